import numpy as np
import pytest

from dspipe.data import TOKENS_FILE, BatchOrder, TokenWindows, read_meta
from dspipe.errors import SpecError


def test_tokenizer_reloads_through_transformers_and_round_trips(corpus):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(corpus / "tokenizer"))
    meta = read_meta(corpus)
    assert len(tok) == meta["vocab_size"] == 1024 and tok.eos_token_id == meta["eos_id"]
    text = "def f(x):\n    return x  # ünïcode\n"
    assert tok.decode(tok.encode(text)) == text


def test_windows_are_consecutive_tokens_of_the_corpus(corpus):
    w = TokenWindows(corpus, seq_len=32)
    raw = np.fromfile(corpus / TOKENS_FILE, dtype=np.uint16)
    assert len(w) == (raw.size - 1) // 32
    assert np.array_equal(w[5], raw[160:193]) and w[5].dtype == np.int64


def order(dp, mb, ga, seed=0, n=1000):
    return BatchOrder(num_samples=n, seed=seed, dp=dp, micro_batch=mb, grad_accum=ga)


def step_samples(o, step):
    return [list(o.indices(step=step, micro=m, dp_rank=r)) for m in range(o.grad_accum) for r in range(o.dp)]


def test_ranks_get_disjoint_samples_and_the_global_order_ignores_dp():
    a, b = order(dp=2, mb=2, ga=2), order(dp=1, mb=2, ga=4)
    for step in range(3):
        flat_a = sum(step_samples(a, step), [])
        assert len(set(flat_a)) == 8
        assert flat_a == sum(step_samples(b, step), [])  # same samples in the same global order


def test_order_is_seeded_and_wraps_epochs():
    assert step_samples(order(2, 2, 2), 0) == step_samples(order(2, 2, 2), 0)
    assert step_samples(order(2, 2, 2), 0) != step_samples(order(2, 2, 2, seed=1), 0)
    o = order(dp=1, mb=10, ga=1, n=20)
    epoch0 = sorted(sum(step_samples(o, 0) + step_samples(o, 1), []))
    assert epoch0 == list(range(20)) and sorted(sum(step_samples(o, 2), [])) != []


def test_truncated_token_file_is_rejected(corpus, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "meta.json").write_text((corpus / "meta.json").read_text())
    (bad / TOKENS_FILE).write_bytes((corpus / TOKENS_FILE).read_bytes()[:1000])
    with pytest.raises(SpecError, match="holds 500 tokens, meta.json says .*truncated or foreign"):
        TokenWindows(bad, seq_len=16)


def test_corpus_shorter_than_a_sequence_is_rejected(corpus):
    with pytest.raises(SpecError, match="shorter than one sequence"):
        TokenWindows(corpus, seq_len=10**8)


def test_missing_data_dir_says_how_to_prepare(tmp_path):
    with pytest.raises(SpecError, match="dspipe prepare-data --out"):
        read_meta(tmp_path / "nope")
