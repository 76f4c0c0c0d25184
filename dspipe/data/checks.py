"""Checks between a prepared data directory and a model, from meta.json alone (no torch, no shard reads)."""
from __future__ import annotations

from pathlib import Path

from dspipe.data.shards import read_meta
from dspipe.errors import SpecError

VOCAB_MULTIPLE = 64


def padded_vocab(vocab: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """The vocabulary rounded up to a multiple of 64 (faster embedding/softmax matmuls)."""
    return -(-vocab // multiple) * multiple


def check_data_for_model(data_dir: str | Path, *, model_vocab: int, seq_len: int) -> dict:
    """meta.json of data_dir, after checking that every token id fits the model and one sequence fits the data."""
    meta = read_meta(data_dir)
    vocab = meta["vocab_size"]
    if vocab > model_vocab:
        raise SpecError(f"tokenizer vocab {vocab} in {data_dir} > model vocab {model_vocab}: token ids would "
                        f"overflow the embedding; pass --vocab {vocab} or --pad-vocab ({padded_vocab(vocab)})")
    train = meta["splits"]["train"]
    if sum(max(0, (s["num_tokens"] - 1) // seq_len) for s in train["shards"]) == 0:
        raise SpecError(f"the train split of {data_dir} ({train['num_tokens']} tokens) is shorter than one "
                        f"sequence of {seq_len + 1} tokens")
    return meta


def check_val_for_eval(data_dir: str | Path, *, seq_len: int, dp: int, micro_batch: int) -> None:
    """The validation split must hold one batch (dp x micro_batch windows) for --eval-interval to work."""
    meta = read_meta(data_dir)
    val = meta["splits"].get("val", {"shards": [], "num_tokens": 0})
    windows = sum(max(0, (s["num_tokens"] - 1) // seq_len) for s in val["shards"])
    if windows < dp * micro_batch:
        raise SpecError(f"the val split of {data_dir} holds {windows} windows of {seq_len + 1} tokens, fewer than one "
                        f"validation batch of dp {dp} x micro_batch {micro_batch} = {dp * micro_batch}; pass "
                        f"--eval-interval 0 or prepare the data with a larger --val-fraction "
                        f"(now {meta['val_fraction']})")
