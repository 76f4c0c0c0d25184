"""prepare-data: documents -> tokenizer -> parallel batched encoding -> token shards, written whole or not at all.

The output is built in a work directory `.NAME.tmp-partial-<fingerprint[:16]>` beside `out` and renamed over `out`
at the end, so `out` is either the previous complete result or the new one; meta.json is the last file written.
Re-running with the same inputs and options (same fingerprint) is a no-op. The main process reads documents and
writes shards; each worker process holds one single-threaded Rust tokenizer; at most 2 batches per worker are in
flight, so memory does not grow with the corpus. A long document (one 40 MB line) is cut into pieces where the
pre-tokenizer cuts anyway (tokenizer.pieces): the BPE trains on pieces, and a tokenizer that splits_exactly encodes
it in parts on several workers into exactly the ids of the whole.

Resume: every JOURNAL_SECONDS, and whenever a shard closed, at a document boundary, the work directory's journal is
rewritten (atomically, the files it names synced first): documents and bytes consumed, the tokenizer's facts and
both split writers' states (ShardWriter.state). A run that dies (kill -9, out of memory, a lost node) leaves the
work directory; the next run with the same fingerprint takes its tokenizer as it is (a trained BPE is not trained
again), restores the writers, reads past the documents already prepared without tokenizing them and goes on: the
output is byte for byte an uninterrupted run's. A Ctrl-C keeps the work directory too once it holds documents. The
directory is locked (flock, released by the kernel when its process dies): a second run with the same fingerprint
is refused while the first lives; a work directory of another fingerprint, or with an unusable journal, is removed
once no live run holds it.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from dspipe import outputs
from dspipe.atomic import replace_dir
from dspipe.data.limits import too_small
from dspipe.data.shards import (
    FORMAT,
    FORMAT_VERSION,
    META_FILE,
    SPLITS,
    TOKENIZER_DIR,
    ShardWriter,
    dataset_id,
    fsync_path,
    read_meta,
    token_dtype,
    write_meta,
)
from dspipe.data.sources import Inputs, documents, fingerprint
from dspipe.data.workdir import JOURNAL_FILE, LOCK_FILE, WorkDir, remove_stale_temps
from dspipe.errors import SpecError, cannot_read

DEFAULT_VOCAB = 4096
BATCH_CHARS = 1 << 20  # text per task sent to a worker
BATCH_DOCS = 1024
JOURNAL_SECONDS = 5.0
"""The journal is rewritten at least this often (at the next document boundary), and whenever a shard closed."""


@dataclass(frozen=True)
class Prepared:
    meta: dict
    reused: bool  # the output already matched the inputs: nothing was done
    seconds: float = 0.0
    encode_seconds: float = 0.0
    resumed_documents: int = 0  # documents an interrupted run had prepared, taken as they were
    encoded_documents: int = 0  # documents this run sent to the tokenizer
    encoded_tokens: int = 0  # their tokens (meta's num_tokens less the resumed ones: a rate is this / encode_seconds)


def _tokenizer_identity(tokenizer: str | None, train_tokenizer: int | None, sample_bytes: int) -> list:
    if tokenizer is None:
        from dspipe.data.tokenizer import MAX_WORD_CHARS, PIECE_CHARS

        return [
            "train-bpe",
            train_tokenizer,
            sample_bytes,
            ["max-word", MAX_WORD_CHARS],
            ["sample-pieces", PIECE_CHARS],
        ]
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
        what = (
            f"{shown} is too large"
            if isinstance(value, int) and value > high
            else f"must be at least {low}, got {shown}"
        )
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


class _InputChanged(Exception):
    """The documents an interrupted run prepared are not what the input holds now (a hub dataset changed)."""


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


def _progress(enabled: bool, *, desc: str = "tokenizing", total: int | None = None, initial: int = 0):
    """A bar of input bytes (rate, and an ETA when `total` is known) on stderr, shown only on a terminal."""
    from tqdm import tqdm

    return tqdm(
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        total=total,
        initial=initial,
        disable=None if enabled else True,
        file=sys.stderr,
        mininterval=0.5,
        smoothing=0.05,
        dynamic_ncols=True,
    )


def _input_size(inputs: Inputs, max_bytes: int | None) -> int | None:
    """The input's size for the ETA: its local files' sizes (a text file holds about its text, a JSON line a little
    more), at most --max-mb; None for a hub dataset and for parquet (compressed: its size says little)."""
    if inputs.hub or any(f.suffix.lower() == ".parquet" for f in inputs.files):
        return None
    try:
        size = sum(os.stat(f).st_size for f in inputs.files)
    except OSError:
        return None
    return min(size, max_bytes) if max_bytes else size


def _skip(docs: Iterator[str], *, count: int, nbytes: int, progress: bool) -> None:
    """Read past the first `count` documents (an interrupted run prepared them) without tokenizing them; they must
    hold the `nbytes` bytes of UTF-8 that run counted, else _InputChanged."""
    seen, size = 0, 0
    with _progress(progress, desc="skipping prepared documents", total=nbytes) as bar:
        for doc in docs:
            n = len(doc.encode("utf-8"))
            seen, size = seen + 1, size + n
            bar.update(n)
            if seen == count:
                break
    if (seen, size) != (count, nbytes):
        raise _InputChanged(
            f"its first {seen:,} documents hold {size:,} bytes, the interrupted run prepared "
            f"{count:,} documents of {nbytes:,} bytes"
        )


def _encode(
    *,
    inputs: Inputs,
    max_bytes,
    tokenizer_json: Path,
    eos_id: int,
    dtype: str,
    workers: _Workers,
    val_fraction: float,
    writers: dict,
    progress: bool,
    done: dict,
    journal: Callable[[dict], None],
) -> dict:
    """Tokenize the documents after the `done` ones (num_documents, num_bytes: 0 but on a resume) into `writers`;
    `journal` gets the counts and the writers' states at document boundaries (JOURNAL_SECONDS, a shard closed).
    Returns the counts: num_documents, num_bytes (all of them, done included)."""
    from dspipe.data.tokenizer import PIECE_CHARS, release_memory, splits_exactly

    counts = {"num_documents": done["num_documents"], "num_bytes": done["num_bytes"]}
    clock = {
        "journal": time.monotonic(),
        "closed": sum(len(w.shards) for w in writers.values()),
        "tokens": sum(w.num_tokens for w in writers.values()),
    }
    held: list[np.ndarray] = []  # the parts so far of a document sent in parts, without their EOS

    def checkpoint() -> None:
        journal({**counts, "writers": {s: w.state() for s, w in writers.items()}})
        clock["journal"] = time.monotonic()
        clock["closed"] = sum(len(w.shards) for w in writers.values())

    def write(tokens: np.ndarray, lengths: np.ndarray, continued: bool, nbytes: int) -> None:
        counts["num_bytes"] += nbytes
        clock["tokens"] += int(tokens.size) - continued
        if continued:
            held.append(tokens[:-1])
            bar.update(nbytes)
            return
        if held:  # the last part: the whole document
            tokens, lengths = _whole(held, last=tokens, dtype=lengths.dtype)
        _add_documents(
            tokens=tokens, lengths=lengths, first=counts["num_documents"], val_fraction=val_fraction, writers=writers
        )
        counts["num_documents"] += lengths.size
        _postfix(bar, documents=counts["num_documents"], tokens=clock["tokens"])
        bar.update(nbytes)
        if _journal_due(clock=clock, writers=writers):
            checkpoint()
        release_memory()

    exact = splits_exactly(tokenizer_json)
    task = dict(tokenizer_json=str(tokenizer_json), eos_id=eos_id, dtype=dtype, piece_chars=PIECE_CHARS if exact else 0)
    docs = _documents_after(inputs=inputs, max_bytes=max_bytes, done=done, workers=workers, progress=progress)
    bar = _progress(progress, total=_input_size(inputs, max_bytes), initial=done["num_bytes"])
    with bar:
        _encode_in_order(docs=docs, exact=exact, task=task, workers=workers, write=write)
    return counts


def _postfix(bar, *, documents: int, tokens: int) -> None:
    """The progress bar's documents and tokens so far (when it shows)."""
    if not bar.disable:
        bar.set_postfix_str(f"{documents:,} docs, {bar.format_sizeof(tokens)} tokens", refresh=False)


def _whole(held: list[np.ndarray], *, last: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, lengths) of the document whose parts are `held` (emptied) and `last`."""
    tokens = np.concatenate([*held, last])
    lengths = np.array([tokens.size], dtype=dtype)
    held.clear()
    return tokens, lengths


def _journal_due(*, clock: dict, writers: dict) -> bool:
    """Whether the journal is due: JOURNAL_SECONDS since the last, or a shard closed since."""
    return (
        time.monotonic() - clock["journal"] >= JOURNAL_SECONDS
        or sum(len(w.shards) for w in writers.values()) != clock["closed"]
    )


def _add_documents(*, tokens: np.ndarray, lengths: np.ndarray, first: int, val_fraction: float, writers: dict) -> None:
    """Whole documents (`lengths` of them, the first numbered `first`) to the val or the train writer."""
    val = is_val(np.arange(first, first + lengths.size, dtype=np.float64), val_fraction)
    if val.any():
        token_val = np.repeat(val, lengths)
        writers["val"].add(tokens[token_val], lengths[val])
        writers["train"].add(tokens[~token_val], lengths[~val])
    else:
        writers["train"].add(tokens, lengths)


def _documents_after(*, inputs: Inputs, max_bytes, done: dict, workers: _Workers, progress: bool) -> Iterator[str]:
    """The input's documents, read past the `done` ones (the pool starting meanwhile)."""
    docs = documents(inputs, max_bytes=max_bytes, first_within=max_bytes)
    if done["num_documents"]:
        workers.pool()  # starts while the prepared documents are read past
        _skip(docs, count=done["num_documents"], nbytes=done["num_bytes"], progress=progress)
    return docs


def _encode_in_order(*, docs: Iterator[str], exact: bool, task: dict, workers: _Workers, write: Callable) -> None:
    """Encode the batches of `docs` in the pool, at most 2 per worker in flight, `write` taking each in order."""
    from dspipe.data.tokenizer import encode_batch

    pending: deque = deque()
    for batch, continued in _batches(docs, cut=exact):
        nbytes = sum(len(d.encode("utf-8")) for d in batch)
        pending.append((workers.pool().apply_async(encode_batch, (batch,), task), continued, nbytes))
        if len(pending) >= 2 * workers.count:
            result, more, size = pending.popleft()
            write(*result.get(), more, size)
    while pending:
        result, more, size = pending.popleft()
        write(*result.get(), more, size)


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
    if len(tok) < train_tokenizer:  # the trainer ran out of pairs to merge: say so, the vocab is not what was asked
        from dspipe.log import get_logger

        base = 256 + 1  # the byte alphabet and EOS
        get_logger(__name__).info(
            f"note: the BPE has {len(tok)} tokens, not the {train_tokenizer} asked for: its training text yields "
            f"only {len(tok) - base} merges beyond the 256 byte tokens and EOS (every word in it is already one "
            f"token); a larger or more varied input gives more"
        )
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
                raise too_small(
                    flag="--tokenizer-sample-mb",
                    limit=sample_bytes,
                    size=size,
                    what=f"the first piece of the BPE's training text ({size:,} bytes: the first "
                    f"document, or its first {PIECE_CHARS:,} characters at most)",
                )
            yield piece
            total += size
            if total >= sample_bytes:
                return


def _empty_input(inputs: Inputs) -> SpecError:
    skipped = inputs.stats
    return SpecError(
        f"empty input: no documents with text in {inputs.label} ({skipped['empty']} empty documents, "
        f"{skipped['bad_utf8']} non-UTF-8 and {skipped['unreadable']} unreadable files skipped)"
    )


def _new_tokenizer(
    *, work: WorkDir, inputs: Inputs, tokenizer, train_tokenizer, sample_bytes, max_bytes, workers, log
) -> dict:
    """Load or train the tokenizer, save it in the work directory (synced: a resume takes it as it is); its facts
    for meta.json (source, vocab_size, eos_id, eos_token)."""
    from dspipe.data.tokenizer import save_hf

    tok, source = _load_tokenizer(
        inputs=inputs,
        tokenizer=tokenizer,
        train_tokenizer=train_tokenizer,
        sample_bytes=sample_bytes,
        max_bytes=max_bytes,
        workers=workers,
        log=log,
    )
    saved = save_hf(tok, work.path / TOKENIZER_DIR).parent
    for f in (*saved.iterdir(), saved):
        fsync_path(f)
    return {"source": source, "vocab_size": len(tok), "eos_id": int(tok.eos_token_id), "eos_token": tok.eos_token}


def _resume(work: WorkDir, *, fp: str, shard_tokens: int, log) -> tuple[dict, dict, dict] | None:
    """(tokenizer facts, split writers, documents, bytes and tokens done) from the journal of a run of this fingerprint
    that died, or None: there is none, or it does not hold (the directory is emptied for a fresh build)."""
    journal = work.journal()
    if journal is None:
        if any(p.name != LOCK_FILE for p in work.path.iterdir()):
            log(f"discarding {work.path}: an interrupted run left no usable journal there")
        work.clear()
        return None
    facts, writers = journal["tokenizer"], {}
    try:
        vocab, eos_id = facts.get("vocab_size"), facts.get("eos_id")
        if (
            type(vocab) is not int
            or type(eos_id) is not int
            or not 0 <= eos_id < vocab
            or not isinstance(facts.get("source"), str)
            or not isinstance(facts.get("eos_token"), str)
        ):
            raise ValueError("its tokenizer facts are not valid")
        if not (work.path / TOKENIZER_DIR / "tokenizer.json").is_file():
            raise ValueError(f"{TOKENIZER_DIR}/tokenizer.json is missing")
        for s in SPLITS:
            writers[s] = ShardWriter(
                directory=work.path, split=s, dtype=token_dtype(vocab), shard_tokens=shard_tokens, ident=dataset_id(fp)
            )
            state = journal["writers"].get(s)
            if not isinstance(state, dict):
                raise ValueError(f"the journal has no {s} writer state")
            writers[s].restore(state)
    except (ValueError, TypeError, KeyError, OSError) as e:  # the journal or the files are not as a run left them
        for w in writers.values():
            w.abort()
        log(f"cannot resume from {work.path} ({e}): starting over")
        work.clear()
        return None
    keep = {TOKENIZER_DIR, JOURNAL_FILE}  # and the shards of the journal; the shards past it are gone (restore)
    for s in SPLITS:
        state = journal["writers"][s]
        for shard in state["shards"] + ([state["open"]] if state["open"] else []):
            keep |= {f"{shard['name']}.bin", f"{shard['name']}.idx"}
    work.clear(keep=keep)  # a journal's temp file or a meta.json the run was writing when it died
    done = {
        "num_documents": journal["num_documents"],
        "num_bytes": journal["num_bytes"],
        "num_tokens": sum(w.num_tokens for w in writers.values()),
    }
    log(f"resuming {work.shown}: {done['num_documents']:,} documents ({done['num_tokens']:,} tokens) already prepared")
    return facts, writers, done


def _build(
    *,
    work: WorkDir,
    workers: _Workers,
    inputs: Inputs,
    fp: str,
    tokenizer,
    train_tokenizer,
    sample_bytes,
    val_fraction,
    max_bytes,
    shard_tokens,
    progress,
    log,
) -> tuple[dict, float, dict]:
    """Everything into the work directory, from where a run of this fingerprint that died stopped (its journal),
    else from the start; returns (meta, seconds spent encoding, the documents done before this run)."""
    facts, writers, done = _start(
        work=work,
        workers=workers,
        inputs=inputs,
        fp=fp,
        tokenizer=tokenizer,
        train_tokenizer=train_tokenizer,
        sample_bytes=sample_bytes,
        max_bytes=max_bytes,
        shard_tokens=shard_tokens,
        log=log,
    )
    dtype = token_dtype(facts["vocab_size"])
    counts, encode_seconds = _encode_timed(
        work=work,
        workers=workers,
        inputs=inputs,
        facts=facts,
        writers=writers,
        done=done,
        val_fraction=val_fraction,
        max_bytes=max_bytes,
        progress=progress,
    )
    if counts["num_documents"] == 0:
        raise _empty_input(inputs)
    splits = _close_splits(writers)
    meta = _meta(
        fp=fp,
        facts=facts,
        dtype=dtype,
        counts=counts,
        splits=splits,
        inputs=inputs,
        val_fraction=val_fraction,
        max_bytes=max_bytes,
    )
    write_meta(work.path, meta)  # last: a directory without meta.json is never read
    return meta, encode_seconds, done


def _encode_timed(
    *,
    work: WorkDir,
    workers: _Workers,
    inputs: Inputs,
    facts: dict,
    writers: dict,
    done: dict,
    val_fraction,
    max_bytes,
    progress,
) -> tuple[dict, float]:
    """(_encode's counts, the seconds it took); the writers are aborted when it fails."""
    eos_id, dtype = facts["eos_id"], token_dtype(facts["vocab_size"])
    try:
        t0 = time.perf_counter()
        counts = _encode(
            inputs=inputs,
            max_bytes=max_bytes,
            tokenizer_json=work.path / TOKENIZER_DIR / "tokenizer.json",
            eos_id=eos_id,
            dtype=dtype,
            workers=workers,
            val_fraction=val_fraction,
            writers=writers,
            progress=progress,
            done=done,
            journal=lambda j: work.write_journal({**j, "tokenizer": facts}),
        )
        encode_seconds = time.perf_counter() - t0
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    return counts, encode_seconds


def _start(
    *,
    work: WorkDir,
    workers: _Workers,
    inputs: Inputs,
    fp: str,
    tokenizer,
    train_tokenizer,
    sample_bytes,
    max_bytes,
    shard_tokens,
    log,
) -> tuple[dict, dict, dict]:
    """(tokenizer facts, split writers, documents done) from where a run of this fingerprint that died stopped, else
    from the start: the tokenizer loaded or trained, the writers new."""
    resumed = _resume(work, fp=fp, shard_tokens=shard_tokens, log=log)
    if resumed is not None:
        return resumed
    facts = _new_tokenizer(
        work=work,
        inputs=inputs,
        tokenizer=tokenizer,
        train_tokenizer=train_tokenizer,
        sample_bytes=sample_bytes,
        max_bytes=max_bytes,
        workers=workers,
        log=log,
    )
    writers, done = _fresh_writers(work=work, facts=facts, fp=fp, shard_tokens=shard_tokens)
    return facts, writers, done


def _close_splits(writers: dict) -> dict:
    """Close the split writers; each split's documents, tokens and shards."""
    splits = {}
    for s, w in writers.items():
        shards = w.close()
        splits[s] = {
            "num_documents": sum(x["num_documents"] for x in shards),
            "num_tokens": sum(x["num_tokens"] for x in shards),
            "shards": shards,
        }
    return splits


def _fresh_writers(*, work: WorkDir, facts: dict, fp: str, shard_tokens) -> tuple[dict, dict]:
    """(split writers, nothing done) for a build from the start, its first journal written."""
    writers = {
        s: ShardWriter(
            directory=work.path,
            split=s,
            dtype=token_dtype(facts["vocab_size"]),
            shard_tokens=shard_tokens,
            ident=dataset_id(fp),
        )
        for s in SPLITS
    }
    done = {"num_documents": 0, "num_bytes": 0, "num_tokens": 0}
    work.write_journal(
        {
            "num_documents": 0,
            "num_bytes": 0,
            "tokenizer": facts,
            "writers": {s: w.state() for s, w in writers.items()},
        }
    )
    return writers, done


def _meta(
    *, fp: str, facts: dict, dtype: str, counts: dict, splits: dict, inputs: Inputs, val_fraction, max_bytes
) -> dict:
    """meta.json's content for a finished build."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "fingerprint": fp,
        "tokenizer": TOKENIZER_DIR,
        "tokenizer_source": facts["source"],
        "vocab_size": facts["vocab_size"],
        "eos_id": facts["eos_id"],
        "eos_token": facts["eos_token"],
        "dtype": dtype,
        "num_documents": counts["num_documents"],
        "num_tokens": sum(v["num_tokens"] for v in splits.values()),
        "num_bytes": counts["num_bytes"],
        "skipped": dict(inputs.stats),
        "val_fraction": val_fraction,
        "input": {
            "source": inputs.label,
            "files": len(inputs.files),
            "hub": inputs.hub,
            "config": inputs.config,
            "split": inputs.split,
            "text_field": inputs.text_field,
            "txt_docs": inputs.txt_docs,
            "max_bytes": max_bytes,
        },
        "splits": splits,
    }


def prepare(
    *,
    inputs: Inputs,
    out: Path,
    tokenizer: str | None = None,
    train_tokenizer: int | None = None,
    tokenizer_sample_bytes: int = 64 << 20,
    val_fraction: float = 0.01,
    max_bytes: int | None = None,
    shard_tokens: int = 500_000_000,
    workers: int = 1,
    force: bool = False,
    progress: bool = False,
    log: Callable[[str], None] = lambda s: None,
) -> Prepared:
    """Prepare `out` from `inputs`; a no-op (reused=True) when out already holds exactly this preparation. A run of
    the same inputs and options that died is resumed where it stopped (module docstring)."""
    if tokenizer is None and train_tokenizer is None:
        train_tokenizer = DEFAULT_VOCAB
    _validate(
        tokenizer=tokenizer,
        train_tokenizer=train_tokenizer,
        val_fraction=val_fraction,
        max_bytes=max_bytes,
        shard_tokens=shard_tokens,
        workers=workers,
        sample_bytes=tokenizer_sample_bytes,
    )
    out = outputs.target(out, flag="--out", expect="dir")
    fp = fingerprint(
        [
            FORMAT,
            FORMAT_VERSION,
            inputs.fingerprint_items(),
            _tokenizer_identity(tokenizer, train_tokenizer, tokenizer_sample_bytes),
            val_fraction,
            max_bytes,
            shard_tokens,
        ]
    )
    same, rebuilding = _existing(out, fp=fp, force=force)
    if same is not None:
        return Prepared(meta=same, reused=True)
    outputs.claim_dir(out, kind="data", replace=True)  # only a data directory dspipe wrote, holding nothing else
    if rebuilding:
        log(f"{out} holds another preparation (different inputs or options): rebuilding it")
    options = dict(
        inputs=inputs,
        tokenizer=tokenizer,
        train_tokenizer=train_tokenizer,
        sample_bytes=tokenizer_sample_bytes,
        val_fraction=val_fraction,
        max_bytes=max_bytes,
        shard_tokens=shard_tokens,
        progress=progress,
        log=log,
    )
    return _prepare_fresh(out=out, fp=fp, workers=workers, options=options, log=log)


def _existing(out: Path, *, fp: str, force: bool) -> tuple[dict | None, bool]:
    """(the meta of `out` when it holds exactly this preparation, else None; whether it holds another one)."""
    if (out / META_FILE).is_file() and not force:
        try:
            meta = read_meta(out)
        except SpecError:
            meta = {}
        if meta.get("fingerprint") == fp:
            return meta, False
        return None, True
    return None, False


def _prepare_fresh(*, out: Path, fp: str, workers: int, options: dict, log) -> Prepared:
    """Build `out` (claimed) with _build's `options`, from where a run that died stopped or from the start."""
    start = time.perf_counter()
    dest = Path(os.path.abspath(out))
    work, pool = WorkDir(dest, fp, shown=out), _Workers(workers)
    build = dict(work=work, workers=pool, fp=fp, **options)
    meta, encode_seconds, done = _build_into(out=out, dest=dest, work=work, pool=pool, build=build, log=log)
    return Prepared(
        meta=meta,
        reused=False,
        seconds=time.perf_counter() - start,
        encode_seconds=encode_seconds,
        resumed_documents=done["num_documents"],
        encoded_documents=meta["num_documents"] - done["num_documents"],
        encoded_tokens=meta["num_tokens"] - done["num_tokens"],
    )


def _build_into(*, out: Path, dest: Path, work: WorkDir, pool: _Workers, build: dict, log) -> tuple[dict, float, dict]:
    """_build's (meta, seconds spent encoding, documents done before), its work directory then moved to `dest`; the
    work directory is kept for a resume when interrupted with documents prepared, else discarded on a failure."""
    with outputs.parents(out):
        with outputs.write_errors(out):
            remove_stale_temps(dest, keep=work.path)
            work.acquire()
        try:
            try:
                meta, encode_seconds, done = _build(**build)
            except _InputChanged as e:
                log(f"the input changed since the interrupted run of {out} ({e}): starting over")
                work.clear()
                meta, encode_seconds, done = _build(**build)
            with outputs.write_errors(out):
                staged = work.finish()
                outputs.write_marker(staged, kind="data")
                replace_dir(staged, dest)
        except KeyboardInterrupt:
            if not work.documents:
                work.discard()
            else:
                log(
                    f"interrupted: the {work.documents:,} documents prepared so far are kept in {work.path}; run "
                    f"the same command again to resume"
                )
            raise
        except BaseException:
            work.discard()
            raise
        finally:
            work.release()
            pool.stop()
    return meta, encode_seconds, done
