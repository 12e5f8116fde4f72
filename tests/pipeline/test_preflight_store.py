"""The preflight's answers kept by content beside the compilation cache (pipeline/preflight_store.py): the key
changes with every field that can change the answer, an entry that is corrupt or was written for another key is
ignored with a warning, `python -m pipeline.preflight --compilation_cache_dir` answers a repeated request from the
store, and Ctrl-C during its compiling ends it at once (status 130) with nothing stored."""

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from paths import REPO as ROOT  # noqa: E402
from pipeline import preflight_store
from pipeline.preflight import PreflightRequest, resolve_model
from pipeline.preflight_store import AnswerStore, answer_fields, answer_key

BASE = PreflightRequest(model="klein-4b", topology="v5e:1x1", height=1024, width=1024, batch_size=None)
ANSWER = {"fits": True, "batch": 2, "model": "klein-4b", "topology": "v5e:1x1", "batch_picked": True,
          "model_shards": 1, "peak_bytes_per_chip": 10 * 2**30, "hbm_bytes_per_chip": 16 * 2**30,
          "est_seconds_per_image": 0.634}


def _fields(request=BASE, model=None):
    return answer_fields(resolve_model(model or request.model), request)


@pytest.mark.parametrize("change", [
    dict(model="klein-9b"),  # another model's configs
    dict(topology="v5e:2x2"), dict(height=768), dict(width=768), dict(num_inference_steps=8),
    dict(guidance_scale=2.5), dict(dtype="float32"), dict(quantize="int8"), dict(model_shards=1),
    dict(max_sequence_length=256), dict(batch_size=2), dict(max_batch_size=4),
    dict(text_encoder_out_layers=(9, 18, 26)),
    dict(reserved_bytes=2**30),  # --score_model's scorer: less of the chip for the generator
    "jax", "jaxlib", "libtpu", "XLA_FLAGS", "LIBTPU_INIT_ARGS", "code",
])
def test_every_field_of_the_key_misses_when_it_changes(change, tmp_path, monkeypatch):
    store = AnswerStore(str(tmp_path))
    base = _fields()
    store.save(base, ANSWER)
    assert store.load(base) == ANSWER
    if isinstance(change, dict):
        fields = _fields(dataclasses.replace(BASE, **change))
    elif change in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"):
        monkeypatch.setenv(change, "--xla_tpu_enable_latency_hiding_scheduler=false")
        fields = _fields()
    elif change == "code":
        monkeypatch.setattr(preflight_store, "code_identity", lambda: "another build")
        fields = _fields()
    else:
        versions = preflight_store.package_versions()
        monkeypatch.setattr(preflight_store, "package_versions", lambda: {**versions, change: "9.9.9"})
        fields = _fields()
    assert answer_key(fields) != answer_key(base)
    assert store.load(fields) is None


def test_the_scorers_reservation_reaches_the_preflight_command():
    """The launch's child preflight gets the bytes kept for the scorer (--reserved_bytes), so that the answer it
    computes and stores is the one for the chip less the scorer; none is passed without a scorer."""
    from pipeline.launch_check import preflight_args
    from pipeline.preflight import parse_args

    args = preflight_args(dataclasses.replace(BASE, reserved_bytes=3 * 2**20), None)
    assert args["reserved_bytes"] == 3 * 2**20
    assert parse_args([f"--{k}={v}" for k, v in args.items() if v is not None]).reserved_bytes == 3 * 2**20
    assert preflight_args(BASE, None)["reserved_bytes"] is None


def test_the_checkpoints_defaults_named_or_left_ask_the_same():
    """Steps and guidance left to the checkpoint (the CLI's default) and named as its defaults (the launch's) are
    one key, and a preset and a checkpoint with the same configs are one model."""
    assert answer_key(_fields(dataclasses.replace(BASE, num_inference_steps=4, guidance_scale=1.0))) == \
        answer_key(_fields())


def test_a_corrupt_or_another_keys_entry_is_ignored_with_a_warning(tmp_path, caplog):
    store = AnswerStore(str(tmp_path))
    fields = _fields()
    path = store.save(fields, ANSWER)
    caplog.set_level(logging.WARNING, logger="pipeline.preflight_store")
    with open(path, "wb") as f:
        f.write(b'{"key": "cut sh')
    assert store.load(fields) is None
    assert "ignoring the stored preflight answer" in caplog.text and "not JSON" in caplog.text
    caplog.clear()
    other = dict(fields, height=768)  # an entry written for another key, under this key's name
    with open(path, "w") as f:
        json.dump({"key": answer_key(fields), "fields": other, "answer": ANSWER}, f)
    assert store.load(fields) is None
    assert "written for another key (differs in: height)" in caplog.text
    caplog.clear()
    with open(path, "w") as f:
        json.dump({"key": answer_key(fields), "fields": fields, "answer": {"batch": 2}}, f)
    assert store.load(fields) is None and "lacks fits or batch" in caplog.text
    store.save(fields, ANSWER)
    assert store.load(fields) == ANSWER and os.listdir(store.folder) == [os.path.basename(path)]
    caplog.clear()
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert AnswerStore(str(blocked)).save(fields, ANSWER) is None  # cannot be written: a warning, not an error
    assert "could not be stored" in caplog.text


# ------------------------------------------------------------------------------------------------ the command line
@pytest.fixture(scope="module")
def libtpu():
    return pytest.importorskip("libtpu", reason="libtpu (the TPU compiler) is not installed: pip install libtpu")


# test_preflight.py's tiny job: in one test session its programs are compiled once (model.preflight.aot._COMPILED)
TINY = dict(topology="v5e:2x2", height=64, width=64, batch_size=2, max_sequence_length=32, model_shards=2)


def _flags(model: str, cache, **overrides) -> list[str]:
    return [f"--{k}={v}" for k, v in {"model": model, **TINY, "compilation_cache_dir": cache, **overrides}.items()]


def test_the_command_answers_a_repeated_request_from_the_store(libtpu, tiny_ckpt, tmp_path, capsys, monkeypatch):
    from pipeline import preflight

    loggers = [logging.getLogger(name) for name in ("pipeline.preflight", "model.preflight.aot")]
    levels = [logger.level for logger in loggers]
    try:
        assert preflight.main(_flags(tiny_ckpt, tmp_path)) == 0
        first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert os.listdir(tmp_path / "preflight-answers")  # beside JAX's own cache entries

        def compiles(*args, **kwargs):
            raise AssertionError("compiled for a stored answer")

        monkeypatch.setattr(preflight, "preflight", compiles)
        assert preflight.main(_flags(tiny_ckpt, tmp_path)) == 0
        out = capsys.readouterr().out.strip().splitlines()
        assert json.loads(out[-1]) == first
        assert out[0].startswith(f"preflight answer stored at {tmp_path}/preflight-answers/") and \
            "(compiled nothing)" in out[0]
        with pytest.raises(AssertionError, match="compiled for a stored answer"):  # another field: compiles again
            preflight.main(_flags(tiny_ckpt, tmp_path, width=32))
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def test_ctrl_c_while_compiling_ends_the_command_at_once_and_stores_nothing(libtpu, tiny_ckpt, tmp_path):
    """A real `python -m pipeline.preflight` process, sent SIGINT as its first program starts compiling: it exits
    with status 130 within seconds (the compiler's thread is not waited for), and no answer, whole or partial, is
    in the store."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    child = subprocess.Popen([sys.executable, "-m", "pipeline.preflight",
                              *_flags(tiny_ckpt, tmp_path, topology="v5e:1x1", model_shards=1, batch_size=1)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in child.stderr:
            seen.append(line)
            if "compiling batch 1 for v5e:1x1: 3 programs at once" in line:
                break
        else:
            pytest.fail("no progress line before the end: " + "".join(seen)[-2000:])
        child.send_signal(signal.SIGINT)
        sent = time.monotonic()
        status = child.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        child.kill()
    rest = child.stderr.read()
    assert status == 130, "".join(seen) + rest
    assert took < 5, took
    assert "interrupted: the preflight stopped; nothing was stored" in rest
    answers = tmp_path / "preflight-answers"
    assert not answers.exists() or not os.listdir(answers)


LAUNCH_CHILD = """
import sys
from pipeline.launch_check import _child_preflight
try:
    _child_preflight(dict(model=sys.argv[1], topology="v5e:1x1", height=64, width=64, batch_size=1,
                          max_sequence_length=32, compilation_cache_dir=sys.argv[2]), {"JAX_PLATFORMS": "cpu"})
except KeyboardInterrupt:
    sys.exit(130)
"""


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process table from /proc")
def test_ctrl_c_at_launch_kills_the_compiling_child(libtpu, tiny_ckpt, tmp_path):
    """The launch shows the child preflight's progress as it comes, and Ctrl-C there kills the child (in its own
    session, so the terminal's signal would not reach it) before the launch goes on up: nothing is left running."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    launch = subprocess.Popen([sys.executable, "-c", LAUNCH_CHILD, tiny_ckpt, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in launch.stdout:
            if line.startswith("TPU preflight: compiling batch 1 for v5e:1x1: 3 programs at once"):
                break
        else:
            pytest.fail("no progress line from the child: " + launch.stderr.read()[-2000:])
        (child,) = _children(launch.pid)
        launch.send_signal(signal.SIGINT)
        assert launch.wait(timeout=30) == 130
    finally:
        launch.kill()
    assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z"
