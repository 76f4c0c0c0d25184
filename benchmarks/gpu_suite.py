"""Everything dspipe measures on a GPU, in one command for a short loan of one GPU: FusedAdam's build, the CUDA/NCCL
path (the README demo for 50 steps, its loss and time to the first step), `dspipe bench` of gpt3-1.3b and
llama3.2-1b at seq 4,096 against the plain-PyTorch reference (compiled blocks and the chunked loss on dspipe's side,
torch.compile on the reference's), the mixture-of-experts bench and its ZeRO stages, and the windowed-attention and
chunked-loss kernels. Each step runs in its own process with its own time limit, in priority order (or in `--only`'s
order), within `--budget` seconds; a step that fails or times out is recorded as such and the suite goes on. After
every step the results so far are written to OUT/suite.md (a dated markdown section named by the device) and
OUT/suite.log (every command's output), so a suite cut short still leaves its figures; at the end the section is
appended to `--append` (docs/benchmarks.md).

On the H200 (2026-11-29) the steps took: fused-adam 42 s, demo 69 s, bench-gpt 165 s, bench-moe 112 s, bench-llama
over 147 s; the whole suite is more than one 10-minute call, so `--budget` (540 s) cuts it and `--only` says what
comes first.

    python benchmarks/gpu_suite.py --out /tmp/suite --append docs/benchmarks.md [--budget 540] [--only moe-zero demo]

Run it from the repository root after `bash scripts/setup.sh` (or with dspipe and DeepSpeed on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
DSPIPE = [PY, "-m", "dspipe"]
LOSS_CHUNK = 8192
"""Tokens per chunk of the loss in the benches (dspipe's --loss-chunk)."""


@dataclass
class Step:
    """One measurement: its commands (run in order, stopping at the first failure), time limit and parser."""

    name: str
    title: str
    commands: list[list[str]]
    limit_s: int
    parse: object = None
    """(output text) -> dict of figures; None: keep only the exit status and time."""
    env: dict = field(default_factory=dict)
    fallbacks: list[list[list[str]]] = field(default_factory=list)
    """Other commands to try, in order, when the step fails (a new feature failing must not cost the figure)."""


def run_with_fallbacks(step: Step, *, log, deadline: float) -> dict:
    """run_step, then each fallback in turn while the step fails and time is left; the failures are kept."""
    result = run_step(step, log=log, deadline=deadline)
    failures = []
    for commands in step.fallbacks:
        if not result["status"].startswith("failed"):
            break
        failures.append(result["status"])
        log.write(f"\n[{step.name} failed; trying its fallback]\n")
        result = run_step(
            Step(step.name, step.title, commands, step.limit_s, step.parse, step.env), log=log, deadline=deadline
        )
        result["fallback"] = shlex.join(commands[-1][-6:])
    if failures:
        result["failed first"] = " || ".join(failures)
    return result


def run_step(step: Step, *, log, deadline: float) -> dict:
    """Run the step's commands within its limit and the suite's deadline; its figures or its failure."""
    started = time.perf_counter()
    output = []
    for cmd in step.commands:
        left = min(step.limit_s - (time.perf_counter() - started), deadline - time.perf_counter())
        if left < 5:
            return {"status": "skipped (out of time)", "seconds": time.perf_counter() - started}
        log.write(f"\n$ {shlex.join(cmd)}\n")
        log.flush()
        try:
            r = subprocess.run(
                cmd, cwd=ROOT, capture_output=True, text=True, timeout=left, env={**os.environ, **step.env}
            )
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            log.write(text + f"\n[timed out after {left:.0f} s]\n")
            return {
                "status": f"timed out after {time.perf_counter() - started:.0f} s",
                "seconds": time.perf_counter() - started,
            }
        text = r.stdout + r.stderr
        log.write(text)
        log.flush()
        output.append(text)
        if r.returncode:
            tail = [ln for ln in text.splitlines() if ln.strip()][-3:]
            return {
                "status": f"failed (exit {r.returncode}): {' | '.join(tail)[-400:]}",
                "seconds": time.perf_counter() - started,
            }
    result = {"status": "ok", "seconds": time.perf_counter() - started}
    if step.parse:
        try:
            result.update(step.parse("\n".join(output)))
        except Exception as e:  # a figure missing from the output: the step ran, its report is incomplete
            result["status"] = f"ok, figures not parsed ({type(e).__name__}: {e})"
    return result


def demo_parser(run_dir: Path):
    """The demo's loss, time to its first step (the runner's start-up line) and median tokens/s (metrics.csv)."""

    def parse(text: str) -> dict:
        import csv
        import statistics

        loss = re.search(r"done: loss ([\d.]+) -> ([\d.]+)", text)
        first = re.search(r"first step ([\d.]+) s after the process start", text)
        out = {"loss": f"{loss.group(1)} -> {loss.group(2)}"}
        if first:
            out["first step after launch (s)"] = float(first.group(1))
        with open(ROOT / run_dir / "metrics.csv") as f:
            rates = [float(row["tokens_per_s"]) for row in csv.DictReader(f) if row.get("tokens_per_s")]
        if rates:
            out["median tokens/s"] = round(statistics.median(rates))
        return out

    return parse


def parse_bench(text: str) -> dict:
    """dspipe bench's table: tokens/s, MFU, step time and peak memory per column, and the ratios."""
    out = {}
    for label in ("tokens/s", "MFU", "step time (ms)", "peak allocated (GiB)"):  # one cell per column
        row = re.search(rf"^{re.escape(label)}\s+(.+)$", text, re.M)
        if row:
            out[label] = row.group(1).split()
    for name, value in re.findall(r"dspipe / ([\w ]+) tokens/s: ([\d.]+)", text):
        out[f"ratio vs {name}"] = float(value)
    section = re.search(r"^bench: (.+)$", text, re.M)
    out["setup"] = section.group(1) if section else ""
    return {**out, **parse_plan_word(text)}


def parse_plan_word(text: str) -> dict:
    """bench's plan lines: plan / measured for the step time and the memory, one per table in the output."""
    out = {}
    for what, key in (("step time", "plan / measured step"), ("memory", "plan / measured memory")):
        found = re.findall(rf"^plan: {what} .*\(plan / measured ([\d.]+)\)$", text, re.M)
        if found:
            out[key] = found
    return out


def parse_benches(text: str) -> dict:
    """Several dspipe-only `dspipe bench` tables in one output: per figure, each table's value in order."""
    out = {}
    for label in (
        "tokens/s",
        "step time (ms)",
        "backward + grad reduction (ms)",
        "optimizer step (ms)",
        "peak allocated (GiB)",
    ):
        cells = [row.split()[0] for row in re.findall(rf"^ *{re.escape(label)}\s+(.+)$", text, re.M)]
        if cells:
            out[label] = cells
    plans = re.findall(
        r"^bench: \S+ [\d,.]+M params .*?\| (ZeRO-\d) offload \S+ \| \S+ \| recompute \S+ \| batch (\d+) x ga (\d+)",
        text,
        re.M,
    )
    out["runs"] = [f"{zero} micro {micro} x ga {ga}" for zero, micro, ga in plans]
    return {**out, **parse_plan_word(text)}


def parse_lines(text: str) -> dict:
    """A script's own report: its last 30 lines that are not log records or warnings."""
    noise = ("[20", "  warnings.warn", "W1", "I1")
    keep = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(noise) and "Warning" not in ln]
    return {"report": keep[-30:]}


def steps(*, gpu: str | None, sections: Path) -> list[Step]:
    """The suite, most wanted first; the benches append their tables to `sections`."""
    gpu_flag = ["--gpu", gpu] if gpu else []
    demo_dir, data = "runs/gpu-suite-demo", "data/stdlib"
    bench = [
        *DSPIPE,
        "bench",
        "--gpus-per-node",
        "1",
        "--nodes",
        "1",
        *gpu_flag,
        "--warmup",
        "2",
        "--steps",
        "5",
        "--compare",
        "--append",
        str(sections),
    ]
    solo = [arg for arg in bench if arg != "--compare"]  # dspipe's side alone
    fast = ["--compile", "--loss-chunk", str(LOSS_CHUNK)]
    moe = (
        "--model tiny-llama --layers 4 --hidden 1024 --heads 16 --kv-heads 4 --ffn 2816 --vocab 32000 --seq-len 2048 "
        "--experts 32 --experts-per-token 4 --expert-ffn 1024 --global-batch 16"
    ).split()
    moe_bench = [*moe, "--micro-batch", "4"]
    gpt_batch = ["--model", "gpt3-1.3b", "--global-batch", "16"]
    gpt = [*gpt_batch, "--micro-batch", "2"]
    llama = ["--model", "llama3.2-1b", "--seq-len", "4096", "--global-batch", "8", "--micro-batch", "1"]
    return [
        Step(
            "fused-adam",
            "FusedAdam JIT build (DeepSpeed's op, for this GPU's architecture)",
            [[PY, "-c", "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()"]],
            240,
        ),
        Step(
            "demo",
            "README demo on CUDA/NCCL: 4-layer GPT, bf16, ZeRO-1, 50 steps",
            [
                [*DSPIPE, "prepare-data", "--out", data, "--train-tokenizer", "4096"],
                [
                    *DSPIPE,
                    "gen-config",
                    "--model",
                    "tiny",
                    "--layers",
                    "4",
                    "--hidden",
                    "128",
                    "--heads",
                    "4",
                    "--seq-len",
                    "128",
                    "--vocab",
                    "4096",
                    "--gpus-per-node",
                    "1",
                    *gpu_flag,
                    "--precision",
                    "bf16",
                    "--micro-batch",
                    "8",
                    "--global-batch",
                    "16",
                    "--steps",
                    "50",
                    "--warmup",
                    "10",
                    "--lr",
                    "2e-3",
                    "--zero",
                    "1",
                    "--log-interval",
                    "10",
                    "--eval-interval",
                    "0",
                    "--data",
                    data,
                    "--out",
                    demo_dir,
                    "--force",
                ],
                [PY, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "run.py", "--run", demo_dir, "--restart"],
            ],
            150,
            demo_parser(Path(demo_dir)),
        ),
        Step(
            "bench-gpt",
            "gpt3-1.3b, micro 2 x ga 8, compiled blocks + chunked loss vs compiled reference",
            [[*bench, *gpt, *fast]],
            200,
            parse_bench,
            fallbacks=[[[*bench, *gpt, "--compile"]], [[*bench, *gpt, "--reference", "eager"]]],
        ),
        Step(
            "bench-moe",
            "MoE 479M (32 experts of 1024, top-4), ZeRO-2, vs the eager reference",
            [[*bench, *moe_bench, "--zero", "2", "--reference", "eager"]],
            150,
            parse_bench,
        ),
        Step(
            "moe-zero",
            "the same MoE, dspipe alone: ZeRO-0, ZeRO-1, ZeRO-2 with 5e8-element reduce buckets (bench-moe's are "
            "h^2 = 1,048,576), and the planner's own choice (no --zero, no --micro-batch)",
            [
                [*solo, *moe_bench, "--zero", "0"],
                [*solo, *moe_bench, "--zero", "1"],
                [*solo, *moe_bench, "--zero", "2", "--reduce-bucket-size", "500000000"],
                [*solo, *moe],
            ],
            240,
            parse_benches,
        ),
        Step(
            "gpt-variants",
            "gpt3-1.3b, dspipe alone, compiled blocks + chunked loss: micro 4 x ga 4, and ZeRO-1 (DeepSpeed's "
            "BF16_Optimizer in place of ZeRO-0's FP16_Optimizer step)",
            [[*solo, *gpt_batch, "--micro-batch", "4", *fast], [*solo, *gpt, *fast, "--zero", "1"]],
            200,
            parse_benches,
        ),
        Step(
            "bench-llama",
            "llama3.2-1b seq 4,096, micro 1 x ga 8, compiled blocks + chunked loss vs compiled reference",
            [[*bench, *llama, *fast]],
            200,
            parse_bench,
            fallbacks=[[[*bench, *llama, "--compile"]], [[*bench, *llama, "--reference", "eager"]]],
        ),
        Step(
            "cuda-tests",
            "the unit tests that need CUDA (liger's loss, flex windows, host waits: the routing counts, the batches)",
            [
                [
                    PY,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "tests/unit/model/test_chunked_loss.py",
                    "tests/unit/model/test_window.py",
                    "tests/unit/model/test_moe.py::test_expert_counts_are_bincounts_without_a_host_wait",
                    "tests/unit/runtime/test_to_device.py",
                ]
            ],
            90,
            parse_lines,
        ),
        Step(
            "chunked-loss",
            "cross-entropy without the full logits, Llama-3 head (V 128,256, h 4,096, 8,192 "
            "tokens): plain / chunked / liger (benchmarks/chunked_loss.py)",
            [
                [
                    PY,
                    "benchmarks/chunked_loss.py",
                    "--device",
                    "cuda",
                    "--check",
                    "--vocab",
                    "128256",
                    "--hidden",
                    "4096",
                    "--seq",
                    "8192",
                    "--chunk",
                    "1024",
                    "4096",
                    "--repeats",
                    "5",
                ]
            ],
            90,
            parse_lines,
        ),
        Step(
            "window",
            "sliding-window attention kernel vs causal flash (benchmarks/window_attention.py)",
            [[PY, "benchmarks/window_attention.py"]],
            60,
            parse_lines,
        ),
    ]


def detected_gpu() -> str | None:
    """The catalog's type of this machine's GPU (what gen-config's --gpu takes), None without one or unknown."""
    from dspipe.cluster.doctor import detect_gpu

    return detect_gpu()


def device_line() -> tuple[str, str]:
    """(device name, versions) as the GPU machine reports them."""
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    try:
        import deepspeed

        ds = deepspeed.__version__
    except ImportError:
        ds = "absent"
    return name, f"python {sys.version.split()[0]}, torch {torch.__version__}, deepspeed {ds}"


def section(results: dict, *, device: str, versions: str, date: str, plan: list[Step], tables: str) -> str:
    """The dated markdown section: one row per step (status, seconds, figures), then each step's detail."""
    lines = [
        f"### {date}: {device}, GPU suite (`python benchmarks/gpu_suite.py`)",
        "",
        f"- versions: {versions}",
        "",
        "| step | status | seconds | figures |",
        "|---|---|---:|---|",
    ]
    for step in plan:
        r = results.get(step.name)
        if r is None:
            lines.append(f"| {step.name} | not run | | |")
            continue
        figures = {k: v for k, v in r.items() if k not in ("status", "seconds", "report", "setup", "failed first")}
        text = ", ".join(f"{k} {' / '.join(v) if isinstance(v, list) else v}" for k, v in figures.items())
        lines.append(
            f"| {step.name}: {step.title} | {r['status'].replace('|', '/')} | {r['seconds']:.0f} | "
            f"{text.replace('|', '/')} |"
        )
    for step in plan:
        r = results.get(step.name) or {}
        if r.get("failed first"):
            lines += ["", f"- {step.name} failed first: {r['failed first']}"]
        if r.get("setup"):
            lines += ["", f"- {step.name} setup: {r['setup']}"]
        if r.get("report"):
            lines += ["", f"{step.name}:", "", "```", *r["report"], "```"]
    return "\n".join(lines) + "\n" + tables


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for suite.md, suite.json and suite.log")
    ap.add_argument("--append", default=None, help="markdown file the finished section is appended to")
    ap.add_argument("--budget", type=float, default=540, help="seconds for the whole suite")
    ap.add_argument("--gpu", default=None, help="catalog GPU type (default: detected)")
    ap.add_argument("--only", nargs="+", default=None, help="run only these steps, in this order")
    args = ap.parse_args(argv)
    names = [s.name for s in steps(gpu=None, sections=Path())]
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:  # before anything is written or measured
        ap.error(f"--only: no step {', '.join(unknown)}; the steps are {', '.join(names)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.budget
    device, versions = device_line()
    sections = out / "bench-tables.md"
    gpu = args.gpu or detected_gpu()
    every = steps(gpu=gpu, sections=sections)
    by_name = {s.name: s for s in every}
    plan = every if args.only is None else [by_name[name] for name in dict.fromkeys(args.only)]  # in --only's order
    date = datetime.date.today().isoformat()
    results: dict[str, dict] = {}
    env_arch = {}
    try:
        import torch

        if torch.cuda.is_available():  # build DeepSpeed's ops for this GPU only (minutes less than every arch)
            major, minor = torch.cuda.get_device_capability(0)
            # always the plain "9.0": DeepSpeed 0.19.8's op builder parses each entry as int.int and raised
            # ValueError on the H200 image's own TORCH_CUDA_ARCH_LIST "9.0a" (2026-11-27), failing every launch
            env_arch = {"TORCH_CUDA_ARCH_LIST": f"{major}.{minor}"}
    except ImportError:
        pass
    with open(out / "suite.log", "a") as log:
        log.write(f"# {date} {device} | {versions}\n")
        for step in plan:
            step.env = {**env_arch, "PYTHONUNBUFFERED": "1", **step.env}
            print(f"gpu-suite: {step.name} ...", flush=True)
            results[step.name] = run_with_fallbacks(step, log=log, deadline=deadline)
            print(f"gpu-suite: {step.name}: {json.dumps(results[step.name])[:600]}", flush=True)
            (out / "suite.json").write_text(
                json.dumps({"device": device, "versions": versions, "results": results}, indent=1)
            )
            tables = sections.read_text().split("\n", 1)[1] if sections.exists() else ""  # without its title
            tables = tables.replace("\n### ", "\n#### ")  # each bench's own section, one level down
            (out / "suite.md").write_text(
                section(results, device=device, versions=versions, date=date, plan=plan, tables=tables)
            )
    text = (out / "suite.md").read_text()
    print(text)
    if args.append:
        path = Path(args.append)
        body = path.read_text() if path.exists() else "# dspipe benchmarks\n"
        path.write_text(body.rstrip("\n") + "\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
