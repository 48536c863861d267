"""``specbatch bench --shared-prefix-len N``: every prompt starts with the same N tokens, then
its own ``--input-len``; the engine finds the prefix cached."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from specbatch.bench import offline
from specbatch.bench.workload import Workload, with_shared_prefix
from specbatch.entrypoints.cli import main


def test_with_shared_prefix_puts_one_prefix_before_every_prompt() -> None:
    w = Workload([[1, 2], [3, 4]], 2, 5, "two prompts")
    shared = with_shared_prefix(w, [9, 9, 9])
    assert shared.prompts == [[9, 9, 9, 1, 2], [9, 9, 9, 3, 4]] and shared.input_len == 5
    assert "shared prefix of 3 tokens" in shared.source
    assert with_shared_prefix(w, []) is w


def test_bench_with_a_shared_prefix_hits_the_cache(
    make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    engines = []
    make = offline.build_engine

    def keep(cfg, draft, max_seqs):
        engines.append(make(cfg, draft, max_seqs))
        return engines[-1]

    monkeypatch.setattr(offline, "build_engine", keep)
    out = tmp_path / "b"
    argv = ["bench", "--model", str(make_checkpoint("llama", num_layers=1)), "--device", "cpu"]
    argv += ["--batch-sizes", "2", "--draft-lengths", "0", "--num-requests", "4"]
    argv += ["--input-len", "4", "--output-len", "3", "--shared-prefix-len", "40"]
    argv += ["--block-size", "4", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["config"]["shared_prefix_len"] == 40
    assert "shared prefix of 40 tokens" in report["workload_source"]
    (engine,) = engines
    m = engine.metrics
    assert m.prefix_cache_queries > 0 and m.prefix_cache_hits >= 40 * 4  # the measured ones
    assert main([*argv, "--shared-prefix-len", "-1"]) == 2
