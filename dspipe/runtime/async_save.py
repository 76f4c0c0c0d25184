"""Checkpoint files written in the background (`--async-save`, the default).

DeepSpeed's `save_checkpoint` hands every file it writes (model states, ZeRO partitions, pipeline layers, the
experts) to its checkpoint engine. `BackgroundWriter` (dspipe.runtime.async_engine) is one: `save` copies
the file's tensors into shared-memory arenas (the snapshot, the only part the step waits for); a writer process per
rank then writes the files with torch.save, in the format the engine's own writer uses, through O_DIRECT, and fsyncs
each. The training step goes on meanwhile. Whether every rank's files are written, and written without a failure,
is agreed on by dspipe.runtime.checkpoint before the checkpoint is marked complete, so `latest` never names a
checkpoint whose files are still being written, and a process killed during the write leaves the previous
checkpoint as `latest`.

Why not DeepSpeed 0.19.8's own asynchronous engines: FastCheckpointEngine (and DecoupledCheckpointEngine, which runs
it in a subprocess) write through deepspeed.ops.aio, which needs libaio (absent here:
AsyncIOBuilder().is_compatible() is False); and the decoupled engine's commit waits for the files at the next
optimizer step, so a write longer than one forward and backward stalls training there. Why a process and not a
thread: torch.save holds the GIL while it writes (measured: the step during a save took 1.9x with a thread).
"""

from __future__ import annotations

import copy
import io
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from dspipe.runtime.writefail import WriteFailures

WRITER_NICE = 10
"""The writer process's niceness: below the training ranks, which keep the cores while both want them."""


def snapshot(item, memo: dict | None = None, *, stage):
    """`item` with every tensor in it (nested in dicts, lists, tuples) replaced by `stage(tensor)`, a copy the
    training step may go on changing the original of. A tensor that appears twice is staged once (torch.save then
    stores it once, as it would the original)."""
    import torch

    memo = {} if memo is None else memo
    if torch.is_tensor(item):
        if id(item) not in memo:
            memo[id(item)] = stage(item)
        return memo[id(item)]
    if isinstance(item, dict):
        copied = copy.copy(item)
        for key, value in item.items():
            copied[key] = snapshot(value, memo, stage=stage)
        return copied
    if isinstance(item, list):
        return [snapshot(value, memo, stage=stage) for value in item]
    if isinstance(item, tuple) and type(item) is tuple:
        return tuple(snapshot(value, memo, stage=stage) for value in item)
    return item


def tensors_in(item, found: dict | None = None) -> list:
    """The distinct tensors in `item` (nested in dicts, lists, tuples), in the order snapshot meets them."""
    import torch

    found = {} if found is None else found
    if torch.is_tensor(item):
        found.setdefault(id(item), item)
    elif isinstance(item, dict):
        for value in item.values():
            tensors_in(value, found)
    elif isinstance(item, (list, tuple)):
        for value in item:
            tensors_in(value, found)
    return list(found.values())


ALIGN = 64
"""Bytes each tensor's slot in an arena is aligned to (any dtype's element size divides it)."""


@dataclass(frozen=True)
class Slot:
    """A staged tensor's place in its file's arena of its dtype: what the writer process rebuilds it from."""

    offset: int
    """In elements of the arena's dtype."""
    dtype: object
    shape: tuple

    def view(self, arenas: dict):
        return arenas[self.dtype][self.offset : self.offset + math.prod(self.shape)].view(self.shape)


def rebuild(item, arenas: dict, memo: dict | None = None):
    """The writer process's side: every Slot in `item` as a view of its dtype's arena. An arena holds exactly the
    file's tensors of that dtype (each 64-byte aligned), so torch.save stores it once, as one storage the tensors are
    views of (as DeepSpeed's own files store its flat buffers), with no copy in the writer."""
    memo = {} if memo is None else memo
    if isinstance(item, Slot):
        if id(item) not in memo:
            memo[id(item)] = item.view(arenas)
        return memo[id(item)]
    if isinstance(item, dict):
        copied = copy.copy(item)
        for key, value in item.items():
            copied[key] = rebuild(value, arenas, memo)
        return copied
    if isinstance(item, list):
        return [rebuild(value, arenas, memo) for value in item]
    if isinstance(item, tuple) and type(item) is tuple:
        return tuple(rebuild(value, arenas, memo) for value in item)
    return item


class ArenaPool:
    """Shared-memory buffers, one per checkpoint file name and dtype (torch.save refuses views of one storage as
    different dtypes), kept from one checkpoint to the next: a run saves the same files with the same shapes every
    time, so after the first save a snapshot is a memory copy into pages already mapped (allocating them anew costs
    a page fault per 4 KiB: 5x the copy, measured), and the writer process receives one handle per buffer (a handle
    per tensor costs the rank's GIL, measured: the step after a save took 1.5x)."""

    def __init__(self):
        self.arenas: dict[tuple, object] = {}

    def take(self, name: str, dtype, numel: int, *, fault_in: bool = False):
        """The buffer of file `name`'s tensors of `dtype` (`numel` elements), allocated unless one of that size is
        held; `fault_in`: a new one's pages are written now (mapped in this process), not by the first copy."""
        import torch

        arena = self.arenas.get((name, dtype))
        if arena is None or arena.numel() != numel:
            arena = self.arenas[(name, dtype)] = torch.empty(numel, dtype=dtype).share_memory_()
            if fault_in:
                arena.zero_()
        return arena

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self.arenas.values())


def placement(state) -> tuple[list, dict, dict]:
    """(the non-empty tensors of `state`, each one's offset in its dtype's arena, each dtype's arena length):
    tensors in the order snapshot meets them, each slot 64-byte aligned."""
    tensors = [t for t in tensors_in(state) if t.numel()]
    offsets, totals = {}, {}
    for t in tensors:
        step = max(1, ALIGN // t.element_size())
        offsets[id(t)] = totals.get(t.dtype, 0)
        totals[t.dtype] = offsets[id(t)] + -(-t.numel() // step) * step
    return tensors, offsets, totals


def reserve(state, *, pool: ArenaPool, name: str) -> int:
    """The arenas `stage_into` would copy `state` into, allocated and faulted in now (a rehearsal of the first
    save, outside the steps); copies nothing. Returns the bytes the file's tensors take."""
    tensors, _, totals = placement(state)
    for dtype, numel in totals.items():
        pool.take(name, dtype, numel, fault_in=True)
    return sum(t.numel() * t.element_size() for t in tensors)


def stage_into(state, *, pool: ArenaPool, name: str):
    """({dtype: the file's arena}, `state` with its tensors copied into the arenas and replaced by their Slots,
    bytes). Empty tensors (ZeRO-3's partitioned placeholders) are staged as empty tensors of their own, not as views
    (a view of no bytes records the arena's storage under a size of 0)."""
    import torch

    tensors, offsets, totals = placement(state)
    arenas = {dtype: pool.take(name, dtype, numel) for dtype, numel in totals.items()}

    def stage(t):
        if not t.numel():
            return torch.empty(t.shape, dtype=t.dtype)
        slot = Slot(offset=offsets[id(t)], dtype=t.dtype, shape=tuple(t.shape))
        slot.view(arenas).copy_(t.detach())
        return slot

    return arenas, snapshot(state, stage=stage), sum(t.numel() * t.element_size() for t in tensors)


class DirectFile:
    """A write-only file torch.save streams into, written with O_DIRECT through a page-aligned bounce buffer: the
    bytes go from the buffer to the disk without the page cache, whose copies and dirty-page throttling cost this
    machine 1.4-3 s of CPU per GiB written (O_DIRECT: 0.2 s, measured). The tail is written padded to the block
    size and the file truncated to its length. Where O_DIRECT is refused (tmpfs, some network filesystems), an
    ordinary buffered file. Closed by `close` (fsync first)."""

    BLOCK = 4096
    CHUNK = 64 * 2**20

    def __init__(self, path: str):
        import mmap

        self.path, self.length, self.filled = path, 0, 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            self.fd, self.direct = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644), hasattr(os, "O_DIRECT")
        except OSError:
            self.fd, self.direct = os.open(path, flags, 0o644), False
        self.buffer = mmap.mmap(-1, self.CHUNK)  # anonymous: page-aligned

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n, done = len(view), 0
        while done < n:
            take = min(self.CHUNK - self.filled, n - done)
            self.buffer[self.filled : self.filled + take] = view[done : done + take]
            self.filled += take
            done += take
            if self.filled == self.CHUNK:
                self._flush(self.CHUNK)
        self.length += n
        return n

    def _flush(self, nbytes: int) -> None:
        view = memoryview(self.buffer)[:nbytes]
        written = 0
        while written < nbytes:
            written += os.write(self.fd, view[written:])
        self.filled = 0

    def flush(self) -> None:
        pass  # whole blocks only: the rest is written by close

    def close(self) -> None:
        try:
            if self.filled:
                tail = self.filled
                padded = -(-tail // self.BLOCK) * self.BLOCK if self.direct else tail
                self.buffer[tail:padded] = bytes(padded - tail)
                self._flush(padded)
            os.ftruncate(self.fd, self.length)
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.buffer.close()


def save_file(torch, state, path: str, *, zipfile: bool) -> None:
    """torch.save of `state` to `path` through a DirectFile (zip format; the legacy format seeks, so it is written
    with torch.save's own file and fsynced)."""
    if not zipfile:
        torch.save(state, path, _use_new_zipfile_serialization=False)
        fsync_file(path)
        return
    f = DirectFile(path)
    try:
        torch.save(state, f)
    except BaseException:
        f.close()
        raise
    f.close()


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the rank that started it dies, so that no file is written into a
    checkpoint directory after its rank is gone (a relaunch may be writing the same step there)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _failure(e: BaseException) -> tuple[int, str]:
    code = getattr(e, "errno", None)
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return (
        code if isinstance(code, int) and code > 0 else WriteFailures.GENERIC,
        f"{type(e).__name__}: {first}" if first else type(e).__name__,
    )


def writer_process(jobs, results, parent: int, kill_tag: str | None) -> None:
    """The writer process: torch.save each (staged state, path, zip format) it receives, fsync, answer
    (path, 0 or a failure code, detail, seconds). Its own interpreter: the rank's training thread never waits for
    the GIL while a file is written. `kill_tag`: a test's fault (Faults.kill_in_async_write)."""
    import queue
    import threading

    _die_with_parent()
    os.nice(WRITER_NICE)
    import torch

    # no zip CRC-32 in the background files: torch.load never checks it (a flipped byte in a tensor loads without
    # error, measured), and computing it was a third of this process's CPU (0.4 s per GiB here), which the training
    # step shares on a host without idle cores
    torch.serialization.set_crc32_options(False)
    torch.save({"warm-up": torch.zeros(1)}, io.BytesIO())  # its first save's imports and set-up: not in a checkpoint's

    inbox: queue.Queue = queue.Queue()

    def receive() -> None:  # takes every job at once, so that the rank never waits in send for a file's write
        while True:
            try:
                inbox.put(jobs.recv())
            except (EOFError, OSError):
                inbox.put(None)
                return

    threading.Thread(target=receive, daemon=True).start()
    while os.getppid() == parent:
        job = inbox.get()
        if job is None:
            return
        arenas, staged, path, zipfile = job
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            save_file(torch, rebuild(staged, arenas), path, zipfile=zipfile)
            code, detail = 0, ""
        except Exception as e:
            code, detail = _failure(e)
        del arenas, staged, job
        if kill_tag is not None and Path(path).parent.name.removeprefix(".partial-") == kill_tag:
            os.kill(parent, signal.SIGKILL)
            os._exit(1)
        results.send((path, code, detail, time.perf_counter() - t0, time.process_time() - c0))
