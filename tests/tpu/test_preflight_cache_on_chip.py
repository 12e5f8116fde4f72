"""One compile for the launch's check and the job: on a TPU machine the preflight compiles on the chips (as the launch
does when libtpu here does not compile for a named topology) into the job's compilation cache, and the job's first
compile of the same batch and size finds its three programs there: it writes no new encode, denoise or decode entry
(a program that missed would be compiled and written under its own key)."""

import os

PROGRAMS = ("jit_encode-", "jit_denoise-", "jit_decode-")


def _entries(cache: str) -> set:
    return {name for name in os.listdir(cache) if name.startswith(PROGRAMS)}


def test_the_jobs_first_compile_finds_the_preflights_programs(chip_checkpoint, tmp_path):
    import jax

    import model
    from pipeline.preflight import PreflightRequest, preflight

    ckpt, cache = chip_checkpoint(), str(tmp_path / "xla")
    model.enable_compilation_cache(cache)
    report = preflight(PreflightRequest(model=ckpt, topology="attached", height=64, width=64, batch_size=2,
                                        max_sequence_length=32))
    assert report.fits
    compiled = _entries(cache)
    assert len(compiled) == 3, compiled
    jax.clear_caches()  # nothing of the preflight's compiles in memory: the job's must come from the cache
    gen = model.load(ckpt, "bfloat16", max_sequence_length=32, batch_size=2, compilation_cache_dir=cache)
    gen.generate(["a red fox"], [0], height=64, width=64)
    assert _entries(cache) == compiled, f"the job compiled programs the preflight had not: {_entries(cache) - compiled}"
