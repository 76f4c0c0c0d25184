"""Choose a strategy: every valid ZeRO x offload x pp x tp x sp x recomputation x micro-batch, estimated and ranked.
No torch."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from dspipe.errors import SpecError
from dspipe.spec.layout import ParallelLayout
from dspipe.planner.estimate import GIB, MEMORY_HEADROOM, Estimate, estimate, throughput
from dspipe.planner.plan import Plan, check_rules, make_plan
from dspipe.spec.core import ClusterSpec, ModelSpec, StrategySpec, TrainSpec
from dspipe.planner.startup import size_text

AUTO = "auto"
AUTO_CHECKPOINTING = ("none", "full")
"""Recomputation the search chooses from. Not selective: with SDPA's fused kernels the attention core it recomputes
keeps no s x s scores, so it saves only the kernel's log-sum-exp (estimate.activation_bytes_per_layer) and costs a
recomputation; a pinned --checkpointing selective is still planned, with the memory it really uses."""
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

    def describe(self, *, every_axis: bool = False) -> str:
        """One line: family, precision, parallel sizes (tp and sp only when > 1 unless `every_axis`), batch split,
        recomputation."""
        p = self.plan
        extra = "".join(f", {k} {v}" for k, v in (("tp", p.tp), ("sp", p.sp)) if v > 1 or every_axis)
        return (f"{self.family}, {p.precision}, pp {p.pp}{extra}, dp {p.dp}, micro {p.micro_batch} x ga {p.grad_accum}, "
                f"recompute {p.checkpointing}")


@dataclass(frozen=True)
class SearchResult:
    best: Candidate | None
    ranked: list[Candidate]
    """Fitting candidates, fastest first."""
    closest: Candidate | None
    """When nothing fits: the candidate with the smallest memory shortfall."""
    rejected: dict[str, str]
    """One line per strategy family (and per tp / sp size) that was not chosen, saying why."""
    evaluated: int
    tie: str = ""
    """When several plans tied (within 2% of the fastest): how many, and why the tie-break chose this one."""


ROOMY = 0.80
"""Fraction of the GPU's memory above which a plan loses every tie to one that stays under it: allocator
fragmentation and what the model does not count bite first near the edge."""
_PREFERENCE_WHY = ("the roomier plan", "bf16 before fp16 before fp32", "the lower ZeRO stage", "no offload",
                   "optimizer-only offload", "less recomputation", "fewer pipeline stages", "less tensor parallelism",
                   "less sequence parallelism", "the larger micro-batch (up to 4,096 tokens per micro-batch)",
                   "the smaller memory footprint")
GEMM_TOKENS = 4096
"""Tokens per micro-batch (the M of every weight GEMM) below which a larger micro-batch is preferred among ties:
the time model does not charge small matrix multiplies their lower efficiency; beyond it the smaller memory wins."""


def _preference(c: Candidate) -> tuple:
    """The tie-break among plans within 2% of the fastest: the seed recipe (bf16, lowest ZeRO stage, no offload,
    less recomputation (full is the only kind it chooses), fewer pipeline stages, less tensor then sequence parallelism), then a
    larger micro-batch while it has fewer than GEMM_TOKENS tokens, then the smaller memory footprint (a roomier plan
    over one near the edge of the GPU's memory). Before all of these: a plan over ROOMY of the GPU's memory loses to
    one under it."""
    ckpt = {"none": 0, "selective": 1, "full": 2}[c.plan.checkpointing]
    seq_len = c.plan.tokens_per_step // c.plan.global_batch
    return (c.est.memory.total > ROOMY * c.est.gpu_memory_bytes, _PREC_ORDER[c.plan.precision], c.plan.zero_stage,
            _OFFLOAD_ORDER[c.plan.offload], c.plan.offload_params,
            ckpt, c.plan.pp, c.plan.tp, c.plan.sp, -min(c.plan.micro_batch * seq_len, GEMM_TOKENS),
            c.est.memory.total)


def _tie_reason(winner: Candidate, loser: Candidate) -> str:
    """Why the tie-break put `winner` before `loser`: the first preference they differ on."""
    for why, a, b in zip(_PREFERENCE_WHY, _preference(winner), _preference(loser)):
        if a != b:
            if why == "the roomier plan":
                return (f"{why} ({winner.est.memory.total / winner.est.gpu_memory_bytes:.0%} vs "
                        f"{loser.est.memory.total / loser.est.gpu_memory_bytes:.0%} of GPU memory; over "
                        f"{ROOMY:.0%} loses ties)")
            if why == "the smaller memory footprint":
                return f"{why} ({winner.est.memory.total / GIB:.1f} vs {loser.est.memory.total / GIB:.1f} GiB)"
            return why
    return "the search order"


def _options(value, choices):
    return list(choices) if value in (None, AUTO) else [value]


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


LONG_CONTEXT = 16384
"""Sequence length from which the search considers Ulysses sequence parallelism on its own."""


def tp_choices(model: ModelSpec, cluster: ClusterSpec) -> list[int]:
    """Tensor-parallel sizes the search tries: divisors of the GPUs per node (tp stays inside a node) that divide the
    heads and the MLP width."""
    return [t for t in _divisors(cluster.gpus_per_node, cluster.gpus_per_node)
            if model.heads % t == 0 and model.ffn % t == 0]


def sp_choices(model: ModelSpec, cluster: ClusterSpec) -> list[int]:
    """Sequence-parallel sizes the search tries: 1, and from LONG_CONTEXT tokens on the divisors of the GPUs per node
    that divide the heads and the sequence length (Ulysses' all-to-alls stay on NVLink)."""
    if model.seq_len < LONG_CONTEXT:
        return [1]
    return [s for s in _divisors(cluster.gpus_per_node, cluster.gpus_per_node)
            if model.heads % s == 0 and model.seq_len % s == 0]


def search(*, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, fixed: dict,
           headroom: float | None = None, import_bytes: int | None = None) -> SearchResult:
    """`fixed` maps zero/offload/offload_params/nvme_path/pp/tp/sp/checkpointing/partition_method/precision/micro_batch
    to a value, or to None/'auto' to let the search choose. A plan fits when its peak is at most (1 - headroom) of
    the GPU's memory (default estimate.MEMORY_HEADROOM) and its start-up fits the node's host RAM (Estimate.fits).
    `import_bytes`: bytes of the --init-from checkpoint's tensors (the start-up reads them instead of drawing)."""
    headroom = MEMORY_HEADROOM if headroom is None else headroom
    world = cluster.world_size
    precision = _options(fixed.get("precision"), ["fp32"] if cluster.gpu == "cpu" else ["bf16"])
    offloads = _options(fixed.get("offload"), ["none", "cpu"] + (["nvme"] if fixed.get("nvme_path") else []))
    pps = _options(fixed.get("pp"), _divisors(world, model.layers))
    tp_list = _options(fixed.get("tp"), tp_choices(model, cluster))
    sp_list = _options(fixed.get("sp"), sp_choices(model, cluster))
    candidates, errors = [], []
    by_family, by_tp, by_sp = {}, {}, {}  # family / tp / sp -> {rule number: message}
    refused = set()  # strategies a rule refuses whatever the micro-batch and recomputation: tried once
    trains = {}  # (precision, micro-batch) -> TrainSpec, validated once
    for prec, zero, offload, offload_params, pp, tp, sp, ckpt in itertools.product(
            precision, _options(fixed.get("zero"), [0, 1, 2, 3]), offloads,
            _options(fixed.get("offload_params"), [False, True]), pps, tp_list, sp_list,
            _options(fixed.get("checkpointing"), AUTO_CHECKPOINTING)):
        # an invalid pp/tp/sp is rejected by StrategySpec / the rules below; dp 1 keeps the micro-batch list finite
        sizes = (pp, tp, sp)
        valid = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes) \
            and world % (pp * tp * sp) == 0
        dp = ParallelLayout(world=world, pp=pp, tp=tp, sp=sp).dp if valid else 1
        micro = _options(fixed.get("micro_batch"), _divisors(train.global_batch // dp, MAX_MICRO_BATCH)
                         if train.global_batch % dp == 0 else [1])
        structure = (prec, zero, offload, offload_params, pp, tp, sp)
        if structure in refused:
            continue
        for mb in micro:
            try:
                strategy = StrategySpec(zero=zero, offload=offload, offload_params=offload_params,
                                        nvme_path=fixed.get("nvme_path"), pp=pp, tp=tp, sp=sp, checkpointing=ckpt,
                                        partition_method=fixed.get("partition_method") or "parameters",
                                        reduce_bucket_size=fixed.get("reduce_bucket_size"),
                                        prefetch_bucket_size=fixed.get("prefetch_bucket_size"),
                                        param_persistence_threshold=fixed.get("param_persistence_threshold"),
                                        max_live_parameters=fixed.get("max_live_parameters"),
                                        max_reuse_distance=fixed.get("max_reuse_distance"))
                t = trains.get((prec, mb))
                if t is None:
                    t = trains[prec, mb] = replace(train, precision=prec, micro_batch=mb)
                plan = make_plan(model=model, cluster=cluster, train=t, strategy=strategy)
            except SpecError as e:
                errors.append(e)
                rule = getattr(e, "rule", 0)
                family = f"ZeRO-{zero}" + ("" if offload == "none" else f" + {offload} offload")
                for table, key in ((by_family, family), (by_tp, tp), (by_sp, sp)):
                    table.setdefault(key, {}).setdefault(rule, str(e))
                if rule == _BATCH_RULE:
                    continue
                refused.add(structure)  # no other rule reads the micro-batch or the recomputation
                break
            est = estimate(model=model, cluster=cluster, plan=plan, headroom=headroom, import_bytes=import_bytes)
            tokens_per_s, mfu = throughput(est=est, model=model, cluster=cluster, plan=plan)
            candidates.append(Candidate(strategy, t, plan, est, tokens_per_s, mfu))
    if not candidates:
        raise max(errors, key=lambda e: getattr(e, "rule", 0))  # the one that got furthest through the rules
    fitting = sorted((c for c in candidates if c.est.fits), key=lambda c: c.est.step_time_s)
    best, tie = None, ""
    if fitting:
        fastest = fitting[0]
        ties = [c for c in fitting if c.est.step_time_s <= fastest.est.step_time_s * TIE]
        best = min(ties, key=_preference)
        if len(ties) > 1:
            recipe = min(ties, key=lambda c: _preference(c)[1:])  # what the order alone would pick
            other = recipe if recipe is not best else min((c for c in ties if c is not best), key=_preference)
            behind = best.est.step_time_s / fastest.est.step_time_s - 1
            tie = (f"{len(ties)} plans within {(TIE - 1) * 100:.0f}% of the fastest ({fastest.est.step_time_s:.3g} "
                   f"s/step){f', this one {behind * 100:.1f}% slower' if behind > 0 else ''}; the tie-break (under "
                   f"{ROOMY:.0%} of GPU memory first, the recipe's order, the larger micro-batch up to "
                   f"{GEMM_TOKENS:,} tokens, then the smaller memory) "
                   f"preferred it for {_tie_reason(best, other)} over "
                   f"{other.describe()}")
        fitting.remove(best)
        fitting.insert(0, best)
    rejected = {}
    families = sorted({c.family for c in candidates})
    for family in families:
        if best is not None and family == best.family:
            continue
        rejected[family] = _why_not(best, [c for c in candidates if c.family == family])
    for family, rules in by_family.items():
        if family not in families:
            rejected[family] = _rules_text(rules)
    for label, values, table, attr, chosen in (("tp", tp_list, by_tp, "tp", best and best.plan.tp),
                                               ("sp", sp_list, by_sp, "sp", best and best.plan.sp)):
        if len(values) < 2 and fixed.get(attr) in (None, AUTO):
            continue  # nothing was chosen along this axis
        for v in values:
            if v == chosen:
                continue
            members = [c for c in candidates if getattr(c.plan, attr) == v]
            rejected[f"{label} {v}"] = _why_not(best, members) if members else _rules_text(table.get(v, {}))
    if fixed.get("tp") in (None, AUTO):
        for t in _divisors(cluster.gpus_per_node, cluster.gpus_per_node):
            if t not in tp_list:  # never tried: say which rule rules it out
                rejected[f"tp {t}"] = "not considered: " + _tp_refusal(model, cluster, train, t)
    closest = None if best else min(candidates, key=_over)
    return SearchResult(best=best, ranked=fitting, closest=closest, rejected=rejected, evaluated=len(candidates),
                        tie=tie)


_BATCH_RULE = 4
"""plan.check_rules' batch-divisibility rule: the only one that depends on the micro-batch."""


def _why_not(best: Candidate | None, members: list[Candidate]) -> str:
    """One line: how the quickest fitting member compares with the chosen plan, or its smallest shortfall."""
    fits = [c for c in members if c.est.fits]
    if fits:
        quickest = min(fits, key=lambda c: c.est.step_time_s)
        slower = quickest.est.step_time_s / best.est.step_time_s - 1
        if quickest.est.step_time_s <= best.est.step_time_s * TIE:  # lost the tie-break, not the race
            pace = f"faster by {-slower * 100:.1f}%" if slower < 0 else f"slower by {slower * 100:.1f}%"
            return (f"{pace} at best, a tie (within {(TIE - 1) * 100:.0f}%) that went to "
                    f"{_tie_reason(best, quickest)} ({quickest.describe()})")
        return f"slower by {slower * 100:.0f}% at best ({quickest.describe()})"
    near = min(members, key=_over)
    return f"does not fit: {_shortfall_text(near)} at best ({near.describe()})"


def _rules_text(rules: dict) -> str:
    """The rule that got furthest (the highest-numbered one: every earlier rule held for that combination)."""
    if not rules:
        return "violates DeepSpeed's rules"
    return "violates DeepSpeed's rules: " + rules[max(rules)]


def _tp_refusal(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, tp: int) -> str:
    """The rule that rules tp out whatever the rest of the strategy (its message from plan.check_rules)."""
    try:
        check_rules(model=model, cluster=cluster, train=replace(train, micro_batch=1),
                    strategy=StrategySpec(zero=1, tp=tp))
    except SpecError as e:
        return str(e)
    return f"tp {tp} does not divide the heads {model.heads} and ffn {model.ffn}"


def _over(c: Candidate) -> float:
    """How far a candidate is from fitting: GPU bytes over the usable memory (in the step or while building) plus
    host bytes over capacity (the start-up's host peak includes the offload's)."""
    e = c.est
    return (max(e.shortfall_bytes, e.startup_device_shortfall_bytes)
            + max(e.startup_host_shortfall_bytes, e.host_memory_bytes - e.host_memory_capacity, 0))


def startup_shortfall_text(e: Estimate) -> str:
    """'start-up needs 1,056 GiB host RAM per node (8 ranks x 132 GiB: the whole model in bf16 on the host for
    AutoTP), has 512 GiB'; '' when the start-up's host RAM fits."""
    s = e.startup
    if s is None or not e.startup_host_shortfall_bytes:
        return ""
    return (f"start-up needs {size_text(s.host_per_node_bytes)} host RAM per node ({s.ranks_per_node} ranks x "
            f"{size_text(s.host_per_rank_bytes)}: {s.holds()}), has {size_text(e.host_memory_capacity)}")


def _shortfall_text(c: Candidate) -> str:
    e = c.est
    parts = []
    if e.shortfall_bytes:
        parts.append(f"needs {e.memory.total / GIB:.1f} GiB per GPU, may use {e.usable_gpu_memory_bytes / GIB:.1f} "
                     f"of {e.gpu_memory_bytes / GIB:.1f} ({e.headroom * 100:.0f}% headroom; short by "
                     f"{e.shortfall_bytes / GIB:.1f} GiB)")
    if e.startup_device_shortfall_bytes and not e.shortfall_bytes:  # else the step's own shortfall says it
        parts.append(f"start-up needs {size_text(e.startup.device_bytes)} per GPU while building "
                     f"({e.startup.mode} build), may use {size_text(e.usable_gpu_memory_bytes)}")
    if e.startup_host_shortfall_bytes and e.startup.build_dominates:
        parts.append(startup_shortfall_text(e))
    elif e.host_memory_bytes > e.host_memory_capacity or e.startup_host_shortfall_bytes:  # the offload's own peak
        parts.append(f"needs {max(e.host_memory_bytes, e.startup.host_per_node_bytes if e.startup else 0) / GIB:.0f} "
                     f"GiB host RAM per node, has {e.host_memory_capacity / GIB:.0f}")
    return "; ".join(parts)


def nothing_fits_message(*, result: SearchResult, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec,
                         fixed: dict, headroom: float | None = None, import_bytes: int | None = None) -> str:
    """One line: the smallest shortfall and what would make it fit (more GPUs, offload, NVMe; when the start-up's
    host RAM is short, a pinned tp / pp / ZeRO stage left to the planner, or nodes with the RAM the start-up needs),
    each re-searched."""
    c = result.closest
    tries = [(f"{cluster.nodes * k} nodes x {cluster.gpus_per_node}", replace(cluster, nodes=cluster.nodes * k), fixed)
             for k in (2, 4, 8, 16, 32, 64)]
    if fixed.get("offload") == "none":
        tries.insert(0, ("--offload cpu", cluster, {**fixed, "offload": "cpu", "offload_params": None}))
    if not fixed.get("nvme_path"):
        tries.insert(1, ("--offload nvme --nvme-path DIR", cluster,
                         {**fixed, "offload": "nvme", "offload_params": None, "nvme_path": "/nvme"}))
    if c.est.startup_host_shortfall_bytes:  # the build holds more than the node's RAM: another build mode may not
        pinned = [k for k in ("tp", "pp", "zero") if fixed.get(k) not in (None, AUTO)]
        relaxed = [(f"--{k} auto", cluster, {**fixed, k: None}) for k in pinned]
        if len(pinned) > 1:
            relaxed.append((" ".join(f"--{k} auto" for k in pinned), cluster, {**fixed, **{k: None for k in pinned}}))
        needed = math.ceil(c.est.startup.host_per_node_bytes / GIB)
        try:
            relaxed.append((f"{needed:,} GiB host RAM per node (--host-memory-gib)",
                            replace(cluster, host_memory_gib=float(needed)), fixed))
        except SpecError:  # beyond any --host-memory-gib
            pass
        tries[:0] = relaxed
    fixes = []
    for label, bigger, options in tries:
        try:
            r = search(model=model, cluster=bigger, train=train, fixed=options, headroom=headroom,
                       import_bytes=import_bytes)
        except SpecError:
            continue
        if r.best:
            fixes.append(f"{label} ({r.best.family})")
            if bigger.nodes != cluster.nodes:
                break
    return (f"nothing fits {model.name} on {cluster.world_size} x {cluster.gpu}: closest is {c.describe()}, which "
            f"{_shortfall_text(c)}; would fit with: {', or '.join(fixes) or 'nothing tried (64x the nodes)'}")
