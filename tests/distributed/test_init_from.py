"""Continued pretraining from a Hugging Face model (`gen-config --init-from HF_DIR`): the runner starts from HF_DIR's
weights under ZeRO-3 (partitioned as it is built: each rank reads its partition of each tensor) and under a 2-stage
pipeline (each stage its own layers), and the run exports back to a LlamaForCausalLM that computes what dspipe
computes."""

import json
import math
import shutil

import pytest
import torch

from dspipe.rundir import load_run
from dspipe.runtime import ckpt_meta
from tests.helpers import OFFLINE, gen_config, launch, max_diff, metrics, offline_here

VOCAB = 1024  # the corpus fixture's BPE


def llama_dir(path, *, tied: bool, corpus):
    """A random tiny LlamaForCausalLM (GQA: 4 heads, 2 key/value heads) with weights large enough that its loss is
    far from ln(vocab), and the corpus's tokenizer beside it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11 + tied)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        initializer_range=0.2,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # RMSNorm weights: not all ones
                p.add_(torch.randn(p.shape) * 0.2)
    model.save_pretrained(path)
    for f in (corpus / "tokenizer").iterdir():
        shutil.copy(f, path / f.name)
    return model


def configure(tmp_path, corpus, hf, name, *flags):
    run = tmp_path / name
    r = gen_config(
        "--init-from",
        hf,
        "--gpus-per-node",
        "2",
        "--gpu",
        "cpu",
        "--global-batch",
        "16",
        "--micro-batch",
        "4",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--log-interval",
        "1",
        "--eval-interval",
        "0",
        "--data",
        corpus,
        "--out",
        run,
        "--precision",
        "fp32",
        "--offload",
        "none",
        "--no-offload-params",
        "--checkpointing",
        "none",
        *flags,
    )
    assert r.returncode == 0, r.stderr
    assert f"note: {corpus}'s tokenizer has the same vocab size as {hf}'s ({VOCAB} tokens)" in r.stderr
    return run


def first_batch_loss(model, corpus) -> float:
    """The loss of `model` (transformers) on the run's first global batch: 16 windows in the dp-invariant order of
    the runner's loader (seed 1234, gen-config's default), mean over every token."""
    from dspipe.data import TokenWindows, TrainLoader

    loader = TrainLoader(windows=TokenWindows(str(corpus), seq_len=64), seed=1234, micro_batch=16, dp=1, dp_rank=0)
    inputs, labels = next(loader)
    with torch.no_grad():
        logits = model(inputs).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).item()


@pytest.mark.distributed
def test_continued_pretraining_from_a_hugging_face_llama(tmp_path, corpus, monkeypatch):
    """ZeRO-3 (2 ranks, dp 2) at lr 1e-12: the first step's loss is the HF model's on the same batch, and the
    export after 3 steps computes the HF model's logits. pp = 2 (tied head) at a normal lr: the first step's loss
    is the HF model's again (both stages loaded), the weights then move, and the export computes dspipe's logits."""
    from transformers import AutoModelForCausalLM

    from dspipe.model.hf import spec_from_hf_dir
    from dspipe.model.hf_state import from_hf_state
    from dspipe.tools.consolidate import consolidate, load_gpt

    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(3))
    found = {}

    # ZeRO-3, untied head, lr 1e-12 (no weight decay): the weights stay the HF model's to ~1e-11
    hf_dir = tmp_path / "hf-untied"
    hf = llama_dir(hf_dir, tied=False, corpus=corpus)
    run = configure(
        tmp_path, corpus, hf_dir, "zero3", "--zero", "3", "--pp", "1", "--lr", "1e-12", "--weight-decay", "0"
    )
    r = launch(run)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    startup = json.loads((run / "engine.json").read_text())["startup"]  # each rank read only its partitions
    assert startup["mode"] == "partitioned" and len(startup["peak_rss_mib"]) == 2
    assert sum(startup["built_params"]) - load_run(run).model.num_params in range(0, 2 * 20)  # partitions (+padding)
    assert all(
        0 < a <= b <= c
        for a, b, c in zip(
            startup["rss_before_build_mib"], startup["build_rss_mib"], startup["peak_rss_mib"], strict=True
        )
    )
    expected = first_batch_loss(hf, corpus)
    assert abs(expected - math.log(VOCAB)) > 0.1  # not a loss any random initialisation would give
    found["zero3 step-1 loss - HF loss"] = abs(metrics(run, "loss")[0] - expected)
    tag = run / "checkpoints" / "global_step3"
    spec = spec_from_hf_dir(hf_dir)
    found["zero3 consolidated - HF weights"] = max_diff(
        consolidate(tag, meta=ckpt_meta.read_meta(tag)), from_hf_state(hf.state_dict(), spec)
    )
    out = tmp_path / "export-zero3"
    r = offline_here("export-hf", run, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported).__name__ == "LlamaForCausalLM" and exported.config.num_key_value_heads == 2
    with torch.no_grad():
        found["zero3 export logits - HF logits"] = (exported(ids).logits - hf(ids).logits).abs().max().item()

    # tp = 2 (dspipe's tensor-parallel layers: each rank reads only its shards' rows of the checkpoint), ZeRO-1,
    # lr 1e-12: the same loss, and the export merges the shards back into the HF model's logits
    run = configure(
        tmp_path, corpus, hf_dir, "tp2", "--zero", "1", "--pp", "1", "--tp", "2", "--lr", "1e-12", "--weight-decay", "0"
    )
    r = launch(run)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    found["tp2 step-1 loss - HF loss"] = abs(metrics(run, "loss")[0] - expected)
    out = tmp_path / "export-tp2"
    r = offline_here("export-hf", run, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    with torch.no_grad():
        found["tp2 export logits - HF logits"] = (
            (AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits - hf(ids).logits).abs().max().item()
        )

    # pp = 2 (each stage loads its own layers; the tied embedding/head on both), ZeRO-1, lr 3e-3
    hf_dir = tmp_path / "hf-tied"
    hf = llama_dir(hf_dir, tied=True, corpus=corpus)
    run = configure(tmp_path, corpus, hf_dir, "pp2", "--zero", "1", "--pp", "2", "--lr", "3e-3")
    r = launch(run)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    startup = json.loads((run / "engine.json").read_text())["startup"]  # each stage built its own layers only
    total, embedding = load_run(run).model.num_params, VOCAB * 64
    assert startup["mode"] == "stage" and sum(startup["built_params"]) == total + embedding  # tied: on both ends
    assert max(startup["built_params"]) < 0.75 * total, startup["built_params"]
    expected = first_batch_loss(hf, corpus)
    losses = metrics(run, "loss")
    found["pp2 step-1 loss - HF loss"] = abs(losses[0] - expected)
    tag = run / "checkpoints" / "global_step3"
    trained = consolidate(tag, meta=ckpt_meta.read_meta(tag))
    moved = max_diff(trained, from_hf_state(hf.state_dict(), spec_from_hf_dir(hf_dir)))
    out = tmp_path / "export-pp2"
    r = offline_here("export-hf", tag, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert exported.config.tie_word_embeddings and type(exported).__name__ == "LlamaForCausalLM"
    gpt = load_gpt(tag, meta=ckpt_meta.read_meta(tag))
    with torch.no_grad():
        found["pp2 export logits - dspipe logits"] = (exported(ids).logits - gpt(ids)).abs().max().item()
    print(found, f"pp2 weights moved by {moved:.3g}, losses {losses}")
    assert moved > 1e-3
    assert all(v < 1e-5 for v in found.values()), found
    assert found["zero3 consolidated - HF weights"] < 1e-9, found
