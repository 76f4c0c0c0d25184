"""The parallel layout: how the world's ranks split into pipeline x data x sequence x tensor parallel groups.

Created once (by the plan) and passed down; no other code divides the world. Rank order follows DeepSpeed's
PipeModelDataParallelTopology (axes pipe, data, model; the last varies fastest) with the sequence axis between
data and tensor: rank = ((pipe·dp + data)·sp + seq)·tp + tensor. Tensor-parallel peers are neighbours (inside a
node), pipeline stages the farthest apart (across nodes). Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspipe.errors import SpecError
from dspipe.spec.kinds import Axis

AXES = ("pipe", "data", "seq", "tensor")  # slowest to fastest


@dataclass(frozen=True)
class ParallelLayout:
    """World = pp x dp x sp x tp ranks."""

    world: int
    """Total ranks."""
    pp: int = 1
    """Pipeline stages."""
    tp: int = 1
    """Tensor-parallel ranks per model replica (inside a node)."""
    sp: int = 1
    """Sequence-parallel ranks per model replica (Ulysses)."""

    def __post_init__(self) -> None:
        for name in ("world", Axis.PP, Axis.TP, Axis.SP):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SpecError(f"layout.{name} must be a positive integer, got {value!r}")
        if self.world % self.model_ranks:
            raise SpecError(
                f"world size {self.world} is not divisible by pp {self.pp} x tp {self.tp} x sp {self.sp} "
                f"= {self.model_ranks}"
            )

    @property
    def model_ranks(self) -> int:
        """Ranks that hold one model replica: pp x tp x sp."""
        return self.pp * self.tp * self.sp

    @property
    def dp(self) -> int:
        """Data-parallel replicas = world / (pp x tp x sp)."""
        return self.world // self.model_ranks

    @property
    def sizes(self) -> dict[str, int]:
        return {"pipe": self.pp, "data": self.dp, "seq": self.sp, "tensor": self.tp}

    def describe(self) -> str:
        """'world 8 = dp 2 x pp 2 x tp 2', naming only the dimensions in use besides dp."""
        parts = [f"dp {self.dp}"] + [
            f"{k} {v}" for k, v in ((Axis.PP, self.pp), (Axis.TP, self.tp), (Axis.SP, self.sp)) if v > 1 or k == Axis.PP
        ]
        return f"world {self.world} = " + " x ".join(parts)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's position on every axis."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside world {self.world}")
        out = {}
        for axis in reversed(AXES):
            size = self.sizes[axis]
            out[axis] = rank % size
            rank //= size
        return {axis: out[axis] for axis in AXES}

    def rank_of(self, **coords: int) -> int:
        rank = 0
        for axis in AXES:
            rank = rank * self.sizes[axis] + coords.get(axis, 0)
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """The rank lists that differ only along `axis` (e.g. 'data': each list is one data-parallel group)."""
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; valid: {', '.join(AXES)}")
        seen, out = set(), []
        for rank in range(self.world):
            if rank in seen:
                continue
            c = self.coords(rank)
            group = [self.rank_of(**{**c, axis: i}) for i in range(self.sizes[axis])]
            seen.update(group)
            out.append(group)
        return out

    @property
    def loss_holders(self) -> int:
        """Ranks whose losses add up to dp x tp x pp replica losses: every rank but the sp - 1 other sequence shares
        of each replica (world / sp)."""
        return self.world // self.sp

    def sequence_slice(self, length: int, rank: int) -> tuple[int, int]:
        """[start, stop) of the contiguous slice of a `length`-token sequence that `rank` holds (its sp coordinate)."""
        if length % self.sp:
            raise ValueError(f"sequence length {length} is not divisible by sp {self.sp}")
        size = length // self.sp
        start = self.coords(rank)["seq"] * size
        return start, start + size

    def dp_rank(self, rank: int) -> int:
        return self.coords(rank)["data"]

    def stage(self, rank: int) -> int:
        return self.coords(rank)["pipe"]
