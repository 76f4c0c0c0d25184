"""Progress with ETA on the console: the arithmetic, the formats, and what RunLog prints on a terminal (a bar that
rewrites itself) and off one (log lines)."""

import pytest

from dspipe.runtime.progress import Progress, duration, tokens


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_duration_and_token_formats():
    assert [duration(s) for s in (0, 42.4, 425, 3 * 3600 + 125, 2 * 86400 + 4 * 3600 + 59)] == [
        "0s",
        "42s",
        "7m05s",
        "3h02m",
        "2d04h",
    ]
    assert [tokens(n) for n in (950, 12_300, 4_190_000, 1.5e9, 3e14)] == ["950", "12.3K", "4.19M", "1.5B", "300T"]


def test_eta_is_remaining_steps_times_recent_step_time_without_the_warmup_step():
    clock = Clock()
    p = Progress(total_steps=100, tokens_per_step=4096, start_step=0, clock=clock)
    assert p.eta_s is None
    p.update(1, 5.0)  # the first step of a session (warm-up): all there is
    assert p.eta_s == pytest.approx(99 * 5.0)
    for step in range(2, 11):
        p.update(step, 0.5)
    clock.now += 9.5
    assert p.eta_s == pytest.approx(90 * 0.5)  # the warm-up step is left out
    assert p.fields() == "10/100 steps (10.0%) | 41K/410K tokens | elapsed 10s | ETA 45s"
    assert p.bar().startswith("[##......................] 10/100 steps")


def test_a_resumed_session_counts_from_where_it_resumed():
    p = Progress(total_steps=1000, tokens_per_step=1, start_step=600, clock=Clock())
    p.update(601, 2.0)
    p.update(602, 1.0)
    assert p.eta_s == pytest.approx(398 * 1.0)


def _row(step):
    return {
        "step": step,
        "tokens": step * 64,
        "loss": 5.0,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_s": 100.0,
        "samples_per_s": 1.0,
        "tflops_per_gpu": 0.1,
        "mfu": None,
        "mem_allocated_gib": 0.1,
        "mem_reserved_gib": 0.2,
        "step_time_s": 0.25,
        "skipped": 0,
        "forward_s": 0.08,
        "backward_s": 0.15,
        "optimizer_s": 0.01,
    }


@pytest.mark.parametrize("terminal", [False, True])
def test_runlog_prints_progress(tmp_path, capsys, terminal):
    from dspipe.runtime.metrics_log import RunLog

    log = RunLog(
        tmp_path,
        monitor=None,
        enabled=True,
        resumed_at=0,
        log_interval=5,
        steps=10,
        validating=False,
        tokens_per_step=64,
        terminal=terminal,
    )
    for step in range(1, 11):
        log.step(_row(step))
    log.close()
    captured = capsys.readouterr()
    out = captured.out
    assert "progress: " not in out  # a diagnostic: the "dspipe" logger's, on stderr (dspipe.log)
    progress = [line for line in captured.err.splitlines() if line.startswith("progress: ")]
    assert [p.split(" steps")[0] for p in progress] == ["progress: 1/10", "progress: 5/10", "progress: 10/10"]
    assert progress[-1].endswith("ETA 0s")
    bars = [chunk for chunk in out.split("\r\033[K") if chunk.startswith("[")]
    if terminal:  # one bar after every step but the last, each rewritten in place
        assert [b.split("] ")[1].split(" steps")[0] for b in bars] == [f"{s}/10" for s in range(1, 10)]
    else:
        assert bars == [] and "\r" not in out
