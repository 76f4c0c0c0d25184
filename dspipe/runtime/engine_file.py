"""engine.json's start-up block: StartupRecord, read (StartupRecord.from_engine, validated) and written (engine_text,
rank 0 once the engine is up) here only. The on-disk format is the one runners have always written: the engine's
settings, "nonfinite_guard", then "startup" with its keys in STARTUP_KEYS order, one value per rank. Imports no
torch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from dspipe.errors import SpecError
from dspipe.jsonio import dumps, show
from dspipe.spec.kinds import BuildMode

STARTUP_LISTS = ("peak_rss_mib", "rss_before_build_mib", "build_rss_mib", "seconds_to_first_step", "seconds_build")
"""The start-up lists every reader needs (one number in 0..1e9 per rank)."""
STARTUP_KEYS = (
    "mode",
    "rss_before_build_mib",
    "build_rss_mib",
    "peak_rss_mib",
    "seconds_build",
    "seconds_to_first_step",
    "built_params",
    "seconds_before_build",
    "ops_built",
)
"""engine.json's "startup" keys in the order runners write them (dspipe.runtime.startup.StartupClock.gathered)."""


RECORD_LIMIT = 1e9
"""The most a start-up figure may be (seconds, MiB): beyond it a record is damaged, not measured (31 years; 1 PiB)."""


def _number(value) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value <= RECORD_LIMIT
    )


BUILD_MODES = tuple(m.value for m in BuildMode)
RSS_LISTS = ("rss_before_build_mib", "build_rss_mib", "peak_rss_mib")
"""engine.json's per-rank RSS figures (MiB): a live process's, never 0."""


@dataclass(frozen=True)
class StartupRecord:
    """What each rank's start-up cost, rank by rank (engine.json's "startup"): its build mode, its peak host RSS
    before the model build, right after it and up to the first step (MiB), the seconds of the build and from the
    process start to the first step, and the parameter values it built (absent in files from before they were
    counted: None)."""

    mode: str
    rss_before_build_mib: tuple[float, ...]
    build_rss_mib: tuple[float, ...]
    peak_rss_mib: tuple[float, ...]
    seconds_build: tuple[float, ...]
    seconds_to_first_step: tuple[float, ...]
    built_params: tuple[int, ...] | None = None
    seconds_before_build: tuple[float, ...] | None = None
    """Seconds from each rank's process start to its module build (imports, process group, data; None in files
    from before it was recorded)."""
    ops_built: tuple[str, ...] | None = None
    """DeepSpeed ops this launch compiled because the extension cache lacked them (dspipe.cluster.opcache; None in
    files from before it was recorded)."""

    @property
    def seconds_initialize(self) -> float | None:
        """The slowest rank's seconds from the build's end to the first step (deepspeed.initialize, the loader)."""
        if self.seconds_before_build is None:
            return None
        return max(
            ready - before - build
            for ready, before, build in zip(
                self.seconds_to_first_step, self.seconds_before_build, self.seconds_build, strict=True
            )
        )

    @property
    def ranks(self) -> int:
        return len(self.peak_rss_mib)

    @property
    def worst_rank(self) -> int:
        """The rank of the highest start-up peak RSS."""
        return max(range(self.ranks), key=self.peak_rss_mib.__getitem__)

    def to_dict(self) -> dict:
        """The JSON object of engine.json's "startup": STARTUP_KEYS order, lists; built_params when counted."""
        out = {key: getattr(self, key) for key in STARTUP_KEYS}
        return {key: value if key == "mode" else list(value) for key, value in out.items() if value is not None}

    @staticmethod
    def _optional(block: dict, *, source: Path | str, ranks: int) -> dict:
        """seconds_before_build (one number in 0..1e9 per rank) and ops_built (op names), when present."""
        out: dict = {}
        before = block.get("seconds_before_build")
        if before is not None:
            if not (isinstance(before, list) and len(before) == ranks and all(_number(v) for v in before)):
                raise SpecError(
                    f"{source}'s startup.seconds_before_build is damaged: one number in 0..1e9 per rank expected, "
                    f"got {show(before)}"
                )
            out["seconds_before_build"] = tuple(before)
        ops = block.get("ops_built")
        if ops is not None:
            if not (isinstance(ops, list) and all(isinstance(v, str) and 0 < len(v) <= 60 for v in ops)):
                raise SpecError(
                    f"{source}'s startup.ops_built is damaged: a list of op names expected, got {show(ops)}"
                )
            out["ops_built"] = tuple(ops)
        return out

    @classmethod
    def from_dict(cls, block, *, source: Path | str) -> StartupRecord:
        """The block validated: a build mode and, per STARTUP_LISTS key, one number in 0..1e9 per rank (built_params,
        when present: one integer >= 0 per rank); anything else is one SpecError naming `source` and the key.
        Keys it does not know are ignored."""
        if not isinstance(block, dict):
            raise SpecError(f"{source}'s startup is damaged: an object expected, got {type(block).__name__}")
        mode = block.get("mode")
        if mode not in BUILD_MODES:
            raise SpecError(
                f"{source}'s startup.mode is damaged: one of {', '.join(BUILD_MODES)} expected, got {show(mode)}"
            )
        lists: dict[str, tuple] = {}
        ranks = None
        for key in STARTUP_LISTS:
            value = block.get(key)
            if not (
                isinstance(value, list)
                and value
                and all(_number(v) for v in value)
                and len(value) == (ranks or len(value))
            ):
                raise SpecError(
                    f"{source}'s startup.{key} is damaged: one number in 0..1e9 per rank expected, got {show(value)}"
                )
            if key in RSS_LISTS and not all(v > 0 for v in value):  # a running process holds memory
                raise SpecError(
                    f"{source}'s startup.{key} is damaged: a process's RSS is above 0 MiB, got {show(value)}"
                )
            lists[key], ranks = tuple(value), len(value)
        built = block.get("built_params")
        if built is not None and not (
            isinstance(built, list)
            and len(built) == ranks
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in built)
        ):
            raise SpecError(
                f"{source}'s startup.built_params is damaged: one integer >= 1 per rank expected (every rank builds "
                f"its part of the model), got {show(built)}"
            )
        record = cls(
            mode=mode,
            **lists,
            built_params=None if built is None else tuple(built),
            **cls._optional(block, source=source, ranks=ranks),
        )
        record._check_order(source=source)
        return record

    def _check_order(self, *, source: Path | str) -> None:
        """Each rank's first step comes after its build ended (the process start + before the build + the build)."""
        before = self.seconds_before_build or (0.0,) * self.ranks
        for rank, (ready, start, build) in enumerate(
            zip(self.seconds_to_first_step, before, self.seconds_build, strict=True)
        ):
            if ready + 0.02 < start + build:  # each figure is rounded to 0.01 s
                raise SpecError(
                    f"{source}'s startup is damaged: rank {rank} reached its first step at {ready:g} s, before its "
                    f"build ended at {start:g} + {build:g} s"
                )

    @classmethod
    def from_engine(cls, engine: dict, *, source: Path | str) -> StartupRecord | None:
        """engine.json's start-up block (engine: the file's object, dspipe.rundir.load_engine); None where its
        runner predates it; damaged: one SpecError naming `source` and the key."""
        block = engine.get("startup")
        return None if block is None else cls.from_dict(block, source=source)


def engine_text(settings: dict, *, guarded: bool, startup: StartupRecord, what: str) -> str:
    """engine.json's text: the live engine's settings, whether the non-finite guard is on, the start-up block."""
    return dumps({**settings, "nonfinite_guard": guarded, "startup": startup.to_dict()}, what=what)
