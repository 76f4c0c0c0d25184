"""Expert parallelism without torch: the run's ep, which layer a mixture of experts trains on (native_layer), what
DeepSpeed's native MoE cannot train, and the names and files of its checkpoints (dspipe.runtime.moe builds the
layers).

A sparse block's tensors as DeepSpeed names them (NativeMoE at h.N.mlp): the router at
`h.N.mlp.moe.deepspeed_moe.gate.wg.weight` (in mp_rank_00_model_states.pt), expert e at
`h.N.mlp.moe.deepspeed_moe.experts.deepspeed_experts.{local id}` in memory and with its global id e in its own file
layer_L_expert_e_mp_rank_MM_model_states.pt (L: the sparse block's index among the sparse blocks, from 0; MM: its
holder's model-parallel rank, 00 at tp 1 and pp 1: holder_tp_rank).
"""

from __future__ import annotations

import math
import re

from dspipe.spec.kinds import Precision

GATE = "moe.deepspeed_moe.gate.wg.weight"
EXPERTS = "moe.deepspeed_moe.experts.deepspeed_experts."
EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
EP_ZERO0_REFUSAL = (
    "measured with DeepSpeed 0.19.8 on 2 ranks: the gradient norm it clips by is not the "
    "model's under expert parallelism (0.6813 where ep 1 gives 0.6823)"
)
EP_ZERO1_REFUSAL = (
    "measured with DeepSpeed 0.19.8 on 2 ranks: that path trains off ep 1 (gradient norm 0.6841 "
    "where ep 1 gives 0.6823, loss 2.3e-3 off after 6 steps); with contiguous_gradients true it "
    "is bitwise ep 1's"
)


def expert_parallel(run) -> int:
    """The run's ep: the plan's, else the strategy's (a plan from before expert parallelism), else 1."""
    ep = getattr(run.plan, "ep", None)
    if ep is None:
        ep = getattr(getattr(run, "strategy", None), "ep", 1)
    return ep if isinstance(ep, int) and not isinstance(ep, bool) else 1


def native_layer(*, zero_stage: int, tp: int = 1, ep: int = 1) -> bool:
    """Whether a mixture of experts trains on DeepSpeed's native MoE layer (deepspeed.moe.layer.MoE: ZeRO 0-2 at
    tp 1, or at tp > 1 with the experts over more ranks than the tp group (`beyond_tp`); its expert groups, expert
    parallelism, expert files in the checkpoint) or as the model's own SparseMLP: under ZeRO-3, which the native
    layer refuses, and with tp > 1 at ep 1 or ep = tp. Under ZeRO-3 at ep > 1 each rank keeps its
    E / ep experts, which ZeRO-3 partitions over their expert-data-parallel group (dspipe.runtime.moe.spread_experts);
    at ep 1 ZeRO-3 partitions every expert over every data-parallel rank like the dense modules. With tp > 1 each
    tp rank routes its sequence slice's tokens (Megatron sequence parallelism; dspipe.runtime.parallelize): at ep 1
    to the experts it holds whole, at ep = tp to the E / tp experts each tp rank holds (`folded`).
    Either way the tokens reach the experts through dspipe.runtime.dispatch, each expert once per forward on its
    routed tokens (an empty batch when none, so every rank gathers and reduces every expert in the same order)."""
    return zero_stage != 3 and (tp == 1 or beyond_tp(tp=tp, ep=ep))


def beyond_tp(*, tp: int, ep: int) -> bool:
    """Whether the experts are spread over more ranks than the tensor-parallel group: tp > 1 and ep = tp x k, k > 1
    (Megatron-Core's expert parallelism folded over tp x dp). Ranks are numbered tp-fastest
    (dspipe.spec.layout), so ep consecutive ranks of a stage are k whole tp groups of k consecutive data-parallel
    ranks: an expert-parallel group of DeepSpeed's plain layout (deepspeed.utils.groups, ranks [q ep, (q + 1) ep),
    a rank's ep rank rank % ep), its expert-data-parallel group the dp / k ranks of one ep rank. Each tp rank routes
    its slice of the sequence (Megatron sequence parallelism) to the holders over that group; DeepSpeed's native
    layer holds the experts (dspipe.runtime.moe.NativeMoE, its router's gradient and load-balancing loss summed over
    the tp group)."""
    return tp > 1 and ep > tp


def folded(*, tp: int, ep: int) -> bool:
    """Whether the experts are spread over the tensor-parallel group (tp > 1 and ep = tp: tp rank r holds experts
    [r E/tp, (r + 1) E/tp) of every sparse block, the tokens of its sequence slice go to their holders through the
    all-to-all over the tp group, and each expert's gradients are reduced over the data-parallel group as a tp shard's
    are: Megatron-Core's expert parallelism folded onto the attention's tp group) rather than over data-parallel
    ranks (tp 1)."""
    return tp > 1 and ep == tp


def ep_span(*, tp: int, ep: int) -> int:
    """The data-parallel ranks an expert-parallel group spans: ep at tp 1, ep / tp at tp > 1 (1 when each tp rank
    holds every expert, ep 1, or the tp group holds them, ep = tp)."""
    return ep if tp == 1 else max(1, ep // tp)


def ep_rank_of(*, dp_rank: int, tp_rank: int, tp: int, ep: int) -> int:
    """The ep rank of the rank at (dp_rank, tp_rank) of a stage: its global rank % ep (DeepSpeed's plain layout of
    ep consecutive ranks, ranks numbered tp-fastest: dspipe.spec.layout), i.e. dp_rank % ep at tp 1, tp_rank at
    ep = tp, (dp_rank % (ep / tp)) x tp + tp_rank at ep = tp x k; 0 at ep 1."""
    if ep <= 1:
        return 0
    return dp_rank % ep if tp == 1 else dp_rank % ep_span(tp=tp, ep=ep) * tp + tp_rank


def capacity_slots(*, tokens: int, experts: int, k: int, factor: float | None) -> int | None:
    """Routes an expert keeps on a rank for `tokens` tokens: ceil(tokens / experts x factor x k) (DeepSpeed's
    capacity with min_capacity 0); None (dropless) without a factor."""
    return None if factor is None else math.ceil(tokens / experts * factor * k)


def refusal(*, spec, plan, ep: int, contiguous_gradients: bool = True) -> str | None:
    """Why this layout cannot train a mixture of experts (None: it can); `contiguous_gradients`: the rendered
    ds_config.json's zero_optimization.contiguous_gradients."""
    if not spec.experts:
        return f"ep {ep} > 1 needs a mixture-of-experts model (experts 0)" if ep > 1 else None
    why = []
    if plan.tp > 1 and ep > 1 and ep % plan.tp:
        why.append(
            f"tp {plan.tp} at ep {ep}: ep % tp = {ep % plan.tp} (at tp > 1 the experts spread over whole tp groups)"
        )
    if plan.tp > 1 and not plan.tp_sp:
        why.append(f"tp {plan.tp} without sequence parallelism (each tp rank would run every token's experts)")
    if plan.sp > 1:
        why.append(f"sp {plan.sp} > 1")
    if ep > 1 and plan.zero_stage == 0:
        why.append(f"ep {ep} > 1 under ZeRO-0 ({EP_ZERO0_REFUSAL}; use ZeRO-1 or 2, or ep 1)")
    if ep > 1 and plan.zero_stage == 1 and not contiguous_gradients:
        why.append(
            f"ep {ep} > 1 under ZeRO-1 with contiguous_gradients false in ds_config.json "
            f"({EP_ZERO1_REFUSAL}; set it true, or use ZeRO-2)"
        )
    if plan.precision == Precision.FP16:
        why.append("fp16 (use bf16 or fp32)")
    if spec.experts % ep:
        why.append(f"experts {spec.experts} % ep {ep} = {spec.experts % ep}")
    groups = ep_span(tp=plan.tp, ep=ep) if ep % plan.tp == 0 else ep  # data-parallel ranks an expert group spans
    if plan.dp % groups:
        why.append(
            f"dp {plan.dp} % (ep {ep} / tp {plan.tp}) = {plan.dp % groups}"
            if groups != ep
            else f"dp {plan.dp} % ep {ep} = {plan.dp % ep}"
        )
    return "; ".join(why) or None


def model_name(name: str, *, local: int = 0, ep_rank: int = 0) -> str:
    """The model's name of a NativeMoE tensor name (DeepSpeed's, with a local expert id, or with the global id as
    the expert files hold it: local = 0); other names unchanged."""
    name = name.replace(GATE, "router.weight")
    m = re.search(re.escape(EXPERTS) + r"(\d+)\.", name)
    if m:
        name = name[: m.start()] + f"experts.{ep_rank * local + int(m.group(1))}." + name[m.end() :]
    return name


def holder_tp_rank(expert: int, *, experts: int, ep: int, tp: int) -> int:
    """The tp rank of the ranks holding `expert` (0 at tp 1): its ep rank's (ep rank q holds experts [q E/ep,
    (q + 1) E/ep); ranks are numbered tp-fastest and an expert-parallel group is ep consecutive ranks, so ep rank q
    is tp rank q % tp). DeepSpeed names an expert's file by its holder's model-parallel rank."""
    return expert // (experts // ep) % tp if tp > 1 and ep > 1 else 0


def expert_files(model: dict, *, ep: int = 1, tp: int = 1) -> list[str]:
    """The expert files a checkpoint of the model (its dspipe.json model) holds at pp 1: one per sparse block and
    expert, named by its holder's tp rank (holder_tp_rank)."""
    from dspipe.spec.core import from_dict
    from dspipe.spec.model import ModelSpec

    spec = from_dict(ModelSpec, model)
    return [
        f"layer_{layer}_expert_{e}_mp_rank_{holder_tp_rank(e, experts=spec.experts, ep=ep, tp=tp):02d}_model_states.pt"
        for layer in range(len(spec.sparse_layers))
        for e in range(spec.experts)
    ]
