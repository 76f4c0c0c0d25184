"""The DeepSpeed checkpoint engine of `--async-save`: `BackgroundWriter` stages each file DeepSpeed saves into
shared-memory arenas and hands it to a writer process of its own (dspipe.runtime.async_save, which imports no
DeepSpeed: the spawned writer starts on torch alone)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from dspipe.runtime.async_save import ArenaPool, reserve, stage_into, writer_process
from dspipe.runtime.writefail import WriteFailures


class BackgroundWriter(TorchCheckpointEngine):
    """A DeepSpeed checkpoint engine whose `save` snapshots into shared host buffers; a process of its own (spawned
    by `start`, or at the first checkpoint; kept for the run) writes the files. Loads are TorchCheckpointEngine's.
    One per rank."""

    def __init__(self, *, zipfile_serialization: bool, kill_tag: str | None = None):
        super().__init__(None)
        self.name = "dspipe.BackgroundWriter"
        self.zipfile_serialization = zipfile_serialization  # the format the engine's own writer was configured with
        self.kill_tag = kill_tag
        self.failures = WriteFailures()  # the current checkpoint's first failed write
        self.blocking_s = self.write_s = self.write_cpu_s = 0.0
        self.bytes = 0
        self.pool = ArenaPool()
        self._held: list = []
        self._outstanding = 0
        self._process = self._jobs = self._results = None
        self._rehearsing = False
        self.prepared = False
        """Its host buffers are sized (by a rehearsal or a save), or a rehearsal was declined."""

    def begin(self) -> None:
        """A new checkpoint (the previous one is drained): reset its failure and figures, reuse its buffers."""
        self.failures = WriteFailures()
        self.blocking_s = self.write_s = self.write_cpu_s = 0.0
        self.bytes = 0
        self._held = []

    def preserves_storage_sharing(self) -> bool:
        return False  # DeepSpeed then hands the live state over without its own clone: `save` copies it once

    @property
    def started(self) -> bool:
        """Its writer process was spawned (at start-up: the run saves in the background before its last step)."""
        return self._process is not None

    @contextlib.contextmanager
    def rehearsal(self):
        """While active, `save` allocates and faults in the file's host buffers and copies nothing: DeepSpeed's
        save_checkpoint run through it sizes every file the run's saves will write (`bytes`: their total)."""
        self.begin()
        self._rehearsing = True
        try:
            yield self
        finally:
            self._rehearsing = False
            self.prepared = True

    def save(self, state_dict, path: str) -> None:
        """Snapshot now; the file is written once `release` hands the checkpoint's files to the writer process."""
        if self._rehearsing:
            self.bytes += reserve(state_dict, pool=self.pool, name=Path(path).name)
            return
        t0 = time.perf_counter()
        arenas, staged, nbytes = stage_into(state_dict, pool=self.pool, name=Path(path).name)
        self.bytes += nbytes
        self._held.append((arenas, staged, str(path)))
        self.prepared = True
        self.blocking_s += time.perf_counter() - t0

    def release(self) -> None:
        """Every file of the checkpoint is snapshot: the writer process writes them (tensors pass by handle)."""
        if not self._held:
            return
        t0 = time.perf_counter()
        self.start()
        for arenas, staged, path in self._held:
            self._jobs.send((arenas, staged, path, self.zipfile_serialization))
            self._outstanding += 1
        self._held = []
        self.blocking_s += time.perf_counter() - t0

    def drained(self) -> bool:
        """Every file of the checkpoint written (or failed); a dead writer process fails what it had."""
        self._collect(timeout=0.0)
        return not self._held and not self._outstanding

    def wait(self) -> None:
        self.release()
        while self._outstanding:
            self._collect(timeout=0.5)

    def _collect(self, *, timeout: float) -> None:
        while self._outstanding and self._results.poll(timeout):
            try:
                _path, code, detail, seconds, cpu = self._results.recv()
            except (EOFError, OSError):  # the writer process is gone
                break
            self._outstanding -= 1
            self.write_s += seconds
            self.write_cpu_s += cpu
            if code and not self.failures.code:
                self.failures.code, self.failures.detail = code, detail
            timeout = 0.0
        if self._outstanding and not self._process.is_alive():
            if not self.failures.code:
                self.failures.code = WriteFailures.GENERIC
                self.failures.detail = f"the checkpoint writer process died (exit code {self._process.exitcode})"
            self._outstanding = 0

    def start(self) -> None:
        """Spawn the writer process unless it runs (at start-up: its imports then do not compete with steps)."""
        import torch.multiprocessing as mp

        if self._process is not None and self._process.is_alive():
            return
        ctx = mp.get_context("spawn")
        self._jobs, jobs = ctx.Pipe()
        results, self._results = ctx.Pipe()
        self._process = ctx.Process(
            target=writer_process,
            args=(jobs, results, os.getpid(), self.kill_tag),
            name="dspipe-checkpoint-writer",
            daemon=True,
        )
        self._process.start()
        jobs.close()
        results.close()
