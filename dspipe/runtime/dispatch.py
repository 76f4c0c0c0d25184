"""dspipe's expert dispatch, the one every mixture of experts trains through: on DeepSpeed's MoE layer
(dspipe.runtime.moe.NativeMoE, ZeRO 0-2 at tp 1, any ep) and on the model's own SparseMLP (DispatchedSparseMLP:
ZeRO-3, and under tensor parallelism dspipe.runtime.tensor_parallel.SequenceParallelSparseMLP). Dropless by
default: every route of every token reaches its expert, in exact numbers, with no (tokens, E, capacity) mask. With a
capacity (a capacity factor cf: C = ceil(T / E x cf x k) routes per expert on each rank, capacity_slots) each expert
keeps the first C of the rank's routes to it in token order (Megatron-Core's "position" drop policy) and the others
are dropped: computed by no expert, they add nothing to their token's output (the kept routes' weights are not
renormalised).

One sparse block's forward, T tokens, k routes each, E experts over ep ranks (L = E / ep local experts each):
1. The T x k routes are sorted by expert (stable: within an expert, by token, then by slot); with a capacity, the
   routes past the C-th of each expert are dropped. Each token's row is gathered once per kept route: the rows are
   laid out expert after expert, E runs of counts[e] rows.
2. ep > 1: the counts go round in one all-to-all (E numbers), then the rows in one all-to-all-v: rank r sends
   rank q the runs of q's experts and gets back, from every rank in turn, the runs of its own; the received rows
   are regrouped expert by expert. Its backward is the all-to-all-v the other way (_AllToAllV).
3. Each local expert runs once, on its run of rows (an empty run when no token chose it: its weights still get a
   zero gradient, so every rank reduces every expert).
4. The outputs go back the way they came (ep > 1: regrouped and all-to-all-v'd home); expert after expert, each
   run is weighted by its routes' combine weights and added to its tokens' outputs (index_add_), so each token's
   output sums its k routes in the plain loop's order (a token is in an expert's run at most once: no two adds to
   one row in a call, so no atomic races on a GPU).

What it moves per rank and forward: k x T rows of h values each way (ep - 1) / ep of them leaving the rank; its
backward, the same. What it computes: k x T rows through the experts (at most; fewer when a capacity drops some).
DeepSpeed's own einsum dispatch, which dspipe used until 2026-11-29, padded every expert to the busiest one's load
and multiplied by (T, E, capacity) masks. Megatron-Core's and AutoEP's dropless dispatchers work as this one does;
this one is dspipe's own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from dspipe.model.gpt import SparseMLP, expert_counts
from dspipe.runtime.experts import capacity_slots


class _AllToAllV(torch.autograd.Function):
    """All-to-all of rows with uneven splits (rank r sends send[q] rows to rank q and gets recv[q] from it); the
    backward sends the gradients back the same way round."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(rows, send=send, recv=recv, group=group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, send=ctx.recv, recv=ctx.send, group=ctx.group), None, None, None


def _all_to_all(rows: torch.Tensor, *, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def _regroup(counts: torch.Tensor) -> torch.Tensor:
    """Rows received as (source rank, local expert) runs of counts[s, j] rows -> the order (local expert, source
    rank): the index of each regrouped row in the received ones."""
    lengths = counts.reshape(-1)
    starts = torch.cumsum(lengths, 0) - lengths  # each run's first row, as received
    lengths_t, starts_t = lengths.view(counts.shape).t().reshape(-1), starts.view(counts.shape).t().reshape(-1)
    total = int(lengths.sum())
    firsts = torch.repeat_interleave(starts_t, lengths_t)
    offsets = torch.arange(total, device=counts.device) - torch.repeat_interleave(
        torch.cumsum(lengths_t, 0) - lengths_t, lengths_t
    )
    return firsts + offsets


def dispatch(
    x: torch.Tensor,
    *,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    experts: nn.ModuleList,
    num_experts: int,
    ep: int = 1,
    group=None,
    capacity: int | None = None,
) -> tuple[torch.Tensor, int]:
    """(The routed experts' output for tokens `x` (T, h), the routes a capacity dropped): `chosen` (T, k) global
    expert ids, `weights` (T, k) their combine weights (in x's dtype), `experts` this rank's L = num_experts / ep
    experts (ep rank r holds [r L, (r + 1) L)), `group` the expert-parallel group (ep > 1), `capacity` the routes
    each expert keeps (None: all)."""
    k = chosen.shape[1]
    routes = chosen.reshape(-1)
    order = torch.argsort(routes, stable=True)
    counts = expert_counts(routes, num_experts=num_experts)  # no host wait: the only one is `runs` below
    dropped = 0
    if capacity is not None:
        first = torch.cumsum(counts, 0) - counts  # each expert's first route in `order`
        place = torch.arange(order.numel(), device=order.device) - first.repeat_interleave(counts)
        kept = place < capacity
        dropped = int(order.numel() - kept.sum())
        order, counts = order[kept], counts.clamp(max=capacity)
    token = torch.div(order, k, rounding_mode="floor")
    rows = x.index_select(0, token)
    runs = counts.tolist()
    if ep == 1:
        outs = [expert(run) for expert, run in zip(experts, rows.split(runs), strict=True)]
    else:
        local = num_experts // ep
        sent = counts.view(ep, local)
        got = torch.empty_like(sent)
        dist.all_to_all_single(got, sent, group=group)  # got[s, j]: rows rank s sends this rank's expert j
        send, recv = sent.sum(1).tolist(), got.sum(1).tolist()
        regroup = _regroup(got)
        rows = _AllToAllV.apply(rows, send, recv, group).index_select(0, regroup)
        out = torch.cat([expert(run) for expert, run in zip(experts, rows.split(got.sum(0).tolist()), strict=True)])
        home = torch.empty_like(regroup)
        home[regroup] = torch.arange(regroup.numel(), device=regroup.device)
        outs = _AllToAllV.apply(out.index_select(0, home), recv, send, group).split(runs)
    # each expert's weighted rows added to their tokens, expert after expert: the loop's order of the sums (and on a
    # GPU no token twice in one index_add_, so no atomic races)
    combined = torch.zeros_like(x)
    weights = weights.reshape(-1).index_select(0, order)
    for out, to, weight in zip(outs, token.split(runs), weights.split(runs), strict=True):
        combined.index_add_(0, to, out * weight[:, None])
    return combined, dropped


def dispatch_counted(
    layer: nn.Module,
    flat: torch.Tensor,
    *,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    experts: nn.ModuleList,
    ep: int = 1,
    group=None,
) -> torch.Tensor:
    """`dispatch` for a sparse block's layer (NativeMoE, DispatchedSparseMLP): its capacity from the rank's tokens
    and the layer's `capacity_factor`, the routes it drops added to the layer's `dropped` in training forwards (a
    recomputation counts none)."""
    capacity = capacity_slots(
        tokens=flat.shape[0], experts=layer.num_experts, k=chosen.shape[1], factor=layer.capacity_factor
    )
    out, dropped = dispatch(
        flat,
        chosen=chosen,
        weights=weights,
        experts=experts,
        num_experts=layer.num_experts,
        ep=ep,
        group=group,
        capacity=capacity,
    )
    if layer.training and not recomputing():
        layer.dropped += dropped
    return out


def recomputing() -> bool:
    """Whether this forward is a recomputation (one runs inside a backward): it counts no expert loads or drops."""
    return torch._C._current_graph_task_id() != -1


class DispatchedSparseMLP(SparseMLP):
    """The model's own SparseMLP with its routed experts run through `dispatch`, a capacity applied where the spec
    has a factor; `dropped` counts the routes it dropped in the training forwards (a recomputation counts none)
    since dspipe.runtime.moe.step_counts took them. At ep 1 every expert is on the rank; at ep > 1 (ZeRO-3:
    dspipe.runtime.moe.spread_experts) `experts` holds the rank's E / ep and `ep_group` is its expert-parallel
    group."""

    capacity_factor: float | None = None
    dropped: int = 0
    ep: int = 1
    ep_group = None

    @classmethod
    def adopt(cls, mlp: SparseMLP, *, capacity_factor: float | None, ep: int = 1, group=None) -> SparseMLP:
        """`mlp` as this class (unless it is one already, a subclass included), in place: its state, names and
        values unchanged."""
        if not isinstance(mlp, cls):
            mlp.__class__ = cls
        mlp.capacity_factor, mlp.dropped = capacity_factor, 0
        mlp.ep, mlp.ep_group = ep, group
        return mlp

    def routed(self, flat: torch.Tensor, *, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return dispatch_counted(
            self, flat, chosen=chosen, weights=weights, experts=self.experts, ep=self.ep, group=self.ep_group
        )
