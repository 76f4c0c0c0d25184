"""Non-finite steps and loss spikes.

A step whose loss or gradient norm is not finite must not touch the weights. DeepSpeed's fp16 loss scaler, its
BF16 optimizer and its ZeRO 1-3 optimizers already discard such a step (they set `optimizer.overflow`, and the
engine then counts `skipped_steps` and holds the lr schedule). Only fp32 without ZeRO hands the step straight to
the base optimizer; `guard_base_optimizer` gives that one the same behaviour. The runner then reads every skip
off the engine, the same way for every configuration, and `Health` decides when to stop and what to log.
"""

from __future__ import annotations

import math
from collections import deque


def guard_base_optimizer(engine) -> bool:
    """Give an optimizer without an overflow check one: a non-finite gradient norm on any rank -> no update on
    every rank and `overflow = True` (DeepSpeed then counts the skip and does not advance the lr schedule).
    It also records the pre-clipping gradient norm as `_global_grad_norm`, which the engine reports.
    Returns whether a guard was installed."""
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.utils import clip_grad_norm_

    from dspipe.runtime.comm import collective_tensor

    opt = engine.optimizer
    if hasattr(opt, "overflow"):
        return False
    unguarded, seen = opt.step, {}

    def clip_and_record():  # DeepSpeed's own fp32 clipping, keeping the norm it computes (before clipping)
        seen["norm"] = clip_grad_norm_(
            parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu
        )

    def local_norm():  # no clipping configured: the norm of this rank's gradients, summed over pipeline stages
        grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
        sq = (
            torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
            if grads
            else collective_tensor(0.0, dtype=torch.float64)
        )
        if getattr(engine, "num_stages", 1) > 1:
            dist.all_reduce(sq, group=engine.grid.get_pipe_parallel_group())
        return sq.sqrt()

    def step(closure=None):
        norm = seen.pop("norm", None)
        norm = float(local_norm() if norm is None else norm)
        bad = collective_tensor([0.0 if math.isfinite(norm) else 1.0], dtype=torch.float32)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # every rank takes the same decision
        opt.overflow, opt._global_grad_norm = bool(bad.item()), norm
        if opt.overflow:
            return None
        return unguarded() if closure is None else unguarded(closure)

    opt.overflow = False
    opt.step = step
    engine.clip_fp32_gradients = clip_and_record
    return True


class Health:
    """Counts skipped steps (stop after `max_skips` in a row) and flags loss spikes: a loss above
    mean + sigma x std of the last `window` finite losses."""

    def __init__(self, *, max_skips: int, window: int, sigma: float):
        self.max_skips, self.sigma = max_skips, sigma
        self.recent: deque[float] = deque(maxlen=window)
        self.consecutive = 0
        self.total_skipped = 0
        self.spikes = 0

    @property
    def halted(self) -> bool:
        return self.max_skips > 0 and self.consecutive >= self.max_skips

    def record(self, *, step: int, loss: float, skipped: bool) -> str | None:
        """Account for one optimizer step; returns a line to log, or None."""
        if skipped or not math.isfinite(loss):
            self.consecutive += 1
            self.total_skipped += 1
            return (
                f"step {step} skipped: non-finite loss or gradient norm (loss {loss}); {self.consecutive} in a "
                f"row, {self.total_skipped} in all" + (f", stopping at {self.max_skips}" if self.max_skips else "")
            )
        self.consecutive = 0
        line = None
        if len(self.recent) >= max(10, self.recent.maxlen // 2):
            mean = sum(self.recent) / len(self.recent)
            std = math.sqrt(sum((x - mean) ** 2 for x in self.recent) / len(self.recent))
            if loss > mean + self.sigma * std:
                self.spikes += 1
                line = (
                    f"loss spike at step {step}: {loss:.4f} > mean {mean:.4f} + {self.sigma:g} x std {std:.4f} "
                    f"of the last {len(self.recent)} steps"
                )
        self.recent.append(loss)
        return line
