"""Blending prepared datasets: `--data a:0.7,b:0.3` -> a deterministic, dp-invariant global sample order over them.

    parse(text)       the --data value -> BlendSpec (sources with exact normalised shares); one-line SpecErrors
    open_sources()    every source checked against the model and against each other (one tokenizer), memory-mapped
    BlendOrder        global sample i -> (source j, k-th draw of j): the greedy rule below, a pure function of the
                      normalised weights, cheap to continue from any (position, counts)
    BlendLoader       TrainLoader's interface over a blend: rank r reads its slice of every global micro-batch; the
                      k-th draw of source j is window P_j,e(k mod n_j) of that source's own seeded per-epoch order
                      (SampleOrder), so a small source repeats with a new permutation every epoch

The rule. Sample i goes to the source furthest behind its share (Megatron's build_blending_indices), in Tijdeman's
form (the chairman assignment problem): at n = i + 1 the candidates are the sources j with w_j n - c_j >= 1/(2K - 2)
(K sources, c_j drawn so far), and of those the one whose draw is due first, min (c_j + 1 - 1/(2K - 2)) / w_j (ties:
the earlier source). Every prefix then holds |c_j(n) - w_j n| <= 1 - 1/(2K - 2) < 1 for every source; Megatron's
max-error rule reaches 1.75 for skewed weights of three or more sources (for K = 2 the two agree up to ties). The
arithmetic is exact (weights are decimal fractions, compared as integers), so equal blends written differently
(a:70,b:30 and a:0.7,b:0.3) give the same order on every machine.

A single path without a weight is not a blend: the runner reads it with TrainLoader exactly as before.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from fractions import Fraction
from functools import reduce
from pathlib import Path

import numpy as np

from dspipe.errors import SpecError

MAX_SOURCES = 256
MAX_WEIGHT_CHARS = 32
_WEIGHT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\Z", re.ASCII)
_NON_FINITE = re.compile(r"[+-]?(nan|inf|infinity)\Z", re.I)
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")
EXAMPLE = "a blend is PATH:WEIGHT,PATH:WEIGHT, e.g. a:0.7,b:0.3"


@dataclass(frozen=True)
class BlendSource:
    path: str
    share: Fraction
    """The normalised weight, exact (shares sum to 1)."""
    given: str = ""
    """The weight as written ('' when none was given)."""

    @property
    def weight(self) -> float:
        return float(self.share)


@dataclass(frozen=True)
class BlendSpec:
    sources: tuple[BlendSource, ...]
    text: str
    """The --data value, normalised (spaces around items dropped; a single path exactly as given; a Megatron list
    of prefixes alone as its prefixes, space-separated)."""
    sized: bool = False
    """Weighed by size: a Megatron list of prefixes without weights (Megatron's order reads such a blend once)."""

    @property
    def is_blend(self) -> bool:
        """Two or more sources (one weighted source reads exactly like its path alone)."""
        return len(self.sources) > 1

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(s.path for s in self.sources)

    @property
    def shares(self) -> tuple[Fraction, ...]:
        return tuple(s.share for s in self.sources)

    @property
    def names(self) -> tuple[str, ...]:
        """One short, distinct name per source for columns and tags (the directory's base name: val_loss_NAME)."""
        return source_names(self.paths)

    def describe(self) -> str:
        """`blend: a 70.0%, b 30.0%` (weights normalised to sum to 100%)."""
        return "blend: " + ", ".join(f"{s.path} {100 * s.weight:.1f}%" for s in self.sources)


def source_names(paths) -> tuple[str, ...]:
    names: list[str] = []
    for path in paths:
        base = _NAME_CHARS.sub("_", os.path.basename(os.path.normpath(path))).strip("_.") or "data"
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}_{n}"
        names.append(name)
    return tuple(names)


def _is_single_path(text: str) -> bool:
    from dspipe.data.megatron import is_prefix

    if os.path.isdir(text) or is_prefix(text):
        return True
    return "," not in text and ":" not in text and len(text.split()) < 2


def _megatron_list(text: str) -> tuple[str, bool]:
    """Megatron's blend syntax (--data-path "0.3 PREFIX_A 0.7 PREFIX_B", or prefixes alone) as dspipe's
    PATH:WEIGHT,... text, and whether the weights are sizes. Megatron reads an even-length list whose every other
    item is a number as weights and prefixes, anything else as prefixes alone, and weighs prefixes alone by their
    sizes: here their train tokens (in Megatron's order, dspipe.data.megatron_order, its samples of one pass)."""
    items = text.split()
    weights = items[0::2]
    if len(items) % 2 == 0 and all(_WEIGHT.match(w) or _NON_FINITE.match(w) for w in weights):
        return ",".join(f"{p}:{w}" for w, p in zip(weights, items[1::2], strict=False)), False
    if len(items) % 2 == 0 and any(_WEIGHT.match(w) for w in weights):
        raise SpecError(
            f"--data {text[:80]!r}: Megatron's blend is WEIGHT PREFIX WEIGHT PREFIX ... (or prefixes "
            f"alone); {weights[[bool(_WEIGHT.match(w)) for w in weights].index(False)]!r} stands where "
            f"a weight goes"
        )
    from dspipe.data.shards import is_prepared, read_meta

    sizes = []
    for path in items:
        if not is_prepared(path):
            raise SpecError(
                f"--data source {path}: not a Megatron dataset or prepared directory (a blend of "
                f"prefixes without weights weighs each by its size, as Megatron does)"
            )
        sizes.append(read_meta(path, deep=False)["splits"]["train"]["num_tokens"])
        if sizes[-1] == 0:
            raise SpecError(f"--data source {path}: its train split is empty, so its size-proportional weight is 0")
    return ",".join(f"{p}:{n}" for p, n in zip(items, sizes, strict=False)), True


def _weight(path: str, text: str) -> Fraction:
    if len(text) > MAX_WEIGHT_CHARS:
        raise SpecError(
            f"--data source {path}: weight {text[:MAX_WEIGHT_CHARS]}... is longer than {MAX_WEIGHT_CHARS} characters"
        )
    if _NON_FINITE.match(text):
        raise SpecError(f"--data source {path}: weight {text} is not finite")
    if not _WEIGHT.match(text):
        raise SpecError(f"--data source {path}: weight {text!r} is not a number")
    approx, mantissa = float(text), re.split("[eE]", text)[0]
    if approx < 0 or text.startswith("-") or not any(c in "123456789" for c in mantissa):
        raise SpecError(f"--data source {path}: weight {text} must be positive")
    if not math.isfinite(approx) or approx == 0:  # before the exact value: 1e999999999 is a huge integer
        raise SpecError(f"--data source {path}: weight {text} is out of range (want a finite positive number)")
    return Fraction(text)


def parse(text: str) -> BlendSpec:
    """The --data value -> BlendSpec. A single directory (no ',' or ':', or an existing directory) is one source
    with share 1 and its text kept as given; else comma-separated PATH:WEIGHT items, every one weighted, weights
    positive finite decimals normalised to sum to 1. Anything else is one SpecError naming the source."""
    if not isinstance(text, str) or not text.strip():
        raise SpecError(f"--data is empty: give a prepared data directory ({EXAMPLE})")
    control = next((c for c in text if c in "\n\r\0"), None)
    if control is not None:  # dspipe.json keeps the value on one line, and every reader of the run needs that
        raise SpecError(f"--data {text!r} holds the control character {control!r}: give a one-line path")
    if _is_single_path(text):
        return BlendSpec(sources=(BlendSource(path=text, share=Fraction(1)),), text=text)
    megatron_text = None
    if "," not in text and ":" not in text:
        text, sized = _megatron_list(text)
        megatron_text = " ".join(p for p, _ in (item.rsplit(":", 1) for item in text.split(","))) if sized else None
    items = text.split(",")
    if len(items) > MAX_SOURCES:
        raise SpecError(f"--data names {len(items)} sources, at most {MAX_SOURCES}")
    parsed: list[tuple[str, str, Fraction | None]] = []
    for i, item in enumerate(items, 1):
        item = item.strip()
        if not item:
            raise SpecError(f"--data source {i} is empty ({EXAMPLE})")
        path, sep, given = item.rpartition(":") if ":" in item else (item, "", "")
        path, given = path.strip(), given.strip()
        if not path:
            raise SpecError(f"--data source {i} has an empty path before its weight :{given} ({EXAMPLE})")
        if sep and not given:
            raise SpecError(f"--data source {path}: empty weight after ':' ({EXAMPLE})")
        parsed.append((path, given, _weight(path, given) if given else None))
    seen: dict[str, str] = {}
    for path, _, _ in parsed:
        key = os.path.normpath(path)
        if key in seen:
            also = "" if seen[key] == path else f" (as {seen[key]} and {path})"
            raise SpecError(f"--data source {seen[key]} is given twice{also}")
        seen[key] = path
    weighted = [p for p, _, w in parsed if w is not None]
    if len(weighted) != len(parsed):
        missing = next(p for p, _, w in parsed if w is None)
        if weighted:
            raise SpecError(
                f"--data source {missing} has no weight while {weighted[0]} has one: give every source "
                f"a weight ({EXAMPLE})"
            )
        equal = ",".join(f"{p}:1" for p, _, _ in parsed[:3]) + (",..." if len(parsed) > 3 else "")
        raise SpecError(
            f"--data names {len(parsed)} sources without weights: give each one a weight, e.g. {equal} for equal shares"
        )
    total = sum(w for _, _, w in parsed)
    sources = tuple(BlendSource(path=p, share=w / total, given=g) for p, g, w in parsed)
    if megatron_text is not None:
        return BlendSpec(sources=sources, text=megatron_text, sized=True)
    return BlendSpec(sources=sources, text=",".join(f"{p}:{g}" for p, g, _ in parsed))


def normalise(text: str) -> str:
    """The --data value as a run directory stores it: a single path as given; one weighted source as its path
    alone (it reads exactly like that); a blend with the spaces around its items dropped."""
    spec = parse(text)
    return spec.sources[0].path if not spec.is_blend else spec.text


# ---- the order --------------------------------------------------------------------------------------------------


class BlendOrder:
    """Global sample index -> (source, draw index within the source) under the rule in the module docstring.

    The rule is sequential (sample i depends on the counts before it), so the order is produced forward from a
    known state (position, counts per source): position 0, a state set from a checkpoint (`anchor`), or one kept
    every ANCHOR_STRIDE samples on the way. Reads move forward a chunk at a time (CHUNK samples per Python pass)."""

    CHUNK = 4096
    ANCHOR_STRIDE = 1 << 16

    def __init__(self, shares):
        shares = [Fraction(s) for s in shares]
        if not shares or any(s <= 0 for s in shares) or sum(shares) != 1:
            raise ValueError(f"shares must be positive and sum to 1, got {shares}")
        self.k = len(shares)
        q = reduce(math.lcm, (s.denominator for s in shares), 1)
        self.q, self.p = q, [int(s * q) for s in shares]
        self._anchors: dict[int, tuple[int, ...]] = {0: (0,) * self.k}
        self._chunk: tuple[int, tuple[int, ...], np.ndarray, np.ndarray] | None = None  # start, counts, src, draw

    def anchor(self, position: int, counts) -> None:
        """A known state: `counts[j]` samples of source j among the first `position` (from a checkpoint)."""
        counts = tuple(int(c) for c in counts)
        if len(counts) != self.k or sum(counts) != position or min(counts) < 0:
            raise ValueError(f"counts {counts} do not describe {position} samples of {self.k} sources")
        self._anchors[position] = counts

    def _simulate(self, start: int, counts: list[int], n: int, record: bool):
        """Draw samples start .. start + n - 1 from `counts` (updated in place); their sources if `record`."""
        k, p, q = self.k, self.p, self.q
        out = [] if record else None
        if k == 1:
            counts[0] += n
            return [0] * n if record else None
        d, stride = 2 * k - 2, self.ANCHOR_STRIDE
        # candidate: d (p_j t - c_j q) >= q; due first: min (d (c_j + 1) - 1) / p_j, compared by cross-multiplying
        for t in range(start + 1, start + n + 1):
            best, best_due = -1, 0
            for j in range(k):
                c = counts[j]
                if d * (p[j] * t - c * q) >= q:
                    due = d * (c + 1) - 1
                    if best < 0 or due * p[best] < best_due * p[j]:
                        best, best_due = j, due
            counts[best] += 1
            if record:
                out.append(best)
            if t % stride == 0:
                self._anchors[t] = tuple(counts)
        return out

    def _from(self, position: int) -> list[int]:
        """The counts before `position`, produced forward from the nearest known state at or before it."""
        chunk = self._chunk
        end = chunk[0] + chunk[2].size if chunk is not None else -1
        if chunk is not None and chunk[0] <= position <= end:
            return [
                c + int(n)
                for c, n in zip(chunk[1], np.bincount(chunk[2][: position - chunk[0]], minlength=self.k), strict=False)
            ]
        at = max(a for a in self._anchors if a <= position)
        counts = list(self._anchors[at])
        if at < end <= position:  # the cached chunk's end is nearer
            at, counts = (
                end,
                [c + int(n) for c, n in zip(chunk[1], np.bincount(chunk[2], minlength=self.k), strict=False)],
            )
        self._simulate(at, counts, position - at, record=False)
        return counts

    def counts_at(self, position: int) -> tuple[int, ...]:
        """Samples of each source among the first `position`."""
        return tuple(self._from(position))

    def assign(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw) of global samples start .. start + count - 1: sample start + i is the draw[i]-th sample
        (0-based) taken from source src[i]."""
        chunk = self._chunk
        if chunk is None or not (chunk[0] <= start and start + count <= chunk[0] + chunk[2].size):
            counts = self._from(start)
            before = tuple(counts)
            n = max(count, self.CHUNK)
            src = np.asarray(self._simulate(start, counts, n, record=True), dtype=np.int64)
            draw = np.empty(n, dtype=np.int64)
            for j in range(self.k):
                sel = src == j
                draw[sel] = before[j] + np.arange(int(sel.sum()), dtype=np.int64)
            self._chunk = chunk = (start, before, src, draw)
        offset = start - chunk[0]
        return chunk[2][offset : offset + count].copy(), chunk[3][offset : offset + count].copy()


class MegatronBlendOrder(BlendOrder):
    """BlendOrder drawing by Megatron's max-error rule (build_blending_indices) in float64: sample i goes to the
    first source j maximising w_j x max(i, 1) - c_j. Same interface: assign, counts_at, anchor."""

    def __init__(self, weights):
        self.k, self.weights = len(weights), [float(x) for x in weights]
        self._anchors = {0: (0,) * self.k}
        self._chunk = None

    def _simulate(self, start: int, counts: list[int], n: int, record: bool):
        out = [] if record else None
        w, k, stride = self.weights, self.k, self.ANCHOR_STRIDE
        for i in range(start, start + n):
            x = float(max(i, 1))
            best, best_err = 0, w[0] * x - float(counts[0])
            for j in range(1, k):
                err = w[j] * x - float(counts[j])
                if err > best_err:
                    best, best_err = j, err
            counts[best] += 1
            if record:
                out.append(best)
            if (i + 1) % stride == 0:
                self._anchors[i + 1] = tuple(counts)
        return out


def source_seed(seed: int, j: int) -> int:
    """The seed of source j's own per-epoch order: the run's seed for the first source, far apart for the others."""
    return (seed + j * 0x9E3779B97F4A7C15) % 2**64


# ---- the sources, checked and opened ----------------------------------------------------------------------------


def open_sources(
    spec: BlendSpec,
    *,
    model_vocab: int,
    seq_len: int,
    split: str = "train",
    order: str = "dspipe",
    seed: int = 0,
    num_samples: int | None = None,
) -> list:
    """The loader sources of `spec` (memory maps checked against meta.json), after checking each one against the
    model (vocab, one sequence of data) and against the others (one tokenizer): TokenWindows, or for the train split
    in Megatron's order (order "megatron": Megatron prefixes only; num_samples = the run's steps x global batch)
    dspipe.data.megatron_order.MegatronSamples, each built for its share of num_samples as Megatron builds it."""
    from dspipe.data.checks import check_blend_sources, check_data_for_model
    from dspipe.data.loader import TokenWindows

    megatron = order == "megatron" and split == "train"
    if megatron:
        from dspipe.data.megatron_order import check_megatron_order

        sizes = check_megatron_order(spec, num_samples=num_samples, seq_len=seq_len)
    if spec.is_blend:
        check_blend_sources(spec.paths)
    out = []
    for j, path in enumerate(spec.paths):
        try:
            check_data_for_model(path, model_vocab=model_vocab, seq_len=seq_len)
            if megatron:
                from dspipe.data.megatron_order import MegatronSamples
                from dspipe.data.shards import read_meta

                out.append(
                    MegatronSamples(
                        path, seq_len=seq_len, seed=seed, num_samples=sizes[j], meta=read_meta(path, deep=False)
                    )
                )
            else:
                out.append(TokenWindows(path, seq_len=seq_len, split=split))
        except SpecError as e:
            if not spec.is_blend:
                raise
            raise SpecError(f"blend source {path}: {e}") from None
    return out


def make_loader(spec: BlendSpec, windows: list, *, seed: int, micro_batch: int, dp: int, dp_rank: int):
    """The train loader of `spec`: TrainLoader for one source (the order and state of a single data directory),
    BlendLoader for a blend (Megatron's blending rule when the sources are in Megatron's order)."""
    from dspipe.data.loader import TrainLoader

    if not spec.is_blend:
        return TrainLoader(windows=windows[0], seed=seed, micro_batch=micro_batch, dp=dp, dp_rank=dp_rank)
    blend_order = None
    if getattr(windows[0], "ordered", False):
        from dspipe.data.megatron_order import blend_weights

        weights = [len(w) for w in windows] if spec.sized else [s.given for s in spec.sources]
        blend_order = MegatronBlendOrder(blend_weights(weights))
    return BlendLoader(
        windows=windows,
        shares=spec.shares,
        seed=seed,
        micro_batch=micro_batch,
        dp=dp,
        dp_rank=dp_rank,
        blend_order=blend_order,
    )


# ---- the loader ---------------------------------------------------------------------------------------------------


class BlendLoader:
    """Endless (inputs, labels) int64 micro-batches of one data-parallel rank over a blend, TrainLoader's interface.

    Global sample g (the same sequence at any dp and micro-batch) is the draw[g]-th sample of source src[g]
    (BlendOrder), i.e. window P_e(k mod n) of that source's own SampleOrder. state_dict() holds the position and, per
    source, its fingerprint, size, weight and samples drawn; load_state_dict() refuses a changed blend in one line
    and continues with exactly the next micro-batch (under any dp size whose global batch divides the position)."""

    def __init__(
        self,
        *,
        windows: list,
        shares,
        seed: int,
        micro_batch: int,
        dp: int,
        dp_rank: int,
        consumed_samples: int = 0,
        blend_order: BlendOrder | None = None,
    ):
        from dspipe.data.loader import order_of

        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp})")
        if len(windows) != len(shares) or len(windows) < 2:
            raise ValueError(
                f"a blend needs two or more sources with one share each, got {len(windows)} "
                f"sources and {len(shares)} shares"
            )
        self.sources, self.shares, self.seed = list(windows), tuple(Fraction(s) for s in shares), seed
        self.micro_batch, self.dp, self.dp_rank = micro_batch, dp, dp_rank
        self.blend = blend_order if blend_order is not None else BlendOrder(self.shares)
        self.orders = [order_of(w, seed=source_seed(seed, j)) for j, w in enumerate(windows)]
        self.order = getattr(windows[0], "order", "dspipe")
        self.consumed_samples = consumed_samples

    def __iter__(self):
        return self

    def indices(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, window within that source) of global samples start .. start + count - 1."""
        src, draw = self.blend.assign(start, count)
        win = np.empty(count, dtype=np.int64)
        for j in np.unique(src):
            sel = src == j
            k = draw[sel]  # consecutive draws of source j: one slice of its order
            win[sel] = self.orders[j].windows(int(k[0]), k.size)
        return src, win

    def next_indices(self) -> tuple[np.ndarray, np.ndarray]:
        """(source, window) of this rank's next micro-batch; advances the position by dp x micro_batch."""
        out = self.indices(self.consumed_samples + self.dp_rank * self.micro_batch, self.micro_batch)
        self.consumed_samples += self.dp * self.micro_batch
        return out

    def rows(self, src: np.ndarray, win: np.ndarray) -> np.ndarray:
        first = self.sources[0]
        out = np.empty((src.size, first.seq_len + 1), dtype=np.int64)
        for j in np.unique(src):
            sel = src == j
            out[sel] = self.sources[j].rows(win[sel])
        return out

    def __next__(self):
        from dspipe.data.loader import _to_torch

        return _to_torch(self.rows(*self.next_indices()))

    def skip(self, micro_batches: int) -> None:
        """Advance without reading (pipeline stages that take no data keep the same position as the others)."""
        self.consumed_samples += micro_batches * self.dp * self.micro_batch

    def state_dict(self) -> dict:
        counts = self.blend.counts_at(self.consumed_samples)
        first = self.sources[0]
        weights = getattr(self.blend, "weights", None) or [float(s) for s in self.shares]  # the ones drawn by
        return {
            "consumed_samples": self.consumed_samples,
            "seed": self.seed,
            "seq_len": first.seq_len,
            "split": first.split,
            "order": self.order,
            "sources": [
                {
                    "path": str(w.data_dir),
                    "fingerprint": w.fingerprint,
                    "num_samples": len(w),
                    "weight": weight,
                    "drawn": drawn,
                    "epoch": drawn // len(w),
                }
                for w, weight, drawn in zip(self.sources, weights, counts, strict=False)
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        from dspipe.data.loader import check_same_order

        mine = self.state_dict()
        if "sources" not in state:
            raise SpecError(
                f"the checkpoint's data position is of one data directory (fingerprint "
                f"{str(state.get('fingerprint'))[:16]}), this run's --data is a blend of "
                f"{len(self.sources)} ({describe_sources(mine['sources'])}): the data changed; resume "
                f"with the --data it was saved with"
            )
        check_same_order(state, self.order)
        for key in ("seed", "split", "seq_len"):
            if state.get(key) != mine[key]:
                raise SpecError(
                    f"the checkpoint's data position does not fit this data: {key} "
                    f"{state.get(key)!r} in the checkpoint, {mine[key]!r} now "
                    f"({describe_sources(mine['sources'])})"
                )
        change = blend_change(state["sources"], mine["sources"])
        if change:
            raise SpecError(
                f"the checkpoint's data blend differs from this run's --data: {change}; resume with the "
                f"blend it was saved with ({describe_sources(state['sources'])})"
            )
        consumed = int(state["consumed_samples"])
        if consumed % (self.dp * self.micro_batch):
            raise SpecError(
                f"the checkpoint consumed {consumed} samples, not a multiple of dp {self.dp} x "
                f"micro_batch {self.micro_batch}: cannot continue the global order"
            )
        self.blend.anchor(consumed, [s["drawn"] for s in state["sources"]])
        self.consumed_samples = consumed


def describe_sources(sources: list[dict]) -> str:
    return ",".join(f"{s['path']}:{s['weight']:.6g}" for s in sources)


def blend_change(saved: list[dict], now: list[dict]) -> str:
    """What differs between a checkpoint's blend and this run's ('' when nothing does): one clause, naming the
    source. Paths may differ (a moved directory is the same data); fingerprints, sizes and weights may not."""
    if len(saved) != len(now):
        return f"{len(now)} sources now, {len(saved)} in the checkpoint"
    for i, (a, b) in enumerate(zip(saved, now, strict=False), 1):
        name = f"source {i} ({b['path']})"
        if a["fingerprint"] != b["fingerprint"]:
            return (
                f"{name} holds other data now (fingerprint {b['fingerprint'][:16]}, {a['fingerprint'][:16]} "
                f"in the checkpoint, read from {a['path']})"
            )
        if a["num_samples"] != b["num_samples"]:
            return f"{name} has {b['num_samples']} samples now, {a['num_samples']} in the checkpoint"
        if a["weight"] != b["weight"]:
            return f"{name} has weight {100 * b['weight']:.6g}% now, {100 * a['weight']:.6g}% in the checkpoint"
    return ""


# ---- gen-config ---------------------------------------------------------------------------------------------------


def blend_option(o: dict) -> BlendSpec | None:
    """gen-config's --data (`o["data"]`; absent for plan and bench): parsed and normalised in place. Returns the
    BlendSpec of a blend of several sources after checking that every one is prepared and all share one tokenizer;
    None for one data directory (which gen-config checks as before: it may still be unprepared)."""
    if o.get("data") is None:
        return None
    spec = parse(o["data"])
    o["data"] = normalise(o["data"])
    if not spec.is_blend:
        return None
    from dspipe.data.checks import check_blend_sources

    check_blend_sources(spec.paths)
    return spec


def check_blend_for_run(
    spec: BlendSpec, *, model_vocab: int, seq_len: int, dp: int | None = None, micro_batch: int | None = None
) -> None:
    """Every source of a blend against the model (vocab, one sequence of data) and, given dp and micro_batch,
    its validation split against one validation batch; one SpecError naming the source."""
    from dspipe.data.checks import check_data_for_model, check_val_for_eval

    for path in spec.paths:
        try:
            check_data_for_model(path, model_vocab=model_vocab, seq_len=seq_len)
            if dp is not None:
                check_val_for_eval(path, seq_len=seq_len, dp=dp, micro_batch=micro_batch)
        except SpecError as e:
            raise SpecError(f"blend source {path}: {e}") from None


def tokenizer_dir(text: str) -> Path:
    """The directory holding the tokenizer of a --data value (every source of a blend shares one)."""
    from dspipe.data.checks import tokenizer_path

    return tokenizer_path(parse(text).sources[0].path)
