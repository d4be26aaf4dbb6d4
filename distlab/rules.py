"""The type and range of every option, checked once, in the parent, before any rank starts.

Every option of `dl.train` is a field of the typed spec (`distlab.strategies.spec`), declared with its
default, its rule and its docstring by `option`; a spec checks its fields when it is made
(`check_fields`). `dl.train`'s own arguments (`train.ARGUMENTS`) are a table ``name -> rule``, applied
by `check`. A refusal names the option, what it takes, what to pass instead, and what it got::

    >>> check({"steps": Whole(1, example=20)}, {"steps": True})
    ValueError: steps=True: steps must be a positive integer (e.g. steps=20)

A refused value is a ValueError, whatever was wrong with it (its type or its range); a TypeError is
kept for an option that does not exist (`distlab.strategies.parse`). The traps of Python that
these rules close, each of which once trained something silently wrong here:

    bool is an int          True == 1, isinstance(True, int): steps=True would train one step
    NaN compares False      nan < 0 and nan >= 0 are both False: "refuse if below 0" lets it through
    inf is a float          a positive float, and no learning rate or clipping norm
    "2" is not 2            a string where a number belongs fails later, inside a rank

Cross-option rules (a rank below ``world_size``, a step below ``steps``, a step that a checkpoint
directory holds) stay in the checks that know both sides: `strategies.validate`,
`checkpoint.options.check_values`, `restart.plan`.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, kw_only=True)
class Rule(ABC):
    """A rule: ``accepts(value)`` (True or False) and ``what()`` it takes, in words.
    ``example``: a value to suggest; ``none``: when set, None is accepted and means that (e.g. "no
    clipping")."""

    example: object = None
    none: str | None = None

    def check(self, name: str, value) -> None:
        if value is None and self.none is not None:
            return
        if not self.accepts(value):
            hint = f" (e.g. {name}={self.example!r})" if self.example is not None else ""
            none = f", or None ({self.none})" if self.none is not None else ""
            raise ValueError(f"{name}={value!r}: {name} must be {self.what()}{hint}{none}")

    @abstractmethod
    def what(self) -> str:
        """What the option takes, in words ("a positive integer")."""

    @abstractmethod
    def accepts(self, value) -> bool:
        """Whether ``value`` is one the option takes."""


def _is_number(value) -> bool:
    """An int or a float (numpy's too: they register as ``numbers.Real``), never a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class Whole(Rule):
    """An int (numpy's too: ``numbers.Integral``), never a bool, ``low <= value <= high`` (either bound may
    be None)."""

    low: int | None = None
    high: int | None = None

    def what(self) -> str:
        if self.low is not None and self.high is not None:
            return f"an integer from {self.low} to {self.high}"
        if self.low == 1 and self.high is None:
            return "a positive integer"
        return "an integer" + (f" >= {self.low}" if self.low is not None else "") + (
            f" <= {self.high}" if self.high is not None else "")

    def accepts(self, value) -> bool:
        return (isinstance(value, numbers.Integral) and not isinstance(value, bool)
                and (self.low is None or value >= self.low) and (self.high is None or value <= self.high))


@dataclass(frozen=True)
class Number(Rule):
    """A finite int or float (never a bool, NaN or inf), above ``low`` (``strict``: above, not equal)."""

    low: float | None = None
    strict: bool = False

    def what(self) -> str:
        if self.low == 0:
            return "a positive finite number" if self.strict else "a finite number >= 0"
        bound = f" {'>' if self.strict else '>='} {self.low}" if self.low is not None else ""
        return f"a finite number{bound}"

    def accepts(self, value) -> bool:
        if not _is_number(value) or not math.isfinite(value):
            return False
        return self.low is None or value > self.low or (value == self.low and not self.strict)


@dataclass(frozen=True)
class Flag(Rule):
    """``True`` or ``False``, nothing else (not 1, not "no": a non-empty string is truthy)."""

    def what(self) -> str:
        return "True or False"

    def accepts(self, value) -> bool:
        return value is True or value is False


class OneOf(Rule):
    """One of ``choices``, of the same type too (``1`` is not ``True``, ``0`` not ``False``)."""

    def __init__(self, *choices, example=None, none: str | None = None):
        object.__setattr__(self, "choices", choices)
        super().__init__(example=example, none=none)

    def what(self) -> str:
        shown = [repr(c) for c in self.choices]
        if len(shown) <= 2:
            return " or ".join(shown)
        return "one of " + ", ".join(shown[:-1]) + f" or {shown[-1]}"

    def accepts(self, value) -> bool:
        return any(value == c and type(value) is type(c) for c in self.choices)


@dataclass(frozen=True)
class Text(Rule):
    """A non-blank ``str``."""

    def what(self) -> str:
        return "a non-empty string"

    def accepts(self, value) -> bool:
        return isinstance(value, str) and bool(value.strip())


@dataclass(frozen=True)
class Directory(Rule):
    """A directory: a non-blank ``str`` or an ``os.PathLike`` (``"."`` for this one, said explicitly: an
    empty string is refused, though ``Path("")`` would quietly mean ".")."""

    def what(self) -> str:
        return "a directory (a non-empty str or a pathlib.Path; '.' for the current directory)"

    def accepts(self, value) -> bool:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        return isinstance(value, str) and bool(value.strip())


class Described(Rule):
    """A rule whose words are given, not derived: ``description`` says what it takes."""

    def __init__(self, description: str, example=None, none: str | None = None):
        object.__setattr__(self, "description", description)
        super().__init__(example=example, none=none)

    def what(self) -> str:
        return self.description


class Custom(Described):
    """``test(value)`` raises a TypeError or ValueError for what ``description`` does not take."""

    def __init__(self, test: Callable, description: str, example=None, none: str | None = None):
        object.__setattr__(self, "test", test)
        super().__init__(description, example=example, none=none)

    def accepts(self, value) -> bool:
        try:
            self.test(value)
        except (TypeError, ValueError):
            return False
        return True


class Either(Described):
    """Any one of ``rules`` (e.g. a flag or a whole number); ``description`` says what in words."""

    def __init__(self, *rules: Rule, description: str, example=None, none: str | None = None):
        object.__setattr__(self, "rules", rules)
        super().__init__(description, example=example, none=none)

    def accepts(self, value) -> bool:
        return any(rule.accepts(value) for rule in self.rules)


#: what a world size takes (`dl.train`'s ``world_size``, each restart's; what a machine holds: `train`)
WORLD_SIZE = Whole(1, example=4)


def check(table: dict[str, Rule], values: dict) -> None:
    """Every value in ``values`` that ``table`` has a rule for, checked by it (names are checked elsewhere:
    `distlab.strategies.parse`)."""
    for name, value in values.items():
        if name in table:
            table[name].check(name, value)


def option(default, rule: Rule, doc: str):
    """A field of a typed spec: its default, the rule its value obeys and its docstring, side by side::

        bucket_mb: float = option(25.0, Number(0, strict=True), "gradient bucket size in MiB")
    """
    return dataclasses.field(default=default, metadata={"rule": rule, "doc": doc})


def rule_of(spec_class, name: str) -> Rule:
    """The rule of field ``name`` of the dataclass ``spec_class`` (declared by `option`)."""
    return next(f.metadata["rule"] for f in dataclasses.fields(spec_class) if f.name == name)


def check_fields(spec) -> None:
    """Every field of the dataclass instance ``spec`` declared by `option`, checked by its rule."""
    for f in dataclasses.fields(spec):
        if "rule" in f.metadata:
            f.metadata["rule"].check(f.name, getattr(spec, f.name))
