"""dspipe.json's "estimate": RunEstimate, read (RunEstimate.from_dict, validated, by dspipe.rundir.load_run) and
written (RunEstimate.written, gen-config's; to_dict, dspipe.rundir.write_run) here only. Its on-disk format is
dspipe.planner.summary.estimate_summary's (what `dspipe plan --json` prints) plus save_interval_auto, unchanged: the
section is kept whole as written and the figures its readers use are typed properties. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspipe.errors import SpecError
from dspipe.jsonio import leaves, show
from dspipe.spec.checks import is_number

ESTIMATE_NUMBERS = ("tokens_per_s", "mfu", "step_time_s", "rank_resident_bytes", "dp_comm_after_step_s")
"""Figures of dspipe.json's estimate that `dspipe report` reads (with memory_per_gpu_bytes.total)."""
AUTO_INTERVAL = "save_interval_auto"
"""dspipe.json's estimate key, true when train.save_interval came from --save-interval auto: the runner then
re-plans it from each save's measured time (dspipe.runtime.save_schedule)."""
ESTIMATE_LAYOUT = (
    "num_params",
    "zero_stage",
    "offload",
    "offload_params",
    "precision",
    "pp",
    "tp",
    "sp",
    "dp",
    "micro_batch",
    "grad_accum",
    "checkpointing",
    "recompute_blocks",
)
"""Figures of dspipe.json's estimate that repeat the plan (dspipe.planner.summary.estimate_summary)."""


POSITIVE = (
    "tokens_per_s",
    "step_time_s",
    "step_time_breakdown_s.compute",
    "first_step.seconds",
    "memory_per_gpu_bytes.total",
)
"""Figures of the estimate that are never 0 (a model computes, holds memory and takes time): 0 there is damage,
which report would show as a prediction and calibrate --from-run fold as a ratio."""
MAX_FIGURE = 1e21
"""The largest figure an estimate holds (bytes of a 405B model's checkpoint are ~1e13, tokens/s ~1e8): beyond it, a
damaged file (1e30 tokens/s printed a 31-digit MFU)."""
FRACTIONS = ("mfu", "memory_headroom")
NOT_NUMBERS = {  # block -> {key: what it holds instead of a number}
    "startup": {"mode": str, "build": str, "holds": str, "not_counted": str, "import_bytes": (int, float, type(None))},
    "first_step": {"jit_ops": list, "ops_checked": bool},
    "checkpoint": {},
    "memory_per_gpu_bytes": {},
}
"""The estimate's blocks whose figures readers use (report, calibrate): every other key of theirs is a number."""


def _check_blocks(estimate: dict, *, source: Path | str) -> None:
    """Every number of the estimate finite, >= 0 and below MAX_FIGURE (mfu and the memory headroom at most 1); in
    the blocks readers use (NOT_NUMBERS), every figure a number."""
    for name, value in leaves(estimate):
        if is_number(value) and not 0 <= value <= (1 if name in FRACTIONS else MAX_FIGURE):
            top = 1 if name in FRACTIONS else f"{MAX_FIGURE:g}"
            raise SpecError(f"{source}: estimate.{name} must be a number in 0..{top}, got {show(value)}")
    for block, other in NOT_NUMBERS.items():
        value = estimate.get(block)
        if not isinstance(value, dict):
            continue
        for key, figure in value.items():
            kind = other.get(key)
            if kind is None and not is_number(figure):
                raise SpecError(f"{source}: estimate.{block}.{key} must be a number, got {show(figure)}")
            if kind is not None and (not isinstance(figure, kind) or (kind is not bool and isinstance(figure, bool))):
                what = {str: "text", list: "a list", bool: "true or false"}.get(kind, "a number or null")
                raise SpecError(f"{source}: estimate.{block}.{key} must be {what}, got {show(figure)}")


def _figure(value) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class RunEstimate:
    """The planner's estimate of a run as gen-config wrote it. `figures` is the section itself (its keys in the
    written order; to_dict gives it back unchanged); the properties are the validated figures readers use. An
    older run directory may lack any of them: None (or False / {})."""

    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float | None:
        return _figure(self.figures.get("tokens_per_s"))

    @property
    def mfu(self) -> float | None:
        return _figure(self.figures.get("mfu"))

    @property
    def step_time_s(self) -> float | None:
        return _figure(self.figures.get("step_time_s"))

    @property
    def memory_total_bytes(self) -> float | None:
        """memory_per_gpu_bytes.total: the predicted peak per GPU."""
        return _figure(self.figures.get("memory_per_gpu_bytes", {}).get("total"))

    @property
    def save_interval_auto(self) -> bool:
        """train.save_interval came from --save-interval auto (the runner re-plans it)."""
        return self.figures.get(AUTO_INTERVAL) is True

    @property
    def checkpoint(self) -> dict | None:
        """The predicted checkpoint (dspipe.planner.checkpoint_size's to_dict), None where not written."""
        value = self.figures.get("checkpoint")
        return value if isinstance(value, dict) else None

    @property
    def startup(self) -> dict | None:
        """The predicted start-up (dspipe.planner.startup's to_dict), None where not written."""
        value = self.figures.get("startup")
        return value if isinstance(value, dict) else None

    @property
    def first_step(self) -> dict[str, float] | None:
        """The predicted time to the end of the first step by term (dspipe.planner.first_step's to_dict: its
        numbers only), None where not written."""
        value = self.figures.get("first_step")
        if not isinstance(value, dict):
            return None
        return {k: float(v) for k, v in value.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    @property
    def jit_ops(self) -> tuple[str, ...]:
        """The ops the plan expected the launch to compile."""
        value = (self.figures.get("first_step") or {}).get("jit_ops")
        return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()

    @property
    def rank_resident_bytes(self) -> float | None:
        """A CPU rank's predicted peak RSS (GpuType.resident_bytes), None elsewhere or where not written."""
        return _figure(self.figures.get("rank_resident_bytes"))

    @property
    def breakdown(self) -> dict[str, float]:
        """step_time_breakdown_s: the step's predicted seconds by term ({} where not written)."""
        value = self.figures.get("step_time_breakdown_s")
        if not isinstance(value, dict):
            return {}
        return {k: float(v) for k, v in value.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    @property
    def dp_after_step_s(self) -> float:
        """Of the breakdown's dp_comm, the seconds of the parameters' all-gather inside the optimizer step (0 where not
        written: a plan from before the figure)."""
        return _figure(self.figures.get("dp_comm_after_step_s")) or 0.0

    def layout(self) -> dict[str, Any]:
        """The ESTIMATE_LAYOUT figures it holds (they repeat the plan's)."""
        return {key: self.figures[key] for key in ESTIMATE_LAYOUT if key in self.figures}

    def to_dict(self) -> dict[str, Any]:
        """dspipe.json's "estimate" object, as written."""
        return self.figures

    @classmethod
    def written(cls, summary: dict[str, Any], *, auto_interval: bool = False) -> RunEstimate:
        """What gen-config writes: the search's estimate_summary, marked save_interval_auto when the save interval
        came from --save-interval auto."""
        return cls({**summary, **({AUTO_INTERVAL: True} if auto_interval else {})})

    @classmethod
    def from_dict(cls, estimate, *, source: Path | str) -> RunEstimate:
        """The section validated (the figures readers use: numbers >= 0 or null, memory_per_gpu_bytes an object,
        save_interval_auto true when present); anything else is one SpecError naming `source` and the key."""
        if not isinstance(estimate, dict):
            raise SpecError(f"{source}: estimate must be an object, got {type(estimate).__name__}")
        memory = estimate.get("memory_per_gpu_bytes", {})
        if not isinstance(memory, dict):
            raise SpecError(f"{source}: estimate.memory_per_gpu_bytes must be an object, got {type(memory).__name__}")
        for name, value in [
            *((k, estimate.get(k)) for k in ESTIMATE_NUMBERS),
            ("memory_per_gpu_bytes.total", memory.get("total")),
        ]:
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise SpecError(f"{source}: estimate.{name} must be a number >= 0 or null, got {show(value)}")
        for section in ("first_step", "step_time_breakdown_s"):
            block = estimate.get(section)
            if block is None:
                continue
            if not isinstance(block, dict):
                raise SpecError(f"{source}: estimate.{section} must be an object, got {type(block).__name__}")
            for key, value in block.items():
                number = isinstance(value, (int, float)) and not isinstance(value, bool)
                if (number and not 0 <= value < float("inf")) or (section == "step_time_breakdown_s" and not number):
                    raise SpecError(f"{source}: estimate.{section}.{key} must be a number >= 0, got {show(value)}")
        _check_blocks(estimate, source=source)
        for path in POSITIVE:
            value = estimate
            for key in path.split("."):
                value = value.get(key) if isinstance(value, dict) else None
            if is_number(value) and value <= 0:
                raise SpecError(
                    f"{source}: estimate.{path} must be more than 0 (the planner never predicts 0), got {show(value)}"
                )
        if AUTO_INTERVAL in estimate and estimate[AUTO_INTERVAL] is not True:
            raise SpecError(
                f"{source}: estimate.{AUTO_INTERVAL} must be true when present, got {show(estimate[AUTO_INTERVAL])}"
            )
        return cls(estimate)
