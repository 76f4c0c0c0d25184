"""Rank 0's record of a run: metrics.csv and val_metrics.csv (columns in dspipe.planner.throughput), TensorBoard events
through the engine's monitor (runs/NAME/monitor/), and the console lines."""
from __future__ import annotations

import csv
from pathlib import Path

from dspipe.runtime import checkpoint as ckpt
from dspipe.planner.throughput import STEP_COLUMNS, VAL_COLUMNS
from dspipe.rundir import VAL_FILE

GIB = 2 ** 30


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value)


class _Csv:
    """Append rows to a CSV; on resume keep the rows up to the resumed step and continue after them."""

    def __init__(self, path: Path, columns: tuple[str, ...], *, resumed_at: int):
        if resumed_at:
            ckpt.trim_metrics(path, resumed_at)
        append = bool(resumed_at) and path.is_file()
        self.file = open(path, "a" if append else "w", newline="")
        self.writer = csv.writer(self.file)
        self.columns = columns
        if not append:
            self.writer.writerow(columns)

    def write(self, row: dict) -> None:
        self.writer.writerow([_fmt(row[c]) for c in self.columns])
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class RunLog:
    """Everything rank 0 writes per step and per evaluation. Other ranks get a RunLog with `enabled=False`."""

    def __init__(self, run_path: Path, *, monitor, enabled: bool, resumed_at: int, log_interval: int,
                 steps: int, validating: bool):
        self.enabled, self.monitor, self.log_interval, self.steps = enabled, monitor, log_interval, steps
        self.steps_csv = self.val_csv = None
        if enabled:
            self.steps_csv = _Csv(Path(run_path) / "metrics.csv", STEP_COLUMNS, resumed_at=resumed_at)
            if validating:
                self.val_csv = _Csv(Path(run_path) / VAL_FILE, VAL_COLUMNS, resumed_at=resumed_at)

    def say(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def _events(self, prefix: str, row: dict, step: int) -> None:
        if self.monitor is not None and self.monitor.enabled:
            self.monitor.write_events([(f"{prefix}/{k}", float(v), step) for k, v in row.items()
                                       if k != "step" and v is not None and v != ""])

    def step(self, row: dict) -> None:
        """One optimizer step: a CSV row, TensorBoard scalars, and a console line every log_interval steps."""
        if not self.enabled:
            return
        self.steps_csv.write(row)
        self._events("Train", row, row["step"])
        s = row["step"]
        if s == 1 or s % self.log_interval == 0 or s == self.steps:
            mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
            norm = "-" if row["grad_norm"] is None else f"{row['grad_norm']:.3f}"
            self.say(f"step {s:>5}/{self.steps} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | gnorm {norm} | "
                     f"{row['tokens_per_s']:,.0f} tok/s | {row['samples_per_s']:,.1f} samples/s | "
                     f"{row['tflops_per_gpu']:.3g} TFLOP/s/gpu | MFU {mfu} | mem {row['mem_allocated_gib']:.2f}/"
                     f"{row['mem_reserved_gib']:.2f} GiB | {1000 * row['step_time_s']:.0f} ms")

    def validation(self, row: dict) -> None:
        if not self.enabled:
            return
        self.val_csv.write(row)  # validating=True whenever validation runs
        self._events("Validation", row, row["step"])
        self.say(f"step {row['step']:>5}/{self.steps} | validation loss {row['val_loss']:.4f} | "
                 f"perplexity {row['val_ppl']:.2f}")

    def close(self) -> None:
        if self.enabled:
            self.steps_csv.close()
            if self.val_csv:
                self.val_csv.close()
            if self.monitor is not None and getattr(self.monitor, "tb_monitor", None) is not None:
                self.monitor.tb_monitor.summary_writer.flush()
