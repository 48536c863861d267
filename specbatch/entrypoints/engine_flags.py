"""Command-line flags shared by every subcommand that builds an engine or samples.

Engine flags are ``EngineArgs`` field names with dashes (``--max-model-len``); their defaults are
``EngineArgs``'s, so the CLI, ``LLM(...)`` and the server behave alike. Sampling flags are
``SamplingParams`` field names with dashes and its (vLLM's) defaults. Only the types are checked
here; every range and limit is checked by ``EngineArgs`` / ``SamplingParams`` themselves, whose
messages name the field. ``flag_message`` turns those field names into flag names.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from specbatch.config import DEVICES, DTYPES, EngineArgs
from specbatch.errors import InvalidInputError
from specbatch.sampling_params import SamplingParams


class CliParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors read ``error: <message>`` (after the usage), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"error: {message}\n")


@dataclass(frozen=True)
class Flag:
    field: str
    type: Callable[[str], Any] | None
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def name(self) -> str:
        return "--" + self.field.replace("_", "-")


def draft_length_arg(value: str) -> int | str:
    """``--num-speculative-tokens``: an integer, or ``auto``."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


# One entry per EngineArgs field (a test checks that none is missing).
ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag(
        "model",
        str,
        "target model: a Hugging Face checkpoint directory, a GGUF file or a folder holding "
        "one (default: the built-in pair, when installed)",
        metavar="DIR",
    ),
    Flag(
        "draft_model",
        str,
        "draft model (directory or GGUF file); must share the target's vocabulary; turns "
        "speculative decoding on",
        metavar="DIR",
    ),
    Flag(
        "speculative_config",
        str,
        "the drafter as vLLM's JSON, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or '
        '\'{"method": "draft_model", "model": "DIR", "num_speculative_tokens": "auto"}\'; '
        "--draft-model and --num-speculative-tokens are shorthands for it",
        metavar="JSON",
    ),
    Flag(
        "num_speculative_tokens",
        draft_length_arg,
        "draft tokens proposed per round, or auto: chosen per request and step for throughput, "
        "up to --max-draft-length; 0 turns speculation off (default: auto with a drafter, 3 "
        "with --batch-invariant, else 0)",
        metavar="K|auto",
    ),
    Flag(
        "max_draft_length",
        int,
        "the largest draft length --num-speculative-tokens auto may choose",
        metavar="N",
    ),
    Flag(
        "tokenizer", str, "tokenizer directory or GGUF file (default: the model's)", metavar="DIR"
    ),
    Flag(
        "dtype",
        str,
        "weights and activations dtype; auto takes the checkpoint's (on a CPU: bfloat16 for "
        "16-bit checkpoints where the CPU multiplies it natively, else float32)",
        choices=DTYPES,
    ),
    Flag("seed", int, "engine seed (see the command's help for how requests use it)", metavar="N"),
    Flag("device", str, "where to run", choices=DEVICES),
    Flag("block_size", int, "tokens per KV-cache block", metavar="N"),
    Flag(
        "num_kv_blocks", int, "number of KV-cache blocks (overrides --kv-cache-memory)", metavar="N"
    ),
    Flag(
        "kv_cache_memory",
        str,
        "KV-cache budget, e.g. 2GiB, 512MiB or bytes "
        "(default on CPU: 1GiB; on GPU: from --gpu-memory-utilization)",
        metavar="SIZE",
    ),
    Flag("gpu_memory_utilization", float, "fraction of GPU memory the engine may use", metavar="F"),
    Flag("max_num_seqs", int, "most requests in one batch", metavar="N"),
    Flag("max_num_batched_tokens", int, "most tokens in one step (default 2048)", metavar="N"),
    Flag(
        "max_model_len",
        int,
        "most tokens (prompt + output) of one request (default: the models' context length)",
        metavar="N",
    ),
    Flag("tensor_parallel_size", int, "target model shards (GPUs)", metavar="N"),
    Flag(
        "draft_tensor_parallel_size",
        int,
        "draft shards: 1 (replicated) or the target's tensor-parallel size (default 1)",
        metavar="N",
    ),
    Flag(
        "distributed_executor_backend",
        str,
        "uni (one process) or ray (default: ray when tensor-parallel)",
        choices=("uni", "ray"),
    ),
    Flag(
        "ray_address",
        str,
        "join this Ray cluster (default: $RAY_ADDRESS, else a local one)",
        metavar="ADDR",
    ),
    Flag(
        "batch_invariant",
        bool,
        "every op gives a request's rows the same bits whatever else is in the batch, and draft "
        "lengths never depend on the batch: a seeded request returns the same tokens alone or "
        "in any batch, with or without speculation (CPU kernels only; not with auto)",
    ),
    Flag(
        "enable_prefix_caching",
        bool,
        "reuse the KV blocks of prompt prefixes seen before (the target's and the drafter's); "
        "--no-enable-prefix-caching computes every prompt whole",
    ),
    Flag(
        "logprobs_mode",
        str,
        "what logprobs report: raw_logprobs (the model's log-softmax, as vLLM) or "
        "processed_logprobs (after penalties, temperature and top-k/top-p/min-p)",
        choices=("raw_logprobs", "processed_logprobs"),
    ),
    Flag(
        "attention_backend",
        str,
        "auto, torch, cpu (specbatch's kernel), flash-attn (CUDA, block size a multiple of "
        "256) or xformers (CUDA, multiple of 64); auto: on a CPU the kernel where it runs, on "
        "CUDA flash-attn, else xformers, as installed and as the block size allows; else torch",
        metavar="NAME",
    ),
)


def token_ids_arg(value: str) -> list[int]:
    """``"1,2,3"`` (spaces allowed) as a list of ints."""
    parts = [p for p in re.split(r"[,\s]+", value.strip()) if p]
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids such as 1,2,3, got {value!r}"
        ) from None


SAMPLING_FLAGS: tuple[Flag, ...] = (
    Flag("temperature", float, "0 means greedy", metavar="T"),
    Flag(
        "top_p",
        float,
        "nucleus sampling: smallest set of tokens with this much mass (1 = off)",
        metavar="P",
    ),
    Flag("top_k", int, "sample among the K most likely tokens (0 or -1 = off)", metavar="K"),
    Flag(
        "min_p",
        float,
        "drop tokens below this fraction of the top token's probability",
        metavar="P",
    ),
    Flag("max_tokens", int, "most tokens to generate per request", metavar="N"),
    Flag("min_tokens", int, "no EOS or stop token before this many tokens", metavar="N"),
    Flag("n", int, "completions per prompt (they share the prompt's KV blocks)", metavar="N"),
    Flag(
        "logprobs",
        int,
        "record each output token's logprob and the K most likely tokens (0-20)",
        metavar="K",
    ),
    Flag(
        "presence_penalty",
        float,
        "subtracted from the logit of every token generated so far, in [-2, 2]",
        metavar="X",
    ),
    Flag(
        "frequency_penalty",
        float,
        "subtracted once per earlier occurrence among the generated tokens, in [-2, 2]",
        metavar="X",
    ),
    Flag(
        "repetition_penalty",
        float,
        "transformers' rule over prompt and output tokens (1 = off, > 1 discourages)",
        metavar="X",
    ),
)


def _engine_default(name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(EngineArgs)}[name]
    return f.default


def _sampling_default(name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(SamplingParams)}[name]
    return f.default


def _add(parser: argparse._ActionsContainer, flag: Flag, default: Any, required: bool) -> None:
    if flag.type is bool:  # a switch: present or not; --no-NAME when it is on by default
        if default:
            parser.add_argument(
                flag.name,
                dest=flag.field,
                action=argparse.BooleanOptionalAction,
                default=True,
                help=flag.help + " (default: on)",
            )
        else:
            parser.add_argument(flag.name, dest=flag.field, action="store_true", help=flag.help)
        return
    help_text = flag.help
    if default is not None and not required:
        help_text += f" (default: {default})"
    parser.add_argument(
        flag.name,
        dest=flag.field,
        type=flag.type,
        choices=flag.choices,
        default=default,
        required=required,
        metavar=flag.metavar,
        help=help_text,
    )


def add_engine_flags(
    parser: argparse.ArgumentParser,
    *,
    skip: Iterable[str] = (),
    required: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
    help_overrides: Mapping[str, str] | None = None,
) -> None:
    """Add one flag per ``EngineArgs`` field (except ``skip``) to an "engine options" group."""
    skip, required = set(skip), set(required)
    defaults = dict(defaults or {})
    helps = dict(help_overrides or {})
    group = parser.add_argument_group("engine options")
    for flag in ENGINE_FLAGS:
        if flag.field in skip:
            continue
        if flag.field in helps:
            flag = dataclasses.replace(flag, help=helps[flag.field])
        default = defaults.get(flag.field, _engine_default(flag.field))
        _add(group, flag, default, flag.field in required)


def engine_args_from(ns: argparse.Namespace, **overrides: Any) -> EngineArgs:
    """``EngineArgs`` from the parsed flags (fields without a flag keep their defaults)."""
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    kwargs = {k: v for k, v in vars(ns).items() if k in names}
    kwargs.update(overrides)
    return EngineArgs(**kwargs)


def add_sampling_flags(
    parser: argparse.ArgumentParser,
    *,
    skip: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
    stop_flags: bool = True,
) -> None:
    """Add the sampling flags (and, with ``stop_flags``, --stop/--stop-token-ids/--ignore-eos)."""
    skip = set(skip)
    defaults = dict(defaults or {})
    group = parser.add_argument_group("sampling options")
    for flag in SAMPLING_FLAGS:
        if flag.field not in skip:
            _add(group, flag, defaults.get(flag.field, _sampling_default(flag.field)), False)
    if not stop_flags:
        return
    group.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="stop when the output contains TEXT (repeat for several)",
    )
    group.add_argument(
        "--stop-token-ids",
        type=token_ids_arg,
        action="extend",
        default=None,
        metavar="IDS",
        help="stop at any of these token ids, comma-separated (repeatable)",
    )
    group.add_argument(
        "--ignore-eos",
        action="store_true",
        default=False,
        help="keep generating after the end-of-sequence token",
    )


SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "min_tokens",
    "n",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
)


def sampling_kwargs_from(ns: argparse.Namespace) -> dict[str, Any]:
    """The ``SamplingParams`` keyword arguments the parsed flags set (no seed: see callers)."""
    return {k: getattr(ns, k) for k in SAMPLING_FIELDS if k != "seed" and hasattr(ns, k)}


def _known_fields() -> list[str]:
    names = {f.field for f in ENGINE_FLAGS} | set(SAMPLING_FIELDS)
    return sorted(names, key=len, reverse=True)


def flag_message(message: str, extra_fields: Iterable[str] = ()) -> str:
    """Rewrite a leading field name (``top_p must be ...``, ``model: ...``) as its flag."""
    for name in sorted({*_known_fields(), *extra_fields}, key=len, reverse=True):
        m = re.match(rf"{re.escape(name)}(?=[ :=])", message)
        if m:
            return "--" + name.replace("_", "-") + message[m.end() :]
    return message


def check_sampling_flags(ns: argparse.Namespace) -> SamplingParams:
    """Build the flags' ``SamplingParams`` once, so a bad flag fails before any model loads."""
    try:
        return SamplingParams(**sampling_kwargs_from(ns))
    except InvalidInputError as e:
        raise InvalidInputError(flag_message(str(e))) from None
