"""Ctrl-C (SIGINT) or SIGTERM mid-run: one line saying what was written and how to resume, exit 130 / 143, no
beam-temp-* folder left behind, the output's lease released; the resume with --skip_existing completes the job.
A real signal, a real job."""

import os
import signal
import subprocess
import sys
import time

import pytest

from pipeline_helpers import MODEL_ARGS, ckpt32, wait_for_images  # noqa: F401 - ckpt32 is a fixture

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
    wait_for_images(job, out, 4)
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


# Moments of the 20 interrupts, as (images written first, then seconds): 0 images and a delay from the start (the
# modules importing, the launch's checks, the model's load and compile: whichever this machine has reached), or
# once the first image is written, a delay into the generating.
MOMENTS = [(0, 0.2), (0, 0.7), (0, 1.5), (0, 2.5), (0, 3.5), (0, 4.5), (0, 5.5), (0, 6.5), (0, 8.0), (0, 10.0),
           (0, 12.0), (0, 14.0), (1, 0.0), (1, 0.1), (1, 0.3), (1, 0.5), (1, 0.8), (1, 1.2), (1, 1.7), (1, 2.5)]
PROMPTS = 3000  # far more than a run generates before its signal: every job is still running when interrupted


def _interpreter_start_s() -> float:
    """How long this machine's Python takes to start and reach the job's first statement (the interrupt handler's
    import): a Ctrl-C before that is the interpreter's own (a KeyboardInterrupt traceback in any Python program)."""
    started = time.time()
    subprocess.run([sys.executable, "-c", "import pipeline.interrupts"], cwd=ROOT, check=True)
    return time.time() - started


def _interrupt_at(argv, out, moment, start_s: float = 0.0) -> tuple[object, int | str, str]:
    """Start the job, wait for `moment` (see MOMENTS; a moment of 0 images counts from `start_s`, the interpreter's
    start-up), send SIGINT; (moment, exit status, stderr)."""
    job = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    images, delay = moment
    if not images:
        delay += start_s
    if images:
        wait_for_images(job, out, images, timeout_s=240, poll_s=0.05)
    time.sleep(delay)
    running = job.poll() is None
    job.send_signal(signal.SIGINT)
    _, stderr = job.communicate(timeout=120)
    return moment, job.returncode if running else f"ended before the signal ({job.returncode})", stderr


def test_ctrl_c_at_any_moment_exits_130_with_the_line_and_never_aborts(ckpt32, tmp_path):
    """Twenty Ctrl-Cs at moments spread over the whole run (importing, launching, loading and compiling the model,
    generating), two jobs at a time: each exits 130 with the one `interrupted (SIGINT)` line, no traceback, no
    'Exception ignored', no abort of the runtime (`Check failed: PyGILState_Check()`, exit 134)."""
    import concurrent.futures

    source = tmp_path / "prompts.txt"
    source.write_text("".join(f"prompt number {i}\n" for i in range(PROMPTS)))

    start_s = _interpreter_start_s()

    def one(i):
        out = tmp_path / f"out{i}"
        argv = [sys.executable, "-m", "pipeline.run", f"--model={ckpt32}", f"--input={source}", f"--output={out}",
                *MODEL_ARGS, "--runner=FnApiRunner", *(["--no_progress"] if i % 2 else [])]
        return _interrupt_at(argv, out, MOMENTS[i], start_s)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(one, range(len(MOMENTS))))
    bad = []
    for moment, status, stderr in runs:
        lines = stderr.strip().splitlines()
        last = lines[-1] if lines else ""
        found = [w for w in ("Check failed", "Traceback", "Exception ignored", "FATAL", "core dumped") if w in stderr]
        if status != 130 or not last.startswith("interrupted (SIGINT)") or found:
            bad.append((moment, status, found, last[:200]))
    assert not bad, "\n".join(map(repr, bad))


def test_an_interrupt_raised_where_python_ignores_it_is_raised_again():
    """A signal handler may run inside a __del__ or a garbage collector callback (JAX registers one), where Python
    only prints 'Exception ignored' and goes on: the job then ran to its end. The interrupt is handed back to the
    main thread, and nothing is printed for it."""
    import io
    import logging

    from pipeline import interrupts

    class RaisesInItsDel:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)  # the handler runs at the next bytecode: inside __del__
            for _ in range(100):
                pass

    previous = interrupts.install()
    stderr, sys.stderr = sys.stderr, io.StringIO()
    try:
        with pytest.raises(KeyboardInterrupt):
            RaisesInItsDel()
            for _ in range(10 ** 7):  # the interrupt, raised again, lands here
                pass
        printed = sys.stderr.getvalue()
    finally:
        sys.stderr = stderr
        interrupts.STATE.stopping = True  # the re-delivery thread stops
        interrupts.restore(previous)
        logging.disable(logging.NOTSET)
    assert interrupts.STATE.received == signal.SIGINT and "Exception ignored" not in printed, printed


def test_main_in_process_puts_the_signal_handlers_back(tmp_path, capsys):
    from pipeline.run import main

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.unraisablehook
    assert main(["--model=/no/such/checkpoint", f"--input={tmp_path}/p.txt", f"--output={tmp_path}/out"]) == 2
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.unraisablehook) == before


def test_an_earlier_runs_redelivery_never_interrupts_the_next_run():
    """main() called again in the same process (a test, a notebook): the re-delivery thread of an interrupted run
    ends with it, and never raises its interrupt in the next run."""
    import time

    from pipeline import interrupts

    previous = interrupts.install()
    try:
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
            for _ in range(10 ** 7):
                pass
    finally:
        interrupts.STATE.stopping = True
        interrupts.restore(previous)
    previous = interrupts.install()  # the next run, at once
    try:
        time.sleep(interrupts.REDELIVER_S * 2)  # an old re-delivery thread would interrupt this sleep
    finally:
        interrupts.STATE.stopping = True
        interrupts.restore(previous)
    assert interrupts.STATE.received is None
