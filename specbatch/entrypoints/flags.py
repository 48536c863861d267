"""Command-line flags read from the options' declarations (``specbatch.options``).

Every option of ``EngineArgs`` or ``SamplingParams`` (or any dataclass declared the same way) is
a flag spelled from its name (``--max-model-len``), with its default, limit and help. Only the
types are read here: each value is checked where it becomes ``EngineArgs`` or
``SamplingParams``, and the CLI shows an error's field as its flag (``flag``).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from specbatch.config import EngineArgs
from specbatch.options import Option, options_of
from specbatch.sampling_params import SamplingParams

METAVARS = {int: "N", float: "X", str: "TEXT", Path: "PATH", object: "TEXT"}


def flag(field: str) -> str:
    """A field as the command line spells it: ``--max-model-len``; a key inside a JSON flag
    (``speculative_config.topk``) or an item (``prompts[0]``) stays as it is."""
    return "--" + field.replace("_", "-") if field.isidentifier() else field


def token_ids_arg(value: str) -> list[int]:
    """``"1,2,3"`` (spaces allowed) as a list of ints."""
    parts = [p for p in re.split(r"[,\s]+", value.strip()) if p]
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids such as 1,2,3, got {value!r}"
        ) from None


def _parser(opt: Option) -> Callable[[str], Any]:
    """A flag's text as the option's type; its words (``auto``) pass as they are."""
    kind = str if opt.type in (object, Path) else opt.type
    if not opt.also:
        return kind

    def parse(text: str) -> Any:
        try:
            return text if text in opt.also else kind(text)
        except ValueError:  # the wrong type (the limit is checked with the value)
            expected = Option("", opt.type, also=opt.also).expected()
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None

    return parse


def add_options(
    parser: argparse.ArgumentParser,
    cls: Any,
    title: str,
    *,
    skip: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
    helps: Mapping[str, str] | None = None,
) -> None:
    """One flag per option of ``cls`` that has one (except ``skip``), in a group ``title``."""
    group = parser.add_argument_group(title)
    defaults, helps = dict(defaults or {}), dict(helps or {})
    for name, opt, default in options_of(cls):
        if not opt.flag or name in skip:
            continue
        default, text = defaults.get(name, default), helps.get(name, opt.help)
        if opt.type is bool:  # a switch: present or not; --no-NAME when it is on by default
            action = argparse.BooleanOptionalAction if default else "store_true"
            on = f"{text} (default: on)" if default else text
            group.add_argument(flag(name), dest=name, default=default, action=action, help=on)
            continue
        shown = [f"default: {default}"] if default is not None else []
        shown += [opt.limit] if opt.limit and not opt.choices else []
        kwargs: dict[str, Any] = {"type": _parser(opt), "choices": opt.choices or None}
        if opt.many:  # repeatable; integers also comma-separated
            kwargs = {"type": token_ids_arg, "action": "extend"} if opt.type is int else {}
            kwargs.setdefault("action", "append")
        group.add_argument(
            flag(name),
            dest=name,
            default=default,
            metavar=opt.metavar or (None if opt.choices else METAVARS[opt.type]),
            help=f"{text} ({'; '.join(shown)})" if shown else text,
            **kwargs,
        )


def add_engine_flags(parser: argparse.ArgumentParser, **kwargs: Any) -> None:
    add_options(parser, EngineArgs, "engine options", **kwargs)


def add_sampling_flags(parser: argparse.ArgumentParser, **kwargs: Any) -> None:
    add_options(parser, SamplingParams, "sampling options", **kwargs)


def values_of(ns: argparse.Namespace, cls: Any) -> dict[str, Any]:
    """The flags' values of ``cls``' options (those it has a flag for)."""
    return {n: getattr(ns, n) for n, opt, _ in options_of(cls) if opt.flag and hasattr(ns, n)}


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """``EngineArgs`` from the parsed flags (fields without a flag keep their defaults)."""
    return EngineArgs(**values_of(ns, EngineArgs))
