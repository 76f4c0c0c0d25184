"""Hang detection (dspipe.runtime.watchdog): a collective that outlasts the hang timeout is reported with the rank, the
operation and the step, recorded in events.jsonl, and ends the rank with HANG_EXIT; unarmed or paused, nothing is
watched. Driven by a fake clock and a fake exit: no ranks start."""

import json
import threading

import pytest
import torch.distributed as dist

from dspipe.runtime.watchdog import (
    COLLECTIVES,
    EVENTS_FILE,
    HANG_EXIT,
    Watchdog,
    events_text,
    read_events,
    record_event,
)


@pytest.fixture(autouse=True)
def restored_collectives(monkeypatch):
    """install() replaces torch.distributed's functions: put every one back after each test."""
    for name in COLLECTIVES:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, getattr(dist, name))


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def watchdog(tmp_path, **kw):
    exits = []
    clock = Clock()
    w = Watchdog(timeout_s=30, rank=3, world=4, run_path=tmp_path, clock=clock, exit=exits.append, **kw)
    return w, clock, exits


def test_a_collective_past_the_timeout_is_reported_and_ends_the_rank(tmp_path, capsys):
    w, clock, exits = watchdog(tmp_path)
    w.on, w.step = True, 12
    w.enter("all_reduce")
    clock.now += 29
    assert w.stuck() is None  # inside the timeout
    clock.now += 2
    assert w.stuck() == ("all_reduce", 31)
    w.report(*w.stuck())
    assert exits == [HANG_EXIT]
    line = capsys.readouterr().err.strip()
    assert line == (
        "dspipe: hang: rank 3 has been inside all_reduce for 31 s at step 12 (hang timeout 30 s); "
        "stopping the job so that it restarts from the newest checkpoint"
    )
    (event,) = read_events(tmp_path)
    assert {k: event[k] for k in ("event", "rank", "world", "op", "step", "seconds")} == {
        "event": "hang",
        "rank": 3,
        "world": 4,
        "op": "all_reduce",
        "step": 12,
        "seconds": 31.0,
    }


def test_nothing_is_watched_unarmed_paused_or_between_collectives(tmp_path):
    w, clock, _ = watchdog(tmp_path)
    w.enter("barrier")
    clock.now += 1000
    assert w.stuck() is None  # not armed (start-up, final save)
    w.on = True
    assert w.stuck() == ("barrier", 1000)
    with w.paused():  # a save inside the steps
        assert w.stuck() is None
    assert w.on
    w.leave()
    assert w.stuck() is None  # no collective in progress


def test_the_outer_collective_is_the_one_named(tmp_path):
    w, clock, _ = watchdog(tmp_path)
    w.on = True
    w.enter("all_gather_object")
    clock.now += 5
    w.enter("all_gather")  # called by all_gather_object
    w.leave()
    clock.now += 26
    assert w.stuck() == ("all_gather_object", 31)
    w.leave()
    assert w.op is None


def test_install_wraps_torch_distributed_collectives_once(tmp_path, monkeypatch):
    calls = []
    for name in ("all_reduce", "barrier"):
        monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: calls.append((_n, w.op)) or "work")
    w, _, _ = watchdog(tmp_path)
    w.install()
    first = dist.all_reduce
    w.install()  # idempotent: not wrapped twice
    assert dist.all_reduce is first and dist.all_reduce.__dspipe_watchdog__ is w
    assert dist.all_reduce("t") == "work" and dist.barrier() == "work"
    assert calls == [("all_reduce", "all_reduce"), ("barrier", "barrier")]  # named while inside
    assert w.op is None and w.depth == 0
    assert {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "send", "recv"} <= set(
        COLLECTIVES
    )


def test_the_injected_hang_sleeps_once_inside_the_collective(tmp_path, monkeypatch):
    slept = []
    w = Watchdog(timeout_s=30, rank=1, world=2, run_path=tmp_path, hang_step=4, sleep=slept.append)
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: None)
    w.install()
    w.on, w.step = True, 3
    dist.all_reduce("t")
    assert slept == []
    w.step = 4
    dist.all_reduce("t")
    dist.all_reduce("t")
    assert slept == [3900]  # inside the step's first collective only (the watchdog ends a real one)


def test_armed_watch_thread_fires(tmp_path):
    exits = []
    fired = threading.Event()
    w = Watchdog(timeout_s=0.2, rank=0, world=2, run_path=tmp_path, exit=lambda c: (exits.append(c), fired.set()))
    with w.armed():
        w.step = 9
        w.enter("broadcast")
        assert fired.wait(5)
    assert exits == [HANG_EXIT] and read_events(tmp_path)[0]["op"] == "broadcast"


def test_events_text_names_the_ranks_and_the_restarts(tmp_path):
    record_event(tmp_path, {"event": "restart", "attempt": 1, "world": 4, "step": 4})
    for rank in (1, 2, 3):
        record_event(tmp_path, {"event": "hang", "rank": rank, "world": 4, "op": "all_reduce", "step": 7})
    record_event(tmp_path, {"event": "restart", "attempt": 2, "world": 2, "step": 6, "resized": "dp 2 -> 1"})
    with open(tmp_path / EVENTS_FILE, "a") as f:
        f.write('{"event": "hang", "ra')  # a torn last line (a kill while writing) is left out
    events = read_events(tmp_path)
    assert len(events) == 5
    assert events_text(events) == (
        "hang at step 7: rank(s) 1, 2, 3 waited inside all_reduce (not rank(s) 0); "
        "restart 1 resumed at step 4 on 4 ranks; restart 2 resumed at step 6 on 2 ranks "
        "(dp 2 -> 1)"
    )
    assert events_text([]) == "no events"
    assert events_text([{"event": "host_buffers", "step": 1, "bytes": 10, "seconds": 0.1}]) == "no events"
    assert all(json.loads(line) for line in (tmp_path / EVENTS_FILE).read_text().splitlines()[:5])
