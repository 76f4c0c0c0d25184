"""Throughput arithmetic shared by the runner, `dspipe bench` and `dspipe report`: model FLOPs per token and
one step's tokens/s, samples/s, TFLOP/s per GPU and MFU.

MFU counts model FLOPs only (6N + 6·L·h·s per token: weights forward+backward, causal attention scores), never
the recomputation a checkpointing strategy adds, so it compares across strategies (PaLM's definition).
Imports no torch.
"""
from __future__ import annotations

from dspipe.spec.core import ModelSpec

# metrics.csv (one row per optimizer step, rank 0) and val_metrics.csv columns, in order.
STEP_COLUMNS = ("step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "tflops_per_gpu",
                "mfu", "mem_allocated_gib", "mem_reserved_gib", "step_time_s", "skipped")
VAL_COLUMNS = ("step", "tokens", "val_loss", "val_ppl")

def model_flops_per_token(model: ModelSpec) -> float:
    """Training FLOPs per token: 6N for the weights (2 forward + 4 backward) + 6·L·h·s for causal attention."""
    return 6.0 * model.num_params + 6.0 * model.layers * model.hidden * model.seq_len


def step_rates(*, tokens: int, samples: int, seconds: float, flops_per_token: float, world_size: int,
               peak_tflops: float | None) -> dict:
    """tokens/s and samples/s of the whole job, achieved model TFLOP/s per GPU, and MFU (None without a peak)."""
    tflops = tokens * flops_per_token / seconds / world_size / 1e12
    return {"tokens_per_s": tokens / seconds, "samples_per_s": samples / seconds, "tflops_per_gpu": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None}


def perplexity(loss: float) -> float:
    """exp(loss), capped so that a diverged loss prints as inf instead of raising OverflowError."""
    import math

    return math.exp(loss) if loss < 700 else float("inf")
