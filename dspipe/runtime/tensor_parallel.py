"""dspipe's tensor-parallel layers, in Megatron-LM's layout (Shoeybi et al. 2019), and the collectives between them.

    ColumnParallelLinear    output features split: each rank holds whole heads of the fused q/k/v projection (q, k
                            and v each split by tp, biases with their rows) or its share of a fused [gate; up]
                            projection (`column_linear`: the input is used whole, and in backward its gradient
                            is all-reduced over the tp group while the weight's gradient is computed, Megatron's
                            overlap of the collective with the GEMM).
    RowParallelLinear       input features split (the attention and MLP output projections): the partial products
                            are all-reduced (`leave_region`), the bias, replicated, added once after.
    VocabParallelEmbedding  vocabulary rows split (ceil(V / tp) per rank, the last rank the rest): each rank looks up
                            the ids it holds, zeros for the others, and the rows are summed over the group. The same
                            shard is the tied head; an untied head is split the same way.
    vocab_parallel_cross_entropy  the mean next-token loss from each rank's vocabulary slice of the logits (the
                            full logits are never gathered): max, sum of exponentials and the target's logit are
                            all-reduced; the gradient is softmax - one-hot on each rank's own slice.
    ReducedRMSNorm          a norm whose weight is shared by all heads but applied by each rank to its own heads
                            (Qwen3's q/k norm): its weight enters through `copy_to_region`, so its gradient is summed
                            over the group and the replicas never drift.

Megatron's sequence parallelism (TensorGroup.sequence_parallel): outside the tensor-parallel regions each rank holds
its slice of the sequence; `column_linear` all-gathers it (keeping only the slice for backward, where it gathers
again while the input's gradient is computed, and reduce-scatters that gradient while the weight's is computed),
`leave_region` reduce-scatters instead of all-reducing, and every replicated parameter applied to a slice (norms,
learned positions, row-parallel biases) has its gradient summed over the group (ReducedLayerNorm, ReducedRMSNorm,
SlicedPositions, copy_to_region).

Every sharded parameter carries `tensor_model_parallel = True` (DeepSpeed counts it in the gradient norm on every
tp rank, a replicated one on tp rank 0 only), `partition_dim` and `tp_shard`: the function that cuts this rank's
shard out of the whole tensor, which the builders use to give the shard its step-0 value (the draw, or an
imported tensor, is whole; the rank keeps its slice). Layers keep the whole sizes as `in_features`,
`out_features`, `num_embeddings`, so the model's step-0 declarations (dspipe.model.gpt.initial_values) are
unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dspipe.model.gpt import routes_per_expert
from dspipe.model.tp_split import part_rows, vocab_rows
from dspipe.runtime.dispatch import DispatchedSparseMLP


@dataclass
class TensorGroup:
    """This rank's place in its tensor-parallel group; `group` is set once the process groups exist (a module
    may be built, on the meta device, before). `sequence_parallel`: Megatron's sequence parallelism, the
    activations outside the tensor-parallel regions split along the sequence over the group."""

    rank: int
    size: int
    sequence_parallel: bool = False
    group: object = field(default=None, repr=False)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.tp.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=tp.group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# torch 2.13 renamed the single-tensor collectives (the old names warn); older torch has only the old ones
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_sequence(x: torch.Tensor, tp: TensorGroup) -> torch.Tensor:
    """(b, s / tp, ...) on each rank -> (b, s, ...), the ranks' slices in rank order."""
    local = x.movedim(1, 0).contiguous()
    out = local.new_empty((local.shape[0] * tp.size, *local.shape[1:]))
    _ALL_GATHER(out, local, group=tp.group)
    return out.movedim(0, 1).contiguous()


def _reduce_scatter_sequence(x: torch.Tensor, tp: TensorGroup) -> torch.Tensor:
    """(b, s, ...) partial sums on each rank -> (b, s / tp, ...): this rank's slice of the sum."""
    whole = x.movedim(1, 0).contiguous()
    out = whole.new_empty((whole.shape[0] // tp.size, *whole.shape[1:]))
    _REDUCE_SCATTER(out, whole, group=tp.group)
    return out.movedim(0, 1).contiguous()


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _reduce_scatter_sequence(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.tp), None


def _weight_grads(grad: torch.Tensor, x: torch.Tensor, *, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear layer's weight and bias gradients from its output's gradient and its (whole) input."""
    flat = grad.reshape(-1, grad.shape[-1])
    return flat.t().matmul(x.reshape(-1, x.shape[-1])), flat.sum(0) if bias else None


class _ColumnLinear(torch.autograd.Function):
    """y = x W^T + b for x replicated over the tp group. Backward: the input's gradient (this rank's partial sum)
    is all-reduced asynchronously while the weight's gradient is computed (Megatron-LM's
    LinearWithGradAccumulationAndAsyncCommunication: on NCCL the collective runs beside the GEMM)."""

    @staticmethod
    def forward(ctx, x, weight, bias, tp):
        ctx.tp, ctx.has_bias = tp, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight)
        pending = dist.all_reduce(grad_x, group=ctx.tp.group, async_op=True)
        grad_w, grad_b = _weight_grads(grad, x, bias=ctx.has_bias)
        pending.wait()
        return grad_x, grad_w, grad_b, None


class _SequenceParallelColumn(torch.autograd.Function):
    """y = gather(x) W^T + b under sequence parallelism, keeping only x's sequence slice for backward (Megatron's
    way: the whole input is gathered again there), so the input's memory divides by tp like every other
    activation outside the tensor-parallel regions. Backward overlaps as Megatron does: the re-gather runs while the
    input's gradient is computed, that gradient's reduce-scatter while the weight's is."""

    @staticmethod
    def forward(ctx, x, weight, bias, tp):
        ctx.tp, ctx.has_bias = tp, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_gather_sequence(x, tp), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        tp = ctx.tp
        local = x.movedim(1, 0).contiguous()
        whole = local.new_empty((local.shape[0] * tp.size, *local.shape[1:]))
        gathering = _ALL_GATHER(whole, local, group=tp.group, async_op=True)
        partial = grad.matmul(weight).movedim(1, 0).contiguous()
        grad_x = partial.new_empty((partial.shape[0] // tp.size, *partial.shape[1:]))
        scattering = _REDUCE_SCATTER(grad_x, partial, group=tp.group, async_op=True)
        gathering.wait()
        grad_w, grad_b = _weight_grads(grad, whole.movedim(0, 1), bias=ctx.has_bias)
        scattering.wait()
        return grad_x.movedim(0, 1).contiguous(), grad_w, grad_b, None


def column_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, tp: TensorGroup
) -> torch.Tensor:
    """A column-parallel projection of the replicated (or, with sequence parallelism, sequence-split) `x`."""
    if tp.sequence_parallel:
        return _SequenceParallelColumn.apply(x, weight, bias, tp)
    return _ColumnLinear.apply(x, weight, bias, tp)


def leave_region(x: torch.Tensor, tp: TensorGroup) -> torch.Tensor:
    """Out of a tensor-parallel region: the partial sums all-reduced, or with sequence parallelism reduce-scattered
    to this rank's sequence slice (all-gather backward)."""
    return _ReduceScatterToSequence.apply(x, tp) if tp.sequence_parallel else _ReduceFromRegion.apply(x, tp)


def copy_to_region(x: torch.Tensor, tp: TensorGroup) -> torch.Tensor:
    """Identity forward; the gradient summed over the tp group backward (Megatron's f)."""
    return _CopyToRegion.apply(x, tp)


def _row_shard(rows: list[tuple[int, int]]):
    def shard(full):
        pieces = [full[a:b] for a, b in rows]
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    return shard


def shard_param(
    module: nn.Module, name: str, param: nn.Parameter, *, dim: int, shard, rows: list[tuple[int, int]] | None = None
) -> None:
    """Make `param` `module`'s parameter `name`, a shard: `shard(full)` cuts it from the whole tensor, `rows` (a
    dim-0 shard) are its row ranges of the whole tensor (so an import reads only those). The module keeps how in
    `tp_marks`, and `mark_shards` puts it on the parameters again whenever they are new objects (materialising from
    the meta device makes new Parameters, without the attributes)."""
    marks = module.__dict__.setdefault("tp_marks", {})
    marks[name] = dict(dim=dim, shard=shard, rows=rows)
    setattr(module, name, param)
    _mark(param, **marks[name])


def _mark(param: nn.Parameter, *, dim: int, shard, rows) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1
    param.tp_shard = shard
    param.tp_rows = rows


def mark_shards(module: nn.Module) -> None:
    """Put the shard attributes on every sharded parameter of `module` (after materialising it)."""
    for part in module.modules():
        for name, how in part.__dict__.get("tp_marks", {}).items():
            _mark(getattr(part, name), **how)


def shard_of(param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """The slice of the whole tensor `full` that `param` holds (all of it for a replicated parameter)."""
    shard = getattr(param, "tp_shard", None)
    return full if shard is None else shard(full)


def read_shard(param: nn.Parameter, *, read_rows, whole) -> torch.Tensor:
    """`param`'s shard of an imported tensor: only its rows (`read_rows(start, stop)`) for a dim-0 shard, else the
    whole tensor (`whole()`) cut to the shard."""
    rows = getattr(param, "tp_rows", None)
    if rows is None:
        return shard_of(param, whole())
    pieces = [read_rows(a, b) for a, b in rows]
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _empty(*shape, like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=like.device, dtype=like.dtype))


class ColumnParallelLinear(nn.Module):
    def __init__(self, linear: nn.Linear, *, parts: list[int], tp: TensorGroup):
        super().__init__()
        if sum(parts) != linear.out_features or any(p % tp.size for p in parts):
            raise ValueError(f"parts {parts} of {linear.out_features} output features do not split over tp {tp.size}")
        self.in_features, self.out_features, self.parts, self.tp = linear.in_features, linear.out_features, parts, tp
        local, rows = linear.out_features // tp.size, part_rows(parts, rank=tp.rank, size=tp.size)
        shard_param(
            self,
            "weight",
            _empty(local, linear.in_features, like=linear.weight),
            dim=0,
            shard=_row_shard(rows),
            rows=rows,
        )
        self.bias = None
        if linear.bias is not None:
            shard_param(self, "bias", _empty(local, like=linear.bias), dim=0, shard=_row_shard(rows), rows=rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_linear(x, self.weight, self.bias, tp=self.tp)


class RowParallelLinear(nn.Module):
    def __init__(self, linear: nn.Linear, *, tp: TensorGroup):
        super().__init__()
        if linear.in_features % tp.size:
            raise ValueError(f"{linear.in_features} input features do not split over tp {tp.size}")
        self.in_features, self.out_features, self.tp = linear.in_features, linear.out_features, tp
        per = linear.in_features // tp.size

        def shard(full, per=per, tp=tp):
            return full[:, tp.rank * per : (tp.rank + 1) * per]

        shard_param(self, "weight", _empty(linear.out_features, per, like=linear.weight), dim=1, shard=shard)
        self.bias = None if linear.bias is None else _empty(linear.out_features, like=linear.bias)  # replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = leave_region(F.linear(x, self.weight), self.tp)
        if self.bias is None:
            return y
        return y + (copy_to_region(self.bias, self.tp) if self.tp.sequence_parallel else self.bias)


def shard_vocab_rows(module: nn.Module, name: str, weight: torch.Tensor, *, vocab: int, tp: TensorGroup) -> None:
    """Give `module` an empty parameter `name` for this rank's vocabulary rows of a (vocab, hidden) table."""
    start, stop = vocab_rows(vocab, rank=tp.rank, size=tp.size)
    shard_param(
        module,
        name,
        _empty(stop - start, weight.shape[1], like=weight),
        dim=0,
        shard=_row_shard([(start, stop)]),
        rows=[(start, stop)],
    )


class VocabParallelEmbedding(nn.Module):
    def __init__(self, table: nn.Embedding, *, tp: TensorGroup):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tp = table.num_embeddings, table.embedding_dim, tp
        self.start, self.stop = vocab_rows(table.num_embeddings, rank=tp.rank, size=tp.size)
        shard_vocab_rows(self, "weight", table.weight, vocab=table.num_embeddings, tp=tp)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.stop)
        local = (idx - self.start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_region(rows, self.tp)


class ReducedRMSNorm(nn.RMSNorm):
    """RMSNorm whose weight's gradient is summed over the tp group: each rank applies it to its own heads (q/k
    norm) or, under sequence parallelism, to its own sequence slice."""

    tp: TensorGroup

    @classmethod
    def like(cls, norm: nn.RMSNorm, *, tp: TensorGroup) -> "ReducedRMSNorm":
        out = cls(norm.normalized_shape, eps=norm.eps, device=norm.weight.device, dtype=norm.weight.dtype)
        out.tp = tp
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, copy_to_region(self.weight, self.tp), self.eps)


class ReducedLayerNorm(nn.LayerNorm):
    """LayerNorm applied to this rank's sequence slice, its weight's and bias's gradients summed over the group."""

    tp: TensorGroup

    @classmethod
    def like(cls, norm: nn.LayerNorm, *, tp: TensorGroup) -> "ReducedLayerNorm":
        out = cls(
            norm.normalized_shape,
            eps=norm.eps,
            bias=norm.bias is not None,
            device=norm.weight.device,
            dtype=norm.weight.dtype,
        )
        out.tp = tp
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else copy_to_region(self.bias, self.tp)
        return F.layer_norm(x, self.normalized_shape, copy_to_region(self.weight, self.tp), bias, self.eps)


class ReducedEmbedding(nn.Embedding):
    """A replicated table (learned positions) looked up for this rank's sequence slice, its gradient summed."""

    tp: TensorGroup

    @classmethod
    def like(cls, table: nn.Embedding, *, tp: TensorGroup) -> "ReducedEmbedding":
        out = cls(table.num_embeddings, table.embedding_dim, device=table.weight.device, dtype=table.weight.dtype)
        out.tp = tp
        return out

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, copy_to_region(self.weight, self.tp))


class SlicedPositions(ReducedEmbedding):
    """Learned positions under sequence parallelism: the rows of this rank's slice of the positions asked for."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx.chunk(self.tp.size, dim=-1)[self.tp.rank])


class ReducedLinear(nn.Linear):
    """A replicated projection applied to this rank's sequence slice (a routed or shared expert's, under sequence
    parallelism), its weight's and bias's gradients summed over the group."""

    tp: TensorGroup

    @classmethod
    def like(cls, linear: nn.Linear, *, tp: TensorGroup) -> "ReducedLinear":
        out = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
        )
        out.tp = tp
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else copy_to_region(self.bias, self.tp)
        return F.linear(x, copy_to_region(self.weight, self.tp), bias)


def sequence_parallel_experts(mlp: nn.Module, *, tp: TensorGroup, ep: int = 1) -> None:
    """A SparseMLP (dspipe.model.gpt) made sequence-parallel in place (SequenceParallelSparseMLP): its shared
    experts' projections replicated projections whose gradients are summed over the group; its routed experts' the
    same at ep 1, and at ep = tp (dspipe.runtime.experts.folded) this rank's E / tp of them marked as its tensor-
    parallel shards (whole tensors, different on every tp rank: DeepSpeed reduces their gradients over the
    data-parallel group and counts them in the gradient norm on every tp rank), the others left to be skipped by the
    build and dropped by dspipe.runtime.moe.install_for_run (`mlp.held`: the rank's experts). At ep = tp x k, k > 1
    (dspipe.runtime.experts.beyond_tp) the routed experts are left as they are: DeepSpeed's native layer takes this
    rank's (dspipe.runtime.moe.NativeMoE), their gradients reduced over their expert-data-parallel group."""
    routed = list(mlp.experts) if ep == 1 else []
    if ep == tp.size:
        per = len(mlp.experts) // ep
        mlp.held = range(tp.rank * per, (tp.rank + 1) * per)
        for e in mlp.held:
            for linear in (mlp.experts[e].c_fc, mlp.experts[e].c_proj):
                linear.tp_marks = {
                    name: dict(dim=0, shard=None, rows=None) for name, _ in linear.named_parameters(recurse=False)
                }
    for expert in [*routed, *([mlp.shared] if mlp.shared is not None else [])]:
        expert.c_fc, expert.c_proj = (ReducedLinear.like(x, tp=tp) for x in (expert.c_fc, expert.c_proj))
    mlp.__class__ = SequenceParallelSparseMLP
    mlp.tp = tp


class SequenceParallelSparseMLP(DispatchedSparseMLP):
    """A SparseMLP under Megatron sequence parallelism: the router, the routed and the shared experts stay whole on
    every tp rank, which routes and runs its own slice of the sequence, their gradients summed over the group; the
    load-balancing loss is the whole sequence's (the routes per expert and the router's probabilities summed over
    the group: the forward's only collectives, two all-reduces of E numbers), as at tp 1. Its experts run through
    dspipe.runtime.dispatch (DispatchedSparseMLP: a capacity, when set, applies to the rank's slice)."""

    tp: TensorGroup

    def router_weight(self) -> torch.Tensor:
        return copy_to_region(self.router.weight, self.tp)

    def balance(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        return sequence_balance(probs, chosen, tp=self.tp)


def sequence_balance(probs: torch.Tensor, chosen: torch.Tensor, *, tp: TensorGroup) -> torch.Tensor:
    """The load-balancing loss of the whole sequence from this tp rank's slice of it: the routes per expert and the
    router's probabilities summed over the group (two all-reduces of E numbers), as dspipe.model.gpt.balance_loss
    computes it at tp 1."""
    routes = routes_per_expert(probs, chosen)
    dist.all_reduce(routes, group=tp.group)
    tokens = probs.shape[0] * tp.size
    mean = _ReduceFromRegion.apply(probs.sum(dim=0), tp) / tokens
    return probs.shape[-1] * (routes / tokens * mean).sum()


def reduced_norm(norm: nn.Module, *, tp: TensorGroup) -> nn.Module:
    """The same norm, its parameters' gradients summed over the tp group."""
    return (ReducedRMSNorm if isinstance(norm, nn.RMSNorm) else ReducedLayerNorm).like(norm, tp=tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, tp, start):
        """logits (tokens, V_local) fp32, labels (tokens,) -> per-token loss (tokens,)."""
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=tp.group)
        local = labels - start
        mine = (local >= 0) & (local < logits.shape[-1])
        local = local.masked_fill(~mine, 0)
        target = shifted.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
        dist.all_reduce(target, group=tp.group)
        exp.div_(total.unsqueeze(-1))  # the softmax over the whole vocabulary, this rank's slice
        ctx.save_for_backward(exp, local, mine)
        return total.log() - target

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        grad_logits = softmax
        grad_logits[torch.arange(local.shape[0], device=local.device), local] -= mine.to(softmax.dtype)
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, tp: TensorGroup, vocab: int
) -> torch.Tensor:
    """Mean next-token cross-entropy of (batch, seq, V_local) logits (this rank's vocabulary rows), in fp32."""
    start, _ = vocab_rows(vocab, rank=tp.rank, size=tp.size)
    flat = logits.float().reshape(-1, logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(flat, labels.reshape(-1), tp, start).mean()


class VocabParallelLoss:
    """The pipeline's (and GPT's) loss function under tp: vocab_parallel_cross_entropy bound to the group."""

    def __init__(self, *, tp: TensorGroup, vocab: int):
        self.tp, self.vocab = tp, vocab

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, tp=self.tp, vocab=self.vocab)
