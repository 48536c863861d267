"""Engine-wide counters: steps, tokens, preemptions and speculation statistics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from specbatch.request import SpecStats
from specbatch.scheduler.output import SchedulerOutput, StepResult


@dataclass
class EngineMetrics:
    num_steps: int = 0
    num_prompt_tokens: int = 0  # target tokens processed that were not emitted by this step
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    step_time_total: float = 0.0
    draft_time_total: float = 0.0
    target_time_total: float = 0.0
    spec: SpecStats = field(default_factory=SpecStats)
    draft_length_counts: Counter[int] = field(default_factory=Counter)  # per decoding request
    decoding_steps: int = 0  # steps in which some request could draft
    drafting_steps: int = 0  # ... and some did
    prefix_cache_queries: int = 0  # tokens of requests admitted for the first time
    prefix_cache_hits: int = 0  # of those, tokens found in the prefix cache

    def on_step(self, plan: SchedulerOutput, result: StepResult, step_time: float) -> None:
        self.num_steps += 1
        self.num_preemptions += plan.num_preempted
        self.step_time_total += step_time
        self.draft_time_total += result.timings.get("draft", 0.0)
        self.target_time_total += result.timings.get("target", 0.0)
        self.prefix_cache_queries += plan.prefix_cache_queries
        self.prefix_cache_hits += plan.prefix_cache_hits
        decoding = drafting = False
        for sr in plan.requests:
            self.num_prompt_tokens += len(sr.target_token_ids) - (1 if sr.sample else 0)
            r = result.results.get(sr.request_id)
            if r is not None:
                self.num_generated_tokens += len(r.token_ids)
                self.spec.record(r.num_proposed, r.num_accepted, r.rejected)
                self.draft_length_counts[sr.num_draft] += 1
                decoding = decoding or len(sr.target_token_ids) == 1
                drafting = drafting or sr.num_draft > 0
        self.decoding_steps += decoding
        self.drafting_steps += drafting

    def summary(self) -> dict[str, float | int | list[float] | None]:
        s = self.spec
        return {
            "steps": self.num_steps,
            "generated_tokens": self.num_generated_tokens,
            "preemptions": self.num_preemptions,
            "spec_rounds": s.rounds,
            "draft_tokens_proposed": s.proposed,
            "draft_tokens_accepted": s.accepted,
            "acceptance_rate": s.acceptance_rate,
            "alpha": s.alpha,
            "mean_draft_length": s.mean_draft_length,
            "mean_tokens_per_round": s.mean_tokens_per_round,
            "predicted_tokens_per_round": s.predicted_tokens_per_round(),
            "acceptance_by_position": s.acceptance_by_position,
            "drafting_share": (
                self.drafting_steps / self.decoding_steps if self.decoding_steps else None
            ),
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
        }

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Prompt tokens found in the prefix cache / prompt tokens looked up."""
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else None
