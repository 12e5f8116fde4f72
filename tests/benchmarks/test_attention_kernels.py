"""benchmarks.attention_kernels runs here (Pallas interpret mode off TPU): splash and the flash kernel per block pair,
within bf16 rounding of each other and of the float32 reference."""

from __future__ import annotations


def test_attention_kernels_small_runs_here(capsys):
    import json

    from benchmarks.attention_kernels import main

    result = main(["--small"])
    assert result["shape"] == [1, 2, 512, 128] and result["interpret"]
    # key blocks of 256 (two per head, four 128-key slices in all) and of 512 (every key in one block)
    assert [r["blocks"] for r in result["rows"]] == [[512, 256, 128], [512, 512, 128]]
    for row in [result["splash"], *result["rows"]]:
        assert "error" not in row and row["ms"] > 0, row
        assert row["max_diff_splash"] <= 4e-3 and row["max_diff_f32"] <= 4e-3, row
    assert result["best"] in result["rows"] and result["speedup_over_splash"] > 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result  # the JSON line comes last
