"""Step time while a checkpoint is saved, written in the step (--sync-save) and in the background (--async-save,
the default), side by side: a 152M GPT (12 layers, hidden 1024), fp32, ZeRO-1, 2 CPU ranks, the same run twice.

    python benchmarks/async_checkpoint.py                         # global batch 4, 16 steps, a checkpoint every 4
    python benchmarks/async_checkpoint.py --global-batch 8

Within each run, a save's cost is what the steps from the save's step to the one after which it completed took
(plus what the save held the loop up: the checkpoint meta's blocking_s, the whole write when synchronous, the copy
to host memory when not) beyond as many of the run's clean steps (no save, no write in flight; their median): the
background writer shares the cores, so its cost shows in the steps it overlaps. Printed as the step's time during a
save over a clean step's, per save (the first also allocates the host buffers the later ones reuse), with the
checkpoint's size and write time.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspipe.runtime.watchdog import read_events  # noqa: E402


def dspipe(*args) -> None:
    r = subprocess.run([sys.executable, "-m", "dspipe", *map(str, args)], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"dspipe {' '.join(map(str, args[:2]))} failed:\n{r.stderr[-3000:]}")


def launch(run: Path, *, port: int) -> None:
    launcher = shutil.which("deepspeed") or "deepspeed"
    r = subprocess.run(
        [launcher, "--num_gpus", "2", "--master_port", str(port), "run.py", "--run", str(run)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if r.returncode:
        sys.exit(f"{run.name}: launch failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def step_times(run: Path) -> dict[int, float]:
    with open(run / "metrics.csv") as f:
        return {int(r["step"]): float(r["step_time_s"]) for r in csv.DictReader(f)}


def saves(run: Path) -> dict[int, dict]:
    out = {}
    for meta_path in (run / "checkpoints").glob("global_step*/dspipe.json"):
        meta = json.loads(meta_path.read_text())
        out[meta["step"]] = meta["save"]
    return dict(sorted(out.items()))


def listed(figures: dict, key: str) -> str:
    return ", ".join(f"{f[key]:.2f}" for f in figures.values())


def cost_ratio(*, times: dict, save: dict, step: int, clean: float) -> float:
    """(steps step..completed_after_step + blocking - as many clean steps) / a clean step, + 1."""
    span = range(step, max(step, save["completed_after_step"]) + 1)
    return 1 + (sum(times[j] for j in span) + save["blocking_s"] - len(span) * clean) / clean


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--every", type=int, default=4, help="steps between checkpoints")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dspipe-async-ckpt-"))
    try:
        data = work / "data"
        dspipe("prepare-data", "--out", data, "--max-mb", "1.5", "--train-tokenizer", args.vocab)
        common = [
            "--layers",
            args.layers,
            "--hidden",
            args.hidden,
            "--heads",
            args.heads,
            "--vocab",
            args.vocab,
            "--gpus-per-node",
            2,
            "--gpu",
            "cpu",
            "--global-batch",
            args.global_batch,
            "--micro-batch",
            1,
            "--seq-len",
            args.seq_len,
            "--precision",
            "fp32",
            "--zero",
            1,
            "--offload",
            "none",
            "--pp",
            1,
            "--checkpointing",
            "none",
            "--steps",
            args.steps,
            "--warmup",
            1,
            "--eval-interval",
            0,
            "--log-interval",
            1,
            "--keep-checkpoints",
            args.steps // args.every + 1,
            "--data",
            data,
        ]
        runs = {
            "sync": ["--save-interval", args.every, "--sync-save"],
            "async": ["--save-interval", args.every, "--async-save"],
        }
        for i, (name, flags) in enumerate(runs.items()):
            dspipe("gen-config", *common, *flags, "--out", work / name)
            launch(work / name, port=29711 + i)
        print(
            f"{args.layers} layers x hidden {args.hidden}, global batch {args.global_batch} x seq {args.seq_len}, "
            f"fp32 ZeRO-1 on 2 CPU ranks, a checkpoint every {args.every} steps:"
        )
        for name in runs:
            times, figures = step_times(work / name), saves(work / name)
            busy = {j for s, f in figures.items() for j in range(s, max(s, f["completed_after_step"]) + 1)}
            clean = statistics.median(t for j, t in times.items() if j not in busy and j > 1)
            measured = {s: f for s, f in figures.items() if s < args.steps}  # the run's end waits for its last
            ratios = [cost_ratio(times=times, save=f, step=s, clean=clean) for s, f in measured.items()]
            last = list(measured.values())[-1]
            held = f", {last['rank_max_bytes'] / 2**30:.2f} GiB per rank held in host memory" if name == "async" else ""
            prepared = [e for e in read_events(work / name) if e.get("event") == "host_buffers"]
            if prepared:
                held += f" (allocated once after step {prepared[0]['step']}, in {prepared[0]['seconds']:.2f} s)"
            print(
                f"  {name:5s}: a clean step {clean:.2f} s; step during a save / clean = "
                f"{', '.join(f'{r:.3f}' for r in ratios)} (saves at {', '.join(map(str, measured))}; "
                f"mean {statistics.mean(ratios):.3f}, the first {ratios[0]:.3f}); checkpoint "
                f"{last['bytes'] / 2**30:.2f} GiB{held}; written in "
                f"{listed(measured, 'write_s')} s, the step waited {listed(measured, 'blocking_s')} s"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
