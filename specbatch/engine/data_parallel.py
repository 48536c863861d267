"""Data parallelism: ``data_parallel_size`` engine replicas on a Ray cluster, behind one
engine's API.

``DataParallelEngine`` offers ``LLMEngine``'s step-level API (``add_request``, ``step``,
``abort_request``, ``metrics``), so ``LLM``, ``specbatch generate`` and the offline bench drive it
as they drive one engine. Prompts are checked and tokenized here, once; each replica
(``dp_replica.py``) is a Ray actor running an ``LLMEngine`` of its own.

Two ways requests reach the replicas:

* **pull** (offline, the default): requests queue here, and a replica is sent more only when it
  reports room (fewer than ``lookahead`` requests waiting for its batch), so a slow replica takes
  fewer and never holds the run back; among replicas with room the least loaded goes first.
* **route at once** (the server, ``route_at_once=True``): each request goes at once to the
  replica with the fewest outstanding tokens (``dp_router.py``).

A replica that dies (its process, or its engine) is killed and marked down; its unfinished
requests run again on the others, except those whose outputs were already delivered in part (a
stream), which fail with an ``EngineError`` (``take_failures``). When no replica is left,
``step`` raises ``EngineError``. A request without a seed gets one here, from the engine seed and
a counter as one engine would, so replicas never share a random stream.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from specbatch.config import EngineArgs, EngineConfig
from specbatch.distributed.ray_settings import DEFAULT_STEP_TIMEOUT_S, STEP_TIMEOUT_ENV, env_seconds
from specbatch.engine.dp_placement import ReplicaSet, failure_of
from specbatch.engine.dp_replica import Control, ReplicaRequest, ReplicaUpdate, token_budget
from specbatch.engine.dp_router import Router
from specbatch.engine.engine_state import EngineState, merge_metrics, merge_states
from specbatch.engine.llm_engine import LLMEngine, PromptInput
from specbatch.engine.metrics import EngineMetrics
from specbatch.errors import EngineError
from specbatch.grammar.compiler import GrammarCompilerPool
from specbatch.outputs import RequestOutput
from specbatch.sampling_params import SamplingParams
from specbatch.tokenizer import eos_token_ids, load_tokenizer, max_token_chars

logger = logging.getLogger(__name__)

POLL_S = 1.0  # a poll returns after this long even when nothing happened
WAIT_S = 0.5  # longest wait for a poll here (signals are handled between waits)
STATS_TIMEOUT_S = 30.0


@dataclass
class _Entry:
    req: ReplicaRequest
    order: int  # when it was added: requests moved off a dead replica keep their turn
    cost: int  # its token budget (dp_replica.token_budget)
    replica: int | None = None  # None: waiting here
    delivered: bool = False  # an output before the last went to the caller


def create_engine(args: EngineArgs) -> LLMEngine | DataParallelEngine:
    """One engine, or ``data_parallel_size`` replicas behind the same API."""
    config = args.create_engine_config()
    if config.data_parallel_size > 1:
        return DataParallelEngine(config)
    return LLMEngine(config)


class DataParallelEngine:
    # the same request checks as one engine (they read only the tokenizer and the config)
    prepare_prompt = LLMEngine.prepare_prompt
    check_request = LLMEngine.check_request

    def __init__(self, config: EngineConfig, route_at_once: bool = False) -> None:
        self.config = config
        self.route_at_once = route_at_once
        tok_path = config.target.tokenizer_path
        self.tokenizer = load_tokenizer(tok_path) if tok_path else None
        self.max_prompt_chars = (config.max_model_len - 1) * (
            max_token_chars(self.tokenizer) if self.tokenizer is not None else 1
        )
        # structured outputs' grammars, parsed to check requests (each replica compiles its own)
        stops = eos_token_ids(config.target.hf_config, self.tokenizer, config.target.path)
        self.grammars = GrammarCompilerPool(self.tokenizer, config.target.vocab_size, stops)
        self.lookahead = max(1, config.max_num_seqs // 4)
        self.hung_after_s = POLL_S + env_seconds(STEP_TIMEOUT_ENV, DEFAULT_STEP_TIMEOUT_S)
        self.replica_set = ReplicaSet(config)
        self.replicas = self.replica_set.replicas
        n = len(self.replicas)
        self.router = Router(n)
        self._states = [EngineState() for _ in range(n)]
        self._waiting = [0] * n  # as each replica last reported
        self._requests: dict[str, _Entry] = {}
        self._pending: deque[str] = deque()
        self._polls: dict[int, tuple[Any, float]] = {}  # replica -> (its poll, when sent)
        self._submits: list[Any] = []  # fire-and-forget calls, reaped as they finish
        self._failures: list[tuple[str, EngineError]] = []
        self._ids = itertools.count()
        self._order = itertools.count()
        self._seeds = itertools.count(1)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> DataParallelEngine:
        return cls(args.create_engine_config())

    # ---- requests --------------------------------------------------------------------------
    def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        field: str = "prompt",
    ) -> str:
        params = params or SamplingParams()
        text, ids = self.check_request(prompt, params, field)
        return self.add_checked_request(text, ids, params, request_id)

    def add_checked_request(
        self,
        text: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        stream: bool = False,
    ) -> str:
        """Queue a request ``check_request`` accepted. ``stream``: deliver its outputs as
        they grow (else only the finished one)."""
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self._requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        if params.seed is None:  # as LLMEngine derives it, from one counter for all replicas
            seed = (self.config.seed * 1_000_003 + next(self._seeds)) % 2**63
            params = dataclasses.replace(params, seed=seed)
        req = ReplicaRequest(rid, text, list(prompt_token_ids), params, stream)
        cost = token_budget(req, self.config.max_model_len)
        self._requests[rid] = _Entry(req, next(self._order), cost)
        if self.route_at_once:
            self._route(rid)
        else:
            self._pending.append(rid)
        return rid

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        by_replica: dict[int, list[str]] = {}
        for rid in ids:
            entry = self._requests.pop(rid, None)
            if entry is not None and entry.replica is not None:
                by_replica.setdefault(entry.replica, []).append(rid)
        for i, rids in by_replica.items():
            self._submit(i, aborts=rids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def take_failures(self) -> list[tuple[str, EngineError]]:
        """Requests that failed with their replica after part of their output was delivered."""
        failures, self._failures = self._failures, []
        return failures

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Send waiting requests to replicas with room, then return the outputs of the first
        replica(s) to answer (an empty list when none answered within ``WAIT_S``)."""
        import ray

        self._reap_submits()
        if not self._requests:
            return []
        self._check_live()
        if not self.route_at_once:
            self._feed()
        for i, (_, sent) in list(self._polls.items()):
            if time.monotonic() - sent > self.hung_after_s:
                self.lose(i, f"no reply within {self.hung_after_s:g} s (hung?)")
        self._check_live()
        for r in self.replica_set.live:
            if r.index not in self._polls:
                self._poll(r.index, None)
        refs = {ref: i for i, (ref, _) in self._polls.items()}
        ready, _ = ray.wait(list(refs), num_returns=1, timeout=WAIT_S)
        if ready:
            more, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
            ready = list({*ready, *more})
        outputs: list[RequestOutput] = []
        for ref in sorted(ready, key=lambda r: refs[r]):
            i = refs[ref]
            del self._polls[i]
            try:
                update = ray.get(ref)
            except ray.exceptions.RayError as e:
                self.lose(i, failure_of(e))
                continue
            outputs.extend(self.absorb(i, update))
        if self._failures and not self.route_at_once:  # offline: a replica refused a request
            raise self._failures.pop(0)[1]
        return outputs

    def _feed(self) -> None:
        """Waiting requests to the replicas with room that are not being polled, the least
        loaded first; each gets them with its next poll."""
        idle = [r.index for r in self.replica_set.live if r.index not in self._polls]
        room = {i: self._room(i) for i in idle}
        adds: dict[int, list[ReplicaRequest]] = {i: [] for i in idle}
        seqs = {i: self.replicas[i].seq + 1 for i in idle}
        while self._pending and any(room.values()):
            rid = self._pending.popleft()
            entry = self._requests.get(rid)
            if entry is None or entry.replica is not None:
                continue  # aborted, or already placed
            i = self.router.choose([j for j in idle if room[j] > 0])
            entry.replica = i
            adds[i].append(entry.req)
            room[i] -= 1
            self.router.sent(i, seqs[i], entry.cost)
        for i in idle:
            if adds[i]:
                self._poll(i, Control(self.replicas[i].next_seq(), adds=adds[i]))

    def _room(self, i: int) -> int:
        """How many more requests replica ``i`` takes: at most ``lookahead`` waiting for its
        batch, at most ``max_num_seqs + lookahead`` in all."""
        held = sum(1 for e in self._requests.values() if e.replica == i)
        total = self.config.max_num_seqs + self.lookahead - held
        return max(0, min(self.lookahead - self._waiting[i], total))

    def _poll(self, i: int, control: Control | None) -> None:
        low_water = self.lookahead // 2 if self._pending and not self.route_at_once else -1
        ref = self.replicas[i].actor.poll.remote(control, low_water, POLL_S)
        self._polls[i] = (ref, time.monotonic())

    def _route(self, rid: str) -> None:
        """Send a request to the live replica with the fewest outstanding tokens."""
        entry = self._requests[rid]
        self._check_live()
        i = self.router.choose()
        entry.replica = i
        seq = self._submit(i, adds=[entry.req])
        self.router.sent(i, seq, entry.cost)

    def _submit(
        self,
        i: int,
        adds: list[ReplicaRequest] | None = None,
        aborts: list[str] | None = None,
        reset_metrics: EngineMetrics | None = None,
    ) -> int:
        r = self.replicas[i]
        if not r.alive:
            return r.seq
        control = Control(r.next_seq(), adds or [], aborts or [], reset_metrics)
        self._submits.append(r.actor.submit.remote(control))
        return control.seq

    def _reap_submits(self) -> None:
        """Drop finished fire-and-forget calls (a dead replica's are read, and shows in its
        poll)."""
        import ray

        if not self._submits:
            return
        done, self._submits = ray.wait(self._submits, num_returns=len(self._submits), timeout=0)
        for ref in done:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(ref)

    def absorb(self, i: int, update: ReplicaUpdate) -> list[RequestOutput]:
        """Take in replica ``i``'s update: the outputs to deliver (requests aborted or moved
        meanwhile left out)."""
        if not self.replicas[i].alive:  # a late reply from a replica already down
            return []
        self._take_state(i, update.state)
        self._waiting[i] = update.waiting
        self.router.update(i, update.applied_seq, update.outstanding_tokens)
        if update.error is not None:
            self.lose(i, f"its engine failed: {update.error}")
            return []
        for rid, why in update.refused:
            if self._requests.pop(rid, None) is not None:
                self._failures.append((rid, EngineError(f"replica {i} refused {rid}: {why}")))
        outputs = []
        for out in update.outputs:
            entry = self._requests.get(out.request_id)
            if entry is None or entry.replica != i:
                continue
            if out.finished:
                del self._requests[out.request_id]
            else:
                entry.delivered = True
            outputs.append(out)
        return outputs

    def _take_state(self, i: int, state: EngineState) -> None:
        """Replica ``i``'s state, unless one it published later already arrived (a poll's reply
        read after a fresher ``stats``)."""
        if state.snapshot >= self._states[i].snapshot:
            self._states[i] = state

    def lose(self, i: int, why: str) -> None:
        """Replica ``i`` is down: its requests go to the others, but those already partly
        delivered, which fail."""
        self.replica_set.mark_down(i, why)
        self.router.remove(i)
        # its counters stay in the sums (they never go back), its gauges leave them
        self._states[i] = EngineState(metrics=self._states[i].metrics)
        self._waiting[i] = 0
        self._polls.pop(i, None)
        moved = sorted(
            (e for e in self._requests.values() if e.replica == i), key=lambda e: e.order
        )
        err = EngineError(f"data-parallel replica {i} ({self.replicas[i].where}) failed: {why}")
        retry = []
        for e in moved:
            e.replica = None
            if e.delivered:
                del self._requests[e.req.request_id]
                self._failures.append((e.req.request_id, err))
            else:
                retry.append(e.req.request_id)
        if retry:
            logger.warning("moving %d request(s) of replica %d to the others", len(retry), i)
        if not self.replica_set.live:
            return
        if self.route_at_once:
            for rid in retry:
                self._route(rid)
        else:
            self._pending.extendleft(reversed(retry))

    def _check_live(self) -> None:
        if not self.replica_set.live:
            down = "; ".join(f"replica {r.index} ({r.where}): {r.error}" for r in self.replicas)
            raise EngineError(f"every data-parallel replica failed: {down}")

    # ---- introspection ---------------------------------------------------------------------
    @property
    def metrics(self) -> EngineMetrics:
        """Every replica's counters added up, as of its last update."""
        return merge_metrics(s.metrics for s in self._states)

    @metrics.setter
    def metrics(self, value: EngineMetrics) -> None:
        """Reset the counters: every replica counts from a copy of ``value``, which must be
        fresh (an ``EngineMetrics``, or a subclass counting more, as created)."""
        if value != type(value)():
            raise ValueError("a data-parallel engine's metrics can only be reset")
        for r in self.replica_set.live:
            self._submit(r.index, reset_metrics=copy.deepcopy(value))
        for s in self._states:
            s.metrics = copy.deepcopy(value)

    def state(self) -> EngineState:
        """The replicas' states added up, as of their last updates; requests queued here
        count as waiting."""
        total = merge_states(self._states)
        queued = sum(1 for e in self._requests.values() if e.replica is None)
        total.waiting += queued
        total.completions_waiting += queued
        return total

    def num_requests(self) -> tuple[int, int]:
        s = self.state()
        return s.running, s.waiting

    def replica_states(self) -> list[EngineState | None]:
        """Each replica's state now (None: down), once it applied every message sent to it."""
        import ray

        refs = {
            r.index: r.actor.stats.remote(r.seq, STATS_TIMEOUT_S) for r in self.replica_set.live
        }
        states: list[EngineState | None] = [None] * len(self.replicas)
        for i, ref in refs.items():
            try:
                states[i] = ray.get(ref, timeout=STATS_TIMEOUT_S + 5)
                self._take_state(i, states[i])
            except ray.exceptions.RayError as e:
                self.lose(i, failure_of(e))
        return states

    @property
    def num_kv_blocks(self) -> int:
        return sum(r.num_kv_blocks for r in self.replica_set.live)

    @property
    def num_free_kv_blocks(self) -> int:
        states = [s for s in self.replica_states() if s is not None]
        return sum(s.kv_blocks_total - s.kv_blocks_used for s in states)

    def replica_health(self) -> list[dict[str, Any]]:
        return [
            {
                "replica": r.index,
                "status": "ok" if r.alive else "down",
                "node_ip": r.node_ip,
                "pid": r.pid,
                **({"error": r.error} if r.error else {}),
            }
            for r in self.replicas
        ]

    def shutdown(self) -> None:
        self.replica_set.shutdown()
