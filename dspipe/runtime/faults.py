"""Failures a test injects into a training run to exercise the recovery paths: a NaN loss (skipped steps, halting),
a rank killed after a step, inside a save or during a background write (resume), a full disk on one rank (a failed
save).

One object carries them all. Production runs hold the empty one (`Faults()`, nothing happens); the only way in is
the rank entry point's hidden `--test-faults JSON` option (dspipe.runtime.entry), which the tests' launches pass
(e.g. `--test-faults '{"kill_at_step": 5}'`). Nothing here reads the environment.
"""
from __future__ import annotations

import errno
import json
import os
import signal
from dataclasses import dataclass, field, fields

from dspipe.errors import SpecError


@dataclass(frozen=True)
class Faults:
    """The failures to inject; each field off by default."""

    nan_at_steps: frozenset[int] = field(default_factory=frozenset)
    """Steps whose loss is made NaN (the plain model's first micro-batch, every micro-batch of a pipeline)."""
    kill_at_step: int | None = None
    """SIGKILL every rank right after this step (a crash between checkpoints)."""
    kill_in_save: int | None = None
    """SIGKILL every rank inside the save at this step, after DeepSpeed wrote its files, before `latest` moves."""
    kill_in_async_write: int | None = None
    """SIGKILL every rank while its background writer writes the save at this step (after its first file)."""
    fail_write_at: int | None = None
    """The save at this step fails with ENOSPC on rank `fail_write_rank` (a full disk where no tmpfs can be mounted)."""
    fail_write_rank: int = 1
    """The rank whose write fails (fail_write_at)."""
    disk_fills_later: bool = False
    """Skip the launch's check that the checkpoints fit their disk: the disk fills during the run (another job's
    files), which is the path the test drives (a save failing on a full disk)."""

    @classmethod
    def from_json(cls, text: str) -> Faults:
        """The faults of a `--test-faults` JSON object (keys: the field names); anything else is one line."""
        try:
            given = json.loads(text)
        except ValueError as e:
            raise SpecError(f"--test-faults: not JSON ({e})") from None
        names = {f.name for f in fields(cls)}
        if not isinstance(given, dict) or set(given) - names:
            raise SpecError(f"--test-faults must be a JSON object with keys among {', '.join(sorted(names))}, got "
                            f"{text!r}")
        if "nan_at_steps" in given:
            given["nan_at_steps"] = frozenset(given["nan_at_steps"])
        return cls(**given)

    def kill_after_step(self, step: int, *, drain=None) -> None:
        """The crash after a step (kill_at_step), between checkpoints: `drain` first completes a checkpoint still
        being written in the background (a kill during that write is kill_in_async_write's)."""
        if self.kill_at_step == step:
            if drain is not None:
                drain()
            os.kill(os.getpid(), signal.SIGKILL)

    @property
    def async_write_kill_tag(self) -> str | None:
        """The checkpoint tag whose background write kills the rank after its first file (kill_in_async_write)."""
        return None if self.kill_in_async_write is None else f"global_step{self.kill_in_async_write}"

    def kill_inside_save(self, step: int) -> None:
        """The crash inside a save (kill_in_save)."""
        if self.kill_in_save == step:
            os.kill(os.getpid(), signal.SIGKILL)

    def fail_write(self, failures, *, step: int, rank: int) -> None:
        """Record ENOSPC in the save's WriteFailures on the chosen rank (fail_write_at)."""
        if self.fail_write_at == step and self.fail_write_rank == rank:
            failures.record(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))

    def nan_loss(self, engine, *, pipeline: bool) -> NanLoss | None:
        """The NaN injector for `engine`'s module (DeepSpeed's engine), None when no step is poisoned."""
        return NanLoss(engine.module, steps=self.nan_at_steps, pipeline=pipeline) if self.nan_at_steps else None


NO_FAULTS = Faults()
"""A production run's: nothing is injected."""


class NanLoss:
    """Makes the loss NaN during the steps it is armed for: a pipeline's loss_fn is wrapped (every micro-batch of the
    step), the plain model gets a forward hook (its output is the loss; the step's first micro-batch only)."""

    def __init__(self, module, *, steps: frozenset[int], pipeline: bool):
        self.steps, self.on, self.keep = steps, False, pipeline
        if pipeline:
            loss_fn = module.loss_fn
            module.loss_fn = lambda outputs, labels: self._poison(loss_fn(outputs, labels))
        else:
            module.register_forward_hook(lambda _module, _args, loss: self._poison(loss))

    def arm(self, step: int) -> None:
        self.on = step in self.steps

    def disarm(self) -> None:
        self.on = False

    def _poison(self, loss):
        if not self.on:
            return loss
        self.on = self.keep
        return loss * float("nan")
