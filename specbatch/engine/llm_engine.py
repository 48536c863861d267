"""The step loop: schedule, execute, update. Everything else is input checking and outputs."""

from __future__ import annotations

import itertools
import time
from typing import Any

from specbatch.config import EngineArgs, EngineConfig
from specbatch.engine.metrics import EngineMetrics
from specbatch.errors import EngineError, InvalidInputError
from specbatch.kv_cache.kv_cache_manager import KVCacheManager
from specbatch.outputs import CompletionOutput, RequestMetrics, RequestOutput
from specbatch.request import Request
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.adaptive import AdaptiveDraftLength
from specbatch.scheduler.scheduler import Scheduler, SchedulerLimits
from specbatch.scheduler.speculation import FixedDraftLength, SpeculationPolicy
from specbatch.stop_checker import StopChecker
from specbatch.tokenizer import encode_text, eos_token_ids, load_tokenizer, max_token_chars
from specbatch.worker.executor import Executor, UniprocExecutor

PromptInput = str | dict[str, Any] | list[int]


def create_executor(config: EngineConfig) -> Executor:
    if config.distributed_executor_backend == "ray":
        from specbatch.worker.ray_executor import RayExecutor

        return RayExecutor(config)
    return UniprocExecutor(config)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        tok_path = config.target.tokenizer_path
        self.tokenizer = load_tokenizer(tok_path) if tok_path else None
        self.eos_token_ids = eos_token_ids(
            config.target.hf_config, self.tokenizer, config.target.path
        )
        # A text prompt longer than this has more tokens than the prompt limit: refused unread.
        self.max_prompt_chars = (config.max_model_len - 1) * (
            max_token_chars(self.tokenizer) if self.tokenizer is not None else 1
        )
        self.executor = create_executor(config)
        try:
            num_blocks = self.executor.determine_num_kv_blocks()
            self.executor.init_kv_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv_cache = KVCacheManager(num_blocks, config.block_size)
        self.stop_checker = StopChecker(self.tokenizer)
        policy: SpeculationPolicy = FixedDraftLength(config.num_speculative_tokens)
        if config.adaptive_speculation:
            k = config.num_speculative_tokens
            policy = AdaptiveDraftLength(
                k, self.kv_cache, k + 1 if config.spec_method == "eagle" else 3
            )
        self.scheduler = Scheduler(
            SchedulerLimits(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
            ),
            self.kv_cache,
            self.stop_checker,
            policy=policy,
            speculative=config.speculative,
            draft_input={"ngram": "none", "eagle": "features"}.get(config.spec_method, "tokens"),
            batch_invariant=config.batch_invariant,
        )
        self.metrics = EngineMetrics()
        self._ids = itertools.count()
        self._seeds = itertools.count(1)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    # ---- requests --------------------------------------------------------------------------
    def prepare_prompt(
        self, prompt: PromptInput, field: str = "prompt", add_special_tokens: bool = True
    ) -> tuple[str | None, list[int]]:
        """Text and token ids of a prompt, checked against the vocabulary and max_model_len.

        A text prompt of more than ``max_prompt_chars`` characters is refused before it is
        tokenized: no tokenization of it could fit. ``add_special_tokens=False`` for text that
        already holds them (a rendered chat template)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return self.prepare_prompt(list(prompt["prompt_token_ids"]), field)
            if "prompt" in prompt:
                return self.prepare_prompt(prompt["prompt"], field, add_special_tokens)
            raise InvalidInputError(f"{field}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError(f"{field}: the prompt is empty")
            if self.tokenizer is None:
                raise InvalidInputError(
                    f"{field}: the model has no tokenizer, so prompts must be token ids "
                    "({'prompt_token_ids': [...]})"
                )
            if len(prompt) > self.max_prompt_chars:
                limit = self.config.max_model_len - 1
                raise InvalidInputError(
                    f"{field}: {len(prompt)} characters, more than the {self.max_prompt_chars} "
                    f"that any prompt within the limit of {limit} tokens can have (max_model_len "
                    f"{self.config.max_model_len} leaves room for one output token)"
                )
            text, ids = prompt, encode_text(self.tokenizer, prompt, add_special_tokens)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
            vocab = self.config.target.vocab_size
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise InvalidInputError(
                        f"{field}: token id {t!r} is outside the vocabulary [0, {vocab})"
                    )
        else:
            kind = type(prompt).__name__
            raise InvalidInputError(
                f"{field}: must be a string, a list of token ids or a dict, got {kind}"
            )
        if not ids:
            raise InvalidInputError(f"{field}: the prompt is empty (0 tokens)")
        limit = self.config.max_model_len - 1
        if len(ids) > limit:
            raise InvalidInputError(
                f"{field}: {len(ids)} tokens, more than the limit of {limit} "
                f"(max_model_len {self.config.max_model_len} leaves room for one output token)"
            )
        return text, ids

    def check_request(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        field: str = "prompt",
        add_special_tokens: bool = True,
    ) -> tuple[str | None, list[int]]:
        """Everything ``add_request`` would refuse, checked without adding anything. Reads only
        the tokenizer and the configuration: safe on another thread than the engine's."""
        if params.stop_strings and self.tokenizer is None:
            raise InvalidInputError("stop: stop strings need a tokenizer, and the model has none")
        return self.prepare_prompt(prompt, field, add_special_tokens)

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
    ) -> str:
        """Queue a request that ``check_request`` accepted (its text and token ids)."""
        rid = request_id if request_id is not None else str(next(self._ids))
        seed = params.seed
        if seed is None:  # derived from the engine's seed: reproducible from run to run
            seed = (self.config.seed * 1_000_003 + next(self._seeds)) % 2**63
        self.scheduler.add_request(
            Request(
                request_id=rid,
                prompt_token_ids=prompt_token_ids,
                sampling_params=params,
                max_model_len=self.config.max_model_len,
                eos_token_ids=self.eos_token_ids,
                prompt=text,
                seed=seed,
            )
        )
        return rid

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for req in self.scheduler.abort(ids):
            self.stop_checker.forget(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that emitted tokens or finished."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            if self.scheduler.has_unfinished():
                raise EngineError("the scheduler could not schedule any waiting request")
            return []
        result = self.executor.execute(plan)
        touched = self.scheduler.update(plan, result)
        seconds = time.perf_counter() - start
        self.scheduler.policy.observe(plan, result, seconds)
        self.metrics.on_step(plan, result, seconds)
        return [self._output(req) for req in touched]

    def _output(self, req: Request) -> RequestOutput:
        finished = req.is_finished
        if finished:
            text = self.stop_checker.finish_text(req)
            self.stop_checker.forget(req.request_id)
        else:
            text = self.stop_checker.text(req)
        reason = req.finish_reason.value if req.finish_reason else None
        completion = CompletionOutput(0, text, list(req.output_token_ids), reason, req.stop_reason)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=RequestMetrics.of(req),
        )

    # ---- introspection ---------------------------------------------------------------------
    @property
    def num_free_kv_blocks(self) -> int:
        return self.kv_cache.num_free_blocks

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def shutdown(self) -> None:
        self.executor.shutdown()
