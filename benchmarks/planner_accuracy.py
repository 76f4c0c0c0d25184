"""Planner vs. live DeepSpeed engines on 2 CPU ranks: predicted model-state bytes per rank against the tensors
the engine actually holds (dspipe.runtime.census), for ZeRO 0-3 and pp=2. Writes docs/planner-accuracy.md.

    python benchmarks/planner_accuracy.py [--write]
"""
from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dspipe.planner.estimate import estimate  # noqa: E402
from dspipe.rundir import load_run  # noqa: E402

# ~31.5M parameters: big enough that model states dominate everything else a rank holds.
MODEL = ["--model", "tiny", "--layers", "4", "--hidden", "768", "--heads", "12", "--seq-len", "64", "--vocab", "4096"]
CONFIGS = {  # every layout pinned (the planner would pick tp 2 for some of these on 2 CPU ranks)
    "zero0": ["--zero", "0", "--tp", "1", "--sp", "1"],
    "zero1": ["--zero", "1", "--tp", "1", "--sp", "1"],
    "zero2": ["--zero", "2", "--tp", "1", "--sp", "1"],
    "zero3": ["--zero", "3", "--tp", "1", "--sp", "1"],
    "pp2-zero1": ["--zero", "1", "--pp", "2", "--tp", "1", "--sp", "1"],
    "tp2-zero1": ["--zero", "1", "--tp", "2", "--sp", "1"],
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(name: str, workdir: Path) -> dict:
    """Generate the run, launch 2 ranks, return predicted and measured (largest rank) bytes by category."""
    run_dir = workdir / name
    gen = [sys.executable, "-m", "dspipe", "gen-config", *MODEL, "--gpus-per-node", "2", "--gpu", "cpu",
           "--global-batch", "2", "--micro-batch", "1", "--steps", "10", "--warmup", "1", "--precision", "bf16",
           "--offload", "none", "--no-offload-params", "--checkpointing", "none", "--pp", "1", *CONFIGS[name],
           "--data", str(workdir / "no-data"), "--out", str(run_dir), "--force"]
    subprocess.run(gen, cwd=ROOT, check=True, capture_output=True)
    launcher = [shutil.which("deepspeed")] if shutil.which("deepspeed") else [sys.executable, "-m",
                                                                              "deepspeed.launcher.runner"]
    out = workdir / f"census-{name}"
    r = subprocess.run([*launcher, "--num_gpus", "2", "--master_port", str(_port()), "benchmarks/measure_memory.py",
                        "--run", str(run_dir), "--out-dir", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    if r.returncode:
        raise RuntimeError(f"{name}: launch failed\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]
    measured = max(ranks, key=lambda c: c["total"])
    run = load_run(run_dir)
    est = estimate(model=run.model, cluster=run.cluster, plan=run.plan)
    return {"name": name, "num_params": run.plan.num_params, "predicted": est.memory.model_states,
            "measured": measured["total"], "measured_by_kind": {k: measured[k] for k in
                                                                ("params", "grads", "optimizer", "buffers")}}


def table(rows: list[dict]) -> str:
    lines = ["| config | params | predicted MiB | measured MiB | error | measured params / grads / optimizer / "
             "buffers MiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        k = r["measured_by_kind"]
        err = (r["predicted"] - r["measured"]) / r["measured"] * 100
        lines.append(f"| {r['name']} | {r['num_params'] / 1e6:.1f}M | {r['predicted'] / 2**20:.1f} | "
                     f"{r['measured'] / 2**20:.1f} | {err:+.2f}% | {k['params'] / 2**20:.1f} / {k['grads'] / 2**20:.1f}"
                     f" / {k['optimizer'] / 2**20:.1f} / {k['buffers'] / 2**20:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", action="store_true", help="rewrite the table in docs/planner-accuracy.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(name, Path(tmp)) for name in CONFIGS]
    text = table(rows)
    print(text)
    if args.write:
        doc = ROOT / "docs" / "planner-accuracy.md"
        head, _, tail = doc.read_text().partition("<!-- table -->\n")
        rest = tail.split("\n\n", 1)[1] if "\n\n" in tail else ""  # the text after the table stays
        doc.write_text(f"{head}<!-- table -->\n{text}\n\n{rest}")


if __name__ == "__main__":
    main()
