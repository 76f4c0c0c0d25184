"""The specs' validation helpers: a SpecError names the field and what it accepts.

The integer checks read a field's largest value from its setting's limit: each spec module enters its class's limits
(add_limits) when it defines the class. No torch, no deepspeed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TypeGuard

from dspipe.errors import SpecError
from dspipe.spec.settings import declared

_LIMITS: dict[str, int | float] = {}
"""Largest accepted value per spec field, by field name (dspipe.spec.core.LIMITS holds every spec's)."""


def add_limits(cls: type) -> None:
    """Enter the limits that spec class `cls`'s settings declare, for int_range to check its fields against."""
    _LIMITS.update({s.field: s.limit for s in declared(cls, section="") if s.field is not None and s.limit is not None})


def limit(name: str) -> int | float:
    """The largest value spec field `name` accepts (its setting's limit)."""
    return _LIMITS[name]


def show(value: object) -> str:
    """repr, cut short (a 400-digit number or a long string stays one readable line)."""
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        int_range(owner, name, value, low=1)


def int_range(owner: str, name: str, value: object, *, low: int) -> None:
    """An int (not bool) in [low, limit(name)]; the message names the field and the allowed range."""
    high = limit(name)
    allowed = f"allowed range {low}..{high:,}"
    if not is_int(value) or value < low:
        rule = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise SpecError(f"{owner}.{name} must be {rule}, got {show(value)} ({allowed})")
    if value > high:
        raise SpecError(f"{owner}.{name} {show(value)} is too large ({allowed})")


def number(
    owner: str, name: str, value: object, *, low: float, high: float, low_open: bool = False, rule: str | None = None
) -> None:
    """A finite int or float in [low, high] (or (low, high] when low_open); NaN and +-inf are refused."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
    ok = is_number(value) and math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        too_large = is_number(value) and math.isfinite(value) and value > high  # the rule names the low side
        why = f"must be at most {high:g}" if too_large else rule or f"must be a finite number in {interval}"
        raise SpecError(f"{owner}.{name} {why}, got {show(value)} (allowed: finite, {interval})")


def one_of(owner: str, name: str, value: object, allowed: Sequence[object]) -> None:
    if type(value) is not type(allowed[0]) or value not in allowed:
        raise SpecError(f"{owner}.{name} {show(value)} is not one of: {', '.join(map(str, allowed))}")


def flag(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise SpecError(f"{owner}.{name} must be true or false, got {show(value)}")


def text(owner: str, name: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or not value or "\0" in value or "\n" in value:
        raise SpecError(
            f"{owner}.{name} must be a non-empty one-line string{' or null' if optional else ''}, got {show(value)}"
        )


def absolute_dir(owner: str, name: str, value: str) -> None:
    """A directory every rank reaches by the same name: not blank, no space at either end, absolute (a relative
    one resolves against each rank's own working directory, wherever the launcher started it)."""
    if not value.strip():
        raise SpecError(f"{owner}.{name} is blank ({value!r}): give an absolute directory, e.g. /local_nvme")
    if value != value.strip():
        raise SpecError(
            f"{owner}.{name} {show(value)} starts or ends with white space: give the directory's exact absolute path"
        )
    if not value.startswith("/"):
        absolute = os.path.abspath(value)
        here = f" (from here: {absolute})" if len(absolute) <= 200 else ""
        raise SpecError(
            f"{owner}.{name} {show(value)} is relative: each rank would resolve it against its own "
            f"working directory; give an absolute path{here}"
        )
