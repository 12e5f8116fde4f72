"""A disk that fills during a run: one line naming the file, the free space and about how much more the run needs,
exit 1, no temporary folder or lease left; once there is room, `--skip_existing` completes the job. The job runs
into a small tmpfs (needs root: skipped where mounts are not allowed); the line itself is checked everywhere with a
real ENOSPC (a write to /dev/full)."""

import os
import subprocess
import sys

import pytest

from pipeline.disk_full import disk_full_error, disk_full_line
from pipeline_helpers import MODEL_ARGS, ckpt32  # noqa: F401 - ckpt32 is a fixture

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _enospc() -> OSError:
    try:
        with open("/dev/full", "wb", buffering=0) as f:
            f.write(b"x")
    except OSError as e:
        return e
    pytest.skip("no /dev/full here")


def test_a_full_disk_is_recognised_however_beam_passes_it_on(tmp_path):
    error = _enospc()
    assert disk_full_error(error) == (28, None)
    path = str(tmp_path / "out" / "images" / "a.png")
    named = OSError(error.errno, os.strerror(error.errno), path)
    try:
        try:
            raise named
        except OSError as e:  # in-process: Beam raises its own error from the worker's
            raise RuntimeError(f"OSError: {e} [while running 'WriteOutput/WriteImages']") from e
    except RuntimeError as wrapped:
        assert disk_full_error(wrapped) == (28, path)
    # From a worker process only the text comes back.
    text = RuntimeError(f"Traceback ...\nOSError: [Errno 28] No space left on device: '{path}' [while running 'x']")
    assert disk_full_error(text) == (28, path)
    assert disk_full_error(RuntimeError("OSError: [Errno 2] No such file or directory: 'x'")) is None
    images = tmp_path / "out" / "images"
    images.mkdir(parents=True)
    for i in range(4):
        (images / f"{i}.png").write_bytes(b"p" * 1000)
    line = disk_full_line((28, path), str(tmp_path / "out"), 10, started_at=0.0)
    assert line.startswith(f"no space left on the device writing {path} (") and " free)" in line
    assert "about 6.0 KB more are needed for the 6 image(s) still to generate (1.0 KB each)" in line
    assert "the 4 image(s) written are kept" in line and line.endswith("run the same command with --skip_existing "
                                                                         "to resume")
    assert "\n" not in line


@pytest.fixture
def small_disk(tmp_path):
    folder = tmp_path / "small-disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_disk_that_fills_stops_the_run_with_one_line_and_the_resume_completes(ckpt32, tmp_path, small_disk):
    n = 80  # about 5.6 KB each: more than the 256 KB disk holds
    source = tmp_path / "prompts.txt"
    source.write_text("".join(f"prompt number {i}\n" for i in range(n)))
    out = small_disk / "out"
    argv = [sys.executable, "-m", "pipeline.run", f"--model={ckpt32}", f"--input={source}", f"--output={out}",
            *MODEL_ARGS, "--runner=FnApiRunner", "--no_progress"]
    full = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert full.returncode == 1, full.stderr[-3000:]
    lines = full.stderr.strip().splitlines()
    assert len(lines) == 1, full.stderr[-3000:]
    assert lines[0].startswith(f"error: no space left on the device writing {out / 'images'}{os.sep}"), lines[0]
    assert "more are needed for the" in lines[0] and "--skip_existing" in lines[0], lines[0]
    kept = len(os.listdir(out / "images"))
    assert 0 < kept < n
    left = [os.path.join(d, name) for d, dirs, files in os.walk(out) for name in dirs + files
            if name.startswith("beam-temp-") or name.endswith(".tmp") or name == ".flux2-job.lease"]
    assert left == []
    subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True)  # room freed
    from pipeline.run import run

    _, summary = run(argv[3:] + ["--skip_existing"])
    assert (summary["skipped"], summary["images_generated"]) == (kept, n - kept)
    assert len(os.listdir(out / "images")) == n
