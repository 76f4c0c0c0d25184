"""Planner vs. live DeepSpeed engines on 2 CPU ranks: predicted model-state bytes per rank against the tensors
the engine actually holds (benchmarks/census/tensors.py), on the device and the host, between steps and at the in-step
peak, for ZeRO 0-3, CPU offload (optimizer, parameters), bf16 and fp32, GPT, Llama, Qwen2 and Qwen3 shapes, pp 2,
tp 2 and a mixture of experts at ep 1 and 2. Writes the table of docs/planner-accuracy.md.

    python benchmarks/planner_accuracy.py [--write] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.census.tensors import CATEGORIES  # noqa: E402
from dspipe.cluster.ports import free_port  # noqa: E402
from dspipe.planner.cost import estimate  # noqa: E402
from dspipe.planner.memory import zero3_gathered_bound  # noqa: E402
from dspipe.rundir import load_run  # noqa: E402
from dspipe.spec.dtypes import dtype_bytes  # noqa: E402

# ~31.5M parameters: big enough that model states dominate everything else a rank holds. The second size has a
# larger largest tensor (the 8192 x 1024 embedding) and fewer, wider blocks; the third is the Llama family (RMSNorm,
# SwiGLU, grouped-query attention, untied head) at the second's width.
MODELS = {
    "31M": [
        "--model",
        "tiny",
        "--layers",
        "4",
        "--hidden",
        "768",
        "--heads",
        "12",
        "--seq-len",
        "64",
        "--vocab",
        "4096",
    ],
    "34M": [
        "--model",
        "tiny",
        "--layers",
        "2",
        "--hidden",
        "1024",
        "--heads",
        "16",
        "--seq-len",
        "64",
        "--vocab",
        "8192",
    ],
    "39M": [
        "--model",
        "tiny-llama",
        "--layers",
        "2",
        "--hidden",
        "1024",
        "--heads",
        "16",
        "--kv-heads",
        "4",
        "--ffn",
        "2816",
        "--seq-len",
        "64",
        "--vocab",
        "8192",
    ],
    # Qwen2/2.5 (q/k/v biases only, tied head like the 0.5B/1.5B) and Qwen3 (per-head q/k RMSNorm, heads 128 wide:
    # twice hidden / heads, so q is 2048 wide and the out-projection 2048 -> 1024) at the Llama row's width
    "qwen2-31M": [
        "--model",
        "tiny",
        "--layers",
        "2",
        "--hidden",
        "1024",
        "--heads",
        "16",
        "--kv-heads",
        "4",
        "--ffn",
        "2816",
        "--seq-len",
        "64",
        "--vocab",
        "8192",
        "--norm",
        "rmsnorm",
        "--mlp",
        "swiglu",
        "--positions",
        "rope",
        "--no-bias",
        "--qkv-bias",
    ],
    # a mixture of experts: 8 routed experts (top-2, 1024 wide) in each of 2 blocks, Llama attention at 512 wide;
    # 35.1M parameters, 25.2M of them routed experts (split over ep)
    "moe-35M": [
        "--model",
        "tiny-llama",
        "--layers",
        "2",
        "--hidden",
        "512",
        "--heads",
        "8",
        "--kv-heads",
        "4",
        "--ffn",
        "1408",
        "--experts",
        "8",
        "--experts-per-token",
        "2",
        "--expert-ffn",
        "1024",
        "--seq-len",
        "64",
        "--vocab",
        "8192",
    ],
    "qwen3-45M": [
        "--model",
        "tiny-llama",
        "--layers",
        "2",
        "--hidden",
        "1024",
        "--heads",
        "16",
        "--kv-heads",
        "4",
        "--head-dim",
        "128",
        "--qk-norm",
        "--ffn",
        "2816",
        "--seq-len",
        "64",
        "--vocab",
        "8192",
    ],
}
BF16, FP32 = ["--precision", "bf16"], ["--precision", "fp32"]
CPU_OFFLOAD = ["--offload", "cpu"]
CONFIGS = {  # name: (model, options); every layout pinned (the planner would pick tp 2 for some on 2 CPU ranks)
    "zero0": ("31M", ["--zero", "0", *BF16]),
    "zero1": ("31M", ["--zero", "1", *BF16]),
    "zero2": ("31M", ["--zero", "2", *BF16]),
    "zero3": ("31M", ["--zero", "3", *BF16]),
    "zero2-offload": ("31M", ["--zero", "2", *BF16, *CPU_OFFLOAD]),
    "zero3-offload": ("31M", ["--zero", "3", *BF16, *CPU_OFFLOAD]),
    "zero3-offload-params": ("31M", ["--zero", "3", *BF16, *CPU_OFFLOAD, "--offload-params"]),
    "zero3-offload-params-reuse1e9": (
        "31M",
        [
            "--zero",
            "3",
            *BF16,
            *CPU_OFFLOAD,
            "--offload-params",
            "--max-live-parameters",
            "1000000000",
            "--max-reuse-distance",
            "1000000000",
        ],
    ),  # the knobs many published configs carry
    # gradient accumulation (2 micro-batches a step) under CPU offload: bf16 accumulates into a compact fp32
    # partition on the device, fp32 into host buffers
    "zero2-offload-ga2": ("31M", ["--zero", "2", *BF16, *CPU_OFFLOAD, "--global-batch", "4"]),
    "zero1-offload-ga2": ("31M", ["--zero", "1", *BF16, *CPU_OFFLOAD, "--global-batch", "4"]),
    "zero2-offload-fp32-ga2": ("31M", ["--zero", "2", *FP32, *CPU_OFFLOAD, "--global-batch", "4"]),
    # bf16 with gradient accumulation (2 micro-batches a step), the usual layout of a real run
    "zero1-ga2": ("31M", ["--zero", "1", *BF16, "--global-batch", "4"]),
    "zero2-ga2": ("31M", ["--zero", "2", *BF16, "--global-batch", "4"]),
    "zero3-ga2": ("31M", ["--zero", "3", *BF16, "--global-batch", "4"]),
    "zero1-fp32": ("31M", ["--zero", "1", *FP32]),
    # fp32 with gradient accumulation (2 micro-batches a step)
    "zero1-fp32-ga2": ("31M", ["--zero", "1", *FP32, "--global-batch", "4"]),
    "zero2-fp32-ga2": ("31M", ["--zero", "2", *FP32, "--global-batch", "4"]),
    "zero2-fp32": ("31M", ["--zero", "2", *FP32]),
    "zero0-fp32-ga2": ("31M", ["--zero", "0", *FP32, "--global-batch", "4"]),
    "zero3-fp32": ("31M", ["--zero", "3", *FP32]),
    "zero2-offload-fp32": ("31M", ["--zero", "2", *FP32, *CPU_OFFLOAD]),
    "34M-zero2": ("34M", ["--zero", "2", *BF16]),
    "34M-zero3": ("34M", ["--zero", "3", *BF16]),
    "34M-zero2-offload": ("34M", ["--zero", "2", *BF16, *CPU_OFFLOAD]),
    "34M-zero3-offload-params-fp32": ("34M", ["--zero", "3", *FP32, *CPU_OFFLOAD, "--offload-params"]),
    # fp32 ZeRO-2 at another largest tensor (the partition buffer's straddling ends) and blocks
    "34M-zero2-fp32": ("34M", ["--zero", "2", *FP32]),
    "llama-zero2": ("39M", ["--zero", "2", *BF16]),
    "llama-zero3-offload": ("39M", ["--zero", "3", *BF16, *CPU_OFFLOAD]),
    "llama-zero3-offload-params-fp32": ("39M", ["--zero", "3", *FP32, *CPU_OFFLOAD, "--offload-params"]),
    "llama-zero2-fp32-ga2": ("39M", ["--zero", "2", *FP32, "--global-batch", "4"]),
    "qwen2-zero2": ("qwen2-31M", ["--zero", "2", *BF16]),
    "qwen3-zero3": ("qwen3-45M", ["--zero", "3", *BF16]),
    "pp2-zero1": ("31M", ["--zero", "1", *BF16, "--pp", "2"]),
    # bf16 ZeRO-0 under a pipeline: DeepSpeed's BF16_Optimizer with bf16 gradient accumulation
    "pp2-zero0": ("31M", ["--zero", "0", *BF16, "--pp", "2"]),
    # the same with every 16-bit gradient kept until the step (bf16.immediate_grad_update false)
    "pp2-zero0-keep": ("31M", ["--zero", "0", *BF16, "--pp", "2", "--no-immediate-grad-update"]),
    "tp2-zero1": ("31M", ["--zero", "1", *BF16, "--tp", "2"]),
    # the tensor-parallel split of 128-wide heads
    "tp2-qwen3-zero1": ("qwen3-45M", ["--zero", "1", *BF16, "--tp", "2"]),
    # DeepSpeed's native MoE (the runtime's expert-parallel wrapper): experts over ep, their ZeRO states over dp / ep
    "moe-zero1-ep2": ("moe-35M", ["--zero", "1", *BF16, "--ep", "2"]),
    "moe-zero2-ep2": ("moe-35M", ["--zero", "2", *BF16, "--ep", "2"]),
    "moe-zero2-ep1": ("moe-35M", ["--zero", "2", *BF16, "--ep", "1"]),
    "moe-zero2-ep2-fp32": ("moe-35M", ["--zero", "2", *FP32, "--ep", "2"]),
    # each pipeline stage its own sparse blocks (the BF16_Optimizer of a bf16 pipeline, its expert groups)
    "moe-pp2-zero1": ("moe-35M", ["--zero", "1", *BF16, "--pp", "2", "--ep", "1"]),
    # ZeRO-3: the model's own SparseMLP, every expert partitioned over dp like a dense module
    "moe-zero3-ep1": ("moe-35M", ["--zero", "3", *BF16, "--ep", "1"]),
    # ZeRO-3 at ep 2: each rank its experts, partitioned over their expert-data-parallel group (dspipe.runtime.moe)
    "moe-zero3-ep2": ("moe-35M", ["--zero", "3", *BF16, "--ep", "2"]),
    # tp 2 (sequence parallel): the model's own SparseMLP whole on both tp ranks, the attention split (ZeRO-3 at tp 2
    # on 2 ranks would be dp 1: nothing partitioned)
    "moe-tp2-zero1": ("moe-35M", ["--zero", "1", *BF16, "--tp", "2", "--ep", "1"]),
}
MOE_ROWS = [name for name in CONFIGS if name.startswith("moe-")]
"""Rows that need the runtime's mixture-of-experts support (dspipe.runtime.moe); left out where it is missing."""
LAUNCHES = [  # rows measured one after another by the same 2 ranks (a launch costs ~20 s before any engine)
    [name for name in CONFIGS if not name.startswith(("pp2", "tp2", "moe-"))],
    ["pp2-zero1", "pp2-zero0", "pp2-zero0-keep"],
    ["tp2-zero1"],
    ["tp2-qwen3-zero1"],
    [name for name in MOE_ROWS if "-pp2" not in name and "-tp2" not in name],
    ["moe-pp2-zero1"],
    [name for name in MOE_ROWS if "-tp2" in name],
]
"""Each launch's engines share one process group; pipeline and tensor-parallel engines get their own launch."""
METRICS = ("steady", "peak", "host_steady", "host_peak")
"""What each row compares: device bytes between steps and at the in-step peak, host bytes between steps and peak."""


def _generate(name: str, workdir: Path, *, seq_len: int | None = None) -> Path:
    """gen-config for row `name`, by the CLI's main in this process (a fresh interpreter spends ~5 s importing
    DeepSpeed to parse each config; this process imports it once); `seq_len` replaces the model's sequence."""
    from dspipe.cli.app import main as dspipe_main

    model, options = CONFIGS[name]
    run_dir = workdir / name
    gen = [
        "gen-config",
        *MODELS[model],
        "--gpus-per-node",
        "2",
        "--gpu",
        "cpu",
        "--global-batch",
        "2",
        "--micro-batch",
        "1",
        "--steps",
        "10",
        "--warmup",
        "1",
        "--offload",
        "none",
        "--no-offload-params",
        "--checkpointing",
        "none",
        "--pp",
        "1",
        "--tp",
        "1",
        "--sp",
        "1",
        *options,
        *(["--seq-len", str(seq_len)] if seq_len else []),
        "--data",
        str(workdir / "no-data"),
        "--out",
        str(run_dir),
        "--force",
    ]
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            dspipe_main(gen)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    if code:
        raise RuntimeError(f"{name}: gen-config failed\n{err.getvalue()[-2000:]}")
    return run_dir


def predicted(run_dir: Path) -> dict:
    """The planner's bytes per rank: device between steps (Memory.model_states) and at the step's peak (every kind
    but activations and the framework reserve), host between steps and at the peak."""
    run = load_run(run_dir)
    est = estimate(model=run.model, cluster=run.cluster, plan=run.plan)
    mem = est.memory
    return {
        "steady": mem.model_states,
        "peak": mem.total - mem.activations,  # the cpu type has no framework reserve
        "host_steady": mem.host_model_states,
        "host_peak": mem.host_peak,
    }


def gathered_allowed(run_dir: Path) -> int:
    """ZeRO-3 gathered parameter bytes the rendered knobs allow at most (memory.zero3_gathered_bound); 0 below
    ZeRO-3."""
    run = load_run(run_dir)
    b = dtype_bytes(run.plan.precision)
    return b * zero3_gathered_bound(model=run.model, plan=run.plan) if run.plan.zero_stage == 3 else 0


def measure_launch(names: list[str], workdir: Path, *, seq_len: int | None = None) -> list[dict]:
    """Generate the runs, launch 2 ranks once for all of them, return one row per run: predicted and measured
    (largest rank) bytes for each of METRICS, and the measured bytes by category at the device peak. `seq_len`:
    the models at another sequence length (model states do not depend on it; the steps' compute does)."""
    run_dirs = [_generate(name, workdir, seq_len=seq_len) for name in names]
    launcher = (
        [shutil.which("deepspeed")]
        if shutil.which("deepspeed")
        else [sys.executable, "-m", "deepspeed.launcher.runner"]
    )
    out = workdir / "census"
    r = subprocess.run(
        [
            *launcher,
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            "benchmarks/measure_memory.py",
            "--run",
            *map(str, run_dirs),
            "--out-dir",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if r.returncode:
        raise RuntimeError(f"{names}: launch failed\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return collect(names, workdir)


def collect(names: list[str], workdir: Path) -> list[dict]:
    """Rows from the run dirs and the census files a launch left in workdir."""
    run_dirs, out = [workdir / name for name in names], workdir / "census"
    rows = []
    for name, run_dir in zip(names, run_dirs, strict=True):
        ranks = [json.loads((out / name / f"rank{i}.json").read_text()) for i in range(2)]
        measured = {
            "steady": max(c["steady"]["total"] for c in ranks),
            "peak": max(c["peak"]["total"] for c in ranks),
            "host_steady": max(c["steady"]["host"]["total"] for c in ranks),
            "host_peak": max(c["host_peak"]["total"] for c in ranks),
        }
        worst = max(ranks, key=lambda c: c["peak"]["total"])
        rows.append(
            {
                "name": name,
                "num_params": load_run(run_dir).plan.num_params,
                "predicted": predicted(run_dir),
                "measured": measured,
                "peak_by_kind": {k: worst["peak"][k] for k in (*CATEGORIES, "total")},
                "peak_buffers": worst["peak"]["buffers_by_owner"],
                "peak_at": worst["peak_at"],
                "gathered": max(c["gathered_peak"] for c in ranks),
                "gathered_at": max(ranks, key=lambda c: c["gathered_peak"])["gathered_at"],
                "gathered_allowed": gathered_allowed(run_dir),
                "steady_by_kind": {
                    k: max(ranks, key=lambda c: c["steady"]["total"])["steady"][k] for k in (*CATEGORIES, "total")
                },
            }
        )
    return rows


def error(row: dict, metric: str) -> float:
    """(predicted - measured) / measured; 0 when both are 0."""
    p, m = row["predicted"][metric], row["measured"][metric]
    return (p - m) / m if m else (0.0 if p == 0 else float("inf"))


def table(rows: list[dict]) -> str:
    mib = 2**20
    lines = [
        "| config | params | device between steps MiB (pred / meas / err) | device in-step peak MiB (pred / "
        "meas / err) | host between steps MiB | host peak MiB | at the peak: params / gathered / grads / "
        "optimizer / buffers MiB | ZeRO-3 gathered MiB: most seen / allowed |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cell(r, metric):
        p, m = r["predicted"][metric] / mib, r["measured"][metric] / mib
        return f"{p:.1f} / {m:.1f} / {error(r, metric) * 100:+.1f}%" if m or p else "0 / 0"

    for r in rows:
        k = r["peak_by_kind"]
        gathered = f"{r['gathered'] / mib:.1f} / {r['gathered_allowed'] / mib:.1f}" if r["gathered_allowed"] else ""
        kinds = " / ".join(f"{k[c] / mib:.1f}" for c in ("params", "gathered", "grads", "optimizer", "buffers"))
        lines.append(
            f"| {r['name']} | {r['num_params'] / 1e6:.1f}M | {cell(r, 'steady')} | {cell(r, 'peak')} | "
            f"{cell(r, 'host_steady')} | {cell(r, 'host_peak')} | {kinds} | {gathered} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", action="store_true", help="rewrite the table in docs/planner-accuracy.md")
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), help="measure these rows only")
    args = parser.parse_args()
    launches = [[n for n in names if n in args.only] for names in LAUNCHES] if args.only else LAUNCHES
    try:
        import dspipe.runtime.moe  # noqa: F401
    except ImportError:  # a runtime without expert parallelism: the MoE rows cannot be measured
        print("(no dspipe.runtime.moe: the MoE rows are left out)")
        launches = [[n for n in names if n not in MOE_ROWS] for names in launches]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, names in enumerate(n for n in launches if n):
            rows += measure_launch(names, Path(tmp) / str(i))
    text = table(rows)
    print(text)
    if args.write:
        doc = ROOT / "docs" / "planner-accuracy.md"
        head, _, tail = doc.read_text().partition("<!-- table -->\n")
        rest = tail.split("\n\n", 1)[1] if "\n\n" in tail else ""  # the text after the table stays
        doc.write_text(f"{head}<!-- table -->\n{text}\n\n{rest}")


if __name__ == "__main__":
    main()
