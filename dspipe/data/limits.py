"""Text-size limits of prepare-data (--max-mb, --tokenizer-sample-mb): MiB to bytes, and the one line for a limit
too small to hold anything (less than a byte, or less than the first document or training piece)."""

from __future__ import annotations

import math

from dspipe.errors import SpecError

MIB = 2**20
MAX_MB = {"--max-mb": 2.0**24, "--tokenizer-sample-mb": 2.0**14}
"""Largest text sizes in MiB: 16 TiB of input, 16 GiB of BPE training sample."""


def mib_text(nbytes: int) -> str:
    """The shortest decimal number of MiB that mib_to_bytes turns into exactly `nbytes` bytes: how a message shows a
    limit, and the smallest value that holds `nbytes`."""
    exact = nbytes / MIB
    for digits in range(1, 18):
        text = f"{exact:.{digits}g}"
        if int(float(text) * MIB) == nbytes:
            return text
    return repr(exact)  # exact: an integer below 2^53 scaled by a power of two


def mib_to_bytes(value, *, flag: str) -> int:
    """A size flag in MiB (a finite number in (0, MAX_MB[flag]]) as bytes; NaN, inf, 0 and negatives are one
    SpecError with the allowed range, and so is a positive value below one byte (it would hold no text)."""
    high = MAX_MB[flag]
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and 0 < value <= high)
    ):
        raise SpecError(
            f"{flag} must be a positive number of MiB, got {str(value)[:40]} (allowed: finite, (0, {high:,.0f}])"
        )
    nbytes = int(value * MIB)
    if nbytes < 1:
        raise SpecError(
            f"{flag} {value:g} is 0 bytes: less than one byte; the smallest {flag} is {mib_text(1)} (1 byte)"
        )
    return nbytes


def too_small(*, flag: str, limit: int, size: int, what: str) -> SpecError:
    """The limit `flag` (`limit` bytes) is below `size` bytes, what it must hold at least (`what` says which and
    shows the size)."""
    unit = "byte" if limit == 1 else "bytes"
    return SpecError(
        f"{flag} {mib_text(limit)} ({limit:,} {unit}) cannot hold {what}; the smallest {flag} that "
        f"holds it is {mib_text(size)}"
    )
