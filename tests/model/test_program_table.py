"""model/engine/programs.py: a bucket's compiled set is one table of module-level programs (no closures), in the
order the preflight and the CPU options name them, each traced under its own name (profiles group by it)."""

import inspect

from model.engine import programs
from model.options import PROGRAMS


def test_the_table_is_the_programs_in_order():
    assert tuple(programs.BUCKET_PROGRAMS) == PROGRAMS
    for name, program in programs.BUCKET_PROGRAMS.items():
        assert program.module in ("text_encoder", "transformer", "vae"), name
        assert program.batched_args and 0 not in program.batched_args, name  # the parameters are shared


def test_programs_are_module_level_functions_that_close_over_nothing():
    functions = [p.fn for p in programs.BUCKET_PROGRAMS.values()] + [programs.velocity_at, programs.velocity,
                                                                     programs.denoise_batch]
    for fn in functions:
        assert fn.__closure__ is None and "<locals>" not in fn.__qualname__, fn
        assert inspect.getmodule(fn) is programs and next(iter(inspect.signature(fn).parameters)) == "s", fn


def test_a_traced_program_keeps_its_name_and_takes_its_arguments_after_the_settings():
    def probe(s, *args):
        return s, args

    traced = programs.traced_on_mesh(probe, None)
    assert traced.__name__ == traced.__qualname__ == "probe"
    assert list(inspect.signature(traced).parameters) == ["args"]  # what jit reads: no settings argument


def test_static_arguments_are_dropped_when_the_compiled_program_is_called():
    call = programs.drop_static_args(lambda *a: a, (2, 3))
    assert call("state", "tokens", 4, 5) == ("state", "tokens")
    same = object()
    assert programs.drop_static_args(same, ()) is same
