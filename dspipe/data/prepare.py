"""prepare-data: documents -> tokenizer -> parallel batched encoding -> token shards, written whole or not at all.

The output is built in a sibling temp directory `.NAME.tmp-PID-*` and renamed over `out` at the end, so `out` is
either the previous complete result or the new one; meta.json is the last file written. An interrupted run leaves
only the temp directory (no meta.json, never read by a loader), which the next run removes. Re-running with the
same inputs and options (same fingerprint) is a no-op. The main process reads documents and writes shards; each
worker process holds one single-threaded Rust tokenizer; at most 2 batches per worker are in flight, so memory
does not grow with the corpus. A long document (one 40 MB line) is cut into pieces where the pre-tokenizer cuts
anyway (tokenizer.pieces): the BPE trains on pieces, and a tokenizer that splits_exactly encodes it in parts on
several workers into exactly the ids of the whole.
"""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from dspipe.data.shards import (FORMAT, FORMAT_VERSION, META_FILE, SPLITS, TOKENIZER_DIR, ShardWriter, dataset_id,
                                read_meta, token_dtype, write_meta)
from dspipe.data.limits import too_small
from dspipe.data.sources import Inputs, documents, fingerprint
from dspipe import outputs
from dspipe.atomic import staged_dir
from dspipe.errors import SpecError, cannot_read

DEFAULT_VOCAB = 4096
BATCH_CHARS = 1 << 20  # text per task sent to a worker
BATCH_DOCS = 1024


@dataclass(frozen=True)
class Prepared:
    meta: dict
    reused: bool  # the output already matched the inputs: nothing was done
    seconds: float = 0.0
    encode_seconds: float = 0.0


def _tokenizer_identity(tokenizer: str | None, train_tokenizer: int | None, sample_bytes: int) -> list:
    if tokenizer is None:
        from dspipe.data.tokenizer import MAX_WORD_CHARS, PIECE_CHARS

        return ["train-bpe", train_tokenizer, sample_bytes, ["max-word", MAX_WORD_CHARS],
                ["sample-pieces", PIECE_CHARS]]
    path = Path(tokenizer)
    if path.is_dir():  # a local directory: its content, not its name
        h = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(f.relative_to(path).as_posix().encode() + b"\0" + _read_bytes(f))
        return ["dir", h.hexdigest()]
    if path.is_file():  # a tokenizer.json file: its content
        return ["file", hashlib.sha256(_read_bytes(path)).hexdigest()]
    return ["hub", tokenizer]


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise cannot_read(path, e) from None


MAX_WORKERS = 128
"""--workers at most: each worker is a process holding a tokenizer (~150 MiB)."""
MAX_SHARD_TOKENS = 2**40


def _int_flag(flag: str, value, *, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        shown = str(value) if len(str(value)) <= 40 else str(value)[:37] + "..."
        what = f"{shown} is too large" if isinstance(value, int) and value > high else \
            f"must be at least {low}, got {shown}"
        raise SpecError(f"{flag} {what} (allowed range {low}..{high:,})")


def _validate(*, tokenizer, train_tokenizer, val_fraction, max_bytes, shard_tokens, workers, sample_bytes) -> None:
    from dspipe.data.tokenizer import check_vocab

    if tokenizer is not None and train_tokenizer is not None:
        raise SpecError("give --tokenizer NAME_OR_DIR or --train-tokenizer VOCAB_SIZE, not both")
    if train_tokenizer is not None:
        check_vocab(train_tokenizer)
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise SpecError(f"--val-fraction {val_fraction} must be in [0, 1)")
    if max_bytes is not None and max_bytes <= 0:
        raise SpecError(f"--max-mb must be positive, got {max_bytes / 2**20:g}")
    _int_flag("--shard-tokens", shard_tokens, low=1, high=MAX_SHARD_TOKENS)
    _int_flag("--workers", workers, low=1, high=MAX_WORKERS)
    if sample_bytes <= 0:
        raise SpecError(f"--tokenizer-sample-mb must be positive, got {sample_bytes / 2**20:g}")


def _remove_stale_temps(out: Path) -> None:
    """Temp directories of runs that died (their process is gone)."""
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        try:
            pid = int(tmp.name.split(".tmp-")[1].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            pass



def _batches(docs: Iterator[str], *, cut: bool = False) -> Iterator[tuple[list[str], bool]]:
    """(texts, continued): documents in batches of about BATCH_CHARS characters or BATCH_DOCS documents. With
    `cut` (a tokenizer that splits_exactly), a longer document goes in parts of about BATCH_CHARS, a batch each
    (so several workers share it): continued=True but for its last part."""
    from dspipe.data.tokenizer import pieces

    batch, chars = [], 0
    for doc in docs:
        if cut and len(doc) > BATCH_CHARS:
            if batch:
                yield batch, False
                batch, chars = [], 0
            previous = None
            for part in pieces(doc, size=BATCH_CHARS, exact=True):
                if previous is not None:
                    yield [previous], True
                previous = part
            yield [previous], False
            continue
        batch.append(doc)
        chars += len(doc)
        if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
            yield batch, False
            batch, chars = [], 0
    if batch:
        yield batch, False


def is_val(doc_index: np.ndarray, fraction: float) -> np.ndarray:
    """Document i goes to validation iff floor((i+1)f + 1/2) > floor(i f + 1/2): round(n f) of the first n
    documents, evenly spread (the first at i = 1/(2f)), decided per document (streaming), whatever the batching."""
    return np.floor((doc_index + 1) * fraction + 0.5) > np.floor(doc_index * fraction + 0.5)


class _Workers:
    """The tokenizer processes, started on first need: once the input proved readable (a bad input fails
    without spawning anything), and while a BPE trains on it (the workers import meanwhile). Spawned, never
    forked: the main process may hold Rust and Arrow threads. Each worker tokenizes on one thread."""

    def __init__(self, count: int):
        self.count, self._pool = count, None

    def pool(self):
        if self._pool is None:
            from dspipe.data.tokenizer import warm_worker
            self._pool = multiprocessing.get_context("spawn").Pool(self.count, initializer=warm_worker)
        return self._pool

    def stop(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()


def _progress(enabled: bool):
    from tqdm import tqdm

    return tqdm(desc="tokenizing", unit="tok", unit_scale=True, disable=None if enabled else True, file=sys.stderr,
                mininterval=0.5, smoothing=0.05, dynamic_ncols=True)


def _encode(*, inputs: Inputs, max_bytes, tokenizer_json: Path, eos_id: int, dtype: str, workers: _Workers,
            val_fraction: float, writers: dict, progress: bool) -> dict:
    from dspipe.data.tokenizer import PIECE_CHARS, encode_batch, release_memory, splits_exactly

    counts = {"num_documents": 0, "num_bytes": 0}
    bar = _progress(progress)
    held: list[np.ndarray] = []  # the parts so far of a document sent in parts, without their EOS

    def write(tokens: np.ndarray, lengths: np.ndarray, continued: bool) -> None:
        if continued:
            held.append(tokens[:-1])
            bar.update(int(held[-1].size))
            return
        bar.update(int(tokens.size))
        if held:  # the last part: the whole document
            tokens = np.concatenate([*held, tokens])
            lengths = np.array([tokens.size], dtype=lengths.dtype)
            held.clear()
        first = counts["num_documents"]
        val = is_val(np.arange(first, first + lengths.size, dtype=np.float64), val_fraction)
        if val.any():
            token_val = np.repeat(val, lengths)
            writers["val"].add(tokens[token_val], lengths[val])
            writers["train"].add(tokens[~token_val], lengths[~val])
        else:
            writers["train"].add(tokens, lengths)
        counts["num_documents"] += lengths.size
        release_memory()

    exact = splits_exactly(tokenizer_json)
    task = dict(tokenizer_json=str(tokenizer_json), eos_id=eos_id, dtype=dtype,
                piece_chars=PIECE_CHARS if exact else 0)
    with bar:
        pending: deque = deque()
        docs = documents(inputs, max_bytes=max_bytes, first_within=max_bytes)
        for batch, continued in _batches(docs, cut=exact):
            counts["num_bytes"] += sum(len(d.encode("utf-8")) for d in batch)
            pending.append((workers.pool().apply_async(encode_batch, (batch,), task), continued))
            if len(pending) >= 2 * workers.count:
                result, more = pending.popleft()
                write(*result.get(), more)
        while pending:
            result, more = pending.popleft()
            write(*result.get(), more)
    return counts


def _load_tokenizer(*, inputs: Inputs, tokenizer, train_tokenizer, sample_bytes, max_bytes, workers, log):
    from dspipe.data.tokenizer import load_hf, train_bpe

    if tokenizer is not None:
        if Path(tokenizer).is_dir():
            workers.pool()  # starts while transformers imports and loads the tokenizer
        return load_hf(tokenizer), tokenizer
    limit = min(sample_bytes, max_bytes) if max_bytes else sample_bytes
    log(f"training a {train_tokenizer}-token byte-level BPE on up to {limit / 2**20:.1f} MiB of the input")
    seen = 0

    def counted():
        nonlocal seen
        for doc in documents(inputs, max_bytes=limit, first_within=max_bytes):
            seen += 1
            if seen == 1:
                workers.pool()
            yield doc

    tok = train_bpe(_sample(counted(), sample_bytes=sample_bytes), vocab_size=train_tokenizer)
    if not seen:
        raise _empty_input(inputs)
    return tok, f"byte-level BPE trained on the input ({train_tokenizer} tokens)"


def _sample(docs: Iterator[str], *, sample_bytes: int) -> Iterator[str]:
    """The BPE's training text: the documents in pieces (tokenizer.pieces, at most PIECE_CHARS characters: the
    trainer's time and memory grow with the length of one text), up to the piece that reaches sample_bytes of
    UTF-8. A sample smaller than the first piece is refused: it would hold nothing."""
    from dspipe.data.tokenizer import PIECE_CHARS, pieces

    total = 0
    for doc in docs:
        for piece in pieces(doc, size=PIECE_CHARS, exact=False):
            size = len(piece.encode("utf-8"))
            if not total and size > sample_bytes:
                raise too_small(flag="--tokenizer-sample-mb", limit=sample_bytes, size=size,
                                what=f"the first piece of the BPE's training text ({size:,} bytes: the first "
                                     f"document, or its first {PIECE_CHARS:,} characters at most)")
            yield piece
            total += size
            if total >= sample_bytes:
                return


def _empty_input(inputs: Inputs) -> SpecError:
    skipped = inputs.stats
    return SpecError(f"empty input: no documents with text in {inputs.label} ({skipped['empty']} empty documents, "
                     f"{skipped['bad_utf8']} non-UTF-8 and {skipped['unreadable']} unreadable files skipped)")


def _build(*, tmp: Path, workers: _Workers, inputs: Inputs, fp: str, tokenizer, train_tokenizer, sample_bytes,
           val_fraction, max_bytes, shard_tokens, progress, log) -> tuple[dict, float]:
    """Everything into tmp; returns (meta, seconds spent encoding)."""
    from dspipe.data.tokenizer import save_hf

    tok, source = _load_tokenizer(inputs=inputs, tokenizer=tokenizer, train_tokenizer=train_tokenizer,
                                  sample_bytes=sample_bytes, max_bytes=max_bytes, workers=workers, log=log)
    tokenizer_json = save_hf(tok, tmp / TOKENIZER_DIR)
    vocab, eos_id = len(tok), int(tok.eos_token_id)
    dtype = token_dtype(vocab)
    writers = {s: ShardWriter(directory=tmp, split=s, dtype=dtype, shard_tokens=shard_tokens,
                              ident=dataset_id(fp)) for s in SPLITS}
    try:
        t0 = time.perf_counter()
        counts = _encode(inputs=inputs, max_bytes=max_bytes, tokenizer_json=tokenizer_json, eos_id=eos_id,
                         dtype=dtype, workers=workers, val_fraction=val_fraction, writers=writers,
                         progress=progress)
        encode_seconds = time.perf_counter() - t0
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    if counts["num_documents"] == 0:
        raise _empty_input(inputs)
    splits = {}
    for s, w in writers.items():
        shards = w.close()
        splits[s] = {"num_documents": sum(x["num_documents"] for x in shards),
                     "num_tokens": sum(x["num_tokens"] for x in shards), "shards": shards}
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "fingerprint": fp,
            "tokenizer": TOKENIZER_DIR, "tokenizer_source": source, "vocab_size": vocab, "eos_id": eos_id,
            "eos_token": tok.eos_token, "dtype": dtype,
            "num_documents": counts["num_documents"], "num_tokens": sum(v["num_tokens"] for v in splits.values()),
            "num_bytes": counts["num_bytes"], "skipped": dict(inputs.stats), "val_fraction": val_fraction,
            "input": {"source": inputs.label, "files": len(inputs.files), "hub": inputs.hub, "config": inputs.config,
                      "split": inputs.split, "text_field": inputs.text_field, "txt_docs": inputs.txt_docs,
                      "max_bytes": max_bytes},
            "splits": splits}
    write_meta(tmp, meta)  # last: a directory without meta.json is never read
    return meta, encode_seconds


def prepare(*, inputs: Inputs, out: Path, tokenizer: str | None = None, train_tokenizer: int | None = None,
            tokenizer_sample_bytes: int = 64 << 20, val_fraction: float = 0.01, max_bytes: int | None = None,
            shard_tokens: int = 500_000_000, workers: int = 1, force: bool = False, progress: bool = False,
            log: Callable[[str], None] = lambda s: None) -> Prepared:
    """Prepare `out` from `inputs`; a no-op (reused=True) when out already holds exactly this preparation."""
    if tokenizer is None and train_tokenizer is None:
        train_tokenizer = DEFAULT_VOCAB
    _validate(tokenizer=tokenizer, train_tokenizer=train_tokenizer, val_fraction=val_fraction, max_bytes=max_bytes,
              shard_tokens=shard_tokens, workers=workers, sample_bytes=tokenizer_sample_bytes)
    out = outputs.target(out, flag="--out", expect="dir")
    fp = fingerprint([FORMAT, FORMAT_VERSION, inputs.fingerprint_items(),
                      _tokenizer_identity(tokenizer, train_tokenizer, tokenizer_sample_bytes),
                      val_fraction, max_bytes, shard_tokens])
    rebuilding = False
    if (out / META_FILE).is_file() and not force:
        try:
            meta = read_meta(out)
        except SpecError:
            meta = {}
        if meta.get("fingerprint") == fp:
            return Prepared(meta=meta, reused=True)
        rebuilding = True
    outputs.claim_dir(out, kind="data", replace=True)  # only a data directory dspipe wrote, holding nothing else
    if rebuilding:
        log(f"{out} holds another preparation (different inputs or options): rebuilding it")
    start = time.perf_counter()
    dest = Path(os.path.abspath(out))
    pool = _Workers(workers)
    with outputs.parents(out):
        with outputs.write_errors(out):
            _remove_stale_temps(dest)
        try:
            # the temp's name carries the pid: _remove_stale_temps tells a dead run's temp from a live one's
            with staged_dir(dest, tag=f"tmp-{os.getpid()}-",
                            errors=lambda: outputs.write_errors(out)) as tmp:
                meta, encode_seconds = _build(tmp=tmp, workers=pool, inputs=inputs, fp=fp, tokenizer=tokenizer,
                                              train_tokenizer=train_tokenizer, sample_bytes=tokenizer_sample_bytes,
                                              val_fraction=val_fraction, max_bytes=max_bytes,
                                              shard_tokens=shard_tokens, progress=progress, log=log)
                with outputs.write_errors(out):
                    outputs.write_marker(tmp, kind="data")
        finally:
            pool.stop()
    return Prepared(meta=meta, reused=False, seconds=time.perf_counter() - start, encode_seconds=encode_seconds)
