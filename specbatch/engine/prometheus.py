"""The server's ``/metrics`` page, through ``prometheus_client``.

Metrics are named as vLLM names them (``vllm:num_requests_running`` is
``specbatch:num_requests_running``), with the same ``model_name`` label, so a vLLM dashboard
needs only its prefix changed. Each server has a registry of its own. Engine state is read when
the page is scraped; the latency histograms are observed once per finished request.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from specbatch.outputs import RequestOutput

if TYPE_CHECKING:
    from specbatch.engine.async_engine import AsyncLLMEngine

PREFIX = "specbatch:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """The metrics of one server over ``engine``, served as ``model_name``."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.finished: collections.Counter[str] = collections.Counter()
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, registry=self.registry, buckets=buckets)

        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Time from a request's arrival in the engine to its first output token.",
            TTFT_BUCKETS,
        ).labels(model_name)
        self.tpot = histogram(
            "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            TPOT_BUCKETS,
        ).labels(model_name)
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "Time from a request's arrival in the engine to its end.",
            E2E_BUCKETS,
        ).labels(model_name)
        self.http_errors = Counter(
            PREFIX + "http_errors",
            "Error responses by status code.",
            [*labels, "status"],
            registry=self.registry,
        )
        self.model_name = model_name
        self.registry.register(_EngineCollector(engine, self))

    def observe(self, out: RequestOutput) -> None:
        """Record a finished request."""
        m = out.metrics
        self.finished[out.outputs[0].finish_reason or "unknown"] += 1
        for hist, value in (
            (self.ttft, m.time_to_first_token),
            (self.tpot, m.time_per_output_token),
            (self.e2e, m.e2e_latency),
        ):
            if value is not None:
                hist.observe(value)

    def http_error(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    content_type = CONTENT_TYPE_LATEST

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class _EngineCollector(Collector):
    """Gauges and counters read from the engine at each scrape (plain ints, no lock)."""

    def __init__(self, engine: AsyncLLMEngine, metrics: ServerMetrics) -> None:
        self.engine, self.metrics = engine, metrics

    def collect(self) -> Iterator[Metric]:
        model = self.metrics.model_name
        st = self.engine.engine_state()
        m, spec = st.metrics, st.metrics.spec
        total, used = st.kv_blocks_total, st.kv_blocks_used
        nan, usage = float("nan"), used / total if total else 0.0
        rate = nan if spec.acceptance_rate is None else spec.acceptance_rate
        alpha = nan if spec.alpha is None else spec.alpha
        gauges = (
            ("healthy", "1 while the engine can serve requests.", self.engine.is_healthy),
            ("num_requests_running", "Requests in the batch (n > 1 counted once).", st.running),
            ("num_requests_waiting", "Requests waiting (n > 1 counted once).", st.waiting),
            (
                "num_completions_running",
                "Completions (n per request) in the batch.",
                st.completions_running,
            ),
            (
                "num_completions_waiting",
                "Completions (n per request) waiting.",
                st.completions_waiting,
            ),
            ("kv_blocks_total", "KV-cache blocks in the pool.", total),
            ("kv_blocks_used", "KV-cache blocks in use.", used),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", usage),
            ("spec_decode_draft_acceptance_rate", "Accepted / proposed draft tokens.", rate),
            ("spec_decode_alpha", "Accepted / (accepted + rejections) draft tokens.", alpha),
            (
                "spec_decode_drafting_share",
                "Share of decoding steps in which some request drafted.",
                nan if m.decoding_steps == 0 else m.drafting_steps / m.decoding_steps,
            ),
        )
        counters = (
            ("prompt_tokens", "Prompt tokens processed.", m.num_prompt_tokens),
            ("generation_tokens", "Output tokens generated.", m.num_generated_tokens),
            ("num_preemptions", "Requests preempted.", m.num_preemptions),
            ("engine_steps", "Engine steps.", m.num_steps),
            ("spec_decode_num_drafts", "Verification rounds with a draft token.", spec.rounds),
            ("spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.proposed),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.accepted),
            ("spec_decode_num_rejections", "Rounds that stopped at a rejection.", spec.rejections),
            ("spec_decode_num_emitted_tokens", "Tokens emitted by drafting rounds.", spec.emitted),
            ("prefix_cache_queries", "Prefix cache queries, in tokens.", m.prefix_cache_queries),
            ("prefix_cache_hits", "Prefix cache hits, in tokens.", m.prefix_cache_hits),
        )
        for kind, rows in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, doc, value in rows:
                family = kind(PREFIX + name, doc, labels=["model_name"])
                family.add_metric([model], float(value))
                yield family
        finished = self.metrics.finished + collections.Counter({"abort": self.engine.num_aborted})
        for name, doc, label, values in (
            (
                "spec_decode_num_accepted_tokens_per_pos",
                "Rounds accepting the draft token at this position (from 0).",
                "position",
                dict(enumerate(spec.accepted_by_position)),
            ),
            (
                "request_success",
                "Finished requests by finish reason.",
                "finished_reason",
                {r: finished[r] for r in sorted({"stop", "length", "abort", *finished})},
            ),
        ):
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", label])
            for key, value in values.items():
                family.add_metric([model, str(key)], value)
            yield family
        replicas = self.engine.replica_health()
        if replicas is not None:
            family = GaugeMetricFamily(
                PREFIX + "replica_healthy",
                "1 while this data-parallel replica serves.",
                labels=["model_name", "replica"],
            )
            for r in replicas:
                family.add_metric([model, str(r["replica"])], float(r["status"] == "ok"))
            yield family
        if st.draft_nodes is not None:  # auto: the draft lengths granted, 0 included
            counts = m.draft_length_counts
            lengths = range(st.draft_nodes + 1)
            buckets = [(str(k), sum(counts.get(j, 0) for j in range(k + 1))) for k in lengths]
            family = HistogramMetricFamily(
                PREFIX + "spec_decode_draft_length",
                "Draft length granted to a decoding request per step (auto).",
                labels=["model_name"],
            )
            family.add_metric(
                [model],
                [*buckets, ("+Inf", sum(counts.values()))],
                sum(k * n for k, n in counts.items()),
            )
            yield family


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name to value, from a Prometheus text page; labels other than ``model_name``
    are kept in the name as written (``name{label="value"}``)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items() if k != "model_name")
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values
