"""Choose a strategy: every valid ZeRO x offload x pp x recomputation x micro-batch, estimated and ranked. No torch."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from dspipe.errors import SpecError
from dspipe.planner.layout import ParallelLayout
from dspipe.planner.estimate import GIB, Estimate, estimate, throughput
from dspipe.planner.plan import Plan, make_plan
from dspipe.planner.spec import ClusterSpec, ModelSpec, StrategySpec, TrainSpec

AUTO = "auto"
TIE = 1.02
"""Plans within 2% of the fastest are ties, broken by the practitioners' order."""
MAX_MICRO_BATCH = 64
_PREC_ORDER = {"bf16": 0, "fp16": 1, "fp32": 2}
_OFFLOAD_ORDER = {"none": 0, "cpu": 1, "nvme": 2}


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
        off = "" if s.offload == "none" else f" + {s.offload} offload" + (" (params too)" if s.offload_params else "")
        return f"ZeRO-{s.zero}{off}"

    def describe(self) -> str:
        p = self.plan
        return (f"{self.family}, {p.precision}, pp {p.pp}, dp {p.dp}, micro {p.micro_batch} x ga {p.grad_accum}, "
                f"recompute {p.checkpointing}")


@dataclass(frozen=True)
class SearchResult:
    best: Candidate | None
    ranked: list[Candidate]
    """Fitting candidates, fastest first."""
    closest: Candidate | None
    """When nothing fits: the candidate with the smallest memory shortfall."""
    rejected: dict[str, str]
    """One line per strategy family that was not chosen, saying why."""
    evaluated: int


def _preference(c: Candidate) -> tuple:
    """The seed recipe: bf16, lowest ZeRO stage, no offload, less recomputation (selective before full),
    fewer pipeline stages, larger micro-batches (fewer accumulation steps)."""
    ckpt = {"none": 0, "selective": 1, "full": 2}[c.plan.checkpointing]
    return (_PREC_ORDER[c.plan.precision], c.plan.zero_stage, _OFFLOAD_ORDER[c.plan.offload], c.plan.offload_params,
            ckpt, c.plan.pp, -c.plan.micro_batch)


def _options(value, choices):
    return list(choices) if value in (None, AUTO) else [value]


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def search(*, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, fixed: dict) -> SearchResult:
    """`fixed` maps zero/offload/offload_params/nvme_path/pp/checkpointing/partition_method/precision/micro_batch
    to a value, or to None/'auto' to let the search choose."""
    world = cluster.world_size
    precision = _options(fixed.get("precision"), ["fp32"] if cluster.gpu == "cpu" else ["bf16"])
    offloads = _options(fixed.get("offload"), ["none", "cpu"] + (["nvme"] if fixed.get("nvme_path") else []))
    pps = _options(fixed.get("pp"), _divisors(world, model.layers))
    candidates, errors, by_family = [], [], {}  # by_family: family -> {rule number: message}
    for prec, zero, offload, offload_params, pp, ckpt in itertools.product(
            precision, _options(fixed.get("zero"), [0, 1, 2, 3]), offloads,
            _options(fixed.get("offload_params"), [False, True]), pps,
            _options(fixed.get("checkpointing"), ["none", "selective", "full"])):
        # an invalid pp is rejected by StrategySpec / the rules below; dp 1 only keeps the micro-batch list finite
        dp = ParallelLayout(world=world, pp=pp).dp if isinstance(pp, int) and pp > 0 and world % pp == 0 else 1
        micro = _options(fixed.get("micro_batch"), _divisors(train.global_batch // dp, MAX_MICRO_BATCH)
                         if train.global_batch % dp == 0 else [1])
        for mb in micro:
            try:
                strategy = StrategySpec(zero=zero, offload=offload, offload_params=offload_params,
                                        nvme_path=fixed.get("nvme_path"), pp=pp, checkpointing=ckpt,
                                        partition_method=fixed.get("partition_method") or "parameters",
                                        reduce_bucket_size=fixed.get("reduce_bucket_size"),
                                        prefetch_bucket_size=fixed.get("prefetch_bucket_size"),
                                        param_persistence_threshold=fixed.get("param_persistence_threshold"))
                t = replace(train, precision=prec, micro_batch=mb)
                plan = make_plan(model=model, cluster=cluster, train=t, strategy=strategy)
            except SpecError as e:
                errors.append(e)
                family = f"ZeRO-{zero}" + ("" if offload == "none" else f" + {offload} offload")
                by_family.setdefault(family, {}).setdefault(getattr(e, "rule", 0), str(e))
                continue
            est = estimate(model=model, cluster=cluster, plan=plan)
            tps, mfu = throughput(est=est, model=model, cluster=cluster, plan=plan)
            candidates.append(Candidate(strategy, t, plan, est, tps, mfu))
    if not candidates:
        raise max(errors, key=lambda e: getattr(e, "rule", 0))  # the one that got furthest through the rules
    fitting = sorted((c for c in candidates if c.est.fits), key=lambda c: c.est.step_time_s)
    best = None
    if fitting:
        fastest = fitting[0].est.step_time_s
        best = min((c for c in fitting if c.est.step_time_s <= fastest * TIE), key=_preference)
        fitting.remove(best)
        fitting.insert(0, best)
    rejected = {}
    families = sorted({c.family for c in candidates})
    for family in families:
        members = [c for c in candidates if c.family == family]
        fits = [c for c in members if c.est.fits]
        if best is not None and family == best.family:
            continue
        if fits:
            quickest = min(fits, key=lambda c: c.est.step_time_s)
            slower = quickest.est.step_time_s / best.est.step_time_s - 1
            rejected[family] = f"slower by {slower * 100:.0f}% at best ({quickest.describe()})"
        else:
            near = min(members, key=_over)
            rejected[family] = f"does not fit: {_shortfall_text(near)} at best ({near.describe()})"
    for family, rules in by_family.items():
        if family not in families:
            rejected[family] = "violates DeepSpeed's rules: " + "; ".join(rules[k] for k in sorted(rules)[:2])
    closest = None if best else min(candidates, key=_over)
    return SearchResult(best=best, ranked=fitting, closest=closest, rejected=rejected, evaluated=len(candidates))


def _over(c: Candidate) -> float:
    """How far a candidate is from fitting: GPU bytes over capacity plus host bytes over capacity."""
    e = c.est
    return max(0, e.memory.total - e.gpu_memory_bytes) + max(0, e.host_memory_bytes - e.host_memory_capacity)


def _shortfall_text(c: Candidate) -> str:
    e = c.est
    parts = []
    if e.memory.total > e.gpu_memory_bytes:
        parts.append(f"needs {e.memory.total / GIB:.1f} GiB per GPU, has {e.gpu_memory_bytes / GIB:.1f} "
                     f"(short by {(e.memory.total - e.gpu_memory_bytes) / GIB:.1f} GiB)")
    if e.host_memory_bytes > e.host_memory_capacity:
        parts.append(f"needs {e.host_memory_bytes / GIB:.0f} GiB host RAM per node, has "
                     f"{e.host_memory_capacity / GIB:.0f}")
    return "; ".join(parts)


def nothing_fits_message(*, result: SearchResult, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec,
                         fixed: dict) -> str:
    """One line: the smallest shortfall and what would make it fit (more GPUs, offload, NVMe), each re-searched."""
    tries = [(f"{cluster.nodes * k} nodes x {cluster.gpus_per_node}", replace(cluster, nodes=cluster.nodes * k), fixed)
             for k in (2, 4, 8, 16, 32, 64)]
    if fixed.get("offload") == "none":
        tries.insert(0, ("--offload cpu", cluster, {**fixed, "offload": "cpu", "offload_params": None}))
    if not fixed.get("nvme_path"):
        tries.insert(1, ("--offload nvme --nvme-path DIR", cluster,
                         {**fixed, "offload": "nvme", "offload_params": None, "nvme_path": "/nvme"}))
    fixes = []
    for label, bigger, options in tries:
        try:
            r = search(model=model, cluster=bigger, train=train, fixed=options)
        except SpecError:
            continue
        if r.best:
            fixes.append(f"{label} ({r.best.family})")
            if bigger is not cluster:
                break
    c = result.closest
    return (f"nothing fits {model.name} on {cluster.world_size} x {cluster.gpu}: closest is {c.describe()}, which "
            f"{_shortfall_text(c)}; would fit with: {', or '.join(fixes) or 'nothing tried (64x the nodes)'}")
