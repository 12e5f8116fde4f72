"""The TPU suite: runs on a TPU chip in one process, skipped with a reason everywhere else (CI has no accelerator).

    JAX_PLATFORMS=tpu,cpu python -m pytest -q -m tpu tests/tpu

Tiny checkpoints come from tests/conftest.py's factory (torch and diffusers needed), or, on a TPU VM with only the
runtime, from FLUX2_TEST_CHECKPOINTS (built elsewhere with `python -m tiny_klein DIR`). The real-size test builds
klein-4B's random-weight checkpoint once under the project's cache folder (13 GB, FLUX2_KLEIN_CACHE).
"""

import os

import pytest


def _backend() -> str:
    try:
        import jax

        return jax.default_backend()
    except Exception as e:  # noqa: BLE001 - any failure to start a backend means: no chip here
        return f"none ({e})"


def pytest_collection_modifyitems(config, items):
    backend = None
    for item in items:
        if "tests/tpu/" not in str(item.fspath).replace(os.sep, "/"):
            continue
        item.add_marker(pytest.mark.tpu)
        backend = backend or _backend()
        if backend != "tpu":
            item.add_marker(pytest.mark.skip(reason=f"needs a TPU chip: JAX's backend here is {backend!r} "
                                                    f"(run with JAX_PLATFORMS=tpu,cpu on a TPU VM)"))


@pytest.fixture(scope="session")
def chip_checkpoint(tiny_checkpoint_factory):
    """`make(**TinySpec overrides) -> path`: a prebuilt copy from FLUX2_TEST_CHECKPOINTS when there is one."""
    import dataclasses

    from tiny_klein import TinySpec, spec_hash

    def make(**overrides):
        spec = dataclasses.replace(TinySpec(), **overrides)
        prebuilt = os.path.join(os.environ.get("FLUX2_TEST_CHECKPOINTS", "/nonexistent"), f"tiny-{spec_hash(spec)}")
        if os.path.isfile(os.path.join(prebuilt, "model_index.json")):
            return prebuilt
        return tiny_checkpoint_factory(spec)

    return make
