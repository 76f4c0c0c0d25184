"""A run's plan against what it measured, term by term: the step's phases (forward, backward, optimizer step), the
start-up's (launch, build, initialize with any op compile, the first step) and a rank's peak memory. `dspipe report`
shows them with a verdict; `dspipe calibrate --from-run` folds them into a profile. Imports no torch.

Measured: metrics.csv (the medians of the steady steps: step_time_s, forward_s, backward_s, optimizer_s, which CPU
ranks without a pipeline record; the first row's step_time_s for the first step; the largest mem_allocated_gib,
a CPU rank's RSS) and engine.json's start-up (the slowest rank's seconds). Predicted: dspipe.json's estimate
(step_time_breakdown_s, first_step, rank_resident_bytes or memory_per_gpu_bytes.total).

The phases' predictions split the plan's terms as the engine spends them: forward = the compute's forward share
(1/3 of the FLOPs; 1/4 under full recomputation, whose backward re-runs the forward) plus a third of the synchronous
tp / sp / ep collectives; backward = the rest of the compute, the data-parallel collectives the plan leaves exposed
(ZeRO-3: half of them, its forward gathers the other half; ZeRO-1 / 2: less the parameters' all-gather, which the
engine's step issues) and two thirds of the synchronous ones; optimizer step = the optimizer and offload terms and
that all-gather (the estimate's dp_comm_after_step_s).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from dspipe.errors import SpecError
from dspipe.planner.timing import recomputed_share
from dspipe.run_estimate import RunEstimate
from dspipe.rundir import ENGINE_FILE, Run
from dspipe.runtime.engine_file import StartupRecord
from dspipe.spec.hardware import GIB

OK_BAND = (0.75, 1.33)
"""measured / predicted within this band: the plan kept its word (issue 40's 25%)."""
WARMUP_STEPS = 3
"""Leading steps left out of the medians (when more steps than that exist): dspipe.tools.report's."""


@dataclass(frozen=True)
class Term:
    """One figure of the plan and the run's measurement of it (None: not predicted / not measured)."""

    name: str
    kind: str
    """'step', 'startup' or 'memory': what a correction of it touches."""
    predicted: float | None
    measured: float | None

    @property
    def ratio(self) -> float | None:
        if self.predicted is None or self.measured is None or self.predicted <= 0:
            return None
        return self.measured / self.predicted

    @property
    def ok(self) -> bool | None:
        r = self.ratio
        return None if r is None else OK_BAND[0] <= r <= OK_BAND[1]


def _median(rows: list[dict], column: str) -> float | None:
    values = [r[column] for r in rows if r.get(column) is not None]
    return statistics.median(values) if values else None


def steady(rows: list[dict]) -> list[dict]:
    return rows[WARMUP_STEPS:] if len(rows) > WARMUP_STEPS else rows


def forward_share(recomputed: float) -> float:
    """The forward's share of a step's compute: 2N of 6N; full recomputation runs it again for the `recomputed`
    share of the blocks (dspipe.planner.timing.recomputed_share: every block, 8N; Megatron's block method less)."""
    return 1 / (3 + recomputed)


def phase_split(estimate: RunEstimate, *, recomputed: float, zero_stage: int) -> dict[str, tuple[float, float]]:
    """(compute, communication) seconds the plan puts in the forward, the backward and the optimizer step of a step
    (the module docstring's split; the optimizer's "compute" is its optimizer and offload terms); {} without a
    breakdown in the estimate."""
    b = estimate.breakdown
    if not b:
        return {}
    fwd, compute = forward_share(recomputed), b.get("compute", 0.0)
    sync = b.get("tp_comm", 0.0) + b.get("sp_comm", 0.0) + b.get("ep_comm", 0.0)
    dp = b.get("dp_comm", 0.0)
    dp_fwd = dp / 2 if zero_stage == 3 else 0.0
    after = min(estimate.dp_after_step_s, dp - dp_fwd)
    return {
        "forward": (compute * fwd, sync / 3 + dp_fwd),
        "backward": (compute * (1 - fwd), sync * 2 / 3 + dp - dp_fwd - after),
        "optimizer": (b.get("optimizer", 0.0) + b.get("offload", 0.0), after),
    }


def predicted_phases(estimate: RunEstimate, *, recomputed: float, zero_stage: int) -> dict[str, float] | None:
    """The plan's seconds of forward, backward and optimizer step per step; None without a breakdown."""
    split = phase_split(estimate, recomputed=recomputed, zero_stage=zero_stage)
    return {name: sum(parts) for name, parts in split.items()} if split else None


def step_terms(estimate: RunEstimate, rows: list[dict], *, recomputed: float, zero_stage: int) -> list[Term]:
    """The step's time and, where the run recorded them, its phases."""
    s = steady(rows)
    terms = [Term("step time (s)", "step", estimate.step_time_s, _median(s, "step_time_s"))]
    phases = predicted_phases(estimate, recomputed=recomputed, zero_stage=zero_stage)
    measured = {name: _median(s, f"{name}_s") for name in ("forward", "backward", "optimizer")}
    if phases and all(v is not None for v in measured.values()):
        for name in ("forward", "backward", "optimizer"):
            terms.append(Term(f"{name} (s)", "step", phases[name], measured[name]))
    return terms


def startup_terms(estimate: RunEstimate, record: StartupRecord | None, rows: list[dict]) -> list[Term]:
    """The time to the end of the first step and its terms (the slowest rank's), as far as both sides have them.
    Measured: engine.json's seconds to the first step plus metrics.csv's first row (a resumed run's first row is
    an earlier launch's first step after its resume)."""
    fs = estimate.first_step or {}
    first = rows[0].get("step_time_s") if rows else None
    ready = None if record is None else max(record.seconds_to_first_step)
    whole = None if ready is None or first is None else ready + first
    terms = [Term("time to first step (s)", "startup", fs.get("seconds"), whole)]
    if record is None or record.seconds_before_build is None or not fs:
        return terms
    jit = fs.get("jit_s", 0.0)
    terms += [
        Term("launch (s)", "startup", fs.get("launch_s"), max(record.seconds_before_build)),
        Term("build (s)", "startup", fs.get("build_s"), max(record.seconds_build)),
        Term(
            "initialize (s)" + (", op compiles included" if jit or record.ops_built else ""),
            "startup",
            fs.get("initialize_s", 0.0) + jit,
            record.seconds_initialize,
        ),
        Term(
            "first step (s)",
            "startup",
            None if "step_s" not in fs else fs["step_s"] + fs.get("extra_s", 0.0),
            first,
        ),
    ]
    return terms


def memory_term(estimate: RunEstimate, rows: list[dict]) -> Term:
    """A rank's peak memory in GiB: a CPU rank's RSS against the plan's resident prediction, a GPU's allocated bytes
    against the plan's total."""
    measured = [r["mem_allocated_gib"] for r in rows if r.get("mem_allocated_gib") is not None]
    resident = estimate.rank_resident_bytes
    predicted = resident if resident is not None else estimate.memory_total_bytes
    return Term(
        "peak RSS per rank (GiB)" if resident is not None else "peak memory per GPU (GiB)",
        "memory",
        None if predicted is None else predicted / GIB,
        max(measured) if measured else None,
    )


def startup_record(engine: dict | None) -> StartupRecord | None:
    """engine.json's start-up block; None where absent or damaged (the report's read_startup names the damage)."""
    try:
        return None if engine is None else StartupRecord.from_engine(engine, source=ENGINE_FILE)
    except SpecError:
        return None


def plan_terms(run: Run, engine: dict | None, steps: list[dict]) -> list[Term]:
    """The run's terms against its plan (dspipe.tools.run_terms): memory, the step's, the start-up's. A damaged
    engine.json start-up block leaves the start-up's out (read_startup's note says why)."""
    plan = run.plan
    return [
        memory_term(run.estimate, steps),
        *step_terms(
            run.estimate, steps, recomputed=recomputed_share(model=run.model, plan=plan), zero_stage=plan.zero_stage
        ),
        *startup_terms(run.estimate, startup_record(engine), steps),
    ]


ADVICE = {
    "step": "fold this run into a profile: dspipe calibrate --from-run RUN --out PROFILE, then plan with --profile",
    "startup": "the start-up figures are per machine class: dspipe calibrate --from-run RUN folds this run's in",
    "memory": "the resident-memory figures are per machine class: dspipe calibrate --from-run RUN folds them in",
}


NEGLIGIBLE = 0.05
"""A part (a phase of the step, a term of the start-up) whose error is under this share of its whole is 'ok' whatever
its ratio: a 0.02 s build that took 0.06 s moves nothing."""


def verdict(term: Term, *, others: list[Term] = (), whole: Term | None = None) -> str:
    """'ok' within OK_BAND (or, for a part of `whole`, an error under NEGLIGIBLE of it); else how far off, the worst
    sub-term among `others` (the phases of a step, the terms of a start-up) and what to do."""
    r = term.ratio
    if r is None:
        return "n/a"
    if term.ok:
        return "ok"
    if whole is not None and whole.measured and abs(term.measured - term.predicted) < NEGLIGIBLE * whole.measured:
        return f"ok ({r:.2f}x, but {abs(term.measured - term.predicted):.2g} of the whole's {whole.measured:.3g})"
    side = "slower" if r > 1 else "faster"
    if term.kind == "memory":
        side = "more" if r > 1 else "less"
    worst = max(
        (t for t in others if t.ratio is not None and t is not term and abs(t.measured - t.predicted) > 0),
        key=lambda t: abs(t.measured - t.predicted),
        default=None,
    )
    culprit = (
        f"; most of it is {worst.name.split(' (')[0]}: {worst.measured:.3g} vs {worst.predicted:.3g} planned"
        if worst is not None
        else ""
    )
    return f"off: {r:.2f}x ({side} than planned){culprit}; {ADVICE[term.kind]}"
