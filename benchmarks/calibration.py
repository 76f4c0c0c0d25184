"""Predicted vs measured step time of the CPU demo, with and without a `dspipe calibrate` profile.

Runs, on this machine: `dspipe calibrate` at the demo's model and micro-batch (2 ranks at once, the cores shared
out), `dspipe plan --json` for the demo's configuration without and with `--profile`, and `dspipe bench` for the
same configuration (2 CPU ranks on gloo, DeepSpeed's engine, random tokens, 3 warm-up + 10 measured steps), repeated
`--rounds` times. Prints the comparison; `--write` replaces the `<!-- calibration -->` section of
docs/planner-accuracy.md.

    python benchmarks/calibration.py [--rounds 3] [--write]

The machine is shared: figures move with the load on it. Each round calibrates and benches back to back, so that
both see the same machine.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "planner-accuracy.md"
BEGIN, END = "<!-- calibration -->", "<!-- /calibration -->"
MODEL = ["--model", "tiny", "--layers", "4", "--hidden", "128", "--heads", "4", "--seq-len", "128", "--vocab", "4096"]
"""scripts/demo.sh's model."""
CLUSTER = [
    "--gpus-per-node",
    "2",
    "--gpu",
    "cpu",
    "--precision",
    "fp32",
    "--micro-batch",
    "8",
    "--global-batch",
    "32",
    "--zero",
    "1",
]
"""scripts/demo.sh's CPU configuration (2 ranks, fp32, micro 8, global batch 16 x 2 ranks, ZeRO-1)."""


def dspipe(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "dspipe", *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"dspipe {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def predicted(profile: str | None) -> dict:
    extra = ["--profile", profile] if profile else []
    s = json.loads(dspipe("plan", *MODEL, *CLUSTER, "--json", "--top", "1", *extra))
    return {"step_time_s": s["step_time_s"], "breakdown": s["step_time_breakdown_s"]}


def measured() -> dict:
    text = dspipe("bench", *MODEL, *CLUSTER, "--steps", "10", "--warmup", "3")
    rows = {}
    for label in ("step time", "forward", "backward + grad reduction", "optimizer step"):
        m = re.search(rf"^\s*{re.escape(label)} \(ms\)\s+([0-9.,]+)", text, re.M)
        rows[label] = float(m.group(1).replace(",", "")) / 1000 if m else None
    return rows


def one_round(tmp: str, i: int) -> dict:
    """Calibrate, predict (catalog and profile), then measure: back to back, so both see the same machine."""
    profile = str(Path(tmp) / f"profile{i}.json")
    dspipe("calibrate", *MODEL, "--micro-batch", "8", "--precision", "fp32", "--out", profile)
    return {
        "profile": json.loads(Path(profile).read_text()),
        "catalog": predicted(None),
        "calibrated": predicted(profile),
        "measured": measured(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="calibrate + bench rounds; medians reported")
    parser.add_argument("--write", action="store_true", help=f"replace the {BEGIN} section of {DOC.name}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rounds = [one_round(tmp, i) for i in range(args.rounds)]
    med = statistics.median
    prof = rounds[0]["profile"]
    f = {
        k: med(r["profile"]["figures"][k] for r in rounds)
        for k in (
            "compute_tflops",
            "matmul_tflops",
            "allreduce_busbw_gbps",
            "allreduce_latency_s",
            "host_memcpy_gbps",
            "optimizer_params_per_s",
        )
    }
    adam = [r["profile"]["figures"]["cpu_adam_params_per_s"] for r in rounds]
    lines = [
        f"Machine: {prof['device']}, {prof['ranks']} ranks x {prof['threads_per_rank']} thread, {prof['versions']}; "
        f"model {prof['model']}; fp32, ZeRO-1, dp 2, grad accum 2 (4,096 tokens/step), as scripts/demo.sh.",
        "",
        f"Profile (median of {args.rounds}): compute {f['compute_tflops'] * 1e3:.1f} GFLOP/s per rank (the model's "
        f"forward + backward; its GEMMs alone {f['matmul_tflops'] * 1e3:.1f}), gloo all-reduce busbw "
        f"{f['allreduce_busbw_gbps']:.2f} GB/s and 4 KiB latency {f['allreduce_latency_s'] * 1e6:.0f} us, host memcpy "
        f"{f['host_memcpy_gbps']:.1f} GB/s (no GPU: no pinned copy), CPU-Adam "
        + ("n/a" if None in adam else f"{med(adam) / 1e6:.0f}M params/s per node")
        + f", AdamW step {f['optimizer_params_per_s'] / 1e6:.0f}M params/s per rank.",
        "",
        "| round | predicted, catalog s | predicted, profile s (compute + dp comm + optimizer) | measured s "
        "(fwd + bwd + step) | measured / catalog | measured / profile |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rounds, start=1):
        cat, cal, m = r["catalog"], r["calibrated"], r["measured"]
        b = cal["breakdown"]
        lines.append(
            f"| {i} | {cat['step_time_s']:.3f} | {cal['step_time_s']:.3f} ({b['compute']:.3f} + "
            f"{b['dp_comm']:.4f} + {b.get('optimizer', 0.0):.4f}) | {m['step time']:.3f} "
            f"({m['forward']:.3f} + {m['backward + grad reduction']:.3f} + {m['optimizer step']:.3f}) | "
            f"{m['step time'] / cat['step_time_s']:.1f} | {m['step time'] / cal['step_time_s']:.2f} |"
        )
    ratios = [r["measured"]["step time"] / r["calibrated"]["step_time_s"] for r in rounds]
    before = [r["measured"]["step time"] / r["catalog"]["step_time_s"] for r in rounds]
    lines += [
        "",
        f"Median measured / predicted: {med(before):.1f} with the catalog, {med(ratios):.2f} with the "
        f"profile (range {min(ratios):.2f}-{max(ratios):.2f}; goal within 1.5x either way).",
    ]
    table = "\n".join(lines)
    print(table)
    if args.write:
        doc = DOC.read_text()
        section = f"{BEGIN}\n{table}\n{END}"
        if BEGIN in doc and END in doc:
            doc = doc[: doc.index(BEGIN)] + section + doc[doc.index(END) + len(END) :]
        else:
            doc = doc.rstrip("\n") + "\n\n## Calibrated step time on CPU\n\n" + section + "\n"
        DOC.write_text(doc)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
