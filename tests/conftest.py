"""Shared pytest fixtures. JAX runs on CPU unless the caller chose a platform.

Test files sit by package (tests/model, tests/transforms, tests/pipeline, tests/templates, tests/benchmarks,
tests/tiny_klein); the helpers they share are modules in tests/support, importable by name from every test.
Checkpoint fixtures build tiny random-weight FLUX.2 [klein] folders (tiny_klein/) once per session. Heavy
imports (torch, diffusers, the model package) happen inside the fixtures, so collecting tests stays cheap.
Add new fixtures in their own section below.
"""

import gc
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA cache for the whole session (subprocesses inherit it): the many generators the suite loads
# compile identical programs, and a cache hit costs milliseconds instead of seconds of compiling.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="flux2-tests-xla-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402


# ---------------------------------------------------------------------------------------------------------------
# Garbage collector
# ---------------------------------------------------------------------------------------------------------------

_FROZEN_AT = {"modules": 0}


@pytest.fixture(autouse=True)
def _gc_skips_imported_modules():
    """Once a test process has imported a few hundred more modules (JAX, Beam, torch, diffusers: some 650k objects
    that live as long as the process), move what is alive then into the collector's permanent generation
    (gc.freeze). Every full collection after that skips them: the model loader's `gc.collect()` (one per load and
    per program set, model/loading/loader.py release_host_memory) costs ~0.5 s in a test process otherwise, about a
    seventh of an in-process test file's time. Objects made later are collected as before; nothing the code does
    changes."""
    if len(sys.modules) - _FROZEN_AT["modules"] >= 200:
        gc.collect()
        gc.freeze()
        _FROZEN_AT["modules"] = len(sys.modules)
    yield


# ---------------------------------------------------------------------------------------------------------------
# Tiny checkpoints
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory):
    """`make(spec=None, **overrides) -> path`: build (once per session and spec) a tiny checkpoint folder.

    `make()` is the default spec; `make(num_layers=2)` or `make(TinySpec(...))` give other configurations.
    """
    from tiny_klein import TinySpec, build_tiny_checkpoint, spec_hash

    built: dict[str, str] = {}

    def make(spec=None, **overrides) -> str:
        spec = spec or TinySpec()
        if overrides:
            import dataclasses

            spec = dataclasses.replace(spec, **overrides)
        key = spec_hash(spec)
        if key not in built:
            root = tmp_path_factory.mktemp(f"tiny-{key}")
            built[key] = build_tiny_checkpoint(str(root / "ckpt"), spec)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_checkpoint_factory) -> str:
    """Distilled klein checkpoint (is_distilled true) at the default TinySpec."""
    return tiny_checkpoint_factory()


@pytest.fixture(scope="session")
def tiny_base_ckpt(tiny_checkpoint_factory) -> str:
    """Base (non-distilled, CFG) klein checkpoint at the default TinySpec."""
    return tiny_checkpoint_factory(distilled=False)


# ---------------------------------------------------------------------------------------------------------------
# Local GCS emulator (tests/support/gcs_emulator.py)
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def gcs_emulator():
    """A real local GCS (gcp-storage-emulator) that google-cloud-storage and Beam reach via STORAGE_EMULATOR_HOST."""
    from gcs_emulator import start_emulator

    emulator = start_emulator()
    yield emulator
    emulator.stop()


@pytest.fixture
def gcs_bucket(gcs_emulator) -> str:
    """A fresh, empty bucket on the emulator (its name, without gs://)."""
    return gcs_emulator.new_bucket()


# ---------------------------------------------------------------------------------------------------------------
# Stand-in Hugging Face Hub (tests/support/hub_server.py)
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stand_in_hub(tiny_ckpt):
    """A local Hub serving `tiny/klein` (the tiny checkpoint; branch main and tag v1 = HUB_COMMITS, plus files the
    pipeline must not fetch) and the gated `tiny/gated`; point huggingface_hub at it with HF_ENDPOINT=.endpoint."""
    from hub_server import HUB_COMMITS, Repo, StandInHub

    extra = {"flux-2-klein-tiny.safetensors": b"a single-file checkpoint the pipeline does not read",
             "README.md": b"# tiny", "transformer/diffusion_pytorch_model.fp16.safetensors": b"another variant",
             "vae/diffusion_pytorch_model.bin": b"pickle weights beside the safetensors"}
    hub = StandInHub({"tiny/klein": Repo(tiny_ckpt, revisions=HUB_COMMITS, extra=extra),
                      "tiny/gated": Repo(tiny_ckpt, revisions={"main": "3" * 40}, gated=True)})
    yield hub
    hub.stop()
