"""Sliding-window causal attention without an (s, s) mask on the GPU: flex_attention with a block mask.

A windowed block (query q sees keys q - window < k <= q, window < seq) has two kernels:
  mask  scaled_dot_product_attention with the boolean (s, s) window_mask: exact, on every device, with attention
        dropout; but a mask rules out SDPA's flash kernel, computes every score and keeps the mask for backward.
  flex  torch.nn.attention.flex_attention with a block mask of the same rule, run compiled: tiles wholly outside the
        window are skipped (about window / seq of the causal work at window << seq), no (s, s) tensor is kept, only
        the block mask's per-tile indices (built once per (seq, window, device) and cached).
`choose_kernel` picks: flex on CUDA, the mask everywhere else (the CPU path stays the exact reference; torch's
flex_attention has no CPU backward), and the mask wherever attention dropout is on (flex_attention has no dropout).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

KERNELS = ("causal", "mask", "flex")
"""causal: SDPA's is_causal (no window shorter than the sequence); mask and flex: a window's two kernels."""


def choose_kernel(
    *, device_type: str, seq: int, window: int | None, dropout: float, override: str | None = None
) -> str:
    """The kernel of one attention core call: 'causal' without a window shorter than `seq`; else 'flex' on CUDA
    and 'mask' elsewhere or with attention dropout (> 0 only while training), unless `override` ('mask' or 'flex',
    for tests and benchmarks) names one. Forcing flex with dropout on is refused: flex_attention drops nothing."""
    if override not in (None, "mask", "flex"):
        raise ValueError(f"window kernel {override!r}: expected 'mask', 'flex' or None (by device)")
    if window is None or window >= seq:
        return "causal"
    if override == "flex" and dropout > 0:
        raise ValueError(f"window kernel 'flex' has no attention dropout (dropout {dropout}): use 'mask' or None")
    if override is not None:
        return override
    return "flex" if device_type == "cuda" and dropout == 0 else "mask"


def window_rule(window: int) -> Callable:
    """flex_attention's mask_mod for `window`: True where query q may see key k, q - window < k <= q (the rule of
    dspipe.model.gpt.window_mask, element by element)."""

    def allows(batch, head, q, k):
        return (k <= q) & (q - k < window)

    return allows


_BLOCK_MASKS: dict[tuple[int, int, str], object] = {}
"""window_block_mask's masks by (seq, window, device): a plain dict, which torch.compile reads as a constant (it
would trace through an lru_cache and rebuild the mask inside the graph)."""


def window_block_mask(seq: int, window: int, device: str):
    """The BlockMask of `window` over `seq` queries and keys on `device`, shared by every batch and head, built once
    per (seq, window, device): a windowed model's blocks and steps reuse it."""
    key = (seq, window, device)
    block = _BLOCK_MASKS.get(key)
    if block is None:
        block = _BLOCK_MASKS[key] = _build_block_mask(seq, window, device)
    return block


@torch.compiler.disable
def _build_block_mask(seq: int, window: int, device: str):
    """create_block_mask for window_rule(window), always eager (inside a compiled block: a graph break, once)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(window_rule(window), None, None, seq, seq, device=device)


@functools.lru_cache(maxsize=None)
def _compiled_flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_function(device_type: str) -> Callable:
    """flex_attention as it runs on `device_type`: on CUDA compiled once (the fused, tile-skipping kernel; eager
    flex_attention materialises every score), with static shapes (a new (batch, heads, seq, head_dim) compiles
    again), or the plain function where a torch.compile region is being traced (a compiled block: the region
    compiles it); eager elsewhere (torch's dense reference, forward only on the CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda" and not torch.compiler.is_compiling():
        return _compiled_flex()
    return flex_attention


def flex_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int) -> torch.Tensor:
    """Sliding-window causal attention of (batch, heads, seq, head_dim) q, k and v (k and v one per query head),
    SDPA's scale 1/sqrt(head_dim), through flex_attention and the cached block mask; same layout out."""
    seq = q.shape[2]
    if k.shape[2] != seq:
        raise ValueError(f"window attention needs as many keys as queries: {k.shape[2]} keys, {seq} queries")
    block = window_block_mask(seq, window, str(q.device))
    return flex_function(q.device.type)(q, k, v, block_mask=block)
