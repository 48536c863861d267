"""``specbatch bench serve`` against a real server on loopback: a bounded load test."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from specbatch.bench.serve_load import run_benchmark, synthetic_prompts
from specbatch.bench.serve_results import percentiles
from specbatch.config import EngineArgs
from specbatch.entrypoints.bench_serve import parse_rates
from specbatch.entrypoints.cli import main
from specbatch.entrypoints.openai_server import build_app

uvicorn = pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def server(make_checkpoint: Callable[..., Path]) -> Iterator[tuple[str, Any]]:
    app = build_app(
        EngineArgs(
            model=str(make_checkpoint("llama", with_tokenizer=True)),
            draft_model=str(make_checkpoint("llama", with_tokenizer=True, seed=1)),
            num_speculative_tokens=3,
            num_kv_blocks=128,
            block_size=16,
            max_model_len=128,
            max_num_seqs=16,
        ),
        max_queue_len=64,
        served_model_name="tiny",
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.engine
    srv.should_exit = True
    thread.join(15)
    sock.close()


def test_parse_rates_and_percentiles() -> None:
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("0", "-1", "fast", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rates(bad)
    p = percentiles([0.001 * i for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["mean"] == pytest.approx(50.5)
    assert p["p99"] == pytest.approx(99.01)
    assert percentiles([])["p90"] is None
    prompts = synthetic_prompts(3, 5, seed=1)
    assert len(prompts) == 3 and all(len(p.split()) == 5 for p in prompts)
    assert len(set(prompts)) == 3  # not one prompt repeated
    assert prompts == synthetic_prompts(3, 5, seed=1) != synthetic_prompts(3, 5, seed=2)


def test_load_no_errors_no_leaks(server: tuple[str, Any]) -> None:
    url, engine = server
    prompts: list[str | list[int]] = list(synthetic_prompts(200, 6, seed=0))
    spec = engine.engine.metrics.spec
    before = (spec.proposed, spec.accepted)
    report = asyncio.run(
        run_benchmark(
            url,
            [50.0, 200.0, math.inf],
            prompts,
            max_tokens=6,
            ignore_eos=True,
            max_concurrency=48,
            seed=0,
        )
    )
    assert report["model"] == "tiny"
    for run in report["runs"]:
        assert run["errors"] == 0, run["error_examples"]
        assert run["completed"] == 200
        assert run["total_output_tokens"] == 200 * 6
        assert run["request_throughput"] > 0 and run["output_throughput"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert run[key]["p50"] is not None and run[key]["p99"] >= run[key]["p50"]
        proposed, accepted = run["draft_tokens_proposed"], run["draft_tokens_accepted"]
        assert proposed > 0 and run["acceptance_rate"] == pytest.approx(accepted / proposed)
        assert run["kv_blocks_used_after"] == 0
    e = engine.engine
    # the runs' counters, read from /metrics before and after each, are the engine's own
    runs = report["runs"]
    assert sum(r["draft_tokens_proposed"] for r in runs) == e.metrics.spec.proposed - before[0]
    assert sum(r["draft_tokens_accepted"] for r in runs) == e.metrics.spec.accepted - before[1]
    assert e.num_free_kv_blocks == e.num_kv_blocks and engine.num_in_flight == 0


def test_cli_writes_table_json_png(
    server: tuple[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = server
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["bench", "serve", "--base-url", url, "--request-rate", "100,inf"]
    argv += ["--num-prompts", "20", "--max-tokens", "4", "--max-concurrency", "8"]
    argv += ["--output-json", str(out_json), "--output-png", str(out_png)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "TTFT" in table and "inf" in table
    report = json.loads(out_json.read_text())
    assert [r["request_rate"] for r in report["runs"]] == [100.0, "inf"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_unreachable_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "2"]
    argv += ["--output-json", str(tmp_path / "x.json"), "--output-png", str(tmp_path / "x.png")]
    assert main(argv) == 2
    assert "error: --base-url" in capsys.readouterr().err
