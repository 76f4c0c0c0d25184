"""Start-up at scale (issue 25): every build mode gives the plain build's step-0 weights, bitwise, and a ZeRO-3 rank
never holds more than its partition plus one tensor while it builds. One launch builds eight engines in turn
(tests/distributed/ranks/step0_weights.py): a 38M GPT first (its build's RSS is the fresh process's), then tiny
models under ZeRO-3 (fp32; bf16 with parameters offloaded to the host; sequence parallel 2; a Llama with an
untied head; a Hugging Face import), ZeRO-1 (meta-device build in bf16) and tp 2 with dspipe's tensor-parallel
layers under ZeRO-1 (each rank materialises only its shards) and under ZeRO-3."""

import json
import shutil
import subprocess
import sys

import torch

from dspipe.model.gpt import GPT
from dspipe.rundir import load_run
from tests.helpers import ROOT, free_port, gen_config

SEED = 1234  # gen-config's default
COMMON = (
    "--gpus-per-node",
    "2",
    "--gpu",
    "cpu",
    "--global-batch",
    "8",
    "--micro-batch",
    "2",
    "--steps",
    "3",
    "--warmup",
    "1",
    "--eval-interval",
    "0",
    "--pp",
    "1",
    "--checkpointing",
    "none",
    "--offload",
    "none",
)
RUNS = {  # name: (flags, dtype of the module's parameters)
    "big-zero3": (
        (
            "--layers",
            "12",
            "--hidden",
            "512",
            "--heads",
            "8",
            "--vocab",
            "1024",
            "--seq-len",
            "64",
            "--precision",
            "fp32",
            "--zero",
            "3",
            "--no-offload-params",
        ),
        torch.float32,
    ),
    "zero3-fp32": (("--model", "tiny", "--precision", "fp32", "--zero", "3", "--no-offload-params"), torch.float32),
    "zero3-bf16-offload-params": (
        ("--model", "tiny", "--precision", "bf16", "--zero", "3", "--offload", "cpu", "--offload-params"),
        torch.bfloat16,
    ),
    "zero3-llama-bf16": (
        ("--model", "tiny-llama", "--precision", "bf16", "--zero", "3", "--no-offload-params"),
        torch.bfloat16,
    ),
    "zero1-bf16": (("--model", "tiny", "--precision", "bf16", "--zero", "1", "--no-offload-params"), torch.bfloat16),
    "tp2-fp32": (
        ("--model", "tiny", "--precision", "fp32", "--zero", "1", "--tp", "2", "--no-offload-params"),
        torch.float32,
    ),
    "tp2-zero3-llama-bf16": (
        ("--model", "tiny-llama", "--precision", "bf16", "--zero", "3", "--tp", "2", "--no-offload-params"),
        torch.bfloat16,
    ),
}
SEQUENCE_PARALLEL = {
    "zero3-sp2": (
        ("--model", "tiny", "--precision", "fp32", "--zero", "3", "--sp", "2", "--no-offload-params"),
        torch.float32,
    )
}
"""Built last: DeepSpeed's sequence-parallel groups are process-wide once made."""


def hf_llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    LlamaForCausalLM(cfg).float().save_pretrained(path, max_shard_size="200KB")  # sharded: an index and 4+ files


def test_every_build_mode_gives_the_plain_step0_weights(tmp_path, corpus):
    """Gathered step-0 weights equal GPT(spec, seed) in the training dtype, bitwise, in every mode; the ZeRO-3
    import equals the checkpoint; the 38M model's partitioned build stays within its partition + 4 tensors."""
    from safetensors.torch import load_file

    from dspipe.model.hf import spec_from_hf_dir
    from dspipe.model.hf_state import from_hf_state

    hf = tmp_path / "hf"
    hf_llama(hf)
    flags = {name: flags for name, (flags, _) in RUNS.items() if not name.startswith("tp2")}
    flags["zero3-import"] = ("--init-from", hf, "--precision", "fp32", "--zero", "3", "--no-offload-params")
    # after every tp 1 engine: DeepSpeed keeps the last mpu it was given process-wide (deepspeed.utils.groups.mpu),
    # and an engine built later without one would read it (the runner builds one engine per process)
    flags.update((name, f) for name, (f, _) in RUNS.items() if name.startswith("tp2"))
    flags.update((name, f) for name, (f, _) in SEQUENCE_PARALLEL.items())
    runs = []
    for name, args in flags.items():
        pinned = [x for axis in ("--tp", "--sp") if axis not in args for x in (axis, "1")]  # the mode named, not a pick
        r = gen_config(*COMMON, *args, *pinned, "--data", corpus, "--out", tmp_path / name)
        assert r.returncode == 0, r.stderr
        runs.append(tmp_path / name)
    out = tmp_path / "out"
    out.mkdir()
    launcher = (
        [shutil.which("deepspeed")]
        if shutil.which("deepspeed")
        else [sys.executable, "-m", "deepspeed.launcher.runner"]
    )
    r = subprocess.run(
        [
            *launcher,
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            "tests/distributed/ranks/step0_weights.py",
            out,
            *runs,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    for name, (_, dtype) in {**RUNS, **SEQUENCE_PARALLEL}.items():
        model = GPT(load_run(tmp_path / name).model, seed=SEED)
        plain = model.state_dict()
        got = torch.load(out / f"{name}.pt")
        assert set(got) == set(plain), name
        for key, value in plain.items():
            assert got[key].dtype == dtype and torch.equal(got[key], value.to(dtype)), (name, key)
        # the optimizer decays exactly the matrices and embeddings, whatever shape the build left on the tensor
        wd = json.loads((out / f"{name}.json").read_text())["weight_decay"]
        assert {n for n, d in wd.items() if d > 0} == {n for n, p in model.named_parameters() if p.dim() >= 2}, name
    modes = {name: json.loads((out / f"{name}.json").read_text())["mode"] for name in flags}
    assert modes == {
        "big-zero3": "partitioned",
        "zero3-fp32": "partitioned",
        "zero3-import": "partitioned",
        "zero3-bf16-offload-params": "partitioned",
        "zero3-sp2": "partitioned",
        "zero3-llama-bf16": "partitioned",
        "zero1-bf16": "device",
        "tp2-fp32": "device",
        "tp2-zero3-llama-bf16": "device",
    }

    # the Hugging Face import: each rank read its partition of each tensor; gathered, they are the checkpoint's
    got = torch.load(out / "zero3-import.pt")
    shards = {k: v for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(f).items()}  # read whole
    want = from_hf_state(shards, spec_from_hf_dir(hf))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)

    # the 38M GPT's build, fresh process: each rank grew by its partition (half the fp32 model) and at most a few
    # whole tensors, where building the whole model first grew by the whole model (151 MiB) and more
    figures = json.loads((out / "big-zero3.json").read_text())
    big = load_run(tmp_path / "big-zero3").model
    mib = 1024**2
    whole = big.num_params * 4 / mib
    largest = max(torch.Size(shape).numel() for _, shape in big.model_tensors()) * 4 / mib
    growth = max(b - a for a, b in zip(figures["rss_before_build_mib"], figures["build_rss_mib"], strict=True))
    assert growth <= whole / 2 + 4 * largest + 24 < whole, (growth, whole, largest)
    print(
        f"38M GPT ZeRO-3 dp 2: build grew {growth:.0f} MiB; whole fp32 model {whole:.0f} MiB, partition "
        f"{whole / 2:.0f}, largest tensor {largest:.0f}"
    )
