"""What a serve benchmark measures: each request's timings (``RequestResult``), the server's
counters before and after a rate (``scrape_metrics``), and a rate's summary of both
(``summarise``, latencies as ``percentiles``). The completions load (serve_load.py) and the chat
load (serve_chat.py) report through it alike."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import httpx

from specbatch.engine.prometheus import parse_metrics
from specbatch.stats import percentile


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """Mean, p50, p90, p99 in milliseconds (linear interpolation), None when empty."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = 1000.0
    return {
        "mean": sum(values) / len(values) * ms,
        **{f"p{q}": percentile(values, q) * ms for q in (50, 90, 99)},
    }


async def scrape_metrics(client: httpx.AsyncClient) -> dict[str, float]:
    try:
        resp = await client.get("/metrics", timeout=30)
        return parse_metrics(resp.text) if resp.status_code == 200 else {}
    except httpx.HTTPError:
        return {}


def summarise(
    rate: float,
    results: list[RequestResult],
    duration: float,
    before: dict[str, float],
    after: dict[str, float],
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    proposed = after.get("specbatch:spec_decode_num_draft_tokens_total", 0.0) - before.get(
        "specbatch:spec_decode_num_draft_tokens_total", 0.0
    )
    accepted = after.get("specbatch:spec_decode_num_accepted_tokens_total", 0.0) - before.get(
        "specbatch:spec_decode_num_accepted_tokens_total", 0.0
    )
    errors = [r.error for r in results if not r.ok]
    queries, hits = (
        after.get(f"specbatch:prefix_cache_{n}_total", 0.0)
        - before.get(f"specbatch:prefix_cache_{n}_total", 0.0)
        for n in ("queries", "hits")
    )
    return {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "num_requests": len(results),
        "completed": len(ok),
        "errors": len(errors),
        "error_examples": sorted(set(e for e in errors if e))[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": tokens / duration if duration > 0 else 0.0,
        "total_output_tokens": tokens,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": percentiles(itl),
        "acceptance_rate": accepted / proposed if proposed > 0 else None,
        "draft_tokens_proposed": int(proposed),
        "draft_tokens_accepted": int(accepted),
        "kv_blocks_used_after": after.get("specbatch:kv_blocks_used"),
        "prefix_cache_hit_rate": hits / queries if queries > 0 else None,
    }
