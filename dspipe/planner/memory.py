"""Memory per rank for one Plan: model states, activations, host offload.

Pure arithmetic: no torch, no deepspeed.

Memory counts what DeepSpeed 0.19 actually allocates per rank (measured with benchmarks/census/tensors.py on live
engines, see docs/planner-accuracy.md), not only the textbook 16 bytes/param:

  steady state after a step (what a rank holds between steps), Phi = params of the rank's pipeline stage,
  N = ZeRO group size (dp x sp), b = bytes of the training dtype (2 for bf16/fp16, 4 for fp32):
    ZeRO-0, mixed precision  params 2Phi            optimizer 12Phi (fp32 master + Adam m, v)
    ZeRO-0, fp32             params 4Phi            optimizer 8Phi
    ZeRO-1, bf16             params 2Phi  grads 4Phi (BF16_Optimizer's fp32 accumulation buffer)  optimizer 12Phi/N
                             (16-bit gradients at the peak: 2Phi, or the largest tensor's with immediate_grad_update)
    ZeRO-0, bf16, pp > 1     the same BF16_Optimizer, with bf16 accumulation: grads 2Phi; at the step the rank's
                             partition cast to fp32 (4Phi/N), beside the 16-bit gradients unless immediate_grad_update
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
  activations (measured with saved-tensor hooks on the real model: benchmarks/census/activations.py): Korthikanti et al.
  2022's s.b.h(34 + 5as/h) without the s x s scores (SDPA's fused kernels keep q, k, v, the output and an fp32
  log-sum-exp) and without dropout masks at dropout 0: 32sbh per GPT block at 2-byte activations plus fp32 statistics
  (activation_bytes_per_layer, from the ModelSpec: SwiGLU, RMSNorm, rotary, GQA); selective recomputation saves only
  the log-sum-exp, so the search never picks it; full keeps 2sbh per block and peaks at the larger of the head's
  tensors and one recomputed block (they never coincide); the head and loss keep log_softmax's fp32 output, ~4sbV
  (with strategy.loss_chunk = c > 0, the chunked cross-entropy: a 4sb log-sum-exp, and one chunk's cV fp32 logits
  (+ cV at b in 16-bit) during the loss's backward);
  stage i holds the blocks of DeepSpeed's partition (stage_blocks) for min(p - i, m) micro-batches in flight (1F1B).
  start-up (dspipe.planner.startup): host bytes per rank while the module is built in the plan's build mode (the
  stage with the most parameters under a pipeline), or the offload's host peak where larger, times the ranks per
  node, must fit the node's RAM; the build's device transient must fit the usable GPU memory (Estimate.fits).
  GPU (kernels="cuda") and CPU (the gloo runner) kernels differ in the norms' statistics dtype and RMSNorm's saved
  tensors (_norm_bytes_per_token) and in a windowed block's (s, s) mask, kept by the CPU's masked SDPA but not by
  the GPU's flex_attention (window_mask_bytes); stage_memory uses the GPU type's backend to choose.

Tensor parallel (dspipe's tensor-parallel layers, Megatron layout, t ranks): a
rank holds 1/t of the four block matrices and of the column-parallel biases, and ceil(V / t) rows of the token
embedding and of an untied head (vocab-parallel; a tied head shares the embedding's shard) (dspipe/model/tp_split.py,
planner/stages.py); learned positions, norms and the row-parallel biases stay whole, so Phi above is the per-rank
count and ZeRO shards it over dp. Activations per layer s.b.h(8 + 24/t) plus statistics (Korthikanti et al. eq. 2
without SP, the 5as/(ht) term gone with SDPA, no dropout masks): the regions outside the split GEMMs (norms, residual
adds, the block input) stay whole on every tp rank; full recomputation keeps the block input 2sbh, whole. With
Megatron sequence parallelism (plan.tp_sp, on by default) those hold the rank's s/t tokens instead: 34sbh/t (eq. 4). The
cross-entropy is vocab-parallel (the full logits are never gathered): the head's fp32 softmax is ceil(V / t) wide.
ZeRO-3 at t > 1 counts the rank's shard as Phi but the whole model's modules in its gathered working set
(zero3_backward_working: an overestimate).
Ulysses sequence parallel (sp ranks): every activation, the recomputation inputs and the logits divide by sp (a rank
holds s/sp tokens); parameters do not, but DeepSpeed partitions ZeRO over its sequence-data-parallel group
(engine.seq_data_parallel_group: dp x sp ranks), so N above is dp x sp.
Mixture of experts (ep expert-parallel ranks inside dp: DeepSpeed's native MoE layer under ZeRO 0-2 at tp = sp = 1,
the model's own SparseMLP under ZeRO-3, its experts spread the same way; with tp > 1 the model's own at ep 1, whole
on every tp rank, each routing its s / tp tokens):
a rank holds the dense parameters Phi_d (attention, norms, embeddings, routers, shared experts) and experts / ep of
every sparse block's routed experts (its stage's under a pipeline: stages.stage_experts), Phi_e =
routed_expert_params / ep at pp 1, so Phi = Phi_d + Phi_e; DeepSpeed puts the
experts in their own optimizer groups, partitioned by ZeRO over the expert-data-parallel group (dp / ep ranks), so
every X.Phi/N above is X.Phi_d/dp + X.Phi_e/(dp/ep) (stages.param_groups), except ZeRO-2's live 16-bit gradients
in bf16 (fp32 gradient accumulation): b.Phi_d/dp as a dense model's, but of the experts only b.Phi_e/(dp/ep) x the
share of an expert's parameters in tensors larger than the reduce bucket (expert_grads_kept; DeepSpeed reduces a
bucketed gradient straight into the fp32 partition and keeps no 16-bit copy: 0 for most MoE shapes, whose expert
matrices fit the h x h bucket; fp16 and fp32 keep every gradient of the partition). A sparse block's MLP saves
moe_mlp_activation_bytes instead of the dense MLP's hidden activations: the router's fp32 logits and probabilities
and the routed rows' inputs, hidden activations and weighted outputs (dspipe.runtime.dispatch, which every layout's
experts run through: k x tokens rows, fewer under a capacity factor; no masks, no padding).
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass
from functools import lru_cache

from dspipe.model.tp_split import vocab_split as vocab_rows
from dspipe.planner.plan import Plan
from dspipe.planner.stages import (
    largest_tensor,
    largest_tensor_per_rank,
    param_groups,
    share,
    stage_blocks,
    stage_params,
    zero_group_size,
)
from dspipe.planner.throughput import window_kernel
from dspipe.runtime.experts import capacity_slots
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.dtypes import dtype_bytes
from dspipe.spec.hardware import GIB
from dspipe.spec.kinds import Checkpointing, Offload
from dspipe.spec.model import ModelSpec

FRAMEWORK_RESERVE = int(1.5 * GIB)
"""CUDA context, NCCL buffers and allocator fragmentation (none on the nominal 'cpu' type)."""
MEMORY_HEADROOM = 0.10
"""Fraction of GPU memory a plan leaves free (allocator fragmentation, spikes, what the model does not count):
a plan fits when its peak is at most (1 - headroom) x the GPU's memory."""


@dataclass(frozen=True)
class Memory:
    """Per-GPU bytes at the peak of a step, by kind."""

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    model_states: int
    """Bytes held between steps in params, grads, optimizer and DeepSpeed's buffers (what benchmarks/census/tensors.py
    counts)."""
    host_model_states: int = 0
    """Host bytes this rank's offload holds between steps (census 'host')."""
    host_peak: int = 0
    """Host bytes this rank's offload holds at the step's peak; Estimate.host_memory_bytes is gpus_per_node x this."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


def _norm_bytes_per_token(model: ModelSpec, *, act_bytes: int, kernels: str) -> int:
    """Bytes one normalisation layer saves per token. CUDA: its input and fp32 statistics (LayerNorm's mean and
    rstd, the fused RMSNorm's rstd). CPU: LayerNorm's statistics are in the activation dtype; RMSNorm is composite
    (torch.rms_norm decomposes off CUDA): it saves the input upcast to fp32, the fp32 normalised tensor and rstd."""
    h = model.hidden
    if model.norm == "rmsnorm":
        return 8 * h + 4 if kernels == "cpu" else act_bytes * h + 4
    return act_bytes * h + 2 * (act_bytes if kernels == "cpu" else 4)


def _fused_qkv_views(model: ModelSpec) -> int:
    """How many of the attention core's q, k, v are views of the fused q/k/v output (the rest are tensors of their
    own: q and k when rotary or the q/k norm rewrites them, k and v when grouped-query attention repeats them)."""
    grouped, rewritten = model.kv_groups < model.heads, model.positions == "rope" or model.qk_norm
    return 3 - (int(rewritten) + 2 * int(grouped) + int(rewritten and not grouped))


def activation_coefficients(model: ModelSpec) -> tuple[float, float]:
    """(whole on every tp rank, divided by tp) elements per token that one block saves besides its norms, in units of h,
    from the model's declaration (measured by benchmarks/census/activations.py): whole, the inputs of the fused q/k/v
    and the MLP's up projection (2); split, the attention's saved q, k and v (heads x head_dim = q_width each when
    rotary or the q/k norm rewrites it or grouped-query attention expands it to every query head, otherwise views of
    the fused q/k/v output, which then stays whole: qkv_width / h), its output (q_width / h, which the out-projection
    saves as its input: a view), and the MLP's hidden activations: GELU's input and output (2 ffn / h), SwiGLU's fused
    gate/up output, SiLU's output and the product (4 ffn / h). GPT-2/3: 2 + 3 + 1 + 8 = 14, with the two norm inputs
    16 elements = 32sbh at 2 bytes. The q/k norm's own tensors are _qk_norm_bytes_per_token's."""
    h, q = model.hidden, model.q_width / model.hidden
    views = _fused_qkv_views(model)
    qkv = (3 - views) * q + (model.qkv_width / h if views else 0)
    mlp = (4 if model.mlp == "swiglu" else 2) * model.ffn / h
    return 2.0, qkv + q + mlp


def _qk_norm_bytes_per_token(model: ModelSpec, *, act_bytes: int, kernels: str) -> int:
    """Bytes per token the per-head RMSNorm of q and k (Qwen3) saves, all divided by tp (the heads are): per norm
    its input and fp32 statistics (one per head). The input is a view of the fused q/k/v output, whose storage is
    then kept whole unless q, k or v already keeps it; CPU (composite RMSNorm) also saves the fp32 normalised
    tensor, and in 16-bit the fp32 copy of the input instead of the input (as _norm_bytes_per_token)."""
    if not model.qk_norm:
        return 0
    width = model.q_width + model.kv_groups * model.head_dim
    stats = 4 * (model.heads + model.kv_groups)
    if kernels == "cpu" and act_bytes != 4:
        return 8 * width + stats
    fused = 0 if _fused_qkv_views(model) else act_bytes * model.qkv_width
    return fused + (4 * width if kernels == "cpu" else 0) + stats


def window_mask_bytes(model: ModelSpec, *, act_bytes: int) -> int:
    """Bytes a block with a sliding window shorter than the sequence saves for its attention where it runs the
    masked kernel (throughput.window_kernel: the CPU kernels, or attention dropout): SDPA converts the (s, s)
    boolean window mask to an additive one in the activation dtype and keeps it for backward, one per block and
    micro-batch, whatever the batch, heads or tp (the whole sequence's under Ulysses: the core runs after the
    all-to-all). Causal attention (SDPA's is_causal) and flex_attention's block mask (per-tile indices, built once
    and shared) keep none."""
    return act_bytes * model.seq_len**2


def windowed_blocks(model: ModelSpec, layers: range) -> int:
    """Blocks among `layers` whose sliding window is shorter than the sequence (they run a window kernel:
    throughput.window_kernel)."""
    if model.sliding_window is None or model.sliding_window >= model.seq_len:
        return 0
    return len(range(max(layers.start, model.window_start_layer), layers.stop))  # window_of: from that layer on


def activation_bytes_per_layer(
    *,
    model: ModelSpec,
    micro_batch: int,
    checkpointing: str,
    act_bytes: int,
    tp: int = 1,
    sp: int = 1,
    kernels: str = "cuda",
    windowed: bool | None = None,
    sparse: bool = False,
    tp_sp: bool = False,
) -> int:
    """Bytes one transformer block keeps for backward on one rank (measured on the real model: see
    benchmarks/census/activations.py and docs/planner-accuracy.md). With SDPA's fused kernels no s x s scores are kept:
    the kernel saves q, k, v, its output and the fp32 log-sum-exp (4 bytes per token and head), so Korthikanti et al.'s
    34sbh is 32sbh for GPT (no dropout masks: dropout 0), plus the norms' statistics.
      none: two norms (_norm_bytes_per_token), activation_coefficients' elements at act_bytes (whole + split / t),
        the q/k norm's (_qk_norm_bytes_per_token / t), the log-sum-exp (heads / t), rotary's cos and sin tables
        (4 x s x head_dim, not per sequence), one-byte dropout masks (attention and MLP outputs) when dropout > 0,
        and for a `windowed` block (sliding window shorter than the sequence; None: as the model's last block) on
        the masked kernel (throughput.window_kernel: 'cpu', or dropout > 0) the attention's (s, s) mask
        (window_mask_bytes, not per sequence); flex_attention (the 'cuda' kernel) saves what the causal kernel does.
      selective (the attention core recomputed, as dspipe wires it): DeepSpeed's checkpoint keeps q, k and v, the
        out-projection still saves the core's output: only the log-sum-exp (and a window's mask, built inside the
        core) is not kept, so it saves what 'none' does (less 4 bytes per token and head) and costs a recomputation.
      full: the block input (act_bytes x h per token), whole on every tp rank; see recompute_working_bytes.
    Ulysses: s is the rank's s/sp tokens. `kernels`: 'cuda' (flash / memory-efficient SDPA, fused norms with fp32
    statistics; the GPU runner) or 'cpu' (PyTorch's CPU kernels: the gloo runner; the CPU SDPA also saves the
    log-sum-exp). `sparse`: a mixture-of-experts block, whose MLP saves moe_mlp_activation_bytes instead of the
    dense MLP's hidden activations (none / selective; full keeps the block input as a dense block). `tp_sp`: Megatron
    sequence parallelism, where what stays whole on every tp rank without it (the norms' tensors, the inputs of the
    column-parallel projections, the block input, the dropout masks) holds the rank's s/tp tokens (Korthikanti et al.
    eq. 4: every term / t)."""
    s, b, h = share(model.seq_len, sp), micro_batch, model.hidden
    tokens = s * b
    cut = tp if tp_sp else 1  # what divides the regions outside the tensor-parallel ones
    if checkpointing == Checkpointing.FULL:
        return tokens * h * act_bytes // cut
    whole, split = activation_coefficients(model)
    per_token = (
        2 * _norm_bytes_per_token(model, act_bytes=act_bytes, kernels=kernels) / cut
        + act_bytes * h * (whole / cut + split / tp)
        + _qk_norm_bytes_per_token(model, act_bytes=act_bytes, kernels=kernels) / tp
    )
    mask = 0
    if checkpointing == Checkpointing.NONE:
        per_token += 4 * share(model.heads, tp)  # the kernel's fp32 log-sum-exp
        if windowed is None:
            windowed = windowed_blocks(model, range(model.layers - 1, model.layers)) > 0
        masked = windowed and window_kernel(model, kernels=kernels) == "mask"
        mask = window_mask_bytes(model, act_bytes=act_bytes) if masked else 0
    if model.dropout > 0:
        per_token += 2 * h / cut
    rotary = 4 * s * model.head_dim * act_bytes if model.positions == "rope" else 0
    moe: float = 0
    if sparse and model.experts:  # the dense MLP's hidden activations replaced by the MoE layer's
        dense_mlp = act_bytes * (4 if model.mlp == "swiglu" else 2) * model.ffn / tp
        # under tp (sequence parallelism, the rules' condition) each tp rank routes its s / tp of the tokens
        routed = share(tokens, cut)
        moe = moe_mlp_activation_bytes(model=model, tokens=routed, act_bytes=act_bytes)
        moe -= tokens * dense_mlp
    return int(tokens * per_token + rotary + mask + moe)


def routed_rows(*, model: ModelSpec, tokens: int) -> int:
    """Rows the experts compute for `tokens` tokens on a rank (dspipe.runtime.dispatch): every route, k x tokens;
    with a capacity factor at most capacity_slots per expert, so at most E x C."""
    routes = model.experts_per_token * tokens
    slots = capacity_slots(
        tokens=tokens, experts=model.experts, k=model.experts_per_token, factor=model.capacity_factor
    )
    return routes if slots is None else min(routes, model.experts * slots)


def moe_mlp_activation_bytes(*, model: ModelSpec, tokens: int, act_bytes: int) -> int:
    """Bytes one sparse block's MoE layer saves for backward for `tokens` tokens on a rank, beyond the block's norm
    output (a dense block's MLP input, counted in activation_coefficients). Every layout's experts run through
    dspipe.runtime.dispatch (DeepSpeed's layer at ZeRO 0-2, the model's own SparseMLP under ZeRO-3 and tp; the
    plain SparseMLP's loop keeps the same): no dispatch masks, R = routed_rows rows in all however the router
    balances them, and per row its input, the expert's hidden activations, its output and its weighted output
    (index_add_ keeps it), its index and weight (8 + b); the router's top-k indices and weights (12 T k), and in
    16-bit training the router weight's fp32 copy (4 E h), while nothing keeps the block's 16-bit norm output (the
    router keeps its fp32 copy, index_select only its indices): - b T h. With T tokens, E experts, k routes per
    token, h hidden, f expert_width, c = 4 for SwiGLU (fused gate/up output, SiLU output, product) or 2 for GELU,
    b = act_bytes:
      router      8 T E: the fp32 logits and softmax probabilities (tokens x E), plus 4 T h for the fp32 copy of
                  its input in 16-bit training
      experts     R (b (3 h + c f) + 8 + b) + 12 T k
      shared      b T c (shared_experts x f): the always-on shared expert's hidden activations
    Census (benchmarks/census/activations.py, tiny-moe, the plain loop and DeepSpeed's layer with the dispatch, bf16
    and fp32, no/selective/full recomputation): within 0.2%. At ep > 1 the all-to-all-v's gradient buffers in the
    backward (2 b R h, transient) are moe_exchange_bytes."""
    e, h, f = model.experts, model.hidden, model.expert_width
    c = 4 if model.mlp == "swiglu" else 2
    router = 8 * tokens * e + (4 * tokens * h if act_bytes != 4 else 0)
    shared = act_bytes * tokens * c * model.shared_experts * f
    rows = routed_rows(model=model, tokens=tokens)
    copy = 4 * e * h - act_bytes * tokens * h if act_bytes != 4 else 0
    experts = rows * (act_bytes * (3 * h + c * f) + 8 + act_bytes) + 12 * model.experts_per_token * tokens + copy
    return router + experts + shared


def recompute_working_bytes(
    *,
    model: ModelSpec,
    micro_batch: int,
    act_bytes: int,
    tp: int = 1,
    sp: int = 1,
    kernels: str = "cuda",
    windowed: bool | None = None,
    sparse: bool = False,
    tp_sp: bool = False,
) -> int:
    """Full recomputation: what one block's recomputed forward saves during its backward, beyond the block input
    the checkpoint already holds. Only one block is rebuilt at a time (`windowed`: one with a window's mask;
    `sparse`: a mixture-of-experts block)."""
    none = activation_bytes_per_layer(
        model=model,
        micro_batch=micro_batch,
        checkpointing="none",
        act_bytes=act_bytes,
        tp=tp,
        sp=sp,
        kernels=kernels,
        windowed=windowed,
        sparse=sparse,
        tp_sp=tp_sp,
    )
    return none - activation_bytes_per_layer(
        model=model,
        micro_batch=micro_batch,
        checkpointing="full",
        act_bytes=act_bytes,
        tp=tp,
        sp=sp,
        kernels=kernels,
        tp_sp=tp_sp,
    )


def logits_bytes(
    *,
    model: ModelSpec,
    micro_batch: int,
    sp: int = 1,
    act_bytes: int = 2,
    kernels: str = "cuda",
    tp: int = 1,
    tp_sp: bool = False,
    loss_chunk: int = 0,
) -> int:
    """What the last stage's final norm, head and loss save: log_softmax's fp32 output (4 bytes x V per token: the
    loss upcasts the logits, which themselves are not kept; at tp > 1 the vocab-parallel cross-entropy's fp32 softmax
    of the rank's ceil(V / tp) columns, the full logits never gathered; with `loss_chunk` (dspipe.model.loss, tp 1)
    only the fp32 log-sum-exp, 4 bytes per token, the chunk's logits being loss_chunk_working_bytes), the final norm's
    input and statistics, the head's input (whole on every tp rank; the norm's and the head's inputs / tp under
    Megatron sequence parallelism, whose head gathers its input again in backward) and the int64 labels; s is s/sp
    under Ulysses."""
    cut = tp if tp_sp else 1
    per_token = (
        (4 if loss_chunk else 4 * vocab_rows(model.vocab, tp)[0])
        + (_norm_bytes_per_token(model, act_bytes=act_bytes, kernels=kernels) + act_bytes * model.hidden) / cut
        + 8
    )
    return int(share(model.seq_len, sp) * micro_batch * per_token)


def loss_chunk_working_bytes(
    *, model: ModelSpec, micro_batch: int, loss_chunk: int, sp: int = 1, act_bytes: int = 2
) -> int:
    """What the chunked cross-entropy (dspipe.model.loss, loss_chunk > 0) adds while its backward runs: one chunk's
    logits (min(loss_chunk, the rank's s/sp x b tokens) x V) in fp32, plus in 16-bit training the chunk's logits
    in the activation dtype while they are upcast (the same size again at act_bytes: the gradient cast back); 0
    without chunks. liger-kernel's fused loss on CUDA picks its own chunk (a power of two, at most loss_chunk where
    its rule allows) and computes the head's weight and input gradients in the forward, holding them until the
    backward instead of creating them there (not counted apart: the model's gradients are)."""
    if not loss_chunk:
        return 0
    rows = min(loss_chunk, share(model.seq_len, sp) * micro_batch)
    return rows * model.vocab * (4 + (act_bytes if act_bytes != 4 else 0))


def embedding_bytes(*, model: ModelSpec, micro_batch: int, sp: int = 1) -> int:
    """What the first stage's embedding saves: the int64 token ids (and learned positions' ids, per position)."""
    s = share(model.seq_len, sp)
    return 8 * s * micro_batch + (8 * s if model.positions == "learned" else 0)


def _sparse_blocks_bytes(
    *,
    model: ModelSpec,
    micro_batch: int,
    checkpointing: str,
    act_bytes: int,
    tp: int,
    sp: int,
    kernels: str,
    sparse: int,
) -> int:
    """What `sparse` mixture-of-experts blocks save beyond as many dense blocks (0 without any)."""
    if not sparse:
        return 0

    def block(*, is_sparse: bool) -> int:
        return activation_bytes_per_layer(
            model=model,
            micro_batch=micro_batch,
            checkpointing=checkpointing,
            act_bytes=act_bytes,
            tp=tp,
            sp=sp,
            kernels=kernels,
            windowed=False,
            sparse=is_sparse,
        )

    return sparse * (block(is_sparse=True) - block(is_sparse=False))


def _stage_blocks_bytes(
    *,
    model: ModelSpec,
    micro_batch: int,
    checkpointing: str,
    act_bytes: int,
    blocks: int,
    windowed: int,
    sparse: int,
    tp: int,
    sp: int,
    kernels: str,
    tp_sp: bool,
    recomputed: int | None = None,
) -> tuple[int, int, int]:
    """(saved, working, kept): what a stage's blocks save, one recomputed block under full checkpointing
    (micro_batch_activations' terms), and of `saved` what the blocks that are not recomputed save. `recomputed`:
    under full checkpointing, how many of the blocks are recomputed (None: all), the first ones; the others save
    what they do without recomputation, and are taken to hold the stage's windowed and sparse blocks first (the
    larger savers: an upper bound where those sit among the recomputed ones)."""
    if checkpointing == Checkpointing.FULL and recomputed is not None and recomputed < blocks:
        kept = blocks - recomputed

        def part(mode: str, count: int, *, windows: int, sparse_blocks: int) -> tuple[int, int, int]:
            return _stage_blocks_bytes(
                model=model,
                micro_batch=micro_batch,
                checkpointing=mode,
                act_bytes=act_bytes,
                blocks=count,
                windowed=windows,
                sparse=sparse_blocks,
                tp=tp,
                sp=sp,
                kernels=kernels,
                tp_sp=tp_sp,
            )

        kept_saved = part(Checkpointing.NONE, kept, windows=min(windowed, kept), sparse_blocks=min(sparse, kept))[0]
        saved, working, _ = part(
            Checkpointing.FULL, recomputed, windows=max(0, windowed - kept), sparse_blocks=max(0, sparse - kept)
        )
        return kept_saved + saved, working, kept_saved

    def per_layer(masked: bool) -> int:
        return activation_bytes_per_layer(
            model=model,
            micro_batch=micro_batch,
            checkpointing=checkpointing,
            act_bytes=act_bytes,
            tp=tp,
            sp=sp,
            kernels=kernels,
            windowed=masked,
            tp_sp=tp_sp,
        )

    saved = (blocks - windowed) * per_layer(False) + windowed * per_layer(True)
    moe_saved = _sparse_blocks_bytes(
        model=model,
        micro_batch=micro_batch,
        checkpointing=checkpointing,
        act_bytes=act_bytes,
        tp=tp,
        sp=sp,
        kernels=kernels,
        sparse=sparse,
    )
    if checkpointing != Checkpointing.FULL or not blocks:
        return saved + moe_saved, 0, 0
    working = recompute_working_bytes(
        model=model,
        micro_batch=micro_batch,
        act_bytes=act_bytes,
        tp=tp,
        sp=sp,
        kernels=kernels,
        windowed=windowed > 0,
        sparse=sparse > 0,
        tp_sp=tp_sp,
    )
    return saved + moe_saved, working, 0


def _last_stage_bytes(
    *,
    model: ModelSpec,
    micro_batch: int,
    act_bytes: int,
    tp: int,
    sp: int,
    kernels: str,
    tp_sp: bool,
    loss_chunk: int,
    last: bool,
) -> tuple[int, int]:
    """(head, chunk): what the last stage's head and loss save and a chunked loss's one chunk of logits ((0, 0) on
    any other stage)."""
    if not last:
        return 0, 0
    head = logits_bytes(
        model=model,
        micro_batch=micro_batch,
        sp=sp,
        act_bytes=act_bytes,
        kernels=kernels,
        tp=tp,
        tp_sp=tp_sp,
        loss_chunk=loss_chunk,
    )
    chunk = loss_chunk_working_bytes(
        model=model, micro_batch=micro_batch, loss_chunk=loss_chunk, sp=sp, act_bytes=act_bytes
    )
    return head, chunk


def micro_batch_activations(
    *,
    model: ModelSpec,
    micro_batch: int,
    checkpointing: str,
    act_bytes: int,
    blocks: int,
    first: bool,
    last: bool,
    tp: int = 1,
    sp: int = 1,
    kernels: str = "cuda",
    windowed: int | None = None,
    sparse: int = 0,
    ep: int = 1,
    tp_sp: bool = False,
    loss_chunk: int = 0,
    recompute_blocks: int = 0,
) -> tuple[int, int]:
    """(held, working): activation bytes one micro-batch keeps on a stage of `blocks` blocks from its forward to its
    backward, and what its backward adds at the moment of its peak. none / selective: every block's saved tensors,
    the embedding's ids on the first stage, the head and loss on the last; added, a chunked loss's one chunk of
    logits (loss_chunk_working_bytes, in the loss's backward, before any block's). full: the block inputs (and
    ids) held; at the peak either the head and loss (alive at the end of the forward, freed by the head's backward;
    with a chunked loss's chunk) or one recomputed block (rebuilt after the head's tensors are gone), whichever is
    larger: they never coincide. `recompute_blocks` (full only; 0: every block): only the first that many blocks
    are recomputed and the others save what they save without recomputation; those are backpropagated first, so
    their tensors are gone when a recomputed block is rebuilt.
    `windowed`: how many of the blocks have a sliding window shorter than the sequence (None: the last `blocks`
    blocks of the model, the most a stage can hold, as windowed_blocks counts them). `sparse`: how many of the
    blocks are mixture-of-experts blocks (their MoE layers' saved tensors; at `ep` > 1 one block's backward adds
    its all-to-all-v's two gradient buffers, moe_exchange_bytes)."""
    if windowed is None:
        windowed = windowed_blocks(model, range(model.layers - blocks, model.layers))
    saved, working, kept = _stage_blocks_bytes(
        model=model,
        micro_batch=micro_batch,
        checkpointing=checkpointing,
        act_bytes=act_bytes,
        blocks=blocks,
        windowed=windowed,
        sparse=sparse,
        tp=tp,
        sp=sp,
        kernels=kernels,
        tp_sp=tp_sp,
        recomputed=min(recompute_blocks, blocks) if recompute_blocks else None,
    )
    ids = embedding_bytes(model=model, micro_batch=micro_batch, sp=sp) if first else 0
    head, chunk = _last_stage_bytes(
        model=model,
        micro_batch=micro_batch,
        act_bytes=act_bytes,
        tp=tp,
        sp=sp,
        kernels=kernels,
        tp_sp=tp_sp,
        loss_chunk=loss_chunk,
        last=last,
    )
    exchange = moe_exchange_bytes(model=model, micro_batch=micro_batch, act_bytes=act_bytes, ep=ep) if sparse else 0
    if checkpointing != Checkpointing.FULL:
        return saved + ids + head, max(exchange, chunk)
    return saved + ids, max(head + chunk, working + exchange - kept)


def moe_exchange_bytes(*, model: ModelSpec, micro_batch: int, act_bytes: int, ep: int) -> int:
    """What a sparse block's backward adds at ep > 1 (dspipe.runtime.dispatch): the gradients of the rows its
    all-to-all-v received and of the rows it sent, b x routed_rows x h each, alive together while the gradient goes
    back; 0 at ep 1 (no exchange: the census's case) and for a dense model."""
    if ep == 1 or not model.experts:
        return 0
    rows = routed_rows(model=model, tokens=model.seq_len * micro_batch)
    return 2 * act_bytes * rows * model.hidden


@lru_cache(maxsize=1024)
def persistent_params(*, model: ModelSpec, threshold: int) -> int:
    """Parameters ZeRO-3 keeps whole on every rank: tensors smaller than stage3_param_persistence_threshold."""
    sizes = (math.prod(shape) for _, shape in model.model_tensors())
    return sum(n for n in sizes if n < threshold)


def zero3_gathered_bound(*, model: ModelSpec, plan: Plan) -> int:
    """Elements ZeRO-3 can hold gathered at most under the plan's knobs: the coordinator prefetches only while fewer
    than stage3_max_live_parameters are gathered (parameters kept for reuse count too) and its last prefetched
    tensor can overshoot that by one tensor."""
    return plan.max_live_parameters + largest_tensor(model)


def module_sizes(tensors: list[tuple[str, tuple[int, ...]]]) -> list[int]:
    """Elements of each parameterised module among `tensors`, in their order (ZeRO-3 gathers, releases and reduces a
    module's parameters together)."""
    modules: dict[str, int] = {}
    for name, shape in tensors:
        owner = name.rsplit(".", 1)[0]
        modules[owner] = modules.get(owner, 0) + math.prod(shape)
    return list(modules.values())


@lru_cache(maxsize=256)
def block_modules(model: ModelSpec, *, ep: int = 1) -> tuple[int, ...]:
    """Elements of every parameterised module of the blocks a rank holds, in forward order (a sparse block's experts
    each; at ep > 1 its E / ep, dspipe.runtime.moe.spread_experts)."""
    held = model.experts // ep if model.experts else 0

    def kept(name: str) -> bool:
        m = _EXPERT.match(name)
        return m is None or int(m[1]) < held

    return tuple(
        size for i in range(model.layers) for size in module_sizes([t for t in model.block_tensors(i) if kept(t[0])])
    )


_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.")


@lru_cache(maxsize=256)
def _forward_modules(model: ModelSpec, ep: int = 1) -> tuple[int, ...]:
    """Elements of every parameterised module in forward order, the head (a tied one reuses the embedding) last."""
    tensors = model.model_tensors()
    return (
        *module_sizes([t for t in tensors if t[0].startswith("embed.")]),
        *block_modules(model, ep=ep),
        *module_sizes([t for t in tensors if t[0].startswith("final.")]),
        model.vocab * model.hidden,
    )


def zero3_kept_for_reuse(*, model: ModelSpec, plan: Plan) -> int:
    """Elements ZeRO-3 keeps gathered from their forward to their backward: after a module runs, its parameters stay
    gathered when the trace reuses them within stage3_max_reuse_distance elements; between a module's forward and
    its backward the trace fetches every later module twice, so the kept ones are the model's tail (the head at the
    forward/backward turn at least; DeepSpeed's 1e9 default keeps the whole model, measured)."""
    kept, after = 0, 0
    for size in reversed(_forward_modules(model, plan.ep)):
        if 2 * after > plan.max_reuse_distance:
            break
        kept, after = kept + size, after + size
    return min(kept, model.num_params)  # a tied head is the embedding: counted once


@lru_cache(maxsize=256)
def _backward_order(model: ModelSpec, *, ep: int) -> tuple[int, int, int]:
    """Of the blocks' modules in backward order (block_modules reversed): the largest two adjacent ones together,
    the largest, and the first (the last block's last module)."""
    order = list(reversed(block_modules(model, ep=ep)))
    pair = max(a + b for a, b in zip(order, order[1:] + order[:1], strict=True))
    return pair, max(order), order[0]


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
    pair, largest, first = _backward_order(model, ep=plan.ep)
    head = model.vocab * model.hidden
    kept = zero3_kept_for_reuse(model=model, plan=plan)
    live = min(plan.max_live_parameters, plan.prefetch_bucket_size + largest_tensor(model))
    tied = head if model.tied_embeddings else 0
    # what stayed gathered since the forward, less the head (and final norm) released after their backward; a tied
    # head is the embedding, needed again at the end
    blocks = max(live + pair, kept - (head - tied) + largest) + tied
    at_head = max(kept, head + plan.prefetch_bucket_size + first) + head
    return max(blocks, at_head)


def expert_grads_kept(*, model: ModelSpec, reduce_bucket_size: int) -> tuple[int, int]:
    """(elements, of) one routed expert's parameters whose 16-bit gradients ZeRO-2 keeps in bf16 with fp32 gradient
    accumulation (DeepSpeed 0.19.8's compact gradient partition): a tensor of at most reduce_bucket_size elements is
    copied into the reduce (ipg) bucket, reduced into the fp32 partition and its gradient left a view of the bucket;
    only a larger one is reduced on its own and keeps its gradient until the end of the backward (census of the moe-*
    rows: none of the 0.5M-1M-element experts' gradients is live at the peak)."""
    sizes = [math.prod(shape) for _, shape in model.expert_tensors()]
    return sum(n for n in sizes if n > reduce_bucket_size), sum(sizes)


def _model_states(*, model: ModelSpec, plan: Plan, phi: int) -> tuple[dict[str, int], dict[str, int]]:
    """(steady, transient) device bytes per rank for params/grads/optimizer/buffers on a stage of phi parameters
    per rank; the host's are _host_states'. What is partitioned (Phi/N below) is summed over stages.param_groups:
    under MoE the dense parameters over N = dp x sp and the rank's experts over the dp / ep expert-data-parallel
    ranks (12 Phi_d / dp + 12 Phi_e / (dp / ep) of optimizer state, Phi_e = routed experts / ep)."""
    z, b = plan.zero_stage, dtype_bytes(plan.precision)
    groups = param_groups(model=model, plan=plan, phi=phi)

    def part(k: int) -> int:  # k bytes per parameter, each kind partitioned over its ZeRO group
        return sum(k * p // g for p, g in groups)

    mixed = b == 2
    master = 4 * phi if mixed else 0
    adam = 8 * phi
    bucket = plan.reduce_bucket_size * b
    offload = plan.offload != Offload.NONE
    largest = b * largest_tensor_per_rank(model, plan.tp)
    if plan.bf16_optimizer:
        accumulated = dtype_bytes(plan.grad_accum_dtype)
        steady = dict(params=2 * phi, grads=accumulated * phi, optimizer=part(12), buffers=0)
        # the 16-bit gradients: all alive from the end of the backward to the step, or with immediate_grad_update
        # only the one being produced, freed once its hook has added it into the accumulation buffer; under bf16
        # accumulation (ZeRO-0 in a pipeline) the step casts the rank's partition of it to fp32 for Adam (census:
        # pp2-zero1, pp2-zero0, pp2-zero0-keep)
        kept = 0 if plan.immediate_grad_update else 2 * phi
        cast = 0 if accumulated == 4 else part(4)
        transient = dict(grads=max(largest if plan.immediate_grad_update else 0, kept + cast), buffers=0)
    elif z == 0:
        steady = dict(params=b * phi, grads=0, optimizer=master + adam, buffers=0)
        # the peak is the optimizer step's fp32 gradients (4Phi); mixed precision frees the 16-bit ones first (census);
        # in fp32 with gradient accumulation each new gradient is a tensor of its own until it is added into .grad
        # (up to the largest; census: zero0-fp32-ga2)
        fresh = largest if not mixed and plan.grad_accum > 1 else 0
        transient = dict(grads=4 * phi + fresh, buffers=0)
    elif z in (1, 2) and offload:
        # Device: the 16-bit params, a gradient staging buffer of the largest tensor (temp_grad_buffer_for_gpu_offload);
        # from the last backward to the step the rank's fp32 gradient partition (averaged_gradients, 4Phi/N) and,
        # while a gradient is produced, that gradient (up to the largest tensor; ZeRO-1 keeps every 16-bit gradient
        # until the boundary's reduction, b.Phi) and the reduce bucket.
        # In fp32 the partition is the gradients themselves; a copy of the largest gradient is made on the way out.
        # With gradient accumulation ZeRO-2 keeps the gradients of the rank's partition from one micro-batch to the
        # next (b.Phi/N; census: zero2-offload-ga2 and zero2-offload-fp32-ga2, 15.6% and 22.1% over the plan without).
        steady = dict(params=b * phi, grads=0, optimizer=0, buffers=largest)
        kept = part(b) if z == 2 and plan.grad_accum > 1 else 0
        transient = dict(
            grads=(b * phi if z == 1 else largest) + bucket + kept,
            buffers=(part(4) if mixed else 0) + largest + bucket,
        )
    elif z in (1, 2):
        steady = dict(params=b * phi, grads=0, optimizer=part(12), buffers=0)
        live_grads = b * phi if z == 1 else part(b) + 2 * bucket
        if z == 1 and not mixed and plan.grad_accum > 1:  # as ZeRO-0's: the new gradient before it is added
            live_grads += largest
        if z == 2 and mixed and plan.grad_accum_dtype == "fp32" and model.experts:
            # the rank's expert gradients that the reduce buckets carry are reduced straight into the fp32 partition
            # and never kept in 16 bits: only the expert tensors larger than the bucket keep theirs (census)
            (_, _), (experts, g) = groups
            kept, whole = expert_grads_kept(model=model, reduce_bucket_size=plan.reduce_bucket_size)
            live_grads += b * experts * kept // (whole * g) - b * experts // g
        # mixed precision: the fp32 gradient partition built for the step (4Phi/N); ZeRO-2 also copies the largest
        # gradient on its way into the partition (census: an unnamed buffer of that size)
        fp32_partition = part(4) if mixed else 0
        transient = dict(
            grads=live_grads + fp32_partition,
            buffers=(int(4.5 * bucket) if plan.overlap_comm else 0) + (largest if z == 2 else 0),
        )
        if z == 2 and not mixed:
            transient = _fp32_zero2_transient(plan=plan, groups=groups, backward=transient, largest=largest)
    else:
        steady, transient = _zero3_states(model=model, plan=plan, phi=phi)
    return steady, transient


def _fp32_zero2_transient(
    *, plan: Plan, groups: list[tuple[int, int]], backward: dict[str, int], largest: int
) -> dict[str, int]:
    """fp32 ZeRO-2 without offload, DeepSpeed 0.19.8 (stage_1_and_2.copy_grads_in_partition and step): the reduced
    gradients of the rank's partitions are copied into one contiguous buffer (grads_in_partition: every group's
    parameters in the partition, a tensor straddling a partition's end counted whole: up to `largest` per end),
    alive until the last group that holds views of it has stepped. The step flattens each group's partition into a
    new tensor (in mixed precision that copy is the fp32 one counted already; in fp32 it is a second fp32 copy): the
    dense weights' group, stepped first while the buffer is whole, adds 4 bytes x its partition. With gradient
    accumulation that buffer holds the earlier micro-batches' gradients through the next backward. Census:
    zero2-fp32 (planned 6.6% under before), zero2-fp32-ga2 (12.0% under); moe-zero2-ep2-fp32 keeps its backward
    peak (its experts' group steps after the buffer is gone)."""
    ends = 0 if plan.dp * plan.sp == 1 else largest * (1 if plan.dp * plan.sp == 2 else 2)
    buffer = sum(4 * p // g for p, g in groups) + ends
    dense_p, dense_g = groups[0]
    step = buffer + 4 * dense_p // dense_g
    held = buffer if plan.grad_accum > 1 else 0
    if step >= sum(backward.values()) + held:
        return dict(grads=step - buffer, buffers=buffer)
    return dict(grads=backward["grads"], buffers=backward["buffers"] + held)


def _zero3_states(*, model: ModelSpec, plan: Plan, phi: int) -> tuple[dict[str, int], dict[str, int]]:
    """_model_states' (steady, transient) device bytes per rank under ZeRO-3 (at ep > 1 the rank's experts
    partitioned over their expert-data-parallel group: stages.param_groups)."""
    n, b = zero_group_size(plan), dtype_bytes(plan.precision)
    groups = param_groups(model=model, plan=plan, phi=phi)

    def part(k: int) -> int:  # k bytes per parameter, each kind partitioned over its ZeRO group
        return sum(k * p // g for p, g in groups)

    bucket = plan.reduce_bucket_size * b
    offload = plan.offload != Offload.NONE
    persistent = persistent_params(model=model, threshold=plan.param_persistence_threshold)
    # the partitions (moved to the host with offload_params) and the persistent tensors, whole on every rank
    params = b * persistent if plan.offload_params else part(b) + b * persistent * (n - 1) // n
    steady = dict(
        params=params,
        grads=0 if offload else part(4),
        optimizer=0 if offload else part(12),
        buffers=bucket,
    )  # the contiguous-gradients reduce bucket stays allocated
    backward = dict(grads=0, buffers=b * zero3_backward_working(model=model, plan=plan))
    # the fp32 gradients handed to the optimizer: DeepSpeed's step makes them one sub-group at a time, and at ep > 1
    # the rank's experts are a sub-group of their own (partitioned over another group): the larger one (census)
    fp32_grads = max(4 * p // g for p, g in groups) if plan.ep > 1 and model.experts else part(4)
    step = dict(grads=0 if offload else fp32_grads, buffers=0)
    transient = max(backward, step, key=lambda t: sum(t.values()))
    return steady, transient


def _host_states(*, model: ModelSpec, plan: Plan, phi: int) -> tuple[int, int]:
    """(between steps, peak) host bytes one rank's offload holds, as DeepSpeed 0.19.8 allocates them (measured:
    benchmarks/census/tensors.py's host rule). ZeRO-1/2 + cpu: fp32 master, fp32 gradient partition and Adam m, v
    (16Phi/N), a 16-bit copy of the partition (b.Phi/N), a host gradient staging buffer of the largest tensor, and
    with gradient accumulation a b.Phi/N accumulation buffer (not in bf16 with fp32 accumulation: a compact fp32
    partition on the device). ZeRO-3 + cpu: fp32 master and Adam (12Phi/N), two fp32
    gradient partitions (grad_partitions_flat_buffer and the master's .grad, 8Phi/N), with offload_params the 16-bit
    partitions (b.Phi/N). NVMe (not measured: no NVMe here): swap buffers of 2 fp32 and 4 training-dtype reduce
    buckets and, with offload_params, the partitions."""
    z, b = plan.zero_stage, dtype_bytes(plan.precision)
    if plan.offload == Offload.NONE:
        return 0, 0
    groups = param_groups(model=model, plan=plan, phi=phi)

    def part(k: int) -> int:  # as _model_states: each kind of parameter over its ZeRO group
        return sum(k * p // g for p, g in groups)

    params = part(b) if plan.offload_params else 0
    if plan.offload == Offload.NVME:
        host = 2 * plan.reduce_bucket_size * 4 + 4 * plan.reduce_bucket_size * b + params
        return host, host
    if z in (1, 2):
        host = part(16) + part(b) + b * largest_tensor_per_rank(model, plan.tp)
        # gradient accumulation: b.Phi/N of host buffers (accumulated_grads_in_cpu), except in bf16 with fp32
        # accumulation, which accumulates into a compact fp32 partition on the device (census: *-offload-ga2)
        compact = b != 4 and plan.grad_accum_dtype == "fp32"
        host += part(b) if plan.grad_accum > 1 and not compact else 0
    else:
        host = part(20) + params
    return host, host


def stage_memory(*, model: ModelSpec, cluster: ClusterSpec, plan: Plan) -> tuple[Memory, int]:
    """(memory, parameters per rank) of the pipeline stage with the largest peak. Stage 0 holds the embedding and
    pp micro-batches in flight; the last holds the logits."""
    gpu = cluster.gpu_type
    pp, m, tp, sp = plan.pp, plan.grad_accum, plan.tp, plan.sp
    b = dtype_bytes(plan.precision)
    stages = stage_params(model=model, pp=pp, partition_method=plan.partition_method, tp=tp, ep=plan.ep)
    blocks = stage_blocks(model=model, pp=pp, partition_method=plan.partition_method, tp=tp)
    first_block = [sum(blocks[:i]) for i in range(pp)]
    kernels = "cuda" if gpu.backend == "nccl" else "cpu"
    reserve = FRAMEWORK_RESERVE if gpu.backend == "nccl" else 0
    worst = None
    # stages alike in what decides their bytes are counted once (most of a deep pipeline's middle stages)
    states: dict[int, tuple[tuple[dict[str, int], dict[str, int]], tuple[int, int]]] = {}
    activations: dict[tuple[int, bool, bool, int, int], tuple[int, int]] = {}
    for i, phi in enumerate(stages):
        if phi not in states:
            states[phi] = _model_states(model=model, plan=plan, phi=phi), _host_states(model=model, plan=plan, phi=phi)
        (steady, transient), (host_steady, host_peak) = states[phi]
        layers = range(first_block[i], first_block[i] + blocks[i])
        sparse = bisect.bisect_left(model.sparse_layers, layers.stop) - bisect.bisect_left(
            model.sparse_layers, layers.start
        )
        key = (blocks[i], i == 0, i == pp - 1, windowed_blocks(model, layers), sparse)
        if key not in activations:
            activations[key] = micro_batch_activations(
                model=model,
                micro_batch=plan.micro_batch,
                checkpointing=plan.checkpointing,
                act_bytes=b,
                blocks=blocks[i],
                first=i == 0,
                last=i == pp - 1,
                tp=tp,
                sp=sp,
                kernels=kernels,
                windowed=key[3],
                sparse=sparse,
                ep=plan.ep,
                tp_sp=plan.tp_sp,
                loss_chunk=plan.loss_chunk,
                recompute_blocks=plan.recompute_blocks,
            )
        held, working = activations[key]
        acts = min(pp - i, m) * held + working  # 1F1B: stage i has up to pp - i micro-batches in flight
        mem = Memory(
            params=steady["params"],
            grads=steady["grads"] + transient["grads"],
            optimizer=steady["optimizer"],
            activations=acts,
            buffers=steady["buffers"] + transient["buffers"] + reserve,
            model_states=sum(steady.values()),
            host_model_states=host_steady,
            host_peak=host_peak,
        )
        if worst is None or mem.total > worst.total:
            worst, worst_phi = mem, phi
    assert worst is not None  # pp >= 1 stages: the loop ran
    return worst, worst_phi


def host_offload_per_rank(*, model: ModelSpec, plan: Plan) -> int:
    """Host bytes at the peak of one rank's offload on the stage with the most (every GPU of a node offloads its
    rank's share)."""
    stages = stage_params(model=model, pp=plan.pp, partition_method=plan.partition_method, tp=plan.tp, ep=plan.ep)
    return max(_host_states(model=model, plan=plan, phi=phi)[1] for phi in stages)
