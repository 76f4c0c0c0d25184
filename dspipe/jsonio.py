"""Strict JSON files: read only UTF-8 objects of finite numbers, write nothing non-finite. Standard library only.

Python's json module reads NaN, Infinity and 1e999 (as inf) and writes them back as bare NaN/Infinity, which is not
JSON; every file dspipe reads goes through read_object and every file it writes through dumps, so a non-finite
number is refused with the file and the field named, in both directions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from dspipe.digits import digits_text, significant_digits
from dspipe.errors import SpecError, cannot_read

FLOAT_DIGITS = 308
"""Integers of more digits are beyond a float's range (1.8e308): refused as such, like 1e999."""


def read_object(path: str | Path, *, hint: str = "", partial_ok: bool = False) -> dict | None:
    """The JSON object in `path`; any other content (unreadable, not UTF-8, not JSON, NaN/Infinity, a number
    beyond float range, a key given twice in one object, not an object) is one SpecError naming the file. `hint` is
    appended to the message. partial_ok: an empty file or one that ends early (a writer is still at it) gives None
    instead."""
    path = Path(path)
    tail = f"; {hint}" if hint else ""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise cannot_read(path, e, tail=tail) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}){tail}") from None

    def unique(pairs: list) -> dict:
        out = dict(pairs)
        if len(out) < len(pairs):
            seen: set = set()
            twice = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise SpecError(f"{path} is not valid: key {show(twice)} given twice in one JSON object{tail}")
        return out

    try:
        data = json.loads(text, object_pairs_hook=unique, **number_hooks(str(path), tail=tail))
    except json.JSONDecodeError as e:
        ends_early = e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string")  # runs to the end
        if partial_ok and ends_early:
            return None
        where = (
            f"it ends early at line {e.lineno} column {e.colno}" if ends_early else f"line {e.lineno} column {e.colno}"
        )
        raise SpecError(f"{path} is not valid JSON: {where}: {e.msg}{tail}") from None
    except RecursionError:
        raise SpecError(f"{path} is not valid JSON: nested too deeply{tail}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path} must hold a JSON object, not {type(data).__name__}{tail}")
    return data


def number_hooks(where: str, *, tail: str = "") -> dict:
    """json.loads keywords that refuse, in one SpecError naming `where`: NaN and Infinity, a float literal beyond
    float range (1e999), and an integer of more than FLOAT_DIGITS digits (math on it overflows; int() refuses
    beyond 4,300 digits)."""

    def constant(name: str):
        raise SpecError(f"{where}: {name} is not a finite number (JSON has no NaN or Infinity){tail}")

    def number(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            raise SpecError(f"{where}: {literal[:40]} is beyond the range of a float{tail}")
        return value

    def integer(literal: str) -> int:
        if significant_digits(literal) > FLOAT_DIGITS:
            raise SpecError(f"{where}: {digits_text(literal)} is beyond the range of a float{tail}")
        return int(literal)

    return dict(parse_constant=constant, parse_float=number, parse_int=integer)


def show(value, width: int = 40) -> str:
    """repr of a value read from a file, cut to `width` characters (a 5000-digit number stays one short line)."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def non_finite(value, where: str = "") -> str | None:
    """The key path ('a.b[2]') of the first NaN or infinite float in a JSON-like value, or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (where or "(top level)")
    if isinstance(value, dict):
        items = ((f"{where}.{k}" if where else str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for key, v in items:
        found = non_finite(v, key)
        if found:
            return found
    return None


def dumps(value, *, what: str) -> str:
    """Indented JSON text with a final newline; a NaN or infinite number anywhere is a SpecError naming its key
    (`what` names the file being written), never a bare NaN/Infinity in a file."""
    bad = non_finite(value)
    if bad:
        raise SpecError(f"refusing to write {what}: {bad} is not a finite number")
    return json.dumps(value, indent=2, allow_nan=False) + "\n"


MISSING = object()
"""What `dotted_get` returns for a key path that is not there."""


def leaves(d: dict, prefix: str = ""):
    """(dotted key, value) of every leaf of nested dicts, in order (an empty dict is a leaf, a list too)."""
    for key, value in d.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def dotted_get(d, path: str):
    """The value at a dotted key path ('zero_optimization.stage') of nested dicts, or MISSING."""
    for part in path.split("."):
        if not isinstance(d, dict) or part not in d:
            return MISSING
        d = d[part]
    return d
