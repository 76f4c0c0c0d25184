"""Hang detection on every rank: a collective that does not return within the hang timeout is reported with the rank,
the operation, the step and the seconds it has waited, and the rank exits (HANG_EXIT), so that the launcher stops the
job and torch's elastic agent (`dspipe launch --max-restarts N`) restarts it from the newest complete checkpoint,
instead of every rank waiting until the process group's own timeout (30 minutes by default), or for ever where a
peer spins.

torch.distributed's collectives are wrapped once per process: DeepSpeed's communication layer
(deepspeed/comm/torch.py) looks them up on the torch.distributed module at each call, so every collective the engine,
ZeRO, the pipeline and dspipe issue passes through the wrapper. The wrapper notes the operation and the time it
entered (two attribute writes); a daemon thread checks every second. The watchdog is armed only while training steps
run (`armed()`): start-up, a resharding conversion and the final save may keep peers waiting far longer than a step,
and do so legitimately. A `async_op=True` collective counts until it returns its work handle.

A test injects the hang (dspipe.runtime.faults: `hang_at_step`): the chosen rank sleeps inside its first collective of
that step, as a rank stuck in a collective does. No torch import at module level."""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from dspipe.errors import SpecError
from dspipe.log import get_logger

MAX_HANG_TIMEOUT_S = 7 * 86400
MIN_HANG_TIMEOUT_S = 1
"""The shortest --hang-timeout besides 0: a collective of a healthy step may take a good part of a second."""
HANG_EXIT = 75
"""A rank's exit code after a detected hang (EX_TEMPFAIL: the job may succeed when restarted)."""
EVENTS_FILE = "events.jsonl"
"""The run directory's log of what happened to the job (hangs, restarts at another world size): one JSON per line."""
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "all_to_all",
    "all_to_all_single",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "all_reduce_coalesced",
    "batch_isend_irecv",
)


def check_hang_timeout(seconds: float) -> float:
    """--hang-timeout: 0 (off), or 1 s .. a week (below a second, a step's own collectives would end the job);
    anything else is one line."""
    if not (seconds == 0 or MIN_HANG_TIMEOUT_S <= seconds <= MAX_HANG_TIMEOUT_S):
        raise SpecError(
            f"--hang-timeout {seconds:g} must be 0 (off) or in {MIN_HANG_TIMEOUT_S}..{MAX_HANG_TIMEOUT_S} seconds"
        )
    return seconds


def utc_now() -> str:
    """The time as events.jsonl writes it ('2026-11-27T23:59:59Z': string order is time order)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def record_event(run_path: Path, event: dict) -> None:
    """Append one event line to the run's events.jsonl (one write of one whole line; O_APPEND keeps lines whole)."""
    line = json.dumps({"time": utc_now(), **event}) + "\n"
    fd = os.open(Path(run_path) / EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_events(run_path: Path) -> list[dict]:
    """The run's events, oldest first: each line's JSON object (a torn line, from a kill, and a line that is not an
    object are left out)."""
    return read_event_lines(run_path)[0]


def read_event_lines(run_path: Path) -> tuple[list[dict], int]:
    """(The run's events, oldest first; how many non-empty lines were left out: torn by a kill, or not a JSON
    object)."""
    path = Path(run_path) / EVENTS_FILE
    if not path.is_file():
        return [], 0
    events, left_out = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if isinstance(event, dict):
            events.append(event)
        elif line.strip():
            left_out += 1
    return events, left_out


class Watchdog:
    """One per rank: `install()` wraps the collectives, `armed()` around the training steps, `step` set by the loop."""

    def __init__(
        self,
        *,
        timeout_s: float,
        rank: int,
        run_path: Path,
        world: int = 1,
        hang_step: int | None = None,
        clock=time.monotonic,
        exit=os._exit,
        sleep=time.sleep,
    ):
        self.timeout_s, self.rank, self.world, self.run_path = float(timeout_s), rank, world, Path(run_path)
        self.clock, self.exit, self.sleep = clock, exit, sleep
        self.hang_step = hang_step
        """The step in whose first collective this rank sleeps (a test's injected hang), or None."""
        self.step = 0
        self.op: str | None = None
        self.since = 0.0
        self.depth = 0
        self.on = False
        self._thread: threading.Thread | None = None

    # -- the wrapper's side (the training thread) --
    def enter(self, name: str) -> None:
        self.depth += 1
        if self.depth == 1:  # all_gather_object calls all_gather: the outer operation is the one named
            self.op, self.since = name, self.clock()
            if self.on and self.hang_step == self.step:
                self.hang_step = None
                self.sleep(10 * self.timeout_s + 3600)  # stuck inside the collective; the watchdog ends it

    def leave(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.op = None

    def install(self) -> None:
        """Wrap torch.distributed's collectives (once per process) so that they report to this watchdog."""
        import torch.distributed as dist

        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None or getattr(fn, "__dspipe_watchdog__", None) is not None:
                continue
            setattr(dist, name, _wrapped(fn, name, self))

    # -- the watching side --
    @contextmanager
    def armed(self):
        """Watch the collectives inside the with-block (the training steps)."""
        if self.timeout_s <= 0:
            yield
            return
        self.on = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="dspipe-watchdog", daemon=True)
            self._thread.start()
        try:
            yield
        finally:
            self.on = False

    @contextmanager
    def paused(self):
        """Not watching inside the with-block (a checkpoint write inside the armed steps)."""
        was, self.on = self.on, False
        try:
            yield
        finally:
            self.on = was

    def stuck(self) -> tuple[str, float] | None:
        """(operation, seconds in it) when the armed rank has been inside one collective past the timeout."""
        op, since = self.op, self.since
        if not self.on or op is None:
            return None
        waited = self.clock() - since
        return (op, waited) if waited > self.timeout_s else None

    def _watch(self) -> None:
        interval = min(1.0, max(0.05, self.timeout_s / 10))
        while True:
            time.sleep(interval)
            found = self.stuck()
            if found:
                self.report(*found)
                return

    def report(self, op: str, waited: float) -> None:
        """Say which rank hangs in which collective, record it in events.jsonl, and end the rank (HANG_EXIT)."""
        line = (
            f"dspipe: hang: rank {self.rank} has been inside {op} for {waited:.0f} s at step {self.step} "
            f"(hang timeout {self.timeout_s:g} s); stopping the job so that it restarts from the newest checkpoint"
        )
        sys.stderr.write(line + "\n")  # one write: the ranks' lines do not interleave
        sys.stderr.flush()
        try:
            record_event(
                self.run_path,
                {
                    "event": "hang",
                    "rank": self.rank,
                    "world": self.world,
                    "op": op,
                    "step": self.step,
                    "seconds": round(waited, 1),
                    "timeout_s": self.timeout_s,
                },
            )
        except OSError as e:
            get_logger(__name__).warning(
                f"dspipe: could not record the hang in {self.run_path / EVENTS_FILE}: {e}", extra={"all_ranks": True}
            )  # this rank's own failure
        sys.stdout.flush()
        self.exit(HANG_EXIT)


def _wrapped(fn, name: str, watchdog: Watchdog):
    @functools.wraps(fn)
    def collective(*args, **kwargs):
        watchdog.enter(name)
        try:
            return fn(*args, **kwargs)
        finally:
            watchdog.leave()

    collective.__dspipe_watchdog__ = watchdog
    return collective


NO_EVENTS = "no events"
"""events_text's answer when none of the events is one it tells (a run's host-buffer allocation is not)."""


def _hang_key(event: dict) -> tuple:
    return event.get("step"), event.get("op"), event.get("world")


def events_text(events: list[dict]) -> str:
    """One line on what happened to a job, from its events: each hang (the ranks, the operation, the step) and each
    restart (the step it resumed from, the ranks it ran on, a changed layout), the save interval's re-planning."""
    parts = []
    hangs: dict[tuple, list[int]] = {}
    for e in events:
        if e.get("event") == "hang":  # a damaged line's list or object where a number was: told as written
            key = tuple(v if isinstance(v, int | float | str | None) else json.dumps(v) for v in _hang_key(e))
            hangs.setdefault(key, []).append(e.get("rank"))
        elif e.get("event") == "restart":
            parts.append(
                f"restart {e.get('attempt')} resumed at step {e.get('step')} on {e.get('world')} ranks"
                + (f" ({e['resized']})" if e.get("resized") else "")
            )
    found = []
    for (step, op, world), ranks in hangs.items():
        waited = sorted(r for r in ranks if isinstance(r, int))
        others = sorted(set(range(world)) - set(waited)) if isinstance(world, int) and world <= 64 else []
        found.append(
            f"hang at step {step}: rank(s) {', '.join(map(str, waited))} waited inside {op}"
            + (f" (not rank(s) {', '.join(map(str, others))})" if others else "")
        )
    planned = [e for e in events if e.get("event") == "save_interval"]
    if planned:  # dspipe.runtime.save_schedule
        parts.append(
            f"--save-interval auto re-planned after {len(planned)} save(s): {planned[0].get('was')} -> "
            f"{planned[-1].get('interval')} steps"
        )
    return "; ".join(found + parts) or NO_EVENTS
