"""dspipe export-hf and dspipe generate: consolidation of ZeRO-1/ZeRO-3/pipeline checkpoints, the GPT-2 export
loaded back with transformers (logits equal to dspipe's GPT), the shared sampling loop, and the refusals."""

import json
import re

import pytest
import torch

from dspipe.errors import SpecError
from dspipe.runtime import ckpt_tags
from dspipe.spec.model import ModelSpec
from tests.helpers import dspipe, error_lines, make_run


def tokens(vocab, n=2, seq=16):
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(7))


# ---- unit: the GPT-2 mapping, the sampling loop, refusals -------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_hf_model_computes_the_same_logits_as_dspipe_gpt(tied):
    from dspipe.model.gpt import GPT
    from dspipe.model.hf_state import hf_model

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
    runs = [
        sample(fake_model(flat), [1], sampling=Sampling(max_tokens=30, temperature=1, top_k=0, seed=s))
        for s in (1, 1, 2)
    ]
    assert runs[0] == runs[1] != runs[2] and all(0 < t < 5 for t in runs[0]) and len(runs[0]) <= 30


def test_sampling_options_are_checked():
    from dspipe.tools.generate import Sampling

    for kwargs, msg in (
        ({"temperature": -1}, "--temperature must be >= 0"),
        ({"top_k": -2}, "--top-k must be >= 0"),
        ({"max_tokens": 0}, "--max-tokens must be at least 1"),
    ):
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
        (
            ("export-hf", partial, "--out", out),
            f"--out {out} exists and is not an export-hf model directory written by dspipe",
        ),
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
    from dataclasses import asdict

    from dspipe.rundir import load_run

    spec = load_run(run)
    data = {
        "consumed_samples": 64,
        "epoch": 0,
        "seed": spec.train.seed,
        "num_samples": 100,
        "seq_len": spec.model.seq_len,
        "split": "train",
        "fingerprint": "ab" * 32,
    }
    (tag / ckpt_tags.META_FILE).write_text(
        json.dumps(
            {
                "step": 4,
                "consumed_samples": 64,
                "data": data,
                "model": asdict(spec.model),
                "pp": 1,
                "zero_stage": 1,
                "dp": 2,
                "world_size": 2,
            }
        )
    )
    with pytest.raises(SpecError, match=re.escape(f"tokenizer not found: {tmp_path / 'gone' / 'tokenizer'}")):
        export_hf(source=run, out=tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
