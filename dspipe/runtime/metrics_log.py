"""Rank 0's record of a run: metrics.csv and val_metrics.csv (columns in dspipe.planner.throughput), TensorBoard events
through the engine's monitor (runs/NAME/monitor/), and the console lines.

Crash consistency (a `kill -9` may land anywhere): every file is opened with its header already on disk (written
atomically), each row is one write + flush, and a start at step S first rewrites each CSV, atomically, as the
header plus exactly one row per step <= S (a torn last line, rows of another shape, duplicates and the rows of
steps after S, which the run replays, are dropped; the last complete row of a step wins). TensorBoard: every tag
is keyed by the optimizer step (DeepSpeed's own sample-keyed `Train/Samples/*` events are switched off), and a
start at step S writes a `SessionLog.START` event at step S + 1 (what torch's `SummaryWriter(purge_step=S + 1)`
writes): TensorBoard then drops every earlier-written event at steps > S, so each step shows one value. DeepSpeed's
csv monitor files (monitor/csv/) are trimmed the same way as metrics.csv. The rows of metrics.csv that a resume
replays are not lost: they are appended to metrics.rewound.csv (header, then each row as it was), which shows what
the steps looked like before the crash, and lets a test compare them with their replay."""

from __future__ import annotations

import csv
import io
import re
import sys
from pathlib import Path

from dspipe.atomic import write_file
from dspipe.errors import SpecError, cannot_read
from dspipe.log import get_logger
from dspipe.planner.throughput import STEP_COLUMNS, VAL_COLUMNS
from dspipe.rundir import VAL_FILE
from dspipe.runtime.progress import Progress

REWOUND_FILE = "metrics.rewound.csv"
"""metrics.csv's rows of the steps a resume replayed, as first written."""
SAMPLE_KEYED_PREFIX = "Train_Samples_"  # DeepSpeed's csv monitor files keyed by samples (written before dspipe 11)


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _line(fields) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(fields)
    return buf.getvalue()


def complete_lines(text: str) -> list[list[str]]:
    """The lines of a CSV written line by line, parsed; a last line without its newline (a write cut short) is
    dropped, and so are blank lines."""
    lines = text.split("\n")[:-1]  # the piece after the last newline is empty or torn
    return [row for row in csv.reader(lines) if row]


_STEP = re.compile(r"[0-9]{1,18}", re.ASCII)


def _is_int(text: str) -> bool:
    """A step number: ASCII digits, at most 18 ('\u0663'.isdigit() is True; int() refuses 4,301 digits)."""
    return _STEP.fullmatch(text.strip()) is not None


def repair_rows(
    path: Path, *, upto: int, columns: tuple[str, ...] | None = None, rewound: Path | None = None
) -> int | None:
    """Rewrite the CSV at `path` atomically as a header plus one row per step 1..`upto` that it holds (ascending;
    the last complete row written for a step wins): torn lines, rows whose field count differs from the header's,
    and rows after `upto` are dropped. The header is `columns` (old rows are mapped by column name; a file whose
    header is missing is read as `columns`), or the file's own header when `columns` is None (then a file without
    a header is left alone). A missing file is written with the header alone. Returns the rows kept, or None when
    the file was left alone. `rewound`: a CSV the complete rows after `upto` are appended to (with the header when
    it is new), before the rewrite."""
    path = Path(path)
    try:
        rows = complete_lines(path.read_bytes().decode("utf-8", errors="replace")) if path.is_file() else []
    except OSError as e:
        raise cannot_read(path, e, tail="; move the file away to let the run write a new one") from None
    if rows and not _is_int(rows[0][0]):
        header, rows = tuple(rows[0]), rows[1:]
    elif columns is None:
        return None
    else:
        header = columns
    out_columns = columns or header
    if "step" not in header:
        raise SpecError(
            f"{path}: no 'step' column in its header {','.join(header)} (expected "
            f"{','.join(out_columns)}); move the file away to let the run write a new one"
        )
    at = header.index("step")
    by_step: dict[int, list[str]] = {}
    later = [row for row in rows if len(row) == len(header) and _is_int(row[at]) and int(row[at]) > upto]
    if rewound is not None and later:
        _append_rows(Path(rewound), header=header, rows=later)
    for row in rows:
        if len(row) == len(header) and _is_int(row[at]) and 1 <= int(row[at]) <= upto:
            named = dict(zip(header, row, strict=True))
            by_step[int(row[at])] = [named.get(c, "") for c in out_columns]
    write_file(path, _line(out_columns) + "".join(_line(by_step[s]) for s in sorted(by_step)))
    return len(by_step)


def _append_rows(path: Path, *, header: tuple[str, ...], rows: list[list[str]]) -> None:
    """Append `rows` to the CSV at `path` (the header first when the file is new or empty); one write."""
    fresh = not path.is_file() or path.stat().st_size == 0
    with open(path, "a", newline="") as f:
        f.write((_line(header) if fresh else "") + "".join(_line(r) for r in rows))


class _Csv:
    """Append rows to a CSV whose header and earlier rows `repair_rows` has just put in order."""

    def __init__(self, path: Path, columns: tuple[str, ...], *, resumed_at: int, rewound: Path | None = None):
        self.path, self.columns = Path(path), columns
        self.kept = repair_rows(self.path, upto=resumed_at, columns=columns, rewound=rewound)
        self.file = open(self.path, "a", newline="")

    def write(self, row: dict) -> None:
        self.file.write(_line([_fmt(row[c]) for c in self.columns]))  # one write of one whole line
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def purge_event(step: int):
    """The event TensorBoard reads as "a run (re)started here": it drops every earlier-written event at >= step."""
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog

    return Event(step=step, session_log=SessionLog(status=SessionLog.START))


def prepare_monitor(monitor, *, resumed_at: int) -> None:
    """On rank 0's monitor (DeepSpeed's MonitorMaster): purge the TensorBoard steps after `resumed_at` and trim the
    csv monitor files to the steps up to it."""
    if monitor is None:
        return
    tb = getattr(monitor, "tb_monitor", None)
    if tb is not None and tb.summary_writer is not None:
        writer = tb.summary_writer
        writer._get_file_writer().add_event(purge_event(resumed_at + 1))
        writer.flush()
    cm = getattr(monitor, "csv_monitor", None)
    if cm is not None and cm.log_dir and Path(cm.log_dir).is_dir():
        for f in sorted(Path(cm.log_dir).glob("*.csv")):
            if not f.name.startswith(SAMPLE_KEYED_PREFIX) and repair_rows(f, upto=resumed_at) is not None:
                cm.filenames.append(f.stem)  # it has its header: DeepSpeed must not write another one


def finish_monitors(monitor) -> None:
    """End the W&B run and the Comet experiment DeepSpeed's monitor started, so that everything logged is written
    (offline: to the local run directory) before the rank exits."""
    wandb_monitor = getattr(monitor, "wandb_monitor", None)
    if wandb_monitor is not None and wandb_monitor.enabled:
        import wandb

        wandb.finish()
    comet_monitor = getattr(monitor, "comet_monitor", None)
    experiment = getattr(comet_monitor, "experiment", None)
    if experiment is not None:
        experiment.end()


class RunLog:
    """Everything rank 0 writes per step and per evaluation. Other ranks get a RunLog with `enabled=False`."""

    def __init__(
        self,
        run_path: Path,
        *,
        monitor,
        enabled: bool,
        resumed_at: int,
        log_interval: int,
        steps: int,
        validating: bool,
        tokens_per_step: int = 0,
        terminal: bool | None = None,
        val_columns: tuple[str, ...] = (),
        step_columns: tuple[str, ...] = (),
    ):
        self.enabled, self.monitor, self.log_interval, self.steps = enabled, monitor, log_interval, steps
        self.progress = Progress(total_steps=steps, tokens_per_step=tokens_per_step, start_step=resumed_at)
        self.terminal = sys.stdout.isatty() if terminal is None else terminal
        self._bar_shown = False
        self.steps_csv = self.val_csv = None
        if monitor is not None:
            monitor.enabled = False  # DeepSpeed's engine writes its Train/Samples/* events only while this is set
        if enabled:
            prepare_monitor(monitor, resumed_at=resumed_at)
            # a mixture-of-experts model adds aux_loss (its load-balancing loss; `loss` stays the LM loss),
            # expert_load (the step's load imbalance) and dropped_routes (routes its capacity dropped; 0 dropless)
            self.steps_csv = _Csv(
                Path(run_path) / "metrics.csv",
                STEP_COLUMNS + tuple(step_columns),
                resumed_at=resumed_at,
                rewound=Path(run_path) / REWOUND_FILE,
            )
            if validating:
                # a blend adds one val_loss_NAME column per source (dspipe.runtime.evaluate.val_columns)
                self.val_csv = _Csv(Path(run_path) / VAL_FILE, VAL_COLUMNS + tuple(val_columns), resumed_at=resumed_at)
            if resumed_at and self.steps_csv.kept < resumed_at:
                self.say(
                    f"dspipe: note: {self.steps_csv.path} holds rows for {self.steps_csv.kept} of the "
                    f"{resumed_at} steps before the resume (the others were lost with the file)",
                    diagnostic=True,
                )

    def say(self, line: str, *, diagnostic: bool = False) -> None:
        """A result line (a step's or a validation's figures) on stdout; a diagnostic (a note, progress) through
        the "dspipe" logger (stderr, dspipe.log)."""
        if self.enabled:
            if self._bar_shown:  # a log line replaces the bar; the bar comes back after the next step
                print("\r\033[K", end="", flush=True)
                self._bar_shown = False
            if diagnostic:
                get_logger(__name__).info(line)
            else:
                print(line, flush=True)

    def _events(self, prefix: str, row: dict, step: int) -> None:
        if self.monitor is not None:
            self.monitor.write_events(
                [(f"{prefix}/{k}", float(v), step) for k, v in row.items() if k != "step" and v is not None and v != ""]
            )

    def step(self, row: dict) -> None:
        """One optimizer step: a CSV row, TensorBoard scalars, and a console line every log_interval steps."""
        if not self.enabled:
            return
        self.steps_csv.write(row)
        self._events("Train", row, row["step"])
        s = row["step"]
        self.progress.update(s, row["step_time_s"])
        if s == 1 or s % self.log_interval == 0 or s == self.steps:
            mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
            norm = "-" if row["grad_norm"] is None else f"{row['grad_norm']:.3f}"
            aux = f" | aux {row['aux_loss']:.4f}" if row.get("aux_loss") is not None else ""
            aux += f" | load {row['expert_load']:.2f}" if row.get("expert_load") is not None else ""
            aux += f" | dropped {row['dropped_routes']}" if row.get("dropped_routes") else ""  # only a capacity's
            self.say(
                f"step {s:>5}/{self.steps} | loss {row['loss']:.4f}{aux} | lr {row['lr']:.2e} | gnorm {norm} | "
                f"{row['tokens_per_s']:,.0f} tok/s | {row['samples_per_s']:,.1f} samples/s | "
                f"{row['tflops_per_gpu']:.3g} TFLOP/s/gpu | MFU {mfu} | mem {row['mem_allocated_gib']:.2f}/"
                f"{row['mem_reserved_gib']:.2f} GiB | {1000 * row['step_time_s']:.0f} ms"
            )
            self.say(f"progress: {self.progress.fields()}", diagnostic=True)
        if self.terminal and s < self.steps:  # a bar that rewrites itself between the log lines
            print("\r\033[K" + self.progress.bar(), end="", flush=True)
            self._bar_shown = True

    def validation(self, row: dict) -> None:
        if not self.enabled:
            return
        self.val_csv.write(row)  # validating=True whenever validation runs
        self._events("Validation", row, row["step"])
        extra = self.val_csv.columns[len(VAL_COLUMNS) :]  # a blend's per-source losses
        per_source = "".join(f" | {c[len('val_loss_') :]} {row[c]:.4f}" for c in extra)
        self.say(
            f"step {row['step']:>5}/{self.steps} | validation loss {row['val_loss']:.4f} | "
            f"perplexity {row['val_ppl']:.2f}{per_source}"
        )

    def close(self) -> None:
        if self.enabled:
            if self._bar_shown:
                print("\r\033[K", end="", flush=True)
                self._bar_shown = False
            self.steps_csv.close()
            if self.val_csv:
                self.val_csv.close()
            if self.monitor is not None and getattr(self.monitor, "tb_monitor", None) is not None:
                self.monitor.tb_monitor.summary_writer.flush()
            finish_monitors(self.monitor)
