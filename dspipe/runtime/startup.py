"""What the start-up of a rank cost, measured: its peak host RSS before the model was built, right after, and once
the engine was up, the seconds from the process start to the build's end and to the first step, and how many
parameter values the rank built. Rank 0 writes
every rank's figures into engine.json ("startup"), beside which `dspipe report` shows the plan's prediction."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import time

from dspipe.runtime.engine_file import StartupRecord

MIB = 1024**2
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
STARTUP_MMAP_THRESHOLD = 1 * MIB
"""During start-up every allocation over 1 MiB is its own mapping, returned to the OS when freed. glibc's default
(a threshold that rises to the largest block freed, up to 32 MiB) keeps each freed whole tensor of the build on the
heap: measured on the 152M GPT, ZeRO-3, 2 CPU ranks: the build's RSS growth 543 MiB with the default, 330 MiB with
this (its partition is 290 MiB)."""
STEADY_MMAP_THRESHOLD = 32 * MIB
"""After start-up on a GPU: glibc's own ceiling for its dynamic threshold, so the host's allocations reuse the heap
as they would by default. On CPU ranks (the host is the device) the start-up threshold stays: measured on the 152M
GPT, ZeRO-3, 2 ranks, steps peak at 1.88 GiB per rank with it, 3.24 GiB with glibc's default."""


def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") else None


def malloc_threshold(nbytes: int) -> bool:
    """Set glibc's mmap threshold (no-op elsewhere); True when it was set."""
    libc = _libc()
    return bool(libc and libc.mallopt(M_MMAP_THRESHOLD, int(nbytes)))


def release_freed() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim; no-op elsewhere)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def peak_rss_mib() -> float:
    """This process's peak resident set so far (getrusage's ru_maxrss, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MIB


def process_start() -> float:
    """The wall-clock time this process started (psutil, a DeepSpeed dependency)."""
    import psutil

    return psutil.Process().create_time()


_OPS_MISSING_AT_START: tuple[str, ...] = ()


def note_ops_at_start() -> None:
    """At the process start (before deepspeed.init_distributed builds anything): which of DeepSpeed's JIT ops are
    neither prebuilt nor in the extension cache (dspipe.runtime.ops), so that the start-up record can say which ones
    this launch compiled."""
    from dspipe.cluster.opcache import CPU_ADAM, FUSED_ADAM, SHM_COMM
    from dspipe.runtime.ops import op_built

    global _OPS_MISSING_AT_START
    _OPS_MISSING_AT_START = tuple(op for op in (SHM_COMM, FUSED_ADAM, CPU_ADAM) if not op_built(op))


def ops_built_here() -> tuple[str, ...]:
    """The ops missing at the process start that are built now: this launch compiled them."""
    from dspipe.runtime.ops import op_built

    return tuple(op for op in _OPS_MISSING_AT_START if op_built(op))


class StartupClock:
    """Marks taken on one rank: `before_build`, `built`, `ready` (the engine up and data open, the first step next)."""

    def __init__(self) -> None:
        self.started = process_start()
        self.marks: dict[str, tuple[float, float]] = {}
        self.built_params = 0
        malloc_threshold(STARTUP_MMAP_THRESHOLD)

    def mark(self, name: str, *, module=None) -> None:
        """`module` given: also count the parameter values this rank holds of it (a ZeRO-3 parameter: its
        partition; a pipeline stage: its own layers; under expert parallelism: not the meta experts of other
        ranks)."""
        self.marks[name] = (time.time() - self.started, peak_rss_mib())
        if module is not None:
            self.built_params = sum(
                p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()
                for p in module.parameters()
                if not p.is_meta
            )

    def gathered(self, *, mode: str, host_is_device: bool) -> StartupRecord:
        """Collective, at the end of start-up: every rank's figures, rank by rank, as engine.json's "startup"
        value; on a GPU the allocator goes back to its training setting."""
        import torch
        import torch.distributed as dist

        from dspipe.runtime.comm import collective_tensor

        release_freed()
        if not host_is_device:
            malloc_threshold(STEADY_MMAP_THRESHOLD)

        names = ("before_build", "built", "ready")  # rows: seconds, RSS per mark; then the values built
        mine = collective_tensor([v for n in names for v in self.marks[n]] + [self.built_params], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        rows = [t.tolist() for t in every]
        return StartupRecord(
            mode=mode,
            rss_before_build_mib=tuple(round(r[1], 1) for r in rows),
            build_rss_mib=tuple(round(r[3], 1) for r in rows),
            peak_rss_mib=tuple(round(r[5], 1) for r in rows),
            seconds_build=tuple(round(r[2] - r[0], 2) for r in rows),
            seconds_to_first_step=tuple(round(r[4], 2) for r in rows),
            built_params=tuple(int(r[6]) for r in rows),
            seconds_before_build=tuple(round(r[0], 2) for r in rows),
            ops_built=ops_built_here(),
        )
