"""Census of DeepSpeed's checkpoint files: one save of a tiny GPT on 2 CPU ranks for each layout (ZeRO 0-3 in fp32
and bf16, pp 2, tp 2), every file's size, written to tests/data/checkpoint_census.json, which
tests/unit/planner/test_checkpoint_size.py holds dspipe.planner.checkpoint_size to (about 40 s a layout).

    python benchmarks/census/checkpoints.py [--out tests/data/checkpoint_census.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPE = ["--model", "tiny", "--layers", "2", "--hidden", "256", "--heads", "4", "--vocab", "4096", "--seq-len", "64"]
MOE = "--model tiny-llama --experts 4 --experts-per-token 2 --expert-ffn 512 --ffn 704 --kv-heads 2"
LAYOUTS = {  # the tiny GPT of SHAPE (MOE: a tiny-llama with 4 experts instead)
    "z0fp32": "--zero 0 --precision fp32",
    "z0bf16": "--zero 0 --precision bf16",
    "z1fp32": "--zero 1 --precision fp32",
    "z1bf16": "--zero 1 --precision bf16",
    "z2bf16": "--zero 2 --precision bf16",
    "z3bf16": "--zero 3 --precision bf16",
    "z3fp32": "--zero 3 --precision fp32",
    "pp2bf16": "--zero 1 --pp 2 --precision bf16",
    "tp2bf16": "--zero 1 --tp 2 --precision bf16",
    "pp2z0fp32": "--zero 0 --pp 2 --precision fp32",
    "pp2z0bf16": "--zero 0 --pp 2 --precision bf16",
    "sp2z1fp32": "--zero 1 --sp 2 --tp 1 --pp 1 --precision fp32 --offload none",
    "sp2z1bf16": "--zero 1 --sp 2 --tp 1 --pp 1 --precision bf16 --offload none",
    "sp2z2bf16": "--zero 2 --sp 2 --tp 1 --pp 1 --precision bf16 --offload none",
    "sp2z3bf16": "--zero 3 --sp 2 --tp 1 --pp 1 --precision bf16 --offload none",
    "tp2z2bf16": "--zero 2 --tp 2 --pp 1 --sp 1 --precision bf16 --offload none",
    "tp2z3bf16": "--zero 3 --tp 2 --pp 1 --sp 1 --precision bf16 --offload none",
    "pp2z1fp32": "--zero 1 --pp 2 --tp 1 --sp 1 --precision fp32 --offload none",
    "tp2z1fp32": "--zero 1 --tp 2 --pp 1 --sp 1 --precision fp32 --offload none",
    "z2fp32": "--zero 2 --tp 1 --pp 1 --sp 1 --precision fp32 --offload none",
    "z2bf16offload": "--zero 2 --tp 1 --pp 1 --sp 1 --precision bf16 --offload cpu",
    "pp2z1bf16offload": "--zero 1 --pp 2 --tp 1 --sp 1 --precision bf16 --offload cpu",
    "moez1ep2": MOE + " --zero 1 --ep 2 --tp 1 --pp 1 --sp 1 --precision bf16 --offload none",
    "moez2ep2": MOE + " --zero 2 --ep 2 --tp 1 --pp 1 --sp 1 --precision bf16 --offload none",
    "moez2ep1": MOE + " --zero 2 --ep 1 --tp 1 --pp 1 --sp 1 --precision bf16 --offload none",
    "moez3ep2": MOE + " --zero 3 --ep 2 --tp 1 --pp 1 --sp 1 --precision bf16 --offload none",
    "moepp2z1": MOE + " --zero 1 --ep 1 --pp 2 --tp 1 --sp 1 --precision bf16 --offload none",
}


def run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "data" / "checkpoint_census.json"))
    ap.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS))
    args = ap.parse_args()
    out = {
        "note": "DeepSpeed checkpoint files of one save, 2 CPU ranks, tiny GPT (layers 2, hidden 256, heads 4, "
        "vocab 4096, seq 64), global batch 8, micro 2 (benchmarks/census/checkpoints.py)",
        "layouts": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        run([sys.executable, "-m", "dspipe", "prepare-data", "--out", str(data), "--train-tokenizer", "4096"])
        for name in args.layouts:
            flags = LAYOUTS[name]
            run_dir = Path(tmp) / name
            run(
                [
                    sys.executable,
                    "-m",
                    "dspipe",
                    "gen-config",
                    *SHAPE,
                    "--gpus-per-node",
                    "2",
                    "--gpu",
                    "cpu",
                    "--global-batch",
                    "8",
                    "--micro-batch",
                    "2",
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
                    "--sync-save",
                    *flags.split(),
                ]
            )
            run(
                [
                    sys.executable,
                    "-m",
                    "deepspeed.launcher.runner",
                    "--num_gpus",
                    "2",
                    "--module",
                    "dspipe.runtime.entry",
                    "--run",
                    str(run_dir),
                ]
            )
            tag = sorted((run_dir / "checkpoints").glob("global_step*"))[-1]
            files = {p.name: p.stat().st_size for p in sorted(tag.glob("*.pt"))}
            out["layouts"][name] = {"flags": flags.split(), "files": files}
            print(name, sum(files.values()), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
