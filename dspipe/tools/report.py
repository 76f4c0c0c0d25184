"""`dspipe report runs/NAME`: a trained (or training) run's metrics against its plan, as PNG plots and report.md.

Reads runs/NAME/metrics.csv (dspipe.planner.throughput.STEP_COLUMNS, one row per optimizer step, rank 0),
val_metrics.csv (VAL_COLUMNS, optional), the start-up figures in engine.json (dspipe.runtime.startup: every rank's peak
host RSS and seconds to the first step) and the planner's estimate in dspipe.json. Measured throughput is the median
over the steps after the first WARMUP_STEPS (compilation, allocator and communicator warm-up); peak memory is the
largest
mem_allocated_gib (a peak since start on rank 0). Plots go through matplotlib's Figure API (Agg canvas, no pyplot,
no display). The report directory is written beside its destination, then renamed into place. Imports no torch.
"""

from __future__ import annotations

import csv
import io
import math
import re
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from dspipe import outputs
from dspipe.atomic import staged_dir
from dspipe.errors import SpecError, cannot_read
from dspipe.jsonio import read_object
from dspipe.log import get_logger
from dspipe.planner.throughput import STEP_COLUMNS, VAL_COLUMNS, perplexity
from dspipe.run_estimate import RunEstimate
from dspipe.rundir import ENGINE_FILE, VAL_FILE, Run, engine_disagreement, load_engine, load_run
from dspipe.runtime.ckpt_meta import SaveRecord
from dspipe.runtime.ckpt_tags import read_latest
from dspipe.runtime.engine_file import StartupRecord
from dspipe.runtime.watchdog import EVENTS_FILE, NO_EVENTS, events_text, read_event_lines
from dspipe.spec.kinds import Axis
from dspipe.tools.run_terms import Term, memory_term, plan_terms, verdict

MIB = 1024**2
WARMUP_STEPS = 3
"""Leading steps left out of the throughput, MFU and step-time medians (when more steps than that exist)."""
FINAL_WINDOW = 10
"""Last steps averaged into the final training loss."""
REPORT_FILE = "report.md"
PLOTS = {"loss": "loss.png", "throughput": "throughput.png", "lr": "lr.png"}
_INT_COLUMNS = {"step", "tokens", "skipped"}


@dataclass(frozen=True)
class Measured:
    """What the metrics say, reduced to the figures the report shows (None: not measured / n/a)."""

    first_step: int
    last_step: int
    rows: int
    tokens: int
    warmup: int
    """Rows left out of the medians."""
    steady_from: int
    """First step the medians count."""
    final_loss: float
    final_window: int
    skipped: int
    tokens_per_s: float | None
    mfu: float | None
    step_time_s: float | None
    mem_allocated_gib: float | None
    mem_reserved_gib: float | None
    best_val: dict | None
    final_val: dict | None
    startup: "Startup | None" = None
    """engine.json's start-up figures beside the plan's (read_startup); None until write_report reads them."""
    terms: tuple[Term, ...] = ()
    """The plan's terms against the run's (dspipe.tools.run_terms): the step's, the start-up's, the memory's."""
    events: str = NO_EVENTS
    """What events.jsonl says happened to the run's jobs (job_events)."""

    def term(self, name: str) -> Term | None:
        return next((t for t in self.terms if t.name.startswith(name)), None)

    def of_kind(self, kind: str) -> list[Term]:
        return [t for t in self.terms if t.kind == kind]


_INT = re.compile(r"[0-9]{1,18}", re.ASCII)
_FLOAT = re.compile(
    r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(nan|inf|infinity)", re.ASCII | re.IGNORECASE
)
FP32_MAX = 3.4028234663852886e38
"""The largest finite fp32 number: a metric beyond it (or a negative one) is damage, not a measurement."""
NON_FINITE_OK = {"loss", "grad_norm", "val_loss", "val_ppl"}
"""Columns where NaN/inf are real measurements (a skipped non-finite step, a diverged run); elsewhere they are
damage."""


def _parse(value: str | None, column: str, where: str):
    """An ASCII decimal integer (step, tokens, skipped: 0 .. 10^18) or float; None for an empty field."""
    if value is None or value.strip() == "":
        return None
    text = value.strip()
    if column in _INT_COLUMNS:
        if not _INT.fullmatch(text):
            raise SpecError(f"{where}: {column} {value[:40]!r} is not a whole number in 0..10^18")
        return int(text)
    if not _FLOAT.fullmatch(text):
        raise SpecError(f"{where}: {column} {value[:40]!r} is not a number")
    number = float(text)
    if column not in NON_FINITE_OK and not (math.isfinite(number) and number >= 0):
        raise SpecError(f"{where}: {column} {value[:40]!r} must be a finite number >= 0")
    if math.isfinite(number) and not 0 <= number <= FP32_MAX:
        raise SpecError(
            f"{where}: {column} {value[:40]!r} must be in 0..{FP32_MAX:.4g} (the runner writes no value beyond "
            f"an fp32 number's range)" + (" or NaN/inf" if column in NON_FINITE_OK else "")
        )
    return number


def _csv_text(path: Path) -> str:
    """The file's text, or one SpecError: a directory, an unreadable file, bytes that are not UTF-8."""
    if path.is_dir():
        raise SpecError(f"{path} is a directory, not a CSV file (the runner writes it as a file)")
    try:
        text = path.read_bytes().decode("utf-8-sig")  # a spreadsheet's byte-order mark is not the first column's name
        return text.replace("\r\n", "\n").replace("\r", "\n")  # a spreadsheet's CR LF or CR line ends
    except UnicodeDecodeError as e:
        raise SpecError(f"{path} is not a readable CSV file: {' '.join(str(e).split())}") from None
    except OSError as e:
        raise cannot_read(path, e) from None


def read_csv(path: Path, *, columns: tuple[str, ...], required: tuple[str, ...]) -> list[dict]:
    """The rows, in step order, as the runner writes them (dspipe.runtime.metrics_log): every row one whole line
    with the header's fields, the steps increasing (a resume rewrites the file to the steps it keeps before it
    appends). Columns of `columns` that the file lacks read as None. A last line without its newline is one the
    runner is writing right now (or was killed while writing): it is left out, with a note. Any other short or long
    row, or a step not above the one before it, is a SpecError naming the line."""
    text = _csv_text(path)
    cut = text.rfind("\n") + 1
    complete, torn = text[:cut], text[cut:]
    try:
        reader = csv.DictReader(io.StringIO(complete, newline=""))
        header = reader.fieldnames or []
        twice = sorted({c for c in header if header.count(c) > 1})
        if twice:
            raise SpecError(f"{path}: column {', '.join(twice)} twice in the header (expected {','.join(columns)})")
        missing = [c for c in required if c not in header]
        if header and missing:
            raise SpecError(f"{path}: no column {', '.join(missing)} in the header (expected {','.join(columns)})")
        raw = [(reader.line_num, row) for row in reader]
    except csv.Error as e:
        raise SpecError(f"{path} is not a readable CSV file: {' '.join(str(e).split())}") from None
    if torn.strip() and header:
        line = complete.count("\n") + 1
        get_logger(__name__).info(
            f"note: {path}:{line}: the last line has no newline (the runner is writing it, or was stopped while "
            f"writing it): left out"
        )
    rows: list[dict] = []
    last_line = 0
    for line, row in raw:
        if None in row:  # csv.DictReader's key for the fields beyond the header's
            raise SpecError(f"{path}:{line}: {len(header) + len(row[None])} fields, the header has {len(header)}")
        if None in row.values():
            given = sum(v is not None for v in row.values())
            raise SpecError(f"{path}:{line}: {given} field(s), the header has {len(header)}")
        parsed = {c: _parse(row.get(c), c, f"{path}:{line}") for c in columns}
        if any(parsed[c] is None for c in required):
            raise SpecError(f"{path}:{line}: empty {', '.join(c for c in required if parsed[c] is None)}")
        if rows and parsed["step"] <= rows[-1]["step"]:
            raise SpecError(
                f"{path}:{line}: step {parsed['step']} after step {rows[-1]['step']} (line {last_line}): the "
                f"runner writes each step once, in increasing order"
            )
        rows.append(parsed)
        last_line = line
    return rows


def read_metrics(run: Run) -> tuple[list[dict], list[dict]]:
    """(step rows, validation rows); one-line errors when there is nothing to report yet."""
    path = run.metrics_path
    if not path.exists() and not path.is_symlink():
        raise SpecError(
            f"{path} does not exist: no step of {run.path} has finished yet "
            f"(start it with 'deepspeed run.py --run {run.path}')"
        )
    steps = read_csv(path, columns=STEP_COLUMNS, required=("step", "loss"))
    if not steps:
        raise SpecError(f"{path} has no rows: no step of {run.path} has finished yet")
    _check_against_run(steps, path=path, run=run)
    val_path = run.val_metrics_path
    exists = val_path.exists() or val_path.is_symlink()
    val = read_csv(val_path, columns=VAL_COLUMNS, required=("step", "val_loss")) if exists else []
    _check_against_run(val, path=val_path, run=run)
    for row in val:
        if row["val_ppl"] is None:
            row["val_ppl"] = perplexity(row["val_loss"])
    return steps, val


def _check_against_run(rows: list[dict], *, path: Path, run: Run) -> None:
    """Each row's step in 1..the run's steps and its tokens = step x the plan's tokens per step (the global batch
    is fixed for a run; `dspipe extend` only raises the steps), as the runner writes them; a row without tokens (a
    runner older than that column) gets that product. One SpecError naming the first row that disagrees."""
    steps, per_step = run.train.steps, run.plan.tokens_per_step
    for n, row in enumerate(rows, 1):
        step = row["step"]
        if not 1 <= step <= steps:
            raise SpecError(
                f"{path}: row {n}: step {step:,} is outside the run's 1..{steps:,} steps (dspipe.json train.steps)"
            )
        if row["tokens"] is None:
            row["tokens"] = step * per_step
        elif row["tokens"] != step * per_step:
            raise SpecError(
                f"{path}: row {n}: tokens {row['tokens']:,} at step {step:,}, the run's is step {step:,} x "
                f"{per_step:,} tokens per step = {step * per_step:,}"
            )


def _values(rows: list[dict], column: str) -> list[float]:
    return [r[column] for r in rows if r[column] is not None and math.isfinite(r[column])]


def _median(rows: list[dict], column: str) -> float | None:
    values = _values(rows, column)
    return statistics.median(values) if values else None


def measure(steps: list[dict], val: list[dict]) -> Measured:
    warmup = WARMUP_STEPS if len(steps) > WARMUP_STEPS else 0
    steady = steps[warmup:]
    last = steps[-FINAL_WINDOW:]
    losses = _values(last, "loss")
    allocated, reserved = _values(steps, "mem_allocated_gib"), _values(steps, "mem_reserved_gib")
    finite_val = [r for r in val if math.isfinite(r["val_loss"])]
    return Measured(
        first_step=steps[0]["step"],
        last_step=steps[-1]["step"],
        rows=len(steps),
        tokens=steps[-1]["tokens"],
        warmup=warmup,
        steady_from=steady[0]["step"],
        final_loss=statistics.fmean(losses) if losses else float("nan"),
        final_window=len(last),
        skipped=sum(r["skipped"] or 0 for r in steps),
        tokens_per_s=_median(steady, "tokens_per_s"),
        mfu=_median(steady, "mfu"),
        step_time_s=_median(steady, "step_time_s"),
        mem_allocated_gib=max(allocated) if allocated else None,
        mem_reserved_gib=max(reserved) if reserved else None,
        best_val=min(finite_val, key=lambda r: r["val_loss"]) if finite_val else None,
        final_val=val[-1] if val else None,
    )


# ---------------------------------------------------------------------------------------------------- start-up


@dataclass(frozen=True)
class Startup:
    """A run's start-up as engine.json records it (the worst rank), beside the plan's prediction (dspipe.json's
    estimate.startup). Figures are None where not recorded or not predicted; `note` says why in one line."""

    note: str = ""
    mode: str | None = None
    ranks: int = 0
    worst_rank: int | None = None
    peak_rss_mib: float | None = None
    """The worst rank's peak host RSS up to its first step."""
    before_build_mib: float | None = None
    """That rank's peak RSS before the module build (the process, torch, DeepSpeed)."""
    build_rss_mib: float | None = None
    """That rank's peak RSS right after the module build."""
    seconds_to_first_step: float | None = None
    """The largest over the ranks."""
    seconds_build: float | None = None
    """The largest module build over the ranks."""
    predicted_mode: str | None = None
    predicted_host_per_rank_mib: float | None = None
    predicted_seconds: float | None = None

    @property
    def recorded(self) -> bool:
        return self.peak_rss_mib is not None

    @property
    def growth_mib(self) -> float | None:
        """The worst rank's start-up peak less its RSS before the build: what the prediction counts."""
        return None if not self.recorded else self.peak_rss_mib - self.before_build_mib

    def line(self) -> str:
        """One line for the console."""
        plan_host = (
            "" if self.predicted_host_per_rank_mib is None else f"; plan {self.predicted_host_per_rank_mib:,.1f} MiB"
        )
        plan_s = "" if self.predicted_seconds is None else f"; plan {self.predicted_seconds:,.4g} s to its end"
        if not self.recorded:
            return f"start-up: not recorded{f' ({self.note})' if self.note else ''}"
        return (
            f"start-up: worst rank {self.worst_rank} peak RSS {self.peak_rss_mib:,.1f} MiB "
            f"(+{self.growth_mib:,.1f} over the {self.before_build_mib:,.1f} before the build{plan_host}), first "
            f"step began {self.seconds_to_first_step:,.4g} s after the process start{plan_s}"
        )


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _predicted(estimate: RunEstimate) -> dict:
    """The plan's start-up figures from dspipe.json's estimate (each None where absent or not a number >= 0)."""
    pred = estimate.startup
    if pred is None:
        return {}
    host, seconds, mode = pred.get("host_per_rank_bytes"), pred.get("seconds"), pred.get("mode")
    if estimate.first_step and "seconds" in estimate.first_step:  # the whole time to the first step's end
        seconds = estimate.first_step["seconds"]
    return {
        "predicted_mode": mode if isinstance(mode, str) else None,
        "predicted_host_per_rank_mib": host / MIB if _number(host) else None,
        "predicted_seconds": float(seconds) if _number(seconds) else None,
    }


def read_startup(engine: dict | None, estimate: RunEstimate) -> Startup:
    """engine.json's "startup" (StartupRecord) reduced to its worst rank, beside the plan's prediction; never
    raises: an absent block is 'not recorded', a damaged one names its first bad value in `note`."""
    pred = _predicted(estimate)
    if engine is None:
        return Startup(note="engine.json not written yet", **pred)
    try:
        record = StartupRecord.from_engine(engine, source=ENGINE_FILE)
    except SpecError as e:  # one line naming the key
        return Startup(note=str(e), **pred)
    if record is None:
        return Startup(note="engine.json has no startup figures: its runner predates them", **pred)
    worst = record.worst_rank
    return Startup(
        mode=record.mode,
        ranks=record.ranks,
        worst_rank=worst,
        peak_rss_mib=float(record.peak_rss_mib[worst]),
        before_build_mib=float(record.rss_before_build_mib[worst]),
        build_rss_mib=float(record.build_rss_mib[worst]),
        seconds_to_first_step=float(max(record.seconds_to_first_step)),
        seconds_build=float(max(record.seconds_build)),
        **pred,
    )


def _seconds_rows(s: Startup, terms: list[Term]) -> list[str]:
    """The time to the first step's row and its terms' rows (an older plan without them: its build seconds
    against engine.json's time to the first step)."""
    whole = next((t for t in terms if t.name.startswith("time to first step")), None)
    if whole is None or whole.predicted is None:
        seconds = (
            f"{s.seconds_to_first_step:.4g} (slowest rank; module build {s.seconds_build:.4g})"
            if s.recorded
            else "not recorded"
        )
        return [
            f"| time to first step (s) | {_or_na(s.predicted_seconds, '.4g')} (the build alone: an older plan) | "
            f"{seconds} | {_ratio(s.seconds_to_first_step, s.predicted_seconds)} | n/a |"
        ]
    parts = [t for t in terms if t is not whole]
    rows = [
        f"| time to first step's end (s) | {whole.predicted:.4g} | {_or_na(whole.measured, '.4g')} (slowest rank) | "
        f"{_ratio(whole.measured, whole.predicted)} | {verdict(whole, others=parts)} |"
    ]
    for t in parts:
        rows.append(
            f"| &nbsp;&nbsp;{t.name} | {_or_na(t.predicted, '.4g')} | {_or_na(t.measured, '.4g')} | "
            f"{_ratio(t.measured, t.predicted)} | {verdict(t, whole=whole)} |"
        )
    return rows


def _growth_verdict(s: Startup, *, host_is_device: bool) -> str:
    if host_is_device:
        return "n/a: the host is the device (the peak RSS row compares a CPU rank's memory)"
    ok = Term("start-up host RAM", "memory", s.predicted_host_per_rank_mib, s.growth_mib).ok
    return "n/a" if ok is None else "ok" if ok else "off: the build model (dspipe.planner.startup)"


def startup_markdown(
    s: Startup, terms: list[Term] = (), *, host_is_device: bool = False
) -> tuple[list[str], list[str]]:
    """(rows of the plan-vs-measured table, notes below it) for the start-up; `terms`: run_terms.startup_terms."""
    plan_mode = f" ({s.predicted_mode} build)" if s.predicted_mode else ""
    if s.recorded:
        host = (
            f"worst rank {s.worst_rank} of {s.ranks}: peak {s.peak_rss_mib:,.1f}, +{s.growth_mib:,.1f} over the "
            f"{s.before_build_mib:,.1f} before the build (after the build {s.build_rss_mib:,.1f})"
        )
    else:
        host = "not recorded"
    rows = [
        f"| start-up host RAM per rank (MiB) | {_or_na(s.predicted_host_per_rank_mib, ',.1f')}{plan_mode} | "
        f"{host} | {_ratio(s.growth_mib, s.predicted_host_per_rank_mib)} (growth) | "
        f"{_growth_verdict(s, host_is_device=host_is_device)} |",
        *_seconds_rows(s, list(terms)),
    ]
    notes = []
    if not s.recorded:
        notes.append(f"Start-up: not recorded ({s.note})." if s.note else "Start-up: not recorded.")
    else:
        notes.append(
            "Start-up: the host RAM row counts what the build (and the offload) hold on the host, not the process "
            "itself (Python, torch, DeepSpeed: the RSS before the build), so its ratio is the growth's. The time "
            "runs from a rank's process start to the end of its first step: launch (imports, process group, data), "
            "the build, deepspeed.initialize and any op compile, then the first step (metrics.csv's first row)."
        )
        if s.predicted_mode and s.mode != s.predicted_mode:
            notes.append(f"The engine built its model as `{s.mode}`, the plan predicted `{s.predicted_mode}`.")
    if s.predicted_host_per_rank_mib is None:
        notes.append(
            "The plan in dspipe.json has no start-up prediction (written before it; 'dspipe gen-config "
            "--force' adds it)."
        )
    return rows, notes


# ---------------------------------------------------------------------------------------------------- plots


def _figure():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=110, layout="constrained")
    return fig, fig.add_subplot()


def plot_loss(steps: list[dict], val: list[dict], path: Path) -> None:
    from matplotlib.ticker import EngFormatter

    fig, ax = _figure()
    train = [r for r in steps if r["loss"] is not None and math.isfinite(r["loss"])]
    ax.plot([r["tokens"] for r in train], [r["loss"] for r in train], lw=1, color="tab:blue", label="train loss")
    if val:
        ax.plot(
            [r["tokens"] for r in val],
            [r["val_loss"] for r in val],
            "o-",
            ms=4,
            color="tab:orange",
            label="validation loss",
        )
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.set(xlabel="tokens trained", ylabel="loss (nats/token)", title="Loss vs. tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path)


def plot_throughput(steps: list[dict], measured: Measured, predicted: float | None, path: Path) -> None:
    from matplotlib.ticker import StrMethodFormatter

    fig, ax = _figure()
    rows = [r for r in steps if r["tokens_per_s"] is not None]
    ax.plot([r["step"] for r in rows], [r["tokens_per_s"] for r in rows], lw=1, color="tab:blue", label="tokens/s")
    if measured.tokens_per_s is not None:
        ax.axhline(
            measured.tokens_per_s, ls=":", color="tab:blue", label=f"median after warm-up {measured.tokens_per_s:,.0f}"
        )
    title = "Throughput"
    if predicted is not None:
        top = max((r["tokens_per_s"] for r in rows), default=0.0)
        if predicted <= 2 * top:  # a far-off prediction would flatten the measured curve: give it in the title
            ax.axhline(predicted, ls="--", color="tab:gray", label=f"planner {predicted:,.0f}")
        title += f" (planner predicts {predicted:,.0f} tokens/s)"
    ax.set(xlabel="step", ylabel="tokens/s (whole job)", title=title)
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    mfu = [r for r in steps if r["mfu"] is not None]
    if mfu:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in mfu], [r["mfu"] * 100 for r in mfu], lw=1, color="tab:red", label="MFU")
        ax2.set_ylabel("MFU (%)", color="tab:red")
        ax2.set_ylim(bottom=0)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="lower right")
    fig.savefig(path)


def plot_lr(steps: list[dict], path: Path) -> None:
    fig, ax = _figure()
    rows = [r for r in steps if r["lr"] is not None]
    ax.plot([r["step"] for r in rows], [r["lr"] for r in rows], lw=1.5, color="tab:green")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    ax.set(xlabel="step", ylabel="learning rate", title="Learning rate schedule")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.savefig(path)


# ---------------------------------------------------------------------------------------------------- report.md


def _or_na(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{fraction * 100:.1f}%"


def _ratio(measured: float | None, predicted: float | None) -> str:
    return f"{measured / predicted:.2f}" if measured is not None and predicted else "n/a"


def latest_save(run: Run) -> SaveRecord | None:
    """The `save` record (bytes, rank_max_bytes, write_s, ...) of the checkpoint `latest` names, None before the
    first complete save or where it has none (a checkpoint written before the record existed) or a damaged one."""
    try:
        tag = read_latest(run.checkpoint_dir)  # a global_stepN tag, or a SpecError
        source = run.checkpoint_dir / tag / "dspipe.json"
        meta = read_object(source)
        save = meta.get("save") if isinstance(meta, dict) else None
        return None if save is None else SaveRecord.from_dict(save, source=source)
    except (OSError, SpecError):
        return None


def checkpoint_rows(run: Run, *, estimate: RunEstimate) -> list[str]:
    """Plan vs. measured for one checkpoint: every rank's files and the largest rank's (the plan's estimate, or
    dspipe.planner.checkpoint_size for a run directory written before the estimate held it)."""
    from dspipe.planner.checkpoint_size import checkpoint_size

    planned = (
        estimate.checkpoint
        or checkpoint_size(model=run.model, plan=run.plan, ranks_per_node=run.cluster.gpus_per_node).to_dict()
    )
    save = latest_save(run)
    measured = {
        "bytes": None if save is None else save.bytes,
        # a synchronous save does not count a rank's bytes
        "rank_max_bytes": None if save is None or save.mode == "sync" else save.rank_max_bytes,
    }
    rows = []
    for label, key in (("checkpoint per save (MiB)", "bytes"), ("checkpoint, largest rank (MiB)", "rank_max_bytes")):
        want, got = planned.get(key), measured[key]
        want_mib = None if want is None else want / 2**20
        got_mib = None if got is None else got / 2**20
        ok = Term(label, "memory", want_mib, got_mib).ok
        rows.append(
            f"| {label} | {_or_na(want_mib, ',.1f')} | {_or_na(got_mib, ',.1f')} | {_ratio(got_mib, want_mib)} | "
            f"{'n/a' if ok is None else 'ok' if ok else 'off: the checkpoint size model (checkpoint_size)'} |"
        )
    return rows


def _engine_line(engine: dict | None) -> str:
    """The configuration table's live-engine cell: what engine.json says the engine runs."""
    return (
        "not written yet (the runner writes engine.json once the engine is up)"
        if engine is None
        else f"ZeRO-{engine.get('zero_stage')}, dp {engine.get('dp')} x pp {engine.get('pp')}"
        + "".join(f" x {k} {engine[k]}" for k in (Axis.TP, Axis.SP) if engine.get(k, 1) != 1)
        + ", "
        f"{engine.get('backend')}, {engine.get('wrapper_optimizer')} / {engine.get('base_optimizer')}, "
        f"world {engine.get('world_size')} (engine.json)"
    )


def _configuration_lines(run: Run, *, engine: dict | None, m: Measured) -> list[str]:
    """The report's title, run line and configuration table, up to the plan-vs-measured table's header."""
    model, plan, cluster = run.model, run.plan, run.cluster
    engine_line = _engine_line(engine)
    return [
        f"# Run report: {run.path.name}",
        "",
        f"Run directory `{run.path}`: {m.rows} steps ({m.first_step}-{m.last_step}), {m.tokens:,} tokens.",
        "",
        "## Configuration",
        "",
        "| | |",
        "|---|---|",
        f"| model | {model.name}: {plan.num_params / 1e6:,.2f}M params ({model.shape_text}) |",
        f"| world | {plan.layout.describe().removeprefix('world ')} ({cluster.nodes} node(s) x "
        f"{cluster.gpus_per_node} {cluster.gpu}) |",
        f"| ZeRO | stage {plan.zero_stage}, offload {plan.offload}{' + parameters' if plan.offload_params else ''} |",
        f"| precision | {plan.precision} (gradient accumulation in {plan.grad_accum_dtype}) |",
        f"| recomputation | {plan.recomputation} |",
        f"| batch | global {plan.global_batch} = micro {plan.micro_batch} x GA {plan.grad_accum} x dp {plan.dp} "
        f"({plan.tokens_per_step:,} tokens/step) |",
        f"| schedule | {run.train.steps} steps, peak lr {run.train.lr:g}, warmup {run.train.warmup_steps} |",
        f"| live engine | {engine_line} |",
        "",
        "## Plan vs. measured",
        "",
        "| per GPU / job | predicted | measured | measured / predicted | verdict |",
        "|---|---|---|---|---|",
    ]


def _comparison_rows(*, estimate: RunEstimate, m: Measured) -> list[str]:
    """The plan-vs-measured table's memory, throughput, MFU and step-time rows."""
    steady = (
        f"median of steps {m.steady_from}-{m.last_step}"
        if m.warmup
        else f"median of all {m.rows} steps (too few to drop a warm-up)"
    )
    lines: list[str] = []
    memory = m.term("peak ") or memory_term(estimate, [])
    reserved = "" if m.mem_reserved_gib is None else f" (reserved {m.mem_reserved_gib:.3f})"
    what = "max RSS of rank 0" if memory.name.startswith("peak RSS") else "max allocated"
    lines.append(
        f"| {memory.name} | {_or_na(memory.predicted, '.3f')} | {what} "
        f"{_or_na(m.mem_allocated_gib, '.3f')}{reserved} | {_ratio(m.mem_allocated_gib, memory.predicted)} | "
        f"{verdict(memory)} |"
    )
    step = m.term("step time") or Term("step time (s)", "step", estimate.step_time_s, m.step_time_s)
    phases = [t for t in m.of_kind("step") if t is not step]
    tps = estimate.tokens_per_s
    lines.append(
        f"| tokens/s (job) | {_or_na(tps, ',.0f')} | {_or_na(m.tokens_per_s, ',.0f')} ({steady}) | "
        f"{_ratio(m.tokens_per_s, tps)} | {verdict(step, others=phases)} |"
    )
    mfu = estimate.mfu
    lines.append(
        f"| MFU | {_percent(mfu)} | "
        f"{'n/a (no peak FLOP/s for this device)' if m.mfu is None else _percent(m.mfu)} | "
        f"{_ratio(m.mfu, mfu)} | {'n/a' if m.mfu is None else verdict(step, others=phases)} |"
    )
    lines.append(
        f"| step time (s) | {_or_na(step.predicted, '.4g')} | {_or_na(m.step_time_s, '.4g')} | "
        f"{_ratio(m.step_time_s, step.predicted)} | {verdict(step, others=phases)} |"
    )
    for t in phases:  # CPU ranks without a pipeline: the step's phases, medians
        lines.append(
            f"| &nbsp;&nbsp;{t.name} | {_or_na(t.predicted, '.4g')} | {_or_na(t.measured, '.4g')} | "
            f"{_ratio(t.measured, t.predicted)} | {verdict(t, whole=step)} |"
        )
    return lines


def _results_lines(m: Measured) -> list[str]:
    """The report's Results section: the final train loss, the validation losses and the skipped steps."""
    lines = [
        "",
        "## Results",
        "",
        f"- final train loss: {m.final_loss:.4f} (mean of the last {m.final_window} steps, "
        f"ppl {perplexity(m.final_loss):.2f})"
        if math.isfinite(m.final_loss)
        else "- final train loss: n/a (no finite loss in the last steps)",
    ]
    if m.best_val is None:
        lines.append(f"- validation: none ({VAL_FILE} absent or empty)")
    else:
        b, f = m.best_val, m.final_val
        lines.append(
            f"- best validation loss: {b['val_loss']:.4f} (ppl {b['val_ppl']:.2f}) at step {b['step']}, "
            f"{b['tokens']:,} tokens"
        )
        lines.append(f"- final validation loss: {f['val_loss']:.4f} (ppl {f['val_ppl']:.2f}) at step {f['step']}")
    lines.append(f"- skipped steps (optimizer step skipped, e.g. fp16 overflow): {m.skipped}")
    lines.append(f"- job events ({EVENTS_FILE}: hangs, restarts, the save interval re-planned): {m.events}")
    return lines


def job_events(run: Run) -> str:
    """One line from the run's events.jsonl: its jobs' hangs, restarts and the save interval's re-planning
    (dspipe.runtime.watchdog.events_text), and how many of its lines were unreadable; n/a when the file cannot be
    read."""
    try:
        events, left_out = read_event_lines(run.path)
    except OSError as e:
        return f"n/a ({EVENTS_FILE}: {e.strerror or e})"
    told = events_text(events)
    if left_out:
        told += f" ({left_out} line(s) of {EVENTS_FILE} unreadable: torn by a kill, or not a JSON object)"
    return told


def _basis_line(run: Run) -> str:
    """What the plan's figures rested on: the catalog's, this machine's quick measurement, or a profile (and how
    many runs corrected it)."""
    p = run.cluster.profile
    if p is None:
        return (
            f"The plan used the catalog's `{run.cluster.gpu}` figures (no profile: gen-config --measure never, or "
            f"planned on another machine)."
        )
    corrections = ", ".join(f"{k} x{v:.3g}" for k, v in p.corrections)
    folded = f" ({corrections})" if corrections else ""
    return (
        f"The plan used figures {p.basis}{folded}: {p.device}, {p.ranks} rank(s) x {p.threads_per_rank} thread(s), "
        f"{p.model}, {p.dtype}, {p.created}."
    )


def render_markdown(run: Run, *, estimate: RunEstimate, engine: dict | None, m: Measured) -> str:
    cluster = run.cluster
    lines = _configuration_lines(run, engine=engine, m=m)
    lines += _comparison_rows(estimate=estimate, m=m)
    lines += checkpoint_rows(run, estimate=estimate)
    startup_rows, startup_notes = startup_markdown(
        m.startup or read_startup(engine, estimate),
        m.of_kind("startup"),
        host_is_device=run.cluster.gpu_type.host_is_device,
    )
    lines += startup_rows
    lines += [line for note in startup_notes for line in ("", note)]
    lines += ["", _basis_line(run)]
    if cluster.gpu == "cpu":
        lines += [
            "",
            "On the `cpu` type the measured memory is the RSS of rank 0 (DeepSpeed's CPU accelerator), Python and "
            "torch included; the plan's figure for it is a rank's resident prediction (the process before its "
            "build, deepspeed.initialize's own buffers, and what the plan counts at the allocator's factor).",
        ]
    lines += _results_lines(m)
    lines += [
        "",
        "## Plots",
        "",
        f"![training and validation loss vs. tokens]({PLOTS['loss']})",
        "",
        f"![tokens/s and MFU vs. step]({PLOTS['throughput']})",
        "",
        f"![learning rate vs. step]({PLOTS['lr']})",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- writing


def _check_out(out: str | Path) -> Path:
    """Only a previous report dspipe wrote (or an empty directory) is replaced: never the run directory or
    anything else, and not a report directory holding files the report did not write."""
    out = outputs.target(out, flag="--out", expect="dir")
    outputs.claim_dir(out, kind="report", replace=True)
    return out


def write_report(run_path: str | Path, *, out: str | Path | None = None) -> tuple[Path, Measured]:
    """Write report.md and the plots into `out` (default runs/NAME/report) atomically; returns (out, figures)."""
    run = load_run(run_path)  # the one validated reader: dspipe.json (estimate included), ds_config.json
    estimate = run.estimate
    engine = load_engine(run)  # None while absent or being written
    why = engine_disagreement(run, engine)
    if why:  # its figures are not this plan's run: reported without them
        get_logger(__name__).info(f"note: {why}; the report leaves it out")
        engine = None
    steps, val = read_metrics(run)
    measured = replace(
        measure(steps, val),
        startup=read_startup(engine, estimate),
        terms=tuple(plan_terms(run, engine, steps)),
        events=job_events(run),
    )
    out = _check_out(out if out is not None else run.path / "report")
    with outputs.writing(out), staged_dir(out, tag="tmp-") as tmp:
        plot_loss(steps, val, tmp / PLOTS["loss"])
        plot_throughput(steps, measured, estimate.tokens_per_s, tmp / PLOTS["throughput"])
        plot_lr(steps, tmp / PLOTS["lr"])
        (tmp / REPORT_FILE).write_text(render_markdown(run, estimate=estimate, engine=engine, m=measured))
        outputs.write_marker(tmp, kind="report")
    return out, measured
