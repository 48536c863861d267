"""The server's ``/metrics`` page in the Prometheus text exposition format (version 0.0.4).

Gauges and counters are read from the engine when the page is rendered; the latency histograms
are fed by ``ServerMetrics.observe`` once per finished request.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from specbatch.outputs import RequestOutput

PREFIX = "specbatch"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _fmt(v: float | int) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(float(v))


class Histogram:
    """A cumulative-bucket histogram (``le`` upper bounds, plus +Inf)."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name, self.help = name, help_text
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{_fmt(float(bound))}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_fmt(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class ServerMetrics:
    def __init__(self) -> None:
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Time from a request's arrival in the engine to its first output token.",
            TTFT_BUCKETS,
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            TPOT_BUCKETS,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Time from a request's arrival in the engine to its end.",
            E2E_BUCKETS,
        )
        self.finished: Counter[str] = Counter()
        self.http_errors: Counter[int] = Counter()

    def observe(self, out: RequestOutput) -> None:
        """Record a finished request."""
        m = out.metrics
        self.finished[out.outputs[0].finish_reason or "unknown"] += 1
        if m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
        if m.time_per_output_token is not None:
            self.tpot.observe(m.time_per_output_token)
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)

    def render(self, engine: Any, healthy: bool, aborted: int = 0) -> str:
        """The whole page; ``engine`` is the ``LLMEngine`` (only read: plain ints, no lock);
        ``aborted`` counts requests aborted in flight (the engine reports no output for them)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, value: float | int) -> None:
            full = f"{PREFIX}_{name}"
            lines.extend((f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"))
            lines.append(f"{full} {_fmt(value)}")

        sched, m = engine.scheduler, engine.metrics
        spec = m.spec
        total = engine.num_kv_blocks
        metric("healthy", "gauge", "1 while the engine can serve requests.", int(healthy))
        metric("num_requests_running", "gauge", "Requests in the running batch.", sched.num_running)
        metric(
            "num_requests_waiting", "gauge", "Requests waiting to be scheduled.", sched.num_waiting
        )
        metric("kv_blocks_total", "gauge", "KV-cache blocks in the pool.", total)
        metric(
            "kv_blocks_used", "gauge", "KV-cache blocks in use.", total - engine.num_free_kv_blocks
        )
        metric(
            "kv_cache_usage_ratio",
            "gauge",
            "Fraction of KV-cache blocks in use.",
            (total - engine.num_free_kv_blocks) / total if total else 0.0,
        )
        metric("prompt_tokens_total", "counter", "Prompt tokens processed.", m.num_prompt_tokens)
        metric(
            "generation_tokens_total", "counter", "Output tokens generated.", m.num_generated_tokens
        )
        metric("num_preemptions_total", "counter", "Requests preempted.", m.num_preemptions)
        metric("engine_steps_total", "counter", "Engine steps.", m.num_steps)
        metric(
            "spec_decode_num_rounds_total",
            "counter",
            "Verification rounds with at least one draft token.",
            spec.rounds,
        )
        metric(
            "spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.", spec.proposed
        )
        metric(
            "spec_decode_num_accepted_tokens_total",
            "counter",
            "Draft tokens accepted.",
            spec.accepted,
        )
        metric(
            "spec_decode_num_rejections_total",
            "counter",
            "Rounds that stopped at a rejected draft token.",
            spec.rejections,
        )
        metric(
            "spec_decode_num_emitted_tokens_total",
            "counter",
            "Tokens emitted by speculative rounds (accepted + one per round).",
            spec.emitted,
        )
        rate = spec.acceptance_rate
        metric(
            "spec_decode_acceptance_rate",
            "gauge",
            "Accepted / proposed draft tokens since start (NaN before any round).",
            float("nan") if rate is None else rate,
        )
        alpha = spec.alpha
        metric(
            "spec_decode_alpha",
            "gauge",
            "Per-tested-draft acceptance probability: accepted / (accepted + rejections).",
            float("nan") if alpha is None else alpha,
        )
        if engine.config.adaptive_speculation:  # the draft lengths granted, 0 included
            counts = m.draft_length_counts
            name = f"{PREFIX}_spec_decode_draft_length"
            lines.append(
                f"# HELP {name} Draft length granted to a decoding request per step "
                "(num_speculative_tokens=auto)."
            )
            lines.append(f"# TYPE {name} histogram")
            cumulative = 0
            for k in range(sched.policy.shape.depth + 1):
                cumulative += counts.get(k, 0)
                lines.append(f'{name}_bucket{{le="{k}"}} {cumulative}')
            lines.append(f'{name}_bucket{{le="+Inf"}} {sum(counts.values())}')
            lines.append(f"{name}_sum {sum(k * n for k, n in counts.items())}")
            lines.append(f"{name}_count {sum(counts.values())}")
        name = f"{PREFIX}_request_success_total"
        lines.extend(
            (f"# HELP {name} Finished requests by finish reason.", f"# TYPE {name} counter")
        )
        finished = self.finished + Counter({"abort": aborted})
        for reason in sorted({"stop", "length", "abort", *finished}):
            lines.append(f'{name}{{finished_reason="{reason}"}} {finished[reason]}')
        name = f"{PREFIX}_http_errors_total"
        lines.extend((f"# HELP {name} Error responses by status code.", f"# TYPE {name} counter"))
        for code in sorted(self.http_errors):
            lines.append(f'{name}{{status="{code}"}} {self.http_errors[code]}')
        for hist in (self.ttft, self.tpot, self.e2e):
            lines.extend(hist.render())
        return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name (with its labels, as written) to value, from a Prometheus text page."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            values[name] = float(value)
        except ValueError:
            continue
    return values
