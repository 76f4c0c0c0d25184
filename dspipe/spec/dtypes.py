"""Bytes per element of each training precision (train.precision): the one table the planner and the tools use.
Standard library only."""

from __future__ import annotations

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes of one element in each precision of dspipe.spec.values.PRECISIONS."""


def dtype_bytes(precision: str) -> int:
    """Bytes of one element of `precision` ('bf16', 'fp16' or 'fp32')."""
    return DTYPE_BYTES[precision]
