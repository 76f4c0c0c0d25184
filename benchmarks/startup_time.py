"""Time from the launch to the first step, for the code at a git revision (before) and for this
checkout (after), on the same run: by default tinyllama-1.1b, ZeRO-3, bf16, 2 CPU ranks, seq 64, one step. The
revision is checked out into a temporary git worktree and imported first (PYTHONPATH); the ranks are killed when
rank 0 says the first step is next (on 2 cores and 24 GiB a tinyllama step does not fit, before or after).

    python benchmarks/startup_time.py --before afd062a
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd, *, cwd, env=None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})})


READY = "starting fresh from step 0"
"""What rank 0 prints, in this checkout and before it, once the engine is up and the first step is next."""


def timed_launch(*, code: Path, run_dir: Path, ranks: int, port: int) -> tuple[float, float | None, str]:
    """(seconds from the launch to rank 0's line that the first step is next, the worst rank's start-up peak RSS
    in MiB if the code records it, status); the ranks are then killed (nothing trains, nothing is saved)."""
    import os
    import signal

    launcher = shutil.which("deepspeed") or "deepspeed"
    start = time.perf_counter()
    proc = subprocess.Popen(
        [launcher, "--num_gpus", str(ranks), "--master_port", str(port), "run.py", "--run", str(run_dir)],
        cwd=code,
        env={**os.environ, "PYTHONPATH": str(code)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    tail = []
    for line in proc.stdout:
        tail = (tail + [line])[-5:]
        if READY in line:
            seconds = time.perf_counter() - start
            time.sleep(2)  # engine.json is written right after the line
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            engine = run_dir / "engine.json"
            startup = json.loads(engine.read_text()).get("startup") if engine.is_file() else None
            return seconds, max(startup["peak_rss_mib"]) if startup else None, "ok"
    proc.wait()
    return time.perf_counter() - start, None, f"failed (exit {proc.returncode}): {''.join(tail)[-300:]!r}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="git revision of the 'before' code")
    ap.add_argument("--model", default="tinyllama-1.1b")
    ap.add_argument("--zero", default="3")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--data", default=None, help="a prepared data directory (default: prepare a small one)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dspipe-startup-time-"))
    before = work / "before"
    r = run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=ROOT)
    if r.returncode:
        sys.exit(r.stderr)
    try:
        data = args.data
        if data is None:
            data = work / "data"
            r = run(
                [
                    sys.executable,
                    "-m",
                    "dspipe",
                    "prepare-data",
                    "--out",
                    str(data),
                    "--max-mb",
                    "1.5",
                    "--train-tokenizer",
                    "1024",
                ],
                cwd=ROOT,
            )
            if r.returncode:
                sys.exit(r.stderr)
        rows = []
        for label, code in (("before", before), ("after", ROOT)):
            run_dir = work / f"run-{label}"
            r = run(
                [
                    sys.executable,
                    "-m",
                    "dspipe",
                    "gen-config",
                    "--model",
                    args.model,
                    "--gpus-per-node",
                    str(args.ranks),
                    "--gpu",
                    "cpu",
                    "--global-batch",
                    str(args.ranks),
                    "--micro-batch",
                    "1",
                    "--seq-len",
                    "64",
                    "--precision",
                    args.precision,
                    "--zero",
                    args.zero,
                    "--offload",
                    "none",
                    "--no-offload-params",
                    "--pp",
                    "1",
                    "--tp",
                    "1",
                    "--checkpointing",
                    "none",
                    "--steps",
                    "2",
                    "--warmup",
                    "1",
                    "--eval-interval",
                    "0",
                    "--data",
                    str(data),
                    "--out",
                    str(run_dir),
                ],
                cwd=code,
                env={"PYTHONPATH": str(code)},
            )
            if r.returncode:
                sys.exit(f"{label}: gen-config: {r.stderr}")
            rows.append((label, *timed_launch(code=code, run_dir=run_dir, ranks=args.ranks, port=29651)))
        print(
            f"{args.model}, ZeRO-{args.zero}, {args.precision}, {args.ranks} CPU ranks, seq 64: seconds from the "
            f"launch to the first step"
        )
        for label, seconds, rss, status in rows:
            print(
                f"  {label:7s} {seconds:7.1f} s   worst rank's start-up peak RSS "
                f"{'not recorded' if rss is None else f'{rss:,.0f} MiB'}   {status}"
            )
        if all(r[3] == "ok" for r in rows):
            print(f"  after / before = {rows[1][1] / rows[0][1]:.2f}")
    finally:
        run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
