"""An asyncio front end for ``LLMEngine``: one background loop steps the engine for everyone.

Every engine call (``add_request``, ``abort_request``, ``step``) runs on ONE dedicated thread, so
the engine is never touched from two threads at once and the event loop never blocks on a step.
Prompts are tokenized on a small pool of other threads (``prepare``: the tokenizer releases the
GIL), so a long prompt delays neither the event loop nor the steps of the requests running.
Each request gets an asyncio queue that the loop fills with the engine's ``RequestOutput``s
(cumulative text and token ids) as rounds accept tokens; a consumer that stops iterating (a
client that went away) aborts its request, which returns its KV blocks to the pool.

Admission: at most ``max_num_seqs + max_queue_len`` requests are unfinished at once; one more
raises ``QueueFullError``. After a step fails the engine is dead: every request in flight gets
the ``EngineError``, new requests are refused with it, and ``is_healthy`` is False.

Shutdown (``request_shutdown``): new requests are refused at once with ``ShutdownError``; those
in flight run on until a timeout, then each gets ``ShutdownError`` and is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from specbatch.config import EngineArgs
from specbatch.engine.engine_state import EngineState
from specbatch.engine.llm_engine import LLMEngine, PromptInput
from specbatch.errors import EngineError
from specbatch.outputs import RequestOutput
from specbatch.sampling_params import SamplingParams

T = TypeVar("T")
DEFAULT_MAX_QUEUE_LEN = 1024
TOKENIZER_THREADS = 2


class QueueFullError(RuntimeError):
    """The server holds as many waiting requests as ``max_queue_len`` allows."""


class ShutdownError(EngineError):
    """The server is shutting down: the request was refused, or aborted at the timeout."""


class RequestStream:
    """The outputs of one request, in order; iterate with ``async for``.

    Leaving the iteration early (``break``, cancellation, an exception in the consumer) aborts
    the request in the engine.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                if item.finished:
                    self.finished = True
                yield item
                if self.finished:
                    return
        finally:
            if not self.finished:
                self._engine.abort(self.request_id)

    async def final(self) -> RequestOutput:
        """Consume the stream and return the last (finished) output."""
        last: RequestOutput | None = None
        async for out in self:
            last = out
        assert last is not None
        return last


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_queue_len: int = DEFAULT_MAX_QUEUE_LEN) -> None:
        if isinstance(max_queue_len, bool) or not isinstance(max_queue_len, int):
            raise TypeError("max_queue_len must be an integer")
        if max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {max_queue_len}")
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.max_in_flight = engine.config.max_num_seqs + max_queue_len
        self.error: BaseException | None = None
        self.num_aborted = 0  # requests aborted before they finished (clients that went away)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specbatch-engine")
        self._tokenizers = ThreadPoolExecutor(
            max_workers=TOKENIZER_THREADS, thread_name_prefix="specbatch-tokenize"
        )
        self._streams: dict[str, RequestStream] = {}
        self._aborts: list[str] = []
        self._aborts_lock = threading.Lock()
        self._ids = itertools.count()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._finish_callbacks: list[Any] = []
        self.shutting_down = False
        self._shutdown_timer: asyncio.TimerHandle | None = None

    @classmethod
    def from_engine_args(
        cls, args: EngineArgs, max_queue_len: int = DEFAULT_MAX_QUEUE_LEN
    ) -> AsyncLLMEngine:
        return cls(LLMEngine.from_engine_args(args), max_queue_len)

    # ---- state -----------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self.error is None and (self._loop_task is None or not self._loop_task.done())

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def engine_state(self) -> EngineState:
        """The engine's counters and gauges now (for ``/metrics``; plain reads, no lock)."""
        return EngineState.of(self.engine)

    def replica_health(self) -> list[dict[str, Any]] | None:
        """Each data-parallel replica's status; None for one engine."""
        return None

    def on_finish(self, callback: Any) -> None:
        """Call ``callback(output)`` (on the event loop) for every request that finishes."""
        self._finish_callbacks.append(callback)

    # ---- requests --------------------------------------------------------------------------
    async def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str | None = None,
        field: str = "prompt",
    ) -> RequestStream:
        """Check and queue a request; raises ``InvalidInputError``, ``QueueFullError`` or
        ``EngineError`` before anything is queued."""
        self._check_admission()
        text, ids = await self.prepare(prompt, params, field)
        return await self.add_prepared(text, ids, params, request_id)

    async def prepare(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        field: str = "prompt",
        add_special_tokens: bool = True,
    ) -> tuple[str | None, list[int]]:
        """``LLMEngine.check_request`` on the tokenizer threads: the prompt's text and ids."""
        return await self.run_on_tokenizer_threads(
            self.engine.check_request, prompt, params, field, add_special_tokens
        )

    async def run_on_tokenizer_threads(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the tokenizer threads (work that reads only the tokenizer)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizers, fn, *args)

    async def add_prepared(
        self,
        text: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        stream: bool = True,
    ) -> RequestStream:
        """Queue a request that ``prepare`` accepted; raises ``QueueFullError`` or
        ``EngineError`` before anything is queued. ``stream``: the caller reads outputs before
        the last (a data-parallel engine sends only the last otherwise)."""
        self._check_admission()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in flight")
        stream = RequestStream(self, rid)
        self._streams[rid] = stream  # counted at once, so concurrent adds see the limit
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(
                self._thread, self.engine.add_checked_request, text, prompt_token_ids, params, rid
            )
        except asyncio.CancelledError:  # the add still runs on the engine thread: undo it
            self.abort(rid)
            raise
        except BaseException:
            self._streams.pop(rid, None)
            raise
        assert self._wake is not None
        self._wake.set()
        return stream

    def _check_admission(self) -> None:
        self._ensure_started()
        if self.shutting_down:
            raise ShutdownError("the server is shutting down and accepts no new requests")
        if self.error is not None:
            raise EngineError(f"the engine has failed: {self.error}")
        if len(self._streams) >= self.max_in_flight:
            raise QueueFullError(
                f"the server is full: {len(self._streams)} requests in flight "
                f"(max_num_seqs {self.engine.config.max_num_seqs} + max_queue_len "
                f"{self.max_queue_len}); retry later"
            )

    async def generate(
        self, prompt: PromptInput, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(prompt, params, request_id)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, non-blocking); applied before the next step."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self.num_aborted += 1
        with self._aborts_lock:
            self._aborts.append(request_id)
        if self._wake is not None:
            self._wake.set()

    def request_shutdown(self, timeout: float) -> None:
        """Refuse new requests from now on and abort those still in flight ``timeout`` seconds
        from now. Safe from any thread and from a signal handler."""
        self.shutting_down = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._arm_shutdown, timeout)

    def _arm_shutdown(self, timeout: float) -> None:
        if self._shutdown_timer is None and self._loop is not None:
            self._shutdown_timer = self._loop.call_later(timeout, self._abort_all)

    def _abort_all(self) -> None:
        err = ShutdownError("the server shut down before the request finished")
        for rid, stream in list(self._streams.items()):
            self.abort(rid)
            stream.put(err)

    # ---- the loop --------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            self._loop_task = self._loop.create_task(self._run())

    async def start(self) -> None:
        self._ensure_started()

    def _step(self) -> tuple[list[RequestOutput], bool]:
        """On the engine thread: apply aborts, then one step if there is work."""
        with self._aborts_lock:
            aborts, self._aborts = self._aborts, []
        if aborts:
            self.engine.abort_request(aborts)
        if not self.engine.has_unfinished_requests():
            return [], False
        outputs = self.engine.step()
        return outputs, self.engine.has_unfinished_requests()

    async def _run(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()  # before the step: a request added during it sets it again
            try:
                outputs, more = await loop.run_in_executor(self._thread, self._step)
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # the engine is dead: fail everyone, refuse new ones
                self._fail(e)
                return
            self._deliver(outputs)
            if not more:
                await self._wake.wait()
            else:
                await asyncio.sleep(0)  # let handlers send what arrived

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                for cb in self._finish_callbacks:
                    with contextlib.suppress(Exception):
                        cb(out)
            if stream is not None:
                stream.put(out)

    def _fail(self, e: BaseException) -> None:
        err = e if isinstance(e, EngineError) else EngineError(f"{type(e).__name__}: {e}")
        self.error = err
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(err)

    async def shutdown(self) -> None:
        if self._shutdown_timer is not None:
            self._shutdown_timer.cancel()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(BaseException):
                await self._loop_task
        loop = asyncio.get_running_loop()
        with contextlib.suppress(Exception):
            await loop.run_in_executor(self._thread, self.engine.shutdown)
        self._thread.shutdown(wait=False)
        self._tokenizers.shutdown(wait=False, cancel_futures=True)
