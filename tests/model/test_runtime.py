"""The worker's accelerator-runtime settings: chosen only where the user named none, and in the environment before
the runtime starts (in a job's model load too, where nothing starts it before the load unless the job requires an
accelerator)."""

import os

from model.engine import runtime

ENV = runtime.PREMAPPED_BUFFER_ENV


def _unset(monkeypatch):
    monkeypatch.setenv(ENV, "placeholder")
    monkeypatch.delenv(ENV)  # absent again after the test, whatever the code under test set


def test_premapped_buffer_default_only_where_unset():
    env = {}
    assert runtime.apply_runtime_defaults(env) == {ENV: "1073741824"} and env == {ENV: "1073741824"}
    mine = {ENV: "2147483648"}
    assert runtime.apply_runtime_defaults(mine) == {} and mine == {ENV: "2147483648"}


def test_start_runtime_sets_the_defaults_before_it_starts(monkeypatch):
    _unset(monkeypatch)
    seen = []
    monkeypatch.setattr(runtime.jax, "devices", lambda: seen.append(os.environ.get(ENV)))
    assert runtime.start_runtime().result() >= 0
    assert seen == ["1073741824"]


def test_the_handlers_load_sets_them_first_and_keeps_the_users(monkeypatch, tmp_path):
    """Without --require_accelerator the handler asks for the devices only after model.load (which starts the
    runtime beside its preparations); with it, before, as the fail-fast check must."""
    import model
    from transforms import inference

    _unset(monkeypatch)
    calls = []
    monkeypatch.setattr(inference, "check_accelerator", lambda required: calls.append(("devices", required)))
    monkeypatch.setattr(model, "load", lambda settings: calls.append(("load", os.environ.get(ENV))) or object())
    try:
        inference.Flux2KleinModelHandler(str(tmp_path), dtype="float32").load_model()
        assert calls == [("load", "1073741824"), ("devices", None)]
        calls.clear()
        monkeypatch.setenv(ENV, "2147483648")  # the user's, e.g. through --worker_env
        inference.Flux2KleinModelHandler(str(tmp_path), dtype="float32", require_accelerator="tpu").load_model()
        assert calls == [("devices", "tpu"), ("load", "2147483648")]
    finally:
        inference.discard_pending_model_loads()


def test_a_new_compilation_cache_folder_takes_effect_after_another_was_opened(tmp_path):
    """JAX opens its persistent cache once per process: pointing it elsewhere later (the launcher's preflight into
    the job's shared cache, a second load with another --compilation_cache_dir) must still write there."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.compilation_cache import compilation_cache

    from model.engine.programs import enable_compilation_cache

    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    saved = {k: getattr(jax.config, k) for k in keys}
    first, second = tmp_path / "first", tmp_path / "second"
    try:
        enable_compilation_cache(str(first))
        jax.jit(lambda x: x * 3.0 + 1.0).lower(jnp.ones(7)).compile()
        assert os.listdir(first), "the first folder received nothing"
        enable_compilation_cache(str(second))
        jax.jit(lambda x: x * 5.0 - 2.0).lower(jnp.ones(11)).compile()
        assert second.is_dir() and os.listdir(second), "the second folder received nothing: the first stayed open"
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()
