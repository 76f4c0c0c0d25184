"""`dspipe calibrate --from-run RUN`: fold what a run measured into the profile it was planned with, so that the next
plan of this machine predicts what the run saw. Imports no torch.

Per term (dspipe.tools.run_terms), the run's measured / predicted ratio, against the plan the run was made with
(its run directory's profile, which may already carry corrections):

    compute,       the forward and backward phases (CPU ranks without a pipeline record them), each measured =
    communication  k_compute x its planned compute + k_communication x its planned collectives: solved for both
                   where the collectives are at least COMM_SIGNAL of the step; else the collectives as planned
                   and k_compute from the two phases together (communication unchanged). Without phases: the
                   whole step's ratio corrects the compute
    optimizer      the optimizer-step phase less its planned all-gather (ZeRO-1 / 2; at the communication's
                   ratio where solved), over the plan's optimizer and offload terms (where it has them)
    startup        the time to the first step's end (shown; its figures are replaced, not scaled)

A profile's correction per term is the geometric mean over the runs folded in of each run's total factor (the
correction it was planned with x its ratio): one run sets it, later runs average into it (Profile.runs counts them).
The start-up figures (launch, initialize, the first step's extra, each op compile) and a CPU rank's memory figures
(its RSS before the build, the allocator's factor) are the runs' own measurements, averaged the same way; a run
that compiled ops gives their compile time instead of its launch and initialize.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dspipe.errors import SpecError
from dspipe.planner.timing import recomputed_share
from dspipe.rundir import Run
from dspipe.runtime.engine_file import StartupRecord
from dspipe.spec.hardware import GIB, GPU_CATALOG, MIB
from dspipe.spec.profile import CORRECTION_TERMS, Profile, profile_from_dict, profile_to_dict
from dspipe.tools.run_terms import Term, phase_split, plan_terms, startup_record

COMM_SIGNAL = 0.10
"""The plan's collectives in the backward must be this share of its step for a run to correct them."""
RATIO_LIMITS = (0.05, 20.0)
"""A term's ratio outside this range is a broken measurement, not a correction (refused in one line)..."""
SMALL_SHARE = 0.05
"""...unless the term is under this share of the run's step: a few milliseconds of fixed overhead the plan does not
model move its ratio that far, so such a term is left unchanged (a note says so) instead of refusing the run."""


@dataclass(frozen=True)
class Folded:
    profile: Profile
    ratios: dict[str, float]
    """This run's measured / predicted per CORRECTION_TERMS term it could measure."""
    notes: list[str]
    """One line per term it could not correct, and why."""


def _find(terms: list[Term], prefix: str) -> Term | None:
    return next((t for t in terms if t.name.startswith(prefix) and t.ratio is not None), None)


def _compute_and_comm(
    forward: Term, backward: Term, split: dict[str, tuple[float, float]], *, step: float
) -> tuple[float, float | None]:
    """(compute ratio, communication ratio or None) from the forward and backward phases: the two equations
    measured = k_c x compute + k_m x communication, one per phase, solved where the plan's collectives are at least
    COMM_SIGNAL of its step; else the collectives taken as planned and k_c from both phases together."""
    (c_f, m_f), (c_b, m_b) = split["forward"], split["backward"]
    f, b = forward.measured, backward.measured
    det = c_f * m_b - c_b * m_f  # Cramer's rule; a near-singular pair (the phases split alike) cannot tell them apart
    if m_f + m_b >= COMM_SIGNAL * step and abs(det) > 0.05 * (c_f + c_b) * (m_f + m_b):
        k_c, k_m = (f * m_b - b * m_f) / det, (c_f * b - c_b * f) / det
        if k_c > 0 and k_m > 0:
            return k_c, k_m
    return (f + b - m_f - m_b) / (c_f + c_b), None


def run_ratios(
    terms: list[Term], *, breakdown: dict[str, float], split: dict[str, tuple[float, float]] | None = None
) -> tuple[dict[str, float], list[str]]:
    """(ratio per term, notes) of one run (the module docstring's rules); `split`: run_terms.phase_split."""
    ratios: dict[str, float] = {}
    notes: list[str] = []
    forward, backward, opt = _find(terms, "forward"), _find(terms, "backward"), _find(terms, "optimizer")
    step, first = _find(terms, "step time"), _find(terms, "time to first step")
    comm = sum(breakdown.get(k, 0.0) for k in ("dp_comm", "tp_comm", "sp_comm", "ep_comm"))
    k_m = None
    if forward is not None and backward is not None and split:
        ratios["compute"], k_m = _compute_and_comm(forward, backward, split, step=step.predicted if step else 0.0)
    elif step is not None:
        ratios["compute"] = step.ratio
        notes.append("compute: corrected by the whole step's ratio (the run did not record its phases)")
    if k_m is not None:
        ratios["communication"] = k_m
    else:
        notes.append(
            f"communication: unchanged (the plan's collectives, {comm:.3g} s, are under {COMM_SIGNAL:.0%} of its "
            f"step, or the run has no phases to tell them from the compute)"
        )
    if opt is not None:
        _optimizer_ratio(opt, (split or {}).get("optimizer"), k_m=k_m, ratios=ratios, notes=notes)
    else:
        notes.append("optimizer: unchanged (no optimizer term planned, or no phases recorded)")
    if first is not None:
        ratios["startup"] = first.ratio
    whole = step.measured if step is not None and step.measured else None
    for term, ratio in list(ratios.items()):
        if RATIO_LIMITS[0] <= ratio <= RATIO_LIMITS[1]:
            continue
        seconds = _measured_seconds(term, forward=forward, backward=backward, opt=opt)
        if whole is not None and seconds is not None and seconds < SMALL_SHARE * whole:
            del ratios[term]
            notes.append(
                f"{term}: unchanged (it ran {ratio:.3g}x its plan, outside [{RATIO_LIMITS[0]:g}, "
                f"{RATIO_LIMITS[1]:g}], but {seconds:.3g} s of the step's {whole:.3g} s: under {SMALL_SHARE:.0%}, too "
                f"small a share to correct by)"
            )
            continue
        raise SpecError(
            f"--from-run: the run's {term} ran {ratio:.3g}x its plan, outside [{RATIO_LIMITS[0]:g}, "
            f"{RATIO_LIMITS[1]:g}]: a broken measurement (another load on the machine?), not a correction"
        )
    return ratios, notes


def _optimizer_ratio(
    opt: Term, split: tuple[float, float] | None, *, k_m: float | None, ratios: dict, notes: list[str]
) -> None:
    """The optimizer's ratio into `ratios` (or a note): the phase less its planned all-gather, over the plan's
    optimizer and offload terms; the whole phase's ratio where the split has no such terms."""
    planned, gather = split if split else (opt.predicted, 0.0)
    if not planned:
        ratios["optimizer"] = opt.ratio
        return
    own = opt.measured - gather * (k_m or 1.0)
    if own <= 0:
        notes.append(
            f"optimizer: unchanged (the step's phase, {opt.measured:.3g} s, is within its planned parameter "
            f"all-gather's {gather * (k_m or 1.0):.3g} s)"
        )
        return
    ratios["optimizer"] = own / planned


def _measured_seconds(term: str, *, forward: Term | None, backward: Term | None, opt: Term | None) -> float | None:
    """The run's seconds per step behind a step term's ratio (None: a start-up term, or not measured)."""
    if term == "optimizer":
        return opt.measured if opt else None
    if term in ("compute", "communication") and forward is not None and backward is not None:
        return forward.measured + backward.measured
    return None


def _mean(old: float | None, new: float, runs: int) -> float:
    """The running mean of a figure measured by `runs` runs before (none: the new one alone)."""
    return new if old is None or runs == 0 else (old * runs + new) / (runs + 1)


def _startup_figures(base: Profile, record: StartupRecord, terms: list[Term], *, gpu) -> dict:
    """The profile's start-up figures with this run's folded in."""
    n, out = base.runs, {}
    fs_first, step = _find(terms, "first step ("), _find(terms, "step time")
    if fs_first is not None and step is not None:
        out["first_step_extra_s"] = _mean(base.first_step_extra_s, max(0.0, fs_first.measured - step.measured), n)
    if record.seconds_before_build is None:
        return out
    launch, initialize = max(record.seconds_before_build), record.seconds_initialize
    if not record.ops_built:
        out["launch_s"] = _mean(base.launch_s, launch, n)
        out["initialize_s"] = _mean(base.initialize_s, initialize, n)
        return out
    # a run that compiled ops: the compile is what its launch and initialize took beyond the figures without one
    compiled = max(0.0, launch + initialize - gpu.launch_s - gpu.initialize_s)
    shares = {op: gpu.jit_seconds(op) for op in record.ops_built}
    total = sum(shares.values()) or 1.0
    table = dict(base.jit_build_s or ())
    for op, share in shares.items():
        table[op] = _mean(table.get(op), compiled * share / total, n)
    out["jit_build_s"] = tuple(table.items())
    return out


def _memory_figures(base: Profile, record: StartupRecord, terms: list[Term], *, run: Run, gpu) -> dict:
    """A CPU rank's RSS figures with this run's folded in (nothing on a GPU)."""
    memory = next((t for t in terms if t.kind == "memory" and t.name.startswith("peak RSS")), None)
    counted = run.estimate.memory_total_bytes
    if memory is None or memory.measured is None or not counted:
        return {}
    before = record.rss_before_build_mib[0]  # rank 0's: the rank whose RSS metrics.csv records
    factor = (memory.measured * GIB - before * MIB - gpu.engine_rss_bytes) / counted
    return {
        "rank_base_rss_mib": _mean(base.rank_base_rss_mib, before, base.runs),
        "host_alloc_factor": _mean(base.host_alloc_factor, min(max(factor, 0.5), 20.0), base.runs),
    }


def fold(run: Run, *, engine: dict | None, steps: list[dict]) -> Folded:
    """The run's profile with the run folded in; one-line SpecError where the run cannot be folded."""
    base = run.cluster.profile
    if base is None:
        raise SpecError(
            f"--from-run {run.path}: the run was planned on the catalog's figures (no profile): nothing to fold "
            f"into; plan it on this machine (gen-config --measure auto, or --profile) and run it again"
        )
    if not steps:
        raise SpecError(f"--from-run {run.path}: metrics.csv has no steps yet")
    if not run.estimate.breakdown or not run.estimate.step_time_s:
        raise SpecError(
            f"--from-run {run.path}: dspipe.json's estimate has no step time and breakdown to compare the run with "
            f"(estimate.step_time_s, estimate.step_time_breakdown_s)"
        )
    record = None if engine is None else StartupRecord.from_engine(engine, source=f"--from-run {run.path}: engine.json")
    if record is None:
        raise SpecError(f"--from-run {run.path}: engine.json has no start-up record (not started, or an older runner)")
    terms = plan_terms(run, engine, steps)
    recomputed = recomputed_share(model=run.model, plan=run.plan)
    split = phase_split(run.estimate, recomputed=recomputed, zero_stage=run.plan.zero_stage)
    ratios, notes = run_ratios(terms, breakdown=run.estimate.breakdown, split=split)
    n = base.runs
    old = dict(base.corrections)
    corrections = {}
    for term in CORRECTION_TERMS:
        if term in ratios:
            total = old.get(term, 1.0) * ratios[term]
            corrections[term] = math.exp((n * math.log(old.get(term, 1.0)) + math.log(total)) / (n + 1))
        elif term in old:
            corrections[term] = old[term]
    gpu = run.cluster.gpu_type  # the figures the run was planned with (its profile applied)
    catalog = GPU_CATALOG[run.cluster.gpu]
    changes = {
        **_startup_figures(base, record, terms, gpu=gpu),
        **(_memory_figures(base, record, terms, run=run, gpu=catalog) if catalog.host_is_device else {}),
    }
    profile = replace(base, **changes, corrections=tuple(corrections.items()), runs=n + 1)
    # what is written must read back (a figure the run measured out of a profile's range is refused here, in one line)
    profile_from_dict(profile_to_dict(profile), where=f"--from-run {run.path}: the folded profile")
    return Folded(profile=profile, ratios=ratios, notes=notes)


def remaining(run: Run, folded: Profile, *, engine: dict | None, steps: list[dict]) -> list[Term]:
    """The run's terms against a plan of the same layout with the folded profile: what error is left."""
    from dspipe.planner.cost import estimate, throughput
    from dspipe.planner.enumerate import Candidate
    from dspipe.planner.summary import estimate_summary
    from dspipe.run_estimate import RunEstimate

    cluster = replace(run.cluster, profile=folded)
    est = estimate(model=run.model, cluster=cluster, plan=run.plan)
    record = startup_record(engine)
    est = est.with_ops(tuple(record.ops_built or ()) if record else (), gpu=cluster.gpu_type)
    tokens_per_s, mfu = throughput(est=est, model=run.model, cluster=cluster, plan=run.plan)
    c = Candidate(strategy=run.strategy, train=run.train, plan=run.plan, est=est, tokens_per_s=tokens_per_s, mfu=mfu)
    again = replace(run, estimate=RunEstimate(estimate_summary(c)), cluster=cluster)
    return [t for t in plan_terms(again, engine, steps) if t.kind != "startup" or t.name.startswith("time to")]
