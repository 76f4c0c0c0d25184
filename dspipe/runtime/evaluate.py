"""Validation loss on the validation split: the same batches, in order, every time (comparable across steps).

A blend (dspipe.data.blend) is validated per source: each source's own validation split gives val_loss_NAME, and
val_loss is their mean weighted by the blend's shares (the loss expected under the training mixture)."""

from __future__ import annotations

from dataclasses import dataclass

from dspipe.data.loader import TokenWindows, val_batches
from dspipe.errors import SpecError
from dspipe.planner.throughput import perplexity


def check_val_split(*, windows: TokenWindows, micro_batch: int, dp: int, batches: int) -> int:
    """Micro-batches per rank one evaluation will use (at most `batches`); errors now, not at the first eval."""
    available = len(windows) // (dp * micro_batch)
    if available == 0:
        next(val_batches(windows=windows, micro_batch=micro_batch, dp=dp, dp_rank=0))  # raises its one-line error
    return min(batches, available)


def evaluate(eng, *, windows: TokenWindows, micro_batch: int, batches: int) -> float:
    """Mean next-token loss over `batches` micro-batches per data-parallel rank (dropout off), on every rank.
    `eng`: a dspipe.runtime.engine.Engine (plain or pipeline)."""
    it = val_batches(
        windows=windows, micro_batch=micro_batch, dp=eng.layout.dp, dp_rank=eng.dp_rank, max_batches=batches
    )
    return eng.eval_loss(it, count=batches)


@dataclass(frozen=True)
class ValSet:
    """One source's validation windows, its weight in the blend and its micro-batches per rank; column is the
    source's val_metrics.csv column (None for a single data directory, whose loss is val_loss itself)."""

    windows: TokenWindows
    weight: float
    batches: int
    column: str | None = None


def val_sets(spec, *, seq_len: int, micro_batch: int, dp: int, batches: int) -> list[ValSet]:
    """The validation sets of a --data BlendSpec, each checked to hold one batch (an error names the source)."""
    out = []
    for source, name in zip(spec.sources, spec.names, strict=True):
        try:
            windows = TokenWindows(source.path, seq_len=seq_len, split="val")
            count = check_val_split(windows=windows, micro_batch=micro_batch, dp=dp, batches=batches)
        except SpecError as e:
            if not spec.is_blend:
                raise
            raise SpecError(f"blend source {source.path}: {e}") from None
        out.append(
            ValSet(
                windows=windows,
                weight=source.weight,
                batches=count,
                column=f"val_loss_{name}" if spec.is_blend else None,
            )
        )
    return out


def val_columns(sets: list[ValSet]) -> tuple[str, ...]:
    """The per-source columns val_metrics.csv gets beyond dspipe.planner.throughput.VAL_COLUMNS."""
    return tuple(s.column for s in sets if s.column)


def evaluate_sets(eng, sets: list[ValSet], *, micro_batch: int) -> dict:
    """{val_loss, val_ppl, and per source val_loss_NAME}: val_loss is the weighted mean over the sets (one set: its
    loss, as without a blend)."""
    row, total = {}, 0.0
    for s in sets:
        loss = evaluate(eng, windows=s.windows, micro_batch=micro_batch, batches=s.batches)
        if s.column:
            row[s.column] = loss
        total += s.weight * loss if len(sets) > 1 else loss
    return {"val_loss": total, "val_ppl": perplexity(total), **row}
