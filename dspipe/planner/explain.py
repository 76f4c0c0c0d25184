"""Why not: one line per strategy family (and per tp / sp size) the search did not choose, and the shortfall of a
plan that does not fit. No torch."""

from __future__ import annotations

from dataclasses import replace

from dspipe.errors import SpecError
from dspipe.planner.cost import STEP_TERMS, Estimate
from dspipe.planner.enumerate import TIE, Candidate, Enumerated, divisors
from dspipe.planner.plan import check_rules
from dspipe.planner.rank import tie_reason
from dspipe.planner.startup import size_text
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.core import StrategyRequest
from dspipe.spec.hardware import GIB
from dspipe.spec.kinds import Axis
from dspipe.spec.model import ModelSpec
from dspipe.spec.settings import is_auto
from dspipe.spec.strategy import StrategySpec
from dspipe.spec.train import TrainSpec


def rejected(
    *,
    found: Enumerated,
    best: Candidate | None,
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    request: StrategyRequest,
) -> dict[str, str]:
    """family / 'tp N' / 'sp N' / 'ep N' (and a mixture of experts' 'pp N') -> why it was not chosen, for everything the
    search tried (or, for tp, ruled out)."""
    candidates = found.candidates
    out = {}
    families = sorted({c.family for c in candidates})
    for family in families:
        if best is not None and family == best.family:
            continue
        out[family] = why_not(best, [c for c in candidates if c.family == family])
    for family, rules in found.by_family.items():
        if family not in families:
            out[family] = rules_text(rules)
    axes = [
        (Axis.TP, found.tp_list, found.by_tp, best and best.plan.tp),
        (Axis.SP, found.sp_list, found.by_sp, best and best.plan.sp),
        (Axis.EP, found.ep_list, found.by_ep, best and best.plan.ep),
    ]
    for label, values, table, chosen in axes:
        if len(values) < 2 and is_auto(getattr(request, label)):
            continue  # nothing was chosen along this axis
        for v in values:
            if v == chosen:
                continue
            members = [c for c in candidates if getattr(c.plan, label) == v]
            out[f"{label} {v}"] = why_not(best, members) if members else rules_text(table.get(v, {}))
    if is_auto(request.tp):
        for t in divisors(cluster.gpus_per_node, cluster.gpus_per_node):
            if t not in found.tp_list:  # never tried: say which rule rules it out
                out[f"tp {t}"] = "not considered: " + tp_refusal(model, cluster, train, t)
    return out


def why_not(best: Candidate | None, members: list[Candidate]) -> str:
    """One line: how the quickest fitting member compares with the chosen plan, or its smallest shortfall."""
    fits = [c for c in members if c.est.fits]
    if fits:
        assert best is not None  # a plan fits: the search chose one
        quickest = min(fits, key=lambda c: c.est.step_time_s)
        slower = quickest.est.step_time_s / best.est.step_time_s - 1
        if quickest.est.step_time_s <= best.est.step_time_s * TIE:  # lost the tie-break, not the race
            pace = f"faster by {-slower * 100:.1f}%" if slower < 0 else f"slower by {slower * 100:.1f}%"
            return (
                f"{pace} at best, a tie (within {(TIE - 1) * 100:.0f}%) that went to "
                f"{tie_reason(best, quickest)} ({quickest.describe()})"
            )
        return f"slower by {slower * 100:.0f}% at best ({quickest.describe()}){widest_gap(best.est, quickest.est)}"
    near = min(members, key=over)
    return f"does not fit: {shortfall_text(near)} at best ({near.describe()})"


def widest_gap(best: Estimate, other: Estimate) -> str:
    """': its TERM X s against Y s': the step-time term by which `other` loses the most to `best` ('' if none)."""
    name, attr = max(STEP_TERMS, key=lambda t: getattr(other, t[1]) - getattr(best, t[1]))
    if getattr(other, attr) <= getattr(best, attr):
        return ""
    return f": its {name} {getattr(other, attr):.3g} s against {getattr(best, attr):.3g} s"


def rules_text(rules: dict[int, str]) -> str:
    """The rule that got furthest (the highest-numbered one: every earlier rule held for that combination)."""
    if not rules:
        return "violates DeepSpeed's rules"
    return "violates DeepSpeed's rules: " + rules[max(rules)]


def tp_refusal(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, tp: int) -> str:
    """The rule that rules tp out whatever the rest of the strategy (its message from plan.check_rules)."""
    try:
        check_rules(
            model=model, cluster=cluster, train=replace(train, micro_batch=1), strategy=StrategySpec(zero=1, tp=tp)
        )
    except SpecError as e:
        return str(e)
    return f"tp {tp} does not divide the heads {model.heads}, kv_heads {model.kv_groups} and ffn {model.ffn}"


def over(c: Candidate) -> float:
    """How far a candidate is from fitting: GPU bytes over the usable memory (in the step or while building) plus
    host bytes over capacity (the start-up's host peak includes the offload's)."""
    e = c.est
    return max(e.shortfall_bytes, e.startup_device_shortfall_bytes) + max(
        e.startup_host_shortfall_bytes, e.host_memory_bytes - e.host_memory_capacity, 0
    )


def startup_shortfall_text(e: Estimate) -> str:
    """'start-up needs 2,154 GiB host RAM per node (8 ranks x 269 GiB: the stage's tp shard in fp32 on the host,
    one full tensor drawn at a time), has 2,048 GiB'; '' when the start-up's host RAM fits."""
    s = e.startup
    if s is None or not e.startup_host_shortfall_bytes:
        return ""
    return (
        f"start-up needs {size_text(s.host_per_node_bytes)} host RAM per node ({s.ranks_per_node} ranks x "
        f"{size_text(s.host_per_rank_bytes)}: {s.holds()}), has {size_text(e.host_memory_capacity)}"
    )


def shortfall_text(c: Candidate) -> str:
    e, s = c.est, c.est.startup
    parts = []
    if e.shortfall_bytes:
        parts.append(
            f"needs {e.memory.total / GIB:.1f} GiB per GPU, may use {e.usable_gpu_memory_bytes / GIB:.1f} "
            f"of {e.gpu_memory_bytes / GIB:.1f} ({e.headroom * 100:.0f}% headroom; short by "
            f"{e.shortfall_bytes / GIB:.1f} GiB)"
        )
    # (a start-up shortfall implies a start-up estimate: s is not None)
    if s is not None and e.startup_device_shortfall_bytes and not e.shortfall_bytes:  # else the step's says it
        parts.append(
            f"start-up needs {size_text(s.device_bytes)} per GPU while building "
            f"({s.mode} build), may use {size_text(e.usable_gpu_memory_bytes)}"
        )
    if s is not None and e.startup_host_shortfall_bytes and s.build_dominates:
        parts.append(startup_shortfall_text(e))
    elif e.host_memory_bytes > e.host_memory_capacity or e.startup_host_shortfall_bytes:  # the offload's own peak
        parts.append(
            f"needs {max(e.host_memory_bytes, e.startup.host_per_node_bytes if e.startup else 0) / GIB:.0f} "
            f"GiB host RAM per node, has {e.host_memory_capacity / GIB:.0f}"
        )
    return "; ".join(parts)
