"""Megatron-LM / GPT-NeoX indexed datasets (PREFIX.bin + PREFIX.idx, "MMIDIDX" version 1): read, checked, written.

The format, as megatron.core.datasets.indexed_dataset (and GPT-NeoX's mmap dataset) writes it:

    PREFIX.idx  b"MMIDIDX\\x00\\x00", <Q version 1, <B dtype code, <Q sequence count n, <Q document count d,
                int32 lengths[n], int64 byte offsets[n] into PREFIX.bin, int64 document indices[d] (the sequence
                each document starts at: 0 first, n last, so d = documents + 1); a multimodal dataset adds int8
                modes[n]
    PREFIX.bin  the token ids, sequence after sequence
    dtype codes 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16

How dspipe reads one (numpy only; megatron-core itself is not imported: it pulls in megatron.core whole, 7.5 s per
process on the CI machine, and warns about Transformer Engine and Apex):
- The .bin is one stream of documents: every writer lays the sequences out back to back (checked), and document i
  is sequences document_indices[i] .. document_indices[i + 1].
- The last VAL_FRACTION of the documents (rounded as Megatron rounds its --split) is the validation split, the rest
  the train split: Megatron's default --split 969,30,1 holds out the same 3% (its 0.1% test split is not held out).
- Token ids: the stored dtype must be an integer type; the largest id (scanned once per file version, cached
  under ~/.cache/dspipe) must fit the model's vocabulary. EOD: the token every document ends with, where all end
  with the same one (preprocess_data.py --append-eod).
- The tokenizer (for generate and export-hf) is a Hugging Face directory: gen-config --tokenizer DIR, else a
  `tokenizer/` directory beside the prefix.

Writing (MegatronWriter): one sequence per document, as megatron-core's IndexedDatasetBuilder.add_document does for
an unsplit document, in the dtype megatron-core would choose (uint16 below 65,500 tokens, else int32). The index is
built from a side file of lengths, so memory stays flat for any number of documents.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspipe.errors import SpecError, cannot_read
from dspipe.jsonio import read_object

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEAD = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count: 34 bytes
CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
TOKEN_DTYPES = ("uint8", "int16", "uint16", "int32", "int64")
VAL_FRACTION = 0.03
TEXT_DOCUMENT = "text_document"
"""The prefix's name inside a directory dspipe writes (Megatron's preprocess_data.py names its outputs
PREFIX_text_document): pass DIR/text_document to Megatron's --data-path."""
FORMAT = "megatron-mmidx"
CHUNK = 1 << 24  # tokens (or index entries) handled per pass: memory stays flat


def is_prefix(path: str | os.PathLike) -> bool:
    """Whether `path` names a Megatron dataset: PREFIX.idx or PREFIX.bin exists, and PREFIX is not a prepared dspipe
    directory. PREFIX may be a directory too: megatron-core keeps its index cache in PREFIX/cache by default."""
    p = str(path)
    return not os.path.isfile(os.path.join(p, "meta.json")) and (
        os.path.isfile(p + ".idx") or os.path.isfile(p + ".bin")
    )


def idx_path(prefix) -> Path:
    return Path(f"{prefix}.idx")


def bin_path(prefix) -> Path:
    return Path(f"{prefix}.bin")


def writer_dtype(vocab_size: int) -> str:
    """The dtype megatron-core's DType.optimal_dtype picks for a vocabulary: uint16 below 65,500, else int32."""
    return "uint16" if vocab_size < 65500 else "int32"


@dataclass(frozen=True)
class Index:
    """A checked PREFIX.idx: the arrays are memory maps."""

    prefix: str
    dtype: np.dtype
    lengths: np.ndarray
    pointers: np.ndarray
    doc_index: np.ndarray
    num_tokens: int

    @property
    def num_documents(self) -> int:
        return int(self.doc_index.size - 1)

    def doc_token_starts(self, docs: np.ndarray) -> np.ndarray:
        """Token offset in the .bin of each document start in `docs` (document numbers; num_documents is the end)."""
        seq = self.doc_index[np.asarray(docs, dtype=np.int64)]
        out = np.full(seq.shape, self.num_tokens, dtype=np.int64)
        inside = seq < self.lengths.size
        out[inside] = self.pointers[seq[inside]] // self.dtype.itemsize
        return out


def _fail(prefix, text: str) -> SpecError:
    return SpecError(f"Megatron dataset {prefix}: {text}")


def _read_head(prefix: str, *, ip: Path, bp: Path) -> bytes:
    """The index's first HEAD.size bytes, once both files are there and readable."""
    for path, what in ((ip, "index"), (bp, "token file")):
        if not path.is_file():
            raise _fail(
                prefix, f"{path} is missing (a Megatron dataset is PREFIX.idx + PREFIX.bin; the {what} is not there)"
            )
    for path in (bp, ip):  # both readable, or one line naming the one that is not; the index's header last
        try:
            with open(path, "rb") as f:
                head = f.read(HEAD.size)
        except OSError as e:
            raise cannot_read(path, e) from None
    return head


def _check_header(prefix: str, head: bytes, *, ip: Path, idx_size: int) -> tuple[np.dtype, int, int]:
    """(dtype, sequences, document indices) of an index's header, checked against the index's size."""
    if head[:9] == MAGIC and len(head) < HEAD.size:
        raise _fail(prefix, f"{ip} is truncated: {len(head)} bytes, shorter than its {HEAD.size}-byte header")
    if len(head) < HEAD.size or head[:9] != MAGIC:
        raise _fail(
            prefix,
            f"{ip} is not a Megatron index (its first bytes are {head[:9]!r}, want {MAGIC!r}): "
            f"another format, or truncated",
        )
    _, version, code, n, d = HEAD.unpack(head)
    if version != VERSION:
        raise _fail(
            prefix,
            f"{ip} is index version {version}; dspipe reads version {VERSION} (megatron-core's and GPT-NeoX's MMIDIDX)",
        )
    if code not in CODES:
        raise _fail(prefix, f"{ip} has dtype code {code}, not one of Megatron's {sorted(CODES)}")
    dtype = np.dtype(CODES[code])
    if dtype.name not in TOKEN_DTYPES:
        raise _fail(prefix, f"{ip} stores {dtype.name} values, not token ids (dspipe reads {', '.join(TOKEN_DTYPES)})")
    want = HEAD.size + 12 * n + 8 * d
    if idx_size == want + n and n:
        raise _fail(
            prefix,
            f"{ip} is a multimodal index ({n} sequence modes after the document indices); dspipe trains on text only",
        )
    if idx_size != want:
        raise _fail(
            prefix,
            f"{ip} has {idx_size} bytes; its header ({n} sequences, {d} document indices) "
            f"implies {HEAD.size} + 12 x {n} + 8 x {d} = {want}: truncated or corrupt",
        )
    if d < 1:
        raise _fail(prefix, f"{ip} has no document indices (want documents + 1 >= 1)")
    return dtype, n, d


def _sequence_tokens(
    prefix: str, *, ip: Path, bp: Path, lengths: np.ndarray, pointers: np.ndarray, dtype: np.dtype, deep: bool
) -> int:
    """Tokens the sequences hold, their offsets checked back to back (the first chunk's only unless `deep`)."""
    tokens = 0
    for lo in range(0, lengths.size, CHUNK):
        part = np.asarray(lengths[lo : lo + CHUNK], dtype=np.int64)
        if deep or lo == 0:
            if part.size and part.min() < 0:
                raise _fail(prefix, f"{ip} has a negative sequence length at sequence {lo + int(part.argmin())}")
            expect = (tokens + np.concatenate([[0], np.cumsum(part[:-1])])) * dtype.itemsize
            got = np.asarray(pointers[lo : lo + CHUNK])
            if not np.array_equal(got, expect):
                at = lo + int(np.flatnonzero(got != expect)[0])
                raise _fail(
                    prefix,
                    f"{ip}: sequence {at} starts at byte {int(pointers[at])} of {bp}, not "
                    f"{int(expect[at - lo])} right after the one before: dspipe reads sequences laid "
                    f"out back to back, as Megatron's and GPT-NeoX's writers lay them",
                )
        tokens += int(part.sum())
    return tokens


def _check_documents(prefix: str, doc_index: np.ndarray, *, ip: Path, n: int, deep: bool) -> None:
    """The document indices run from 0 to n, and (deep) never fall."""
    if int(doc_index[0]) != 0 or int(doc_index[-1]) != n:
        raise _fail(
            prefix,
            f"{ip}: document indices run {int(doc_index[0])}..{int(doc_index[-1])}, want 0..{n} "
            f"(the first and the one past the last sequence)",
        )
    if deep:
        for lo in range(0, doc_index.size - 1, CHUNK):
            part = np.asarray(doc_index[lo : lo + CHUNK + 1])
            if np.any(np.diff(part) < 0):
                at = lo + int(np.flatnonzero(np.diff(part) < 0)[0])
                raise _fail(
                    prefix,
                    f"{ip}: document {at + 1} starts at sequence {int(part[at - lo + 1])}, before "
                    f"document {at}'s {int(part[at - lo])}",
                )


def read_index(prefix: str | os.PathLike, *, deep: bool = True) -> Index:
    """PREFIX.idx and PREFIX.bin checked against each other: the header, the file sizes the counts imply, and (deep)
    the offsets laying the sequences back to back and the document indices rising from 0 to n. One SpecError."""
    prefix = str(prefix)
    ip, bp = idx_path(prefix), bin_path(prefix)
    head = _read_head(prefix, ip=ip, bp=bp)
    idx_size, bin_size = ip.stat().st_size, bp.stat().st_size
    dtype, n, d = _check_header(prefix, head, ip=ip, idx_size=idx_size)
    lengths = np.memmap(ip, dtype="<i4", mode="r", offset=HEAD.size, shape=(n,)) if n else np.zeros(0, "<i4")
    pointers = np.memmap(ip, dtype="<i8", mode="r", offset=HEAD.size + 4 * n, shape=(n,)) if n else np.zeros(0, "<i8")
    doc_index = np.memmap(ip, dtype="<i8", mode="r", offset=HEAD.size + 12 * n, shape=(d,))
    tokens = _sequence_tokens(prefix, ip=ip, bp=bp, lengths=lengths, pointers=pointers, dtype=dtype, deep=deep)
    if bin_size != tokens * dtype.itemsize:
        raise _fail(
            prefix,
            f"{bp} has {bin_size} bytes; the index's {n} sequences hold {tokens} {dtype.name} "
            f"tokens = {tokens * dtype.itemsize} bytes: truncated, or of another index",
        )
    _check_documents(prefix, doc_index, ip=ip, n=n, deep=deep)
    return Index(prefix=prefix, dtype=dtype, lengths=lengths, pointers=pointers, doc_index=doc_index, num_tokens=tokens)


def tokens(index: Index) -> np.ndarray:
    """The memory-mapped token ids of the whole .bin."""
    if index.num_tokens == 0:
        return np.zeros(0, index.dtype)
    return np.memmap(bin_path(index.prefix), dtype=index.dtype, mode="r", shape=(index.num_tokens,))


def split_documents(num_documents: int) -> int:
    """The first validation document: the last VAL_FRACTION of the documents, rounded (Megatron rounds each split's
    share of the documents the same way), are the validation split."""
    return num_documents - int(round(VAL_FRACTION * num_documents))


# ---- the scan: largest id, EOD ----------------------------------------------------------------------------------


def _content(index: Index, *, located: bool) -> str:
    """A digest of the two files: sizes and the first and last MiB of each (the whole index up to 64 MiB); located:
    their real paths and modification times too (the scan cache's key: one file version)."""
    h = hashlib.sha256()
    for path in (idx_path(index.prefix), bin_path(index.prefix)):
        st = path.stat()
        h.update(f"{st.st_size}\0".encode())
        if located:
            h.update(f"{os.path.realpath(path)}\0{st.st_mtime_ns}\0".encode())
        whole = path.suffix == ".idx" and st.st_size <= 64 << 20
        with open(path, "rb") as f:
            h.update(f.read() if whole else f.read(1 << 20))
            if not whole:
                f.seek(max(0, st.st_size - (1 << 20)))
                h.update(f.read(1 << 20))
    return h.hexdigest()


def _identity(index: Index) -> str:
    return _content(index, located=True)


def cache_dir() -> Path:
    """dspipe's cache of Megatron scans (XDG_CACHE_HOME, else ~/.cache)/dspipe/megatron; its parent holds dspipe's other
    caches (dspipe.data.megatron_order's indices)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "dspipe" / "megatron"


def _scanned(got: dict) -> bool:
    """Whether a cache entry holds what scan writes: max_id an integer >= -1 (-1: no tokens), min_id an integer <= 0
    (the scan starts from 0), eod None or an id between them."""

    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    hi, lo, eod = got.get("max_id"), got.get("min_id"), got.get("eod")
    if not (whole(hi) and whole(lo) and hi >= -1 and lo <= 0):
        return False
    return eod is None or (whole(eod) and lo <= eod <= hi)


def scan(index: Index) -> dict:
    """{"max_id", "min_id", "eod"}: the largest and smallest token id and the token every document ends with (None
    where documents end differently, or there are none). Cached per file version (_identity); a pass over the
    .bin otherwise."""
    key = _identity(index)
    cache = cache_dir() / f"{key[:32]}.json"
    try:
        got = read_object(cache)
        if got.get("identity") == key and _scanned(got):
            return {k: got[k] for k in ("max_id", "min_id", "eod")}
    except (SpecError, KeyError):
        pass  # a missing or damaged entry: scanned again, and written over
    toks = tokens(index)
    hi, lo = -1, 0
    for s in range(0, toks.size, CHUNK):
        part = toks[s : s + CHUNK]
        hi, lo = max(hi, int(part.max())), min(lo, int(part.min()))
    eod = None
    ends = []
    for s in range(1, index.num_documents + 1, CHUNK):
        docs = np.arange(s, min(s + CHUNK, index.num_documents + 1))
        starts, stops = index.doc_token_starts(docs - 1), index.doc_token_starts(docs)
        stops = stops[stops > starts]  # empty documents end nowhere
        if stops.size:
            last = np.unique(np.asarray(toks[stops - 1]))
            ends = sorted(set(ends) | set(int(x) for x in last[:2]))
            if len(ends) > 1:
                break
    if len(ends) == 1:
        eod = ends[0]
    result = {"max_id": hi, "min_id": lo, "eod": eod}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=".scan-")
        with os.fdopen(fd, "w") as f:
            json.dump({"identity": key, **result}, f)
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only home: scanned again next time
    return result


# ---- the meta a loader reads ------------------------------------------------------------------------------------


def tokenizer_beside(prefix: str) -> Path:
    return Path(prefix).parent / "tokenizer"


def tokenizer_vocab_size(directory: Path) -> int | None:
    """The vocabulary of a Hugging Face tokenizer directory from its tokenizer.json (model vocab + added tokens),
    None where there is no tokenizer.json."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    content = read_object(path)
    model = content.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if not isinstance(vocab, (dict, list)):
        return None
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t.get("id") for t in content.get("added_tokens") or [] if isinstance(t, dict)]
    ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
    return max(ids) + 1 if ids else None


def fingerprint(index: Index) -> str:
    """The dataset's identity in a checkpoint's data position: its content (a moved prefix is the same data)."""
    return _content(index, located=False)[:32]


def read_meta(prefix: str | os.PathLike, *, deep: bool = True, tokenizer: str | os.PathLike | None = None) -> dict:
    """A meta dict of the fields dspipe's loaders and checks read (as a prepared directory's meta.json has them) for a
    Megatron prefix; one SpecError for a bad file. deep: the full index checks and the token scan (gen-config and
    the runner's start); otherwise the header and sizes only."""
    index = read_index(prefix, deep=deep)
    splits = _splits(index)
    tok_dir = Path(tokenizer) if tokenizer is not None else tokenizer_beside(str(prefix))
    tok_vocab = tokenizer_vocab_size(tok_dir) if tok_dir.is_dir() else None
    if tokenizer is not None and tok_vocab is None:
        raise SpecError(
            f"--tokenizer {tokenizer}: no tokenizer.json there (a Hugging Face tokenizer directory "
            f"written by save_pretrained)"
        )
    meta = {
        "format": FORMAT,
        "prefix": str(prefix),
        "dtype": index.dtype.name,
        "fingerprint": fingerprint(index),
        "num_documents": index.num_documents,
        "num_tokens": index.num_tokens,
        "val_fraction": VAL_FRACTION,
        "tokenizer_dir": str(tok_dir) if tok_vocab is not None else None,
        "splits": splits,
    }
    if not deep:
        meta.update(vocab_size=tok_vocab, eos_id=None, max_id=None)
        return meta
    found = scan(index)
    if found["min_id"] < 0:
        raise _fail(prefix, f"{bin_path(prefix)} holds a negative token id ({found['min_id']})")
    limit = np.iinfo(index.dtype).max
    if tok_vocab is not None and tok_vocab - 1 > limit:
        raise _fail(
            prefix,
            f"the index stores {index.dtype.name} token ids (at most {limit:,}) but tokenizer "
            f"{tok_dir} has {tok_vocab:,} tokens: ids above {limit:,} cannot have been stored",
        )
    if tok_vocab is not None and found["max_id"] >= tok_vocab:
        raise _fail(
            prefix,
            f"token id {found['max_id']:,} in {bin_path(prefix)} is outside tokenizer {tok_dir}'s "
            f"{tok_vocab:,} tokens: the data was tokenized with another tokenizer",
        )
    meta.update(
        vocab_size=tok_vocab if tok_vocab is not None else found["max_id"] + 1,
        eos_id=found["eod"],
        max_id=found["max_id"],
    )
    return meta


def _splits(index: Index) -> dict:
    """read_meta's splits: the documents before split_documents' first validation one train, the rest val (one
    'shard' each)."""
    first_val = split_documents(index.num_documents)
    bounds = index.doc_token_starts(np.array([0, first_val, index.num_documents]))
    train_tokens, val_tokens = int(bounds[1] - bounds[0]), int(bounds[2] - bounds[1])
    return {
        "train": {
            "num_tokens": train_tokens,
            "num_documents": first_val,
            "shards": [{"name": "train", "num_tokens": train_tokens, "num_documents": first_val}],
        },
        "val": {
            "num_tokens": val_tokens,
            "num_documents": index.num_documents - first_val,
            "shards": [{"name": "val", "num_tokens": val_tokens, "num_documents": index.num_documents - first_val}],
        },
    }


def open_split(prefix: str, split: str, meta: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(tokens, document offsets)] of one split: a slice of the .bin's memory map (one 'shard')."""
    index = read_index(prefix, deep=False)
    first_val = split_documents(index.num_documents)
    docs = np.arange(0, first_val + 1) if split == "train" else np.arange(first_val, index.num_documents + 1)
    starts = index.doc_token_starts(docs)
    toks = tokens(index)[int(starts[0]) : int(starts[-1])]
    return [(toks, (starts - starts[0]).astype(np.uint64))]


# ---- writing -----------------------------------------------------------------------------------------------------


class MegatronWriter:
    """Writes PREFIX.bin / PREFIX.idx, one sequence per document; `add` takes whole documents back to back and their
    lengths, `close` writes the index (from a side file of lengths: memory does not grow with the corpus)."""

    def __init__(self, prefix: str | os.PathLike, *, dtype: str):
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        if self.dtype.name not in TOKEN_DTYPES:
            raise ValueError(f"{dtype} is not a token dtype")
        self._bin = open(bin_path(self.prefix), "wb")
        self._lengths = open(f"{self.prefix}.lengths.tmp", "w+b")
        self.num_documents = self.num_tokens = 0

    def add(self, toks: np.ndarray, doc_lengths: np.ndarray) -> None:
        toks = np.asarray(toks)
        if toks.size and (toks.min() < 0 or toks.max() > np.iinfo(self.dtype).max):
            raise SpecError(f"token id {int(toks.max())} does not fit {self.dtype.name} ({self.prefix}.bin)")
        lengths = np.asarray(doc_lengths, dtype=np.int64)
        if int(lengths.sum()) != toks.size or (lengths.size and lengths.max() > np.iinfo(np.int32).max):
            raise ValueError("document lengths must sum to the tokens and fit int32")
        self._bin.write(np.ascontiguousarray(toks, dtype=self.dtype).tobytes())
        self._lengths.write(lengths.astype("<i4").tobytes())
        self.num_documents += lengths.size
        self.num_tokens += toks.size

    def close(self) -> None:
        self._bin.close()
        n = self.num_documents
        with open(idx_path(self.prefix), "wb") as out:
            out.write(
                HEAD.pack(MAGIC, VERSION, next(c for c, name in CODES.items() if name == self.dtype.name), n, n + 1)
            )
            self._lengths.seek(0)
            for _ in range(0, n, CHUNK):
                out.write(self._lengths.read(4 * CHUNK))
            self._lengths.seek(0)
            done = 0
            for _ in range(0, n, CHUNK):
                part = np.frombuffer(self._lengths.read(4 * CHUNK), dtype="<i4").astype(np.int64)
                out.write(
                    ((done + np.concatenate([[0], np.cumsum(part[:-1])])) * self.dtype.itemsize).astype("<i8").tobytes()
                )
                done += int(part.sum())
            for lo in range(0, n + 1, CHUNK):
                out.write(np.arange(lo, min(lo + CHUNK, n + 1), dtype="<i8").tobytes())
        self._lengths.close()
        os.unlink(self._lengths.name)

    def abort(self) -> None:
        for f in (self._bin, self._lengths):
            f.close()
        Path(self._lengths.name).unlink(missing_ok=True)
