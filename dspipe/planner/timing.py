"""Seconds of one step: compute, communication, pipeline bubble, offload, optimizer step.

Pure arithmetic: no torch, no deepspeed.

Time (per step, the slowest pipeline stage): compute at the GPU type's matmul_efficiency (or the rate a
`dspipe calibrate` profile measured for the model's forward + backward: GpuType.compute_tflops), divided by tp (dspipe's
tensor-parallel layers split every matmul: the blocks' by heads and MLP width, the head's by vocabulary) and by sp; TP
all-reduces and Ulysses all-to-alls, synchronous; the data-parallel collectives DeepSpeed 0.19.8 issues (see
_dp_comm_s); the 1F1B bubble; pipeline p2p (partitioned over the tp ranks, then all-gathered: DeepSpeed's
pipe_partitioned / grad_partitioned); offload (GpuType's CPU-Adam and
host copy rates); the engine's own optimizer step where the GPU type (a profile) gives its rate. Every collective costs
its bytes over the link's bandwidth plus the ring latency (RING_BASE_LATENCY_S, or a profile's measured launch cost).
Mixture of experts (every layout's experts run through dspipe.runtime.dispatch): model FLOPs count the active
parameters (6 x active + attention per token), executed FLOPs too (no dispatch matmuls, no padding); per sparse
block and micro-batch 4 all-to-alls (dispatch and combine, forward and backward; 6 with full recomputation) of the
routed rows x hidden (memory.routed_rows), (ep-1)/ep of them leaving the rank, on NVLink while the ep group stays in
a node; dense gradients reduced over dp, expert gradients over the dp / ep expert-data-parallel ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dspipe.planner.memory import block_modules, module_sizes, routed_rows
from dspipe.planner.plan import Plan
from dspipe.planner.stages import (
    param_groups,
    share,
    slowest_stage_share,
    stage_blocks,
    stage_sparse_blocks,
    zero_group_size,
)
from dspipe.planner.throughput import attention_flops_per_token, model_flops_per_token
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.dtypes import dtype_bytes
from dspipe.spec.hardware import GpuType
from dspipe.spec.kinds import Checkpointing, Offload
from dspipe.spec.model import ModelSpec

NVME_GBPS = 3.0
"""NVMe read + write bandwidth per node, GB/s."""
RING_BASE_LATENCY_S = 8.4e-6
RING_HOP_LATENCY_S = {"intra": 3.4e-6, "inter": 14e-6}
"""Latency of one ring collective: a launch cost plus one per ring step, inside a node (NVLink) or across nodes
(network); NCCL's own cost model for Ring / Simple (src/graph/tuning.cc: baseLat 8.4 us, hwLat NVLink 3.4 us,
Net 14 us). A ring reduce-scatter or all-gather over n ranks takes n - 1 steps, an all-reduce 2(n - 1). Applied to
gloo's 'cpu' type too, nominally. This is why many small collectives (ZeRO-3's per-module gathers, small buckets)
and very large rings cost more than their bytes."""
ENGINE_ALLREDUCE_BUCKET = 500_000_000
"""Elements per all-reduce when the engine reduces gradients itself (ZeRO-0, BF16_Optimizer):
deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE."""


def _inside_node(span: int, gpus_per_node: int) -> bool:
    """Whether a group of `span` consecutive ranks (aligned to span) sits inside one node."""
    return span <= gpus_per_node and gpus_per_node % span == 0


NIC_AGGREGATION_MAX_NODES = 32
"""Up to this many nodes a data-parallel collective that leaves the node is credited the NIC total of its ranks in a
node (one ring per NIC, each leaving the node once); beyond it, one NIC per GPU. Published runs on both sides
(docs/published-runs.md): FSDP at 8-16 nodes (llm-foundry) ran faster than one NIC per GPU allows; DeepSpeed ZeRO-3
at 48-280 nodes (Narayanan et al. 2021, Table 2: GPT 175B and 530B) kept the same step time when the micro-batch
halved with twice the GPUs, bandwidth-bound at ~16-18 GB/s per GPU of a 25 GB/s NIC. The threshold lies between the
two (16 and 48 nodes); no published run pins it closer."""
ZERO3_OVERLAP = 0.5
"""Fraction of ZeRO-3's parameter gathers and gradient reduce-scatters that its prefetch hides behind the compute
able to cover them (min(communication, compute) x this). Fitted to the 14 published ZeRO-3 / FSDP runs of
docs/published-runs.md: hiding all of it left 13 of them optimistic (planner / published 0.97-1.46); half brings the
14 to 0.94-1.12 (0.4: 0.89-1.10, 0.6: 0.98-1.15)."""


def _across_gbps(*, gpu: GpuType, span: int, stride: int, g: int) -> float:
    """GB/s per rank of a data-parallel collective over `span` ranks (`stride` apart) that leaves the node: NCCL runs
    one ring per NIC, each leaving a node once, so the group's g / stride ranks in a node share their g / stride NICs
    (one per GPU on DGX-class nodes) and the bus bandwidth is their sum, capped by NVLink (nccl-tests busbw across
    nodes ~ the node's NIC total: NVIDIA/nccl-tests#119, NVIDIA/nccl#1048; docs/hardware.md); one NIC per GPU when
    the group spans more than NIC_AGGREGATION_MAX_NODES nodes."""
    if math.ceil(span / g) > NIC_AGGREGATION_MAX_NODES:
        return gpu.inter_node_gbps
    return min(gpu.intra_node_gbps, gpu.inter_node_gbps * max(1, g // stride))


def ring_latency_s(*, steps: int, inter_steps: int = 0, gpu: GpuType | None = None) -> float:
    """Latency of one ring collective of `steps` steps, `inter_steps` of them across nodes (RING_BASE_LATENCY_S);
    with `gpu`, its launch and intra-node hop costs (a calibration profile measures the launch cost)."""
    if gpu is not None:
        return (
            gpu.ring_base_latency_s
            + (steps - inter_steps) * gpu.ring_hop_latency_s
            + inter_steps * RING_HOP_LATENCY_S["inter"]
        )
    return (
        RING_BASE_LATENCY_S
        + (steps - inter_steps) * RING_HOP_LATENCY_S["intra"]
        + inter_steps * RING_HOP_LATENCY_S["inter"]
    )


def zero3_gathers_per_pass(model: ModelSpec, *, threshold: int, ep: int = 1) -> int:
    """All-gathers ZeRO-3 issues in one forward (or backward) pass: one per module whose parameters are partitioned
    (modules under stage3_param_persistence_threshold, `threshold` elements, stay whole: the norms): per dense block
    the QKV, attention-out, MLP-up and MLP-down linears; per sparse block (the model's own SparseMLP under ZeRO-3)
    the attention's two, each routed expert's up and down projections (of the rank's E / ep experts at ep > 1), the
    shared experts' and the router when it is that large; the token and position embeddings and the (tied) head,
    3."""
    return sum(1 for n in block_modules(model, ep=ep) if n >= threshold) + 3


def zero3_expert_gathers_per_pass(model: ModelSpec, *, threshold: int, ep: int) -> int:
    """Of zero3_gathers_per_pass, those of the rank's routed experts (over their expert-data-parallel group)."""
    if not model.experts:
        return 0
    sizes = module_sizes([("expert" + name, shape) for name, shape in model.expert_tensors()])
    per_expert = sum(1 for n in sizes if n >= threshold)
    return len(model.sparse_layers) * (model.experts // ep) * per_expert


def _dp_collectives_s(
    *, model: ModelSpec, plan: Plan, cluster: ClusterSpec, phi: int
) -> tuple[float, float, float, float]:
    """(gather, reduce, all_reduce, shard): _dp_comm_s' seconds of one all-gather, reduce-scatter and all-reduce of
    the rank's parameter groups, and the bytes-only seconds of one all-gather (ZeRO-3's module gathers)."""
    b = dtype_bytes(plan.precision)
    grad_b = 4 if plan.sp > 1 else b
    g = cluster.gpus_per_node
    gpu = cluster.gpu_type
    gather = reduce = all_reduce = shard = 0.0
    # Under MoE the dense parameters are reduced over dp and the rank's experts over the dp / ep expert-data-parallel
    # group (ranks ep apart): stages.param_groups; one group for a dense model.
    for p, n in param_groups(model=model, plan=plan, phi=phi):
        if n == 1 or p == 0:
            continue
        stride = plan.tp * (plan.ep if n != zero_group_size(plan) else 1)
        span = n * stride  # ranks the group spans (n = dp x sp: consecutive, tp apart; experts dp / ep, ep x tp apart)
        inside = _inside_node(span, g)
        bw = (gpu.intra_node_gbps if inside else _across_gbps(gpu=gpu, span=span, stride=stride, g=g)) * 1e9
        hops = 0 if inside else math.ceil(span / g) - 1  # ring steps that cross a node boundary
        ring = ring_latency_s(steps=n - 1, inter_steps=hops, gpu=gpu)
        moved = (n - 1) / n * p  # elements one reduce-scatter or all-gather moves per rank
        shard += moved * b / bw  # the ZeRO-3 module gathers' bytes (at ep > 1 the experts' over their group)
        gather += moved * b / bw + math.ceil(p / plan.allgather_bucket_size) * ring
        reduce += moved * grad_b / bw + math.ceil(p / plan.reduce_bucket_size) * ring
        all_reduce += 2 * moved * grad_b / bw + math.ceil(p / ENGINE_ALLREDUCE_BUCKET) * ring_latency_s(
            steps=2 * (n - 1), inter_steps=2 * hops, gpu=gpu
        )
    return gather, reduce, all_reduce, shard


def _dp_comm_s(
    *, model: ModelSpec, plan: Plan, cluster: ClusterSpec, phi: int, fwd_s: float, bwd_s: float
) -> tuple[float, float]:
    """(all, after the step): seconds per step of data-parallel (ZeRO) collectives not hidden behind compute, and of
    those the all-gather of the updated parameters that the engine's step issues (ZeRO-1 / 2, BF16_Optimizer). As
    DeepSpeed 0.19.8 issues them over the sequence-data-parallel group of N = dp x sp ranks: (N-1)/N of the bytes per
    rank for a reduce-scatter or all-gather, twice that for an all-reduce, at the inter-node bandwidth when the group
    leaves a node (_across_gbps), plus a ring latency per bucket (ring_latency_s). fwd_s / bwd_s: one micro-batch's
    forward and backward (recomputation included) compute, what overlap_comm can hide communication behind.
      ZeRO-0: all-reduces of the gradients at the accumulation boundary (engine.allreduce_gradients), not overlapped.
      bf16 ZeRO-1 without offload (and bf16 ZeRO-0 under a pipeline): BF16_Optimizer; the fp32 accumulated gradients
        are all-reduced at the boundary in the communication dtype, then the updated bf16 params all-gathered.
      ZeRO-1 otherwise: reduce-scatter at the boundary (stage_1_and_2 reduces only there), all-gather after the step.
      ZeRO-2: gradients reduce-scattered in every micro-batch's backward (stage_1_and_2 reduces whenever
        partition_gradients), hidden behind that backward with overlap_comm; params all-gathered after the step.
      ZeRO-3: per micro-batch a forward all-gather, a backward all-gather (one per module) and a reduce-scatter,
        prefetched / overlapped with the forward and the backward, except the forward's first gather (the token
        embedding), ZERO3_OVERLAP of what the pass's compute could cover; no all-gather after the step.
    Gradients travel in the training dtype, in fp32 under Ulysses (DeepSpeed sets the communication dtype to
    seq_parallel_communication_data_type, fp32 by default, when sp > 1); parameters in the training dtype.
    CPU ranks (gloo) hide nothing: their collectives run in the rank's own process on the cores that compute (measured
    on 2 cores: ZeRO-3's forward took 1.55x the planned compute while the plan hid its gathers).
    Mixture of experts: each collective is issued per parameter group (stages.param_groups), the dense parameters
    over dp, the rank's experts over their dp / ep expert-data-parallel ranks (ep apart; fewer bytes, their own
    ring latency); their times add, and overlap_comm hides the sum."""
    z, m = plan.zero_stage, plan.grad_accum
    b = dtype_bytes(plan.precision)
    g = cluster.gpus_per_node
    gpu = cluster.gpu_type
    gather, reduce, all_reduce, shard = _dp_collectives_s(model=model, plan=plan, cluster=cluster, phi=phi)
    if not (gather or reduce or all_reduce):
        return 0.0, 0.0
    n = zero_group_size(plan)
    span = plan.dp * plan.sp * plan.tp
    inside = _inside_node(span, g)
    bw = (gpu.intra_node_gbps if inside else _across_gbps(gpu=gpu, span=span, stride=plan.tp, g=g)) * 1e9
    hops = 0 if inside else math.ceil(span / g) - 1
    ring = ring_latency_s(steps=n - 1, inter_steps=hops, gpu=gpu)

    overlaps = plan.overlap_comm and not gpu.host_is_device  # CPU ranks: gloo runs on the cores computing

    def hidden(comm: float, window: float) -> float:
        return max(0.0, comm - window) if overlaps else comm

    if plan.bf16_optimizer:
        return all_reduce + gather, gather
    if z == 0:
        return all_reduce, 0.0
    if z == 1:
        return hidden(reduce, bwd_s) + gather, gather
    if z == 2:
        return m * hidden(reduce, bwd_s) + gather, gather
    # one ring latency per module gather: the dense modules' over dp, the rank's experts' over their dp / ep ranks
    threshold, ep = plan.param_persistence_threshold, plan.ep
    experts = zero3_expert_gathers_per_pass(model, threshold=threshold, ep=ep)
    module_gathers = shard + (zero3_gathers_per_pass(model, threshold=threshold, ep=ep) - experts) * ring
    if experts and ep > 1 and plan.tp == 1:  # at tp > 1 (spread over the tp group) over dp, as the dense modules
        n_e = n // ep  # ep apart
        span_e = n_e * ep
        hops_e = 0 if _inside_node(span_e, g) else math.ceil(span_e / g) - 1
        module_gathers += experts * (ring_latency_s(steps=n_e - 1, inter_steps=hops_e, gpu=gpu) if n_e > 1 else 0.0)
    elif experts:
        module_gathers += experts * ring
    # The forward's first gather, the token embedding, has no earlier compute to hide behind (the prefetch looks one
    # module ahead of the one computing); every later one overlaps the module before it.
    first = (n - 1) / n * model.vocab * model.hidden * b / bw + ring

    def prefetched(comm: float, window: float) -> float:
        return comm - ZERO3_OVERLAP * min(comm, window) if overlaps else comm

    return m * (first + prefetched(module_gathers - first, fwd_s) + prefetched(module_gathers + reduce, bwd_s)), 0.0


def recomputed_share(*, model: ModelSpec, plan: Plan) -> float:
    """Of the blocks on the stage with the most, the share its backward recomputes: 1 under full recomputation of
    every block, recompute_blocks / the stage's blocks under Megatron's block method, 0 otherwise. Every term that
    re-runs with the forward (its FLOPs, its tp, sp and ep collectives, the experts' calls) scales by it."""
    if plan.checkpointing != Checkpointing.FULL:
        return 0.0
    blocks = max(stage_blocks(model=model, pp=plan.pp, partition_method=plan.partition_method, tp=plan.tp))
    return plan.recomputed(blocks) / blocks if blocks else 0.0


def _tp_comm_s(*, model: ModelSpec, plan: Plan, gpu: GpuType, tokens: int, layers: int) -> float:
    """Seconds per step of the tensor-parallel all-reduces on the slowest stage, `layers` blocks of `tokens` tokens per
    micro-batch: per block and micro-batch, 2 all-reduces of the b.s.h activations in forward (the row-parallel
    attention and MLP outputs), 2 in backward (the column-parallel inputs' gradients), 2 more when full recomputation
    re-runs the forward (times recomputed_share); with per-head q/k norms (Qwen3) 2 more in backward, of their
    head_dim-wide weight gradients (latency only). Per micro-batch, the vocab-parallel embedding's output all-reduce in
    forward and the head's input gradient all-reduce in backward: both on one stage without a pipeline, one on the first
    and the last stage with one (the vocab-parallel cross-entropy's per-token max, sum and target all-reduces are not
    counted: 12 bytes per token against the head's 2h). Ring all-reduce moves 2(t-1)/t of the bytes per rank, over
    NVLink (tp never leaves a node), plus its ring latency. Not credited with overlap: the runtime issues a
    column-parallel layer's backward collectives beside its GEMMs as Megatron does (dspipe.runtime.tensor_parallel), but
    the published Megatron-LM rows, which overlap the same way, already come out at 0.99-1.15 of published without it
    (docs/published-runs.md), and one GPU cannot measure tp here.
    Megatron sequence parallelism (plan.tp_sp): each all-reduce becomes an all-gather and a reduce-scatter, (t-1)/t
    each: per block 4 in forward, 6 in backward (the column-parallel inputs are kept as sequence slices and gathered
    again), 4 more with full recomputation (times recomputed_share);
    the embedding's reduce-scatter and the head's gather, re-gather and reduce-scatter (3) on the slowest stage.
    A mixture of experts (tp needs sequence parallelism there): a sparse block's MLP is no tensor-parallel region
    (half the block's gathers and reduce-scatters) and its parameters (router, routed and shared experts), whole on
    every tp rank, have their gradients all-reduced over the group in each micro-batch's backward, one tensor at a
    time (dspipe.runtime.tensor_parallel.sequence_parallel_experts)."""
    tp = plan.tp
    if tp == 1:
        return 0.0
    b = dtype_bytes(plan.precision)
    latency = ring_latency_s(steps=2 * (tp - 1), gpu=gpu)
    qk_norms = 2 * layers * latency if model.qk_norm else 0.0
    volume = tokens * model.hidden * b / (gpu.intra_node_gbps * 1e9)
    if plan.tp_sp:
        half = (tp - 1) / tp * volume + ring_latency_s(steps=tp - 1, gpu=gpu)
        per_block = 10 + 4 * recomputed_share(model=model, plan=plan)
        ends = 4 if plan.pp == 1 else 3
        sparse = max(stage_sparse_blocks(model=model, pp=plan.pp, partition_method=plan.partition_method))
        gathers = (layers - sparse) * per_block + sparse * per_block / 2 + ends
        return plan.grad_accum * (gathers * half + qk_norms + sparse * _expert_grads_s(model=model, plan=plan, gpu=gpu))
    one = 2 * (tp - 1) / tp * volume + latency
    per_block = 4 + 2 * recomputed_share(model=model, plan=plan)
    ends = 2 if plan.pp == 1 else 1  # the embedding's and the head's: the slowest stage holds one of them
    return plan.grad_accum * ((layers * per_block + ends) * one + qk_norms)


def _expert_grads_s(*, model: ModelSpec, plan: Plan, gpu: GpuType) -> float:
    """Seconds per micro-batch and sparse block of its tp all-reduces: its MLP's gradients (the router, every routed
    expert's and the shared experts' tensors, each on its own: 2(t-1)/t of their bytes over NVLink and a ring
    latency per tensor), and the load-balancing loss's two all-reduces of E numbers in each forward (latency)."""
    tp = plan.tp
    shared = model.mlp_tensors("", model.shared_experts * model.expert_width) if model.shared_experts else []
    forwards = 1 + recomputed_share(model=model, plan=plan)
    routed = 0 if plan.ep > 1 else model.experts  # spread over the tp group (ep = tp): each rank's own, not summed
    tensors = 1 + routed * len(model.expert_tensors()) + len(shared) + 2 * forwards
    params = model.sparse_mlp_params - (model.experts - routed) * model.expert_params
    sent = 2 * (tp - 1) / tp * params * dtype_bytes(plan.precision)
    return sent / (gpu.intra_node_gbps * 1e9) + tensors * ring_latency_s(steps=2 * (tp - 1), gpu=gpu)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step by cause, and the FLOPs behind its compute."""

    compute_s: float
    dp_comm_s: float
    """Data-parallel (ZeRO) collectives not hidden behind the backward pass."""
    dp_after_step_s: float
    """Of dp_comm_s, the all-gather of the updated parameters inside the engine's optimizer step (ZeRO-1 / 2)."""
    bubble_s: float
    pp_comm_s: float
    offload_s: float
    tp_comm_s: float
    """Tensor-parallel activation all-reduces (synchronous)."""
    sp_comm_s: float
    """Ulysses all-to-alls (synchronous)."""
    ep_comm_s: float
    """Expert-parallel all-to-alls (dispatch and combine, synchronous)."""
    optimizer_s: float
    """The engine's own optimizer step over the rank's shard (GpuType.optimizer_params_per_s; 0 where not modelled)."""
    flops_per_token: float
    """Model FLOPs per token (6N + 6Lhs; throughput.py), recomputation excluded: the MFU numerator."""
    hardware_flops_per_token: float
    """FLOPs actually executed per token, recomputation included."""
    matmul_efficiency: float
    """Achieved / peak FLOP/s assumed for the compute (the GPU type's catalog figure, or a profile's measured rate
    over the peak)."""


def _partition(model: ModelSpec, plan: Plan, phi: int) -> float:
    """Parameters of the rank's ZeRO partitions (phi / N; under MoE the dense ones over dp, its experts over
    dp / ep: stages.param_groups)."""
    groups = param_groups(model=model, plan=plan, phi=phi)
    return phi / groups[0][1] if len(groups) == 1 else sum(p / n for p, n in groups)


EXPERT_CALL_S = 6.3e-4
"""On a GPU, the seconds one expert's call takes at least, forward or backward, however little it computes:
dspipe.runtime.dispatch calls the experts one by one from Python, a dozen small kernels each, so with small experts
the GPU idles while the host launches. Fitted to the plain-PyTorch loop over 32 experts of 1024 (top-4, 4 blocks, 4
micro-batches of 8,192 tokens) on the H200 (docs/benchmarks.md, 2026-11-26): 699.8 ms per step where its FLOPs at
the catalog rate take 56 ms, 0.644 s over 1,024 calls. That loop also waited on a nonzero() per expert, which the
dispatch replaces by one wait per block (its counts), so the floor may overstate the dispatch's; DeepSpeed's own
einsum dispatch measured 947.5 ms on the same bench. Taken as 0 on CPU ranks, whose cores compute what they launch."""


def expert_calls_s(*, model: ModelSpec, plan: Plan, gpu: GpuType, tokens: int, achieved: float) -> float:
    """Seconds per micro-batch the MoE layer's expert calls add beyond their FLOPs on a GPU, `tokens` tokens per
    micro-batch, `achieved` FLOP/s: per sparse block on the busiest stage and expert the rank holds (experts / ep),
    each pass (forward, backward, and the forward again under full recomputation) takes at least EXPERT_CALL_S
    beyond the expert's rows at the achieved rate (the mean routed_rows / E). 0 on a dense model and on CPU ranks."""
    if not model.experts or gpu.backend != "nccl":
        return 0.0
    rows = routed_rows(model=model, tokens=tokens) / model.experts
    forward = 2 * model.expert_params * rows / achieved
    floor = [max(0.0, EXPERT_CALL_S - t) for t in (forward, 2 * forward)]
    per_expert = floor[0] * (1 + recomputed_share(model=model, plan=plan)) + floor[1]
    blocks = max(stage_sparse_blocks(model=model, pp=plan.pp, partition_method=plan.partition_method))
    return blocks * (model.experts // plan.ep) * per_expert


def _sp_comm_s(*, model: ModelSpec, plan: Plan, cluster: ClusterSpec, tokens: int, layers: int) -> float:
    """Seconds per step of the Ulysses all-to-alls on the slowest stage, `layers` blocks of `tokens` tokens per
    micro-batch."""
    gpu, m, tp, sp = cluster.gpu_type, plan.grad_accum, plan.tp, plan.sp
    b = dtype_bytes(plan.precision)
    # Ulysses: per layer and micro-batch, 4 all-to-alls in forward (q, k, v to head-sharded, the output back), 4 in
    # backward, 4 more with full recomputation; each sends (sp-1)/sp of the rank's b.(s/sp).(heads x head_dim)
    # activations (k and v are repeated to every query head before the attention core: dspipe.model.gpt), plus
    # sp - 1 steps of latency, over NVLink while the sp group stays inside a node.
    sp_comm = 0.0
    if sp > 1:
        per_layer_ops = 8 + 4 * recomputed_share(model=model, plan=plan)
        volume = (sp - 1) / sp * tokens * model.q_width * b
        inside = _inside_node(sp * tp, cluster.gpus_per_node)
        bw = gpu.intra_node_gbps if inside else gpu.inter_node_gbps
        hops = 0 if inside else math.ceil(sp * tp / cluster.gpus_per_node) - 1
        one = volume / (bw * 1e9) + ring_latency_s(steps=sp - 1, inter_steps=hops, gpu=gpu)
        sp_comm = m * layers * per_layer_ops * one
    return sp_comm


def _ep_comm_s(*, model: ModelSpec, plan: Plan, cluster: ClusterSpec, tokens: int) -> float:
    """Seconds per step of the expert-parallel all-to-alls, `tokens` tokens per micro-batch, on the pipeline stage
    with the most sparse blocks."""
    gpu, m, tp, sp = cluster.gpu_type, plan.grad_accum, plan.tp, plan.sp
    b = dtype_bytes(plan.precision)
    # Expert parallelism (dspipe.runtime.dispatch): per sparse block and micro-batch, an all-to-all-v to dispatch the
    # routed rows to their experts and one to combine them, forward and backward (4; 6 with full recomputation), each
    # sending (ep-1)/ep of the rank's routed rows x h (memory.routed_rows), over NVLink while the ep group (ep
    # consecutive data-parallel ranks) stays inside a node, else the network; plus the counts' all-to-all (E numbers:
    # latency only) per forward. Not overlapped.
    ep_comm = 0.0
    if plan.ep > 1 and model.experts:
        again = recomputed_share(model=model, plan=plan)
        ops, forwards = 4 + 2 * again, 1 + again
        volume = (plan.ep - 1) / plan.ep * routed_rows(model=model, tokens=tokens) * model.hidden * b
        span = plan.ep if tp > 1 else plan.ep * sp  # at tp > 1 the tp group itself (experts.folded)
        inside = _inside_node(span, cluster.gpus_per_node)
        bw = gpu.intra_node_gbps if inside else gpu.inter_node_gbps
        hops = 0 if inside else math.ceil(span / cluster.gpus_per_node) - 1
        one = volume / (bw * 1e9) + ring_latency_s(steps=plan.ep - 1, inter_steps=hops, gpu=gpu)
        counts = ring_latency_s(steps=plan.ep - 1, inter_steps=hops, gpu=gpu)
        blocks = max(stage_sparse_blocks(model=model, pp=plan.pp, partition_method=plan.partition_method))
        ep_comm = m * blocks * (ops * one + forwards * counts)
    return ep_comm


def _pp_comm_s(*, model: ModelSpec, plan: Plan, cluster: ClusterSpec, tokens: int) -> float:
    """Seconds per step of the pipeline's point-to-point sends, `tokens` tokens per micro-batch."""
    gpu, pp, m, tp = cluster.gpu_type, plan.pp, plan.grad_accum, plan.tp
    b = dtype_bytes(plan.precision)
    stages_span_nodes = pp > 1 and cluster.nodes > 1
    p2p_bw = (gpu.inter_node_gbps if stages_span_nodes else gpu.intra_node_gbps) * 1e9
    pp_comm = 0.0
    if pp > 1:  # an activation forward and its gradient backward per micro-batch
        sent = tokens * model.hidden * b
        one = sent / tp / p2p_bw  # pipe_partitioned / grad_partitioned, or tp_sp: each tp rank sends its 1/tp
        if tp > 1 and not plan.tp_sp:  # the receiver all-gathers the tp partitions over NVLink
            one += (tp - 1) / tp * sent / (gpu.intra_node_gbps * 1e9) + ring_latency_s(steps=tp - 1, gpu=gpu)
        pp_comm = 2 * m * one
    return pp_comm


def _offload_optimizer_s(*, model: ModelSpec, plan: Plan, cluster: ClusterSpec, phi: int) -> tuple[float, float]:
    """(offload, optimizer): seconds per step of the offloaded optimizer step and of the engine's own one."""
    gpu = cluster.gpu_type
    b = dtype_bytes(plan.precision)
    offload = optimizer = 0.0
    if plan.offload == Offload.NONE and gpu.optimizer_params_per_s:  # the device's Adam over the params it updates
        whole = plan.zero_stage == 0 and not plan.bf16_optimizer  # BF16_Optimizer partitions over dp at ZeRO-0 too
        optimizer = (phi if whole else _partition(model, plan, phi)) / gpu.optimizer_params_per_s
    if plan.offload != Offload.NONE:
        shard = _partition(model, plan, phi)
        offload = cluster.gpus_per_node * shard / gpu.cpu_adam_params_per_s + 2 * shard * b / (gpu.host_copy_gbps * 1e9)
        if plan.offload == Offload.NVME:
            offload += cluster.gpus_per_node * 2 * 12 * shard / (NVME_GBPS * 1e9)
    return offload, optimizer


def step_time(*, model: ModelSpec, cluster: ClusterSpec, plan: Plan, phi: int) -> StepTime:
    """The step's seconds on the slowest stage, whose ranks hold `phi` parameters each."""
    gpu = cluster.gpu_type
    pp, m, tp, sp = plan.pp, plan.grad_accum, plan.tp, plan.sp
    layers_per_stage = math.ceil(model.layers / pp)

    # Compute: FLOPs per token, split across the tp ranks (every matmul: the blocks' projections and attention by
    # heads and MLP width, the vocab-parallel head by vocabulary) and the sp ranks (each holds s/sp tokens; after the
    # all-to-all, attention runs on heads/sp over the whole sequence).
    # Executed: the model's FLOPs with the attention the kernels run (a windowed block: flex_attention's tiles on
    # the GPU, every score under the CPU's dense mask or with dropout: throughput.window_kernel); recomputation adds
    # the attention core's forward (selective) or the whole forward (full).
    kernels = "cuda" if gpu.backend == "nccl" else "cpu"
    model_flops = model_flops_per_token(model)
    run_attention = attention_flops_per_token(model, kernels=kernels)
    executed = model_flops - attention_flops_per_token(model) + run_attention
    extra = {"none": 0.0, "selective": run_attention / 3, "full": executed / 3}[plan.checkpointing]
    extra *= recomputed_share(model=model, plan=plan) if plan.checkpointing == Checkpointing.FULL else 1
    hw_flops = executed + extra
    rank_flops = hw_flops / tp / sp
    achieved = gpu.compute_tflops(plan.precision) * 1e12  # a profile's measured rate, or peak x efficiency
    tokens_per_replica = plan.micro_batch * model.seq_len * m  # per pipeline stage, per step
    # the busiest stage's share of the work (1 / pp only where the stages' FLOPs are even: the head's are the last
    # stage's, the embedding table's parameters cost the first stage blocks)
    busiest = slowest_stage_share(model=model, pp=pp, partition_method=plan.partition_method, kernels=kernels)
    compute = tokens_per_replica * rank_flops * busiest / achieved
    fwd_share = executed / 3 / hw_flops  # forward: 2N + 2Lhs of the 6N + 6Lhs; the rest (recompute too) is backward
    fwd_micro, bwd_micro = compute / m * fwd_share, compute / m * (1 - fwd_share)
    tokens_micro = plan.micro_batch * share(model.seq_len, sp)
    routed = share(tokens_micro, tp) if plan.tp_sp else tokens_micro  # a tp rank routes its slice (sequence parallel)
    compute += m * expert_calls_s(model=model, plan=plan, gpu=gpu, tokens=routed, achieved=achieved)
    bubble = compute * (pp - 1) / m

    tp_comm = _tp_comm_s(model=model, plan=plan, gpu=gpu, tokens=tokens_micro, layers=layers_per_stage)
    sp_comm = _sp_comm_s(model=model, plan=plan, cluster=cluster, tokens=tokens_micro, layers=layers_per_stage)
    ep_comm = _ep_comm_s(model=model, plan=plan, cluster=cluster, tokens=routed)
    dp_comm, dp_after = _dp_comm_s(model=model, plan=plan, cluster=cluster, phi=phi, fwd_s=fwd_micro, bwd_s=bwd_micro)
    pp_comm = _pp_comm_s(model=model, plan=plan, cluster=cluster, tokens=tokens_micro)
    offload, optimizer = _offload_optimizer_s(model=model, plan=plan, cluster=cluster, phi=phi)
    peak = gpu.peak_tflops(plan.precision) * 1e12
    return StepTime(
        compute_s=compute,
        dp_comm_s=dp_comm,
        dp_after_step_s=dp_after,
        bubble_s=bubble,
        pp_comm_s=pp_comm,
        offload_s=offload,
        tp_comm_s=tp_comm,
        sp_comm_s=sp_comm,
        ep_comm_s=ep_comm,
        optimizer_s=optimizer,
        flops_per_token=model_flops,
        hardware_flops_per_token=hw_flops,
        matmul_efficiency=achieved / peak if peak else 0.0,
    )
