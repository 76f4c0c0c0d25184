"""dspipe export-hf and dspipe generate: consolidation of ZeRO-1/ZeRO-3/pipeline checkpoints, the GPT-2 export
loaded back with transformers (logits equal to dspipe's GPT), the shared sampling loop, and the refusals."""

import pytest
import torch

from dspipe.runtime import ckpt_meta
from dspipe.spec.model import ModelSpec
from tests.helpers import OFFLINE, error_lines, launch, make_run, max_diff, offline_here

# ---- distributed: real checkpoints ------------------------------------------------------------------------------


@pytest.mark.distributed
def test_export_of_zero3_and_pipeline_checkpoints(tmp_path, corpus, monkeypatch):
    """Same seed, data and steps under ZeRO-1, ZeRO-3 and pp=2: the consolidated fp32 weights agree (only the
    summation order differs), each export loads offline with transformers and computes dspipe's logits, and greedy
    generation from a checkpoint and from its export prints the same text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspipe.model.gpt import GPT
    from dspipe.spec.core import from_dict
    from dspipe.tools.consolidate import consolidate, load_gpt

    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    runs = {
        name: make_run(tmp_path, corpus, "--precision", "fp32", *flags, steps=4, name=name)
        for name, flags in (
            ("zero1", ["--zero", "1"]),
            ("zero3", ["--zero", "3"]),
            ("pp2", ["--zero", "1", "--pp", "2"]),
        )
    }
    for run in runs.values():
        r = launch(run)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    tags = {name: run / "checkpoints" / "global_step4" for name, run in runs.items()}
    assert sorted(p.name for p in tags["pp2"].glob("layer_*")) == [  # tied embedding stored once, no head file
        "layer_00-model_states.pt",
        "layer_01-model_states.pt",
        "layer_02-model_states.pt",
        "layer_03-model_states.pt",
    ]  # embedding, 2 blocks, final norm
    weights = {name: consolidate(tag, meta=ckpt_meta.read_meta(tag)) for name, tag in tags.items()}
    spec = from_dict(ModelSpec, ckpt_meta.read_meta(tags["zero1"]).model)
    initial = GPT(spec, seed=1234).state_dict()  # gen-config's default seed
    assert max_diff(weights["zero1"], initial) > 1e-3  # trained: the weights moved
    assert max_diff(weights["zero3"], weights["zero1"]) < 1e-5
    assert max_diff(weights["pp2"], weights["zero1"]) < 1e-5

    for name in ("zero3", "pp2"):
        out = tmp_path / f"hf-{name}"
        src = runs[name] if name == "zero3" else tags[name]  # a run directory means its newest checkpoint
        r = offline_here("export-hf", src, "--out", out)
        assert r.returncode == 0, r.stderr[-3000:]
        assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".hf-{name}")]  # no temp leftovers
        hf = AutoModelForCausalLM.from_pretrained(out).eval()
        tok = AutoTokenizer.from_pretrained(out)
        assert tok.eos_token_id == 0 and hf.config.eos_token_id == 0 and hf.config.tie_word_embeddings
        gpt = load_gpt(tags[name], meta=ckpt_meta.read_meta(tags[name]))
        ids = torch.tensor([tok.encode("def f(x):\n    return x + 1\n")[:64]])
        with torch.no_grad():
            torch.testing.assert_close(hf(ids).logits, gpt(ids), atol=1e-5, rtol=0)

    out = tmp_path / "hf-pp2"
    before = (out / "model.safetensors").read_bytes()
    r = offline_here("export-hf", tags["pp2"], "--out", out)  # exists: refused, untouched
    assert r.returncode == 2 and error_lines(r) == [f"dspipe: error: {out} already exists (pass --force to replace it)"]
    assert (out / "model.safetensors").read_bytes() == before
    r = offline_here("export-hf", tags["zero1"], "--out", out, "--force")  # replaced by another checkpoint's
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "model.safetensors").read_bytes() != before

    texts = [
        offline_here("generate", src, "--prompt", "def ", "--temperature", "0", "--max-tokens", "12")
        for src in (tags["zero1"], out)
    ]
    assert [t.returncode for t in texts] == [0, 0], [t.stderr[-2000:] for t in texts]
    assert texts[0].stdout == texts[1].stdout and texts[0].stdout.startswith("def ")
