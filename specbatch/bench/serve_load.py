"""Load generation against an OpenAI-compatible server: Poisson arrivals, streamed requests,
a table and a plot (the engine behind ``specbatch bench serve``); the latencies and counters
it reports are serve_results.py's, the chat workload serve_chat.py's."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import httpx

from specbatch.bench.serve_chat import run_chat_rate
from specbatch.bench.serve_results import RequestResult, scrape_metrics, summarise

_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "small",
    "birds",
    "sing",
    "about",
    "rivers",
    "mountains",
    "and",
    "distant",
    "cities",
    "where",
    "people",
    "write",
    "code",
    "read",
    "books",
    "and",
    "drink",
    "tea",
]


def synthetic_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(words)) for _ in range(n)]


async def _one_request(
    client: httpx.AsyncClient, payload: dict[str, Any], headers: dict[str, str], timeout: float
) -> RequestResult:
    res = RequestResult(ok=False, start=time.perf_counter())
    try:
        async with client.stream(
            "POST", "/v1/completions", json=payload, headers=headers, timeout=timeout
        ) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"in-stream error: {chunk['error'].get('message')}"
                    return res
                now = time.perf_counter() - res.start
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if choice.get("text"):
                        res.chunk_times.append(now)
                        if res.ttft is None:
                            res.ttft = now
        res.e2e = time.perf_counter() - res.start
        if res.ttft is None and res.output_tokens:  # output that decodes to no text
            res.ttft = res.e2e
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_rate(
    client: httpx.AsyncClient,
    rate: float,
    prompts: list[str | list[int]],
    params: dict[str, Any],
    headers: dict[str, str],
    max_concurrency: int | None,
    seed: int,
    timeout: float,
) -> dict[str, Any]:
    """Send every prompt once at ``rate`` requests/s (Poisson) and summarise."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    before = await scrape_metrics(client)

    async def fire(prompt: str | list[int], delay: float) -> RequestResult:
        await asyncio.sleep(delay)
        payload = {
            **params,
            "prompt": prompt,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if sem is None:
            return await _one_request(client, payload, headers, timeout)
        async with sem:
            return await _one_request(client, payload, headers, timeout)

    t, delays = 0.0, []
    for _ in prompts:
        delays.append(t)
        if not math.isinf(rate):
            t += rng.expovariate(rate)
    start = time.perf_counter()
    results = await asyncio.gather(*(fire(p, d) for p, d in zip(prompts, delays)))
    duration = time.perf_counter() - start
    after = await scrape_metrics(client)
    return summarise(rate, results, duration, before, after)


async def run_benchmark(
    base_url: str,
    rates: list[float],
    prompts: list[str | list[int]],
    *,
    max_tokens: int = 32,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    max_concurrency: int | None = None,
    seed: int = 0,
    model: str | None = None,
    api_key: str | None = None,
    timeout: float = 300.0,
    multi_turn: int = 1,
) -> dict[str, Any]:
    """Benchmark every rate in turn (the same prompts each time); returns the JSON report.
    ``multi_turn`` > 1: each prompt opens a chat of that many turns (serve_chat.py)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts) or 1)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), limits=limits) as client:
        if model is None:
            resp = await client.get("/v1/models", headers=headers, timeout=30)
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
        params = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "ignore_eos": ignore_eos,
        }
        runs = []
        for i, rate in enumerate(rates):
            if multi_turn > 1:
                texts = [str(p) for p in prompts]
                run = await run_chat_rate(client, rate, texts, multi_turn, params, headers,
                                          max_concurrency, seed + i, timeout)  # fmt: skip
            else:
                run = await run_rate(
                    client, rate, prompts, params, headers, max_concurrency, seed + i, timeout
                )
            runs.append(run)
    return {
        "base_url": base_url,
        "model": model,
        "num_prompts": len(prompts),
        "max_concurrency": max_concurrency,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "multi_turn": multi_turn,
        "runs": runs,
    }


# ---- reporting ---------------------------------------------------------------------------------


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def format_table(report: dict[str, Any]) -> str:
    head = (
        f"{'rate':>6} {'ok':>5} {'err':>4} {'req/s':>7} {'tok/s':>8} "
        f"{'TTFT mean/p50/p90/p99 ms':>27} {'TPOT mean/p50/p90/p99 ms':>27} "
        f"{'ITL mean/p50/p90/p99 ms':>27} {'accept':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in report["runs"]:

        def four(d: dict[str, float | None]) -> str:
            return "/".join(_f(d[k]) for k in ("mean", "p50", "p90", "p99"))

        lines.append(
            f"{r['request_rate']!s:>6} {r['completed']:>5} {r['errors']:>4} "
            f"{r['request_throughput']:>7.2f} {r['output_throughput']:>8.1f} "
            f"{four(r['ttft_ms']):>27} {four(r['tpot_ms']):>27} {four(r['itl_ms']):>27} "
            f"{_f(r['acceptance_rate'], 3):>7}"
        )
    for r in report["runs"]:
        if r.get("prefix_cache_hit_rate") is not None:
            lines.append(f"rate {r['request_rate']}: prefix cache hit rate "
                         f"{r['prefix_cache_hit_rate']:.1%}")  # fmt: skip
        for t in r.get("turns", []):
            ttft = "/".join(_f(t["ttft_ms"][k]) for k in ("mean", "p50", "p90", "p99"))
            lines.append(f"  turn {t['turn']}: {t['completed']} done, TTFT {ttft} ms")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Latency (TTFT and TPOT, p50 and p99) against output-token throughput, one point per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    x = [r["output_throughput"] for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            y = [r[key][q] if r[key][q] is not None else float("nan") for r in runs]
            ax.plot(x, y, style, label=q)
            if q == "p50":
                for xi, yi, r in zip(x, y, runs):
                    ax.annotate(
                        f"{r['request_rate']}/s",
                        (xi, yi),
                        textcoords="offset points",
                        xytext=(4, 4),
                        fontsize=8,
                    )
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} vs throughput")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"specbatch bench serve: {report['model']}, {report['num_prompts']} requests/rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the command -------------------------------------------------------------------------------
