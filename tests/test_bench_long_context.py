"""``specbatch bench long-context`` end to end on a tiny checkpoint: every cell measured, the
report, JSON and PNG written; bad flags named."""

from __future__ import annotations

import json

import pytest

from specbatch.entrypoints.cli import main


def test_long_context_bench_measures_every_cell(tiny_llama_checkpoint, tmp_path, capsys):
    out = tmp_path / "lc"
    args = ["bench", "long-context", "--model", str(tiny_llama_checkpoint), "--context-lens",
            "40", "90", "--batch-sizes", "1", "3", "--output-len", "6", "--window", "16",
            "--sinks", "4", "--dtype", "float32", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    cells = {(c["context"], c["batch"]) for c in result["cells"]}
    assert cells == {(40, 1), (40, 3), (90, 1), (90, 3)}
    for c in result["cells"]:
        assert c["plain_tokens_per_s"] > 0 and c["sparse_tokens_per_s"] > 0
        assert 0.0 <= c["alpha"] <= 1.0 and c["tokens_per_round"] >= 1.0
        assert c["auto_tokens_per_s"] > 0
        assert [len(runs) for runs in c["runs"].values()] == [1, 1, 1]
    assert set(result["crossover"]) == {"40", "90"}
    assert result["meta"]["window"] == 16 and result["meta"]["sinks"] == 4
    assert out.with_suffix(".png").stat().st_size > 0
    assert "crossover batch size" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--context-lens", "0"], "--context-lens: each must be >= 1"),
        (["--output-len", "1"], "--output-len: must be >= 2"),
        (["--window", "0"], "speculative_config.window"),
    ],
)
def test_bad_long_context_flags_are_named(tiny_llama_checkpoint, flags, message, capsys):
    assert main(["bench", "long-context", "--model", str(tiny_llama_checkpoint), *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_offline_bench_takes_a_context_axis(tiny_llama_checkpoint, tmp_path, capsys):
    """``specbatch bench --context-lens``: the same test from the grid's flags (the deepest
    chain of --draft-lengths, self_sparse's window from --speculative-config); c and the verify
    cost reported beside the cost model's step."""
    out = tmp_path / "grid"
    spec = '{"method": "self_sparse", "window": 16, "sinks": 4}'
    args = ["bench", "--model", str(tiny_llama_checkpoint), "--context-lens", "60",
            "--batch-sizes", "2", "--draft-lengths", "0", "2", "--output-len", "6",
            "--speculative-config", spec, "--dtype", "float32", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["meta"]["draft_length"] == 2 and result["meta"]["window"] == 16
    (cell,) = result["cells"]
    assert cell["c"] > 0 and cell["verify_cost"] > 0
    assert cell["model_plain_step_ms"] > 0 and cell["model_sparse_step_ms"] > 0
    assert "verify cost" in capsys.readouterr().out


def test_the_context_axis_drafts_only_with_self_sparse(tiny_llama_checkpoint, capsys):
    args = ["bench", "--model", str(tiny_llama_checkpoint), "--context-lens", "60",
            "--speculative-config", '{"method": "ngram"}']  # fmt: skip
    assert main(args) == 2
    assert "speculative_config.method" in capsys.readouterr().err
