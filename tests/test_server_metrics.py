"""``/metrics``: vLLM's names under the ``specbatch:`` prefix, one registry per server, and
queue gauges that count requests (an ``n > 1`` request once)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from specbatch.config import EngineArgs
from specbatch.engine.prometheus import parse_metrics
from specbatch.entrypoints.openai_server import build_app
from tests.test_server import MODEL, ServerThread, engine_kwargs, wait_for, wait_pool_full

# one worker runs the module's tests in order (pytest-xdist): they share one server, and
# test_two_servers_in_one_process_keep_their_own_counts reads what the first test counted
pytestmark = pytest.mark.xdist_group("server_metrics")

VLLM_NAMES = (  # vLLM's metrics (vllm:NAME) that a dashboard reads, by the same name here
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prompt_tokens_total",
    "generation_tokens_total",
    "num_preemptions_total",
    "time_to_first_token_seconds_count",
    "time_per_output_token_seconds_count",
    "e2e_request_latency_seconds_count",
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
    'spec_decode_num_accepted_tokens_per_pos_total{position="0"}',
    'request_success_total{finished_reason="length"}',
)
OWN_NAMES = (  # specbatch's own
    "healthy",
    "kv_blocks_total",
    "kv_blocks_used",
    "num_completions_running",
    "num_completions_waiting",
    "engine_steps_total",
    "spec_decode_num_rejections_total",
    "spec_decode_num_emitted_tokens_total",
    "spec_decode_draft_acceptance_rate",
    "spec_decode_alpha",
)


@pytest.fixture(scope="module")
def models(make_checkpoint: Any) -> tuple[Path, Path]:
    return (
        make_checkpoint("llama", with_tokenizer=True),
        make_checkpoint("llama", with_tokenizer=True, seed=1),
    )


@pytest.fixture(scope="module")
def server(models: tuple[Path, Path]) -> Iterator[ServerThread]:
    args = EngineArgs(**engine_kwargs(*models, max_num_seqs=1))
    with ServerThread(build_app(args, max_queue_len=8, served_model_name=MODEL)) as s:
        yield s


def scrape(server: ServerThread) -> dict[str, float]:
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse_metrics(r.text)


def test_the_page_has_vllms_names_and_labels(server: ServerThread) -> None:
    body = {"model": MODEL, "prompt": "metrics please", "max_tokens": 12, "ignore_eos": True}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
    assert httpx.post(f"{server.url}/v1/completions", json={}, timeout=30).status_code == 400
    m = scrape(server)
    for name in VLLM_NAMES + OWN_NAMES:
        assert f"specbatch:{name}" in m, name
    assert m["specbatch:spec_decode_num_draft_tokens_total"] > 0
    assert m["specbatch:generation_tokens_total"] >= 12
    assert m['specbatch:request_success_total{finished_reason="length"}'] >= 1
    assert m['specbatch:http_errors_total{status="400"}'] >= 1
    assert m['specbatch:time_to_first_token_seconds_bucket{le="+Inf"}'] >= 1
    accepted = m["specbatch:spec_decode_num_accepted_tokens_total"]
    per_pos = sum(
        v for k, v in m.items() if k.startswith("specbatch:spec_decode_num_accepted_tokens_per_pos")
    )
    assert per_pos == accepted
    assert m["specbatch:kv_cache_usage_perc"] == 0 == m["specbatch:kv_blocks_used"]
    text = httpx.get(f"{server.url}/metrics").text
    assert f'specbatch:num_requests_running{{model_name="{MODEL}"}}' in text


def test_two_servers_in_one_process_keep_their_own_counts(
    server: ServerThread, models: tuple[Path, Path]
) -> None:
    app = build_app(EngineArgs(**engine_kwargs(*models)), served_model_name="other")
    with ServerThread(app) as other:
        fresh = scrape(other)
        assert fresh['specbatch:request_success_total{finished_reason="length"}'] == 0
        assert fresh["specbatch:time_to_first_token_seconds_count"] == 0
        assert 'model_name="other"' in httpx.get(f"{other.url}/metrics").text
    assert scrape(server)["specbatch:time_to_first_token_seconds_count"] >= 1


def test_waiting_counts_requests_not_their_completions(server: ServerThread) -> None:
    """One request runs (max_num_seqs 1) while two more of n = 4 wait: 2 requests waiting,
    whatever number of their completions wait."""
    engine = server.engine.engine
    real_step, permits = engine.step, threading.Semaphore(0)

    def gated_step() -> list[Any]:
        assert permits.acquire(timeout=30), "the test never let the step run"
        return real_step()

    body = {"model": MODEL, "prompt": "a b c", "max_tokens": 4, "n": 4, "ignore_eos": True}
    answers: list[httpx.Response] = []

    def post() -> None:
        answers.append(httpx.post(f"{server.url}/v1/completions", json=body, timeout=60))

    engine.step = gated_step  # type: ignore[method-assign]
    threads = [threading.Thread(target=post) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: server.engine.num_in_flight == 3, "three requests in flight")
        permits.release()  # one step: one completion runs, the rest wait
        wait_for(
            lambda: len(engine.scheduler.requests) == 12 and engine.scheduler.num_running == 1,
            "one completion running, eleven queued",
        )
        m = scrape(server)
        assert m["specbatch:num_requests_running"] == 1
        assert m["specbatch:num_requests_waiting"] == 2
        assert m["specbatch:num_completions_running"] == 1
        assert m["specbatch:num_completions_waiting"] == 11
    finally:
        engine.step = real_step  # type: ignore[method-assign]
        permits.release(1000)
        for t in threads:
            t.join(60)
    assert [a.status_code for a in answers] == [200, 200, 200]
    wait_pool_full(server.engine)
    m = scrape(server)
    assert m["specbatch:num_requests_waiting"] == 0 == m["specbatch:num_requests_running"]
