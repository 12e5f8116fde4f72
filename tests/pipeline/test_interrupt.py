"""Ctrl-C (SIGINT) or SIGTERM mid-run: one line saying what was written and how to resume, exit 130 / 143, no
beam-temp-* folder left behind, the output's lease released; the resume with --skip_existing completes the job.
A real signal, a real job."""

import os
import signal
import subprocess
import sys
import time

import pytest

from pipeline_helpers import MODEL_ARGS, ckpt32  # noqa: F401 - ckpt32 is a fixture

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 300


def _leftovers(out):
    return [os.path.join(d, n) for d, dirs, _ in os.walk(out) for n in dirs if n.startswith("beam-temp-")]


@pytest.mark.parametrize("signum,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_job_with_one_line_and_a_resume_finishes_it(ckpt32, tmp_path, signum, status):
    source = tmp_path / "prompts.txt"
    source.write_text("".join(f"prompt number {i}\n" for i in range(N)))
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "pipeline.run", f"--model={ckpt32}", f"--input={source}", f"--output={out}",
            *MODEL_ARGS, "--runner=FnApiRunner", "--no_progress"]
    job = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and job.poll() is None:
        if os.path.isdir(out / "images") and len(os.listdir(out / "images")) >= 4:
            break
        time.sleep(0.2)
    assert job.poll() is None, "the job ended before it could be interrupted"
    job.send_signal(signum)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == status, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted (") and "image(s) written under" in last and "--skip_existing" in last, last
    assert not _leftovers(out), _leftovers(out)
    assert not os.path.exists(out / ".flux2-job.lease")  # the output's lease is released: a resume may start now
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    if signum != signal.SIGINT:  # the resume is the same after either signal: run once (CI time)
        return
    resumed = subprocess.run(argv + ["--skip_existing"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert len(os.listdir(out / "images")) == N and not _leftovers(out)
