"""Validation loss on the validation split: the same batches, in order, every time (comparable across steps)."""
from __future__ import annotations

from dspipe.data.loader import TokenWindows, val_batches


def check_val_split(*, windows: TokenWindows, micro_batch: int, dp: int, batches: int) -> int:
    """Micro-batches per rank one evaluation will use (at most `batches`); errors now, not at the first eval."""
    available = len(windows) // (dp * micro_batch)
    if available == 0:
        next(val_batches(windows=windows, micro_batch=micro_batch, dp=dp, dp_rank=0))  # raises its one-line error
    return min(batches, available)


def evaluate(eng, *, windows: TokenWindows, micro_batch: int, batches: int) -> float:
    """Mean next-token loss over `batches` micro-batches per data-parallel rank (dropout off), on every rank.
    `eng`: a dspipe.runtime.engine.Engine (plain or pipeline)."""
    it = val_batches(windows=windows, micro_batch=micro_batch, dp=eng.layout.dp, dp_rank=eng.dp_rank,
                     max_batches=batches)
    return eng.eval_loss(it, count=batches)
