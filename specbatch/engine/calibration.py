"""``auto``'s prices before the first request: the engine's passes timed at start-up.

Until ``auto`` has timed a pass it can only guess what the pass costs, and a guess is wrong in
one direction or the other: priced at nothing, drafts run at the first batch size the engine
meets, however large; priced as dear as the target, the drafter is never tried. So the engine
first runs a few steps of throwaway requests (random tokens, EOS ignored) at a few batch
sizes up to ``max_num_seqs`` (or 64), on its own scheduler, drafting the deepest shape in
every other step, and hands the controller what those steps' passes took (never what the
drafts accepted: random prompts say nothing of real ones). Then every throwaway request is
finished, the workers forget them, and the prefix cache is emptied: the KV pool is whole again.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from specbatch.draft_shape import DraftShape
from specbatch.request import Request
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.draft_controller import DraftController
from specbatch.scheduler.output import SchedulerOutput, StepResult
from specbatch.scheduler.scheduler import Scheduler
from specbatch.scheduler.speculation import SpeculationPolicy

# and max_num_seqs itself, where it lies below the last; larger batches are priced on the slope
# of what these measured (a step of 64 requests drafting the deepest chain verifies 320 rows)
BATCH_SIZES = (1, 4, 16, 64)
PROMPT_TOKENS = 8
STEPS_EACH = 3  # steps with drafts, and steps without, timed at each batch size
MAX_STEPS = 4 * STEPS_EACH  # at a batch size, however few drafts were made (n-gram lookups)
SEED = 0


class _Alternating:
    """A policy drafting the controller's deepest shape in every other step; it tells the
    controller only what each step's passes took, once ``timing`` is set."""

    def __init__(self, controller: DraftController) -> None:
        self.controller = controller
        self.shape = controller.shape
        self.timing = False
        self.sampled = [0, 0]  # steps that sampled without drafts, with drafts
        self._drafts = False

    def draft_shapes(
        self, requests: list[Request], prompt_rows: int = 0, plain: int = 0
    ) -> list[DraftShape]:
        self._drafts = not self._drafts
        return [self.shape if self._drafts else DraftShape()] * len(requests)

    def observe(self, plan: SchedulerOutput, result: StepResult, seconds: float) -> None:
        drafted = any(r.num_proposed for r in result.results.values())
        if result.results:
            self.sampled[drafted] += 1
        if self.timing:
            self.controller.time_step(plan, result, seconds, drafted)


def batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes timed, smallest first."""
    sizes = [b for b in BATCH_SIZES if b < max_num_seqs]
    return [*sizes, max_num_seqs] if max_num_seqs <= BATCH_SIZES[-1] else sizes


def calibrate(
    controller: DraftController,
    new_scheduler: Callable[[SpeculationPolicy], Scheduler],
    execute: Callable[[SchedulerOutput], StepResult],
    vocab_size: int,
    max_model_len: int,
    max_num_seqs: int,
) -> None:
    """Time the engine's passes for ``controller`` (see the module's docstring): first the
    smallest batch untimed, greedy and sampled (the first calls of a code path pay what first
    calls pay), then, sampled at temperature 1, every batch size of ``batch_sizes`` until
    ``STEPS_EACH`` steps with drafts and as many without have sampled (or ``MAX_STEPS`` steps
    ran: an n-gram lookup may find nothing to draft). ``new_scheduler``: a
    scheduler on the engine's KV cache with the given policy (and a stop checker of its own);
    ``execute``: the engine's executor."""
    policy = _Alternating(controller)
    scheduler = new_scheduler(policy)
    rng = random.Random(SEED)
    prompt_len = max(1, min(PROMPT_TOKENS, max_model_len // 4))
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, ignore_eos=True)
    sizes = batch_sizes(max_num_seqs)
    rounds = [(sizes[0], greedy, False), (sizes[0], sampled, False)]
    rounds += [(b, sampled, True) for b in sizes]
    ids: list[str] = []
    try:
        for i, (batch, params, timed) in enumerate(rounds):
            policy.timing, policy.sampled = timed, [0, 0]
            batch_ids = [f"calibration-{i}-{j}" for j in range(batch)]
            for j, rid in enumerate(batch_ids):
                prompt = [rng.randrange(1, vocab_size) for _ in range(prompt_len)]
                scheduler.add_request(Request(rid, prompt, params, max_model_len, seed=SEED + j))
            ids += batch_ids
            for _ in range(MAX_STEPS):
                if not scheduler.has_unfinished() or min(policy.sampled) >= STEPS_EACH:
                    break
                start = time.perf_counter()
                plan = scheduler.schedule()
                if plan.is_empty:  # nothing fits: what was timed so far stands
                    return
                result = execute(plan)
                scheduler.update(plan, result)
                policy.observe(plan, result, time.perf_counter() - start)
            scheduler.abort(batch_ids)
    finally:
        scheduler.abort(ids)
        execute(SchedulerOutput(finished_request_ids=ids))
