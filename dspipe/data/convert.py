"""convert-data: a prepared dspipe directory <-> a Megatron / GPT-NeoX indexed dataset, token for token.

    to_megatron    DIR (dspipe-tokens) -> OUT/text_document.bin + .idx (Megatron's --data-path OUT/text_document)
                   and OUT/tokenizer: the train split's documents, then the validation split's, one sequence each
    from_megatron  PREFIX -> a prepared directory: the prefix's train and validation documents (dspipe.data.megatron:
                   the last 3% are validation) into the two splits, in order; its EOD is the EOS

Both outputs are written whole or not at all (a staged sibling directory renamed into place) and replace only an
earlier output of the same kind (--force). A prefix -> directory -> prefix round trip gives the same .bin, and the
same .idx where every document is one sequence (dspipe keeps documents, not Megatron's sentence split); directory ->
prefix -> directory gives the same tokens and documents, split again by the prefix's rule.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np

from dspipe import outputs
from dspipe.atomic import staged_dir
from dspipe.data import megatron
from dspipe.data.checks import check_tokenizer_dir
from dspipe.data.shards import (
    FORMAT,
    FORMAT_VERSION,
    META_FILE,
    SPLITS,
    TOKENIZER_DIR,
    ShardWriter,
    dataset_id,
    open_split,
    read_meta,
    token_dtype,
    write_meta,
)
from dspipe.errors import SpecError

PIECE_TOKENS = 1 << 24  # tokens moved per pass: memory stays flat


def _documents(toks: np.ndarray, offsets: np.ndarray, *, index: Path):
    """(tokens, lengths) of whole documents, about PIECE_TOKENS tokens at a time (a longer document alone); document
    offsets that decrease (a damaged `index`: open_split checks only the first and the last) are one SpecError."""
    offsets = np.asarray(offsets, dtype=np.int64)
    down = np.flatnonzero(offsets[1:] < offsets[:-1])
    if down.size:
        d = int(down[0])
        raise SpecError(
            f"{index}: document {d + 1:,} starts at token {int(offsets[d + 1]):,}, before document {d:,} "
            f"(at {int(offsets[d]):,}): the index is damaged; re-run 'dspipe prepare-data --force' to rebuild it"
        )
    first = 0
    while first < offsets.size - 1:
        last = int(np.searchsorted(offsets, offsets[first] + PIECE_TOKENS, side="right")) - 1
        last = max(last, first + 1)
        yield np.asarray(toks[offsets[first] : offsets[last]]), np.diff(offsets[first : last + 1])
        first = last


def _copy_tokenizer(src: Path | None, dest: Path) -> bool:
    if src is None or not src.is_dir():
        return False
    with outputs.write_errors(dest):
        shutil.copytree(src, dest)
    return True


def _check_apart(out: Path, inputs: list[tuple[str, Path]]) -> None:
    """Refuse an --out that is one of the inputs, holds one or lies inside one (symbolic links resolved): writing
    it would replace or mix with what is being read. inputs: (what, path) of each file or directory read."""
    real_out = Path(os.path.realpath(out))
    for what, path in inputs:
        real = Path(os.path.realpath(path))
        shown = f"{what} {path}" + (f" (resolved: {real})" if str(real) != os.path.abspath(path) else "")
        if real == real_out:
            raise SpecError(
                f"--out {out} is {shown} itself: replacing it would delete what convert-data reads; choose "
                f"another --out"
            )
        if real_out in real.parents:
            raise SpecError(
                f"--out {out} contains {shown}: replacing it would delete what convert-data reads; choose another --out"
            )
        if real in real_out.parents:
            raise SpecError(f"--out {out} lies inside {shown}; choose a --out outside it")


def to_megatron(*, source: str | Path, out: str | Path, force: bool = False) -> dict:
    """A prepared directory -> OUT holding a Megatron dataset (OUT/text_document) and the tokenizer; returns
    {"prefix", "num_documents", "num_tokens", "dtype"}."""
    meta = read_meta(source)
    if meta.get("format") == megatron.FORMAT:
        raise SpecError(
            f"{source} is already a Megatron dataset; convert-data makes a dspipe directory of it with --out DIR"
        )
    out = outputs.target(out, flag="--out", expect="dir")
    _check_apart(out, [("the source directory", Path(source))])
    tok = check_tokenizer_dir(source, why="the Megatron output carries it as OUT/tokenizer", read=True)
    outputs.claim_dir(out, kind="data", replace=force)
    vocab = meta["vocab_size"]
    dtype = megatron.writer_dtype(vocab)
    with (
        outputs.parents(out),
        staged_dir(Path(os.path.abspath(out)), tag="convert-", errors=lambda: outputs.write_errors(out)) as tmp,
    ):
        writer = megatron.MegatronWriter(tmp / megatron.TEXT_DOCUMENT, dtype=dtype)
        try:
            for split in SPLITS:
                if split in meta["splits"]:
                    shards = zip(meta["splits"][split]["shards"], open_split(source, split, meta), strict=True)
                    for shard, (toks, offsets) in shards:
                        index = Path(source) / f"{shard['name']}.idx"
                        for piece, lengths in _documents(toks, offsets, index=index):
                            _check_ids(piece, vocab=vocab, path=Path(source) / f"{shard['name']}.bin", source=source)
                            writer.add(piece, lengths)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        _copy_tokenizer(tok, tmp / TOKENIZER_DIR)
        with outputs.write_errors(out):
            outputs.write_marker(tmp, kind="data")
    return {
        "prefix": str(Path(out) / megatron.TEXT_DOCUMENT),
        "num_documents": writer.num_documents,
        "num_tokens": writer.num_tokens,
        "dtype": dtype,
    }


def _check_ids(piece: np.ndarray, *, vocab: int, path: Path, source) -> None:
    """Every token id of a piece of a shard within meta.json's vocab_size."""
    if piece.size and int(piece.max()) >= vocab:
        raise SpecError(
            f"{path} holds token id {int(piece.max()):,}, outside vocab_size {vocab:,} in "
            f"{Path(source) / META_FILE}: the shards and meta.json disagree; re-run 'dspipe prepare-data --out "
            f"{source} --force'"
        )


def from_megatron(
    *,
    prefix: str,
    out: str | Path,
    tokenizer: str | Path | None = None,
    force: bool = False,
    shard_tokens: int = 500_000_000,
) -> dict:
    """A Megatron prefix -> a prepared directory (meta.json, shards, the tokenizer when there is one); returns its
    meta. Its documents must end in one EOD token (preprocess_data.py --append-eod): dspipe's format keeps an EOS
    after every document."""
    meta = megatron.read_meta(prefix, tokenizer=tokenizer)
    if meta["eos_id"] is None:
        raise SpecError(
            f"Megatron dataset {prefix}: its documents do not all end in one EOD token (prepared "
            f"without --append-eod?); a dspipe directory keeps an EOS after every document, so train on "
            f"the prefix itself (--data {prefix})"
        )
    if meta["tokenizer_dir"] is None:
        beside = megatron.tokenizer_beside(prefix)
        raise SpecError(
            f"Megatron dataset {prefix} has no tokenizer (no tokenizer.json in {beside}): a prepared directory "
            f"records the tokenizer's vocab size and carries it; pass --tokenizer DIR (the Hugging Face tokenizer "
            f"directory the data was tokenized with)"
        )
    out = outputs.target(out, flag="--out", expect="dir")
    _check_apart(
        out,
        [
            ("the source's index", megatron.idx_path(prefix)),
            ("the source's token file", megatron.bin_path(prefix)),
            ("the source's tokenizer", Path(meta["tokenizer_dir"])),
        ],
    )
    outputs.claim_dir(out, kind="data", replace=force)
    vocab = meta["vocab_size"]
    dtype = token_dtype(vocab)
    fp = hashlib.sha256(f"from-megatron\0{meta['fingerprint']}\0{vocab}\0{shard_tokens}".encode()).hexdigest()
    with (
        outputs.parents(out),
        staged_dir(Path(os.path.abspath(out)), tag="convert-", errors=lambda: outputs.write_errors(out)) as tmp,
    ):
        splits = {}
        for split in SPLITS:
            splits[split] = _split_from_megatron(
                prefix=prefix, split=split, meta=meta, directory=tmp, dtype=dtype, shard_tokens=shard_tokens, fp=fp
            )
        tok = Path(meta["tokenizer_dir"]) if meta["tokenizer_dir"] else None
        has_tok = _copy_tokenizer(tok, tmp / TOKENIZER_DIR)
        new = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "fingerprint": fp,
            "vocab_size": vocab,
            "eos_id": meta["eos_id"],
            "dtype": dtype,
            "num_documents": meta["num_documents"],
            "num_tokens": meta["num_tokens"],
            "val_fraction": megatron.VAL_FRACTION,
            "splits": splits,
            "tokenizer_source": f"Megatron dataset {prefix}" + (f", tokenizer {tok}" if has_tok else ""),
            "input": {"source": f"megatron:{prefix}"},
        }
        if has_tok:
            new["tokenizer"] = TOKENIZER_DIR
        write_meta(tmp, new)
        with outputs.write_errors(out):
            outputs.write_marker(tmp, kind="data")
    return new


def _split_from_megatron(
    *, prefix: str, split: str, meta: dict, directory: Path, dtype: str, shard_tokens: int, fp: str
) -> dict:
    """One split of a Megatron prefix written as shards in `directory`; its documents, tokens and shards."""
    writer = ShardWriter(directory=directory, split=split, dtype=dtype, shard_tokens=shard_tokens, ident=dataset_id(fp))
    try:
        for toks, offsets in megatron.open_split(prefix, split, meta):
            for piece, lengths in _documents(toks, offsets, index=Path(f"{prefix}.idx")):
                writer.add(piece, lengths)
        shards = writer.close()
    except BaseException:
        writer.abort()
        raise
    return {
        "num_documents": sum(s["num_documents"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "shards": shards,
    }


def convert(*, source: str, out: str | Path, tokenizer: str | None = None, force: bool = False) -> tuple[str, dict]:
    """The direction from the source: a Megatron prefix becomes a prepared directory, a prepared directory a
    Megatron dataset. Returns (direction, summary)."""
    if not source.strip():
        raise SpecError("SOURCE is empty: give a prepared data directory or a Megatron prefix (PREFIX.bin + .idx)")
    if megatron.is_prefix(source):
        return "from-megatron", from_megatron(prefix=source, out=out, tokenizer=tokenizer, force=force)
    if tokenizer is not None:
        raise SpecError(
            f"--tokenizer is for a Megatron source; {source}'s tokenizer is its own ({Path(source) / TOKENIZER_DIR})"
        )
    if not (Path(source) / META_FILE).is_file():
        raise SpecError(
            f"{source} is neither a prepared data directory (no {META_FILE}) nor a Megatron dataset "
            f"(no {source}.idx / {source}.bin)"
        )
    return "to-megatron", to_megatron(source=source, out=out, force=force)
