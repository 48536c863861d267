"""Shutdown: new requests refused at once, requests in flight finished or, at the timeout,
answered with a 503 (an error event on a stream), then a prompt exit on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from specbatch.config import EngineArgs
from specbatch.engine.prometheus import parse_metrics
from specbatch.entrypoints.openai_server import build_app
from tests.test_server import MODEL, ServerThread, engine_kwargs, wait_for, wait_pool_full

LONG = {"model": MODEL, "prompt": "a long story", "max_tokens": 200, "ignore_eos": True}


def stream_lines(url: str, body: dict[str, Any], out: list[str]) -> None:
    with (
        httpx.Client(timeout=120) as c,
        c.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r,
    ):
        out.extend(ln for ln in r.iter_lines() if ln)


def shutdown_error(lines: list[str]) -> dict[str, Any]:
    assert lines[-1] == "data: [DONE]", lines[-3:]
    err = json.loads(lines[-2][len("data: ") :])["error"]
    assert err["code"] == "server_shutting_down" and err["type"] == "server_error", err
    return err


def test_requests_in_flight_at_the_timeout_get_a_503(make_checkpoint: Callable[..., Path]) -> None:
    target = make_checkpoint("llama", with_tokenizer=True)
    draft = make_checkpoint("llama", with_tokenizer=True, seed=1)
    app = build_app(EngineArgs(**engine_kwargs(target, draft)), served_model_name=MODEL)
    with ServerThread(app) as s:
        engine = s.engine.engine
        real_step, held = engine.step, threading.Event()

        def held_step() -> list[Any]:  # nothing finishes while the test looks
            held.wait(30)
            return real_step()

        streamed: list[str] = []
        whole: list[httpx.Response] = []
        engine.step = held_step  # type: ignore[method-assign]
        threads = [
            threading.Thread(target=stream_lines, args=(s.url, LONG, streamed)),
            threading.Thread(
                target=lambda: whole.append(
                    httpx.post(f"{s.url}/v1/completions", json=LONG, timeout=120)
                )
            ),
        ]
        try:
            for t in threads:
                t.start()
            wait_for(lambda: s.engine.num_in_flight == 2, "two requests in flight")
            s.engine.request_shutdown(0.0)
            late = httpx.post(f"{s.url}/v1/completions", json=LONG, timeout=30)
            assert late.status_code == 503, late.text
            assert late.json()["error"]["code"] == "server_shutting_down"
            for t in threads:
                t.join(60)
        finally:
            held.set()
            engine.step = real_step  # type: ignore[method-assign]
        shutdown_error(streamed)
        assert whole[0].status_code == 503, whole[0].text
        assert whole[0].json()["error"]["code"] == "server_shutting_down"
        wait_pool_full(s.engine)
        m = parse_metrics(httpx.get(f"{s.url}/metrics").text)
        assert m['specbatch:request_success_total{finished_reason="abort"}'] == 2


def test_requests_that_finish_within_the_timeout_are_answered(
    make_checkpoint: Callable[..., Path],
) -> None:
    target = make_checkpoint("llama", with_tokenizer=True)
    app = build_app(EngineArgs(model=str(target), num_kv_blocks=64), served_model_name=MODEL)
    with ServerThread(app) as s:
        engine = s.engine.engine
        real_step, held = engine.step, threading.Event()

        def held_step() -> list[Any]:
            held.wait(30)
            return real_step()

        answers: list[httpx.Response] = []
        body = {**LONG, "max_tokens": 8}
        engine.step = held_step  # type: ignore[method-assign]
        t = threading.Thread(
            target=lambda: answers.append(
                httpx.post(f"{s.url}/v1/completions", json=body, timeout=120)
            )
        )
        try:
            t.start()
            wait_for(lambda: s.engine.num_in_flight == 1, "one request in flight")
            s.engine.request_shutdown(60.0)
            assert httpx.post(f"{s.url}/v1/completions", json=body).status_code == 503
            held.set()
            t.join(60)
        finally:
            held.set()
            engine.step = real_step  # type: ignore[method-assign]
        assert answers[0].status_code == 200, answers[0].text
        assert answers[0].json()["usage"]["completion_tokens"] == 8


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_under_load_aborts_and_exits(make_checkpoint: Callable[..., Path]) -> None:
    """Six long streams, one running at a time, then SIGTERM with --shutdown-timeout 0: the
    streams end with the shutdown error or their finish reason, and the process exits."""
    target = make_checkpoint("llama", with_tokenizer=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "specbatch.entrypoints.cli", "serve", "--model", str(target)]
    cmd += ["--port", str(port), "--max-num-seqs", "1", "--max-model-len", "512"]
    cmd += ["--num-kv-blocks", "64", "--shutdown-timeout", "0", "--served-model-name", MODEL]
    proc = subprocess.Popen(cmd, env=os.environ.copy(), stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: _healthy(url, proc), "the server to start", timeout=180)
        body = {**LONG, "max_tokens": 480}
        streams: list[list[str]] = [[] for _ in range(6)]
        threads = [threading.Thread(target=stream_lines, args=(url, body, s)) for s in streams]
        for t in threads:
            t.start()
        wait_for(lambda: _in_flight(url) == 6, "six requests in flight", timeout=60)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert status == 143, proc.stderr.read() if proc.stderr else status
    aborted = 0
    for lines in streams:
        last = json.loads(lines[-2][len("data: ") :])
        if "error" in last:
            aborted += shutdown_error(lines) is not None
        else:
            assert lines[-1] == "data: [DONE]" and last["choices"][0]["finish_reason"]
    assert aborted >= 5  # the waiting ones at least: none had started


def _healthy(url: str, proc: subprocess.Popen[str]) -> bool:
    assert proc.poll() is None, proc.stderr.read() if proc.stderr else proc.returncode
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _in_flight(url: str) -> float:
    m = parse_metrics(httpx.get(f"{url}/metrics", timeout=5).text)
    return m["specbatch:num_requests_running"] + m["specbatch:num_requests_waiting"]
