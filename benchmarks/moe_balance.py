"""Auxiliary-loss-free balancing (DeepSeek-V3's router bias, --router-bias-rate) on 2 CPU ranks: the same tiny
mixture of experts (8 experts, top-2, sigmoid scores, ep 2, ZeRO-2, no load-balancing loss) trained with and without
the bias, side by side: metrics.csv's expert_load (the busiest expert's tokens over the mean, worst sparse block; 1
is balanced) early and late in the run, and the final loss.

    python benchmarks/moe_balance.py [--steps 150] [--rate 0.01] [--data DIR]

Without --data it prepares the offline corpus (the Python standard library's source, a 1024-token BPE) once under
the output directory.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = [
    "--model",
    "tiny-llama",
    "--layers",
    "2",
    "--hidden",
    "64",
    "--heads",
    "4",
    "--seq-len",
    "64",
    "--experts",
    "8",
    "--experts-per-token",
    "2",
    "--expert-ffn",
    "48",
    "--router-score",
    "sigmoid",
    "--aux-loss-coef",
    "0",
]
LAYOUT = [
    "--gpus-per-node",
    "2",
    "--gpu",
    "cpu",
    "--global-batch",
    "16",
    "--micro-batch",
    "8",
    "--precision",
    "fp32",
    "--zero",
    "2",
    "--ep",
    "2",
    "--checkpointing",
    "none",
    "--warmup",
    "5",
    "--lr",
    "3e-3",
    "--eval-interval",
    "0",
    "--save-interval",
    "0",
    "--log-interval",
    "50",
]


def run(*args, **kwargs) -> None:
    done = subprocess.run([str(a) for a in args], cwd=ROOT, capture_output=True, text=True, **kwargs)
    if done.returncode:
        sys.exit(f"{' '.join(map(str, args[:4]))} ... failed:\n{done.stderr[-3000:]}")


def train(out: Path, *, data: Path, steps: int, rate: float) -> list[dict]:
    run(
        sys.executable,
        "-m",
        "dspipe",
        "gen-config",
        *MODEL,
        *LAYOUT,
        "--router-bias-rate",
        rate,
        "--steps",
        steps,
        "--data",
        data,
        "--out",
        out,
    )
    run("deepspeed", "--num_gpus", "2", "run.py", "--run", out)
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rate", type=float, default=0.01)
    ap.add_argument("--data", type=Path)
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "dspipe-moe-balance")
    args = ap.parse_args()
    data = args.data or args.out / "stdlib"
    if not args.data:  # a no-op once prepared
        run(
            sys.executable,
            "-m",
            "dspipe",
            "prepare-data",
            "--out",
            data,
            "--train-tokenizer",
            "1024",
            "--max-mb",
            "1.5",
        )
    print(f"{'router bias rate':>16} | {'expert_load, steps 1-10':>23} | {'last 50 steps':>13} | final loss")
    for rate in (0.0, args.rate):
        rows = train(args.out / f"rate{rate:g}", data=data, steps=args.steps, rate=rate)
        loads = [float(r["expert_load"]) for r in rows]
        print(
            f"{rate:>16g} | {statistics.mean(loads[:10]):>23.3f} | {statistics.mean(loads[-50:]):>13.3f} | "
            f"{float(rows[-1]['loss']):.4f}"
        )


if __name__ == "__main__":
    main()
