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
                             buffers: the reduce bucket
    CPU offload, ZeRO-1/2    params b.Phi, buffers: a gradient staging buffer of the largest tensor (L)
    CPU offload, ZeRO-3      params b.Phi/N (0 with offload_params; the persistent tensors stay), the reduce bucket
  transient at the peak (backward + optimizer step): the live gradients (b.Phi, or b.Phi/N + reduce buckets with
  ZeRO-2/3), the fp32 gradient partition built for the step (4Phi/N, ZeRO-0: 4Phi instead of the 16-bit gradients),
  overlap_comm's 4.5 x bucket sizes; ZeRO-3: the larger of the backward (max_live_parameters gathered, overshot by
  one module, the module gradient being produced and a tied head's embedding gradient: zero3_backward_working) and
  the step (4Phi/N fp32 gradients);
  ZeRO-1/2 offload: the fp32 gradient partition (4Phi/N) on the device from the last backward to the step, the
  gradient being produced (L) and the bucket.
  host (per rank, offload cpu; _host_states): ZeRO-1/2 16Phi/N + b.Phi/N (16-bit partition copy) + b.L (staging);
  ZeRO-3 20Phi/N (two fp32 gradient partitions) + b.Phi/N with offload_params.
  activations (measured with saved-tensor hooks on the real model: dspipe.runtime.actcensus): Korthikanti et al.
  2022's s.b.h(34 + 5as/h) without the s x s scores (SDPA's fused kernels keep q, k, v, the output and an fp32
  log-sum-exp) and without dropout masks at dropout 0: 32sbh per GPT block at 2-byte activations plus fp32 statistics
  (activation_bytes_per_layer, from the ModelSpec: SwiGLU, RMSNorm, rotary, GQA); selective recomputation saves only
  the log-sum-exp, so the search never picks it; full keeps 2sbh per block and peaks at the larger of the head's
  tensors and one recomputed block (they never coincide); the head and loss keep log_softmax's fp32 output, ~4sbV;
  stage i holds the blocks of DeepSpeed's partition (stage_blocks) for min(p - i, m) micro-batches in flight (1F1B).
  start-up (dspipe.planner.startup): host bytes per rank while the module is built in the plan's build mode (the
  stage with the most parameters under a pipeline), or the offload's host peak where larger, times the ranks per
  node, must fit the node's RAM; the build's device transient must fit the usable GPU memory (Estimate.fits).
  GPU (kernels="cuda") and CPU (the gloo runner) kernels differ in the norms' statistics dtype and RMSNorm's saved
  tensors (_norm_bytes_per_token); estimate() uses the GPU type's backend to choose.

Tensor parallel (DeepSpeed AutoTP, t ranks, no Megatron sequence parallelism): a rank holds 1/t of the four block
matrices and of the column-parallel biases (planner/autotp.py's layer specs); embeddings, the head, LayerNorms and the
row-parallel biases stay whole, so Phi above is the per-rank count and ZeRO shards it over dp. Activations per layer
s.b.h(8 + 24/t) plus statistics (Korthikanti et al. eq. 2 without SP, the 5as/(ht) term gone with SDPA, no dropout
masks); full recomputation keeps the
block input 2sbh, replicated on every tp rank; the logits stay whole (the head is not split).
Ulysses sequence parallel (sp ranks): every activation, the recomputation inputs and the logits divide by sp (a rank
holds s/sp tokens); parameters do not, but DeepSpeed partitions ZeRO over its sequence-data-parallel group
(engine.seq_data_parallel_group: dp x sp ranks), so N above is dp x sp.

Time (per step, the slowest pipeline stage): compute at the GPU type's matmul_efficiency (or the rate a
`dspipe calibrate` profile measured for the model's forward + backward: GpuType.compute_tflops), divided by tp (block
matmuls; the replicated head is not) and by sp; TP all-reduces and Ulysses all-to-alls, synchronous; the data-parallel
collectives DeepSpeed 0.19.8 issues (see _dp_comm_s); the 1F1B bubble; pipeline p2p; offload (GpuType's CPU-Adam and
host copy rates); the engine's own optimizer step where the GPU type (a profile) gives its rate. Every collective costs
its bytes over the link's bandwidth plus the ring latency (RING_BASE_LATENCY_S, or a profile's measured launch cost).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from dspipe.planner import autotp
from dspipe.planner.throughput import model_flops_per_token
from dspipe.spec.hardware import GpuType
from dspipe.planner.plan import Plan
from dspipe.spec.core import ClusterSpec, ModelSpec
from dspipe.spec.hardware import GIB
from dspipe.planner.startup import StartupEstimate, build_mode, startup_estimate

FRAMEWORK_RESERVE = int(1.5 * GIB)
"""CUDA context, NCCL buffers and allocator fragmentation (none on the nominal 'cpu' type)."""
MEMORY_HEADROOM = 0.10
"""Fraction of GPU memory a plan leaves free (allocator fragmentation, spikes, what the model does not count):
a plan fits when its peak is at most (1 - headroom) x the GPU's memory."""
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
    host_model_states: int = 0
    """Host bytes this rank's offload holds between steps (census 'host')."""
    host_peak: int = 0
    """Host bytes this rank's offload holds at the step's peak; Estimate.host_memory_bytes is gpus_per_node x this."""

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
    optimizer_s: float = 0.0
    """The engine's own optimizer step over the rank's shard (GpuType.optimizer_params_per_s; 0 where not modelled)."""
    headroom: float = MEMORY_HEADROOM
    """Fraction of GPU memory the plan must leave free."""
    matmul_efficiency: float = 0.5
    """Achieved / peak FLOP/s assumed for the compute (the GPU type's catalog figure, or a profile's measured rate
    over the peak)."""
    startup: StartupEstimate | None = None
    """What the start-up costs: host RAM per node while the ranks build their modules (or hold their offload),
    the device transient of the build, the time to the first step (dspipe.planner.startup)."""

    @property
    def step_time_s(self) -> float:
        return (self.compute_s + self.dp_comm_s + self.bubble_s + self.pp_comm_s + self.offload_s + self.tp_comm_s
                + self.sp_comm_s + self.optimizer_s)

    @property
    def usable_gpu_memory_bytes(self) -> int:
        """GPU memory a plan may use: (1 - headroom) x the device's."""
        return int(self.gpu_memory_bytes * (1 - self.headroom))

    @property
    def fits(self) -> bool:
        """The step's peak within the usable GPU memory, the offload's host bytes within the node's RAM, and the
        start-up too: the node's host peak from the build on, and the build's device transient."""
        return (self.memory.total <= self.usable_gpu_memory_bytes and self.host_memory_bytes <= self.host_memory_capacity
                and not self.startup_host_shortfall_bytes and not self.startup_device_shortfall_bytes)

    @property
    def startup_host_shortfall_bytes(self) -> int:
        """Host bytes per node the start-up needs beyond the node's RAM (0: it fits)."""
        if self.startup is None:
            return 0
        return max(0, self.startup.host_per_node_bytes - self.host_memory_capacity)

    @property
    def startup_device_shortfall_bytes(self) -> int:
        """Device bytes the build's transient needs beyond the usable GPU memory (0: it fits)."""
        if self.startup is None:
            return 0
        return max(0, self.startup.device_bytes - self.usable_gpu_memory_bytes)

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
    sequence length; the world itself is divided only by spec/layout.py)."""
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
def _stage_bounds(model: ModelSpec, pp: int, partition_method: str) -> tuple[int, ...]:
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
    bounds = _stage_bounds(model, pp, partition_method)
    return [max(0, min(b, model.layers + 1) - max(a, 1)) for a, b in zip(bounds, bounds[1:])]


@lru_cache(maxsize=1024)
def _stage_params(model: ModelSpec, pp: int, partition_method: str, tp: int) -> tuple[int, ...]:
    if pp == 1:  # the plain model: a tied head is the embedding itself, not a copy
        split = tp_split_params_per_block(model)
        return (model.num_params - model.layers * (split - _share(split, tp)),)
    bounds = _stage_bounds(model, pp, partition_method)
    local = stage_layer_weights(model, tp)
    return tuple(sum(local[a:b]) for a, b in zip(bounds, bounds[1:]))


KERNELS = ("cuda", "cpu")
"""Whose kernels save the activations: CUDA's fused ones (the GPU runner) or PyTorch's CPU ones (the gloo runner)."""


def _norm_bytes_per_token(model: ModelSpec, *, act_bytes: int, kernels: str) -> int:
    """Bytes one normalisation layer saves per token. CUDA: its input and fp32 statistics (LayerNorm's mean and
    rstd, the fused RMSNorm's rstd). CPU: LayerNorm's statistics are in the activation dtype; RMSNorm is composite
    (torch.rms_norm decomposes off CUDA): it saves the input upcast to fp32, the fp32 normalised tensor and rstd."""
    h = model.hidden
    if model.norm == "rmsnorm":
        return 8 * h + 4 if kernels == "cpu" else act_bytes * h + 4
    return act_bytes * h + 2 * (act_bytes if kernels == "cpu" else 4)


def activation_coefficients(model: ModelSpec) -> tuple[float, float]:
    """(whole on every tp rank, divided by tp) elements per token that one block saves besides its norms, in units
    of h, from the model's declaration (measured by dspipe.runtime.actcensus): whole, the inputs of the fused q/k/v
    and the MLP's up projection (2); split, the attention's saved q, k and v (a storage each when rotary rewrites it
    or grouped-query attention expands it to every query head, otherwise views of the fused q/k/v output, which then
    stays whole: qkv_width / h), its output (1, which the out-projection saves as its input: a view), and the MLP's
    hidden activations: GELU's input and output (2 ffn / h), SwiGLU's fused gate/up output, SiLU's output and the
    product (4 ffn / h). GPT-2/3: 2 + 3 + 1 + 8 = 14, with the two norm inputs 16 elements = 32sbh at 2 bytes."""
    h, grouped, rope = model.hidden, model.kv_groups < model.heads, model.positions == "rope"
    fresh = int(rope) + 2 * int(grouped) + int(rope and not grouped)  # of q, k, v: tensors of their own
    views = 3 - fresh  # q, k, v that are views of the fused projection's output
    qkv = fresh + (model.qkv_width / h if views else 0)
    mlp = (4 if model.mlp == "swiglu" else 2) * model.ffn / h
    return 2.0, qkv + 1 + mlp


def activation_bytes_per_layer(*, model: ModelSpec, micro_batch: int, checkpointing: str, act_bytes: int,
                               tp: int = 1, sp: int = 1, kernels: str = "cuda") -> int:
    """Bytes one transformer block keeps for backward on one rank (measured on the real model: see
    dspipe.runtime.actcensus and docs/planner-accuracy.md). With SDPA's fused kernels no s x s scores are kept: the
    kernel saves q, k, v, its output and the fp32 log-sum-exp (4 bytes per token and head), so Korthikanti et al.'s
    34sbh is 32sbh for GPT (no dropout masks: dropout 0), plus the norms' statistics.
      none: two norms (_norm_bytes_per_token), activation_coefficients' elements at act_bytes (whole + split / t),
        the log-sum-exp (heads / t), rotary's cos and sin tables (4 x s x head_dim, not per sequence), one-byte
        dropout masks (attention and MLP outputs) when dropout > 0.
      selective (the attention core recomputed, as dspipe wires it): DeepSpeed's checkpoint keeps q, k and v, the
        out-projection still saves the core's output: only the log-sum-exp is not kept, so it saves what 'none' does
        (less 4 bytes per token and head) and costs a recomputation.
      full: the block input (act_bytes x h per token), whole on every tp rank; see recompute_working_bytes.
    Ulysses: s is the rank's s/sp tokens. `kernels`: 'cuda' (flash / memory-efficient SDPA, fused norms with fp32
    statistics; the GPU runner) or 'cpu' (PyTorch's CPU kernels: the gloo runner; the CPU SDPA also saves the
    log-sum-exp)."""
    s, b, h = _share(model.seq_len, sp), micro_batch, model.hidden
    tokens = s * b
    if checkpointing == "full":
        return tokens * h * act_bytes
    whole, split = activation_coefficients(model)
    per_token = 2 * _norm_bytes_per_token(model, act_bytes=act_bytes, kernels=kernels) \
        + act_bytes * h * (whole + split / tp)
    if checkpointing == "none":
        per_token += 4 * _share(model.heads, tp)  # the kernel's fp32 log-sum-exp
    if model.dropout > 0:
        per_token += 2 * h
    rotary = 4 * s * model.head_dim * act_bytes if model.positions == "rope" else 0
    return int(tokens * per_token + rotary)


def recompute_working_bytes(*, model: ModelSpec, micro_batch: int, act_bytes: int, tp: int = 1, sp: int = 1,
                            kernels: str = "cuda") -> int:
    """Full recomputation: what one block's recomputed forward saves during its backward, beyond the block input
    the checkpoint already holds. Only one block is rebuilt at a time."""
    none = activation_bytes_per_layer(model=model, micro_batch=micro_batch, checkpointing="none",
                                      act_bytes=act_bytes, tp=tp, sp=sp, kernels=kernels)
    return none - activation_bytes_per_layer(model=model, micro_batch=micro_batch, checkpointing="full",
                                             act_bytes=act_bytes, tp=tp, sp=sp, kernels=kernels)


def logits_bytes(*, model: ModelSpec, micro_batch: int, sp: int = 1, act_bytes: int = 2, kernels: str = "cuda") -> int:
    """What the last stage's final norm, head and loss save: log_softmax's fp32 output (4 bytes x V per token: the
    loss upcasts the logits, which themselves are not kept), the final norm's input and statistics, the head's input
    and the int64 labels. The head is whole on every tp rank; s is s/sp under Ulysses."""
    per_token = 4 * model.vocab + _norm_bytes_per_token(model, act_bytes=act_bytes, kernels=kernels) \
        + act_bytes * model.hidden + 8
    return _share(model.seq_len, sp) * micro_batch * per_token


def embedding_bytes(*, model: ModelSpec, micro_batch: int, sp: int = 1) -> int:
    """What the first stage's embedding saves: the int64 token ids (and learned positions' ids, per position)."""
    s = _share(model.seq_len, sp)
    return 8 * s * micro_batch + (8 * s if model.positions == "learned" else 0)


def micro_batch_activations(*, model: ModelSpec, micro_batch: int, checkpointing: str, act_bytes: int, blocks: int,
                            first: bool, last: bool, tp: int = 1, sp: int = 1,
                            kernels: str = "cuda") -> tuple[int, int]:
    """(held, working): activation bytes one micro-batch keeps on a stage of `blocks` blocks from its forward to its
    backward, and what its backward adds at the moment of its peak. none / selective: every block's saved tensors,
    the embedding's ids on the first stage, the head and loss on the last; nothing added. full: the block inputs (and
    ids) held; at the peak either the head and loss (alive at the end of the forward, freed by the head's backward)
    or one recomputed block (rebuilt after the head's tensors are gone), whichever is larger: they never coincide."""
    per_layer = activation_bytes_per_layer(model=model, micro_batch=micro_batch, checkpointing=checkpointing,
                                           act_bytes=act_bytes, tp=tp, sp=sp, kernels=kernels)
    ids = embedding_bytes(model=model, micro_batch=micro_batch, sp=sp) if first else 0
    head = logits_bytes(model=model, micro_batch=micro_batch, sp=sp, act_bytes=act_bytes, kernels=kernels) \
        if last else 0
    if checkpointing != "full":
        return blocks * per_layer + ids + head, 0
    working = recompute_working_bytes(model=model, micro_batch=micro_batch, act_bytes=act_bytes, tp=tp, sp=sp,
                                      kernels=kernels) if blocks else 0
    return blocks * per_layer + ids, max(head, working)


def persistent_params(*, model: ModelSpec, threshold: int) -> int:
    """Parameters ZeRO-3 keeps whole on every rank: tensors smaller than stage3_param_persistence_threshold."""
    sizes = (math.prod(shape) for _, shape in model.model_tensors())
    return sum(n for n in sizes if n < threshold)


def zero_group_size(plan: Plan) -> int:
    """Ranks ZeRO partitions over and reduces gradients across: DeepSpeed's sequence-data-parallel group, dp x sp
    (engine.seq_data_parallel_group; the plain data-parallel group when sp = 1). AutoTP's tp ranks are not in it."""
    return plan.dp * plan.sp


@lru_cache(maxsize=256)
def largest_tensor(model: ModelSpec) -> int:
    """Elements of the model's largest parameter tensor (the token embedding, or an MLP matrix): the size of ZeRO-1/2
    offload's gradient staging buffers and of the one tensor a ZeRO-3 prefetch may overshoot its bucket by."""
    return max(math.prod(shape) for _, shape in model.model_tensors())


def zero3_gathered_bound(*, model: ModelSpec, plan: Plan) -> int:
    """Elements ZeRO-3 can hold gathered at most under the plan's knobs: the coordinator prefetches only while fewer
    than stage3_max_live_parameters are gathered (parameters kept for reuse count too) and its last prefetched
    tensor can overshoot that by one tensor."""
    return plan.max_live_parameters + largest_tensor(model)


def _modules(tensors: list[tuple[str, tuple[int, ...]]]) -> list[int]:
    """Elements of each parameterised module among `tensors`, in their order (ZeRO-3 gathers, releases and reduces a
    module's parameters together)."""
    modules: dict[str, int] = {}
    for name, shape in tensors:
        owner = name.rsplit(".", 1)[0]
        modules[owner] = modules.get(owner, 0) + math.prod(shape)
    return list(modules.values())


@lru_cache(maxsize=256)
def _forward_modules(model: ModelSpec) -> tuple[int, ...]:
    """Elements of every parameterised module in forward order, the head (a tied one reuses the embedding) last."""
    tensors = model.model_tensors()
    return (*_modules([t for t in tensors if t[0].startswith("embed.")]),
            *_modules(model.block_tensors()) * model.layers,
            *_modules([t for t in tensors if t[0].startswith("final.")]), model.vocab * model.hidden)


def zero3_kept_for_reuse(*, model: ModelSpec, plan: Plan) -> int:
    """Elements ZeRO-3 keeps gathered from their forward to their backward: after a module runs, its parameters stay
    gathered when the trace reuses them within stage3_max_reuse_distance elements; between a module's forward and
    its backward the trace fetches every later module twice, so the kept ones are the model's tail (the head at the
    forward/backward turn at least; DeepSpeed's 1e9 default keeps the whole model, measured)."""
    kept, after = 0, 0
    for size in reversed(_forward_modules(model)):
        if 2 * after > plan.max_reuse_distance:
            break
        kept, after = kept + size, after + size
    return min(kept, model.num_params)  # a tied head is the embedding: counted once


def zero3_backward_working(*, model: ModelSpec, plan: Plan) -> int:
    """Elements ZeRO-3 holds beyond the steady partitions at its backward peak (census of DeepSpeed 0.19.8 at every
    gradient hook, tied GPT and untied Llama): the larger of
      - the blocks: the live parameters gathered (stage3_max_live_parameters, at most what a prefetch bucket past the
        largest tensor brings; the module whose gradient is produced included), overshot by the module prefetched
        past the cap, plus that gradient: the largest two modules adjacent in backward order; or, when
        stage3_max_reuse_distance kept more gathered since the forward, that plus the largest module's gradient;
        with a tied head, the head's share of the embedding gradient (vocab x hidden), held from the head's backward
        to the embedding's;
      - the head: its weight gathered with a prefetch bucket and the first block module past it (or what
        stage3_max_reuse_distance kept gathered since the forward, if more), and its gradient.
    The contiguous reduce bucket is a steady buffer; the gradients are reduced module by module and freed."""
    order = list(reversed(_modules(model.block_tensors())))
    pair = max(a + b for a, b in zip(order, order[1:] + order[:1]))
    head = model.vocab * model.hidden
    kept = zero3_kept_for_reuse(model=model, plan=plan)
    live = min(plan.max_live_parameters, plan.prefetch_bucket_size + largest_tensor(model))
    tied = head if model.tied_embeddings else 0
    # what stayed gathered since the forward, less the head (and final norm) released after their backward; a tied
    # head is the embedding, needed again at the end
    blocks = max(live + pair, kept - (head - tied) + max(order)) + tied
    at_head = max(kept, head + plan.prefetch_bucket_size + order[0]) + head
    return max(blocks, at_head)


def _model_states(*, model: ModelSpec, plan: Plan, phi: int) -> tuple[dict, dict]:
    """(steady, transient) device bytes per rank for params/grads/optimizer/buffers on a stage of phi parameters
    per rank; the host's are _host_states'."""
    n, z, b = zero_group_size(plan), plan.zero_stage, 2 if plan.precision in ("bf16", "fp16") else 4
    mixed = b == 2
    master = 4 * phi if mixed else 0
    adam = 8 * phi
    bucket = plan.reduce_bucket_size * b
    offload = plan.offload != "none"
    largest = b * largest_tensor(model)
    if z == 0:
        steady = dict(params=b * phi, grads=0, optimizer=master + adam, buffers=0)
        # the peak is the optimizer step's fp32 gradients (4Phi); mixed precision frees the 16-bit ones first (census)
        transient = dict(grads=4 * phi, buffers=0)
    elif z == 1 and plan.precision == "bf16" and not offload:
        steady = dict(params=2 * phi, grads=4 * phi, optimizer=12 * phi // n, buffers=0)
        transient = dict(grads=2 * phi, buffers=0)
    elif z in (1, 2) and offload:
        # Device: the 16-bit params, a gradient staging buffer of the largest tensor (temp_grad_buffer_for_gpu_offload);
        # from the last backward to the step the rank's fp32 gradient partition (averaged_gradients, 4Phi/N) and,
        # while a gradient is produced, that gradient (up to the largest tensor; ZeRO-1 keeps every 16-bit gradient
        # until the boundary's reduction, b.Phi) and the reduce bucket.
        # In fp32 the partition is the gradients themselves; a copy of the largest gradient is made on the way out.
        steady = dict(params=b * phi, grads=0, optimizer=0, buffers=largest)
        transient = dict(grads=(b * phi if z == 1 else largest) + bucket,
                         buffers=(4 * phi // n if mixed else 0) + largest + bucket)
    elif z in (1, 2):
        steady = dict(params=b * phi, grads=0, optimizer=12 * phi // n, buffers=0)
        live_grads = b * phi if z == 1 else b * phi // n + 2 * bucket
        # mixed precision: the fp32 gradient partition built for the step (4Phi/N); ZeRO-2 also copies the largest
        # gradient on its way into the partition (census: an unnamed buffer of that size)
        fp32_partition = 4 * phi // n if mixed else 0
        transient = dict(grads=live_grads + fp32_partition,
                         buffers=(int(4.5 * bucket) if plan.overlap_comm else 0) + (largest if z == 2 else 0))
    else:
        persistent = persistent_params(model=model, threshold=plan.param_persistence_threshold)
        # the partitions (moved to the host with offload_params) and the persistent tensors, whole on every rank
        params = b * persistent if plan.offload_params else b * (phi // n + persistent * (n - 1) // n)
        steady = dict(params=params, grads=0 if offload else 4 * phi // n, optimizer=0 if offload else 12 * phi // n,
                      buffers=bucket)  # the contiguous-gradients reduce bucket stays allocated
        backward = dict(grads=0, buffers=b * zero3_backward_working(model=model, plan=plan))
        step = dict(grads=0 if offload else 4 * phi // n, buffers=0)  # the fp32 gradients handed to the optimizer
        transient = max(backward, step, key=lambda t: sum(t.values()))
    return steady, transient


def _host_states(*, model: ModelSpec, plan: Plan, phi: int) -> tuple[int, int]:
    """(between steps, peak) host bytes one rank's offload holds, as DeepSpeed 0.19.8 allocates them (measured:
    dspipe.runtime.census's host rule). ZeRO-1/2 + cpu: fp32 master, fp32 gradient partition and Adam m, v (16Phi/N),
    a 16-bit copy of the partition (b.Phi/N), a host gradient staging buffer of the largest tensor, and with gradient
    accumulation a b.Phi/N accumulation buffer. ZeRO-3 + cpu: fp32 master and Adam (12Phi/N), two fp32 gradient
    partitions (grad_partitions_flat_buffer and the master's .grad, 8Phi/N), with offload_params the 16-bit
    partitions (b.Phi/N). NVMe (not measured: no NVMe here): swap buffers of 2 fp32 and 4 training-dtype reduce
    buckets and, with offload_params, the partitions."""
    n, z, b = zero_group_size(plan), plan.zero_stage, 2 if plan.precision in ("bf16", "fp16") else 4
    if plan.offload == "none":
        return 0, 0
    params = b * phi // n if plan.offload_params else 0
    if plan.offload == "nvme":
        host = 2 * plan.reduce_bucket_size * 4 + 4 * plan.reduce_bucket_size * b + params
        return host, host
    if z in (1, 2):
        host = 16 * phi // n + b * phi // n + b * largest_tensor(model)
        host += b * phi // n if plan.grad_accum > 1 else 0
    else:
        host = 20 * phi // n + params
    return host, host



def _inside_node(span: int, gpus_per_node: int) -> bool:
    """Whether a group of `span` consecutive ranks (aligned to span) sits inside one node."""
    return span <= gpus_per_node and gpus_per_node % span == 0


def ring_latency_s(*, steps: int, inter_steps: int = 0, gpu: GpuType | None = None) -> float:
    """Latency of one ring collective of `steps` steps, `inter_steps` of them across nodes (RING_BASE_LATENCY_S);
    with `gpu`, its launch and intra-node hop costs (a calibration profile measures the launch cost)."""
    if gpu is not None:
        return gpu.ring_base_latency_s + (steps - inter_steps) * gpu.ring_hop_latency_s \
            + inter_steps * RING_HOP_LATENCY_S["inter"]
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
    # Across nodes NCCL runs one ring per NIC, each leaving a node once: the group's g / tp ranks in a node share its
    # g / tp NICs (one per GPU on DGX-class nodes), so the bus bandwidth is their sum, capped by NVLink (nccl-tests
    # busbw across nodes ~ the node's NIC total: NVIDIA/nccl-tests#119, NVIDIA/nccl#1048; docs/hardware.md).
    across = min(gpu.intra_node_gbps, gpu.inter_node_gbps * max(1, g // plan.tp))
    bw = (gpu.intra_node_gbps if inside else across) * 1e9
    hops = 0 if inside else math.ceil(span / g) - 1  # ring steps that cross a node boundary
    ring = ring_latency_s(steps=n - 1, inter_steps=hops, gpu=gpu)
    shard = (n - 1) / n * phi  # elements one reduce-scatter or all-gather moves per rank
    gather = shard * b / bw + math.ceil(phi / plan.allgather_bucket_size) * ring
    reduce = shard * grad_b / bw + math.ceil(phi / plan.reduce_bucket_size) * ring
    all_reduce = 2 * shard * grad_b / bw + math.ceil(phi / ENGINE_ALLREDUCE_BUCKET) * \
        ring_latency_s(steps=2 * (n - 1), inter_steps=2 * hops, gpu=gpu)

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


def estimate(*, model: ModelSpec, cluster: ClusterSpec, plan: Plan, headroom: float = MEMORY_HEADROOM,
             import_bytes: int | None = None) -> Estimate:
    """The plan's memory, time and start-up. `import_bytes`: bytes of the --init-from checkpoint's tensors
    (dspipe.tools.hf_arch.check_weights), None for a random initialisation."""
    gpu = cluster.gpu_type
    n, pp, m, tp, sp = zero_group_size(plan), plan.pp, plan.grad_accum, plan.tp, plan.sp
    b = 2 if plan.precision in ("bf16", "fp16") else 4
    stages = _stage_params(model, pp, plan.partition_method, tp)
    layers_per_stage = math.ceil(model.layers / pp)
    blocks = stage_blocks(model=model, pp=pp, partition_method=plan.partition_method)
    kernels = "cuda" if gpu.backend == "nccl" else "cpu"
    reserve = FRAMEWORK_RESERVE if gpu.backend == "nccl" else 0

    # Memory on the worst stage. Stage 0 holds the embedding and pp micro-batches in flight; the last holds logits.
    worst = None
    for i, phi in enumerate(stages):
        steady, transient = _model_states(model=model, plan=plan, phi=phi)
        held, working = micro_batch_activations(model=model, micro_batch=plan.micro_batch,
                                                checkpointing=plan.checkpointing, act_bytes=b, blocks=blocks[i],
                                                first=i == 0, last=i == pp - 1, tp=tp, sp=sp, kernels=kernels)
        acts = min(pp - i, m) * held + working  # 1F1B: stage i has up to pp - i micro-batches in flight
        host_steady, host_peak = _host_states(model=model, plan=plan, phi=phi)
        mem = Memory(params=steady["params"], grads=steady["grads"] + transient["grads"],
                     optimizer=steady["optimizer"], activations=acts,
                     buffers=steady["buffers"] + transient["buffers"] + reserve,
                     model_states=sum(steady.values()), host_model_states=host_steady, host_peak=host_peak)
        if worst is None or mem.total > worst.total:
            worst, worst_phi = mem, phi

    # Host RAM per node: every GPU of the node offloads its rank's share (the stage with the most parameters).
    host_per_rank = max(_host_states(model=model, plan=plan, phi=phi)[1] for phi in stages)
    host = cluster.gpus_per_node * host_per_rank
    # Start-up: what each rank builds (or imports) before its first step, on the stage with the most parameters.
    startup = startup_estimate(mode=build_mode(zero_stage=plan.zero_stage, tp=tp, pp=pp), num_params=plan.num_params,
                               stage_params=max(stages), largest_tensor=largest_tensor(model),
                               precision=plan.precision, offload_params=plan.offload_params, zero_ranks=n, tp=tp,
                               ranks_per_node=cluster.gpus_per_node, host_offload_per_rank=host_per_rank,
                               import_bytes=import_bytes)

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
    achieved = gpu.compute_tflops(plan.precision) * 1e12  # a profile's measured rate, or peak x efficiency
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
        one = volume / (gpu.intra_node_gbps * 1e9) + ring_latency_s(steps=2 * (tp - 1), gpu=gpu)
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
        one = volume / (bw * 1e9) + ring_latency_s(steps=sp - 1, inter_steps=hops, gpu=gpu)
        sp_comm = m * layers_per_stage * per_layer_ops * one

    dp_comm = _dp_comm_s(model=model, plan=plan, cluster=cluster, phi=worst_phi, fwd_s=fwd_micro, bwd_s=bwd_micro)
    stages_span_nodes = pp > 1 and cluster.nodes > 1
    p2p_bw = (gpu.inter_node_gbps if stages_span_nodes else gpu.intra_node_gbps) * 1e9
    pp_comm = 0.0 if pp == 1 else 2 * m * tokens_micro * model.hidden * b / p2p_bw
    offload = optimizer = 0.0
    if plan.offload == "none" and gpu.optimizer_params_per_s:  # the device's Adam over the params this rank updates
        optimizer = (worst_phi if plan.zero_stage == 0 else worst_phi / n) / gpu.optimizer_params_per_s
    if plan.offload != "none":
        shard = worst_phi / n
        offload = cluster.gpus_per_node * shard / gpu.cpu_adam_params_per_s + 2 * shard * b / (gpu.host_copy_gbps * 1e9)
        if plan.offload == "nvme":
            offload += cluster.gpus_per_node * 2 * 12 * shard / (NVME_GBPS * 1e9)
    return Estimate(memory=worst, gpu_memory_bytes=gpu.memory_bytes, host_memory_bytes=int(host),
                    host_memory_capacity=cluster.host_memory_bytes, compute_s=compute, dp_comm_s=dp_comm, bubble_s=bubble,
                    pp_comm_s=pp_comm, offload_s=offload, flops_per_token=model_flops,
                    hardware_flops_per_token=hw_flops, tp_comm_s=tp_comm, sp_comm_s=sp_comm, headroom=headroom,
                    matmul_efficiency=achieved / peak if (peak := gpu.peak_tflops(plan.precision) * 1e12) else 0.0,
                    optimizer_s=optimizer, startup=startup)


def throughput(*, est: Estimate, model: ModelSpec, cluster: ClusterSpec, plan: Plan) -> tuple[float, float]:
    """(tokens/s, MFU) of the plan."""
    tokens_per_s = plan.tokens_per_step / est.step_time_s
    peak = cluster.world_size * cluster.gpu_type.peak_tflops(plan.precision) * 1e12
    return tokens_per_s, tokens_per_s * est.flops_per_token / peak
