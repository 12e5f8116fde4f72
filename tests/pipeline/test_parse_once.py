"""pipeline/run.py parses the command line once: one check against every option of the job and of Beam, one options
object, which the run, the exit status (--allow_empty) and the interrupt line all read."""

import logging
import signal

import pytest

from pipeline import interrupts, launch, run as run_module


@pytest.fixture
def counted(monkeypatch):
    calls = {"checked": 0, "options": 0}
    real_check, real_options = run_module.check_arguments, launch.pipeline_options

    def check(argv):
        calls["checked"] += 1
        return real_check(argv)

    def options(argv):
        calls["options"] += 1
        return real_options(argv)

    monkeypatch.setattr(run_module, "check_arguments", check)
    monkeypatch.setattr(launch, "pipeline_options", options)
    return calls


def test_a_run_and_its_exit_status_read_one_parse(counted, monkeypatch, capsys):
    seen = []

    def run_options(options, *, wait=None):
        seen.append(options)
        return None, {"records_read": 0}

    monkeypatch.setattr(run_module, "run_options", run_options)
    assert run_module.main(["--output=elsewhere", "--seed=3"]) == 1  # no record read: a run that is not a success
    assert "no record" in capsys.readouterr().err
    assert counted == {"checked": 1, "options": 1}
    assert run_module.main(["--allow_empty", "--seed=3"]) == 0  # the same options object says --allow_empty
    assert counted == {"checked": 2, "options": 2} and len(seen) == 2


def test_the_interrupt_line_reads_the_parsed_output(counted, monkeypatch, tmp_path, capsys):
    def interrupted(options, *, wait=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "run_options", interrupted)
    monkeypatch.setattr(interrupts, "interrupting_signal", lambda e: signal.SIGINT)
    monkeypatch.setattr(interrupts.STATE, "stopping", False)
    monkeypatch.setattr(logging, "disable", lambda level: None)  # the line's quieting of Beam's threads: not here
    out = tmp_path / "out"
    assert run_module.main([f"--output={out}"]) == 130
    assert f"0 image(s) written under {out}" in capsys.readouterr().err
    assert counted == {"checked": 1, "options": 1}
