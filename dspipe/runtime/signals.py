"""SIGTERM/SIGINT during training: remembered, agreed on by every rank; the loop finishes the step, saves, exits 0."""

from __future__ import annotations

import signal


class StopRequest:
    """Remembers SIGTERM/SIGINT; the loop finishes the current step, saves and exits 0."""

    def __init__(self):
        self.signum = None
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum

    def agreed(self) -> bool:
        """True on every rank when any rank got a signal (one tiny all-reduce)."""
        import torch
        import torch.distributed as dist

        from dspipe.runtime.comm import collective_tensor

        flag = collective_tensor([0 if self.signum is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
