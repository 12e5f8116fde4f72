"""Programs compiled from shapes while the weights load (LoadSettings.precompile) are the ones the loaded generator
runs: nothing compiles again on the first call, and the images are those of a generator that compiled afterwards."""

import logging

import numpy as np
import pytest

import model
import model.generator as generator_lib
from model.options import EngineOptions, LoadSettings

ARGS = dict(prompts=["a red fox", "a kite"], seeds=[3, 4], height=32, width=48)


def _settings(ckpt, precompile=()):
    return LoadSettings(model=ckpt, dtype="float32", max_sequence_length=16, engine=EngineOptions(batch_size=2),
                        precompile=precompile)


def test_precompiled_programs_are_adopted_and_give_the_same_images(tiny_ckpt, monkeypatch, caplog):
    plain = model.load(_settings(tiny_ckpt, precompile=((32, 48),)))
    assert plain.programs.compile_count == 0, "precompiling is for accelerators: off on a CPU by default"
    want = plain.generate(**ARGS)
    monkeypatch.setattr(generator_lib, "PRECOMPILE_PLATFORMS", ("cpu", "tpu", "gpu"))  # on CPU too, for the test
    with caplog.at_level(logging.WARNING, logger="model.generator"):
        # 33 is not a multiple of the size step: skipped with a warning, the load goes on
        gen = model.load(_settings(tiny_ckpt, precompile=((32, 48), (33, 48, None, None))))
    assert any("not precompiling 33x48" in r.getMessage() for r in caplog.records), caplog.text
    compiled = gen.programs.compile_count
    assert compiled > 0, "nothing was compiled while loading"
    got = gen.generate(**ARGS)
    assert gen.programs.compile_count == compiled, "the first call compiled again"
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bad", [((32,),), ((0, 48),), ((32, 48, 4, 1.0, 9),), ("32x48",)])
def test_bad_precompile_shapes_are_refused(bad):
    with pytest.raises(ValueError, match="precompile"):
        LoadSettings(model="x", precompile=bad)


@pytest.mark.parametrize("precompile_on", [True, False], ids=["precompiling", "not-precompiling"])
def test_loading_beside_a_precompile_switches_the_gil_finely_then_restores_it(tiny_ckpt, monkeypatch, precompile_on):
    """While a precompile traces the model beside the loading threads, the GIL switch interval is
    LOADING_SWITCH_INTERVAL_S (a loading thread waits at most that for the tracer); the process's own interval is
    back once the weights are placed; a load without a precompile leaves it alone."""
    import sys

    seen = []
    real = generator_lib.load_components

    def spying(components, **kwargs):
        seen.extend(sys.getswitchinterval() for _ in components)
        return real(components, **kwargs)

    monkeypatch.setattr(generator_lib, "load_components", spying)
    if precompile_on:
        monkeypatch.setattr(generator_lib, "PRECOMPILE_PLATFORMS", ("cpu", "tpu", "gpu"))
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.004)
        gen = model.load(_settings(tiny_ckpt, precompile=((32, 48),)))
        after = sys.getswitchinterval()
    finally:
        sys.setswitchinterval(before)
    assert len(seen) == 3  # text encoder, transformer, VAE
    want = generator_lib.LOADING_SWITCH_INTERVAL_S if precompile_on else 0.004
    assert all(abs(v - want) < 1e-9 for v in seen), seen
    assert abs(after - 0.004) < 1e-9, after
    assert (gen.programs.compile_count > 0) == precompile_on
