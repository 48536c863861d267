"""Start-up profile of a speculative step's forwards, run through the worker's own step code.

``auto``'s cost model (scheduler/step_cost.py) prices a plan as the forwards it would run: the
draft's first pass of a step (which also catches up on the tokens the draft has not seen), its
further passes, one per draft position, and the target's verify pass. Each is timed here inside
a real ``Worker.execute`` of dummy requests, so that it includes what a step does around the
forward (inputs built per pass, probabilities, sampling) and runs where a step runs it: the
draft's first pass right after the target's, with the draft's weights out of the caches (on a
CPU several times a further pass), the verify pass right after the draft's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.output import NewRequestData, ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from specbatch.worker.worker import Worker

LARGE = 256  # tokens: past this a shape runs once, unwarmed (its first-time costs are small)


def profile_passes(
    worker: Worker,
    seq_counts: list[int],
    context_len: int,
    depths: list[int],
    draft_counts: list[int],
    rounds: int = 2,
) -> dict[str, list[float] | list[list[float]]]:
    """Seconds, the fastest of ``rounds`` rounds after a warm-up round:

    * ``target[d][i]``: the verify pass (forward, probabilities, rejection sampling) of
      ``seq_counts[i]`` sequences of ``depths[d] + 1`` tokens each;
    * ``draft_further[i]``: one further draft pass over ``seq_counts[i]`` sequences (the draft
      phase of a step at the deepest depth less that at depth 1, per extra position);
    * ``draft_first[i]``: the draft phase of a step at depth 1 whose first pass reads
      ``draft_counts[i]`` tokens (spread over up to ``seq_counts[-1]`` sequences).

    Dummy sequences sit at positions spread over ``context_len * [1/2, 3/2]``, each with KV
    blocks of its own (round the pool when it holds fewer), as a running batch's requests do:
    sequences of one length reading the same blocks made a verify pass look cheaper than in a
    real step (at batch 8, one draft a sequence: 18% below; without drafts: 4%), and the
    policy drafted too deep.
    Run before any request holds a block (a request writes its slots before it reads them)."""
    block_size = worker.config.block_size
    deepest = max(depths)
    positions = [context_len * (4 + i % 9) // 8 for i in range(max(seq_counts[-1], 1))]
    per_seq_blocks = (max(positions) + deepest + 1) // block_size + 1
    num_blocks = worker.target.kv_caches[0][0].shape[0]
    tables = [
        [(i * per_seq_blocks + b) % num_blocks for b in range(per_seq_blocks)]
        for i in range(max(seq_counts[-1], 1))
    ]
    ids = [f"__profile_{i}" for i in range(max(seq_counts[-1], 1))]
    # every other one greedy: a batch's probabilities then cost their softmax and a one-hot
    new = [
        NewRequestData(rid, SamplingParams(temperature=float(i % 2)), seed=0)
        for i, rid in enumerate(ids)
    ]

    def step(num_seqs: int, depth: int, catchup: int = 0) -> dict[str, float]:
        """A step of ``num_seqs`` sequences drafting ``depth`` tokens each, the draft catching up
        on ``catchup`` tokens in all (one per sequence when 0); its phase timings."""
        per_seq = [max(1, catchup // num_seqs)] * num_seqs
        per_seq[0] += max(0, catchup - sum(per_seq))
        requests = [
            ScheduledRequest(
                request_id=ids[i],
                target_token_ids=[0],
                target_start=positions[i],
                draft_token_ids=[0] * per_seq[i] if depth else [],
                draft_start=positions[i] + 1 - per_seq[i],
                num_draft=depth,
                sample=True,
                block_table=tables[i],
            )
            for i in range(num_seqs)
        ]
        # the dummy requests are registered afresh with every step (a new generator each)
        return worker.execute(SchedulerOutput(requests, new[:num_seqs])).timings

    first = [float("inf")] * len(draft_counts)
    further = [float("inf")] * len(seq_counts)
    target = [[float("inf")] * len(seq_counts) for _ in depths]
    worker.sync_phases = True
    try:
        for r in range(-1, rounds):  # round -1 warms the small shapes up and is not kept
            for i, n in enumerate(seq_counts):
                for d, g in enumerate(depths):
                    if r != 0 and n * (g + 1) > LARGE:
                        continue
                    t = step(n, g)
                    if r < 0:
                        continue
                    target[d][i] = min(target[d][i], t["target"] + t["sample"])
                    if g == deepest and worker.draft is not None and deepest > 1:
                        shallow = step(n, 1)["draft"]
                        further[i] = min(further[i], (t["draft"] - shallow) / (deepest - 1))
            if worker.draft is None:
                continue
            for i, tokens in enumerate(draft_counts):
                if r != 0 and tokens > LARGE:
                    continue
                t = step(min(tokens, seq_counts[-1]), 1, catchup=tokens)
                if r >= 0:
                    first[i] = min(first[i], t["draft"])
    finally:
        worker.sync_phases = False
        worker.execute(SchedulerOutput(finished_request_ids=ids))
    return {
        "draft_first": first if worker.draft is not None else [],
        "draft_further": [max(t, 0.0) for t in further] if worker.draft is not None else [],
        "target": target,
    }
