"""The prefix cache seen from a server: vLLM's ``prefix_cache_queries`` and ``prefix_cache_hits``
counters on ``/metrics``, and ``bench serve --multi-turn``, whose later turns resend the
conversation so far and find its blocks cached."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from specbatch.bench.serve_load import run_benchmark
from specbatch.config import EngineArgs
from specbatch.engine.prometheus import parse_metrics
from specbatch.entrypoints.cli import main
from specbatch.entrypoints.openai_server import build_app
from tests.test_server import MODEL, ServerThread, engine_kwargs, wait_pool_full


@pytest.fixture(scope="module")
def server(make_checkpoint: Any) -> Iterator[ServerThread]:
    target = make_checkpoint("llama", with_tokenizer=True)
    draft = make_checkpoint("llama", with_tokenizer=True, seed=1)
    args = EngineArgs(**engine_kwargs(target, draft, block_size=4, num_kv_blocks=512))
    with ServerThread(build_app(args, max_queue_len=64, served_model_name=MODEL)) as s:
        yield s


def scrape(server: ServerThread) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{server.url}/metrics").text)


def test_metrics_count_prefix_cache_queries_and_hits(server: ServerThread) -> None:
    before = scrape(server)
    ids = list(range(10, 40))  # 30 tokens: 7 full blocks of 4
    body = {"model": MODEL, "prompt": ids, "max_tokens": 4, "ignore_eos": True}
    for _ in range(2):
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
    after = scrape(server)
    delta = {
        n: after[f"specbatch:prefix_cache_{n}_total"] - before[f"specbatch:prefix_cache_{n}_total"]
        for n in ("queries", "hits")
    }
    assert delta == {"queries": 60, "hits": 28}  # the second request found 7 blocks
    wait_pool_full(server.engine)
    assert scrape(server)["specbatch:kv_blocks_used"] == 0  # cached blocks are not in use


def test_multi_turn_chats_find_their_earlier_turns_cached(server: ServerThread) -> None:
    prompts: list[str | list[int]] = [f"conversation {i} about the sea and ships" for i in range(6)]
    run_all = run_benchmark(
        server.url, [math.inf], prompts, max_tokens=8, ignore_eos=True, max_concurrency=3,
        multi_turn=3,
    )  # fmt: skip
    report = asyncio.run(run_all)
    (run,) = report["runs"]
    assert run["errors"] == 0, run["error_examples"]
    assert run["completed"] == 18 and run["total_output_tokens"] == 18 * 8
    assert [t["completed"] for t in run["turns"]] == [6, 6, 6]
    assert run["prefix_cache_hit_rate"] > 0.5  # turns 2 and 3 resend what turn 1 computed
    assert report["multi_turn"] == 3


def test_cli_multi_turn(server: ServerThread, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "r.json"
    argv = ["bench", "serve", "--base-url", server.url, "--num-prompts", "3", "--multi-turn", "2"]
    argv += ["--max-tokens", "4", "--output-json", str(out)]
    argv += ["--output-png", str(tmp_path / "p.png")]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "turn 2:" in table and "prefix cache hit rate" in table
    assert len(json.loads(out.read_text())["runs"][0]["turns"]) == 2
    assert main([*argv[:-4], "--multi-turn", "0"]) == 2
    assert "error: --multi-turn must be >= 1" in capsys.readouterr().err
