"""Validation loss on the validation split: the same batches, in order, every time (comparable across steps)."""
from __future__ import annotations

from dspipe.data.loader import TokenWindows, val_batches


def check_val_split(*, windows: TokenWindows, micro_batch: int, dp: int, batches: int) -> int:
    """Micro-batches per rank one evaluation will use (at most `batches`); errors now, not at the first eval."""
    available = len(windows) // (dp * micro_batch)
    if available == 0:
        next(val_batches(windows=windows, micro_batch=micro_batch, dp=dp, dp_rank=0))  # raises its one-line error
    return min(batches, available)


def evaluate(engine, *, windows: TokenWindows, micro_batch: int, dp: int, dp_rank: int, pp: int, batches: int,
             reads_data: bool) -> float:
    """Mean next-token loss over `batches` micro-batches per data-parallel rank (dropout off), on every rank."""
    import torch
    import torch.distributed as dist

    it = val_batches(windows=windows, micro_batch=micro_batch, dp=dp, dp_rank=dp_rank, max_batches=batches)
    if pp > 1:  # the pipeline runs the micro-batches through its stages and broadcasts the mean loss
        return float(engine.eval_batch(it if reads_data else None, num_micro_batches=batches))
    engine.eval()
    total = torch.zeros((), device=engine.device)
    with torch.no_grad():
        for inputs, labels in it:
            total += engine(inputs.to(engine.device), labels.to(engine.device)).float()
    engine.train()
    dist.all_reduce(total)
    return float(total) / (batches * dist.get_world_size())
