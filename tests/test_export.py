"""dspipe export-hf and dspipe generate: consolidation of ZeRO-1/ZeRO-3/pipeline checkpoints, the GPT-2 export
loaded back with transformers (logits equal to dspipe's GPT), the shared sampling loop, and the refusals."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from dspipe.runtime import checkpoint as ckpt
from dspipe.errors import SpecError
from dspipe.planner.spec import ModelSpec
from tests.conftest import ROOT, dspipe
from tests.test_distributed import launch, make_run

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def dspipe_offline(*args):
    return subprocess.run([sys.executable, "-m", "dspipe", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **OFFLINE})


def error_lines(r):
    return [line for line in r.stderr.splitlines() if line.strip()]


def tokens(vocab, n=2, seq=16):
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(7))


# ---- unit: the GPT-2 mapping, the sampling loop, refusals -------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_hf_model_computes_the_same_logits_as_dspipe_gpt(tied):
    from dspipe.tools.export import hf_model
    from dspipe.model.gpt import GPT

    spec = ModelSpec("t", 2, 32, 4, 96, 24, 80, 0.0, tied)
    gpt = GPT(spec, seed=3).eval()
    with torch.no_grad():  # non-trivial LayerNorms and biases, so a missed transpose or swap cannot hide
        for name, p in gpt.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    state = {k: v.clone() for k, v in gpt.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    hf = hf_model(state, spec, eos_id=0, source="test")
    assert hf.config.activation_function == "gelu_new" and hf.config.n_inner == 80 and hf.config.n_positions == 24
    assert hf.config.tie_word_embeddings is tied
    ids = tokens(96, seq=24)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, gpt(ids), atol=1e-5, rtol=0)


class FakeTokenizer:
    eos_token_id = 0

    def __len__(self):
        return 5  # the model below has 8 logits: ids 5-7 (a padded vocab) must never be produced


def fake_model(table, seen=None, context=4):
    """Logits depend on the last token only: row `table[last]`."""
    from dspipe.tools.generate import Model

    def logits(ids):
        if seen is not None:
            seen.append(ids.shape[1])
        return torch.tensor(table, dtype=torch.float)[ids]
    return Model(logits=logits, context=context, tokenizer=FakeTokenizer())


def test_sampling_loop():
    from dspipe.tools.generate import Sampling, sample

    # greedy: 1 -> 2 -> 3 -> 1 ...; id 7 scores highest but lies beyond the tokenizer's vocabulary
    table = [[0, 0, 0, 0, 0, 0, 0, 9]] + [[0] * 8 for _ in range(7)]
    table[1][2] = table[2][3] = table[3][1] = 5
    for row in table[1:4]:
        row[7] = 9
    seen = []
    out = sample(fake_model(table, seen), [1], sampling=Sampling(max_tokens=6, temperature=0))
    assert out == [2, 3, 1, 2, 3, 1]
    assert seen == [1, 2, 3, 4, 4, 4]  # the window is cropped to the context (4)
    table[3][0] = 6  # 3 -> EOS: stop, EOS not included
    assert sample(fake_model(table), [1], sampling=Sampling(max_tokens=6, temperature=0)) == [2, 3]
    # top-k 1 is greedy at any temperature; seeded sampling repeats; different seeds differ
    assert sample(fake_model(table), [1], sampling=Sampling(max_tokens=6, temperature=5, top_k=1, seed=3)) == [2, 3]
    flat = [[1.0] * 5 + [50.0] * 3 for _ in range(8)]
    runs = [sample(fake_model(flat), [1], sampling=Sampling(max_tokens=30, temperature=1, top_k=0, seed=s))
            for s in (1, 1, 2)]
    assert runs[0] == runs[1] != runs[2] and all(0 < t < 5 for t in runs[0]) and len(runs[0]) <= 30


def test_sampling_options_are_checked():
    from dspipe.tools.generate import Sampling

    for kwargs, msg in (({"temperature": -1}, "--temperature must be >= 0"), ({"top_k": -2}, "--top-k must be >= 0"),
                        ({"max_tokens": 0}, "--max-tokens must be at least 1")):
        with pytest.raises(SpecError, match=msg):
            Sampling(**kwargs)


def test_bad_sources_are_one_line_errors(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    partial = tmp_path / "run" / "checkpoints" / ".partial-global_step6"
    partial.mkdir(parents=True)
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"")
    cases = [
        (("export-hf", tmp_path / "nope", "--out", tmp_path / "o2"), f"{tmp_path / 'nope'} does not exist"),
        (("export-hf", partial, "--out", tmp_path / "o3"), f"checkpoint {partial} is incomplete"),
        (("export-hf", partial, "--out", out), f"{out} already exists (pass --force to replace it)"),
        (("generate", tmp_path / "nope", "--prompt", "x"), f"{tmp_path / 'nope'} does not exist"),
        (("generate", partial, "--prompt", "x", "--temperature", "-1"), "--temperature must be >= 0"),
    ]
    for args, msg in cases:
        r = dspipe(*args)
        assert r.returncode == 2, (args, r.stderr)
        lines = error_lines(r)
        assert len(lines) == 1 and lines[0].startswith("dspipe: error: ") and msg in lines[0], (args, r.stderr)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]  # nothing half-written beside it


def test_missing_tokenizer_is_a_one_line_error(tmp_path):
    """A complete checkpoint whose run's data directory (with the tokenizer) is gone."""
    from dspipe.tools.export import export_hf

    run = make_run(tmp_path, tmp_path / "gone", "--zero", "1", steps=4)
    tag = run / "checkpoints" / "global_step4"
    tag.mkdir(parents=True)
    (tag / ckpt.META_FILE).write_text(json.dumps({"step": 4}))
    with pytest.raises(SpecError, match=re.escape(f"tokenizer not found: {tmp_path / 'gone' / 'tokenizer'}")):
        export_hf(source=run, out=tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# ---- distributed: real checkpoints ------------------------------------------------------------------------------

def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.distributed
def test_export_of_zero3_and_pipeline_checkpoints(tmp_path, corpus, monkeypatch):
    """Same seed, data and steps under ZeRO-1, ZeRO-3 and pp=2: the consolidated fp32 weights agree (only the
    summation order differs), each export loads offline with transformers and computes dspipe's logits, and greedy
    generation from a checkpoint and from its export prints the same text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspipe.tools.export import consolidate, load_gpt
    from dspipe.model.gpt import GPT
    from dspipe.planner.spec import from_dict

    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    runs = {name: make_run(tmp_path, corpus, "--precision", "fp32", *flags, steps=4, name=name)
            for name, flags in (("zero1", ["--zero", "1"]), ("zero3", ["--zero", "3"]),
                                ("pp2", ["--zero", "1", "--pp", "2"]))}
    for run in runs.values():
        r = launch(run)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    tags = {name: run / "checkpoints" / "global_step4" for name, run in runs.items()}
    assert sorted(p.name for p in tags["pp2"].glob("layer_*")) == [  # tied embedding stored once, no head file
        "layer_00-model_states.pt", "layer_01-model_states.pt", "layer_02-model_states.pt",
        "layer_03-model_states.pt"]  # embedding, 2 blocks, final norm
    weights = {name: consolidate(tag, meta=ckpt.read_meta(tag)) for name, tag in tags.items()}
    spec = from_dict(ModelSpec, ckpt.read_meta(tags["zero1"])["model"])
    initial = GPT(spec, seed=1234).state_dict()  # gen-config's default seed
    assert max_diff(weights["zero1"], initial) > 1e-3  # trained: the weights moved
    assert max_diff(weights["zero3"], weights["zero1"]) < 1e-5
    assert max_diff(weights["pp2"], weights["zero1"]) < 1e-5

    for name in ("zero3", "pp2"):
        out = tmp_path / f"hf-{name}"
        src = runs[name] if name == "zero3" else tags[name]  # a run directory means its newest checkpoint
        r = dspipe_offline("export-hf", src, "--out", out)
        assert r.returncode == 0, r.stderr[-3000:]
        assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".hf-{name}")]  # no temp leftovers
        hf = AutoModelForCausalLM.from_pretrained(out).eval()
        tok = AutoTokenizer.from_pretrained(out)
        assert tok.eos_token_id == 0 and hf.config.eos_token_id == 0 and hf.config.tie_word_embeddings
        gpt = load_gpt(tags[name], meta=ckpt.read_meta(tags[name]))
        ids = torch.tensor([tok.encode("def f(x):\n    return x + 1\n")[:64]])
        with torch.no_grad():
            torch.testing.assert_close(hf(ids).logits, gpt(ids), atol=1e-5, rtol=0)

    out = tmp_path / "hf-pp2"
    before = (out / "model.safetensors").read_bytes()
    r = dspipe_offline("export-hf", tags["pp2"], "--out", out)  # exists: refused, untouched
    assert r.returncode == 2 and error_lines(r) == [f"dspipe: error: {out} already exists (pass --force to replace it)"]
    assert (out / "model.safetensors").read_bytes() == before
    r = dspipe_offline("export-hf", tags["zero1"], "--out", out, "--force")  # replaced by another checkpoint's
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "model.safetensors").read_bytes() != before

    texts = [dspipe_offline("generate", src, "--prompt", "def ", "--temperature", "0", "--max-tokens", "12")
             for src in (tags["zero1"], out)]
    assert [t.returncode for t in texts] == [0, 0], [t.stderr[-2000:] for t in texts]
    assert texts[0].stdout == texts[1].stdout and texts[0].stdout.startswith("def ")
