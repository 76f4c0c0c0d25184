"""Megatron-LM's own sample order over Megatron indexed datasets: `--data-order megatron`.

dspipe's default order (dspipe.data.loader) cuts fixed windows out of each source and permutes them. A team moving a
run from Megatron-LM may want the samples Megatron itself would have fed, in its order, for the same seed. This
module rebuilds them from what megatron-core's GPTDataset and BlendedDataset document (megatron-core 0.16; tested
against them in tests/unit/data/test_megatron_order.py):

- The train split is sequences [0, round(0.969 n)) of the n in the index: Megatron-LM's default --split 969,30,1.
- The run asks for N = steps x global batch samples (Megatron-LM: train_iters x global_batch_size).
- Epochs E: the fewest whose E x T tokens (T: the train split's) hold N x seq_len + 1.
- Document index: the split's sequence numbers repeated E times and shuffled in place (int32) by
  numpy.random.RandomState(seed).shuffle. When E > 1 and the last epoch gives fewer than int(0.8 x one epoch's
  samples) of the N, that last epoch is shuffled on its own, after the others (so a partial epoch does not
  over-sample some documents).
- Samples: the documents concatenated in that order form one stream; sample j is tokens [j x seq_len,
  j x seq_len + seq_len + 1) of it (inputs and labels shifted by one). There are (E x T - 1) // seq_len of them.
- Shuffle index: range(S) (uint32) shuffled by the same RandomState after the document index; with a separate
  final epoch, the samples before it and those of it are shuffled apart. Training sample i is sample shuffle[i].
- A blend (weights w, normalised as float64 w / sum(w)): source j is built as above for ceil(ceil(N w_j) x 1.005)
  samples, with the same seed; training sample i comes from the source j maximising w_j x max(i, 1) - c_j (c_j:
  samples it gave so far; the first such j on ties), its c_j-th sample (build_blending_indices; the rule is
  dspipe.data.blend.MegatronBlendOrder).
- A Megatron list of prefixes without weights: each source is built for one pass (one epoch, no count asked), the
  weights are those passes' sample counts, and the blend holds no more than their sum (a run that needs more is
  refused at gen-config, where Megatron would run out of samples).

Where dspipe differs: the validation split stays dspipe's (the last 3% of documents, dspipe.data.megatron). The
indices of a source are cached under ~/.cache/dspipe/megatron-order (keyed by the data's content, seed, seq_len and
N), as Megatron caches its .npy files.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from dspipe.data.loader import Source
from dspipe.data.megatron import Index, cache_dir, fingerprint, read_index, tokens
from dspipe.errors import SpecError

SPLIT = (969, 30, 1)
"""Megatron-LM's default --split: train, validation, test per mille of the sequences."""
SURPLUS = 0.005
"""megatron-core's mid_level_dataset_surplus: each source of a blend is built this much larger than its share."""
FINAL_EPOCH_THRESHOLD = 0.80
CACHE_VERSION = 2


def train_sequences(num_sequences: int) -> tuple[int, int]:
    """[begin, end) of the train split's sequences under SPLIT, rounded as megatron-core rounds."""
    w = np.array(SPLIT, dtype=np.float64)
    w = (w / np.sum(w)).tolist()
    return 0, int(round(w[0] * float(num_sequences)))


def num_epochs(*, tokens_per_epoch: int, seq_len: int, num_samples: int | None) -> int:
    """The fewest epochs whose tokens hold num_samples x seq_len + 1 (one epoch when no count is asked)."""
    if num_samples is None:
        return 1
    need = num_samples * seq_len + 1
    return max(1, -(-need // tokens_per_epoch))


def samples_in(*, tokens: int, seq_len: int) -> int:
    """Samples of seq_len + 1 tokens (overlapping by one) that `tokens` tokens give."""
    return max(0, (tokens - 1) // seq_len)


def _document_index(seqs: np.ndarray, epochs: int, rs: np.random.RandomState, separate: bool) -> np.ndarray:
    if separate and epochs > 1:
        return np.concatenate([_document_index(seqs, epochs - 1, rs, False), _document_index(seqs, 1, rs, False)])
    out = np.tile(seqs.astype(np.int32), epochs)
    rs.shuffle(out)
    return out


def _shuffle_index(first: int, total: int, rs: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    head = np.arange(first, dtype=dtype)
    rs.shuffle(head)
    if first == total:
        return head
    tail = np.arange(first, total, dtype=dtype)
    rs.shuffle(tail)
    return np.concatenate([head, tail])


def build_indices(
    *, lengths: np.ndarray, begin: int, end: int, seq_len: int, seed: int, num_samples: int | None
) -> dict[str, np.ndarray]:
    """{"documents": the document index, "ends": each slot's token end in the stream, "shuffle": the shuffle index}
    for sequences [begin, end) of an index with these sequence lengths (the rules in the module docstring)."""
    if seq_len < 2:
        raise SpecError(f"--data-order megatron needs seq_len >= 2, got {seq_len}")
    seqs = np.arange(begin, end, dtype=np.int64)
    per_epoch = int(np.asarray(lengths[begin:end], dtype=np.int64).sum())
    epochs = num_epochs(tokens_per_epoch=per_epoch, seq_len=seq_len, num_samples=num_samples)
    separate = False
    before_final = 0
    if epochs > 1:
        before_final = samples_in(tokens=(epochs - 1) * per_epoch, seq_len=seq_len)
        from_final = num_samples - before_final
        separate = from_final < int(FINAL_EPOCH_THRESHOLD * samples_in(tokens=per_epoch, seq_len=seq_len))
    rs = np.random.RandomState(seed)
    documents = _document_index(seqs, epochs, rs, separate)
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64)[documents])
    total = samples_in(tokens=epochs * per_epoch, seq_len=seq_len)
    shuffle = _shuffle_index(before_final if separate else total, total, rs)
    return {
        "documents": documents,
        "ends": ends,
        "shuffle": shuffle,
        "layout": np.array([epochs, int(separate)], dtype=np.int64),
    }


def _cached(key: str, build) -> dict[str, np.ndarray]:
    """The arrays under ~/.cache/dspipe/megatron-order/KEY (memory-mapped), built and written there first if absent.
    One process per machine builds them (an flock on KEY.lock: the ranks of a node wait for the first, which the OS
    releases if it dies); written to a temporary directory and renamed whole. XDG_CACHE_HOME moves the cache, as it
    moves the scan cache of dspipe.data.megatron; where it cannot be written the arrays stay in memory."""
    import fcntl

    root = cache_dir().parent / "megatron-order"
    where = root / key
    names = ("documents", "ends", "shuffle", "layout")

    def complete() -> bool:
        return all((where / f"{n}.npy").is_file() for n in names)

    if not complete():
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock = open(root / f".{key}.lock", "w")
        except OSError:  # no writable cache
            return build()
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not complete():
                arrays, tmp = build(), None
                try:
                    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
                    for n in names:
                        np.save(tmp / f"{n}.npy", arrays[n])
                    shutil.rmtree(where, ignore_errors=True)  # an incomplete one from elsewhere
                    os.rename(tmp, where)
                except OSError:  # a full disk: keep the arrays in memory
                    if tmp is not None:
                        shutil.rmtree(tmp, ignore_errors=True)
                    return arrays
    return {n: np.load(where / f"{n}.npy", mmap_mode="r") for n in names}


class MegatronSamples(Source):
    """Megatron's GPTDataset over one prefix's train split, as a loader source: len() samples, rows(i) = its
    training sample i (the shuffle inside), seq_len + 1 tokens each. Read in order (loader.IdentityOrder)."""

    ordered = True
    order = "megatron"

    def __init__(self, prefix: str, *, seq_len: int, seed: int, num_samples: int | None, meta: dict):
        self.data_dir, self.seq_len, self.split, self.meta = Path(prefix), seq_len, "train", meta
        index: Index = read_index(prefix, deep=False)
        begin, end = train_sequences(index.lengths.size)
        _check_train_tokens(prefix, begin=begin, end=end, lengths=index.lengths, seq_len=seq_len)
        key = hashlib.sha256(
            repr((CACHE_VERSION, fingerprint(index), begin, end, seq_len, seed, num_samples)).encode()
        ).hexdigest()[:32]
        arrays = _cached(
            key,
            lambda: build_indices(
                lengths=index.lengths, begin=begin, end=end, seq_len=seq_len, seed=seed, num_samples=num_samples
            ),
        )
        self._documents, self._ends, self._shuffle = arrays["documents"], arrays["ends"], arrays["shuffle"]
        epochs, apart = (int(x) for x in arrays["layout"])
        self.layout = f"{epochs} epoch{'s' if epochs > 1 else ''}{', the last shuffled apart' if apart else ''}"
        """How the indices were built (a checkpoint's position holds only in the same)."""
        self._lengths = index.lengths
        self._starts = index.pointers  # byte offsets; // itemsize below
        self._itemsize = index.dtype.itemsize
        self._tokens = tokens(index)

    def __len__(self) -> int:
        return int(self._shuffle.size)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.rows([i])[0]

    def rows(self, indices) -> np.ndarray:
        """(len(indices), seq_len + 1) int64: training samples `indices` (each one stream slice)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"samples {idx.min()}..{idx.max()} out of range [0, {len(self)})")
        first = np.asarray(self._shuffle[idx], dtype=np.int64) * self.seq_len
        pos = first[:, None] + np.arange(self.seq_len + 1, dtype=np.int64)
        slot = np.searchsorted(self._ends, pos, side="right")
        doc = np.asarray(self._documents[slot.ravel()], dtype=np.int64).reshape(slot.shape)
        slot_start = np.asarray(self._ends[slot.ravel()], dtype=np.int64).reshape(slot.shape) - np.asarray(
            self._lengths[doc.ravel()], dtype=np.int64
        ).reshape(slot.shape)
        at = np.asarray(self._starts[doc.ravel()], dtype=np.int64).reshape(slot.shape) // self._itemsize
        return np.asarray(self._tokens[(at + pos - slot_start).ravel()], dtype=np.int64).reshape(pos.shape)


def blend_weights(given) -> list[float]:
    """Megatron's normalised blend weights: the weights as written, float64, divided by their sum."""
    w = np.array([float(g) for g in given], dtype=np.float64)
    return (w / np.sum(w)).tolist()


def blend_sizes(weights, num_samples: int) -> list[int]:
    """Samples each source is built for: ceil(ceil(N w_j) x (1 + SURPLUS)) (megatron-core's margin)."""
    return [int(math.ceil(math.ceil(num_samples * w) * (1 + SURPLUS))) for w in weights]


def check_prefixes(spec) -> None:
    """Every source of `spec` (a dspipe.data.blend.BlendSpec) is a Megatron prefix; one SpecError otherwise."""
    from dspipe.data.megatron import is_prefix

    for path in spec.paths:
        if not is_prefix(path):
            raise SpecError(
                f"--data-order megatron reads Megatron indexed datasets (PREFIX.bin + PREFIX.idx); "
                f"{path} is not one: convert it with 'dspipe convert-data {path} --out DIR' and pass "
                f"DIR/text_document, or keep the default --data-order dspipe"
            )


def check_megatron_order(spec, *, num_samples: int | None, seq_len: int) -> list[int | None]:
    """The samples each source of `spec` (a dspipe.data.blend.BlendSpec) is built for in Megatron's order (None: one
    pass, for a list of prefixes without weights), after checking that every source is a Megatron prefix and, for
    such a list, that one pass of them all holds the run; one SpecError otherwise."""
    check_prefixes(spec)
    if num_samples is None or num_samples < 1:
        raise SpecError(f"--data-order megatron needs the run's sample count (steps x global batch), got {num_samples}")
    if not spec.is_blend:
        return [num_samples]
    if spec.sized:  # Megatron: each source one pass, weighed by its samples, the blend no longer than them all
        one_pass = [one_pass_samples(path, seq_len=seq_len) for path in spec.paths]
        if sum(one_pass) < num_samples:
            raise SpecError(
                f"Megatron reads a list of prefixes without weights once: {' + '.join(map(str, one_pass))}"
                f" = {sum(one_pass)} samples of {seq_len + 1} tokens, the run needs {num_samples} (steps "
                f"x global batch); give the prefixes weights, or train fewer steps"
            )
        return [None] * len(spec.paths)
    return blend_sizes(blend_weights(s.given for s in spec.sources), num_samples)


def one_pass_samples(path: str, *, seq_len: int) -> int:
    """Samples of one pass over a prefix's train split (Megatron's split)."""
    index = read_index(path, deep=False)
    begin, end = train_sequences(index.lengths.size)
    return samples_in(tokens=int(np.asarray(index.lengths[begin:end], dtype=np.int64).sum()), seq_len=seq_len)


def check_for_run(spec, *, seq_len: int, num_samples: int) -> None:
    """gen-config's check of --data-order megatron: every source of `spec` (a dspipe.data.blend.BlendSpec) a
    Megatron prefix whose train split (Megatron's --split) holds one sample of seq_len + 1 tokens. The indices
    themselves are built when the run starts."""
    check_prefixes(spec)
    for path in spec.paths:
        index = read_index(path, deep=False)
        begin, end = train_sequences(index.lengths.size)
        _check_train_tokens(path, begin=begin, end=end, lengths=index.lengths, seq_len=seq_len)
    check_megatron_order(spec, num_samples=num_samples, seq_len=seq_len)


def _check_train_tokens(path, *, begin: int, end: int, lengths, seq_len: int) -> int:
    per_epoch = int(np.asarray(lengths[begin:end], dtype=np.int64).sum())
    if samples_in(tokens=per_epoch, seq_len=seq_len) < 1:
        raise SpecError(
            f"the train split of {path} under Megatron's --split {','.join(map(str, SPLIT))} "
            f"(sequences {begin}..{end - 1}, {per_epoch} tokens) is shorter than one sample of "
            f"{seq_len + 1} tokens"
        )
    return per_epoch
