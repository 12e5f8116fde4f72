"""A small soak (benchmarks/soak.py): the multi-process DirectRunner against the GCS emulator with GCS and inference
faults on; the count check must hold (requests = images + errors, nothing lost, zero duplicates). CI runs it at 10
requests (the size that fits its time limit); the 120-request run is `pytest -m slow tests/pipeline/test_soak.py`."""

import json
import os
import subprocess
import sys

import pytest

import fault_proxy

from paths import REPO  # noqa: E402


@pytest.mark.parametrize("requests", [pytest.param(10, id="ci"), pytest.param(120, id="slow", marks=pytest.mark.slow)])
def test_small_soak_keeps_the_count(tmp_path, requests):
    out = tmp_path / "soak"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "soak.py"), "--requests", str(requests),
                           "--invalid_every", "8", "--gcs_fault_rate", "0.03", "--inference_fault_rate", "0.1",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    result = json.loads((tmp_path / "soak.json").read_text())
    c = result["checks"]
    assert c["requests"] == requests and c["requests_eq_images_plus_errors"] and c["lost"] == 0
    assert c["duplicates"] == 0 and c["invalid_rows"] == c["invalid_planted"] == requests // 8
    assert fault_proxy.data_path_faults(result["faults"]["gcs"])[2] == []
    assert len(result["memory_per_worker"]) == 2
