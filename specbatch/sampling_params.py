"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

from dataclasses import dataclass, field

from specbatch.errors import InvalidInputError
from specbatch.options import check_options, option
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

    # fmt: off
    temperature: float = option(1.0, "0 means greedy", ge=0, metavar="T")
    top_p: float = option(1.0, "nucleus sampling: smallest set of tokens with this much mass "
        "(1 = off)", gt=0, le=1, metavar="P")
    top_k: int = option(0, "sample among the K most likely tokens (0 or -1 = off)", ge=-1,
        shown="an integer >= 1, or 0 or -1 (off)", metavar="K")
    min_p: float = option(0.0, "drop tokens below this fraction of the top token's probability",
        ge=0, le=1, metavar="P")
    seed: int | None = option(None, "the request's own random stream", type=int, ge=0, lt=2**64,
        shown="in [0, 2**64)", flag=False)
    max_tokens: int | None = option(16, "most tokens to generate per request", type=int, ge=1)
    stop: str | list[str] | None = option(None, "stop when the output contains TEXT (repeat for "
        "several)", type=str, many=True)
    stop_token_ids: list[int] | None = option(None, "stop at any of these token ids, "
        "comma-separated (repeatable)", type=int, many=True, ge=0, metavar="IDS")
    ignore_eos: bool = option(False, "keep generating after the end-of-sequence token")
    include_stop_str_in_output: bool = option(False, "keep the stop string at the end of the "
        "text", flag=False)
    skip_special_tokens: bool = option(True, "leave special tokens out of the text", flag=False)
    n: int = option(1, "completions per prompt (they share the prompt's KV blocks)", ge=1,
        le=MAX_N)
    presence_penalty: float = option(0.0, "subtracted from the logit of every token generated "
        "so far", ge=-2, le=2)
    frequency_penalty: float = option(0.0, "subtracted once per earlier occurrence among the "
        "generated tokens", ge=-2, le=2)
    repetition_penalty: float = option(1.0, "transformers' rule over prompt and output tokens "
        "(1 = off, > 1 discourages)", gt=0)
    min_tokens: int = option(0, "no EOS or stop token before this many tokens", ge=0)
    logprobs: int | None = option(None, "record each output token's logprob and the K most "
        "likely tokens", type=int, ge=0, le=MAX_LOGPROBS, metavar="K")
    prompt_logprobs: int | None = option(None, "the same for every prompt token", type=int,
        ge=0, le=MAX_LOGPROBS, flag=False)
    structured_outputs: StructuredOutputsParams | None = option(None, "constrain every output, "
        "as vLLM's StructuredOutputsParams (an object: json, regex, choice, grammar or "
        "json_object)", type=object, metavar="JSON")
    # fmt: on
    _stop: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_options(SamplingParams, self)
        if self.top_k == -1:
            self.top_k = 0
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidInputError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})",
                "min_tokens",
            )
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
            if self.min_tokens:
                raise InvalidInputError(
                    f"min_tokens must be 0 with structured_outputs (the grammar decides where "
                    f"the output ends), got {self.min_tokens}",
                    "min_tokens",
                )
        if self.temperature < _EPS_GREEDY:
            self.temperature = 0.0
        self._stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if "" in self._stop:
            raise InvalidInputError("stop strings must not be empty", "stop")
        self.stop_token_ids = list(self.stop_token_ids or [])

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
