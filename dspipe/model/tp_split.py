"""How dspipe's tensor-parallel layers (dspipe.runtime.tensor_parallel, Megatron's layout) cut each parameter of the
GPT over tp ranks, as data, and the inverse that puts tp ranks' shards back together (export, generate, checkpoint
checks). Names are the plain GPT's (embed.wte.weight, h.N.attn.c_attn.weight, lm_head.weight, ...); a wrapper's
prefix before them is allowed. Imports no torch at module level.

    attn.c_attn weight/bias     rows, part by part: rank r holds [q_r; k_r; v_r] (q, k, v each split evenly)
    mlp.c_fc weight/bias        rows, part by part: [gate_r; up_r] (SwiGLU) or [fc_r]
    attn.c_proj.weight,         columns (dim 1) split evenly; their biases are replicated (added once after the
    mlp.c_proj.weight           all-reduce)
    embed.wte.weight,           vocabulary rows: rank r holds [r * ceil(V / T), min(V, (r + 1) * ceil(V / T))), so
    lm_head.weight (untied)     the last rank may hold fewer rows
    everything else             replicated: the same tensor on every tp rank (wpe, norms, q/k norms)
"""

from __future__ import annotations

import re

from dspipe.spec.model import ModelSpec

_ANY = r"(?:^|.*\.)"  # h.N., a pipeline layer's N., or nothing
QKV = _ANY + r"attn\.c_attn\.(?:weight|bias)$"
UP = _ANY + r"mlp\.c_fc\.(?:weight|bias)$"
DOWN = (_ANY + r"attn\.c_proj\.weight$", _ANY + r"mlp\.c_proj\.weight$")
VOCAB = (_ANY + r"wte\.weight$", r"^(?:.*\.)?lm_head\.weight$")

VOCAB_SPLIT = "vocab"


def fused_parts(model: ModelSpec) -> dict[str, list[int]]:
    """Rows of each part of the column-parallel projections: c_attn [q, k, v], c_fc [gate, up] or [fc]."""
    hd = model.head_dim
    up = [model.ffn, model.ffn] if model.mlp == "swiglu" else [model.ffn]
    return {QKV: [model.heads * hd, model.kv_groups * hd, model.kv_groups * hd], UP: up}


def split_of(name: str, model: ModelSpec) -> tuple[int, list[int]] | tuple[str, int] | None:
    """How parameter `name` is cut: (0, parts) column-parallel rows part by part, (1, [in_features]) row-parallel
    columns, ("vocab", vocab) vocabulary rows, None replicated."""
    for pattern, parts in fused_parts(model).items():
        if re.match(pattern, name):
            return 0, parts
    if re.match(DOWN[0], name):
        return 1, [model.q_width]
    if re.match(DOWN[1], name):
        return 1, [model.ffn]
    if any(re.match(p, name) for p in VOCAB):
        return VOCAB_SPLIT, model.vocab
    return None


def vocab_split(vocab: int, size: int) -> tuple[int, int]:
    """(rows of every rank but the last, rows of the last) of a (vocab, hidden) table over `size` ranks: ceil(vocab /
    size) each, the last the rest, which may be < 1 (the planner's rules refuse that tp). (vocab, vocab) at 1."""
    per = -(-vocab // size)
    return per, vocab - (size - 1) * per


def vocab_rows(vocab: int, *, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of the vocabulary rows tp rank `rank` of `size` holds: ceil(vocab / size) each, the last the
    rest (dspipe.runtime.tensor_parallel.vocab_rows)."""
    per = -(-vocab // size)
    start, stop = rank * per, min(vocab, (rank + 1) * per)
    if start >= stop:
        raise ValueError(
            f"vocab {vocab} over tp {size}: rank {rank} would hold no rows (ceil({vocab} / {size}) = {per} per rank)"
        )
    return start, stop


def shard_rows(name: str, model: ModelSpec, *, rank: int, size: int) -> list[tuple[int, int]] | None:
    """The [start, stop) ranges along the split dimension of the whole tensor that tp rank `rank` holds, in the order
    it holds them (None: replicated)."""
    rule = split_of(name, model)
    if rule is None or size == 1:
        return None if rule is None else [(0, rule[1] if rule[0] == VOCAB_SPLIT else sum(rule[1]))]
    dim, parts = rule
    if dim == VOCAB_SPLIT:
        return [vocab_rows(parts, rank=rank, size=size)]
    _divisible(name, parts, size)
    return part_rows(parts, rank=rank, size=size)


def part_rows(parts: list[int], *, rank: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) of rank `rank`'s rows of each fused part (dim 0), in the order it holds them: q_r, k_r, v_r or
    gate_r, up_r (each part split evenly over `size`)."""
    out, offset = [], 0
    for part in parts:
        per = part // size
        out.append((offset + rank * per, offset + (rank + 1) * per))
        offset += part
    return out


def split_dim(name: str, model: ModelSpec) -> int | None:
    """The dimension `name` is cut along (0 or 1), None if replicated."""
    rule = split_of(name, model)
    return None if rule is None else (0 if rule[0] == VOCAB_SPLIT else rule[0])


def shard_shape(name: str, shape: tuple[int, ...], model: ModelSpec, *, rank: int, size: int) -> tuple[int, ...]:
    """The shape tp rank `rank` of `size` holds of parameter `name` whose whole shape is `shape`."""
    rows = shard_rows(name, model, rank=rank, size=size)
    if rows is None:
        return tuple(shape)
    dim = split_dim(name, model)
    out = list(shape)
    out[dim] = sum(b - a for a, b in rows)
    return tuple(out)


def shard(name: str, full, model: ModelSpec, *, rank: int, size: int):
    """Tp rank `rank`'s shard of the whole tensor `full` (the tensor itself when replicated)."""
    import torch

    rows = shard_rows(name, model, rank=rank, size=size)
    if rows is None:
        return full
    dim = split_dim(name, model)
    pieces = [full.narrow(dim, a, b - a) for a, b in rows]
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]


def merge_shards(name: str, shards: list, model: ModelSpec):
    """The whole tensor from the tp ranks' shards (rank order). Fused parts are interleaved back (rank r holds
    [q_r; k_r; v_r]: the whole is [q_0; q_1; ...; k_0; ...; v_0; ...]), row-parallel weights concatenated along
    dim 1, vocabulary rows along dim 0 (uneven: the rows must add up to the vocabulary); replicated tensors must be
    equal on every rank. Anything else is a ValueError of one line naming the parameter and the numbers."""
    import torch

    rule, size = split_of(name, model), len(shards)
    if rule is None:
        first = shards[0]
        for r, other in enumerate(shards[1:], start=1):
            if tuple(other.shape) != tuple(first.shape):
                raise ValueError(
                    f"{name}: replicated parameter has shape {list(first.shape)} on tp rank 0 and "
                    f"{list(other.shape)} on tp rank {r}"
                )
            if not torch.equal(other, first):
                worst = (other.float() - first.float()).abs().max().item()
                raise ValueError(
                    f"{name}: replicated parameter differs between tp rank 0 and tp rank {r} "
                    f"(max |difference| {worst:.3g})"
                )
        return first
    dim = split_dim(name, model)
    for r, s in enumerate(shards):
        if s.dim() <= dim:
            raise ValueError(
                f"{name}: tp rank {r}'s shard has shape {list(s.shape)}, no dimension {dim} to merge along"
            )
    held = [s.shape[dim] for s in shards]
    if rule[0] == VOCAB_SPLIT:
        want = [b - a for a, b in (vocab_rows(rule[1], rank=r, size=size) for r in range(size))]
        if held != want:
            raise ValueError(
                f"{name}: tp ranks hold {held} vocabulary rows (sum {sum(held)}), vocab {rule[1]} over "
                f"tp {size} gives {want}"
            )
        return torch.cat(list(shards), dim=0)
    parts = rule[1]
    _divisible(name, parts, size)
    per = [p // size for p in parts]
    if any(h != sum(per) for h in held):
        raise ValueError(
            f"{name}: tp ranks hold {held} along dim {dim}, parts {parts} over tp {size} give {sum(per)} each"
        )
    pieces = [s.split(per, dim=dim) for s in shards]
    return torch.cat([pieces[r][i] for i in range(len(parts)) for r in range(size)], dim=dim)


def _divisible(name: str, parts: list[int], size: int) -> None:
    if any(p % size for p in parts):
        raise ValueError(f"{name}: parts {parts} are not divisible by tp {size}")
