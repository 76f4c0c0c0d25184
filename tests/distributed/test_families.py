"""The Llama family beyond Llama-2/3 on real CPU ranks (`gen-config --init-from HF_DIR` and the runner): a tiny random
Llama 3.1-style checkpoint (llama3 rope scaling that matters at the run's length, head_dim != hidden/heads, q/k/v,
output and MLP biases, GQA), a Qwen2 (q/k/v biases, tied embeddings), a Qwen3 (q/k RMSNorm per head, head_dim twice
hidden/heads) and a Mistral (sliding window 16, shorter than the sequence of 64), each written by transformers'
save_pretrained with the corpus's tokenizer beside it. Under ZeRO-3 (dp 2), tp 2, pp 2 and sp 2 (2 ranks, fp32,
dropout 0) the first step's loss is transformers' loss on the same batch, and export-hf of the last checkpoint
(ZeRO-3, tp 2 and pp 2) reloads as the family's class with its config and computes dspipe's logits: those
of transformers' model too at lr 1e-12, moved ones at pp 2 (lr 3e-3). The first step's gradient norm is
transformers' too (every gradient reduced where the layout splits it: q/k norms under tp 2, a tied head under pp 2).
Every family runs every layout (none is refused). One test a family, one launch a layout (16 in all): ZeRO-1 runs
under tp 2, pp 2 and sp 2, and dp 2 under ZeRO-3."""

import json
import math

import pytest
import torch

from dspipe.runtime import ckpt_meta
from tests.helpers import OFFLINE, gen_config, launch, metrics, offline_here, save_hf_checkpoint

pytestmark = pytest.mark.distributed

VOCAB, SEQ = 1024, 64  # the corpus fixture's BPE; the run's sequence
LOSS_TOL, NORM_TOL, LOGITS_TOL = 1e-5, 1e-4, 1e-4  # absolute, relative, absolute
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
)

# family: (transformers class, config class, its arguments, what the export's config must say)
FAMILIES = {
    "llama3.1": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            head_dim=24,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
        dict(head_dim=24, attention_bias=True, mlp_bias=True, num_key_value_heads=2),
    ),
    "qwen2": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        dict(tie_word_embeddings=True, num_key_value_heads=2),
    ),
    "qwen3": (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        dict(head_dim=32, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        dict(head_dim=32, num_key_value_heads=2),
    ),
    "mistral": (
        "MistralForCausalLM",
        "MistralConfig",
        dict(sliding_window=16, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        dict(sliding_window=16, num_key_value_heads=2),
    ),
}
# layout: (flags, steps). lr 1e-12 without weight decay keeps the weights the HF model's, so the export computes
# transformers' logits too; 2 steps, the fewest gen-config accepts (warmup 1 < steps). pp 2 trains at a normal lr
# for 3 steps: with warmup 1 the first two steps apply lr 0 (metrics.csv logs the lr of the step after), the third
# moves the weights; its blocks are compiled (--compile: transformers' loss and gradients through compiled stages)
FROZEN = ["--lr", "1e-12", "--weight-decay", "0"]
LAYOUTS = {
    "zero3": (["--zero", "3", *FROZEN], 2),
    "tp2": (["--zero", "1", "--tp", "2", *FROZEN], 2),
    "pp2": (["--zero", "1", "--pp", "2", "--lr", "3e-3", "--compile"], 3),
    "sp2": (["--zero", "1", "--sp", "2", *FROZEN], 2),
}
EXPORTED = ("zero3", "tp2", "pp2")  # the layouts whose checkpoint is exported and reloaded in transformers
MOVED = "pp2"  # the layout whose weights train (its export is compared with dspipe only)


def family_dir(path, family: str, corpus):
    """A random tiny checkpoint of `family` (save_pretrained) with weights large enough that its loss is far from
    ln(vocab), RMSNorm weights (q/k norms included) and biases not at their initial ones and zeros, and the corpus's
    tokenizer beside it; returns the model transformers loads back from it (it computes what the files say)."""
    cls, config_cls, kwargs, _ = FAMILIES[family]
    return save_hf_checkpoint(
        path,
        cls=cls,
        config_cls=config_cls,
        config={**BASE, **kwargs},
        seed=sorted(FAMILIES).index(family) + 21,
        tokenizer_dir=corpus / "tokenizer",
    )


def configure(run, corpus, hf_dir, steps, *flags):
    return gen_config(
        "--init-from",
        hf_dir,
        "--gpus-per-node",
        "2",
        "--gpu",
        "cpu",
        "--global-batch",
        "16",
        "--micro-batch",
        "4",
        "--steps",
        steps,
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
        "--pp",
        "1",
        *flags,
    )


def first_batch(model, corpus) -> tuple:
    """(loss, gradient norm) of `model` (transformers) on the run's first global batch: 16 windows in the
    dp-invariant order of the runner's loader (seed 1234, gen-config's default), the loss the mean over every token,
    the norm over every parameter (a tied one once)."""
    from dspipe.data import TokenWindows, TrainLoader

    loader = TrainLoader(windows=TokenWindows(str(corpus), seq_len=SEQ), seed=1234, micro_batch=16, dp=1, dp_rank=0)
    inputs, labels = next(loader)
    model.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(inputs).logits.reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    model.zero_grad()
    return loss.item(), norm


def first_step(run) -> tuple:
    """(loss, grad_norm) of the run's first step, as metrics.csv writes them (full precision)."""
    return metrics(run, "loss", "grad_norm")[0]


def without_feature(hf_dir, family: str):
    """The checkpoint as transformers computes it without the feature the run must respect (llama3 rope scaling,
    Mistral's window); None for the families whose features are weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    if family == "llama3.1":
        config.rope_parameters = dict(rope_type="default", rope_theta=10000.0)
    elif family == "mistral":
        config.sliding_window = None
    else:
        return None
    return AutoModelForCausalLM.from_pretrained(hf_dir, config=config).float().eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_starts_from_transformers_loss_and_exports_its_class(family, tmp_path, corpus, monkeypatch):
    from transformers import AutoModelForCausalLM

    from dspipe.tools.consolidate import load_gpt

    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    cls, _, _, exported_config = FAMILIES[family]
    hf_dir = tmp_path / "hf"
    hf = family_dir(hf_dir, family, corpus)
    expected, expected_norm = first_batch(hf, corpus)
    assert abs(expected - math.log(VOCAB)) > 0.3, expected  # not a loss any random initialisation would give
    plain = without_feature(hf_dir, family)
    feature = None if plain is None else abs(first_batch(plain, corpus)[0] - expected)
    assert feature is None or feature > 1e-3  # the scaling / the window changes this loss far beyond the tolerance
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf_logits = hf(ids).logits
    found, failed, moved = {}, {}, None
    for layout, (flags, steps) in LAYOUTS.items():
        run = tmp_path / layout
        r = configure(run, corpus, hf_dir, steps, *flags)
        assert r.returncode == 0, f"{layout}: {r.stderr}"
        assert f"note: {corpus}'s tokenizer has the same vocab size as {hf_dir}'s ({VOCAB} tokens)" in r.stderr
        r = launch(run)
        if r.returncode != 0:
            failed[layout] = r.stdout[-2000:] + r.stderr[-2000:]
            continue
        loss, norm = first_step(run)
        found[f"{layout} step-1 loss - HF loss"] = abs(loss - expected)
        found[f"{layout} step-1 grad norm / HF's - 1"] = abs(norm / expected_norm - 1)  # every gradient reduced
        if layout not in EXPORTED:
            continue
        tag = run / "checkpoints" / f"global_step{steps}"
        out = tmp_path / f"export-{layout}"
        r = offline_here("export-hf", run, "--out", out)
        if r.returncode != 0:
            failed[f"{layout} export-hf"] = r.stderr[-2000:]
            continue
        exported = AutoModelForCausalLM.from_pretrained(out).float().eval()
        assert type(exported).__name__ == cls, type(exported).__name__
        assert {k: getattr(exported.config, k) for k in exported_config} == exported_config
        if family == "llama3.1":
            rope = exported.config.rope_parameters
            assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("llama3", 8.0, 16)
        gpt = load_gpt(tag, meta=ckpt_meta.read_meta(tag)).eval()
        with torch.no_grad():
            logits = exported(ids).logits
            found[f"{layout} export logits - dspipe logits"] = (logits - gpt(ids)).abs().max().item()
            if layout == MOVED:
                moved = (logits - hf_logits).abs().max().item()
            else:
                found[f"{layout} export logits - HF logits"] = (logits - hf_logits).abs().max().item()
    print(
        family,
        f"HF loss {expected:.6f}, grad norm {expected_norm:.6f}, loss without the scaling / window: {feature}",
        json.dumps(found, indent=1),
        f"{MOVED} logits moved by {moved}",
    )
    assert not failed, "\n".join(f"--- {k}\n{v}" for k, v in failed.items())
    tolerance = {"loss": LOSS_TOL, "grad": NORM_TOL, "logits": LOGITS_TOL}
    assert all(v < tolerance[k.split()[2]] for k, v in found.items()), found
    assert len(found) == 2 * len(LAYOUTS) + 2 * len(EXPORTED) - 1
    assert moved > 1e-2, moved  # the weights trained at pp 2
