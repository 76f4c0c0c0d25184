"""`dspipe bench`: the run directory gen-config would write, trained for a few steps on random tokens by
DeepSpeed's launcher on this machine's devices, optionally beside a plain-PyTorch reference (DDP + AdamW).

The arithmetic and the report (table, markdown section) are plain functions of the ranks' JSON results
(`dspipe.tools.bench_worker` writes them); only `run_side` starts processes. Imports no torch.
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
from pathlib import Path

from dspipe.cluster.ports import free_port
from dspipe.errors import SpecError, cannot_read
from dspipe.jsonio import read_object
from dspipe.log import get_logger
from dspipe.planner.throughput import step_rates
from dspipe.spec.hardware import GIB
from dspipe.tools.bench_worker import PHASES

REFERENCES = {"compiled": ("reference",), "eager": ("eager",), "both": ("reference", "eager")}
"""--reference: which plain-PyTorch sides --compare runs beside dspipe."""
COLUMN = {"dspipe": "dspipe", "reference": "reference", "eager": "eager reference"}
"""Each side's column in the table."""


def summarize(
    ranks: list[dict],
    *,
    tokens_per_step: int,
    samples_per_step: int,
    steps: int,
    flops_per_token: float,
    world_size: int,
    peak_tflops: float | None,
) -> dict:
    """One side's figures from its ranks' results: the slowest rank sets the pace and the largest the memory."""
    seconds = max(r["seconds"] for r in ranks)
    out = step_rates(
        tokens=tokens_per_step * steps,
        samples=samples_per_step * steps,
        seconds=seconds,
        flops_per_token=flops_per_token,
        world_size=world_size,
        peak_tflops=peak_tflops,
    )
    out["step_time_s"] = seconds / steps
    phases = [r["phases"] for r in ranks if r.get("phases")]
    out["phases_s"] = {p: max(ph[p] for ph in phases) / steps for p in PHASES} if phases else None
    for key in ("peak_allocated", "peak_reserved", "peak_rss"):
        values = [r[key] for r in ranks if r.get(key) is not None]
        out[key] = max(values) if values else None
    out["first_loss"] = ranks[0]["first_loss"]
    out["threads"] = ranks[0].get("threads")
    out["engine"] = ranks[0].get("engine")
    return out


def ratio(dspipe: dict, reference: dict) -> float:
    """dspipe tokens/s ÷ reference tokens/s (> 1: dspipe is faster)."""
    return dspipe["tokens_per_s"] / reference["tokens_per_s"]


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:,.1f}"


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f}"


def figure_rows(sides: dict[str, dict]) -> list[tuple[str, list[str]]]:
    """(label, one cell per side) for the table and the markdown section, in order."""

    def cells(fn):
        return [fn(s) for s in sides.values()]

    def phase(p):
        return lambda s: _ms(s["phases_s"][p]) if s["phases_s"] else "n/a"

    return [
        ("tokens/s", cells(lambda s: f"{s['tokens_per_s']:,.0f}")),
        ("samples/s", cells(lambda s: f"{s['samples_per_s']:,.2f}")),
        ("TFLOP/s per GPU", cells(lambda s: f"{s['tflops_per_gpu']:.4g}")),
        ("MFU", cells(lambda s: "n/a" if s["mfu"] is None else f"{s['mfu'] * 100:.1f}%")),
        ("step time (ms)", cells(lambda s: _ms(s["step_time_s"]))),
        ("  forward (ms)", cells(phase("forward"))),
        ("  backward + grad reduction (ms)", cells(phase("backward"))),
        ("  optimizer step (ms)", cells(phase("step"))),
        ("peak allocated (GiB)", cells(lambda s: _gib(s["peak_allocated"]))),
        ("peak reserved (GiB)", cells(lambda s: _gib(s["peak_reserved"]))),
        ("peak RSS per rank (GiB)", cells(lambda s: _gib(s["peak_rss"]))),
        ("first-step loss", cells(lambda s: _loss(s["first_loss"]))),
    ]


def plan_word(est, *, on_host: bool) -> dict:
    """What plan_lines sets beside the measurement, from the plan's Estimate: its step time and its memory per GPU
    at the step's peak (per rank, resident, where the ranks are CPU processes: `on_host`)."""
    return {
        "step_s": est.step_time_s,
        "memory_bytes": est.resident_bytes if on_host else est.memory.total,
        "on_host": on_host,
    }


def plan_lines(dspipe: dict, *, plan: dict | None) -> list[str]:
    """The plan's word beside dspipe's measurement: its step time, and its memory per GPU against the peak allocated
    (per rank against the peak RSS where the ranks are CPU processes). `plan`: step_s, memory_bytes, on_host."""
    if plan is None:
        return []
    step = dspipe["step_time_s"]
    ratio_ = plan["step_s"] / step
    lines = [f"plan: step time {_ms(plan['step_s'])} ms, measured {_ms(step)} ms (plan / measured {ratio_:.2f})"]
    key, what = ("peak_rss", "peak RSS per rank") if plan["on_host"] else ("peak_allocated", "peak allocated")
    measured = dspipe.get(key)
    if plan.get("memory_bytes") and measured:
        lines.append(
            f"plan: memory {_gib(plan['memory_bytes'])} GiB, {what} {_gib(measured)} GiB "
            f"(plan / measured {plan['memory_bytes'] / measured:.2f})"
        )
    return lines


def comparison_lines(sides: dict[str, dict], *, plan: dict | None = None) -> list[str]:
    """dspipe's tokens/s ratio and first-step loss against each reference side present, then the plan's word
    (plan_lines)."""
    d, lines = sides["dspipe"], []
    for side in ("reference", "eager"):
        if side not in sides:
            continue
        r, name = sides[side], COLUMN[side]
        both = d["first_loss"] is not None and r["first_loss"] is not None
        diff = f"{abs(d['first_loss'] - r['first_loss']):.2e}" if both else "n/a"
        lines += [
            f"dspipe / {name} tokens/s: {ratio(d, r):.3f}",
            f"first-step loss: dspipe {_loss(d['first_loss'])}, {name} {_loss(r['first_loss'])}, difference {diff}",
        ]
    return lines + plan_lines(d, plan=plan)


def _loss(value: float | None) -> str:
    """A first-step loss, or n/a where the rank reported a non-finite one."""
    return "n/a" if value is None else f"{value:.8f}"


def format_table(sides: dict[str, dict], *, header: str, plan: dict | None = None) -> str:
    rows = figure_rows(sides)
    width = max(len(label) for label, _ in rows) + 2
    names = [COLUMN[side] for side in sides]
    cols = [max(len(name), *(len(c[i]) for _, c in rows)) + 2 for i, name in enumerate(names)]
    lines = [header, " " * width + "".join(name.rjust(w) for name, w in zip(names, cols, strict=True))]
    lines += [
        label.ljust(width) + "".join(c.rjust(w) for c, w in zip(cells, cols, strict=True)) for label, cells in rows
    ]
    return "\n".join(lines + comparison_lines(sides, plan=plan))


def markdown_section(
    sides: dict[str, dict], *, date: str, device: str, versions: str, command: str, setup: str, plan: dict | None = None
) -> str:
    rows = figure_rows(sides)
    lines = [
        f"### {date}: {device}",
        "",
        f"- command: `{command}`",
        f"- setup: {setup}",
        f"- versions: {versions}",
        "",
        "| | " + " | ".join(COLUMN[side] for side in sides) + " |",
        "|---|" + "---:|" * len(sides),
    ]
    lines += [f"| {label.strip()} | " + " | ".join(cells) + " |" for label, cells in rows]
    extra = comparison_lines(sides, plan=plan)
    return "\n".join(lines + ([""] + [f"{line}  " for line in extra] if extra else []) + [""])


def existing_text(path: Path) -> str:
    """The --append file's text (a title for a new file); one line when it cannot be appended to. Checked before
    anything is measured, and again when the section is written."""
    path = Path(path)
    if path.parent and not path.parent.is_dir():
        raise SpecError(f"--append {path}: directory {path.parent} does not exist")
    if path.exists() and not path.is_file():
        raise SpecError(f"--append {path}: not a regular file")
    if not path.exists():
        return "# dspipe benchmarks\n"
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as e:
        raise cannot_read(f"--append {path}", e) from None
    except UnicodeDecodeError as e:
        raise SpecError(f"--append {path}: not UTF-8 text (byte offset {e.start}): not a markdown file") from None


def append_section(path: Path, section: str) -> None:
    """Append after a blank line; create the file (with a title) if it does not exist. The file is replaced whole
    (a failed write leaves it as it was)."""
    from dspipe.atomic import write_file

    path = Path(path)
    text = existing_text(path).rstrip("\n") + "\n\n" + section
    write_file(path, text, mode=path.stat().st_mode & 0o777 if path.is_file() else 0o644)


def today() -> str:
    return datetime.date.today().isoformat()


def launcher_argv(
    *, ranks: int, run_dir: Path, side: str, warmup: int, steps: int, out: Path, master_port: int
) -> list[str]:
    """DeepSpeed's launcher on this machine's `ranks` devices, running the worker module for one side."""
    exe = shutil.which("deepspeed")
    launcher = [exe] if exe else [sys.executable, "-m", "deepspeed.launcher.runner"]
    return [
        *launcher,
        "--num_gpus",
        str(ranks),
        "--master_port",
        str(master_port),
        "--module",
        "dspipe.tools.bench_worker",
        "--run",
        str(run_dir),
        "--side",
        side,
        "--warmup",
        str(warmup),
        "--steps",
        str(steps),
        "--out",
        str(out),
    ]


def cpu_threads(*, ranks: int, cpus: int | None = None, env: dict | None = None) -> int | None:
    """Threads per CPU rank: the usable cores shared out (OMP_NUM_THREADS wins when set). Left to torch, every rank
    starts one OpenMP thread per core: ranks x cores spinning threads on the same cores, which measured 30-50x
    slower per step on this repository's shared 2-core machine."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS"):
        return None
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
    return max(1, cpus // ranks)


def run_side(
    *, ranks: int, run_dir: Path, side: str, warmup: int, steps: int, out: Path, threads: int | None = None
) -> list[dict]:
    """Launch one side and return its ranks' results (one-line error when a rank fails). `threads`: set
    OMP_NUM_THREADS for the ranks (CPU runs)."""
    argv = launcher_argv(
        ranks=ranks, run_dir=run_dir, side=side, warmup=warmup, steps=steps, out=out, master_port=free_port()
    )
    root = str(Path(__file__).resolve().parents[2])  # the ranks import this dspipe, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    r = subprocess.run(argv, env=env, capture_output=True, text=True)
    if os.environ.get("DSPIPE_VERBOSE"):
        get_logger(__name__).info(r.stdout + r.stderr)
    results = sorted(out.glob("rank*.json"))
    if r.returncode or len(results) != ranks:
        lines = [ln.strip() for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln or "error:" in ln] or lines
        raise SpecError(
            f"{side} ranks failed (exit {r.returncode}, {len(results)} of {ranks} results): "
            f"{errors[-1] if errors else 'no output'} (DSPIPE_VERBOSE=1 shows the whole output)"
        )
    return [read_object(p) for p in results]
