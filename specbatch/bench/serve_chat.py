"""The multi-turn chat workload of ``specbatch bench serve --multi-turn T``: conversations of T
user turns through ``/v1/chat/completions``, streamed, each turn sending the whole conversation
so far (the earlier turns and the assistant's replies), as a chat client does. Conversations
start as a Poisson process, at most ``max_concurrency`` of them open at once; a conversation's
next turn is sent when its reply is complete. Every turn is a request in the report; the time to
first token is also reported turn by turn, with the prefix cache's hit rate over the run."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from typing import Any

import httpx

from specbatch.bench.serve_results import RequestResult, percentiles, scrape_metrics, summarise

FOLLOW_UPS = (
    "Say more about that.",
    "Give another example.",
    "Now in fewer words.",
    "What would change if it were larger?",
    "Continue.",
)


async def _one_chat_turn(
    client: httpx.AsyncClient, payload: dict[str, Any], headers: dict[str, str], timeout: float
) -> tuple[RequestResult, str]:
    """One streamed chat completion: its timings and the reply's text."""
    res, parts = RequestResult(ok=False, start=time.perf_counter()), []
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", json=payload, headers=headers, timeout=timeout
        ) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:200]}"
                return res, ""
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"in-stream error: {chunk['error'].get('message')}"
                    return res, ""
                now = time.perf_counter() - res.start
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        parts.append(text)
                        res.chunk_times.append(now)
                        if res.ttft is None:
                            res.ttft = now
        res.e2e = time.perf_counter() - res.start
        if res.ttft is None and res.output_tokens:
            res.ttft = res.e2e
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res, "".join(parts)


async def run_conversations(
    client: httpx.AsyncClient,
    rate: float,
    first_turns: list[str],
    turns: int,
    params: dict[str, Any],
    headers: dict[str, str],
    max_concurrency: int | None,
    seed: int,
    timeout: float,
) -> tuple[list[list[RequestResult]], float]:
    """Every conversation (one per first turn) at ``rate`` conversations/s; returns each
    conversation's turns' results and the run's duration."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def converse(first: str, delay: float) -> list[RequestResult]:
        await asyncio.sleep(delay)
        messages: list[dict[str, str]] = [{"role": "user", "content": first}]
        results: list[RequestResult] = []
        for t in range(turns):
            payload = {
                **params,
                "messages": list(messages),
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            res, reply = await _one_chat_turn(client, payload, headers, timeout)
            results.append(res)
            if not res.ok:
                break
            messages.append({"role": "assistant", "content": reply})
            messages.append({"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]})
        return results

    async def gated(first: str, delay: float) -> list[RequestResult]:
        if sem is None:
            return await converse(first, delay)
        await asyncio.sleep(delay)
        async with sem:
            return await converse(first, 0.0)

    t, delays = 0.0, []
    for _ in first_turns:
        delays.append(t)
        if not math.isinf(rate):
            t += rng.expovariate(rate)
    start = time.perf_counter()
    done = await asyncio.gather(*(gated(f, d) for f, d in zip(first_turns, delays)))
    return list(done), time.perf_counter() - start


async def run_chat_rate(
    client: httpx.AsyncClient,
    rate: float,
    first_turns: list[str],
    turns: int,
    params: dict[str, Any],
    headers: dict[str, str],
    max_concurrency: int | None,
    seed: int,
    timeout: float,
) -> dict[str, Any]:
    """One rate of the chat workload, summarised as ``summarise`` does, with a row per turn."""
    before = await scrape_metrics(client)
    conversations, duration = await run_conversations(
        client, rate, first_turns, turns, params, headers, max_concurrency, seed, timeout
    )
    after = await scrape_metrics(client)
    results = [r for c in conversations for r in c]
    return summarise(rate, results, duration, before, after) | {"turns": by_turn(conversations)}


def by_turn(conversations: list[list[RequestResult]]) -> list[dict[str, Any]]:
    """Per turn: how many completed, and their time to first token (ms)."""
    most = max((len(c) for c in conversations), default=0)
    rows = []
    for t in range(most):
        ok = [c[t] for c in conversations if len(c) > t and c[t].ok]
        ttft = percentiles([r.ttft for r in ok if r.ttft is not None])
        rows.append({"turn": t + 1, "completed": len(ok), "ttft_ms": ttft})
    return rows
