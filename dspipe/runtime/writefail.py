"""A rank's failed checkpoint writes, recorded instead of raised so that the rank still takes part in every
collective of a save (a rank that raised while its peers wait in a barrier would hang them all), then agreed on."""

from __future__ import annotations

import contextlib
import errno
import functools
import shutil
from pathlib import Path

# Exceptions that mean a bug in the code doing the write, not a failed write: they propagate even from a routed
# write. Everything else a routed write raises (OSError, and the RuntimeError torch's C++ writers raise for a
# short write, a failed flush or a failed close, whatever their text) is recorded as a write failure.
BUGS = (
    TypeError,
    AttributeError,
    NameError,
    KeyError,
    IndexError,
    AssertionError,
    ImportError,
    NotImplementedError,
    RecursionError,
    ZeroDivisionError,
)

FULL_MIB = 1.0  # under this much free space after a failed write without errno, the disk counts as full


class WriteFailures:
    """Records the first failed write of this rank instead of raising, so that the rank still takes part in every
    collective of the save (a rank that raised while its peers wait in a barrier would hang them all).
    `call(fn, ...)` runs one of our writes; `deepspeed_writes(engine)` routes DeepSpeed's checkpoint file writes
    (its checkpoint engine's save/makedirs and the recovery-script copy) through `call` while it is active.
    A failure is classified by what failed (a routed write), never by its message text."""

    GENERIC = 1000  # code for a write failure without an errno (torch's writers raise RuntimeError)

    def __init__(self):
        self.code, self.detail = 0, ""

    def record(self, e: BaseException) -> None:
        if not self.code:
            code = getattr(e, "errno", None)
            self.code = code if isinstance(code, int) and code > 0 else self.GENERIC
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            self.detail = f"{type(e).__name__}: {first}" if first else type(e).__name__

    @staticmethod
    def is_write_error(e: BaseException) -> bool:
        """Any exception a routed write raises, except those that mean a programming error (BUGS)."""
        return isinstance(e, Exception) and not isinstance(e, BUGS)

    def call(self, fn, *args, **kwargs):
        if self.code:
            return None  # the checkpoint is lost already: skip further writes, keep the collectives
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if not self.is_write_error(e):
                raise
            self.record(e)
            return None

    def confirm_full(self, free: float | None) -> None:
        """A failure without errno counts as ENOSPC when the target's free space confirms the disk is full."""
        if self.code == self.GENERIC and free is not None and free < FULL_MIB:
            self.code = errno.ENOSPC

    @contextlib.contextmanager
    def deepspeed_writes(self, engine):
        targets = [
            (engine.checkpoint_engine, "save"),
            (engine.checkpoint_engine, "makedirs"),
            (engine, "_copy_recovery_script"),
        ]
        patched = []
        for obj, name in targets:
            fn = getattr(obj, name, None)
            if fn is not None:
                setattr(obj, name, functools.partial(self.call, fn))
                patched.append((obj, name))
        try:
            yield
        finally:
            for obj, name in patched:
                delattr(obj, name)  # the instance attribute shadowed the class's method

    def agreed(self) -> int:
        """Collective: the largest failure code over all ranks (0: every rank wrote everything)."""
        import torch
        import torch.distributed as dist

        from dspipe.runtime.comm import collective_tensor

        flag = collective_tensor([self.code], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def free_mib(path: Path) -> float | None:
    try:
        return shutil.disk_usage(path).free / 2**20
    except OSError:
        return None
