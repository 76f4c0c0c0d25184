"""How DeepSpeed's AutoTP splits dspipe's blocks, as data: the partition_config layer specs the rendered JSON
carries, and the inverse (which dimension, which fused parts) that export uses to put the shards back together.
Imports no torch at module level.

Megatron's split: the fused q/k/v projection and the MLP up-projection are column-parallel (output features split),
the attention out-projection and the MLP down-projection row-parallel (input features split, outputs all-reduced,
bias added once). Fused projections are split part by part so that every rank gets whole heads (q/k/v biases
with them): q/k/v as 3 equal
parts (`shape [3, -1]`), or under grouped-query attention as unequal parts (`shape [[q, k, v], -1]` in rows); a
SwiGLU's fused gate/up as 2 parts. Norms, embeddings and the head stay replicated. Qwen3's per-head q/k norm
weights are shared by all heads, so they stay whole on every rank, but each rank applies them to its own heads
only: their gradients are summed over the tp group (a `skip` spec with `grad_allreduce`, DeepSpeed's
replicated-with-gradient-all-reduce), else the replicas drift apart (measured 0.10 after 6 steps).
"""
from __future__ import annotations

import re

from dspipe.spec.core import ModelSpec

_BLOCK = r"(?:^|.*\.)"  # any prefix: the plain model's h.N., or a wrapper's module. prefixes
QKV = _BLOCK + r"attn\.c_attn\.(?:weight|bias)$"
UP = _BLOCK + r"mlp\.c_fc\.(?:weight|bias)$"
DOWN = (_BLOCK + r"attn\.c_proj\.weight$", _BLOCK + r"mlp\.c_proj\.weight$")
QK_NORM = _BLOCK + r"attn\.[qk]_norm\.weight$"


def fused_parts(model: ModelSpec) -> dict[str, list[int]]:
    """Rows of each part of the fused column-parallel projections: c_attn [q, k, v] (heads x head_dim and twice
    kv_heads x head_dim, head_dim being the spec's, not necessarily hidden / heads), c_fc [gate, up] or [fc]."""
    hd = model.head_dim
    up = [model.ffn, model.ffn] if model.mlp == "swiglu" else [model.ffn]
    return {QKV: [model.heads * hd, model.kv_groups * hd, model.kv_groups * hd], UP: up}


def layer_specs(model: ModelSpec) -> list[dict]:
    """DeepSpeed AutoTP TPLayerSpec dicts (tensor_parallel.partition_config.layer_specs) for `model`'s blocks."""
    out = []
    for pattern, parts in fused_parts(model).items():
        spec = {"patterns": [pattern], "partition_type": "column"}
        if len(parts) > 1:
            spec["shape"] = [len(parts) if len(set(parts)) == 1 else parts, -1]
            spec["partition_dim"] = 0
        out.append(spec)
    out.append({"patterns": list(DOWN), "partition_type": "row"})
    if model.qk_norm:  # replicated, applied by each rank to its own heads: gradients summed over tp
        out.append({"patterns": [QK_NORM], "partition_type": "skip", "grad_allreduce": True})
    return out


def partition_config(model: ModelSpec) -> dict:
    """tensor_parallel.partition_config for `model`: only these specs, none of DeepSpeed's model presets."""
    return {"use_default_specs": False, "layer_specs": layer_specs(model)}


def split_of(name: str, model: ModelSpec) -> tuple[int, list[int]] | None:
    """(dimension the shards are concatenated along, row counts of the fused parts) for a sharded parameter;
    None if replicated (a row-parallel bias is replicated: it is added once after the all-reduce)."""
    for pattern, parts in fused_parts(model).items():
        if re.match(pattern, name):
            return 0, parts
    if any(re.match(p, name) for p in DOWN):
        return 1, [model.q_width if "attn" in name.rsplit(".", 3)[-3] else model.ffn]  # the input features
    return None


def merge_shards(name: str, shards: list, model: ModelSpec):
    """The full tensor from the tp ranks' shards (rank order). Fused parts are interleaved back: rank r holds
    [q_r; k_r; v_r], the full tensor is [q_0; q_1; ...; k_0; ...; v_0; ...]."""
    import torch

    rule = split_of(name, model)
    if rule is None:
        first = shards[0]
        for r, other in enumerate(shards[1:], start=1):
            if other.shape != first.shape or not torch.equal(other, first):
                raise ValueError(f"{name}: replicated parameter differs between tp rank 0 and tp rank {r}")
        return first
    dim, parts = rule
    ranks = len(shards)
    rows = [divmod(p, ranks) for p in parts]
    if any(rest for _, rest in rows):
        raise ValueError(f"{name}: parts {parts} are not divisible by tp {ranks}")
    pieces = [s.split([size for size, _ in rows], dim=dim) for s in shards]
    return torch.cat([pieces[r][i] for i in range(len(parts)) for r in range(ranks)], dim=dim)
