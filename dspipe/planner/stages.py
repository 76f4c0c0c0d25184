"""Parameters per rank: pipeline stages, the tensor-parallel split, ZeRO group, largest tensor.

DeepSpeed's stage partition of the PipelineModule layers, a tp rank's share of the blocks, the embedding and the head
(dspipe's tensor-parallel layers, Megatron layout: dspipe/model/tp_split.py), the group ZeRO partitions over. Pure
arithmetic, shared by planner/memory.py, planner/timing.py and planner/cost.py."""

from __future__ import annotations

import math
from functools import lru_cache
from itertools import pairwise

from dspipe.model.tp_split import split_of
from dspipe.model.tp_split import vocab_split as vocab_rows
from dspipe.planner.plan import Plan
from dspipe.spec.model import ModelSpec


def share(count: int, ranks: int) -> int:
    """One rank's share of `count` split evenly over `ranks` (the rules make tp divide the split widths and sp the
    sequence length; the world itself is divided only by spec/layout.py)."""
    return count // ranks


@lru_cache(maxsize=4096)
def tp_split_params_per_block(model: ModelSpec, layer: int | None = None) -> int:
    """Parameters of block `layer` (None: a dense block) that the tensor-parallel layers split across the tp ranks
    (dspipe.model.tp_split: the fused q/k/v and the MLP up-projection, weights and biases, column-parallel; the
    attention out- and MLP down-projection weights, row-parallel). The norms and the row-parallel biases stay
    whole, and so does a sparse block's MLP (router, routed and shared experts: whole on every tp rank)."""
    return sum(math.prod(shape) for name, shape in model.block_tensors(layer) if split_of(f"h.0.{name}", model))


def block_params_per_rank(model: ModelSpec, tp: int = 1, layer: int | None = None) -> int:
    """Parameters of block `layer` (None: a dense block) on one tp rank (ModelSpec.layer_params: a sparse block
    counts every expert, whole on every tp rank)."""
    split = tp_split_params_per_block(model, layer)
    whole = model.params_per_block if layer is None else model.layer_params(layer)
    return whole - split + share(split, tp)


def blocks_params_off_rank(model: ModelSpec, tp: int) -> int:
    """Block parameters one tp rank does not hold: (tp - 1) / tp of every block's split ones."""
    splits = (tp_split_params_per_block(model, i if model.is_sparse(i) else None) for i in range(model.layers))
    return sum(n - share(n, tp) for n in splits)


def vocab_table_per_rank(model: ModelSpec, tp: int = 1) -> int:
    """Parameters of a (vocab, hidden) table on the tp rank with the most rows: ceil(V / tp) x h (vocab-parallel
    embedding and head; the last rank holds the rest, fewer)."""
    return vocab_rows(model.vocab, tp)[0] * model.hidden


def embedding_params_per_rank(model: ModelSpec, tp: int = 1) -> int:
    """The embedding module on one tp rank: its vocab-parallel wte shard and the whole learned positions."""
    return model.embedding_params - model.vocab * model.hidden + vocab_table_per_rank(model, tp)


def stage_layer_weights(model: ModelSpec, tp: int = 1) -> list[int]:
    """Parameters of each PipelineModule layer on one tp rank: embedding, blocks (each its own count: a sparse block
    holds every expert), final norm, head (a tied head is a copy of the embedding module, as DeepSpeed's
    TiedLayerSpec builds it). The blocks' projections, the token embedding and the head are split by tp (the
    vocabulary tables by rows: the rank with the most, ceil(V / tp)); norms and positions are not."""
    head = embedding_params_per_rank(model, tp) if model.tied_embeddings else vocab_table_per_rank(model, tp)
    if not model.experts:
        blocks = [block_params_per_rank(model, tp)] * model.layers
    else:
        blocks = [block_params_per_rank(model, tp, i) for i in range(model.layers)]
    return [embedding_params_per_rank(model, tp), *blocks, model.final_norm_params, head]


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
def stage_bounds(model: ModelSpec, pp: int, partition_method: str, tp: int = 1) -> tuple[int, ...]:
    """DeepSpeed's stage bounds over the PipelineModule layers (embedding, blocks, final norm, head). 'parameters'
    weighs each layer by its whole parameter count at every tp (dspipe.model.pipeline.GPTPipeline counts a
    meta-device build of the whole layer, so every tp rank agrees on the bounds even where its shards differ in
    size); `tp` is kept in the signature for the callers' cache keys."""
    weights = stage_layer_weights(model)
    if partition_method == "uniform":
        return tuple(_uniform_bounds(len(weights), pp))
    if partition_method == "type:Block":
        return tuple(_balanced_bounds([0, *([1] * model.layers), 0, 0], pp))
    return tuple(_balanced_bounds(weights, pp))


@lru_cache(maxsize=1024)
def slowest_stage_share(*, model: ModelSpec, pp: int, partition_method: str, kernels: str | None = None) -> float:
    """The share of a token's training FLOPs that the busiest pipeline stage computes (1 at pp 1): each block its
    6 x parameters + its attention (throughput.layer_attention_flops_per_token under `kernels`), the final norm its
    6 x parameters, the head its logits, 6 x V x h (tied or not), the token embedding's lookup nothing. DeepSpeed's
    'parameters' partition balances parameters, not FLOPs: the stage with the embedding table gets fewer blocks and
    the last stage computes the head too, so the busiest stage does more than 1 / pp of the work."""
    from dspipe.planner.throughput import layer_attention_flops_per_token

    if pp == 1:
        return 1.0
    weights = stage_layer_weights(model)
    idle = (model.experts - model.experts_per_token) * model.expert_params  # a sparse block's experts a token skips
    blocks = [
        6.0 * (w - (idle if model.is_sparse(i) else 0)) + layer_attention_flops_per_token(model, i, kernels=kernels)
        for i, w in enumerate(weights[1 : 1 + model.layers])
    ]
    flops = [0.0, *blocks, 6.0 * model.final_norm_params, 6.0 * model.vocab * model.hidden]
    bounds = stage_bounds(model, pp, partition_method)
    per_stage = [sum(flops[a:b]) for a, b in pairwise(bounds)]
    return max(per_stage) / sum(flops)


@lru_cache(maxsize=1024)
def stage_sparse_blocks(*, model: ModelSpec, pp: int, partition_method: str) -> tuple[int, ...]:
    """Sparse (mixture-of-experts) blocks on each pipeline stage under DeepSpeed's partition."""
    if pp == 1:
        return (len(model.sparse_layers),)
    bounds = stage_bounds(model, pp, partition_method)
    return tuple(sum(1 for i in model.sparse_layers if a <= i + 1 < b) for a, b in pairwise(bounds))


def stage_blocks(*, model: ModelSpec, pp: int, partition_method: str, tp: int = 1) -> list[int]:
    """Transformer blocks on each pipeline stage under DeepSpeed's partition (a stage that holds the embedding or
    the head may get fewer than ceil(L / pp))."""
    if pp == 1:
        return [model.layers]
    bounds = stage_bounds(model, pp, partition_method, tp)
    return [max(0, min(b, model.layers + 1) - max(a, 1)) for a, b in pairwise(bounds)]


@lru_cache(maxsize=1024)
def stage_params(*, model: ModelSpec, pp: int, partition_method: str, tp: int = 1, ep: int = 1) -> tuple[int, ...]:
    """Parameters held by one rank of each pipeline stage under DeepSpeed's partition methods (stage bounds as
    stage_bounds; a rank holds its tp share of the blocks, of the embedding and of the head, and experts / ep of
    the routed experts of every sparse block its stage holds)."""
    if pp == 1:  # the plain model: a tied head is the embedding itself, not a copy
        tables = 1 if model.tied_embeddings else 2
        vocab_off = tables * (model.vocab * model.hidden - vocab_table_per_rank(model, tp))
        return (model.num_params - blocks_params_off_rank(model, tp) - vocab_off - expert_params_off_rank(model, ep),)
    bounds = stage_bounds(model, pp, partition_method, tp)
    held = [w - off for w, off in zip(stage_layer_weights(model, tp), _experts_off_rank(model, ep), strict=True)]
    return tuple(sum(held[a:b]) for a, b in pairwise(bounds))


def _experts_off_rank(model: ModelSpec, ep: int) -> list[int]:
    """Routed-expert parameters of each PipelineModule layer that a rank does not hold: (ep - 1) / ep of a sparse
    block's (stage_layer_weights' order)."""
    pairs = zip(stage_expert_weights(model, ep=1), stage_expert_weights(model, ep=ep), strict=True)
    return [whole - held for whole, held in pairs]


def stage_expert_weights(model: ModelSpec, *, ep: int) -> list[int]:
    """Routed-expert parameters one rank holds in each PipelineModule layer (stage_layer_weights' order): experts / ep
    of a sparse block's routed experts, 0 in every other layer."""
    per_block = [
        share(model.experts, ep) * model.expert_params if model.is_sparse(i) else 0 for i in range(model.layers)
    ]
    return [0, *per_block, 0, 0]


@lru_cache(maxsize=1024)
def stage_experts(*, model: ModelSpec, pp: int, partition_method: str, tp: int = 1, ep: int = 1) -> tuple[int, ...]:
    """Routed-expert parameters held by one rank of each pipeline stage (stage_params' stages): its sparse blocks'
    experts / ep; (routed_expert_params / ep,) without a pipeline."""
    if not model.experts:
        return (0,) * pp
    if pp == 1:
        return (share(model.routed_expert_params, ep),)
    weights = stage_expert_weights(model, ep=ep)
    return tuple(sum(weights[a:b]) for a, b in pairwise(stage_bounds(model, pp, partition_method, tp)))


@lru_cache(maxsize=1024)
def stage_elements(model: ModelSpec, pp: int, partition_method: str, tp: int = 1, ep: int = 1) -> tuple[int, ...]:
    """Whole (unsplit) parameters of each pipeline stage's layers under the stage bounds: what a rank of the stage
    draws at start-up (whole tensors, then sliced to its tp shard; of a sparse block's routed experts only its
    experts / ep). (num_params,) without a pipeline."""
    if pp == 1:
        return (model.num_params,)
    bounds = stage_bounds(model, pp, partition_method, tp)
    drawn = [w - off for w, off in zip(stage_layer_weights(model), _experts_off_rank(model, ep), strict=True)]
    return tuple(sum(drawn[a:b]) for a, b in pairwise(bounds))


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
    experts = _experts_held(model=model, plan=plan, phi=phi)
    # at tp > 1 whole or spread over the tp group (dspipe.runtime.experts.folded: reduced over dp as the tp shards
    # are) or over k tp groups (beyond_tp: over dp / k)
    return [(phi - experts, n), (experts, max(1, plan.expert_dp * plan.sp))]


def _experts_held(*, model: ModelSpec, plan: Plan, phi: int) -> int:
    """The routed-expert parameters of a rank holding `phi` parameters: the model's share at pp 1; under a pipeline
    those of the stage whose ranks hold phi (stage_params; of stages holding the same count, the most)."""
    held, by_phi = _experts_by_stage(model, pp=plan.pp, partition_method=plan.partition_method, tp=plan.tp, ep=plan.ep)
    if plan.pp == 1:
        return held[0]
    return by_phi[phi] if phi in by_phi else min(phi, max(held))


@lru_cache(maxsize=1024)
def _experts_by_stage(
    model: ModelSpec, *, pp: int, partition_method: str, tp: int, ep: int
) -> tuple[tuple[int, ...], dict[int, int]]:
    """(each stage's routed-expert parameters per rank, {a stage's parameters per rank: the most experts of a stage
    holding that many})."""
    held = stage_experts(model=model, pp=pp, partition_method=partition_method, tp=tp, ep=ep)
    by_phi: dict[int, int] = {}
    for p, e in zip(
        stage_params(model=model, pp=pp, partition_method=partition_method, tp=tp, ep=ep), held, strict=True
    ):
        by_phi[p] = max(e, by_phi.get(p, e))
    return held, by_phi


def zero_group_size(plan: Plan) -> int:
    """Ranks ZeRO partitions over and reduces gradients across: DeepSpeed's sequence-data-parallel group, dp x sp
    (engine.seq_data_parallel_group; the plain data-parallel group when sp = 1). The tp ranks are not in it (the
    mpu's data-parallel group excludes them)."""
    return plan.dp * plan.sp


@lru_cache(maxsize=256)
def largest_tensor(model: ModelSpec) -> int:
    """Elements of the model's largest parameter tensor (the token embedding, or an MLP matrix): the size of ZeRO-1/2
    offload's gradient staging buffers and of the one tensor a ZeRO-3 prefetch may overshoot its bucket by."""
    return max(math.prod(shape) for _, shape in model.model_tensors())


@lru_cache(maxsize=256)
def largest_tensor_per_rank(model: ModelSpec, tp: int = 1) -> int:
    """Elements of the largest parameter tensor one tp rank holds (its shard of a split tensor: a block projection
    / tp, a vocabulary table's ceil(V / tp) rows; a whole replicated one); largest_tensor at tp 1."""
    if tp == 1:
        return largest_tensor(model)
    sizes = [vocab_table_per_rank(model, tp), _positions(model)]
    layers = (None, *model.sparse_layers[:1])  # a dense block, and a sparse one's whole experts
    for name, shape in (item for layer in layers for item in model.block_tensors(layer)):
        n = math.prod(shape)
        sizes.append(share(n, tp) if split_of(f"h.0.{name}", model) else n)
    return max(sizes)


def _positions(model: ModelSpec) -> int:
    """Elements of the learned position table (0 with rotary positions)."""
    return model.seq_len * model.hidden if model.positions == "learned" else 0


@lru_cache(maxsize=1024)
def stage_largest_tensors(model: ModelSpec, pp: int, partition_method: str, tp: int = 1) -> tuple[int, ...]:
    """Elements of the largest whole (unsplit) parameter tensor of each pipeline stage's layers: what a tp rank's
    stage build draws at once before it keeps its slice (the vocabulary tables on the first and last stages)."""
    if pp == 1:
        return (largest_tensor(model),)
    per_layer = _largest_per_layer(model)
    bounds = stage_bounds(model, pp, partition_method, tp)
    return tuple(max(per_layer[a:b]) for a, b in pairwise(bounds))


@lru_cache(maxsize=256)
def _largest_per_layer(model: ModelSpec) -> tuple[int, ...]:
    """Elements of the largest whole tensor of each PipelineModule layer (embedding, blocks, final norm, head)."""
    table = model.vocab * model.hidden
    blocks = (max(math.prod(s) for _, s in model.block_tensors(i)) for i in range(model.layers))
    return (max(table, _positions(model)), *blocks, model.hidden, table)
