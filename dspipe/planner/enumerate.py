"""The candidate strategies of a request: every valid ZeRO x offload x pp x tp x sp x ep x recomputation x precision x
micro-batch it leaves open, planned and estimated (the refusals kept, by family and axis, for the explanation).
No torch."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from dspipe.errors import SpecError
from dspipe.planner.cost import Estimate, estimate, throughput
from dspipe.planner.memory import stage_memory
from dspipe.planner.plan import Plan, RuleError, make_plan
from dspipe.planner.stages import stage_blocks
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.core import StrategyRequest
from dspipe.spec.kinds import Axis, Checkpointing, Offload
from dspipe.spec.layout import ParallelLayout
from dspipe.spec.model import ModelSpec
from dspipe.spec.settings import AUTO, is_auto
from dspipe.spec.strategy import StrategySpec
from dspipe.spec.train import TrainSpec

AUTO_CHECKPOINTING = ("none", "full")
"""Recomputation the search chooses from. Not selective: with SDPA's fused kernels the attention core it recomputes
keeps no s x s scores, so it saves only the kernel's log-sum-exp (memory.activation_bytes_per_layer) and costs a
recomputation; a pinned --checkpointing selective is still planned, with the memory it really uses."""
TIE = 1.02
"""Plans within 2% of the fastest are ties (planner.rank breaks them by the practitioners' order)."""
MAX_MICRO_BATCH = 64
LONG_CONTEXT = 16384
"""Sequence length from which the search considers Ulysses sequence parallelism on its own."""
_T = TypeVar("_T")

SEARCHED = (
    "precision",
    "micro_batch",
    "zero",
    "offload",
    "offload_params",
    "pp",
    "tp",
    "sp",
    "ep",
    "checkpointing",
    "recompute_blocks",
)
"""The request's fields the search tries every value of when they are auto; every other field of the request is
handed to StrategySpec as asked (None: the spec's default)."""
BATCH_RULE = 4
"""plan.check_rules' batch-divisibility rule: the only one that depends on the micro-batch."""


@dataclass(frozen=True)
class Candidate:
    """One evaluated strategy."""

    strategy: StrategySpec
    train: TrainSpec
    plan: Plan
    est: Estimate
    tokens_per_s: float
    mfu: float

    @property
    def family(self) -> str:
        s = self.strategy
        off = (
            ""
            if s.offload == Offload.NONE
            else f" + {s.offload} offload" + (" (params too)" if s.offload_params else "")
        )
        return f"ZeRO-{s.zero}{off}"

    def describe(self, *, every_axis: bool = False) -> str:
        """One line: family, precision, parallel sizes (tp and sp only when > 1 unless `every_axis`), batch split,
        recomputation."""
        p = self.plan
        extra = "".join(f", {k} {v}" for k, v in ((Axis.TP, p.tp), (Axis.SP, p.sp)) if v > 1 or every_axis)
        extra += f", ep {p.ep}" if p.experts or p.ep > 1 else ""  # a mixture of experts always names its ep
        return (
            f"{self.family}, {p.precision}, pp {p.pp}{extra}, dp {p.dp}, micro {p.micro_batch} x ga {p.grad_accum}"
            f", recompute {p.recomputation}"
        )


@dataclass
class Enumerated:
    """What enumerate_candidates found."""

    candidates: list[Candidate]
    errors: list[SpecError]
    """Every refusal, in the order met."""
    tp_list: list[int]
    sp_list: list[int]
    by_family: dict[str, dict[int, str]] = field(default_factory=dict)
    """family -> {rule number: message} of its refused strategies (also by_tp, by_sp: tp / sp size -> ...)."""
    by_tp: dict[int, dict[int, str]] = field(default_factory=dict)
    by_sp: dict[int, dict[int, str]] = field(default_factory=dict)
    by_ep: dict[int, dict[int, str]] = field(default_factory=dict)
    by_pp: dict[int, dict[int, str]] = field(default_factory=dict)
    ep_list: list[int] = field(default_factory=list)
    """Every ep the search tried (a mixture of experts: divisors of gcd(experts, dp) over the layouts tried)."""


def options(value: _T | None, choices: Iterable[_T]) -> list[_T]:
    """[value] when the request fixes it, else every choice."""
    return list(choices) if value is None or value == AUTO else [value]


def divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def tp_choices(model: ModelSpec, cluster: ClusterSpec) -> list[int]:
    """Tensor-parallel sizes the search tries: divisors of the GPUs per node (tp stays inside a node) that divide the
    heads, the key/value heads and the MLP width (plan.check_rules)."""
    return [
        t
        for t in divisors(cluster.gpus_per_node, cluster.gpus_per_node)
        if model.heads % t == 0 and model.kv_groups % t == 0 and model.ffn % t == 0
    ]


def sp_choices(model: ModelSpec, cluster: ClusterSpec) -> list[int]:
    """Sequence-parallel sizes the search tries: 1, and from LONG_CONTEXT tokens on the divisors of the GPUs per node
    that divide the heads and the sequence length (Ulysses' all-to-alls stay on NVLink)."""
    if model.seq_len < LONG_CONTEXT:
        return [1]
    return [
        s
        for s in divisors(cluster.gpus_per_node, cluster.gpus_per_node)
        if model.heads % s == 0 and model.seq_len % s == 0
    ]


def ep_choices(model: ModelSpec, dp: int, tp: int = 1) -> list[int]:
    """Expert-parallel sizes the search tries for `dp` data-parallel ranks: the divisors of gcd(experts, dp) (ep
    divides both: plan.check_rules); at tp > 1, 1 and tp x k (the experts spread over k whole tp groups, k
    dividing dp and experts / tp); 1 for a dense model."""
    if not model.experts:
        return [1]
    if tp > 1:
        if model.experts % tp:
            return [1]
        return [1] + [tp * k for k in divisors(math.gcd(model.experts // tp, dp), model.experts)]
    return divisors(math.gcd(model.experts, dp), model.experts)


def pinned_blocks(request: StrategyRequest) -> int:
    """The request's recompute_blocks when it gives one, else 0 (every block; the search may try fewer)."""
    return 0 if is_auto(request.recompute_blocks) else int(request.recompute_blocks or 0)


def rule_of(error: SpecError) -> int:
    """The number of the rule that refused (0: the strategy itself was invalid)."""
    return error.rule if isinstance(error, RuleError) else 0


def _batch_options(
    *, world: int, pp: int, tp: int, sp: int, train: TrainSpec, micro_batch: int | None
) -> tuple[int, list[int]]:
    """(dp, micro-batches to try) of a pp x tp x sp layout of `world` ranks; dp 1 for an invalid one."""
    # an invalid pp/tp/sp is rejected by StrategySpec / the rules; dp 1 keeps the micro-batch list finite
    valid = (
        all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (pp, tp, sp))
        and world % (pp * tp * sp) == 0
    )
    dp = ParallelLayout(world=world, pp=pp, tp=tp, sp=sp).dp if valid else 1
    micro = options(
        micro_batch, divisors(train.global_batch // dp, MAX_MICRO_BATCH) if train.global_batch % dp == 0 else [1]
    )
    return dp, micro


def _note_refusal(
    found: Enumerated, error: SpecError, *, zero: int, offload: str, pp: int, tp: int, sp: int, ep: int
) -> int:
    """Record a refused strategy's error in `found` (in the order met, by family and by axis); the refusing rule."""
    found.errors.append(error)
    rule = rule_of(error)
    family = f"ZeRO-{zero}" + ("" if offload == Offload.NONE else f" + {offload} offload")
    found.by_family.setdefault(family, {}).setdefault(rule, str(error))
    for table, key in ((found.by_tp, tp), (found.by_sp, sp), (found.by_ep, ep), (found.by_pp, pp)):
        table.setdefault(key, {}).setdefault(rule, str(error))
    return rule


def _search_space(
    r: StrategyRequest, *, precisions: list[str], offloads: list[str], pps: list[int], tps: list[int], sps: list[int]
) -> Iterator[tuple[str, int, str, bool, int, int, int, str]]:
    """Every (precision, zero, offload, offload_params, pp, tp, sp, checkpointing) the search tries, in its order."""
    return itertools.product(
        precisions,
        options(r.zero, [0, 1, 2, 3]),
        offloads,
        options(r.offload_params, [False, True]),
        pps,
        tps,
        sps,
        options(r.checkpointing, AUTO_CHECKPOINTING if pinned_blocks(r) == 0 else [Checkpointing.FULL.value]),
    )


def _strategy(
    structure: tuple[str, int, str, bool, int, int, int, int],
    *,
    checkpointing: str,
    recompute_blocks: int = 0,
    as_asked: dict[str, Any],
) -> StrategySpec:
    """The StrategySpec of a searched (precision, zero, offload, offload_params, pp, tp, sp, ep) and recomputation,
    with the request's other fields as asked."""
    _, zero, offload, offload_params, pp, tp, sp, ep = structure
    return StrategySpec(
        zero=zero,
        offload=offload,
        offload_params=offload_params,
        pp=pp,
        tp=tp,
        sp=sp,
        ep=ep,
        checkpointing=checkpointing,
        recompute_blocks=recompute_blocks,
        **as_asked,
    )


def enumerate_candidates(
    *,
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    request: StrategyRequest,
    headroom: float,
    import_bytes: int | None,
) -> Enumerated:
    """Plan and estimate every strategy the request leaves open; a strategy a rule refuses whatever its micro-batch
    and recomputation is tried once."""
    world = cluster.world_size
    r = request
    precision = options(r.precision, ["fp32"] if cluster.gpu == "cpu" else ["bf16"])
    offloads = options(r.offload, ["none", "cpu"] + (["nvme"] if r.nvme_path else []))
    pps = options(r.pp, divisors(world, model.layers))
    found = Enumerated(
        candidates=[],
        errors=[],
        tp_list=options(r.tp, tp_choices(model, cluster)),
        sp_list=options(r.sp, sp_choices(model, cluster)),
    )
    as_asked = {
        f.name: v for f in fields(StrategyRequest) if f.name not in SEARCHED and (v := getattr(r, f.name)) is not None
    }
    # strategies a rule refuses whatever the micro-batch and recomputation: tried once
    refused: set[tuple[str, int, str, bool, int, int, int, int]] = set()
    trains: dict[tuple[str, int], TrainSpec] = {}  # (precision, micro-batch) -> TrainSpec, validated once
    space = _search_space(r, precisions=precision, offloads=offloads, pps=pps, tps=found.tp_list, sps=found.sp_list)
    cost = _Costing(model=model, cluster=cluster, headroom=headroom, import_bytes=import_bytes)
    blocks = pinned_blocks(r)
    # the fewest blocks that fit are tried where the search chooses the recomputation too: a --checkpointing full
    # the user gives recomputes every block (Megatron's --recompute-granularity full) unless --recompute-blocks says
    searched_blocks = is_auto(r.recompute_blocks) and is_auto(r.checkpointing)
    # (structure, micro-batch) -> its plan without recomputation (tried before full: AUTO_CHECKPOINTING's order)
    unrecomputed: dict[tuple[tuple[str, int, str, bool, int, int, int, int], int], Candidate] = {}
    partial: list[tuple[Candidate, Candidate | None]] = []  # fitting full recomputation of every block
    for prec, zero, offload, offload_params, pp, tp, sp, ckpt in space:
        dp, micro = _batch_options(world=world, pp=pp, tp=tp, sp=sp, train=train, micro_batch=r.micro_batch)
        for ep in options(r.ep, ep_choices(model, dp, tp)):
            if ep not in found.ep_list:
                found.ep_list.append(ep)
            structure = (prec, zero, offload, offload_params, pp, tp, sp, ep)
            if structure in refused:
                continue
            for mb in micro:
                try:
                    strategy = _strategy(structure, checkpointing=ckpt, recompute_blocks=blocks, as_asked=as_asked)
                    t = trains.get((prec, mb))
                    if t is None:
                        t = trains[prec, mb] = replace(train, precision=prec, micro_batch=mb)
                    plan = make_plan(model=model, cluster=cluster, train=t, strategy=strategy)
                except SpecError as e:
                    if _note_refusal(found, e, zero=zero, offload=offload, pp=pp, tp=tp, sp=sp, ep=ep) == BATCH_RULE:
                        continue
                    refused.add(structure)  # no other rule reads the micro-batch or the recomputation
                    break
                found.candidates.append(c := cost.candidate(strategy, t, plan))
                if ckpt == Checkpointing.NONE:
                    unrecomputed[structure, mb] = c
                elif ckpt == Checkpointing.FULL and searched_blocks and c.est.fits:
                    partial.append((c, unrecomputed.get((structure, mb))))
    found.candidates += _partial_recomputation(partial, fitting=found.candidates, cost=cost)
    return found


def _partial_recomputation(
    pending: list[tuple[Candidate, Candidate | None]], *, fitting: list[Candidate], cost: _Costing
) -> list[Candidate]:
    """For each fitting plan that recomputes every block, the one that recomputes the fewest blocks per stage and
    still fits (_fewest_recomputed), where it can matter: not where the same plan fits without recomputation
    (faster still), and not where even that plan (its step time bounds any partial recomputation's from below) is
    more than TIE slower than the fastest plan found; the most promising first."""
    best = min((c.est.step_time_s for c in fitting if c.est.fits), default=math.inf)
    out = []
    bound = {id(whole): (none.est.step_time_s if none is not None else 0.0) for whole, none in pending}
    for whole, none in sorted(pending, key=lambda p: bound[id(p[0])]):
        if none is not None and none.est.fits:
            continue
        if bound[id(whole)] > best * TIE:
            break
        fewest = _fewest_recomputed(whole, cost=cost)
        if fewest is not None:
            out.append(fewest)
            best = min(best, fewest.est.step_time_s)
    return out


@dataclass(frozen=True)
class _Costing:
    """What estimating a plan needs beside it."""

    model: ModelSpec
    cluster: ClusterSpec
    headroom: float
    import_bytes: int | None

    def candidate(self, strategy: StrategySpec, train: TrainSpec, plan: Plan) -> Candidate:
        est = estimate(
            model=self.model, cluster=self.cluster, plan=plan, headroom=self.headroom, import_bytes=self.import_bytes
        )
        tokens_per_s, mfu = throughput(est=est, model=self.model, cluster=self.cluster, plan=plan)
        return Candidate(strategy, train, plan, est, tokens_per_s, mfu)


def _fewest_recomputed(whole: Candidate, *, cost: _Costing) -> Candidate | None:
    """Of full recomputation that fits recomputing every block (`whole`), the plan that recomputes the fewest blocks
    per stage and still fits (Megatron's block method: its step recomputes less); None when only every block fits.
    Found by bisection on the stages' memory alone: it only grows as fewer blocks are recomputed, and nothing else
    that decides the fit (the host's, the start-up's) depends on it."""
    p = whole.plan
    most = max(stage_blocks(model=cost.model, pp=p.pp, partition_method=p.partition_method, tp=p.tp))
    usable = whole.est.usable_gpu_memory_bytes

    def fits(n: int) -> bool:
        plan = replace(whole.plan, recompute_blocks=n)
        return stage_memory(model=cost.model, cluster=cost.cluster, plan=plan)[0].total <= usable

    low, high, fewest = 1, most - 1, None  # most: every block, which `whole` is
    while low <= high:
        mid = (low + high) // 2
        if fits(mid):
            fewest, high = mid, mid - 1
        else:
            low = mid + 1
    if fewest is None:
        return None
    strategy = replace(whole.strategy, recompute_blocks=fewest)
    return cost.candidate(strategy, whole.train, replace(whole.plan, recompute_blocks=fewest))
