"""The server's engine over data-parallel replicas: ``AsyncLLMEngine``'s interface (admission,
streams, aborts, shutdown) on a ``DataParallelEngine`` that routes each request at once to the
replica with the fewest outstanding tokens.

No engine thread: Ray calls do not block, so requests go to their replica straight from the event
loop, and one task per replica awaits its polls and hands the outputs to the request streams. A
replica that dies is marked down: its requests that had streamed nothing yet go to the others,
the rest end with an ``EngineError`` (a 500), and the other replicas keep serving; the engine
fails as a whole only when no replica is left.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from specbatch.config import EngineArgs
from specbatch.engine.async_engine import DEFAULT_MAX_QUEUE_LEN, AsyncLLMEngine, RequestStream
from specbatch.engine.data_parallel import POLL_S, DataParallelEngine
from specbatch.engine.dp_placement import failure_of
from specbatch.engine.engine_state import EngineState
from specbatch.errors import EngineError
from specbatch.sampling_params import SamplingParams


def create_async_engine(
    args: EngineArgs, max_queue_len: int = DEFAULT_MAX_QUEUE_LEN
) -> AsyncLLMEngine:
    """One engine, or ``data_parallel_size`` replicas behind the same interface."""
    config = args.create_engine_config()
    if config.data_parallel_size > 1:
        return AsyncDataParallelEngine(
            DataParallelEngine(config, route_at_once=True), max_queue_len
        )
    from specbatch.engine.llm_engine import LLMEngine

    return AsyncLLMEngine(LLMEngine(config), max_queue_len)


class AsyncDataParallelEngine(AsyncLLMEngine):
    engine: DataParallelEngine  # type: ignore[assignment]

    def __init__(
        self, engine: DataParallelEngine, max_queue_len: int = DEFAULT_MAX_QUEUE_LEN
    ) -> None:
        super().__init__(engine, max_queue_len)  # type: ignore[arg-type]
        self.max_in_flight = engine.config.max_num_seqs * len(engine.replicas) + max_queue_len

    @property
    def is_healthy(self) -> bool:
        return super().is_healthy and bool(self.engine.replica_set.live)

    def engine_state(self) -> EngineState:
        return self.engine.state()

    def replica_health(self) -> list[dict[str, Any]] | None:
        return self.engine.replica_health()

    async def add_prepared(
        self,
        text: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        stream: bool = True,
    ) -> RequestStream:
        self._check_admission()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in flight")
        out = RequestStream(self, rid)
        self._streams[rid] = out
        try:
            self.engine.add_checked_request(text, prompt_token_ids, params, rid, stream=stream)
        except BaseException:
            self._streams.pop(rid, None)
            raise
        return out

    def abort(self, request_id: str) -> None:
        """Abort a request on its replica (call on the event loop)."""
        if self._streams.pop(request_id, None) is None:
            return
        self.num_aborted += 1
        self.engine.abort_request([request_id])

    # ---- the loop --------------------------------------------------------------------------
    async def _run(self) -> None:
        pumps = [asyncio.ensure_future(self._pump(r.index)) for r in self.engine.replicas]
        try:
            await asyncio.gather(*pumps)
        finally:
            for task in pumps:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def _pump(self, i: int) -> None:
        """Await replica ``i``'s polls and deliver what they bring, until it is down."""
        import ray

        replica = self.engine.replicas[i]
        while replica.alive:
            ref = replica.actor.poll.remote(None, -1, POLL_S)
            try:
                update = await asyncio.wait_for(
                    asyncio.wrap_future(ref.future()), self.engine.hung_after_s
                )
            except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
                why = (
                    f"no reply within {self.engine.hung_after_s:g} s (hung?)"
                    if isinstance(e, asyncio.TimeoutError)
                    else failure_of(e)
                )
                if replica.alive:
                    self.engine.lose(i, why)
                outputs = []
            else:
                outputs = self.engine.absorb(i, update)
            self._deliver(outputs)
            for rid, err in self.engine.take_failures():
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    stream.put(err)
            if not self.engine.replica_set.live:
                down = "; ".join(
                    f"replica {r.index} ({r.where}): {r.error}" for r in self.engine.replicas
                )
                self._fail(EngineError(f"every data-parallel replica failed: {down}"))
