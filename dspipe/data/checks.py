"""Checks between prepared data directories and a model, from meta.json and tokenizer.json (no torch or shards)."""

from __future__ import annotations

import os
from pathlib import Path

from dspipe.data.shards import read_meta
from dspipe.errors import SpecError
from dspipe.jsonio import read_object

VOCAB_MULTIPLE = 64


def padded_vocab(vocab: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """The vocabulary rounded up to a multiple of 64 (faster embedding/softmax matmuls)."""
    return -(-vocab // multiple) * multiple


def check_data_for_model(data_dir: str | Path, *, model_vocab: int, seq_len: int) -> dict:
    """meta.json of data_dir, after checking that every token id fits the model and one sequence fits the data."""
    meta = read_meta(data_dir)
    check_files(data_dir, meta)
    vocab = meta["vocab_size"]
    if meta.get("format") == "megatron-mmidx" and meta["max_id"] >= model_vocab:
        tok = f" (its tokenizer has {vocab})" if meta["tokenizer_dir"] else ""
        raise SpecError(
            f"token id {meta['max_id']:,} in {data_dir}.bin does not fit model vocab {model_vocab:,}"
            f"{tok}: pass --vocab {vocab} or --pad-vocab ({padded_vocab(vocab)})"
        )
    if vocab > model_vocab:
        raise SpecError(
            f"tokenizer vocab {vocab} in {data_dir} > model vocab {model_vocab}: token ids would "
            f"overflow the embedding; pass --vocab {vocab} or --pad-vocab ({padded_vocab(vocab)})"
        )
    train = meta["splits"]["train"]
    if sum(max(0, (s["num_tokens"] - 1) // seq_len) for s in train["shards"]) == 0:
        raise SpecError(
            f"the train split of {data_dir} ({train['num_tokens']} tokens) is shorter than one "
            f"sequence of {seq_len + 1} tokens"
        )
    return meta


TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
"""JSON objects a tokenizer directory may hold beside tokenizer.json."""


def check_tokenizer_dir(data_dir: str | Path, *, why: str, read: bool = False) -> Path:
    """DATA/tokenizer of a prepared directory: a directory holding tokenizer.json (read: one that parses and holds a
    vocabulary; else nothing is read); one SpecError otherwise. why: what needs it, for the message."""
    from dspipe.data.shards import TOKENIZER_DIR

    tok = Path(data_dir) / TOKENIZER_DIR
    fix = f"restore it, or re-run 'dspipe prepare-data --out {data_dir} --force'"
    if not os.path.lexists(tok):
        raise SpecError(f"{tok} is missing ({why}); {fix}")
    if not tok.is_dir():
        raise SpecError(f"{tok} is not a directory ({why}); {fix}")
    if not (tok / "tokenizer.json").is_file():
        raise SpecError(f"{tok} holds no tokenizer.json ({why}); {fix}")
    if read:
        from dspipe.data.megatron import tokenizer_vocab_size

        if tokenizer_vocab_size(tok) is None:
            raise SpecError(f"{tok / 'tokenizer.json'} holds no vocabulary (model.vocab) ({why}); {fix}")
        for name in TOKENIZER_SIDE_FILES:  # transformers' AutoTokenizer reads them beside tokenizer.json
            if os.path.lexists(tok / name):
                try:
                    read_object(tok / name)
                except SpecError as e:
                    raise SpecError(f"{e} ({why}); {fix}") from None
    return tok


def check_files(data_dir: str | Path, meta: dict) -> None:
    """The files of a prepared directory, cheaply (headers and sizes, nothing past them): every shard meta.json lists
    is a regular file whose header and size match it and whose document offsets run from 0 to its tokens, and the
    tokenizer meta.json names is there. A Megatron prefix is checked by its read_meta. One SpecError naming the
    file and the numbers."""
    from dspipe.data.shards import META_FILE, open_split

    if meta.get("format") == "megatron-mmidx":
        return
    for split in meta["splits"]:
        open_split(data_dir, split, meta)
    if "tokenizer" in meta:
        check_tokenizer_dir(data_dir, why=f"{META_FILE} names it; generate and export-hf read it", read=True)


def check_val_for_eval(data_dir: str | Path, *, seq_len: int, dp: int, micro_batch: int) -> None:
    """The validation split must hold one batch (dp x micro_batch windows) for --eval-interval to work."""
    meta = read_meta(data_dir)
    val = meta["splits"].get("val", {"shards": [], "num_tokens": 0})
    windows = sum(max(0, (s["num_tokens"] - 1) // seq_len) for s in val["shards"])
    if windows < dp * micro_batch:
        raise SpecError(
            f"the val split of {data_dir} holds {windows} windows of {seq_len + 1} tokens, fewer than one "
            f"validation batch of dp {dp} x micro_batch {micro_batch} = {dp * micro_batch}; pass "
            f"--eval-interval 0 or "
            + (
                f"give a larger Megatron dataset (its last {meta['val_fraction']:.0%} of documents are "
                f"the validation split)"
                if meta.get("format") == "megatron-mmidx"
                else f"prepare the data with a larger --val-fraction (now {meta['val_fraction']})"
            )
        )


TOKENIZER_KEYS = ("model", "added_tokens", "normalizer", "pre_tokenizer")
"""What in tokenizer.json decides the token ids (vocab and merges, special tokens, text splitting)."""


def tokenizer_path(data: str | Path) -> Path:
    """The tokenizer directory of one data source: DATA/tokenizer, or the `tokenizer/` beside a Megatron prefix."""
    from dspipe.data import megatron
    from dspipe.data.shards import TOKENIZER_DIR

    return megatron.tokenizer_beside(str(data)) if megatron.is_prefix(data) else Path(data) / TOKENIZER_DIR


def _tokenizer_content(data_dir: str | Path):
    """The parts of DIR/tokenizer/tokenizer.json that decide token ids, or None where there is no such file."""
    from dspipe.jsonio import read_object

    path = tokenizer_path(data_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    hint = f"; re-run 'dspipe prepare-data --out {data_dir} --force'"
    content = read_object(path, hint=hint[2:])
    return {k: content.get(k) for k in TOKENIZER_KEYS}


def check_blend_sources(paths) -> list[dict]:
    """meta.json of every source of a blend, after checking that they can be mixed in one batch: each is prepared,
    and all share the first one's tokenizer (vocab size, token dtype, EOS id, and tokenizer.json's vocabulary,
    merges, special tokens and splitting). One SpecError naming the source and the difference."""
    metas = []
    for path in paths:
        try:
            metas.append(read_meta(path))
        except SpecError as e:
            raise SpecError(f"blend source {path}: {e}") from None
    first, ref = paths[0], metas[0]
    ref_tok = None
    for path, meta in zip(paths[1:], metas[1:], strict=False):
        fix = f"blended datasets must share one tokenizer (prepare it with --tokenizer {Path(first) / 'tokenizer'})"
        # a Megatron prefix without a tokenizer has no vocabulary of its own (its largest id + 1 stands in)
        told = all(m.get("format") != "megatron-mmidx" or m.get("tokenizer_dir") for m in (meta, ref))
        if meta["vocab_size"] != ref["vocab_size"] and told:
            raise SpecError(
                f"blend source {path}: tokenizer vocab {meta['vocab_size']} ({meta['dtype']} tokens) "
                f"differs from {first}'s {ref['vocab_size']} ({ref['dtype']}); {fix}"
            )
        megatron = "megatron-mmidx" in (meta.get("format"), ref.get("format"))
        if meta["dtype"] != ref["dtype"] and not megatron:  # a loader reads every Megatron dtype into int64
            raise SpecError(
                f"blend source {path}: token dtype {meta['dtype']} differs from {first}'s {ref['dtype']}; {fix}"
            )
        if meta["eos_id"] != ref["eos_id"] and None not in (meta["eos_id"], ref["eos_id"]):
            raise SpecError(
                f"blend source {path}: EOS id {meta['eos_id']} differs from {first}'s {ref['eos_id']}; {fix}"
            )
        if ref_tok is None:
            ref_tok = _tokenizer_content(first) or {}
        tok = _tokenizer_content(path)
        if ref_tok and tok is not None and tok != ref_tok:
            differs = next((k for k in TOKENIZER_KEYS if tok.get(k) != ref_tok.get(k)), "content")
            raise SpecError(
                f"blend source {path}: its tokenizer differs from {first}'s ({differs} in "
                f"tokenizer/tokenizer.json); {fix}"
            )
    return metas


def check_tokenizer(paths, tokenizer: str | Path, *, model_vocab: int | None = None) -> int:
    """gen-config --tokenizer DIR: a Hugging Face tokenizer directory for Megatron prefixes that have none beside
    them. Every source must be a prefix, every id of each within the tokenizer, its dtype able to hold it, and the
    model's vocab must hold the tokenizer's; returns the tokenizer's vocab. One SpecError otherwise."""
    from dspipe.data import megatron

    for path in paths:
        if not megatron.is_prefix(path):
            raise SpecError(
                f"--tokenizer {tokenizer} is for Megatron prefixes; {path} is not one (a prepared "
                f"directory carries its own tokenizer/): drop --tokenizer"
            )
    vocab = megatron.tokenizer_vocab_size(Path(tokenizer)) if Path(tokenizer).is_dir() else None
    if vocab is None:
        raise SpecError(
            f"--tokenizer {tokenizer}: no tokenizer.json with a vocabulary there (a Hugging Face "
            f"tokenizer directory written by save_pretrained)"
        )
    for path in paths:
        megatron.read_meta(path, tokenizer=tokenizer)
    if model_vocab is not None and vocab > model_vocab:
        raise SpecError(
            f"tokenizer vocab {vocab:,} in --tokenizer {tokenizer} > model vocab {model_vocab:,}: "
            f"generate and export-hf would meet ids the model cannot hold; pass --vocab {vocab} or "
            f"--pad-vocab ({padded_vocab(vocab)})"
        )
    return vocab
