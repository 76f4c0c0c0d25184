"""Throughput arithmetic shared by the runner, `dspipe bench` and `dspipe report`: model FLOPs per token, the
GPU catalog entry behind a device name, and one step's tokens/s, samples/s, TFLOP/s per GPU and MFU.

MFU counts model FLOPs only (6N + 6·L·h·s per token: weights forward+backward, causal attention scores), never
the recomputation a checkpointing strategy adds, so it compares across strategies (PaLM's definition).
Imports no torch.
"""
from __future__ import annotations

import re

from dspipe.spec import GPU_CATALOG, GpuType, ModelSpec

# metrics.csv (one row per optimizer step, rank 0) and val_metrics.csv columns, in order.
STEP_COLUMNS = ("step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "tflops_per_gpu",
                "mfu", "mem_allocated_gib", "mem_reserved_gib", "step_time_s", "skipped")
VAL_COLUMNS = ("step", "tokens", "val_loss", "val_ppl")

# Most specific first: "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", "NVIDIA H100 80GB HBM3", "NVIDIA H200".
_DEVICE_PATTERNS = (
    (re.compile(r"H200", re.I), "h200"),
    (re.compile(r"H100", re.I), "h100-80g"),
    (re.compile(r"A100.*80\s*GB", re.I), "a100-80g"),
    (re.compile(r"A100", re.I), "a100-40g"),
)


def model_flops_per_token(model: ModelSpec) -> float:
    """Training FLOPs per token: 6N for the weights (2 forward + 4 backward) + 6·L·h·s for causal attention."""
    return 6.0 * model.num_params + 6.0 * model.layers * model.hidden * model.seq_len


def gpu_for_device(device_name: str) -> GpuType | None:
    """The catalog entry for an accelerator's reported name; None for a CPU or an unknown device (MFU n/a)."""
    for pattern, key in _DEVICE_PATTERNS:
        if pattern.search(device_name):
            return GPU_CATALOG[key]
    return None


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
