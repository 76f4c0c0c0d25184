"""Memory, communication and time for one Plan. Pure arithmetic: no torch, no deepspeed.

Memory counts what DeepSpeed 0.19 actually allocates per rank (measured with dspipe.runtime.census on live engines, see
docs/planner-accuracy.md), not only the textbook 16 bytes/param:

  steady state after a step (what a rank holds between steps), Phi = params of the rank's pipeline stage,
  N = ZeRO group size (dp x sp), b = bytes of the training dtype (2 for bf16/fp16, 4 for fp32):
    ZeRO-0, mixed precision  params 2Phi            optimizer 12Phi (fp32 master + Adam m, v)
    ZeRO-0, fp32             params 4Phi            optimizer 8Phi
    ZeRO-1, bf16             params 2Phi  grads 4Phi (BF16_Optimizer's fp32 accumulation buffer)  optimizer 12Phi/N
    ZeRO-1/2, fp16 or fp32;  params b.Phi           optimizer 12Phi/N (an fp32 master copy is kept even in fp32)
    ZeRO-2, bf16
    ZeRO-3                   params b.Phi/N  grads 4Phi/N (fp32 gradient partitions stay allocated) optimizer 12Phi/N
  transient at the peak (backward + optimizer step): the live gradients (b.Phi, or b.Phi/N + reduce buckets with
  ZeRO-2/3), the fp32 gradient partition built for the step (4Phi/N, ZeRO-0: 4Phi), ZeRO-3's gathered layers and
  prefetch bucket, overlap_comm's 4.5 x bucket sizes.
  activations: Korthikanti et al. 2022, per layer s.b.h(34 + 5as/h) bytes at 2-byte activations, the 5as/h term gone
  with SDPA (flash / memory-efficient kernels), 34sbh with selective recomputation, 2sbh with full; logits and loss
  6.s.b.V at the last stage; 1F1B keeps up to p - i micro-batches in flight on stage i.

Tensor parallel (DeepSpeed AutoTP, t ranks, no Megatron sequence parallelism): a rank holds 1/t of the four block
matrices and of the column-parallel biases (planner/autotp.py's layer specs); embeddings, the head, LayerNorms and the
row-parallel biases stay whole, so Phi above is the per-rank count and ZeRO shards it over dp. Activations per layer
s.b.h(10 + 24/t) (Korthikanti et al. eq. 2 without SP, the 5as/(ht) term gone with SDPA); full recomputation keeps the
block input 2sbh, replicated on every tp rank; the logits stay whole (the head is not split).
Ulysses sequence parallel (sp ranks): every activation, the recomputation inputs and the logits divide by sp (a rank
holds s/sp tokens); parameters do not, but DeepSpeed partitions ZeRO over its sequence-data-parallel group
(engine.seq_data_parallel_group: dp x sp ranks), so N above is dp x sp.

Time (per step, the slowest pipeline stage): compute at the GPU type's matmul_efficiency, divided by tp (block
matmuls; the replicated head is not) and by sp; TP all-reduces and Ulysses all-to-alls, synchronous; the data-parallel
collectives DeepSpeed 0.19.8 issues (see _dp_comm_s); the 1F1B bubble; pipeline p2p; offload. Every collective costs
its bytes over the link's bandwidth plus NCCL's ring latency (RING_BASE_LATENCY_S).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from dspipe.planner import autotp
from dspipe.planner.throughput import model_flops_per_token
from dspipe.planner.plan import Plan
from dspipe.planner.spec import ClusterSpec, ModelSpec

GIB = 1024**3
FRAMEWORK_RESERVE = int(1.5 * GIB)
"""CUDA context, NCCL buffers and allocator fragmentation (none on the nominal 'cpu' type)."""
MEMORY_HEADROOM = 0.10
"""Fraction of GPU memory a plan leaves free (allocator fragmentation, spikes, what the model does not count):
a plan fits when its peak is at most (1 - headroom) x the GPU's memory."""
CPU_ADAM_PARAMS_PER_S = 1.0e9
"""DeepSpeedCPUAdam throughput per node, parameters per second."""
PCIE_GBPS = 25.0
"""Host <-> GPU bandwidth per GPU for offload traffic, GB/s."""
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


@dataclass(frozen=True)
class Memory:
    """Per-GPU bytes at the peak of a step, by kind."""

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    model_states: int
    """Bytes held between steps in params, grads, optimizer and DeepSpeed's buffers (what dspipe.runtime.census counts)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


@dataclass(frozen=True)
class Estimate:
    """What a plan costs: memory per GPU and host, and the time of a step split by cause."""

    memory: Memory
    gpu_memory_bytes: int
    host_memory_bytes: int
    """Host RAM needed per node for offloaded state and pinned buffers."""
    host_memory_capacity: int
    compute_s: float
    dp_comm_s: float
    """Data-parallel (ZeRO) collectives not hidden behind the backward pass."""
    bubble_s: float
    pp_comm_s: float
    offload_s: float
    flops_per_token: float
    """Model FLOPs per token (6N + 6Lhs), recomputation excluded: the MFU numerator."""
    hardware_flops_per_token: float
    """FLOPs actually executed per token, recomputation included."""
    tp_comm_s: float = 0.0
    """Tensor-parallel activation all-reduces (synchronous in AutoTP)."""
    sp_comm_s: float = 0.0
    """Ulysses all-to-alls (synchronous)."""
    headroom: float = MEMORY_HEADROOM
    """Fraction of GPU memory the plan must leave free."""
    matmul_efficiency: float = 0.5
    """Achieved / peak FLOP/s assumed for the compute (the GPU type's catalog figure)."""

    @property
    def step_time_s(self) -> float:
        return (self.compute_s + self.dp_comm_s + self.bubble_s + self.pp_comm_s + self.offload_s + self.tp_comm_s
                + self.sp_comm_s)

    @property
    def usable_gpu_memory_bytes(self) -> int:
        """GPU memory a plan may use: (1 - headroom) x the device's."""
        return int(self.gpu_memory_bytes * (1 - self.headroom))

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_gpu_memory_bytes and self.host_memory_bytes <= self.host_memory_capacity

    @property
    def shortfall_bytes(self) -> int:
        return max(0, self.memory.total - self.usable_gpu_memory_bytes)


def textbook_model_states(*, num_params: float, zero: int, dp: int) -> float:
    """Bytes per GPU of mixed-precision Adam model states by the ZeRO paper's table (2+2+12 bytes/param):
    16 Phi, 4 Phi + 12 Phi/N, 2 Phi + 14 Phi/N, 16 Phi/N. The planner itself uses DeepSpeed's real layout above."""
    phi, n = num_params, dp
    return {0: 16 * phi, 1: 4 * phi + 12 * phi / n, 2: 2 * phi + 14 * phi / n, 3: 16 * phi / n}[zero]


def run_days(*, flops_per_token: float, tokens: float, gpus: int, tflops_per_gpu: float) -> float:
    """Days to train `tokens` at a sustained per-GPU throughput: flops_per_token x tokens / (gpus x rate)."""
    return flops_per_token * tokens / (gpus * tflops_per_gpu * 1e12) / 86400


def _share(count: int, ranks: int) -> int:
    """One rank's share of `count` split evenly over `ranks` (the rules make tp divide the split widths and sp the
    sequence length; the world itself is divided only by planner/layout.py)."""
    return count // ranks


def tp_split_params_per_block(model: ModelSpec) -> int:
    """Parameters of one block that AutoTP splits across the tp ranks (dspipe.planner.autotp's layer specs: the
    fused q/k/v and the MLP up-projection, weights and biases, column-parallel; the attention out- and MLP
    down-projection weights, row-parallel). The norms and the row-parallel biases stay whole."""
    return sum(math.prod(shape) for name, shape in model.block_tensors() if autotp.split_of(f"h.0.{name}", model))


def block_params_per_rank(model: ModelSpec, tp: int = 1) -> int:
    """Parameters of one block on one tp rank."""
    split = tp_split_params_per_block(model)
    return model.params_per_block - split + _share(split, tp)


def stage_layer_weights(model: ModelSpec, tp: int = 1) -> list[int]:
    """Parameters of each PipelineModule layer on one tp rank: embedding, blocks, final norm, head (a tied head is a
    whole copy of the embedding module, as DeepSpeed's TiedLayerSpec builds it). Only the blocks are split by tp."""
    head = model.embedding_params if model.tied_embeddings else model.vocab * model.hidden
    return [model.embedding_params, *([block_params_per_rank(model, tp)] * model.layers), model.final_norm_params, head]


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


def stage_params(*, model: ModelSpec, pp: int, partition_method: str, tp: int = 1) -> list[int]:
    """Parameters held by one rank of each pipeline stage under DeepSpeed's partition methods (stage bounds are
    chosen on the whole layers; a rank holds its tp share of the blocks)."""
    return list(_stage_params(model, pp, partition_method, tp))


@lru_cache(maxsize=1024)
def _stage_params(model: ModelSpec, pp: int, partition_method: str, tp: int) -> tuple[int, ...]:
    if pp == 1:  # the plain model: a tied head is the embedding itself, not a copy
        split = tp_split_params_per_block(model)
        return (model.num_params - model.layers * (split - _share(split, tp)),)
    weights = stage_layer_weights(model)
    if partition_method == "uniform":
        bounds = _uniform_bounds(len(weights), pp)
    elif partition_method == "type:Block":
        bounds = _balanced_bounds([0, *([1] * model.layers), 0, 0], pp)
    else:
        bounds = _balanced_bounds(weights, pp)
    local = stage_layer_weights(model, tp)
    return tuple(sum(local[a:b]) for a, b in zip(bounds, bounds[1:]))


def activation_bytes_per_layer(*, model: ModelSpec, micro_batch: int, checkpointing: str, act_bytes: int,
                               tp: int = 1, sp: int = 1) -> int:
    """Activation bytes one transformer layer keeps for backward on one rank (Korthikanti et al. 2022).
    none / selective: s.b.h(10 + 24/t), the 5as/(ht) score term gone with SDPA (which keeps no s x s scores, so
    'none' and 'selective' store the same); t = 1 gives the paper's 34sbh. full: the block input 2sbh, whole on every
    tp rank. Ulysses: s is the rank's s/sp tokens."""
    s, b, h = _share(model.seq_len, sp), micro_batch, model.hidden
    scale = act_bytes / 2  # the paper's coefficients assume 2-byte activations
    if checkpointing == "full":
        return int(2 * s * b * h * scale)
    whole, split = activation_coefficients(model)
    return int(s * b * h * scale * (whole + split / tp))


def activation_coefficients(model: ModelSpec) -> tuple[float, float]:
    """(whole on every tp rank, divided by tp) activation bytes per layer in units of s.b.h at 2-byte activations,
    from the model's declaration: 10 for the norms' and projections' inputs and the dropout masks; 8 for q, k, v (the
    key/value heads expanded to every query head before attention) and the attention output; the MLP's hidden
    activations 2 bytes x ffn per tensor: GELU keeps fc's output and GELU's (4 ffn/h), SwiGLU the fused gate/up
    output, SiLU's output and the product (8 ffn/h). GPT with ffn 4h: 10 + 24 = Korthikanti's 34."""
    mlp = (4 if model.mlp == "gelu" else 8) * model.ffn / model.hidden
    return 10.0, 8.0 + mlp


def logits_bytes(*, model: ModelSpec, micro_batch: int, sp: int = 1) -> int:
    """Logits and loss at the last stage: 6.s.b.V bytes; the head is whole on every tp rank, s is s/sp under Ulysses."""
    return 6 * _share(model.seq_len, sp) * micro_batch * model.vocab


def persistent_params(*, model: ModelSpec, threshold: int) -> int:
    """Parameters ZeRO-3 keeps whole on every rank: tensors smaller than stage3_param_persistence_threshold."""
    sizes = (math.prod(shape) for _, shape in model.model_tensors())
    return sum(n for n in sizes if n < threshold)


def zero_group_size(plan: Plan) -> int:
    """Ranks ZeRO partitions over and reduces gradients across: DeepSpeed's sequence-data-parallel group, dp x sp
    (engine.seq_data_parallel_group; the plain data-parallel group when sp = 1). AutoTP's tp ranks are not in it."""
    return plan.dp * plan.sp


def _model_states(*, model: ModelSpec, plan: Plan, phi: int) -> tuple[dict, dict]:
    """(steady, transient) bytes per rank for params/grads/optimizer/buffers on a stage of phi parameters per rank."""
    n, z, b = zero_group_size(plan), plan.zero_stage, 2 if plan.precision in ("bf16", "fp16") else 4
    mixed = b == 2
    master = 4 * phi if mixed else 0
    adam = 8 * phi
    bucket = plan.reduce_bucket_size * b
    if z == 0:
        steady = dict(params=b * phi, grads=0, optimizer=master + adam, buffers=0)
        transient = dict(grads=b * phi, buffers=4 * phi if mixed else 0)
    elif z == 1 and plan.precision == "bf16":
        steady = dict(params=2 * phi, grads=4 * phi, optimizer=12 * phi // n, buffers=0)
        transient = dict(grads=2 * phi, buffers=0)
    elif z in (1, 2):
        steady = dict(params=b * phi, grads=0, optimizer=12 * phi // n, buffers=0)
        live_grads = b * phi if z == 1 else b * phi // n + 2 * bucket
        transient = dict(grads=live_grads + 4 * phi // n, buffers=int(4.5 * bucket) if plan.overlap_comm else 0)
    else:
        persistent = persistent_params(model=model, threshold=plan.param_persistence_threshold) * (n - 1) // n
        steady = dict(params=b * (phi // n + persistent), grads=4 * phi // n, optimizer=12 * phi // n, buffers=0)
        gathered = 2 * plan.prefetch_bucket_size * b
        transient = dict(grads=b * phi // n + bucket, buffers=gathered + (int(4.5 * bucket) if plan.overlap_comm else 0))
    if plan.offload != "none":  # optimizer states and fp32 gradients live on the host (or NVMe)
        steady["optimizer"], steady["grads"] = 0, 0
        transient["grads"] = min(transient["grads"], b * phi // n + 2 * bucket)
        if plan.offload_params:
            steady["params"] = 0
    return steady, transient



def _inside_node(span: int, gpus_per_node: int) -> bool:
    """Whether a group of `span` consecutive ranks (aligned to span) sits inside one node."""
    return span <= gpus_per_node and gpus_per_node % span == 0


def ring_latency_s(*, steps: int, inter_steps: int = 0) -> float:
    """Latency of one ring collective of `steps` steps, `inter_steps` of them across nodes (RING_BASE_LATENCY_S)."""
    return RING_BASE_LATENCY_S + (steps - inter_steps) * RING_HOP_LATENCY_S["intra"] \
        + inter_steps * RING_HOP_LATENCY_S["inter"]


def zero3_gathers_per_pass(model: ModelSpec) -> int:
    """All-gathers ZeRO-3 issues in one forward (or backward) pass: one per module whose parameters are partitioned
    (tensors under stage3_param_persistence_threshold = 10h stay whole): per block the QKV, attention-out, MLP-up
    and MLP-down linears; the token and position embeddings; the (tied) head."""
    return 4 * model.layers + 3


def _dp_comm_s(*, model: ModelSpec, plan: Plan, cluster: ClusterSpec, phi: int, fwd_s: float,
               bwd_s: float) -> float:
    """Seconds per step of data-parallel (ZeRO) collectives not hidden behind compute, as DeepSpeed 0.19.8 issues them
    over the sequence-data-parallel group of N = dp x sp ranks: (N-1)/N of the bytes per rank for a reduce-scatter or
    all-gather, twice that for an all-reduce, at the inter-node bandwidth when the group leaves a node, plus a ring
    latency per bucket (ring_latency_s). fwd_s / bwd_s: one micro-batch's forward and backward (recomputation
    included) compute, what overlap_comm can hide communication behind.
      ZeRO-0: all-reduces of the gradients at the accumulation boundary (engine.allreduce_gradients), not overlapped.
      bf16 ZeRO-1 without offload (and bf16 ZeRO-0 under a pipeline): BF16_Optimizer; the fp32 accumulated gradients
        are all-reduced at the boundary in the communication dtype, then the updated bf16 params all-gathered.
      ZeRO-1 otherwise: reduce-scatter at the boundary (stage_1_and_2 reduces only there), all-gather after the step.
      ZeRO-2: gradients reduce-scattered in every micro-batch's backward (stage_1_and_2 reduces whenever
        partition_gradients), hidden behind that backward with overlap_comm; params all-gathered after the step.
      ZeRO-3: per micro-batch a forward all-gather, a backward all-gather (one per module) and a reduce-scatter,
        prefetched / overlapped with the forward and the backward, except the forward's first gather (the token
        embedding); no all-gather after the step.
    Gradients travel in the training dtype, in fp32 under Ulysses (DeepSpeed sets the communication dtype to
    seq_parallel_communication_data_type, fp32 by default, when sp > 1); parameters in the training dtype."""
    n, z, m = zero_group_size(plan), plan.zero_stage, plan.grad_accum
    if n == 1:
        return 0.0
    b = 2 if plan.precision in ("bf16", "fp16") else 4
    grad_b = 4 if plan.sp > 1 else b
    span, g = plan.dp * plan.sp * plan.tp, cluster.gpus_per_node  # the group's ranks: consecutive, tp apart
    inside = _inside_node(span, g)
    gpu = cluster.gpu_type
    bw = (gpu.intra_node_gbps if inside else gpu.inter_node_gbps) * 1e9
    hops = 0 if inside else math.ceil(span / g) - 1  # ring steps that cross a node boundary
    ring = ring_latency_s(steps=n - 1, inter_steps=hops)
    shard = (n - 1) / n * phi  # elements one reduce-scatter or all-gather moves per rank
    gather = shard * b / bw + math.ceil(phi / plan.allgather_bucket_size) * ring
    reduce = shard * grad_b / bw + math.ceil(phi / plan.reduce_bucket_size) * ring
    all_reduce = 2 * shard * grad_b / bw + math.ceil(phi / ENGINE_ALLREDUCE_BUCKET) * \
        ring_latency_s(steps=2 * (n - 1), inter_steps=2 * hops)

    def hidden(comm: float, window: float) -> float:
        return max(0.0, comm - window) if plan.overlap_comm else comm

    bf16_optimizer = plan.precision == "bf16" and plan.offload == "none" and (z == 1 or (z == 0 and plan.pp > 1))
    if bf16_optimizer:
        return all_reduce + gather
    if z == 0:
        return all_reduce
    if z == 1:
        return hidden(reduce, bwd_s) + gather
    if z == 2:
        return m * hidden(reduce, bwd_s) + gather
    module_gathers = shard * b / bw + zero3_gathers_per_pass(model) * ring
    # The forward's first gather, the token embedding, has no earlier compute to hide behind (the prefetch looks one
    # module ahead of the one computing); every later one overlaps the module before it.
    first = (n - 1) / n * model.vocab * model.hidden * b / bw + ring
    return m * (first + hidden(module_gathers - first, fwd_s) + hidden(module_gathers + reduce, bwd_s))


def estimate(*, model: ModelSpec, cluster: ClusterSpec, plan: Plan, headroom: float = MEMORY_HEADROOM) -> Estimate:
    gpu = cluster.gpu_type
    n, pp, m, tp, sp = zero_group_size(plan), plan.pp, plan.grad_accum, plan.tp, plan.sp
    b = 2 if plan.precision in ("bf16", "fp16") else 4
    stages = _stage_params(model, pp, plan.partition_method, tp)
    layers_per_stage = math.ceil(model.layers / pp)
    per_layer = activation_bytes_per_layer(model=model, micro_batch=plan.micro_batch,
                                           checkpointing=plan.checkpointing, act_bytes=b, tp=tp, sp=sp)
    working_set = 0
    if plan.checkpointing == "full":  # one block's full working set is rebuilt during its backward
        working_set = activation_bytes_per_layer(model=model, micro_batch=plan.micro_batch, checkpointing="none",
                                                 act_bytes=b, tp=tp, sp=sp)
    reserve = FRAMEWORK_RESERVE if gpu.backend == "nccl" else 0

    # Memory on the worst stage. Stage 0 holds the embedding and pp micro-batches in flight; the last holds logits.
    worst = None
    for i, phi in enumerate(stages):
        steady, transient = _model_states(model=model, plan=plan, phi=phi)
        acts = min(pp - i, m) * layers_per_stage * per_layer + working_set
        if i == pp - 1:
            acts += logits_bytes(model=model, micro_batch=plan.micro_batch, sp=sp)
        mem = Memory(params=steady["params"], grads=steady["grads"] + transient["grads"],
                     optimizer=steady["optimizer"], activations=acts,
                     buffers=steady["buffers"] + transient["buffers"] + reserve,
                     model_states=sum(steady.values()))
        if worst is None or mem.total > worst.total:
            worst, worst_phi = mem, phi

    host = 0
    if plan.offload != "none":
        per_rank = 16 * worst_phi // n + (b * worst_phi // n if plan.offload_params else 0)
        host = cluster.gpus_per_node * (per_rank if plan.offload == "cpu" else 2 * plan.reduce_bucket_size * 4)
        host += cluster.gpus_per_node * 4 * plan.reduce_bucket_size * b  # pinned staging buffers

    # Compute: FLOPs per token, split across the tp ranks (block matmuls only: AutoTP keeps the head whole) and the
    # sp ranks (each holds s/sp tokens; after the all-to-all, attention runs on heads/sp over the whole sequence).
    model_flops = model_flops_per_token(model)
    extra = {"none": 0.0, "selective": 2 * model.layers * model.hidden * model.seq_len,
             "full": model_flops / 3}[plan.checkpointing]
    hw_flops = model_flops + extra
    rank_flops = hw_flops
    if tp > 1:
        head = 6.0 * model.hidden * model.vocab  # forward 2hV + backward 4hV, never recomputed
        rank_flops = (hw_flops - head) / tp + head
    rank_flops /= sp
    achieved = gpu.peak_tflops(plan.precision) * 1e12 * gpu.matmul_efficiency
    tokens_per_replica = plan.micro_batch * model.seq_len * m  # per pipeline stage, per step
    compute = tokens_per_replica * rank_flops / pp / achieved
    bubble = compute * (pp - 1) / m
    fwd_share = model_flops / 3 / hw_flops  # forward: 2N + 2Lhs of the 6N + 6Lhs; the rest (recompute too) is backward
    fwd_micro, bwd_micro = compute / m * fwd_share, compute / m * (1 - fwd_share)

    # Tensor parallel: per layer and micro-batch, 2 all-reduces of the b.s.h activations in forward (attention and
    # MLP outputs), 2 in backward (their input gradients), 2 more when full recomputation re-runs the forward.
    # Ring all-reduce moves 2(t-1)/t of the bytes per rank, over NVLink (tp never leaves a node), plus its ring
    # latency. Not overlapped.
    tokens_micro = plan.micro_batch * _share(model.seq_len, sp)
    tp_comm = 0.0
    if tp > 1:
        per_layer_ops = 6 if plan.checkpointing == "full" else 4
        volume = 2 * (tp - 1) / tp * tokens_micro * model.hidden * b
        one = volume / (gpu.intra_node_gbps * 1e9) + ring_latency_s(steps=2 * (tp - 1))
        tp_comm = m * layers_per_stage * per_layer_ops * one
    # Ulysses: per layer and micro-batch, 4 all-to-alls in forward (q, k, v to head-sharded, the output back), 4 in
    # backward, 4 more with full recomputation; each sends (sp-1)/sp of the rank's b.(s/sp).h activations (plus sp - 1
    # steps of latency), over NVLink while the sp group stays inside a node.
    sp_comm = 0.0
    if sp > 1:
        per_layer_ops = 12 if plan.checkpointing == "full" else 8
        volume = (sp - 1) / sp * tokens_micro * model.hidden * b
        inside = _inside_node(sp * tp, cluster.gpus_per_node)
        bw = gpu.intra_node_gbps if inside else gpu.inter_node_gbps
        hops = 0 if inside else math.ceil(sp * tp / cluster.gpus_per_node) - 1
        one = volume / (bw * 1e9) + ring_latency_s(steps=sp - 1, inter_steps=hops)
        sp_comm = m * layers_per_stage * per_layer_ops * one

    dp_comm = _dp_comm_s(model=model, plan=plan, cluster=cluster, phi=worst_phi, fwd_s=fwd_micro, bwd_s=bwd_micro)
    stages_span_nodes = pp > 1 and cluster.nodes > 1
    p2p_bw = (gpu.inter_node_gbps if stages_span_nodes else gpu.intra_node_gbps) * 1e9
    pp_comm = 0.0 if pp == 1 else 2 * m * tokens_micro * model.hidden * b / p2p_bw
    offload = 0.0
    if plan.offload != "none":
        shard = worst_phi / n
        offload = cluster.gpus_per_node * shard / CPU_ADAM_PARAMS_PER_S + 2 * shard * b / (PCIE_GBPS * 1e9)
        if plan.offload == "nvme":
            offload += cluster.gpus_per_node * 2 * 12 * shard / (NVME_GBPS * 1e9)
    return Estimate(memory=worst, gpu_memory_bytes=gpu.memory_bytes, host_memory_bytes=int(host),
                    host_memory_capacity=cluster.host_memory_bytes, compute_s=compute, dp_comm_s=dp_comm, bubble_s=bubble,
                    pp_comm_s=pp_comm, offload_s=offload, flops_per_token=model_flops,
                    hardware_flops_per_token=hw_flops, tp_comm_s=tp_comm, sp_comm_s=sp_comm, headroom=headroom,
                    matmul_efficiency=gpu.matmul_efficiency)


def throughput(*, est: Estimate, model: ModelSpec, cluster: ClusterSpec, plan: Plan) -> tuple[float, float]:
    """(tokens/s, MFU) of the plan."""
    tokens_per_s = plan.tokens_per_step / est.step_time_s
    peak = cluster.world_size * cluster.gpu_type.peak_tflops(plan.precision) * 1e12
    return tokens_per_s, tokens_per_s * est.flops_per_token / peak
