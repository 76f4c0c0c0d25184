"""Parameters per rank: pipeline stages, AutoTP's split, ZeRO group, largest tensor.

DeepSpeed's stage partition of the PipelineModule layers, AutoTP's share of the blocks, the group ZeRO partitions
over. Pure arithmetic, shared by planner/memory.py and planner/timing.py."""
from __future__ import annotations

import math
from functools import lru_cache

from dspipe.planner import autotp
from dspipe.planner.plan import Plan
from dspipe.spec.core import ModelSpec


def share(count: int, ranks: int) -> int:
    """One rank's share of `count` split evenly over `ranks` (the rules make tp divide the split widths and sp the
    sequence length; the world itself is divided only by spec/layout.py)."""
    return count // ranks


def tp_split_params_per_block(model: ModelSpec) -> int:
    """Parameters of one block that AutoTP splits across the tp ranks (dspipe.planner.autotp's layer specs: the
    fused q/k/v and the MLP up-projection, weights and biases, column-parallel; the attention out- and MLP
    down-projection weights, row-parallel). The norms and the row-parallel biases stay whole."""
    return sum(math.prod(shape) for name, shape in model.block_tensors() if autotp.split_of(f"h.0.{name}", model))


def block_params_per_rank(model: ModelSpec, tp: int = 1, layer: int | None = None) -> int:
    """Parameters of block `layer` (None: a dense block) on one tp rank (ModelSpec.layer_params: a sparse block
    counts every expert; the rules keep tp 1 with experts)."""
    split = tp_split_params_per_block(model)
    whole = model.params_per_block if layer is None else model.layer_params(layer)
    return whole - split + share(split, tp)


def stage_layer_weights(model: ModelSpec, tp: int = 1) -> list[int]:
    """Parameters of each PipelineModule layer on one tp rank: embedding, blocks (each its own count: a sparse block
    holds every expert), final norm, head (a tied head is a whole copy of the embedding module, as DeepSpeed's
    TiedLayerSpec builds it). Only the blocks are split by tp."""
    head = model.embedding_params if model.tied_embeddings else model.vocab * model.hidden
    if not model.experts:
        blocks = [block_params_per_rank(model, tp)] * model.layers
    else:
        blocks = [block_params_per_rank(model, tp, i) for i in range(model.layers)]
    return [model.embedding_params, *blocks, model.final_norm_params, head]


def _uniform_bounds(items: int, parts: int) -> list[int]:
    """DeepSpeed's partition_uniform: equal layer counts, the remainder to the first parts."""
    size, extra = divmod(items, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + size + (1 if i < extra else 0))
    return bounds


def _balanced_bounds(weights: list[int], parts: int) -> list[int]:
    """Contiguous split minimising the heaviest part (binary search on the cap, then a greedy cut that leaves
    at least one layer for every remaining part)."""
    def parts_needed(cap: int) -> int:
        count, load = 1, 0
        for w in weights:
            if load + w > cap:
                count, load = count + 1, 0
            load += w
        return count

    lo, hi = max(weights), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if parts_needed(mid) <= parts else (mid + 1, hi)
    bounds, load = [0], 0
    for i, w in enumerate(weights):
        unopened = parts - len(bounds)
        if i > 0 and unopened > 0 and (load + w > lo or len(weights) - i == unopened):
            bounds.append(i)
            load = 0
        load += w
    return bounds + [len(weights)]



@lru_cache(maxsize=1024)
def stage_bounds(model: ModelSpec, pp: int, partition_method: str) -> tuple[int, ...]:
    """DeepSpeed's stage bounds over the PipelineModule layers (embedding, blocks, final norm, head)."""
    weights = stage_layer_weights(model)
    if partition_method == "uniform":
        return tuple(_uniform_bounds(len(weights), pp))
    if partition_method == "type:Block":
        return tuple(_balanced_bounds([0, *([1] * model.layers), 0, 0], pp))
    return tuple(_balanced_bounds(weights, pp))


def stage_blocks(*, model: ModelSpec, pp: int, partition_method: str) -> list[int]:
    """Transformer blocks on each pipeline stage under DeepSpeed's partition (a stage that holds the embedding or
    the head may get fewer than ceil(L / pp))."""
    if pp == 1:
        return [model.layers]
    bounds = stage_bounds(model, pp, partition_method)
    return [max(0, min(b, model.layers + 1) - max(a, 1)) for a, b in zip(bounds, bounds[1:])]



@lru_cache(maxsize=1024)
def stage_params(*, model: ModelSpec, pp: int, partition_method: str, tp: int = 1, ep: int = 1) -> tuple[int, ...]:
    """Parameters held by one rank of each pipeline stage under DeepSpeed's partition methods (stage bounds are
    chosen on the whole layers; a rank holds its tp share of the blocks and experts / ep of every sparse block's
    routed experts)."""
    if pp == 1:  # the plain model: a tied head is the embedding itself, not a copy
        split = tp_split_params_per_block(model)
        return (model.num_params - model.layers * (split - share(split, tp)) - expert_params_off_rank(model, ep),)
    bounds = stage_bounds(model, pp, partition_method)
    local = stage_layer_weights(model, tp)
    return tuple(sum(local[a:b]) for a, b in zip(bounds, bounds[1:]))


def expert_params_off_rank(model: ModelSpec, ep: int) -> int:
    """Routed-expert parameters a rank does not hold: (ep - 1) / ep of them (DeepSpeed MoE gives each expert-parallel
    rank experts / ep of every sparse block; 0 for a dense model)."""
    return model.routed_expert_params - share(model.routed_expert_params, ep) if model.experts else 0


def param_groups(*, model: ModelSpec, plan: Plan, phi: int) -> list[tuple[int, int]]:
    """(parameters, ZeRO group size) of each kind of parameter a rank holds on a stage of `phi` parameters: the dense
    ones partitioned over zero_group_size (dp x sp), and under MoE the rank's routed experts (routed_expert_params /
    ep) over the expert-data-parallel group of dp / ep ranks (DeepSpeed puts the expert parameters in their own
    optimizer groups whose ZeRO partitions and gradient reductions use the expert data parallel group). One group
    for a dense model."""
    n = zero_group_size(plan)
    if not model.experts:
        return [(phi, n)]
    experts = share(model.routed_expert_params, plan.ep)
    return [(phi - experts, n), (experts, max(1, n // plan.ep))]


def zero_group_size(plan: Plan) -> int:
    """Ranks ZeRO partitions over and reduces gradients across: DeepSpeed's sequence-data-parallel group, dp x sp
    (engine.seq_data_parallel_group; the plain data-parallel group when sp = 1). AutoTP's tp ranks are not in it."""
    return plan.dp * plan.sp


@lru_cache(maxsize=256)
def largest_tensor(model: ModelSpec) -> int:
    """Elements of the model's largest parameter tensor (the token embedding, or an MLP matrix): the size of ZeRO-1/2
    offload's gradient staging buffers and of the one tensor a ZeRO-3 prefetch may overshoot its bucket by."""
    return max(math.prod(shape) for _, shape in model.model_tensors())
