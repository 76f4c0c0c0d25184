"""A rank's failed checkpoint writes, recorded instead of raised so that the rank still takes part in every
collective of a save (a rank that raised while its peers wait in a barrier would hang them all), then agreed on."""
from __future__ import annotations

import contextlib
import functools
import shutil
from pathlib import Path


class WriteFailures:
    """Records the first failed write of this rank instead of raising, so that the rank still takes part in every
    collective of the save (a rank that raised while its peers wait in a barrier would hang them all).
    `call(fn, ...)` runs one of our writes; `deepspeed_writes(engine)` routes DeepSpeed's checkpoint file writes
    (its checkpoint engine's save/makedirs and the recovery-script copy) through `call` while it is active."""

    GENERIC = 1000  # code for a write failure without an errno (torch's zip writer raises RuntimeError)

    def __init__(self):
        self.code, self.detail = 0, ""

    def record(self, e: BaseException) -> None:
        if not self.code:
            self.code = getattr(e, "errno", None) or self.GENERIC
            self.detail = str(e).splitlines()[0] if str(e) else type(e).__name__

    @staticmethod
    def is_write_error(e: BaseException) -> bool:
        return isinstance(e, OSError) or (isinstance(e, RuntimeError) and any(
            s in str(e) for s in ("PytorchStreamWriter", "inline_container", "file write failed")))

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

    @contextlib.contextmanager
    def deepspeed_writes(self, engine):
        targets = [(engine.checkpoint_engine, "save"), (engine.checkpoint_engine, "makedirs"),
                   (engine, "_copy_recovery_script")]
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

        flag = torch.tensor([self.code], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def free_mib(path: Path) -> float | None:
    try:
        return shutil.disk_usage(path).free / 2**20
    except OSError:
        return None
