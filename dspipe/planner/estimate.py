"""Memory, communication and time for one Plan. Pure arithmetic: no torch, no deepspeed.

Memory counts what DeepSpeed 0.19 actually allocates per rank (measured with dspipe.runtime.census on live engines, see
docs/planner-accuracy.md), not only the textbook 16 bytes/param:

  steady state after a step (what a rank holds between steps), Phi = params of the rank's pipeline stage,
  N = data-parallel size, b = bytes of the training dtype (2 for bf16/fp16, 4 for fp32):
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
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dspipe.planner.throughput import model_flops_per_token
from dspipe.planner.plan import Plan
from dspipe.planner.spec import ClusterSpec, ModelSpec

GIB = 1024**3
FRAMEWORK_RESERVE = int(1.5 * GIB)
"""CUDA context, NCCL buffers and allocator fragmentation (none on the nominal 'cpu' type)."""
MATMUL_EFFICIENCY = 0.5
"""Achieved / peak TFLOP/s of a whole training step (to be calibrated on a GPU; see docs/planner-accuracy.md)."""
CPU_ADAM_PARAMS_PER_S = 1.0e9
"""DeepSpeedCPUAdam throughput per node, parameters per second."""
PCIE_GBPS = 25.0
"""Host <-> GPU bandwidth per GPU for offload traffic, GB/s."""
NVME_GBPS = 3.0
"""NVMe read + write bandwidth per node, GB/s."""


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
    bubble_s: float
    pp_comm_s: float
    offload_s: float
    flops_per_token: float
    """Model FLOPs per token (6N + 6Lhs), recomputation excluded: the MFU numerator."""
    hardware_flops_per_token: float
    """FLOPs actually executed per token, recomputation included."""

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.dp_comm_s + self.bubble_s + self.pp_comm_s + self.offload_s

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.gpu_memory_bytes and self.host_memory_bytes <= self.host_memory_capacity

    @property
    def shortfall_bytes(self) -> int:
        return max(0, self.memory.total - self.gpu_memory_bytes)


def textbook_model_states(*, num_params: float, zero: int, dp: int) -> float:
    """Bytes per GPU of mixed-precision Adam model states by the ZeRO paper's table (2+2+12 bytes/param):
    16 Phi, 4 Phi + 12 Phi/N, 2 Phi + 14 Phi/N, 16 Phi/N. The planner itself uses DeepSpeed's real layout above."""
    phi, n = num_params, dp
    return {0: 16 * phi, 1: 4 * phi + 12 * phi / n, 2: 2 * phi + 14 * phi / n, 3: 16 * phi / n}[zero]


def run_days(*, flops_per_token: float, tokens: float, gpus: int, tflops_per_gpu: float) -> float:
    """Days to train `tokens` at a sustained per-GPU throughput: flops_per_token x tokens / (gpus x rate)."""
    return flops_per_token * tokens / (gpus * tflops_per_gpu * 1e12) / 86400


def stage_layer_weights(model: ModelSpec) -> list[int]:
    """Parameters of each PipelineModule layer: embedding, blocks, final norm, head (a tied head is a whole copy
    of the embedding module, as DeepSpeed's TiedLayerSpec builds it)."""
    head = model.embedding_params if model.tied_embeddings else model.vocab * model.hidden
    return [model.embedding_params, *([model.params_per_block] * model.layers), 2 * model.hidden, head]


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


def stage_params(*, model: ModelSpec, pp: int, partition_method: str) -> list[int]:
    """Parameters held by each pipeline stage under DeepSpeed's partition methods."""
    if pp == 1:
        return [model.num_params]  # the plain model: a tied head is the embedding itself, not a copy
    weights = stage_layer_weights(model)
    if partition_method == "uniform":
        bounds = _uniform_bounds(len(weights), pp)
    elif partition_method == "type:Block":
        bounds = _balanced_bounds([0, *([1] * model.layers), 0, 0], pp)
    else:
        bounds = _balanced_bounds(weights, pp)
    return [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]


def activation_bytes_per_layer(*, model: ModelSpec, micro_batch: int, checkpointing: str, act_bytes: int) -> int:
    s, b, h = model.seq_len, micro_batch, model.hidden
    scale = act_bytes / 2  # the paper's coefficients assume 2-byte activations
    if checkpointing == "full":
        return int(2 * s * b * h * scale)
    return int(34 * s * b * h * scale)  # SDPA keeps no s x s scores, so 'none' and 'selective' store the same


def persistent_params(*, model: ModelSpec, threshold: int) -> int:
    """Parameters ZeRO-3 keeps whole on every rank: tensors smaller than stage3_param_persistence_threshold."""
    h, f = model.hidden, model.ffn
    block = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, h * f, f, f * h, h]
    tensors = model.layers * block + [model.vocab * h, model.seq_len * h, h, h]
    return sum(n for n in tensors if n < threshold)


def _model_states(*, model: ModelSpec, plan: Plan, phi: int) -> tuple[dict, dict]:
    """(steady, transient) bytes per rank for params/grads/optimizer/buffers on a stage of phi parameters."""
    n, z, b = plan.dp, plan.zero_stage, 2 if plan.precision in ("bf16", "fp16") else 4
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


def estimate(*, model: ModelSpec, cluster: ClusterSpec, plan: Plan) -> Estimate:
    gpu = cluster.gpu_type
    n, pp, m, z = plan.dp, plan.pp, plan.grad_accum, plan.zero_stage
    b = 2 if plan.precision in ("bf16", "fp16") else 4
    stages = stage_params(model=model, pp=pp, partition_method=plan.partition_method)
    layers_per_stage = math.ceil(model.layers / pp)

    # Memory on the worst stage. Stage 0 holds the embedding and pp micro-batches in flight; the last holds logits.
    worst = None
    for i, phi in enumerate(stages):
        steady, transient = _model_states(model=model, plan=plan, phi=phi)
        in_flight = min(pp - i, m)
        per_layer = activation_bytes_per_layer(model=model, micro_batch=plan.micro_batch,
                                               checkpointing=plan.checkpointing, act_bytes=b)
        acts = in_flight * layers_per_stage * per_layer
        if plan.checkpointing == "full":  # one block's full working set is rebuilt during its backward
            acts += activation_bytes_per_layer(model=model, micro_batch=plan.micro_batch, checkpointing="none",
                                               act_bytes=b)
        if i == pp - 1:
            acts += 6 * model.seq_len * plan.micro_batch * model.vocab
        reserve = FRAMEWORK_RESERVE if gpu.backend == "nccl" else 0
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

    # Time.
    model_flops = model_flops_per_token(model)
    extra = {"none": 0.0, "selective": 2 * model.layers * model.hidden * model.seq_len,
             "full": model_flops / 3}[plan.checkpointing]
    hw_flops = model_flops + extra
    achieved = gpu.peak_tflops(plan.precision) * 1e12 * MATMUL_EFFICIENCY
    tokens_per_rank = plan.micro_batch * model.seq_len * m  # per pipeline stage, per step
    compute = tokens_per_rank * hw_flops / pp / achieved
    bubble = compute * (pp - 1) / m

    dp_inside_node = n <= cluster.gpus_per_node and cluster.gpus_per_node % n == 0
    bw = (gpu.intra_node_gbps if dp_inside_node else gpu.inter_node_gbps) * 1e9
    grad_bytes = 4 if (z <= 1 and plan.grad_accum_dtype == "fp32") else b
    volume = 2 * (n - 1) / n * worst_phi * grad_bytes  # reduce-scatter + all-gather, or all-reduce
    if z == 3:
        volume = 3 * (n - 1) / n * worst_phi * b
    dp_comm = volume / bw if n > 1 else 0.0
    if plan.overlap_comm:
        dp_comm = max(0.0, dp_comm - compute * 2 / 3)  # hidden behind backward
    stages_span_nodes = pp > 1 and cluster.nodes > 1
    p2p_bw = (gpu.inter_node_gbps if stages_span_nodes else gpu.intra_node_gbps) * 1e9
    pp_comm = 0.0 if pp == 1 else 2 * m * model.seq_len * plan.micro_batch * model.hidden * b / p2p_bw
    offload = 0.0
    if plan.offload != "none":
        shard = worst_phi / n
        offload = cluster.gpus_per_node * shard / CPU_ADAM_PARAMS_PER_S + 2 * shard * b / (PCIE_GBPS * 1e9)
        if plan.offload == "nvme":
            offload += cluster.gpus_per_node * 2 * 12 * shard / (NVME_GBPS * 1e9)
    return Estimate(memory=worst, gpu_memory_bytes=gpu.memory_bytes, host_memory_bytes=int(host),
                    host_memory_capacity=cluster.host_memory_bytes, compute_s=compute, dp_comm_s=dp_comm, bubble_s=bubble,
                    pp_comm_s=pp_comm, offload_s=offload, flops_per_token=model_flops,
                    hardware_flops_per_token=hw_flops)


def throughput(*, est: Estimate, model: ModelSpec, cluster: ClusterSpec, plan: Plan) -> tuple[float, float]:
    """(tokens/s, MFU) of the plan."""
    tokens_per_s = plan.tokens_per_step / est.step_time_s
    peak = cluster.world_size * cluster.gpu_type.peak_tflops(plan.precision) * 1e12
    return tokens_per_s, tokens_per_s * est.flops_per_token / peak
