"""Does the plan keep its word on this machine? (issue 40) Plan, run and report the demo's GPT (4 x 128, seq 128,
2 ranks) and print each run's predicted vs measured tokens/s, step time, peak memory (a CPU rank's RSS) and time to
the first step's end, side by side:

    demo          ZeRO-1 planned on this machine's quick measurement (gen-config --measure auto: the first plan
                  here measures, later ones read the cache)
    demo-jit      the same with an empty op cache (TORCH_EXTENSIONS_DIR): the launch compiles DeepSpeed's ops and
                  the plan says so (--jit; ~3 minutes more on 2 cores)
    zero3, pp2    a ZeRO-3 and a 2-stage pipeline run of the same GPT, planned with the profile folded from the demo
                  run alone (`dspipe calibrate --from-run`): the correction must carry to other layouts

    python benchmarks/plan_word.py              # demo, zero3, pp2 (~6 minutes on 2 CPU cores)
    python benchmarks/plan_word.py --jit        # and demo-jit
    python benchmarks/plan_word.py --steps 300  # the demo's own length
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT = ["--model", "tiny", "--layers", "4", "--hidden", "128", "--heads", "4", "--seq-len", "128", "--vocab", "4096"]
CPU = ["--gpus-per-node", "2", "--gpu", "cpu", "--precision", "fp32", "--micro-batch", "8", "--global-batch", "32"]
CPU += ["--offload", "none", "--checkpointing", "none", "--tp", "1", "--sp", "1"]
ROWS = ("tokens/s (job)", "step time (s)", "peak RSS per rank (GiB)", "time to first step's end (s)")


def sh(*cmd, env=None) -> str:
    r = subprocess.run(
        [str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    if r.returncode:
        sys.exit(f"{' '.join(map(str, cmd[:4]))}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout + r.stderr


def dspipe(*args, env=None) -> str:
    return sh(sys.executable, "-m", "dspipe", *args, env=env)


def train(run: Path, *, flags: list[str], steps: int, env=None) -> dict[str, tuple[str, str, str, str]]:
    """gen-config, launch, report: the report's rows of ROWS as (predicted, measured, ratio, verdict)."""
    dspipe(
        "gen-config", *GPT, *CPU, *flags, "--steps", steps, "--warmup", min(20, steps // 5), "--log-interval",
        max(1, steps // 4), "--eval-interval", "0", "--data", "data/stdlib", "--out", run, "--force", env=env,
    )  # fmt: skip
    sh(shutil.which("deepspeed") or "deepspeed", "--num_gpus", "2", "run.py", "--run", run, "--restart", env=env)
    dspipe("report", run)
    return report_rows(run)


def report_rows(run: Path) -> dict[str, tuple[str, str, str, str]]:
    """The report's rows of ROWS as (predicted, measured, ratio, verdict)."""
    rows = {}
    for line in (run / "report" / "report.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells and cells[0] in ROWS:
            rows[cells[0]] = (cells[1], cells[2].split(" (")[0].split()[-1], cells[3], cells[4].split(";")[0])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--jit", action="store_true", help="also a launch that compiles DeepSpeed's ops")
    ap.add_argument("--out", default="runs/plan-word", help="where the run directories go")
    ap.add_argument("--demo", default=None, help="an existing demo run directory to fold (runs/demo): not run again")
    args = ap.parse_args()
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    dspipe("prepare-data", "--out", "data/stdlib", "--train-tokenizer", "4096")
    demo = Path(args.demo) if args.demo else out / "demo"
    results = {"demo": report_rows(demo) if args.demo else train(demo, flags=["--zero", "1"], steps=args.steps)}
    if args.jit:
        with tempfile.TemporaryDirectory(prefix="dspipe-ext-") as ext:
            env = {"TORCH_EXTENSIONS_DIR": ext}
            results["demo-jit"] = train(out / "demo-jit", flags=["--zero", "1"], steps=args.steps, env=env)
    profile = out / "demo-folded.json"
    print(dspipe("calibrate", "--from-run", demo, "--out", profile).strip())
    for name, flags in (("zero3", ["--zero", "3", "--pp", "1"]), ("pp2", ["--zero", "1", "--pp", "2"])):
        results[name] = train(out / name, flags=[*flags, "--profile", profile], steps=args.steps)
    print(f"\n{'run':<10} {'figure':<30} {'predicted':>11} {'measured':>11} {'ratio':>6}  verdict")
    for name, rows in results.items():
        for row in ROWS:
            pred, meas, ratio, verdict = rows.get(row, ("n/a", "n/a", "n/a", "n/a"))
            print(f"{name:<10} {row:<30} {pred:>11} {meas:>11} {ratio:>6}  {verdict}")


if __name__ == "__main__":
    main()
