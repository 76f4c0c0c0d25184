"""The loader over a real prepared corpus: windows, the seeded dp-invariant order, exact resume, validation batches,
and rejection of damaged or foreign shards."""

import json
import shutil

import numpy as np
import pytest
import torch

from dspipe.data import (
    BatchOrder,
    Permutation,
    TokenWindows,
    TrainLoader,
    check_data_for_model,
    open_split,
    padded_vocab,
    read_meta,
    val_batches,
)
from dspipe.data.shards import HEADER
from dspipe.errors import SpecError


def raw_tokens(corpus, name="train-00000"):
    meta = read_meta(corpus)
    return np.fromfile(corpus / f"{name}.bin", dtype=meta["dtype"], offset=HEADER.size)


def test_tokenizer_reloads_through_transformers_and_matches_the_shards(corpus):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(corpus / "tokenizer"))
    meta = read_meta(corpus)
    assert len(tok) == meta["vocab_size"] == 1024 and tok.eos_token_id == meta["eos_id"]
    text = "def f(x):\n    return x  # ünïcode ✓\n"
    assert tok.decode(tok.encode(text)) == text
    tokens, offsets = open_split(corpus, "train")[0]
    first_doc = tokens[int(offsets[0]) : int(offsets[1])]
    assert first_doc[-1] == tok.eos_token_id
    assert tok.encode(tok.decode(first_doc[:-1]), add_special_tokens=False) == first_doc[:-1].tolist()


def test_windows_are_consecutive_tokens_of_the_memory_map(corpus):
    w = TokenWindows(corpus, seq_len=32)
    raw = raw_tokens(corpus)
    assert len(w) == (raw.size - 1) // 32
    assert np.array_equal(w[5], raw[160:193]) and w[5].dtype == np.int64
    assert isinstance(w.shards[0], np.memmap)  # no copy of the corpus in RAM
    assert np.array_equal(w.rows([5, 0]), np.stack([w[5], w[0]]))
    with pytest.raises(IndexError):
        w[len(w)]


def loader(windows, *, dp=1, rank=0, mb=2, seed=0, consumed=0):
    return TrainLoader(windows=windows, seed=seed, micro_batch=mb, dp=dp, dp_rank=rank, consumed_samples=consumed)


def take(ld, n):
    return [next(ld) for _ in range(n)]


def rows_of(batches):
    return [row for inputs, _ in batches for row in inputs.tolist()]


def test_batches_are_inputs_and_labels_shifted_by_one(corpus):
    w = TokenWindows(corpus, seq_len=16)
    inputs, labels = next(loader(w, mb=4))
    assert inputs.shape == labels.shape == (4, 16) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], labels[:, :-1])


def test_same_seed_same_batches_on_every_rank_and_ranks_are_disjoint(corpus):
    w = TokenWindows(corpus, seq_len=16)
    for rank in range(4):
        a, b = take(loader(w, dp=4, rank=rank), 5), take(loader(w, dp=4, rank=rank), 5)
        assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b, strict=False))
    assert rows_of(take(loader(w, seed=1), 3)) != rows_of(take(loader(w, seed=0), 3))
    idx = [loader(w, dp=4, rank=r) for r in range(4)]
    seen = [set(np.concatenate([ld.next_indices() for _ in range(50)]).tolist()) for ld in idx]
    assert all(len(s) == 100 for s in seen)
    assert all(not (seen[i] & seen[j]) for i in range(4) for j in range(i + 1, 4))  # disjoint samples


def test_the_global_order_does_not_depend_on_dp(corpus):
    w = TokenWindows(corpus, seq_len=16)
    one = loader(w, dp=1, mb=2)
    serial = [one.next_indices().tolist() for _ in range(12)]  # 12 micro-batches of 2 = 24 samples
    ranks = [loader(w, dp=4, rank=r, mb=2) for r in range(4)]
    parallel = [ranks[r].next_indices().tolist() for _ in range(3) for r in range(4)]  # 3 micro-batches x 4 ranks
    assert serial == parallel
    order = BatchOrder(num_samples=len(w), seed=0, dp=2, micro_batch=2, grad_accum=3)
    assert sum(([*order.indices(step=0, micro=m, dp_rank=r)] for m in range(3) for r in range(2)), []) == sum(
        serial[:6], []
    )


def test_every_window_once_per_epoch_then_a_new_order(corpus):
    w = TokenWindows(corpus, seq_len=512)
    n = len(w)
    ld = loader(w, mb=1)
    epoch0 = [int(ld.next_indices()[0]) for _ in range(n)]
    assert sorted(epoch0) == list(range(n)) and ld.epoch == 1
    epoch1 = [int(ld.next_indices()[0]) for _ in range(n)]
    assert sorted(epoch1) == list(range(n)) and epoch1 != epoch0


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 12345])
def test_permutation_is_a_seeded_bijection_with_random_access(n):
    p = Permutation(n, seed=7, epoch=0)
    full = p(np.arange(n))
    assert sorted(full.tolist()) == list(range(n))
    some = np.array([n - 1, 0, n // 2])
    assert np.array_equal(p(some), full[some])
    if n > 5:
        assert not np.array_equal(Permutation(n, seed=8, epoch=0)(np.arange(n)), full)
        assert not np.array_equal(Permutation(n, seed=7, epoch=1)(np.arange(n)), full)


def test_resume_continues_with_exactly_the_next_batch(corpus, tmp_path):
    w = TokenWindows(corpus, seq_len=16)
    ld = loader(w, dp=2, rank=1, mb=3)
    take(ld, 7)
    state = ld.state_dict()
    torch.save({"data": state}, tmp_path / "client_state.pt")  # as in the checkpoint's client_state
    expected = take(ld, 5)
    resumed = loader(w, dp=2, rank=1, mb=3)
    resumed.load_state_dict(torch.load(tmp_path / "client_state.pt")["data"])
    assert state["consumed_samples"] == 7 * 2 * 3 and state["seed"] == 0 and state["epoch"] == 0
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(expected, take(resumed, 5), strict=False)
    )


def test_resume_with_another_dp_size_keeps_the_global_order(corpus):
    w = TokenWindows(corpus, seq_len=16)
    reference = loader(w, dp=1, mb=2)
    global_order = [reference.next_indices().tolist() for _ in range(16)]
    before = [loader(w, dp=2, rank=r, mb=2) for r in range(2)]
    for _ in range(4):  # 4 micro-batches x dp 2 x mb 2 = 16 samples
        for ld in before:
            ld.next_indices()
    state = before[0].state_dict()
    after = [loader(w, dp=4, rank=r, mb=2) for r in range(4)]
    for ld in after:
        ld.load_state_dict(state)
    resumed = [after[r].next_indices().tolist() for _ in range(2) for r in range(4)]
    assert resumed == global_order[8:16]


def test_skip_moves_like_reading(corpus):
    w = TokenWindows(corpus, seq_len=16)
    a, b = loader(w, dp=2), loader(w, dp=2)
    take(a, 3)
    b.skip(3)
    assert a.state_dict() == b.state_dict() and torch.equal(next(a)[0], next(b)[0])


def test_state_from_other_data_or_seed_is_refused(corpus):
    w = TokenWindows(corpus, seq_len=16)
    state = loader(w).state_dict()
    with pytest.raises(SpecError, match="seed 0 in the checkpoint, 1 now"):
        loader(w, seed=1).load_state_dict(state)
    with pytest.raises(SpecError, match="seq_len 16 in the checkpoint, 32 now"):
        loader(TokenWindows(corpus, seq_len=32)).load_state_dict(state)
    with pytest.raises(SpecError, match="not a multiple of dp 2 x micro_batch 2"):
        loader(w, dp=2).load_state_dict({**state, "consumed_samples": 6})


def test_validation_batches_are_ordered_disjoint_and_equal_in_number(corpus):
    w = TokenWindows(corpus, seq_len=8, split="val")
    per_rank = [list(val_batches(windows=w, micro_batch=2, dp=2, dp_rank=r)) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == len(w) // 4 > 0
    first = torch.cat([per_rank[0][0][0], per_rank[1][0][0]])
    assert torch.equal(first, torch.from_numpy(w.rows(range(4))[:, :-1]))
    assert len(list(val_batches(windows=w, micro_batch=2, dp=2, dp_rank=0, max_batches=1))) == 1
    with pytest.raises(SpecError, match="fewer than one batch"):
        next(val_batches(windows=w, micro_batch=len(w), dp=2, dp_rank=0))


def copy_corpus(corpus, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(corpus, dst)
    return dst


def test_truncated_shard_is_rejected(corpus, tmp_path):
    bad = copy_corpus(corpus, tmp_path)
    shard = bad / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(SpecError, match=r"train-00000.bin has 1000 bytes, meta.json says \d+ .*truncated or foreign"):
        TokenWindows(bad, seq_len=16)


def test_foreign_shards_are_rejected(corpus, tmp_path):
    bad = copy_corpus(corpus, tmp_path)
    shard = bad / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[24:32] = b"\x00" * 8  # another dataset's id
    shard.write_bytes(bytes(data))
    with pytest.raises(SpecError, match="belongs to another prepared dataset"):
        TokenWindows(bad, seq_len=16)
    shard.write_bytes(b"\x01" * len(data))  # not our format at all
    with pytest.raises(SpecError, match="is not a dspipe token shard"):
        TokenWindows(bad, seq_len=16)
    shutil.copy(corpus / "train-00000.bin", shard)
    (bad / "train-00000.idx").unlink()
    with pytest.raises(SpecError, match="train-00000.idx does not exist"):
        open_split(bad, "train")


def test_data_from_an_older_format_is_refused(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 4096, "dtype": "uint16", "num_tokens": 10}))
    with pytest.raises(SpecError, match="was not prepared by this dspipe .* --force"):
        TokenWindows(tmp_path, seq_len=16)


def test_corpus_shorter_than_a_sequence_is_rejected(corpus):
    with pytest.raises(SpecError, match=r"train split of .* tokens\) is shorter than one sequence of 100000001"):
        TokenWindows(corpus, seq_len=10**8)
    with pytest.raises(SpecError, match="is shorter than one sequence"):
        check_data_for_model(corpus, model_vocab=1024, seq_len=10**8)


def test_missing_data_dir_says_how_to_prepare(tmp_path):
    with pytest.raises(SpecError, match="dspipe prepare-data --out"):
        read_meta(tmp_path / "nope")


def test_model_vocab_must_cover_the_tokenizer(corpus):
    assert check_data_for_model(corpus, model_vocab=1024, seq_len=64)["vocab_size"] == 1024
    with pytest.raises(SpecError, match=r"tokenizer vocab 1024 .* > model vocab 1000: .* --vocab 1024 or --pad-vocab"):
        check_data_for_model(corpus, model_vocab=1000, seq_len=64)
    assert padded_vocab(1024) == 1024 and padded_vocab(50257) == 50304 and padded_vocab(1) == 64
