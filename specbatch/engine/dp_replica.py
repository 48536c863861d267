"""One data-parallel replica: an ``LLMEngine`` inside a Ray actor, stepped by a thread of its own.

The driver (``data_parallel.py``) calls ``load`` once, then ``submit`` (requests to add and to
abort) and ``poll`` (the outputs since the last poll, and how loaded the replica is). The engine
thread steps whenever there is work, so the replica never waits for the driver: a poll collects
whatever has accumulated, or waits for something to happen. Ray runs a threaded actor's calls in
any order, so every control message carries a sequence number and they are applied in that
order: an abort never overtakes its request.

With a tensor-parallel size above 1 the engine's ranks are Ray actors of their own, started in
this replica's bundle of the placement group.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from specbatch.config import EngineConfig
from specbatch.engine.engine_state import EngineState
from specbatch.engine.metrics import EngineMetrics
from specbatch.outputs import RequestOutput
from specbatch.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _run_at_normal_priority() -> None:
    """Undo the niceness Ray gives its workers (15, unless the cluster was started with
    ``RAY_worker_niceness=0``): a replica is the engine, not background work. Lowering it needs
    the privilege to; without it the replica says so and runs on."""
    if os.nice(0) <= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        logger.warning(
            "this replica runs at nice %d and cannot lower it; start the Ray nodes with "
            "RAY_worker_niceness=0 so that it does not yield the CPU to other work",
            os.nice(0),
        )


@dataclass
class ReplicaRequest:
    request_id: str
    text: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False  # every output as it grows, or only the finished one


def token_budget(req: ReplicaRequest, max_model_len: int) -> int:
    """The tokens a request may still cost a replica: its prompt and every output token it may
    generate (all ``n`` completions)."""
    room = max_model_len - len(req.prompt_token_ids)
    p = req.params
    new = min(p.max_tokens, room) if p.max_tokens is not None else room
    return len(req.prompt_token_ids) + max(new, 0) * p.n


@dataclass
class Control:
    """Requests to add and to abort, applied in ``seq`` order (from 1)."""

    seq: int
    adds: list[ReplicaRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    reset_metrics: EngineMetrics | None = None  # fresh counters to count in from now on


@dataclass
class ReplicaUpdate:
    outputs: list[RequestOutput]  # finished requests', and streamed ones' as they grow
    applied_seq: int  # the last control message applied
    outstanding_tokens: int  # prompt and output tokens the replica's requests may still cost
    waiting: int  # requests not yet in the batch, messages not yet applied included
    state: EngineState
    refused: list[tuple[str, str]] = field(default_factory=list)  # (request id, why)
    error: str | None = None  # the engine failed: nothing runs here any more


@dataclass
class _Tracked:
    stream: bool
    prompt_tokens: int
    budget: int
    generated: int = 0

    @property
    def outstanding(self) -> int:
        left = max(self.budget - self.generated, 0)
        return left - (self.prompt_tokens if self.generated else 0)


class EngineReplica:
    """The body of a replica's Ray actor (``ray.remote(EngineReplica)``, threaded)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.engine: Any = None
        self._cond = threading.Condition()
        self._inbox: dict[int, Control] = {}
        self._next_seq = 1
        self._applied_seq = 0
        self._in_transit = 0  # adds taken from the inbox, not yet published
        self._outbox: list[RequestOutput] = []
        self._refused: list[tuple[str, str]] = []
        self._tracked: dict[str, _Tracked] = {}
        self._outstanding = 0
        self._state = EngineState()
        self._error: str | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def where(self) -> tuple[str, str, int]:
        """(Ray node id, node IP, pid) of this replica."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def load(self, config: EngineConfig, threads: int, placement: tuple[Any, int] | None) -> int:
        """Build the engine (its tensor-parallel ranks in ``placement``'s bundle) and start
        stepping; returns the engine's KV blocks."""
        import torch

        from specbatch.engine.llm_engine import LLMEngine

        torch.set_num_threads(threads)
        _run_at_normal_priority()
        executor = None
        if config.tensor_parallel_size > 1:
            from specbatch.distributed.ray_settings import THREADS_ENV
            from specbatch.worker.ray_executor import RayExecutor

            os.environ.setdefault(THREADS_ENV, str(threads))
            executor = RayExecutor(config, placement=placement)
        self.engine = LLMEngine(config, executor)
        with self._cond:
            self._state = self._stamped(EngineState.of(self.engine, copy_metrics=True))
        self._thread = threading.Thread(
            target=self._loop, args=(threads,), name=f"specbatch-dp{self.index}", daemon=True
        )
        self._thread.start()
        return int(self.engine.num_kv_blocks)

    # ---- calls from the driver -------------------------------------------------------------
    def submit(self, control: Control) -> None:
        with self._cond:
            if control.seq >= self._next_seq:
                self._inbox[control.seq] = control
                self._cond.notify_all()

    def poll(self, control: Control | None, low_water: int, timeout: float) -> ReplicaUpdate:
        """Apply ``control`` (if any), then wait up to ``timeout`` seconds for outputs, a
        failure, or the waiting requests falling to ``low_water`` (-1: never), and return them
        with the replica's load."""
        if control is not None:
            self.submit(control)
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (
                self._outbox
                or self._refused
                or self._error
                or self._closed
                or self._waiting() <= low_water
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            outputs, self._outbox = self._outbox, []
            refused, self._refused = self._refused, []
            return ReplicaUpdate(
                outputs=outputs,
                applied_seq=self._applied_seq,
                outstanding_tokens=self._outstanding,
                waiting=self._waiting(),
                state=self._state,
                refused=refused,
                error=self._error,
            )

    def stats(self, min_seq: int, timeout: float) -> EngineState:
        """The engine's state once every control message up to ``min_seq`` was applied."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._applied_seq < min_seq and not self._error:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"replica {self.index}: message {min_seq} not applied")
                self._cond.wait(left)
            return self._state

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.engine is not None:
            self.engine.shutdown()

    # ---- the engine thread -----------------------------------------------------------------
    def _waiting(self) -> int:
        queued = sum(len(c.adds) for c in self._inbox.values())
        return self._state.waiting + self._in_transit + queued

    def _take_controls(self) -> list[Control]:
        taken = []
        while self._next_seq in self._inbox:
            taken.append(self._inbox.pop(self._next_seq))
            self._next_seq += 1
        self._in_transit += sum(len(c.adds) for c in taken)
        return taken

    def _loop(self, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)  # OpenMP's thread count is per thread
        busy = False
        while True:
            with self._cond:
                while not self._closed and not busy and self._next_seq not in self._inbox:
                    self._cond.wait()
                if self._closed:
                    return
                controls = self._take_controls()
            refused: list[tuple[str, str]] = []
            for c in controls:
                self._apply(c, refused)
            outputs: list[RequestOutput] = []
            error = None
            try:
                if self.engine.has_unfinished_requests():
                    outputs = self._collect(self.engine.step())
                busy = self.engine.has_unfinished_requests()
            except BaseException as e:  # the engine is dead; the driver moves its requests
                error = f"{type(e).__name__}: {e}"
            self._publish(controls, outputs, refused, error)
            if error is not None:
                return

    def _apply(self, control: Control, refused: list[tuple[str, str]]) -> None:
        e = self.engine
        if control.reset_metrics is not None:
            e.metrics = control.reset_metrics
        if control.aborts:
            e.abort_request(control.aborts)
            for rid in control.aborts:
                self._tracked.pop(rid, None)
        max_len = e.config.max_model_len
        for r in control.adds:
            try:
                e.add_checked_request(r.text, r.prompt_token_ids, r.params, r.request_id)
            except Exception as err:
                refused.append((r.request_id, f"{type(err).__name__}: {err}"))
                continue
            prompt = len(r.prompt_token_ids)
            self._tracked[r.request_id] = _Tracked(r.stream, prompt, token_budget(r, max_len))

    def _collect(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs the driver gets: finished ones, and streamed ones as they grow."""
        sent = []
        for out in outputs:
            t = self._tracked.get(out.request_id)
            if t is None:
                continue
            t.generated = sum(len(c.token_ids) for c in out.outputs)
            if out.finished:
                del self._tracked[out.request_id]
            if out.finished or t.stream:
                sent.append(out)
        return sent

    def _stamped(self, state: EngineState) -> EngineState:
        """``state`` numbered after the last one published (call holding ``_cond``)."""
        state.snapshot = self._state.snapshot + 1
        return state

    def _publish(
        self,
        controls: list[Control],
        outputs: list[RequestOutput],
        refused: list[tuple[str, str]],
        error: str | None,
    ) -> None:
        state = EngineState.of(self.engine, copy_metrics=True)
        outstanding = sum(t.outstanding for t in self._tracked.values())
        with self._cond:
            self._outbox.extend(outputs)
            self._refused.extend(refused)
            self._in_transit = 0
            if controls:
                self._applied_seq = controls[-1].seq
            self._state = self._stamped(state)
            self._outstanding = outstanding
            self._error = error
            self._cond.notify_all()
