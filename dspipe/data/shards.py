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

import json
import struct
from pathlib import Path

import numpy as np

from dspipe.errors import SpecError

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
    """Appends whole documents to the numbered shards of one split; a shard closes once it holds shard_tokens."""

    def __init__(self, *, directory: Path, split: str, dtype: str, shard_tokens: int, ident: bytes):
        self.directory, self.split, self.dtype = Path(directory), split, np.dtype(dtype)
        self.shard_tokens, self.ident = shard_tokens, ident
        self.shards: list[dict] = []
        self._tokens = self._index = None

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
            piece = tokens[start:int(ends[last - 1])].astype(self.dtype, copy=False)
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

    def _open(self) -> None:
        name = shard_name(self.split, len(self.shards))
        self._name, self._count, self._docs = name, 0, 0
        self._tokens = open(self.directory / f"{name}.bin", "wb")
        self._index = open(self.directory / f"{name}.idx", "wb")
        self._tokens.write(bytes(HEADER.size))
        self._index.write(bytes(HEADER.size))
        self._index.write(np.zeros(1, "<u8").tobytes())

    def _close_shard(self) -> None:
        for f, magic, size, count in ((self._tokens, TOKENS_MAGIC, self.dtype.itemsize, self._count),
                                      (self._index, INDEX_MAGIC, 8, self._docs + 1)):
            f.seek(0)
            f.write(HEADER.pack(magic, FORMAT_VERSION, size, count, self.ident))
            f.close()
        self.shards.append({"name": self._name, "num_tokens": self._count, "num_documents": self._docs})
        self._tokens = self._index = None

    def abort(self) -> None:
        """Close the open shard without completing its header (its directory is being thrown away)."""
        for f in (self._tokens, self._index):
            if f is not None:
                f.close()
        self._tokens = self._index = None


def write_meta(directory: Path, meta: dict) -> None:
    (Path(directory) / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def read_meta(data_dir: str | Path) -> dict:
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        raise SpecError(f"{data_dir} is not a prepared data directory (no {META_FILE}); "
                        f"run 'dspipe prepare-data --out {data_dir}'")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"{path} is not valid JSON ({e}); re-run 'dspipe prepare-data --out {data_dir} --force'"
                        ) from None
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise SpecError(f"{data_dir} was not prepared by this dspipe (format {meta.get('format')!r} version "
                        f"{meta.get('format_version')}, want {FORMAT!r} {FORMAT_VERSION}); "
                        f"re-run 'dspipe prepare-data --out {data_dir} --force'")
    return meta


def _open_array(path: Path, *, magic: bytes, dtype: np.dtype, count: int, ident: bytes, what: str) -> np.memmap:
    if not path.is_file():
        raise SpecError(f"{path} is missing ({what} listed in {META_FILE})")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
    if len(head) < HEADER.size or head[:8] != magic:
        raise SpecError(f"{path} is not a dspipe {what} (bad header): the file is truncated or foreign")
    _, version, itemsize, n, file_ident = HEADER.unpack(head)
    if file_ident != ident or version != FORMAT_VERSION or itemsize != dtype.itemsize:
        raise SpecError(f"{path} belongs to another prepared dataset (id {file_ident.hex()}, {META_FILE} says "
                        f"{ident.hex()}): the file is foreign")
    if n != count:
        raise SpecError(f"{path} holds {n} items, {META_FILE} says {count}: the file is truncated or foreign")
    expected = HEADER.size + count * itemsize
    if size != expected:
        raise SpecError(f"{path} has {size} bytes, {META_FILE} says {expected} ({count} items): "
                        f"the file is truncated or foreign")
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER.size, shape=(count,))


def open_split(data_dir: str | Path, split: str, meta: dict | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, document offsets) memory maps of every shard of a split, each checked against meta.json."""
    data_dir = Path(data_dir)
    meta = meta or read_meta(data_dir)
    if split not in meta["splits"]:
        raise SpecError(f"{data_dir} has no split {split!r} (splits: {', '.join(meta['splits'])})")
    ident, dtype = dataset_id(meta["fingerprint"]), np.dtype(meta["dtype"])
    shards = []
    for shard in meta["splits"][split]["shards"]:
        tokens = _open_array(data_dir / f"{shard['name']}.bin", magic=TOKENS_MAGIC, dtype=dtype,
                             count=shard["num_tokens"], ident=ident, what="token shard")
        offsets = _open_array(data_dir / f"{shard['name']}.idx", magic=INDEX_MAGIC, dtype=np.dtype("<u8"),
                              count=shard["num_documents"] + 1, ident=ident, what="document index")
        shards.append((tokens, offsets))
    return shards
