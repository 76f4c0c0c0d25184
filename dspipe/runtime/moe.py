"""Expert parallelism: every sparse block's SparseMLP (dspipe.model.gpt) is replaced, before deepspeed.initialize,
by a `NativeMoE` backed by DeepSpeed's native `deepspeed.moe.layer.MoE` (at every ep, 1 included), holding the
model's router as its gate and this rank's experts [ep_rank x E/ep, (ep_rank + 1) x E/ep) as its local experts.

The output equals the plain SparseMLP's (no noise, no random token selection): the model routes
(dspipe.model.gpt.route: the experts chosen by score, selection bias and expert groups; their weights, the top-k
softmax or sigmoid scores renormalised only when router_norm_topk, times router_scale), computed from the gate's
weight with their graph, so the router's gradient is the plain model's too. DeepSpeed's layer holds the experts
(its expert groups, parameter attributes, optimizer groups and checkpoint files); the tokens reach them through
dspipe.runtime.dispatch (dropless; with a capacity factor, each expert keeps its first C routes), as every MoE
layout's do: DeepSpeed's gate and einsum dispatch never run. Where the experts are the model's own modules (ZeRO-3,
tp > 1: dspipe.runtime.experts.native_layer false) its SparseMLP dispatches the same way (install_for_run:
dispatch.DispatchedSparseMLP); under ZeRO-3 at ep > 1 each rank keeps only its experts, which ZeRO-3 partitions
over their expert-data-parallel group (spread_experts: DeepSpeed 0.19.8's stage 3 placement of AutoEP's experts).
The load-balancing loss is the model's (dspipe.model.gpt.balance_loss), kept as `.aux` for GPT.forward; DeepSpeed's
l_aux is not used. After each step: step_counts, load_ratio and update_router_bias. A pipeline stage has no
GPT.forward: its sparse blocks tie their losses into the backward themselves (wire_stage, Megatron-LM's
MoEAuxLossAutoScaler idea) and record them for the report (take_aux_total).

Names: the block's `mlp.router.weight` lives at `mlp.moe.deepspeed_moe.gate.wg.weight`, expert e at
`mlp.moe.deepspeed_moe.experts.deepspeed_experts.{e - ep_rank x E/ep}` (DeepSpeed's checkpoint files name it by its
global id e: layer_L_expert_e_mp_rank_00_model_states.pt); dspipe.runtime.experts.model_name maps those back.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dspipe.errors import SpecError
from dspipe.model.gpt import GPT, Block, RouterState, balance_loss, route
from dspipe.runtime import tensor_parallel as T
from dspipe.runtime.dispatch import DispatchedSparseMLP, dispatch_counted, recomputing
from dspipe.runtime.experts import expert_parallel, folded, native_layer, refusal


class NativeMoE(RouterState):
    """A sparse block's MLP on DeepSpeed's MoE layer, its tokens dispatched by dspipe.runtime.dispatch; the same
    output and aux as the SparseMLP it was built from."""

    def __init__(self, sparse: nn.Module, *, spec, ep: int, ep_rank: int):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self._init_router_state(spec)
        if self.router_bias is not None:
            self.router_bias = sparse.router_bias.detach().float().clone()
        self.capacity_factor = spec.capacity_factor
        local = spec.experts // ep
        template = sparse.experts[ep_rank * local]  # a local expert: the others may be meta (dspipe.runtime.build)
        weight = sparse.router.weight
        with torch.random.fork_rng(devices=[]):  # the gate's throwaway default init must not move the seed streams
            moe = MoE(
                spec.hidden,
                expert=template,
                num_experts=spec.experts,
                ep_size=ep,
                k=spec.experts_per_token,
                min_capacity=0,
                noisy_gate_policy=None,
                drop_tokens=False,
                use_rts=False,
                top2_2nd_expert_sampling=False,
            )  # its gate holds the router's weight; its gate and einsum dispatch never run (dispatch does)
        self.moe = moe.to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.gate_weight.copy_(weight)
            for i, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                source = sparse.experts[ep_rank * local + i]
                for dst, src in zip(expert.parameters(), source.parameters(), strict=True):
                    dst.copy_(src)
        self.shared = getattr(sparse, "shared", None)
        self.tp = getattr(sparse, "tp", None)
        """The tensor-parallel group (dspipe.runtime.tensor_parallel.TensorGroup) whose ranks route slices of one
        sequence (ep = tp x k: dspipe.runtime.experts.beyond_tp); None at tp 1."""
        if self.tp is not None:  # each tp rank holds other experts: DeepSpeed counts them in the norm on every one
            for param in self.moe.deepspeed_moe.experts.parameters():
                param.tensor_model_parallel = True
        self.dropped = 0
        """Routes a capacity dropped in the training forwards since step_counts took them (a recomputation counts
        none)."""
        self.aux: torch.Tensor | None = None
        """The load-balancing loss of the last forward (with its graph)."""

    @property
    def gate_weight(self) -> torch.Tensor:
        return self.moe.deepspeed_moe.gate.wg.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weight = self.gate_weight
        if self.tp is not None:  # the router sees this rank's slice: its gradient summed over the tp group
            weight = T.copy_to_region(weight, self.tp)
        logits = F.linear(flat.float(), weight.float())
        probs, weights, chosen = route(logits, bias=self.router_bias, **self.routing)
        self.aux = balance_loss(probs, chosen) if self.tp is None else T.sequence_balance(probs, chosen, tp=self.tp)
        self._count(chosen)
        layer = self.moe.deepspeed_moe
        out = dispatch_counted(
            self,
            flat,
            chosen=chosen,
            weights=weights.to(flat.dtype),  # the activations' dtype, as the SparseMLP weighs the outputs
            experts=layer.experts.deepspeed_experts,
            ep=layer.ep_size,
            group=layer.ep_group,
        )
        out = out.view_as(x)
        return out if self.shared is None else out + self.shared(x)


class ExpertElsewhere(nn.Module):
    """A routed expert that another expert-parallel rank holds: the pipeline stage build's placeholder
    (dspipe.runtime.build), never run: the NativeMoE that replaces the block's SparseMLP holds this rank's experts."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this routed expert is held by another expert-parallel rank")


def sparse_blocks(module: nn.Module) -> list[Block]:
    """The sparse blocks the module holds: all of a plain GPT's, a pipeline stage's own."""
    return [m for m in module.modules() if isinstance(m, Block) and m.sparse]


def install(module: nn.Module, *, spec, ep: int, ep_rank: int) -> int:
    """Replace the mlp of every sparse block the module holds (a plain GPT, or a pipeline stage) by a NativeMoE;
    returns how many. Each keeps its block's place among the model's sparse blocks (`sparse_index`: its row of
    step_counts). A pipeline stage's blocks hand their load-balancing loss to the backward themselves (wire_stage)."""
    blocks = sparse_blocks(module)
    for block in blocks:
        block.mlp = NativeMoE(block.mlp, spec=spec, ep=ep, ep_rank=ep_rank)
        block.mlp.sparse_index = spec.sparse_layers.index(block.index)
    if not isinstance(module, GPT):
        wire_stage(blocks)
    return len(blocks)


class _AuxGradient(torch.autograd.Function):
    """The identity on a block's output whose backward also gives the block's load-balancing loss the gradient
    `scale` (Megatron-LM's MoEAuxLossAutoScaler): a pipeline stage's blocks add aux_loss_coef x aux / sparse blocks
    to the loss without the loss having to travel to the last stage."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale, ctx.like = scale, aux
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full_like(ctx.like, ctx.scale), None


def wire_stage(blocks: list[Block]) -> None:
    """A pipeline stage's sparse blocks, where no GPT.forward adds their load-balancing losses to the loss: after
    each training forward a block (1) counts its micro-batch's expert loads once and adds its loss to `aux_total`
    (for the report), unless the forward is a recomputation (one runs inside the backward), and (2) when the forward
    builds a graph ties its loss into the backward with the gradient aux_scale, set by set_aux_scale once the
    engine's gradient accumulation is known. A graph is built by a forward without recomputation, by a reentrant
    checkpoint's recomputation, by a non-reentrant checkpoint's first forward (whose graph the backward keeps)."""
    for block in blocks:
        block.aux_scale = None
        block.aux_total = None
        block.register_forward_hook(_stage_block_done)


def _stage_block_done(block: Block, _inputs, output):
    if not block.training:
        return None
    if not recomputing():  # its micro-batch is counted by its forward, not by a recomputation in the backward
        block.mlp.commit_routed()
        aux = block.aux.detach().float()
        block.aux_total = aux if block.aux_total is None else block.aux_total + aux
    if not torch.is_grad_enabled():
        return None
    if block.aux_scale is None:
        raise RuntimeError(f"block {block.index}: its load-balancing loss has no gradient scale (set_aux_scale)")
    return _AuxGradient.apply(output, block.aux, block.aux_scale)


def set_aux_scale(module: nn.Module, *, spec, grad_accum: int) -> None:
    """The gradient of each sparse block's load-balancing loss in a pipeline stage, as the plain GPT's loss gives
    it: aux_loss_coef / sparse blocks (the mean over blocks), / gradient accumulation (the engine divides the
    last stage's loss, and so every gradient, by it)."""
    for block in sparse_blocks(module):
        block.aux_scale = spec.aux_loss_coef / (len(spec.sparse_layers) * grad_accum)


def take_aux_total(module: nn.Module, *, device) -> torch.Tensor:
    """The sum of the load-balancing losses this stage's sparse blocks recorded since the last call (fp32, 0 if
    none); the count restarts."""
    total = torch.zeros((), device=device)
    for block in sparse_blocks(module):
        if block.aux_total is not None:
            total += block.aux_total.to(device)
            block.aux_total = None
    return total


def install_for_run(module: nn.Module, *, run, rank: int) -> None:
    """The runtime step before deepspeed.initialize (dspipe.runtime.engine.build_engine, after the build and
    parallelize): a MoE model's sparse blocks onto DeepSpeed's MoE layer (under ZeRO-3 and at tp > 1 they stay the
    model's own: dspipe.runtime.experts.native_layer; ZeRO-3 at ep > 1: spread_experts; at tp > 1 and ep = tp each
    tp rank keeps the experts it holds, dispatching over the tp group: dspipe.runtime.experts.folded); a layout that
    cannot train a mixture of experts (or ep > 1 on a dense model) is one SpecError on every rank."""
    ep = expert_parallel(run)
    zero = run.ds_config.get("zero_optimization") or {}
    why = refusal(spec=run.model, plan=run.plan, ep=ep, contiguous_gradients=bool(zero.get("contiguous_gradients")))
    if why:
        raise SpecError(f"cannot train {run.model.name} with experts {run.model.experts}, ep {ep}: {why}")
    if not run.model.experts:
        return
    if native_layer(zero_stage=run.plan.zero_stage, tp=run.plan.tp, ep=ep):
        install(module, spec=run.model, ep=ep, ep_rank=rank % ep)
        return
    blocks = sparse_blocks(module)  # the model's own SparseMLPs (ZeRO-3, or tp > 1 after parallelize)
    if folded(tp=run.plan.tp, ep=ep):  # spread over the tp group: this tp rank's experts, its tp shards
        for block in blocks:
            block.mlp.experts = nn.ModuleList(block.mlp.experts[e] for e in block.mlp.held)
            DispatchedSparseMLP.adopt(
                block.mlp, capacity_factor=run.model.capacity_factor, ep=block.mlp.tp.size, group=block.mlp.tp.group
            )
    elif ep > 1:  # ZeRO-3 (at tp > 1 over k tp groups): this rank's experts, over its expert-data-parallel group
        spread_experts(blocks, spec=run.model, ep=ep, ep_rank=rank % ep)
    else:
        for block in blocks:
            DispatchedSparseMLP.adopt(block.mlp, capacity_factor=run.model.capacity_factor)
    if not isinstance(module, GPT):  # a pipeline stage (tp > 1)
        for block in blocks:
            block.mlp.sparse_index = run.model.sparse_layers.index(block.index)
        wire_stage(blocks)


def expert_groups(ep: int) -> tuple[str, object, object]:
    """(name, expert-parallel group, expert-data-parallel group) of this rank in DeepSpeed's expert groups for ep
    (deepspeed.utils.groups, made once): ranks [q ep, (q + 1) ep) form an expert-parallel group, so a rank's ep rank
    is rank % ep, and the ranks of one ep rank its expert-data-parallel group (DeepSpeed's MoE layer makes the same
    groups)."""
    from deepspeed.utils import groups

    name = f"ep_size_{ep}"
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep)
    return name, groups._get_expert_parallel_group(name), groups._get_expert_data_parallel_group(name)


def spread_experts(blocks: list[Block], *, spec, ep: int, ep_rank: int) -> None:
    """ZeRO-3 at ep > 1: each sparse block's SparseMLP keeps only its experts [ep_rank x L, (ep_rank + 1) x L),
    L = E / ep (the build made only those: dspipe.runtime.build.local_experts), as its `experts` 0 .. L-1 (every rank
    holds the same module tree and runs the same modules in the same order, as ZeRO-3's parameter trace requires;
    a checkpoint's readers give them back their ids, ep_rank x L + J: dspipe.runtime.zero3_experts), and dispatches
    the tokens of the others to their holders. Their parameters are DeepSpeed's expert parameters:
    broadcast and reduced over the expert-data-parallel group (allreduce False, group_name); ZeRO-3 partitions them
    over that group (ds_zero_partition_process_group, read when deepspeed.initialize converts the module), averages
    their gradients over the whole dp and adds the expert-parallel group to their gradient norm (the placement
    family DeepSpeed 0.19.8's stage 3 gives AutoEP's experts)."""
    name, group, data_group = expert_groups(ep)
    per = spec.experts // ep
    for block in blocks:
        mlp = block.mlp
        mlp.experts = nn.ModuleList(mlp.experts[e] for e in range(ep_rank * per, (ep_rank + 1) * per))
        for param in mlp.experts.parameters():
            param.allreduce, param.group_name = False, name
            param.ds_zero_placement_family = "autoep_expert"
            param.ds_zero_partition_group_name = name
            param.ds_zero_partition_process_group = data_group
        DispatchedSparseMLP.adopt(mlp, capacity_factor=spec.capacity_factor, ep=ep, group=group)


def live_ep(module: nn.Module) -> int:
    """The expert-parallel size the module's sparse blocks run at: their DeepSpeed MoE layers' ep_size, the size of
    the group the model's own dispatching SparseMLPs exchange tokens over (1 without either)."""
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE

    sizes = [int(m.ep_size) for m in module.modules() if isinstance(m, MoE)]
    sizes += [
        dist.get_world_size(group=m.ep_group)
        for m in module.modules()
        if isinstance(m, DispatchedSparseMLP) and m.ep_group is not None
    ]
    return max(sizes, default=1)


def param_groups(groups: list[dict]) -> list[dict]:
    """dspipe's AdamW groups split by DeepSpeed (split_params_into_different_moe_groups_for_optimizer): each
    group's experts go to a group of their own (moe=True, same hyper-parameters) reduced over the expert data
    parallel ranks only."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    named = [{**g, "name": g.get("name", f"group{i}")} for i, g in enumerate(groups)]
    return [g for g in split_params_into_different_moe_groups_for_optimizer(named) if g["params"]]


def step_counts(module: nn.Module, *, spec, device) -> tuple[torch.Tensor, int]:
    """Collective, after each optimizer step of a mixture of experts: the tokens each expert of each sparse block got
    over the step (every training micro-batch, summed over all ranks: a pipeline's stages each fill their blocks'
    rows), (the model's sparse blocks, E) int64, and the routes a capacity dropped (0 when dropless); one
    all_reduce. Both counts restart."""
    import torch.distributed as dist

    table = torch.zeros(len(spec.sparse_layers), spec.experts + 1, dtype=torch.int64, device=device)
    for row, m in _routers(module):
        table[row, : spec.experts] = m.take_routed(device=device)
        table[row, spec.experts] = getattr(m, "dropped", 0)
        m.dropped = 0
    dist.all_reduce(table)
    return table[:, : spec.experts], int(table[:, spec.experts].sum())


def _routers(module: nn.Module) -> list[tuple[int, RouterState]]:
    """(row among the model's sparse blocks, router) of each sparse block the module holds: a pipeline stage's
    rows are its blocks' sparse_index (install), a whole model's their order."""
    routers = [m for m in module.modules() if isinstance(m, RouterState)]
    return [(getattr(m, "sparse_index", i), m) for i, m in enumerate(routers)]


def load_ratio(loads: torch.Tensor) -> float:
    """The step's worst imbalance: the busiest expert's tokens over the mean tokens per expert, in the sparse block
    where that is highest (1: balanced; DeepSeek-V3's MaxVio + 1)."""
    loads = loads.double()
    return float((loads.max(dim=1).values / loads.mean(dim=1)).max())


def update_router_bias(module: nn.Module, *, loads: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, after each optimizer step, from the step's `loads` (step_counts):
    every expert's selection bias += rate x sign(mean tokens - its tokens) (up for an expert below the mean, down
    above it). The same on every rank: the loads are summed over all of them."""
    step = rate * torch.sign(loads.double().mean(dim=1, keepdim=True) - loads.double()).float()
    with torch.no_grad():
        for row, m in _routers(module):
            m.router_bias.add_(step[row].to(m.router_bias.device))
