"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specbatch.errors import InvalidInputError
from specbatch.structured_outputs import StructuredOutputsParams

_EPS_GREEDY = 1e-5  # temperatures below this are treated as greedy, as vLLM does
MAX_LOGPROBS = 20  # the most top alternatives a token's logprobs may list (OpenAI's limit)
MAX_N = 128  # the most completions of one prompt (OpenAI's limit)


@dataclass
class SamplingParams:
    """How to sample one request's continuation.

    ``temperature == 0`` means greedy. ``top_k == 0`` (or -1) and ``top_p == 1`` switch those
    filters off. ``max_tokens=None`` generates until a stop condition or ``max_model_len``.
    A request with ``seed`` draws every random number from its own generator seeded with it, so it
    returns the same tokens alone or inside any batch; with ``n > 1`` completion ``i`` has a
    generator of its own, derived from the seed and ``i``.

    Penalties have vLLM's meanings: ``presence_penalty`` and ``frequency_penalty`` (OpenAI's,
    in [-2, 2]) subtract from the logit of every token already generated, once or once per
    occurrence; ``repetition_penalty`` (transformers' rule, > 0) divides a positive logit and
    multiplies a negative one of every token in the prompt or the output. ``min_tokens`` masks
    EOS and ``stop_token_ids`` (and ignores stop strings) until that many tokens were generated.
    ``logprobs=K`` returns each generated token's log-probability with the K most likely tokens
    at its position; ``prompt_logprobs=K`` the same for the prompt's tokens (the first has none).
    ``structured_outputs`` (a ``StructuredOutputsParams`` or a dict of its fields) constrains the
    output to a JSON schema, a regex, a choice or a grammar; the grammar's end ends the output.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    _stop: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidInputError(f"temperature must be >= 0, got {self.temperature}")
        self._check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")
        self._check_int("top_k", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise InvalidInputError(f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k}")
        self._check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidInputError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self._check_int("seed", self.seed)
            if not 0 <= self.seed < 2**64:
                raise InvalidInputError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.max_tokens is not None:
            self._check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise InvalidInputError(f"max_tokens must be >= 1, got {self.max_tokens}")
        self._check_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise InvalidInputError(f"n must be in [1, {MAX_N}], got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            self._check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidInputError(f"{name} must be in [-2, 2], got {value}")
        self._check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidInputError(
                f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty}"
            )
        self._check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise InvalidInputError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidInputError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                self._check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise InvalidInputError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
            if self.min_tokens:
                raise InvalidInputError(
                    f"min_tokens must be 0 with structured_outputs (the grammar decides where "
                    f"the output ends), got {self.min_tokens}"
                )
        if self.temperature < _EPS_GREEDY:
            self.temperature = 0.0
        self._stop = self._normalise_stop(self.stop)
        ids = self.stop_token_ids or []
        if not isinstance(ids, (list, tuple)) or any(
            not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids
        ):
            raise InvalidInputError(
                f"stop_token_ids must be a list of non-negative integers, got {ids!r}"
            )
        self.stop_token_ids = list(ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether the logits need the request's history (penalties or min_tokens)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.min_tokens > 0
        )

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @staticmethod
    def _normalise_stop(stop: str | list[str] | None) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
            raise InvalidInputError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in items):
            raise InvalidInputError("stop strings must not be empty")
        return list(items)

    @staticmethod
    def _check_number(name: str, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidInputError(f"{name} must be a number, got {value!r}")
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an int past float's range
            finite = False
        if not finite:
            raise InvalidInputError(f"{name} must be a finite number, got {value!r}")

    @staticmethod
    def _check_int(name: str, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidInputError(f"{name} must be an integer, got {value!r}")
