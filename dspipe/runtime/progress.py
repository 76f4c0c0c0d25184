"""Training progress for the console: steps and tokens done of the total, elapsed time and the ETA from the recent
step times (this session's; a resumed run counts from where it resumed). A bar that rewrites itself on a terminal,
plain log lines otherwise. Pure arithmetic and formatting: no torch."""

from __future__ import annotations

import time
from collections import deque

from dspipe.spec.values import TOKEN_SCALE

WINDOW = 20
"""Step times the ETA averages over (the first step of a session, with its warm-up, is left out once others exist)."""
BAR = 24


def duration(seconds: float) -> str:
    """'42s', '7m05s', '3h02m', '2d04h'."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def tokens(count: float) -> str:
    """'950', '12.3K', '4.19M', '1.5B', '300T'."""
    for unit in ("T", "B", "M", "K"):  # the suffixes --tokens reads
        scale = TOKEN_SCALE[unit]
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return f"{count:.0f}"


class Progress:
    """Where training stands: `update(step, step_time_s)` after each step, then `line()` or `bar()`."""

    def __init__(self, *, total_steps: int, tokens_per_step: int, start_step: int, clock=time.perf_counter):
        self.total, self.tokens_per_step, self.start_step, self.clock = total_steps, tokens_per_step, start_step, clock
        self.started = clock()
        self.times: deque[float] = deque(maxlen=WINDOW + 1)
        self.step = start_step

    def update(self, step: int, step_time_s: float) -> None:
        self.step = step
        self.times.append(step_time_s)

    @property
    def elapsed_s(self) -> float:
        return self.clock() - self.started

    @property
    def eta_s(self) -> float | None:
        """Remaining steps x the mean recent step time (None before the first step)."""
        if not self.times:
            return None
        recent = (
            list(self.times)[1:]
            if len(self.times) > 1 and self.step - self.start_step == len(self.times)
            else list(self.times)
        )  # drop the session's first (warm-up) step while it is in the window
        recent = recent[-WINDOW:]
        return (self.total - self.step) * sum(recent) / len(recent)

    def fields(self) -> str:
        """'12/100 steps (12.0%) | 49.2K/410K tokens | elapsed 1m02s | ETA 7m40s'."""
        pct = 100.0 * self.step / self.total if self.total else 100.0
        eta = self.eta_s
        return (
            f"{self.step}/{self.total} steps ({pct:.1f}%) | {tokens(self.step * self.tokens_per_step)}/"
            f"{tokens(self.total * self.tokens_per_step)} tokens | elapsed {duration(self.elapsed_s)} | "
            f"ETA {'-' if eta is None else duration(eta)}"
        )

    def bar(self) -> str:
        """A one-line bar for a terminal: '[#######.................] 12/100 steps (12.0%) | ...'."""
        done = int(BAR * self.step / self.total) if self.total else BAR
        return "[" + "#" * done + "." * (BAR - done) + "] " + self.fields()
