"""Start-up cost per rank, measured on CPU ranks: the worst rank's peak host RSS once the engine is up, minus the
same for a tiny model in the same set-up (the process, torch, DeepSpeed and gloo), against the whole fp32 model,
and the seconds to the first step, beside the plan's prediction. Each run trains `--steps` steps, so the figures
are those of a run that starts.

    python benchmarks/startup_memory.py                         # 152M GPT, fp32, ZeRO-3, 8 ranks, seq 64
    python benchmarks/startup_memory.py --layers 24 --ranks 8   # 303M
    python benchmarks/startup_memory.py --init-from HF_DIR      # the same from a Hugging Face checkpoint
    python benchmarks/startup_memory.py --hf-llama              # from a random 147M LlamaForCausalLM it writes
                                                                # (save_pretrained, safetensors); checks step 1's
                                                                # loss against transformers' on the same batch
    python benchmarks/startup_memory.py --ranks 4 --tp 2 --pp 2 --zero 0
                                                                # 152M at tp 2 x pp 2 (dp 1): each rank builds
                                                                # only its stage's tp shard (a quarter of the
                                                                # model); --zero 1 adds ZeRO-1's flat buffer and
                                                                # fp32 partition, at dp 1 the whole shard again
    python benchmarks/startup_memory.py --experts 8 --ep 1 2 --layers 4 --ranks 2 --zero 2
                                                                # a mixture of experts (ffn 4 x hidden per
                                                                # expert, top 2) at each ep: a rank builds the
                                                                # dense parameters and experts / ep per block
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024**2


def dspipe(*args) -> None:
    r = subprocess.run([sys.executable, "-m", "dspipe", *map(str, args)], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(r.stderr)


def launch(run: Path, *, ranks: int, port: int) -> dict:
    launcher = shutil.which("deepspeed") or "deepspeed"
    r = subprocess.run(
        [launcher, "--num_gpus", str(ranks), "--master_port", str(port), "run.py", "--run", str(run)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if r.returncode:
        sys.exit(f"{run.name}: launch failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    engine = json.loads((run / "engine.json").read_text())
    plan = json.loads((run / "dspipe.json").read_text())
    return {
        "startup": engine["startup"],
        "params": plan["plan"]["num_params"],
        "predicted": plan.get("estimate", {}).get("startup"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--zero", default="3")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--init-from", default=None, help="a Hugging Face directory instead of the shape flags")
    ap.add_argument("--hf-llama", action="store_true", help="write a random 147M Llama and start from it")
    ap.add_argument("--data", default=None, help="a prepared data directory (default: prepare a small one)")
    ap.add_argument("--experts", type=int, default=0, help="routed experts per block (0: dense)")
    ap.add_argument("--ep", type=int, nargs="+", default=[1], help="expert-parallel sizes, one launch each")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dspipe-startup-"))
    data = args.data
    if data is None:
        data = work / "data"
        dspipe("prepare-data", "--out", data, "--max-mb", "1.5", "--train-tokenizer", "1024")
    common = [
        "--gpus-per-node",
        args.ranks,
        "--gpu",
        "cpu",
        "--global-batch",
        args.ranks,
        "--micro-batch",
        1,
        "--seq-len",
        64,
        "--precision",
        "fp32",
        "--zero",
        args.zero,
        "--offload",
        "none",
        "--no-offload-params",
        "--pp",
        args.pp,
        "--tp",
        args.tp,
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
        "--data",
        data,
    ]
    dspipe(
        "gen-config",
        "--layers",
        2,
        "--hidden",
        64,
        "--heads",
        4,
        "--vocab",
        args.vocab,
        *common,
        "--out",
        work / "tiny",
    )
    hf = None
    if args.hf_llama:
        hf = write_llama(work / "hf-llama", data=Path(data), vocab=args.vocab)
        args.init_from = str(work / "hf-llama")
    model = (
        ["--init-from", args.init_from]
        if args.init_from
        else ["--layers", args.layers, "--hidden", args.hidden, "--heads", args.heads, "--vocab", args.vocab]
    )
    tiny = None
    for i, ep in enumerate(args.ep):
        moe = ["--experts", args.experts, "--ep", ep] if args.experts else []
        dspipe("gen-config", *model, *moe, *common, "--out", work / f"big-ep{ep}")
        tiny = tiny or launch(work / "tiny", ranks=args.ranks, port=29641)
        big = launch(work / f"big-ep{ep}", ranks=args.ranks, port=29642 + i)
        if args.experts:
            print(f"ep {ep}: parameters built per rank {big['startup']['built_params']}")
        report(big, tiny=tiny, args=args)
    if hf is not None:
        ours = step1_loss(work / "big-ep1")
        theirs = first_batch_loss(hf, data=Path(data), windows=args.ranks)
        print(f"  step-1 loss {ours:.7f}, transformers' on the same batch {theirs:.7f} (diff {abs(ours - theirs):.1e})")
    shutil.rmtree(work, ignore_errors=True)


def report(big: dict, *, tiny: dict, args) -> None:
    fp32_model = big["params"] * 4 / MIB
    growth = max(big["startup"]["peak_rss_mib"]) - max(tiny["startup"]["peak_rss_mib"])

    def build_growth(run: dict) -> float:
        return max(
            b - a for a, b in zip(run["startup"]["rss_before_build_mib"], run["startup"]["build_rss_mib"], strict=True)
        )

    build = build_growth(big)
    net = build - build_growth(tiny)  # what building the tiny model costs too: first use of the allocator, kernels
    print(
        f"model {big['params'] / 1e6:.1f}M params, whole fp32 model {fp32_model:,.0f} MiB; ZeRO-{args.zero}, "
        f"{args.ranks} ranks (tp {args.tp}, pp {args.pp}), {big['startup']['mode']} build"
    )
    print(
        f"  worst rank's start-up peak RSS        {max(big['startup']['peak_rss_mib']):8,.0f} MiB "
        f"(tiny model: {max(tiny['startup']['peak_rss_mib']):,.0f})"
    )
    print(f"  minus the tiny model's                {growth:8,.0f} MiB = {growth / fp32_model:.2f} x the fp32 model")
    print(f"  the build alone (worst rank)          {build:8,.0f} MiB = {build / fp32_model:.2f} x")
    print(
        f"  minus the tiny model's build          {net:8,.0f} MiB = {net / fp32_model:.2f} x "
        f"(the rest of the start-up peak is deepspeed.initialize's: ZeRO's flat buffers and fp32 copies)"
    )
    print(
        f"  seconds to the first step (worst)     {max(big['startup']['seconds_to_first_step']):8.1f} "
        f"(build {max(big['startup']['seconds_build']):.1f})"
    )
    if big["predicted"]:
        p = big["predicted"]
        print(
            f"  plan: host per rank {p.get('host_per_rank_bytes', 0) / MIB:,.0f} MiB, "
            f"{p.get('seconds', 0):.1f} s to the first step (build + import)"
        )


def write_llama(path: Path, *, data: Path, vocab: int):
    """A random LlamaForCausalLM (12 layers, hidden 1024, 16 heads, 4 kv heads, ffn 2560: 147M parameters) with
    the data's tokenizer, saved with save_pretrained (safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=1024,
        intermediate_size=2560,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(path)
    for f in (data / "tokenizer").iterdir():
        shutil.copy(f, path / f.name)
    return model


def step1_loss(run: Path) -> float:
    import csv

    with open(run / "metrics.csv") as f:
        return next(float(r["loss"]) for r in csv.DictReader(f) if r["step"] == "1")


def first_batch_loss(model, *, data: Path, windows: int) -> float:
    """transformers' loss on the run's first global batch (the runner's dp-invariant order, seed 1234)."""
    import torch

    from dspipe.data import TokenWindows, TrainLoader

    loader = TrainLoader(windows=TokenWindows(str(data), seq_len=64), seed=1234, micro_batch=windows, dp=1, dp_rank=0)
    inputs, labels = next(loader)
    with torch.no_grad():
        logits = model(inputs).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).item()


if __name__ == "__main__":
    main()
