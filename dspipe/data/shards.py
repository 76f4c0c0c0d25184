"""On-disk format of a prepared data directory: meta.json, token shards and document indexes. numpy only.

    DIR/meta.json            written last: tokenizer, vocab, dtype, counts, input fingerprint, shard list
    DIR/tokenizer/           the tokenizer in Hugging Face format (AutoTokenizer.from_pretrained(DIR/tokenizer))
    DIR/train-00000.bin      32-byte header + token ids (uint16 when the vocabulary fits, else uint32), EOS after
                             every document
    DIR/train-00000.idx      32-byte header + uint64 offsets of document starts (num_documents + 1 values)
    DIR/val-00000.bin/.idx   the validation split, whole documents

Each header holds a magic, the format version, the item size, the item count and the dataset id (the first 8 bytes
of the input fingerprint), so a loader rejects a truncated file, a file of another format and a shard of another
prepared dataset.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dspipe.errors import SpecError, cannot_read, file_problem
from dspipe.jsonio import dumps, read_object, show

FORMAT = "dspipe-tokens"
FORMAT_VERSION = 1
META_FILE = "meta.json"
TOKENIZER_DIR = "tokenizer"
SPLITS = ("train", "val")
HEADER = struct.Struct("<8sIIQ8s")  # magic, version, item size, item count, dataset id: 32 bytes
TOKENS_MAGIC, INDEX_MAGIC = b"DSPTOKEN", b"DSPINDEX"


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def dataset_id(fingerprint: str) -> bytes:
    return bytes.fromhex(fingerprint[:16])


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:05d}"


class ShardWriter:
    """Appends whole documents to the numbered shards of one split; a shard closes once it holds shard_tokens.

    A writer whose process died resumes from its last state(): restore() keeps the shards closed by then, cuts the
    open shard's files back to the sizes it had and goes on appending, so the files come out byte for byte as an
    uninterrupted writer's (the headers are written when a shard closes)."""

    def __init__(self, *, directory: Path, split: str, dtype: str, shard_tokens: int, ident: bytes):
        self.directory, self.split, self.dtype = Path(directory), split, np.dtype(dtype)
        self.shard_tokens, self.ident = shard_tokens, ident
        self.shards: list[dict] = []
        self._tokens = self._index = None
        self._unsynced: list[Path] = []  # files of shards closed since the last state()

    def add(self, tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
        """tokens: whole documents back to back (EOS included); doc_lengths: their lengths, in order."""
        if doc_lengths.size == 0:
            return
        ends = np.cumsum(doc_lengths)
        first = 0
        while first < doc_lengths.size:
            if self._tokens is None:
                self._open()
            room = self.shard_tokens - self._count
            # as many whole documents as fit; at least one, so a document longer than a shard gets its own
            last = max(first + 1, int(np.searchsorted(ends, ends[first] - doc_lengths[first] + room, side="right")))
            last = min(last, doc_lengths.size)
            start = int(ends[first] - doc_lengths[first])
            piece = tokens[start : int(ends[last - 1])].astype(self.dtype, copy=False)
            self._tokens.write(memoryview(np.ascontiguousarray(piece)).cast("B"))
            offsets = self._count + np.cumsum(doc_lengths[first:last], dtype=np.uint64)
            self._index.write(offsets.astype("<u8").tobytes())
            self._count += piece.size
            self._docs += last - first
            first = last
            if self._count >= self.shard_tokens:
                self._close_shard()

    def close(self) -> list[dict]:
        if self._tokens is not None:
            self._close_shard()
        return self.shards

    @property
    def num_tokens(self) -> int:
        """Tokens written so far, the open shard's included."""
        return sum(s["num_tokens"] for s in self.shards) + (self._count if self._tokens is not None else 0)

    def state(self) -> dict:
        """Where the writer stands, as JSON-ready data for restore(): its closed shards, and the open shard's name,
        token and document counts and file sizes (None when no shard is open). Every file it names is on disk
        first (flushed and fsynced), so the state holds after a crash, a power cut included."""
        for path in self._unsynced:
            fsync_path(path)
        self._unsynced.clear()
        current = None
        if self._tokens is not None:
            for f in (self._tokens, self._index):
                f.flush()
                os.fsync(f.fileno())
            current = {
                "name": self._name,
                "num_tokens": self._count,
                "num_documents": self._docs,
                "bin_bytes": self._tokens.tell(),
                "idx_bytes": self._index.tell(),
            }
        return {"shards": [dict(s) for s in self.shards], "open": current}

    def restore(self, state: dict) -> None:
        """Go on from `state` (state() of a writer of this split, directory, dtype, shard size and dataset id whose
        process died): the closed shards are kept as they are (their headers checked), the open shard's files are
        cut back to the sizes the state gives and reopened for appending, and shard files of this split past them
        (written after the state) are removed. ValueError, saying what differs, when the files do not match it."""
        closed, current = state.get("shards"), state.get("open")
        if not isinstance(closed, list) or not (current is None or isinstance(current, dict)):
            raise ValueError(f"bad {self.split} writer state")
        for i, shard in enumerate(closed):
            self._check_closed(i, shard)
        self.shards = [{k: s[k] for k in ("name", "num_tokens", "num_documents")} for s in closed]
        following = len(closed)
        if current is not None:
            self._reopen(current)
            following += 1
        for path in self.directory.glob(f"{self.split}-*"):
            found = re.fullmatch(rf"{re.escape(self.split)}-(\d{{5,}})\.(bin|idx)", path.name)
            if found and int(found[1]) >= following:
                path.unlink()

    def _files(self, name: str) -> tuple[Path, Path]:
        return self.directory / f"{name}.bin", self.directory / f"{name}.idx"

    def _check_closed(self, number: int, shard) -> None:
        """A closed shard of the state: its name, counts, file sizes and headers as _close_shard left them."""
        name = shard_name(self.split, number)
        tokens, docs = _state_count(shard, "num_tokens"), _state_count(shard, "num_documents")
        if shard.get("name") != name:
            raise ValueError(
                f"shard {number} of the {self.split} split is named {show(shard.get('name'))}, not {name!r}"
            )
        for path, magic, size, count in zip(
            self._files(name), (TOKENS_MAGIC, INDEX_MAGIC), (self.dtype.itemsize, 8), (tokens, docs + 1), strict=False
        ):
            expected = HEADER.size + count * size
            if not path.is_file() or path.stat().st_size != expected:
                raise ValueError(
                    f"{path.name} has {path.stat().st_size if path.is_file() else 'no'} bytes, "
                    f"the state says {expected}"
                )
            with open(path, "rb") as f:
                if f.read(HEADER.size) != HEADER.pack(magic, FORMAT_VERSION, size, count, self.ident):
                    raise ValueError(f"{path.name} has another header than the state's")

    def _reopen(self, current: dict) -> None:
        """The open shard of a state, cut back to the state's sizes and opened for appending."""
        name = shard_name(self.split, len(self.shards))
        tokens, docs = _state_count(current, "num_tokens"), _state_count(current, "num_documents")
        sizes = (HEADER.size + tokens * self.dtype.itemsize, HEADER.size + 8 * (docs + 1))
        if (
            current.get("name") != name
            or (current.get("bin_bytes"), current.get("idx_bytes")) != sizes
            or not 0 < tokens < self.shard_tokens
            or not 0 < docs <= tokens
        ):
            raise ValueError(
                f"the open {self.split} shard of the state ({show(current.get('name'))}, {tokens} "
                f"tokens, {docs} documents) is not one this writer could have written"
            )
        paths = self._files(name)
        for path, size in zip(paths, sizes, strict=False):
            if not path.is_file() or path.stat().st_size < size:
                raise ValueError(
                    f"{path.name} has {path.stat().st_size if path.is_file() else 'no'} bytes, the "
                    f"state says at least {size}"
                )
        with open(paths[1], "rb") as f:
            f.seek(sizes[1] - 8)
            last = int(np.frombuffer(f.read(8), "<u8")[0])
        if last != tokens:
            raise ValueError(f"{paths[1].name} ends its document {docs} at token {last}, the state says {tokens}")
        files = []
        for path, size in zip(paths, sizes, strict=False):
            f = open(path, "r+b")
            f.truncate(size)
            f.seek(size)
            files.append(f)
        self._tokens, self._index = files
        self._name, self._count, self._docs = name, tokens, docs

    def _open(self) -> None:
        name = shard_name(self.split, len(self.shards))
        self._name, self._count, self._docs = name, 0, 0
        self._tokens = open(self.directory / f"{name}.bin", "wb")
        self._index = open(self.directory / f"{name}.idx", "wb")
        self._tokens.write(bytes(HEADER.size))
        self._index.write(bytes(HEADER.size))
        self._index.write(np.zeros(1, "<u8").tobytes())

    def _close_shard(self) -> None:
        for f, magic, size, count in (
            (self._tokens, TOKENS_MAGIC, self.dtype.itemsize, self._count),
            (self._index, INDEX_MAGIC, 8, self._docs + 1),
        ):
            f.seek(0)
            f.write(HEADER.pack(magic, FORMAT_VERSION, size, count, self.ident))
            f.close()
        self.shards.append({"name": self._name, "num_tokens": self._count, "num_documents": self._docs})
        self._unsynced += self._files(self._name)
        self._tokens = self._index = None

    def abort(self) -> None:
        """Close the open shard without completing its header (its directory is being thrown away, or kept for a
        resume, which goes on from the last state())."""
        for f in (self._tokens, self._index):
            if f is not None:
                f.close()
        self._tokens = self._index = None


def _state_count(entry, key: str) -> int:
    value = entry.get(key) if isinstance(entry, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
        raise ValueError(f"{key} in a writer state must be a count, got {show(value)}")
    return value


def fsync_path(path: str | Path) -> None:
    """Flush a file (or a directory's entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_meta(directory: Path, meta: dict) -> None:
    """meta.json, checked as read_meta checks it (so a written one always reads back), nothing non-finite."""
    check_meta(meta, source=Path(directory) / META_FILE)
    (Path(directory) / META_FILE).write_text(dumps(meta, what=str(Path(directory) / META_FILE)))


def is_prepared(path: str | Path) -> bool:
    """Whether `path` is data a loader reads: a prepared directory (meta.json) or a Megatron prefix."""
    from dspipe.data import megatron

    return (Path(path) / META_FILE).is_file() or megatron.is_prefix(path)


def read_meta(data_dir: str | Path, *, deep: bool = True) -> dict:
    """meta.json of a prepared data directory, validated (check_meta): one SpecError naming the file and field. For
    a Megatron prefix, the same fields from its index (dspipe.data.megatron.read_meta; deep: every check and the
    token scan)."""
    from dspipe.data import megatron

    if megatron.is_prefix(data_dir):
        return megatron.read_meta(data_dir, deep=deep)
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        raise SpecError(
            f"{data_dir} is not a prepared data directory (no {META_FILE}); run 'dspipe prepare-data --out {data_dir}'"
        )
    meta = read_object(path, hint=f"re-run 'dspipe prepare-data --out {data_dir} --force'")
    version = meta.get("format_version")
    if meta.get("format") != FORMAT or isinstance(version, bool) or version != FORMAT_VERSION:  # true == 1 in Python
        raise SpecError(
            f"{data_dir} was not prepared by this dspipe ({META_FILE}: format {show(meta.get('format'))} "
            f"version {show(version, 20)}, want {FORMAT!r} {FORMAT_VERSION}); "
            f"re-run 'dspipe prepare-data --out {data_dir} --force'"
        )
    check_meta(meta, source=path)
    return meta


MAX_TOKENS = 2**62  # counts beyond this overflow the int64 offsets the loader computes
_META_KEYS = ("fingerprint", "vocab_size", "eos_id", "dtype", "num_documents", "num_tokens", "splits", "val_fraction")
"""The keys check_meta requires, in the order it looks for them."""


def check_meta(meta: dict, *, source: Path) -> None:
    """Every field a reader uses has its type and range, and the counts add up: vocab and dtype agree, EOS is a
    token, shard names are this format's (never a path), each split's totals are the sum of its shards and the
    file's totals the sum of its splits."""
    where = f"{source}:"
    fix = "re-run 'dspipe prepare-data --force' to rebuild it"

    def fail(text: str):
        raise SpecError(f"{where} {text}; {fix}")

    def count(name: str, value, *, low: int = 0, high: int = MAX_TOKENS) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            fail(f"{name} must be an integer in {low}..{high}, got {show(value)}")
        return value

    for key in _META_KEYS:
        if key not in meta:
            fail(f"missing key {key}")
    fp = meta["fingerprint"]
    if not isinstance(fp, str) or not re.fullmatch(r"[0-9a-f]{16,128}", fp, re.ASCII):
        fail(f"fingerprint must be a hex digest, got {show(fp)}")
    vocab = count("vocab_size", meta["vocab_size"], low=1, high=2**32)
    count("eos_id", meta["eos_id"], high=vocab - 1)
    if meta["dtype"] != token_dtype(vocab):
        fail(
            f"dtype {show(meta['dtype'])} does not hold vocab_size {vocab} the way this format stores it "
            f"({token_dtype(vocab)!r})"
        )
    if "tokenizer" in meta and meta["tokenizer"] != TOKENIZER_DIR:
        fail(f"tokenizer must be {TOKENIZER_DIR!r} (the directory beside meta.json), got {show(meta['tokenizer'])}")
    vf = meta["val_fraction"]
    if isinstance(vf, bool) or not isinstance(vf, (int, float)) or not 0 <= vf < 1:
        fail(f"val_fraction must be a number in [0, 1), got {show(vf)}")
    splits = meta["splits"]
    if not isinstance(splits, dict) or "train" not in splits or set(splits) - set(SPLITS):
        fail(
            f"splits must be an object with 'train' (and 'val'), got "
            f"{sorted(map(str, splits)) if isinstance(splits, dict) else type(splits).__name__}"
        )
    totals = {"num_tokens": 0, "num_documents": 0}
    for split, info in splits.items():
        for key, total in _check_split(split, info, fail=fail, count=count).items():
            totals[key] += total
    for key, total in totals.items():
        if count(key, meta[key]) != total:
            fail(f"{key} {meta[key]} != {total}, the sum over the splits")
    if "skipped" in meta and not isinstance(meta["skipped"], dict):
        fail(f"skipped must be an object, got {type(meta['skipped']).__name__}")


def _check_split(split: str, info, *, fail: Callable[[str], None], count: Callable[..., int]) -> dict[str, int]:
    """check_meta's checks of one split's entry (`fail` refuses, `count` checks a count); its tokens and documents."""
    if not isinstance(info, dict) or not isinstance(info.get("shards"), list):
        fail(f"splits.{split} must be an object with a list of shards")
    sums = {"num_tokens": 0, "num_documents": 0}
    for i, shard in enumerate(info["shards"]):
        at = f"splits.{split}.shards[{i}]"
        if not isinstance(shard, dict):
            fail(f"{at} must be an object, got {type(shard).__name__}")
        if shard.get("name") != shard_name(split, i):
            fail(f"{at}.name must be {shard_name(split, i)!r}, got {show(shard.get('name'))}")
        for key in sums:
            sums[key] += count(f"{at}.{key}", shard.get(key))
    for key, total in sums.items():
        if count(f"splits.{split}.{key}", info.get(key)) != total:
            fail(f"splits.{split}.{key} {info[key]} != {total}, the sum over its shards")
    return sums


def _open_array(path: Path, *, magic: bytes, dtype: np.dtype, count: int, ident: bytes, what: str) -> np.memmap:
    """The memory map of one shard file after the cheap checks (no read past its header): a regular file, its
    header this format's (magic, version, item size, dataset id, item count) and its size the count's."""
    fix = "re-run 'dspipe prepare-data --force' to rebuild it"
    problem = file_problem(path)
    if problem:
        raise SpecError(f"{path} {problem} ({what} listed in {META_FILE}); {fix}")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(HEADER.size)
    except OSError as e:
        raise cannot_read(path, e) from None
    if len(head) < HEADER.size:
        raise SpecError(
            f"{path} has {size} bytes, less than a dspipe {what}'s {HEADER.size}-byte header: the file is truncated; "
            f"{fix}"
        )
    if head[:8] != magic:
        raise SpecError(
            f"{path} is not a dspipe {what} (it starts with {head[:8]!r}, not {magic!r}): the file is damaged or "
            f"foreign; {fix}"
        )
    _, version, itemsize, n, file_ident = HEADER.unpack(head)
    if version != FORMAT_VERSION:
        raise SpecError(
            f"{path}: its header says format version {version}, want {FORMAT_VERSION}: the header is damaged, or "
            f"the file is of another dspipe; {fix}"
        )
    if itemsize != dtype.itemsize:
        raise SpecError(
            f"{path}: its header says {itemsize}-byte items, {META_FILE} implies {dtype.itemsize} ({dtype.name}): the "
            f"header is damaged, or the file is foreign; {fix}"
        )
    if file_ident != ident:
        raise SpecError(
            f"{path} belongs to another prepared dataset (id {file_ident.hex()}, {META_FILE} says "
            f"{ident.hex()}): the file is foreign"
        )
    if n != count:
        raise SpecError(f"{path} holds {n} items, {META_FILE} says {count}: the file is truncated or foreign")
    expected = HEADER.size + count * itemsize
    if size != expected:
        raise SpecError(
            f"{path} has {size} bytes, {META_FILE} says {expected} ({count} items): the file is truncated or foreign"
        )
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER.size, shape=(count,))


def open_split(data_dir: str | Path, split: str, meta: dict | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, document offsets) memory maps of every shard of a split, each checked against meta.json."""
    meta = meta or read_meta(data_dir, deep=False)
    if meta.get("format") == "megatron-mmidx":
        from dspipe.data import megatron

        return megatron.open_split(str(data_dir), split, meta)
    data_dir = Path(data_dir)
    if split not in meta["splits"]:
        raise SpecError(f"{data_dir} has no split {split!r} (splits: {', '.join(meta['splits'])})")
    ident, dtype = dataset_id(meta["fingerprint"]), np.dtype(meta["dtype"])
    shards = []
    for shard in meta["splits"][split]["shards"]:
        tokens = _open_array(
            data_dir / f"{shard['name']}.bin",
            magic=TOKENS_MAGIC,
            dtype=dtype,
            count=shard["num_tokens"],
            ident=ident,
            what="token shard",
        )
        offsets = _open_array(
            data_dir / f"{shard['name']}.idx",
            magic=INDEX_MAGIC,
            dtype=np.dtype("<u8"),
            count=shard["num_documents"] + 1,
            ident=ident,
            what="document index",
        )
        first, last = (int(offsets[0]), int(offsets[-1])) if offsets.size else (0, 0)
        if (first, last) != (0, shard["num_tokens"]):
            raise SpecError(
                f"{data_dir / (shard['name'] + '.idx')}: its document offsets run {first}..{last}, want "
                f"0..{shard['num_tokens']} (the shard's tokens in {META_FILE}): the index is damaged; re-run "
                f"'dspipe prepare-data --force' to rebuild it"
            )
        shards.append((tokens, offsets))
    return shards
