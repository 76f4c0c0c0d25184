"""Value checks of DeepSpeed keys a preset sets: each returns the value as dspipe renders it or raises
ValueError(what is allowed), the reason in the one-line import error. No torch, no deepspeed."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

Check = Callable[[object], object]
"""A value check: the preset's value (parsed JSON) -> the value as rendered, or ValueError."""


def boolean(v: object) -> bool:
    if not isinstance(v, bool):
        raise ValueError("must be true or false")
    return v


def integer(lo: int, hi: int | None = None) -> Callable[[object], int]:
    def check(v: object) -> int:
        if isinstance(v, float) and math.isfinite(v) and v == int(v):
            v = int(v)  # 1e9 in JSON is a float; DeepSpeed's pydantic fields take it as an integer
        if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
            raise ValueError(f"must be an integer >= {lo}" + (f" and <= {hi}" if hi is not None else ""))
        return v

    return check


def number(lo: float, hi: float | None = None, *, open_lo: bool = False) -> Callable[[object], float]:
    def check(v: object) -> float:
        if (
            not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
            or v < lo
            or (open_lo and v == lo)
            or (hi is not None and v > hi)
        ):
            raise ValueError(
                f"must be a finite number {'>' if open_lo else '>='} {lo:g}"
                + (f" and <= {hi:g}" if hi is not None else "")
            )
        return v

    return check


def choice(*choices: object) -> Check:
    def check(v: object) -> object:
        if v not in choices:
            raise ValueError(f"must be one of: {', '.join(map(json.dumps, choices))}")
        return v

    return check


def off(why: str) -> Check:
    """Only false is accepted (a DeepSpeed switch dspipe keeps off), with the reason."""

    def check(v: object) -> object:
        if v is not False:
            raise ValueError(f"must be false ({why})")
        return v

    return check


def str_or_null(v: object) -> str | None:
    if v is not None and (not isinstance(v, str) or not v or "\n" in v):
        raise ValueError("must be a one-line string or null")
    return v


def betas(v: object) -> list[float]:
    if (
        not isinstance(v, list)
        or len(v) != 2
        or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in v)
    ):
        raise ValueError("must be a list of two numbers in [0, 1)")
    return v


def number_checkpoints(v: object) -> int | None:
    return None if v is None else integer(1)(v)


def offload_device(v: object) -> object:
    return choice("none", "cpu", "nvme")(v if v is not None else "none")
