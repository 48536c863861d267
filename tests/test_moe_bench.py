"""The mixture-of-experts benchmarks run end to end on tiny shapes and write what they print:
``benchmarks/moe_speculation.py`` (a MoE and its dense twin through bench's grid, THEORY's
woken-expert prediction beside each speculative cell) and ``benchmarks/moe_experts.py`` (the
expert-grouped forward against the read floor and transformers' loop)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import moe_experts, moe_speculation


def test_moe_speculation_writes_both_models_cells_with_the_prediction(tmp_path: Path) -> None:
    out = tmp_path / "ms.json"
    argv = ["--batch-sizes", "1", "2", "--hidden", "64", "--layers", "2", "--vocab", "128",
            "--expert-size", "32", "--heads", "2", "--output-len", "6", "--input-len", "8",
            "--num-requests", "4", "--kv-blocks", "128", "--quiet", "--out", str(out)]  # fmt: skip
    assert moe_speculation.main(argv) == 0
    result = json.loads(out.read_text())
    assert set(result["models"]) == {"moe", "dense"}
    for kind, model in result["models"].items():
        spec = [c for c in model["cells"] if c["draft"] != "0"]
        assert [c["batch_size"] for c in spec] == [1, 2]
        for c in spec:
            assert c["measured_speedup"] > 0 and c["predicted_speedup_woken"] is not None
            if kind == "dense":
                assert c["predicted_verify_cost_woken"] == 1.0
            else:
                assert c["predicted_verify_cost_woken"] > 1.0


def test_moe_experts_times_every_row_count(tmp_path: Path) -> None:
    from specbatch.kernels.cpu import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("specbatch's CPU kernels do not build here")
    out = tmp_path / "me.json"
    argv = ["--rows", "1", "8", "--hidden", "32", "--expert-size", "64", "--repeats", "3",
            "--out", str(out)]  # fmt: skip
    assert moe_experts.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["rows"] for r in rows] == [1, 8]
    assert all(r["grouped_s"] > 0 and r["loop_s"] > 0 for r in rows)
    assert rows[0]["woken_experts"] == 2
