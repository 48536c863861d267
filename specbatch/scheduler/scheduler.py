"""Continuous batching over a paged KV cache, with lookahead slots for speculative drafts.

Each step: (1) every running request gets slots for the tokens its target has not processed yet,
preempting the most recently admitted requests (recompute) if blocks run out; (2) decoding
requests get draft lengths from the policy, shrunk to what the token budget, the length limits and
the free blocks allow (drafts never cause a preemption); (3) waiting requests are admitted in
arrival order while blocks, sequence slots and token budget last, each starting on the longest run
of cached blocks of its tokens when prefix caching is on (cached blocks nobody holds count as
free). After the step, ``update`` moves each model's progress counter back to what was accepted,
publishes the full blocks both caches now hold, and truncates the block table.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from specbatch.draft_shape import DraftShape
from specbatch.kv_cache.kv_cache_manager import KVCacheManager
from specbatch.request import FinishReason, Request, RequestStatus
from specbatch.scheduler.drafter_lag import DrafterLag, is_prompt_chunk
from specbatch.scheduler.drafter_sleep import DrafterSleep
from specbatch.scheduler.output import (
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    StepResult,
)
from specbatch.scheduler.prefix_sharing import PrefixSharing
from specbatch.scheduler.speculation import FixedDraft, SpeculationPolicy
from specbatch.stop_checker import StopChecker


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


class Scheduler:
    def __init__(
        self,
        limits: SchedulerLimits,
        kv_cache: KVCacheManager,
        stop_checker: StopChecker,
        policy: SpeculationPolicy | None = None,
        speculative: bool = False,
        draft_input: str = "tokens",
        batch_invariant: bool = False,
    ) -> None:
        """``draft_input``: what each step sends the drafter of its own KV cache. "tokens" (a
        draft model): the tokens it has not seen, position by position as the target sees
        them. "features" (an EAGLE head, whose position t reads token t + 1 and the target's
        feature of position t): the positions the target processed since the head last caught
        up, each with the token after it. "none" (n-gram lookup): nothing.

        ``batch_invariant``: a decoding request's draft length never depends on the rest of
        the batch. Its drafts (the policy's fixed length, cut only by its own max_tokens and
        max_model_len) are part of the slots and the token budget it needs to run a step; when
        they do not fit, it waits for a later step (budget) or others are preempted (blocks),
        as for any slot. So a seeded request draws the same numbers in the same rounds
        whatever it is batched with."""
        self.limits = limits
        self.kv = kv_cache
        self.stop_checker = stop_checker
        self.policy: SpeculationPolicy = policy or FixedDraft(0)
        self.speculative = speculative
        if draft_input not in ("tokens", "features", "none"):
            raise ValueError(f"draft_input must be tokens, features or none, got {draft_input!r}")
        self.draft_input = draft_input if speculative else "none"
        self.batch_invariant = batch_invariant
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._known_to_worker: set[str] = set()
        self._forget: list[str] = []
        self._forks: dict[str, list[Request]] = {}  # request id -> requests waiting to fork it
        self._fork_of: dict[str, str] = {}  # a waiting fork -> the request it shares blocks of
        self._sampled_once: set[str] = set()  # fork sources that sampled once, not yet ready
        self.lag = DrafterLag(kv_cache, self.draft_input)
        self.sleep = DrafterSleep(self.draft_input)
        self.prefix = PrefixSharing(kv_cache, self.draft_input) if kv_cache.caching else None
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request, fork_of: str | None = None) -> None:
        """Queue a request. With ``fork_of`` (a request of the same prompt, e.g. another of
        ``n`` completions) it waits until that one's target and drafter have processed the
        prompt's full blocks, then shares those blocks and computes only the rest. With the
        prefix cache on, every request does so (``PrefixSharing``): ``fork_of`` adds nothing."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        source = self.requests.get(fork_of) if fork_of is not None else None
        if source is not None and self.prefix is None and self._shareable(source) > 0:
            self._forks.setdefault(source.request_id, []).append(request)
        else:
            self.waiting.append(request)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status is RequestStatus.WAITING:
                if req in self.waiting:
                    self.waiting.remove(req)
                else:  # waiting to fork
                    for pending in self._forks.values():
                        if req in pending:
                            pending.remove(req)
            else:
                self.running.remove(req)
            req.finish_reason = FinishReason.ABORT
            self._finish(req)
            aborted.append(req)
        return aborted

    def compiling_grammars(self) -> list[Future[Any]]:
        """The grammars of waiting requests still being compiled."""
        return [r.grammar for r in self.waiting if r.grammar is not None and r.grammar_pending]

    def failed_grammars(self) -> list[Request]:
        """The waiting requests whose grammar failed to compile (a grammar still compiling is
        neither failed nor ready, so it is asked once and never twice)."""
        return [
            r
            for r in self.waiting
            if r.grammar is not None and r.grammar.done() and r.grammar.exception() is not None
        ]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or any(self._forks.values()))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.limits.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        preempted = self._schedule_running(chosen, budget)
        budget -= sum(n for _, n in chosen)
        shapes = self._grant_drafts(chosen, budget)
        budget -= sum(s.nodes for s in shapes.values())
        if not preempted or not chosen:  # a step that preempted everything admits the first
            self._admit(chosen, budget)

        out = SchedulerOutput(num_preempted=preempted, finished_request_ids=self._forget)
        if self.prefix is not None:
            out.block_copies, out.prefix_cache_queries, out.prefix_cache_hits = (
                self.prefix.take_step()
            )
        self._forget = []
        now = time.monotonic()
        for req, n in chosen:
            rid = req.request_id
            if rid not in self._known_to_worker:
                self._known_to_worker.add(rid)
                out.new_requests.append(self._new_request_data(req))
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            end = req.num_computed + n
            draft_tokens = self.lag.draft_tokens(req, n, end, rid in shapes, len(self.running))
            shape = shapes.get(rid, DraftShape())
            out.requests.append(
                ScheduledRequest(
                    request_id=rid,
                    target_token_ids=req.token_slice(req.num_computed, end),
                    target_start=req.num_computed,
                    draft_token_ids=draft_tokens,
                    draft_start=req.num_draft_computed,
                    num_draft=shape.nodes,
                    sample=end == req.num_tokens,
                    block_table=list(self.kv.block_table(rid)),
                    draft_shape=None if shape.is_chain else shape,
                    drafter_off=req.drafter_off,
                )
            )
        return out

    @staticmethod
    def _new_request_data(req: Request) -> NewRequestData:
        sp = req.sampling_params
        banned = list(sp.stop_token_ids or [])
        if sp.min_tokens and not sp.ignore_eos:
            banned.extend(sorted(req.eos_token_ids))
        return NewRequestData(
            req.request_id,
            sp,
            req.seed,
            req.prompt_token_ids,
            banned if sp.min_tokens else [],
            req.grammar.result() if req.grammar is not None else None,
        )

    def _schedule_running(self, chosen: list[tuple[Request, int]], budget: int) -> int:
        """Slots for every running request's unprocessed tokens; returns how many were preempted."""
        preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(self._to_compute(req), budget)
            need = n  # slots and budget this step takes
            if self.batch_invariant and self.speculative and req.num_tokens - req.num_computed == 1:
                need = 1 + self._own_shape(req).lookahead
                if need > budget:
                    break  # it and the requests after it wait for the next step
            while not self.kv.allocate(req.request_id, req.num_computed + need):
                victim = self.running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is req:
                    return preempted
            chosen.append((req, n))
            budget -= need
            i += 1
        return preempted

    @staticmethod
    def _to_compute(req: Request) -> int:
        """Tokens the target has yet to process this pass. A request resumed after preemption
        recomputes all but its last token, which it then decodes as before, drafts and all:
        its rounds (and the random numbers each draws) are those it would have had anyway."""
        left = req.num_tokens - req.num_computed
        if req.output_token_ids and left > 1:
            return left - 1
        return left

    def _own_shape(self, req: Request) -> DraftShape:
        """The policy's largest drafts cut by the request's own limits only."""
        room_len = self.limits.max_model_len - req.num_tokens
        room_out = req.max_output_tokens - len(req.output_token_ids) - 1
        return self.policy.shape.fit(max(0, min(room_len, room_out)))

    def _grant_drafts(
        self, chosen: list[tuple[Request, int]], budget: int
    ) -> dict[str, DraftShape]:
        """Drafts for decoding requests, within length limits, budget and free blocks."""
        if not self.speculative:
            return {}
        self.sleep.tick(len(self.running))
        decoding = [r for r, n in chosen if n == 1 and r.num_computed + 1 == r.num_tokens]
        plain = sum(r.drafter_off for r in decoding)
        decoding = [r for r in decoding if not r.drafter_off]
        if not decoding:
            return {}
        shapes: dict[str, DraftShape] = {}
        wants = self.policy.draft_shapes(decoding, self._prompt_rows(chosen, budget), plain)
        self.lag.wanted(any(w.nodes for w in wants), len(decoding))
        self.sleep.wanted(any(w.nodes for w in wants), self.running)
        for req, want in zip(decoding, wants, strict=True):
            room_len = self.limits.max_model_len - req.num_tokens
            room_out = req.max_output_tokens - len(req.output_token_ids) - 1
            shape = want.fit(max(0, min(room_len, room_out, budget)))
            if shape.nodes and not self.kv.allocate(
                req.request_id, req.num_computed + 1 + shape.lookahead
            ):
                fits = self.kv.max_slots_within_free(req.request_id) - req.num_computed - 1
                shape = shape.fit(max(0, fits))
                if shape.nodes:
                    ok = self.kv.allocate(req.request_id, req.num_computed + 1 + shape.lookahead)
                    assert ok, "slot arithmetic disagrees with the KV cache manager"
            if shape.nodes:
                shapes[req.request_id] = shape
                budget -= shape.nodes
        return shapes

    def _prompt_rows(self, chosen: list[tuple[Request, int]], budget: int) -> int:
        """The prompt rows this step's target pass will carry: the chunks of running requests
        and what admitting waiting ones will add (as far as seats and budget allow)."""
        rows = sum(n for r, n in chosen if is_prompt_chunk(r, n))
        seats = self.limits.max_num_seqs - len(self.running)
        waiting = sum(self._to_compute(r) for r in itertools.islice(self.waiting, max(seats, 0)))
        return rows + min(budget, waiting)

    def _admit(self, chosen: list[tuple[Request, int]], budget: int) -> None:
        """Admit waiting requests in order while blocks, sequence slots and budget last. A
        waiting request holds no block: it takes its cached blocks here (a fork without the
        prefix cache, its share of its source's blocks). A request whose grammar is still
        compiling, and with the prefix cache one whose next block another request is computing,
        lets the requests after it go first."""
        later: list[Request] = []  # compiling its grammar, or waiting for a block
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            req = self.waiting.popleft()
            if req.grammar_pending:
                later.append(req)
                continue
            copy = None
            if self.prefix is not None:
                start = self.prefix.start(req)
                if start is None:
                    later.append(req)
                    continue
                shared, copy = start
            else:
                shared = self._share_source_blocks(req)
            n = min(self._to_compute(req), budget)
            if not self.kv.allocate(req.request_id, req.num_computed + n):
                if shared:  # give the shared blocks back until it can run
                    self.kv.free(req.request_id)
                    req.num_computed = req.num_draft_computed = 0
                    req.drafter_off = False
                self.waiting.appendleft(req)
                break
            if self.prefix is not None:
                self.prefix.admitted(req, copy)
            self._fork_of.pop(req.request_id, None)
            req.status = RequestStatus.RUNNING
            self.sleep.admitted(req)
            self.running.append(req)
            chosen.append((req, n))
            budget -= n
        self.waiting.extendleft(reversed(later))

    def _share_source_blocks(self, req: Request) -> int:
        """For a fork: share the full prompt blocks its source's caches hold now (none if the
        source finished or was preempted); returns the slots shared."""
        source = self.requests.get(self._fork_of.get(req.request_id, ""))
        if source is None or not self.kv.has_table(source.request_id):
            return 0
        bs = self.kv.block_size
        shared = min(self.lag.filled(source), self._shareable(source)) // bs * bs
        if shared:
            self.kv.fork(req.request_id, source.request_id, shared // bs)
            req.num_computed = req.num_draft_computed = shared
        return shared

    def _preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop the request's cache and requeue it at the front."""
        if req.request_id in self._forks:
            self._fork_waiting(req)
        if self.prefix is not None:
            self.prefix.release(req)
        self.kv.free(req.request_id)
        req.num_computed = 0
        req.num_draft_computed = 0
        req.drafter_off = False
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # ---- after the step --------------------------------------------------------------------
    def update(self, plan: SchedulerOutput, result: StepResult) -> list[Request]:
        """Apply a step's results; returns the requests that emitted tokens or finished."""
        touched: list[Request] = []
        now = time.monotonic()
        for sr in plan.requests:
            req = self.requests.get(sr.request_id)
            if req is None or req.is_finished:
                continue  # aborted while the step ran
            if sr.request_id in result.prompt_logprobs:
                self._add_prompt_logprobs(req, *result.prompt_logprobs[sr.request_id])
            base = sr.target_start + len(sr.target_token_ids)
            drafted_into = sr.draft_start + len(sr.draft_token_ids)
            if not sr.sample:
                req.num_computed = base
                req.num_draft_computed = min(drafted_into, base)
                if self.prefix is not None:
                    self.prefix.publish(req, *self.lag.publishable(req))
                continue
            r = result.results[sr.request_id]
            if self.draft_input == "tokens" and sr.shape.is_chain:
                # a draft model keeps the K/V of its chain's drafts but the last (an EAGLE head
                # keeps only the target's positions; a tree's drafts sit in slots of their own)
                drafted_into += max(min(sr.num_draft, r.num_proposed) - 1, 0)
            req.num_computed = base + r.num_accepted
            req.num_draft_computed = min(drafted_into, req.num_computed)
            if req.request_id in self._forks:
                # an EAGLE head catches up on the prompt one step after the target
                if self._ready_to_fork(req) or req.request_id in self._sampled_once:
                    self._fork_waiting(req)
                else:
                    self._sampled_once.add(req.request_id)
            if r.num_proposed:
                req.spec.record(r.num_proposed, r.num_accepted, r.rejected)
                req.draft_lengths.append(r.num_proposed)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            for k, tok in enumerate(r.token_ids):
                req.token_times.append(now)
                if r.logprobs is not None:
                    req.output_logprobs.append(r.logprobs[k])
                if self.stop_checker.append(req, tok):
                    break
            if r.grammar_done and req.finish_reason is None:
                req.finish_reason = FinishReason.STOP  # the structured output is complete
            if self.prefix is not None:  # the accepted tokens are the request's now
                self.prefix.publish(req, *self.lag.publishable(req))
            if req.finish_reason is not None:
                self.running.remove(req)
                self._finish(req)
            else:
                self.kv.truncate(req.request_id, req.num_computed)
            touched.append(req)
        return touched

    @staticmethod
    def _add_prompt_logprobs(req: Request, first: int, entries: list) -> None:
        """Keep the prompt logprobs of positions not yet kept (a recomputed prompt repeats
        them)."""
        have = len(req.prompt_logprobs) + 1  # the next position to keep
        if first <= have < first + len(entries):
            req.prompt_logprobs.extend(entries[have - first :])

    def _shareable(self, req: Request) -> int:
        """Slots of ``req``'s prompt a fork could share: its full blocks before the last
        prompt token (which the fork computes itself, to sample from)."""
        bs = self.kv.block_size
        return (req.num_prompt_tokens - 1) // bs * bs

    def _ready_to_fork(self, req: Request) -> bool:
        return self.lag.filled(req) >= self._shareable(req)

    def _fork_waiting(self, source: Request) -> None:
        """Queue the requests waiting to fork ``source`` at the front; each shares its
        source's filled prompt blocks when admitted (``_share_source_blocks``)."""
        self._sampled_once.discard(source.request_id)
        for req in reversed(self._forks.pop(source.request_id, [])):
            self._fork_of[req.request_id] = source.request_id
            self.waiting.appendleft(req)

    def _finish(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED
        req.finished_time = time.monotonic()
        if req.request_id in self._forks:
            self._fork_waiting(req)
        self._fork_of.pop(req.request_id, None)
        if self.prefix is not None:
            self.prefix.release(req)
        self.kv.free(req.request_id)
        self.kv.forget(req.request_id)
        del self.requests[req.request_id]
        if req.request_id in self._known_to_worker:
            self._known_to_worker.discard(req.request_id)
            self._forget.append(req.request_id)
