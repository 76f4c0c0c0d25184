"""The loader: fixed windows over the memory-mapped shards, a seeded global order, per-rank micro-batches.

Global sample k of a run (k = 0, 1, 2, ...) is window P_e(k mod n) with epoch e = k div n and P_e a seeded
permutation of the n windows, computed on the fly (no index array in RAM, O(1) to seek). A micro-batch consumes
dp x micro_batch global samples; data-parallel rank r reads the r-th slice of micro_batch of them. So the global
order does not depend on dp, and the position is one number, consumed_samples, saved in the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dspipe.data.shards import open_split, read_meta
from dspipe.errors import SpecError


class Source:
    """What loaders and checkpoints read of a source's meta (meta.json, or a Megatron prefix's equivalent)."""

    meta: dict

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def eos_id(self) -> int:
        return self.meta["eos_id"]

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]


class TokenWindows(Source):
    """Windows of seq_len + 1 tokens over one split (stride seq_len: a window's last token is the next one's first),
    random access straight from the memory map. Windows do not cross shard boundaries."""

    def __init__(self, data_dir: str | Path, *, seq_len: int, split: str = "train"):
        if seq_len < 1:
            raise SpecError(f"seq_len must be positive, got {seq_len}")
        self.data_dir, self.seq_len, self.split = Path(data_dir), seq_len, split
        self.meta = read_meta(data_dir, deep=False)
        self.shards = [tokens for tokens, _ in open_split(data_dir, split, self.meta)]
        counts = np.array([max(0, (t.size - 1) // seq_len) for t in self.shards], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        if self._starts[-1] == 0:
            n = self.meta["splits"][split]["num_tokens"]
            if n == 0:
                raise SpecError(
                    f"the {split} split of {data_dir} is empty (prepared with --val-fraction "
                    f"{self.meta['val_fraction']} from {self.meta['num_documents']} documents)"
                )
            raise SpecError(
                f"the {split} split of {data_dir} ({n} tokens) is shorter than one sequence of {seq_len + 1} tokens"
            )

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range [0, {len(self)})")
        shard = int(np.searchsorted(self._starts, i, side="right")) - 1
        start = (i - int(self._starts[shard])) * self.seq_len
        return np.asarray(self.shards[shard][start : start + self.seq_len + 1], dtype=np.int64)

    def rows(self, indices) -> np.ndarray:
        """(len(indices), seq_len + 1) int64: the windows, gathered out of the memory map (one read per shard)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"windows {idx.min()}..{idx.max()} out of range [0, {len(self)})")
        shard_of = np.searchsorted(self._starts, idx, side="right") - 1
        out = np.empty((idx.size, self.seq_len + 1), dtype=np.int64)
        span = np.arange(self.seq_len + 1)
        for shard in np.unique(shard_of):
            sel = shard_of == shard
            starts = (idx[sel] - self._starts[shard]) * self.seq_len
            out[sel] = self.shards[shard][starts[:, None] + span]
        return out


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a strong 64-bit hash (uint64 arithmetic wraps)."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


class Permutation:
    """A seeded pseudo-random permutation of range(n), evaluated at any positions in O(1) memory: a 6-round
    Feistel network on the smallest even-bit domain >= n, with cycle-walking back into range(n)."""

    ROUNDS = 6

    def __init__(self, n: int, *, seed: int, epoch: int):
        if n < 1:
            raise ValueError(f"cannot permute {n} items")
        self.n, self.epoch = n, epoch
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        seed %= 2**64
        rng = np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32, epoch])
        self.keys = rng.integers(0, 2**63, size=self.ROUNDS, dtype=np.uint64)

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        shift, mask = np.uint64(self.half), np.uint64((1 << self.half) - 1)
        left, right = x >> shift, x & mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << shift) | right

    def __call__(self, positions) -> np.ndarray:
        x = self._round_trip(np.asarray(positions, dtype=np.uint64).reshape(-1))
        outside = x >= self.n
        while outside.any():  # the domain is < 4n, so this ends after a few rounds on average
            x[outside] = self._round_trip(x[outside])
            outside = x >= self.n
        return x.astype(np.int64)


class SampleOrder:
    """Global sample index -> window index: a fresh seeded permutation of all windows every epoch. Positions are
    computed a block at a time (a loader reads forward), so a micro-batch costs a slice, not a Feistel pass."""

    BLOCK = 4096

    def __init__(self, *, num_samples: int, seed: int):
        self.num_samples, self.seed = num_samples, seed
        self._perm: Permutation | None = None
        self._blocks: dict[int, np.ndarray] = {}

    def windows(self, start: int, count: int) -> np.ndarray:
        first, last = start // self.BLOCK, (start + count - 1) // self.BLOCK
        blocks = np.concatenate([self._block(b) for b in range(first, last + 1)])
        offset = start - first * self.BLOCK
        return blocks[offset : offset + count].copy()

    def _block(self, b: int) -> np.ndarray:
        if b not in self._blocks:
            ks = np.arange(b * self.BLOCK, (b + 1) * self.BLOCK, dtype=np.int64)
            epochs, pos = np.divmod(ks, self.num_samples)
            out = np.empty(ks.size, dtype=np.int64)
            for e in np.unique(epochs):
                sel = epochs == e
                out[sel] = self.permutation(int(e))(pos[sel])
            if len(self._blocks) >= 4:
                self._blocks.pop(next(iter(self._blocks)))
            self._blocks[b] = out
        return self._blocks[b]

    def permutation(self, epoch: int) -> Permutation:
        if self._perm is None or self._perm.epoch != epoch:
            self._perm = Permutation(self.num_samples, seed=self.seed, epoch=epoch)
        return self._perm


class IdentityOrder:
    """Global sample index -> the same index (mod n): for sources that shuffle inside themselves
    (dspipe.data.megatron_order.MegatronSamples)."""

    def __init__(self, *, num_samples: int):
        self.num_samples = num_samples

    def windows(self, start: int, count: int) -> np.ndarray:
        return np.arange(start, start + count, dtype=np.int64) % self.num_samples


def check_same_order(state: dict, order: str) -> None:
    """A checkpoint's data position continues only in the sample order it was saved in (absent: dspipe's)."""
    saved = state.get("order", "dspipe")
    if saved != order:
        raise SpecError(
            f"the checkpoint's data position is in {saved}'s sample order, this run reads in {order}'s "
            f"(--data-order): resume with the order it was saved with"
        )


def order_of(windows, *, seed: int):
    """The order a loader reads `windows` in: as given when the source orders itself (Megatron's order), else a
    fresh seeded permutation every epoch (SampleOrder)."""
    if getattr(windows, "ordered", False):
        return IdentityOrder(num_samples=len(windows))
    return SampleOrder(num_samples=len(windows), seed=seed)


class BatchOrder:
    """Which windows a rank reads at (step, micro-batch): global samples step*global_batch + micro*dp*mb +
    rank*mb + [0, mb). Kept for callers that think in steps; TrainLoader uses the same mapping."""

    def __init__(self, *, num_samples: int, seed: int, dp: int, micro_batch: int, grad_accum: int):
        self.order = SampleOrder(num_samples=num_samples, seed=seed)
        self.num_samples, self.seed = num_samples, seed
        self.dp, self.micro_batch, self.grad_accum = dp, micro_batch, grad_accum

    def indices(self, *, step: int, micro: int, dp_rank: int) -> np.ndarray:
        first = (step * self.grad_accum + micro) * self.dp * self.micro_batch + dp_rank * self.micro_batch
        return self.order.windows(first, self.micro_batch)


def _to_torch(rows: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(rows[:, :-1])), torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))


class TrainLoader:
    """Endless (inputs, labels) int64 micro-batches for one data-parallel rank, in the dp-invariant global order.

    state_dict() is its whole position (consumed samples, epoch, seed, and what it reads); load_state_dict()
    continues with exactly the next micro-batch, under any dp size whose global batch divides the position."""

    def __init__(
        self, *, windows: TokenWindows, seed: int, micro_batch: int, dp: int, dp_rank: int, consumed_samples: int = 0
    ):
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp})")
        self.windows, self.seed = windows, seed
        self.micro_batch, self.dp, self.dp_rank = micro_batch, dp, dp_rank
        self.order = order_of(windows, seed=seed)
        self.consumed_samples = consumed_samples

    @property
    def epoch(self) -> int:
        return self.consumed_samples // len(self.windows)

    def __iter__(self):
        return self

    def next_indices(self) -> np.ndarray:
        """The window indices of this rank's next micro-batch; advances the position by dp x micro_batch."""
        first = self.consumed_samples + self.dp_rank * self.micro_batch
        idx = self.order.windows(first, self.micro_batch)
        self.consumed_samples += self.dp * self.micro_batch
        return idx

    def __next__(self):
        return _to_torch(self.windows.rows(self.next_indices()))

    def skip(self, micro_batches: int) -> None:
        """Advance without reading (pipeline stages that take no data keep the same position as the others)."""
        self.consumed_samples += micro_batches * self.dp * self.micro_batch

    def state_dict(self) -> dict:
        return {
            "consumed_samples": self.consumed_samples,
            "epoch": self.epoch,
            "seed": self.seed,
            "num_samples": len(self.windows),
            "seq_len": self.windows.seq_len,
            "split": self.windows.split,
            "fingerprint": self.windows.fingerprint,
            "order": getattr(self.windows, "order", "dspipe"),
            "layout": getattr(self.windows, "layout", None),
        }

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        if "sources" in state:  # saved by a dspipe.data.blend.BlendLoader
            saved = ",".join(f"{s.get('path')}:{s.get('weight')}" for s in state["sources"])
            raise SpecError(
                f"the checkpoint's data position is of a blend of {len(state['sources'])} sources "
                f"({saved}), this run reads one data directory ({self.windows.data_dir}): the data "
                f"changed; resume with the --data it was saved with"
            )
        check_same_order(state, mine["order"])
        if mine["order"] == "megatron" and (state.get("num_samples"), state.get("layout")) != (
            mine["num_samples"],
            mine["layout"],
        ):
            raise SpecError(
                f"the checkpoint's data position is in Megatron's order built for another run length "
                f"({state.get('num_samples')} samples in {state.get('layout')} of "
                f"{self.windows.data_dir} then, {mine['num_samples']} in {mine['layout']} now: the order "
                f"depends on steps x global batch, as Megatron's does); resume with the steps and batch "
                f"it was saved with"
            )
        for key in ("seed", "split", "seq_len", "fingerprint", "num_samples"):
            if state.get(key) != mine[key]:
                raise SpecError(
                    f"the checkpoint's data position does not fit this data: {key} "
                    f"{state.get(key)!r} in the checkpoint, {mine[key]!r} now ({self.windows.data_dir})"
                )
        if state["consumed_samples"] % (self.dp * self.micro_batch):
            raise SpecError(
                f"the checkpoint consumed {state['consumed_samples']} samples, not a multiple of "
                f"dp {self.dp} x micro_batch {self.micro_batch}: cannot continue the global order"
            )
        self.consumed_samples = int(state["consumed_samples"])


def micro_batches(*, windows: TokenWindows, order: BatchOrder, dp_rank: int, start_step: int = 0) -> TrainLoader:
    """A TrainLoader positioned at start_step of `order` (same seed, dp and micro-batch)."""
    return TrainLoader(
        windows=windows,
        seed=order.seed,
        micro_batch=order.micro_batch,
        dp=order.dp,
        dp_rank=dp_rank,
        consumed_samples=start_step * order.grad_accum * order.dp * order.micro_batch,
    )


def val_batches(*, windows: TokenWindows, micro_batch: int, dp: int, dp_rank: int, max_batches: int | None = None):
    """One pass over the validation windows in order: batch b gives rank r windows b*dp*mb + r*mb + [0, mb).
    Every rank yields the same number of batches (a last incomplete global batch is dropped)."""
    total = len(windows) // (dp * micro_batch)
    if total == 0:
        raise SpecError(
            f"the {windows.split} split has {len(windows)} windows of {windows.seq_len + 1} tokens, "
            f"fewer than one batch of dp {dp} x micro_batch {micro_batch}"
        )
    if max_batches is not None:
        total = min(total, max_batches)
    for b in range(total):
        first = b * dp * micro_batch + dp_rank * micro_batch
        yield _to_torch(windows.rows(range(first, first + micro_batch)))
