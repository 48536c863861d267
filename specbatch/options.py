"""Options declared once: a dataclass field whose metadata holds its ``Option`` (help, limits).
The command line's flags, the server's request fields and every error message are read from
those declarations, and ``check_options`` is the one check of a value against its type and
limits, naming the field as the caller spells it."""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import os
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specbatch.errors import invalid

_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
          Path: "a path", object: "a value"}  # fmt: skip
_MANY = {int: "a list of integers", float: "a list of numbers", bool: "a list of booleans",
         str: "a string or a list of strings"}  # fmt: skip
# each limit: how the help and the errors write it alone, and as an interval's end; its check
_BOUNDS = {"ge": (">=", "[", operator.ge), "gt": (">", "(", operator.gt),
           "le": ("<=", "]", operator.le), "lt": ("<", ")", operator.lt)}  # fmt: skip


@dataclass(frozen=True)
class Option:
    help: str
    # of one value: bool, int, float, str, Path (a string or a path), or object (any: checked
    # where it is read)
    type: type
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] = ()
    also: tuple[str, ...] = ()  # words accepted beside the type's values ("auto")
    many: bool = False  # a list of values (a single string too, for strings)
    shown: str | None = None  # the limit as the help and the errors show it, when not derived
    metavar: str | None = None
    flag: bool = True  # the command line has a flag for it

    def _bounds(self) -> list[tuple[str, float]]:
        """The limits set, as (``ge``, ``gt``, ``le`` or ``lt``, the value)."""
        return [(n, b) for n in _BOUNDS if (b := getattr(self, n)) is not None]

    @property
    def limit(self) -> str:
        """The values allowed, in words: ``in (0, 1]``, ``>= 1``, ``one of a, b``."""
        if self.shown is not None:
            return self.shown
        if self.choices:
            return "one of " + ", ".join(self.choices)
        bounds = self._bounds()
        if len(bounds) == 2:  # an interval
            (lo, low), (hi, high) = bounds
            return f"in {_BOUNDS[lo][1]}{low:g}, {high:g}{_BOUNDS[hi][1]}"
        return " ".join(f"{_BOUNDS[n][0]} {b:g}" for n, b in bounds)

    def expected(self, right_type: bool = False) -> str:
        """What a value must be, in words (``right_type``: the value's type was right, so the
        limit alone)."""
        if self.shown is not None or self.choices or (right_type and self.limit and not self.also):
            text = self.limit
        else:
            text = f"{(_MANY if self.many else _KINDS)[self.type]} {self.limit}".strip()
        return text + "".join(f" or {word!r}" for word in self.also)

    def accepts(self, value: Any) -> bool:
        if isinstance(value, str) and value in self.also:
            return True
        if self.many:
            if self.type is str and isinstance(value, str):
                return True
            return isinstance(value, (list, tuple)) and all(self._one(v) for v in value)
        return self._one(value)

    def _one(self, v: Any) -> bool:
        kinds = {float: (int, float), Path: (str, os.PathLike)}.get(self.type, self.type)
        if isinstance(v, bool) is not (self.type is bool) or not isinstance(v, kinds):
            return False
        if self.type is float and not _finite(v):
            return False
        if self.choices:
            return v in self.choices
        return all(_BOUNDS[n][2](v, b) for n, b in self._bounds())


def _finite(v: float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int past float's range
        return False


def option(default: Any, help: str, **spec: Any) -> Any:
    """A dataclass field declaring an option; its type is its default's unless ``type=``."""
    spec.setdefault("type", type(default))
    return dataclasses.field(default=default, metadata={"option": Option(help, **spec)})


def options_of(cls: Any) -> Iterator[tuple[str, Option, Any]]:
    """Each declared option of a dataclass: its name, its ``Option`` and its default."""
    for f in dataclasses.fields(cls):
        if "option" in f.metadata:
            yield f.name, f.metadata["option"], f.default


def declared(cls: Any, name: str) -> Option:
    return next(opt for n, opt, _ in options_of(cls) if n == name)


def same_as(cls: Any, name: str, default: Any = dataclasses.MISSING, **changes: Any) -> Any:
    """A field declaring ``cls``' option ``name`` again for another dataclass: the same type
    and limits, the same default unless ``default`` is given; ``changes`` of the ``Option``
    that are not None (its ``help``, whether it has a ``flag``)."""
    opt = dataclasses.replace(
        declared(cls, name), **{k: v for k, v in changes.items() if v is not None}
    )
    value = getattr(cls, name) if default is dataclasses.MISSING else default
    return dataclasses.field(default=value, metadata={"option": opt})


def check_value(name: str, value: Any, opt: Option, nullable: bool = False) -> None:
    """Raise ``InvalidInputError`` naming ``name`` unless ``value`` is of the option's type
    and within its limits (or None, where ``nullable``)."""
    if (value is None and nullable) or opt.accepts(value):
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if opt.type is float and number and not _finite(value):
        raise invalid(name, f" must be a finite number, got {_short(value)}")
    right_type = not opt.many and (isinstance(value, opt.type) or (opt.type is float and number))
    right_type = right_type and isinstance(value, bool) is (opt.type is bool)
    raise invalid(name, f" must be {opt.expected(right_type)}, got {_short(value)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_options(cls: Any, values: Mapping[str, Any] | Any, prefix: str = "") -> None:
    """Check every declared option of ``cls`` found in ``values`` (a mapping or an instance),
    naming it ``prefix + name``."""
    get = values.get if isinstance(values, Mapping) else lambda n, d: getattr(values, n, d)
    missing = object()
    for name, opt, _ in options_of(cls):
        value = get(name, missing)
        if value is not missing:
            check_value(prefix + name, value, opt, name in nullable(cls))


@functools.cache
def nullable(cls: Any) -> frozenset[str]:
    """The fields of ``cls`` whose type admits None."""
    hints = typing.get_type_hints(cls)
    return frozenset(n for n, hint in hints.items() if type(None) in typing.get_args(hint))
