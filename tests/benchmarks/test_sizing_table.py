"""The README's TPU sizing table is made from the preflight's reports (benchmarks/sizing_table.py over
benchmarks/sizing_1024.json), never typed: the README holds exactly the generated table between its markers."""

import json
import os

import pytest

from benchmarks import sizing_table
from paths import REPO


def _data() -> dict:
    with open(sizing_table.SIZING_JSON, encoding="utf-8") as f:
        return json.load(f)


def test_the_readme_table_is_the_generated_one():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        found = sizing_table.readme_table(f.read())
    if found is None:
        pytest.skip(f"README.md has no sizing table yet: put `python -m benchmarks.sizing_table`'s output there (it "
                    f"starts with {sizing_table.SIZING_BEGIN} and ends with {sizing_table.SIZING_END})")
    assert found == sizing_table.table(_data()), "README.md's sizing table is stale: paste python -m " \
                                                 "benchmarks.sizing_table"


def test_every_row_is_a_preflight_report_with_its_compiler():
    rows = _data()["rows"]
    assert rows and all(row["compiled_on"] and "libtpu" in row["compiled_on"] for row in rows)
    lines = sizing_table.table(_data()).splitlines()
    assert lines[0] == sizing_table.SIZING_BEGIN and lines[-1] == sizing_table.SIZING_END
    assert len(lines) == len(rows) + 4  # markers, header, rule
    for row, line in zip(rows, lines[3:-1]):
        r = row["report"]
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == r["model"] and cells[1] == f"{r['chip'].replace('TPU ', '')} ({r['chips']})"
        assert cells[4] == f"{r['peak_bytes_per_chip'] / 2**30:.1f} of {r['hbm_bytes_per_chip'] / 2**30:.0f}"
        if not r["fits"]:
            assert cells[5] == "does not fit"
            continue
        measured = row.get("measured_s_per_image")
        seconds = measured or (sizing_table.estimate(r) if "programs" in r else r["est_seconds_per_image"])
        assert cells[5] == f"{seconds:.3f}" and cells[7] == ("measured (v5e)" if measured else "estimated")
        price = sizing_table.PRICES.get(r["chip"])
        assert cells[6] == (f"{1000 * seconds * r['chips'] * price / 3600:.2f}" if price else "-")


def test_estimates_follow_the_current_calibration():
    """A row with the compiled figures is priced by today's calibration: its stored estimate (made when it was
    compiled) is not what the table shows once the calibration moved, the recomputed one is."""
    rows = [row for row in _data()["rows"] if "programs" in row["report"] and row["report"]["fits"]]
    assert rows
    for row in rows:
        seconds = sizing_table.estimate(row["report"])
        assert 0.05 < seconds < 2.0, seconds
    int8 = next(row for row in rows if row["report"].get("quantize") == "int8")
    bf16 = next(row for row in rows if row["report"]["topology"] == "v5e:1x1" and row["report"].get("quantize") != "int8")
    assert sizing_table.estimate(int8["report"]) < 0.8 * sizing_table.estimate(bf16["report"])


def test_a_preflight_run_becomes_a_row(tmp_path, capsys):
    """`--add` reads the report (the last JSON line of the preflight's output) and puts it in the JSON, in place of
    the row of the same model, topology, size and batch choice; the table shows it, an auto batch marked so."""
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(_data()))
    reports = [r["report"] for r in _data()["rows"]]
    autos = {(r["model"], r["topology"], r.get("quantize", "none")) for r in reports if r.get("batch_picked")}
    fixed = next(r for r in reports if r["fits"] and not r.get("batch_picked")
                 and (r["model"], r["topology"], r.get("quantize", "none")) not in autos)  # its auto row is new
    report = dict(fixed, batch_picked=True, peak_bytes_per_chip=15 * 2**30, est_seconds_per_image=0.5)
    out = tmp_path / "preflight.out"
    out.write_text("klein-4b on v5e:1x1 ...\nfits: yes\n" + json.dumps(report) + "\n")
    assert sizing_table.main(["--json", str(path), "--add", str(out), "--compiled-on", "a test, libtpu x"]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == len(_data()["rows"]) + 1 and rows[-1]["report"] == report  # auto: not the batch-1 row
    hbm = report["hbm_bytes_per_chip"] / 2**30
    seconds = sizing_table.estimate(report)
    assert (f"| {report['batch']} (auto) | 15.0 of {hbm:.0f} | {seconds:.3f} |") in capsys.readouterr().out
    assert sizing_table.main(["--json", str(path), "--add", str(out), "--compiled-on", "again, libtpu y"]) == 0
    again = json.loads(path.read_text())["rows"]
    assert len(again) == len(rows) and again[-1]["compiled_on"] == "again, libtpu y"  # replaced, not added


@pytest.mark.parametrize("batch, devices, quantize", [(1, 1, "none"), (2, 1, "int8"), (4, 4, "none"), (8, 4, "int8")])
def test_a_reports_estimate_is_the_preflights_own(batch, devices, quantize):
    """Recomputed from a report's JSON (per-image figures), the estimate equals the one the preflight made from the
    compiled programs (per device, per batch): FLOPs, kernel FLOPs and bytes all scale back by batch / devices."""
    import types

    from model import CHIPS, ProgramStats, Report

    figures = [("encode", 2.8e12, 7.2e10, 4.0e11), ("denoise", 1.1e14, 2.6e13, 1.5e11), ("decode", 9.3e12, 0.0, 2.5e12)]
    programs = {name: ProgramStats(name, 10, 5, 1, 0, 10, flops, nbytes, -1.0, kernel, 1.0, 1 if kernel else 0, 1)
                for name, flops, kernel, nbytes in figures}
    topology = types.SimpleNamespace(devices=tuple(object() for _ in range(devices)), devices_per_chip=1,
                                     chip=CHIPS["TPU v5 lite"], name=f"v5e:{devices}", chips=devices, hosts=1)
    report = Report(model="klein-4b", topology=topology, dtype="bfloat16", height=1024, width=1024, batch=batch,
                    steps=4, cfg=False, model_shards=1, attention="splash", parameter_bytes={"transformer": 1},
                    programs=programs, hbm_bytes_per_chip=16 * 2**30, quantize=quantize)
    assert sizing_table.estimate(report.to_json()) == pytest.approx(report.est_seconds_per_image, rel=1e-9)
