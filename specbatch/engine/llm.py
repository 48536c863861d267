"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)`` and ``.chat(messages)``,
as in vLLM."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from specbatch.chat import Message, check_messages, conversations_of, render_chat
from specbatch.config import EngineArgs
from specbatch.engine.data_parallel import DataParallelEngine, create_engine
from specbatch.engine.llm_engine import LLMEngine, PromptInput
from specbatch.errors import EngineError, InvalidInputError
from specbatch.outputs import RequestOutput
from specbatch.sampling_params import SamplingParams


class LLM:
    """An engine in this process, for offline batch generation.

    ``LLM(model=DIR, draft_model=DRAFT, num_speculative_tokens=4, ...)`` takes every
    ``EngineArgs`` field as a keyword. With ``data_parallel_size=N`` (N > 1) the engine is N
    replicas on a Ray cluster (``DataParallelEngine``), each taking prompts as it has room.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine: LLMEngine | DataParallelEngine = create_engine(
            EngineArgs(model=model, **kwargs)
        )

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        Every prompt is checked before any work starts. If generation fails or is interrupted,
        the requests of this call are aborted, so the KV pool is whole again.
        """
        return self._generate(_as_prompt_list(prompts), sampling_params, use_tqdm, True)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of ``{"role", "content"}`` messages) or to each
        of a list of them, as vLLM's ``LLM.chat``: each is rendered by ``chat_template`` (else
        the tokenizer's), ending with the assistant's turn, and generated from like a prompt."""
        conversations = conversations_of(messages)
        tok = self.engine.tokenizer
        texts: list[PromptInput] = [
            render_chat(
                tok,
                check_messages(c, f"messages[{i}]" if len(conversations) > 1 else "messages"),
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
            )
            for i, c in enumerate(conversations)
        ]
        return self._generate(texts, sampling_params, use_tqdm, False)

    def _generate(
        self,
        items: list[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        add_special_tokens: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            params = [SamplingParams()] * len(items)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise InvalidInputError(
                    f"sampling_params: {len(params)} given for {len(items)} prompts"
                )
        checked = [
            self.engine.check_request(p, sp, f"prompts[{i}]", add_special_tokens)
            for i, (p, sp) in enumerate(zip(items, params))
        ]  # all or nothing: a bad prompt leaves no request of this call behind
        ids = [
            self.engine.add_checked_request(text, tokens, sp)
            for (text, tokens), sp in zip(checked, params)
        ]
        done: dict[str, RequestOutput] = {}
        try:
            self._run(set(ids), done, use_tqdm)
        except BaseException as e:
            self.engine.abort_request(ids)
            if isinstance(e, EngineError):
                e.outputs = [done.get(i) for i in ids]
            raise
        return [done[i] for i in ids]

    def _run(self, pending: set[str], done: dict[str, RequestOutput], use_tqdm: bool) -> None:
        """Step until every request of ``pending`` finished, its output put in ``done``."""
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(pending), desc="Generating", unit="req", dynamic_ncols=True)
        start, tokens = time.perf_counter(), 0
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        tokens += sum(len(c.token_ids) for c in out.outputs)
                        if bar is not None:
                            bar.update(1)
                            rate = tokens / max(time.perf_counter() - start, 1e-9)
                            bar.set_postfix_str(f"{rate:.1f} tok/s")
        finally:
            if bar is not None:
                bar.close()

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix-cache entry, as vLLM's ``LLM.reset_prefix_cache``."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if (
        isinstance(prompts, (list, tuple))
        and prompts
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)
    ):
        return [list(prompts)]  # a single prompt given as token ids
    if not isinstance(prompts, (list, tuple)):
        raise InvalidInputError(
            f"prompts: expected a string, a dict or a list of them, got {type(prompts).__name__}",
            "prompts",
        )
    if not prompts:
        raise InvalidInputError("prompts: the list is empty", "prompts")
    return list(prompts)
