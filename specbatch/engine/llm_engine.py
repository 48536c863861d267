"""The step loop: schedule, execute, update. Everything else is input checking and outputs."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import Any

from specbatch.config import EngineArgs, EngineConfig
from specbatch.drafters import DRAFTERS
from specbatch.engine.calibration import calibrate
from specbatch.engine.metrics import EngineMetrics
from specbatch.errors import EngineError, InvalidInputError
from specbatch.grammar.compiler import GrammarCompilerPool
from specbatch.kv_cache.block_keys import salt_of
from specbatch.kv_cache.kv_cache_manager import KVCacheManager
from specbatch.outputs import (
    CompletionOutput,
    PositionLogprobDict,
    RequestMetrics,
    RequestOutput,
    logprob_dicts,
)
from specbatch.request import PositionLogprobs, Request
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.draft_controller import DraftController, ladder
from specbatch.scheduler.scheduler import Scheduler, SchedulerLimits
from specbatch.scheduler.speculation import FixedDraft, SpeculationPolicy
from specbatch.stop_checker import StopChecker
from specbatch.tokenizer import encode_text, eos_token_ids, load_tokenizer, max_token_chars
from specbatch.worker.executor import Executor, UniprocExecutor

PromptInput = str | dict[str, Any] | list[int]
GRAMMAR_WAIT_S = 0.05  # the longest an idle step waits for a grammar to compile
logger = logging.getLogger(__name__)


def cache_salt(config: EngineConfig) -> bytes:
    """The root of the prefix cache's keys: what a block's K/V depend on besides its tokens."""
    models = [(m.path, str(m.dtype)) for m in (config.target, config.draft) if m is not None]
    spec = config.speculative_config
    return salt_of(
        models,
        spec.method if spec.speculative else None,
        config.batch_invariant,
        config.tensor_parallel_size,
        spec.draft_tensor_parallel_size,
        config.attention_backend,
        config.block_size,
    )


def create_executor(config: EngineConfig) -> Executor:
    if config.distributed_executor_backend == "ray":
        from specbatch.worker.ray_executor import RayExecutor

        return RayExecutor(config)
    return UniprocExecutor(config)


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        """``executor``: the workers to run on (default: ``create_executor(config)``); the
        engine owns it from then on and shuts it down."""
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
        self.executor = executor or create_executor(config)
        try:
            num_blocks = self.executor.determine_num_kv_blocks()
            kv_prices = self.executor.init_kv_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv_cache = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, cache_salt(config)
        )
        self.grammars = GrammarCompilerPool(
            self.tokenizer, config.target.vocab_size, self.eos_token_ids
        )
        self.stop_checker = StopChecker(self.tokenizer)
        spec = config.speculative_config
        policy: SpeculationPolicy = FixedDraft(spec.shape)
        kind = DRAFTERS.get(spec.method)
        if spec.auto:
            largest = spec.shape
            policy = DraftController(ladder(largest.depth, largest.topk, largest.nodes), kv_prices)
        self._draft_input = kind.draft_input if kind is not None else "none"
        if isinstance(policy, DraftController):
            self._calibrate(policy)
        self.scheduler = self._new_scheduler(policy, self.stop_checker)
        self.metrics = EngineMetrics()
        self._ids = itertools.count()
        self._seeds = itertools.count(1)
        self._groups: dict[str, list[Request]] = {}  # request id -> its n completions
        self._group_of: dict[str, str] = {}  # completion's request id -> request id
        self._done: dict[str, CompletionOutput] = {}  # finished completions of open groups
        # ("output" or "prompt", request id) -> its logprobs converted so far
        self._logprobs: dict[tuple[str, str], list[PositionLogprobDict]] = {}
        self._token_texts: dict[int, str] = {}  # token id -> its text, for logprobs
        # what exists now (models, tokenizer, modules) lives as long as the engine: a full
        # collection would walk it all again and again, so later collections leave it out
        gc.collect()
        gc.freeze()

    def _new_scheduler(self, policy: SpeculationPolicy, stop_checker: StopChecker) -> Scheduler:
        config = self.config
        return Scheduler(
            SchedulerLimits(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
            ),
            self.kv_cache,
            stop_checker,
            policy=policy,
            speculative=config.speculative_config.speculative,
            draft_input=self._draft_input,
            batch_invariant=config.batch_invariant,
        )

    def _calibrate(self, controller: DraftController) -> None:
        """Time the passes ``auto`` prices before any request arrives (calibration.py)."""
        try:
            calibrate(
                controller,
                lambda policy: self._new_scheduler(policy, StopChecker(self.tokenizer)),
                self.executor.execute,
                self.config.target.vocab_size,
                self.config.max_model_len,
                self.config.max_num_seqs,
            )
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv_cache.reset_prefix_cache()

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
            raise InvalidInputError(
                f"{field}: a dict prompt needs 'prompt' or 'prompt_token_ids'", field
            )
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError(f"{field}: the prompt is empty", field)
            if self.tokenizer is None:
                raise InvalidInputError(
                    f"{field}: the model has no tokenizer, so prompts must be token ids "
                    "({'prompt_token_ids': [...]})",
                    field,
                )
            if len(prompt) > self.max_prompt_chars:
                limit = self.config.max_model_len - 1
                raise InvalidInputError(
                    f"{field}: {len(prompt)} characters, more than the {self.max_prompt_chars} "
                    f"that any prompt within the limit of {limit} tokens can have (max_model_len "
                    f"{self.config.max_model_len} leaves room for one output token)",
                    field,
                )
            text, ids = prompt, encode_text(self.tokenizer, prompt, add_special_tokens)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
            vocab = self.config.target.vocab_size
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise InvalidInputError(
                        f"{field}: token id {t!r} is outside the vocabulary [0, {vocab})", field
                    )
        else:
            kind = type(prompt).__name__
            raise InvalidInputError(
                f"{field}: must be a string, a list of token ids or a dict, got {kind}", field
            )
        if not ids:
            raise InvalidInputError(f"{field}: the prompt is empty (0 tokens)", field)
        limit = self.config.max_model_len - 1
        if len(ids) > limit:
            raise InvalidInputError(
                f"{field}: {len(ids)} tokens, more than the limit of {limit} "
                f"(max_model_len {self.config.max_model_len} leaves room for one output token)",
                field,
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
            raise InvalidInputError(
                "stop: stop strings need a tokenizer, and the model has none", "stop"
            )
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)
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
        """Queue a request that ``check_request`` accepted (its text and token ids). With
        ``n > 1`` its completions are requests of their own (ids ``ID``, ``ID#1``, ...) that
        share the prompt's KV blocks, each with its own random stream."""
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self._groups or any(f"{rid}#{i}" in self._group_of for i in range(params.n)):
            raise ValueError(f"request_id {rid!r} is already in use")
        seed = params.seed
        if seed is None:  # derived from the engine's seed: reproducible from run to run
            seed = (self.config.seed * 1_000_003 + next(self._seeds)) % 2**63
        grammar = None
        if params.structured_outputs is not None:  # compiled off the step loop
            grammar = self.grammars.compile(params.structured_outputs)
        members = []
        for i in range(params.n):
            # the prompt's logprobs come with the first completion only
            own = dataclasses.replace(params, n=1, prompt_logprobs=None) if i else params
            member = Request(
                request_id=f"{rid}#{i}" if i else rid,
                prompt_token_ids=prompt_token_ids,
                sampling_params=own,
                max_model_len=self.config.max_model_len,
                eos_token_ids=self.eos_token_ids,
                prompt=text,
                seed=seed if not i else (seed * 1_000_003 + i) % 2**63,
                grammar=grammar,
            )
            self.scheduler.add_request(member, fork_of=rid if i else None)
            members.append(member)
        if params.n > 1:
            self._groups[rid] = members
            for m in members:
                self._group_of[m.request_id] = rid
        return rid

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        members: list[str] = []
        for rid in ids:
            self._logprobs.pop(("prompt", rid), None)
            group = self._groups.pop(rid, None)
            if group is None:
                members.append(rid)
                continue
            for m in group:
                members.append(m.request_id)
                self._group_of.pop(m.request_id, None)
                self._done.pop(m.request_id, None)
        for req in self.scheduler.abort(members):
            self._forget(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that emitted tokens or finished."""
        start = time.perf_counter()
        failed = self._drop_failed_grammars()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            pending = self.scheduler.compiling_grammars()
            if pending:  # nothing runs until a grammar is compiled
                wait_futures(pending, timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)
            elif self.scheduler.has_unfinished() and not failed:
                raise EngineError("the scheduler could not schedule any waiting request")
            return failed
        result = self.executor.execute(plan)
        touched = self.scheduler.update(plan, result)
        outputs = self._outputs_of(touched)
        seconds = time.perf_counter() - start  # the whole step: the policy prices it all
        if not self.scheduler.sleep.asleep:  # a sleeping drafter's policy learns nothing
            self.scheduler.policy.observe(plan, result, seconds)
        self.metrics.on_step(plan, result, seconds)
        return failed + outputs

    def _outputs_of(self, touched: list[Request]) -> list[RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        for req in touched:
            rid = self._group_of.get(req.request_id, req.request_id)
            if rid not in outputs:
                outputs[rid] = self._output(rid, req)
        return list(outputs.values())

    def _drop_failed_grammars(self) -> list[RequestOutput]:
        """Finish (as aborted) the waiting requests whose grammar failed to compile."""
        failed = self.scheduler.failed_grammars()
        if not failed:
            return []
        for r in failed:
            assert r.grammar is not None
            logger.error("request %s: its grammar failed to compile: %s", r.request_id,
                         r.grammar.exception())  # fmt: skip
        return self._outputs_of(self.scheduler.abort([r.request_id for r in failed]))

    def _completion(self, req: Request, index: int) -> CompletionOutput:
        """A completion as it stands (its final form once it finished)."""
        if req.request_id in self._done:
            return self._done[req.request_id]
        finished = req.is_finished
        text = self.stop_checker.finish_text(req) if finished else self.stop_checker.text(req)
        reason = req.finish_reason.value if req.finish_reason else None
        out = CompletionOutput(index, text, list(req.output_token_ids), reason, req.stop_reason)
        if req.sampling_params.logprobs is not None:
            key = ("output", req.request_id)
            texts = self.stop_checker.token_texts(req)
            out.logprobs = self._converted(key, req.output_logprobs, req.output_token_ids, texts)
            out.cumulative_logprob = sum(e[0] for e in req.output_logprobs)
        if finished:
            self._forget(req)
            if req.request_id in self._group_of:
                self._done[req.request_id] = out
        return out

    def _converted(
        self,
        key: tuple[str, str],
        entries: list[PositionLogprobs],
        tokens: list[int],
        texts: list[str] | None = None,
    ) -> list[PositionLogprobDict]:
        """``entries`` (of ``tokens``) in vLLM's shape, converting only the ones not converted
        at an earlier step under ``key``; ``texts``: each token's share of the text, for the
        chosen tokens (a token alone may decode to half a character)."""
        done = self._logprobs.setdefault(key, [])
        n = len(done)
        done.extend(logprob_dicts(entries[n:], tokens[n : len(entries)], self._decoder()))
        if texts is not None:
            for i in range(n, len(done)):
                done[i][tokens[i]].decoded_token = texts[i]
        return list(done)

    def _decoder(self) -> Any:
        """Token id -> its text, decoded once per id (None without a tokenizer)."""
        tok, texts = self.tokenizer, self._token_texts
        if tok is None:
            return None

        def decode(t: int) -> str:
            text = texts.get(t)
            if text is None:
                text = texts[t] = tok.decode([t])
            return text

        return decode

    def _forget(self, req: Request) -> None:
        self.stop_checker.forget(req.request_id)
        self._logprobs.pop(("output", req.request_id), None)

    def _output(self, rid: str, req: Request) -> RequestOutput:
        """``rid``'s output after a step that touched ``req``, one of its completions."""
        members = self._groups.get(rid) or [req]
        first = members[0]
        prompt_lps = None
        if first.sampling_params.prompt_logprobs is not None:
            key = ("prompt", rid)
            scored = self._converted(key, first.prompt_logprobs, first.prompt_token_ids[1:])
            prompt_lps = [None, *scored]
        completions = [self._completion(m, i) for i, m in enumerate(members)]
        finished = all(m.is_finished for m in members)
        if finished:
            self._logprobs.pop(("prompt", rid), None)
        if finished and rid in self._groups:
            del self._groups[rid]
            for m in members:
                self._group_of.pop(m.request_id, None)
                self._done.pop(m.request_id, None)
        return RequestOutput(
            request_id=rid,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=RequestMetrics.of(first),
            prompt_logprobs=prompt_lps,
            num_cached_tokens=first.num_cached_tokens,
        )

    # ---- introspection ---------------------------------------------------------------------
    def num_requests(self) -> tuple[int, int]:
        """Requests running (a completion in the batch) and waiting, ``n > 1`` counted once.
        Reads copies of the scheduler's collections: safe from another thread."""
        group = self._group_of
        running = {group.get(r.request_id, r.request_id) for r in list(self.scheduler.running)}
        unfinished = {group.get(rid, rid) for rid in list(self.scheduler.requests)}
        return len(running), len(unfinished - running)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (blocks in use stay with their requests)."""
        self.kv_cache.reset_prefix_cache()
        return True

    @property
    def num_free_kv_blocks(self) -> int:
        return self.kv_cache.num_free_blocks

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.executor.shutdown()
