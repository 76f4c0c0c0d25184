"""Throughput arithmetic shared by the runner, `dspipe bench` and `dspipe report`: model FLOPs per token and
one step's tokens/s, samples/s, TFLOP/s per GPU and MFU.

MFU counts model FLOPs only (6N + 6·L·h·s per token, N the active parameters of a mixture of experts: weights
forward+backward, causal attention scores, with heads x head_dim for h and a sliding window's keys for s/2), never the
recomputation a checkpointing strategy adds, so it compares across strategies (PaLM's definition).
Imports no torch.
"""

from __future__ import annotations

from functools import lru_cache

from dspipe.spec.model import ModelSpec

# metrics.csv (one row per optimizer step, rank 0) and val_metrics.csv columns, in order.
STEP_COLUMNS = (
    "step",
    "tokens",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "samples_per_s",
    "tflops_per_gpu",
    "mfu",
    "mem_allocated_gib",
    "mem_reserved_gib",
    "step_time_s",
    "skipped",
    "forward_s",
    "backward_s",
    "optimizer_s",
)
VAL_COLUMNS = ("step", "tokens", "val_loss", "val_ppl")

FLEX_TILE = 128
"""Queries and keys per tile of flex_attention's block mask (create_block_mask's default BLOCK_SIZE): the kernel
computes or skips whole tiles."""


def window_kernel(model: ModelSpec, *, kernels: str) -> str:
    """The kernel of dspipe's windowed blocks (dspipe.model.window.choose_kernel) in training under `kernels`:
    'flex' (flex_attention with a block mask) on the GPU ('cuda') without attention dropout; 'mask' (SDPA with a
    dense (s, s) boolean mask) on the CPU kernels ('cpu') or with dropout (flex_attention has none)."""
    return "flex" if kernels == "cuda" and model.dropout == 0 else "mask"


def flex_window_tiles(*, seq: int, window: int, tile: int = FLEX_TILE) -> int:
    """Tiles (tile x tile queries x keys) a sliding-window block mask keeps over `seq` positions: query tile i
    meets key tiles i - d .. i with d the largest whose nearest pair is inside the window (d x tile - tile + 1 <
    window), so min(i, d) + 1 tiles; the partial tiles on both edges of the band are computed whole."""
    tiles = -(-seq // tile)
    reach = (window + tile - 2) // tile  # d
    inside = min(tiles - 1, reach)  # query tiles 0 .. inside meet every earlier key tile
    return (inside + 1) * (inside + 2) // 2 + max(0, tiles - 1 - reach) * (reach + 1)


def attention_keys_per_query(model: ModelSpec, layer: int, *, kernels: str | None = None) -> float:
    """Keys one query attends to in block `layer`, on average over the sequence: s/2 under causal attention; with a
    sliding window w < s, min(i, w) averaged over positions i, w - w^2/(2s) (s/2 again at w = s). `kernels`
    ('cuda' or 'cpu'; None: what the model needs): what the kernel computes in a windowed block instead
    (window_kernel): flex_attention computes the tiles its block mask keeps and skips the rest,
    flex_window_tiles x 128^2 / s keys per query (~w + 128 at w << s); the masked SDPA skips nothing, s keys."""
    s, w = model.seq_len, model.window_of(layer)
    if w is None or w >= s:
        return s / 2
    if kernels is None:
        return w - w * w / (2 * s)
    if window_kernel(model, kernels=kernels) == "flex":
        return flex_window_tiles(seq=s, window=w) * FLEX_TILE**2 / s
    return float(s)


def layer_attention_flops_per_token(model: ModelSpec, layer: int, *, kernels: str | None = None) -> float:
    """Training FLOPs per token of block `layer`'s attention scores and their weighted sum: q.k^T and softmax.v
    each 2 x heads x head_dim per key, forward, twice that backward: 12 x q_width x keys per query
    (attention_keys_per_query, what the model needs or, under `kernels`, what the kernels compute)."""
    return 12.0 * model.q_width * attention_keys_per_query(model, layer, kernels=kernels)


@lru_cache(maxsize=1024)
def attention_flops_per_token(model: ModelSpec, *, kernels: str | None = None) -> float:
    """Training FLOPs per token of the attention over all blocks (layer_attention_flops_per_token; 6·L·h·s for GPT's
    causal attention)."""
    return sum(layer_attention_flops_per_token(model, layer, kernels=kernels) for layer in range(model.layers))


def model_flops_per_token(model: ModelSpec) -> float:
    """Training FLOPs per token: 6N for the weights (2 forward + 4 backward) + the attention's
    (attention_flops_per_token: 6·L·h·s for causal attention over heads x head_dim = h, bounded by a sliding
    window). N is the active parameters (ModelSpec.active_params: a mixture-of-experts token passes through its
    experts_per_token experts of each sparse block, the router and the shared experts; every parameter for a dense
    model)."""
    return 6.0 * model.active_params + attention_flops_per_token(model)


def step_rates(
    *, tokens: int, samples: int, seconds: float, flops_per_token: float, world_size: int, peak_tflops: float | None
) -> dict[str, float | None]:
    """tokens/s and samples/s of the whole job, achieved model TFLOP/s per GPU, and MFU (None without a peak)."""
    tflops = tokens * flops_per_token / seconds / world_size / 1e12
    return {
        "tokens_per_s": tokens / seconds,
        "samples_per_s": samples / seconds,
        "tflops_per_gpu": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
    }


def perplexity(loss: float) -> float:
    """exp(loss), capped so that a diverged loss prints as inf instead of raising OverflowError."""
    import math

    return math.exp(loss) if loss < 700 else float("inf")
