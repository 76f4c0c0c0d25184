"""Failures a test injects into a training run to exercise the recovery paths: a NaN loss (skipped steps, halting),
a rank killed after a step, inside a save or during a background write (resume), a full disk on one rank (a failed
save).

One object carries them all. Production runs hold the empty one (`Faults()`, nothing happens); the only way in is
the rank entry point's hidden `--test-faults JSON` option (dspipe.runtime.entry), which the tests' launches pass
(e.g. `--test-faults '{"kill_at_step": 5}'`). A JSON list gives each start of the job its own faults: item i for the
i-th restart by torch's elastic agent (`dspipe launch --max-restarts`; the entry point reads the agent's
TORCHELASTIC_RESTART_COUNT), none after the last. Nothing here reads the environment.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
from dataclasses import dataclass, field, fields, replace

from dspipe.errors import SpecError


@dataclass(frozen=True)
class Faults:
    """The failures to inject; each field off by default."""

    nan_at_steps: frozenset[int] = field(default_factory=frozenset)
    """Steps whose loss is made NaN (the plain model's first micro-batch, every micro-batch of a pipeline)."""
    kill_at_step: int | None = None
    """SIGKILL every rank (or kill_rank) right after this step (a crash between checkpoints)."""
    kill_rank: int | None = None
    """The one rank kill_at_step kills (None: every rank)."""
    kill_launcher: bool = False
    """kill_at_step first SIGKILLs the rank's parent, the launcher of its node (torch's elastic agent): the node is
    lost for good, and the other ranks on it end at their next collective."""
    kill_node: int | None = None
    """kill_at_step kills every rank of this node (the --node-rank its `dspipe launch` was given) and their
    launcher: the node is lost for good (from_json keeps the kill on that node's ranks only)."""
    hang_at_step: int | None = None
    """Rank `hang_rank` sleeps inside its first collective of this step (a hung rank; dspipe.runtime.watchdog)."""
    hang_rank: int = 0
    """The rank that hangs (hang_at_step)."""
    kill_in_save: int | None = None
    """SIGKILL every rank inside the save at this step, after DeepSpeed wrote its files, before `latest` moves."""
    kill_in_async_write: int | None = None
    """SIGKILL every rank while its background writer writes the save at this step (after its first file)."""
    fail_write_at: int | None = None
    """The save at this step fails with ENOSPC on rank `fail_write_rank` (a full disk where no tmpfs can be mounted)."""
    fail_write_rank: int = 1
    """The rank whose write fails (fail_write_at)."""
    refuse_after_build: bool = False
    """Refuse the start (a SpecError, exit 2) once the engine is built: a check that fails the same way at every start
    (what dspipe.runtime.elastic keeps its restarts from building again)."""
    disk_fills_later: bool = False
    """Skip the launch's check that the checkpoints fit their disk: the disk fills during the run (another job's
    files), which is the path the test drives (a save failing on a full disk)."""

    @classmethod
    def from_json(cls, text: str, *, attempt: int = 0, node: int | None = None) -> Faults:
        """The faults of a `--test-faults` JSON object (keys: the field names), or of item `attempt` of a list of them
        (none past its end), for a rank on node `node`; anything else is one line."""
        faults = cls._from_json(text, attempt=attempt)
        if faults.kill_node is None:
            return faults
        if faults.kill_node == node:  # this node is lost: each of its ranks kills the launcher, then itself
            return replace(faults, kill_rank=None, kill_launcher=True)
        return replace(faults, kill_at_step=None, kill_node=None)

    @classmethod
    def _from_json(cls, text: str, *, attempt: int) -> Faults:
        try:
            given = json.loads(text)
        except ValueError as e:
            raise SpecError(f"--test-faults: not JSON ({e})") from None
        if isinstance(given, list):
            for item in given:
                cls._parse(item, text)
            return cls._parse(given[attempt], text) if attempt < len(given) else NO_FAULTS
        return cls._parse(given, text)

    @classmethod
    def _parse(cls, given, text: str) -> Faults:
        names = {f.name for f in fields(cls)}
        if not isinstance(given, dict) or set(given) - names:
            raise SpecError(
                f"--test-faults must be a JSON object with keys among {', '.join(sorted(names))}, got {text!r}"
            )
        if "nan_at_steps" in given:
            given["nan_at_steps"] = frozenset(given["nan_at_steps"])
        return cls(**given)

    def after_build(self) -> None:
        """The refusal once the engine is built (refuse_after_build)."""
        if self.refuse_after_build:
            raise SpecError("test fault: refused after the build (--test-faults refuse_after_build)")

    def kill_after_step(self, step: int, *, rank: int, drain=None) -> None:
        """The crash after a step (kill_at_step), between checkpoints: `drain` first completes a checkpoint still
        being written in the background (a kill during that write is kill_in_async_write's); `drain` is collective,
        so a kill of one rank (kill_rank) goes without it."""
        if self.kill_at_step == step and self.kill_rank in (None, rank):
            if drain is not None and self.kill_rank is None:
                drain()
            parent = os.getppid()
            if self.kill_launcher and parent > 1:  # an orphan's parent is init: never that
                with contextlib.suppress(ProcessLookupError):
                    os.kill(parent, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    @property
    def async_write_kill_tag(self) -> str | None:
        """The checkpoint tag whose background write kills the rank after its first file (kill_in_async_write)."""
        return None if self.kill_in_async_write is None else f"global_step{self.kill_in_async_write}"

    def kill_inside_save(self, step: int) -> None:
        """The crash inside a save (kill_in_save)."""
        if self.kill_in_save == step:
            os.kill(os.getpid(), signal.SIGKILL)

    def hang_step(self, rank: int) -> int | None:
        """The step in whose first collective this rank hangs (hang_at_step), or None."""
        return self.hang_at_step if self.hang_rank == rank else None

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
