"""Integers written as text: the longest one any reader of dspipe turns into an int, and how a message shows one.

Python refuses int() of more than 4,300 digits with a ValueError; every flag, --config value and file field that
dspipe reads as an integer refuses more than MAX_DIGITS significant digits first, in one line that shows the count.
Standard library only.
"""

from __future__ import annotations

MAX_DIGITS = 1000
"""Longest integer dspipe reads (leading zeros aside): far beyond every limit, within int()'s 4,300 digits."""


def significant_digits(text: str) -> int:
    """Digits of the integer `text` (an optional sign, then digits) less its leading zeros."""
    return len(text.strip().lstrip("+-").lstrip("0"))


def too_many_digits(text: str) -> bool:
    """Whether the integer `text` has more than MAX_DIGITS significant digits."""
    return significant_digits(text) > MAX_DIGITS


def digits_text(text: str) -> str:
    """'1111111111111111... (5,000 digits)': a long run of digits as a message shows it."""
    return f"{text.strip()[:16]}... ({significant_digits(text):,} digits)"
