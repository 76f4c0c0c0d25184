"""When the step loop saves (dspipe.runtime.save_schedule): fixed intervals at their multiples, --save-interval auto
re-planned from each save's measured figures by the planner's formula; the launch that follows the re-planned
interval is tests/distributed/test_resume.py's."""

import math

import pytest

from dspipe.errors import SpecError
from dspipe.planner.checkpoint_size import ASYNC_DRAG, save_interval
from dspipe.runtime import ckpt_meta, ckpt_tags
from dspipe.runtime.save_schedule import SaveSchedule, replan, resumed_schedule, step_time
from dspipe.runtime.watchdog import events_text
from tests.helpers import meta_of


def test_a_fixed_interval_saves_at_its_multiples_and_never_at_the_last_step():
    s = SaveSchedule(every=3, auto=False, steps=10)
    assert [step for step in range(1, 11) if s.due(step, saved_at=1)] == [3, 6, 9]  # milestones stay multiples
    assert not any(SaveSchedule(every=0, auto=False, steps=10).due(step, saved_at=0) for step in range(1, 11))


def test_auto_counts_from_the_newest_save():
    s = SaveSchedule(every=4, auto=True, steps=20)
    assert [step for step in range(6, 12) if s.due(step, saved_at=5)] == [9, 10, 11]  # from 5 + 4 on, until saved
    assert not s.due(20, saved_at=5)  # the last step: finish saves it


def test_resumed_auto_keeps_the_interval_in_force_when_the_checkpoint_was_saved():
    assert resumed_schedule(every=9, auto=True, steps=50, meta=meta_of(save_interval=4)).every == 4
    assert resumed_schedule(every=9, auto=False, steps=50, meta=meta_of(save_interval=4)).every == 9  # fixed: as given
    assert resumed_schedule(every=9, auto=True, steps=50, meta=meta_of(step=3)).every == 9  # saved before: planned
    assert resumed_schedule(every=9, auto=True, steps=3, meta=meta_of(save_interval=4)).every == 3  # never past the end
    assert resumed_schedule(every=9, auto=True, steps=50, meta=None).every == 9


def test_a_checkpoints_save_interval_is_validated(tmp_path):
    d = tmp_path / "global_step3"
    d.mkdir()
    (d / ckpt_tags.META_FILE).write_text(
        '{"step": 3, "consumed_samples": 48, "data": {}, "model": {}, "pp": 1, '
        '"dp": 2, "zero_stage": 1, "world_size": 2, "save_interval": "soon"}'
    )
    with pytest.raises(SpecError, match=r"dspipe.json: save_interval must be an integer >= 0, got 'soon'"):
        ckpt_meta.read_meta(d)


def test_step_time_is_the_median_of_the_latest_steps():
    assert step_time([]) == 0.0
    assert step_time([9.0, 1.0, 1.2, 1.1]) == pytest.approx(1.15)
    assert step_time([100.0] * 5 + [1.0] * 20) == 1.0  # only the latest 20


def figures(*, mode: str, blocking_s: float, write_s: float) -> ckpt_meta.SaveRecord:
    """A completed save's figures (checkpoint.complete's) with the times replan reads."""
    return ckpt_meta.SaveRecord(
        mode=mode,
        completed_after_step=9,
        blocking_s=blocking_s,
        write_s=write_s,
        writer_cpu_s=0.0,
        rank_max_bytes=0,
        bytes=None,
    )


def test_replan_uses_the_measured_cost_and_says_when_it_changes():
    s = SaveSchedule(every=9, auto=True, steps=1000)
    sync = figures(mode="sync", blocking_s=2.0, write_s=2.0)
    event, line = replan(s, figures=sync, saved_step=9, step_s=0.5, world=8, mtbf_hours=1.0)
    mtbf_s = 3600 / 8
    assert s.every == event["interval"] == round(math.sqrt(2 * 2.0 * mtbf_s) / 0.5) == 85
    assert (event["was"], event["cost_s"], event["step_time_s"]) == (9, 2.0, 0.5)
    assert line == (
        "--save-interval auto: every 85 steps from step 9 (was 9): the save cost 2 s (the step waited) "
        "at 0.5 s per step; Young's sqrt(2 x 2 s x 7m30s between failures) = 42.4 s"
    )
    assert replan(s, figures=sync, saved_step=94, step_s=0.5, world=8, mtbf_hours=1.0)[1] is None  # unchanged
    # a background write costs the copy the step waited for plus ASYNC_DRAG of the write, and the next save waits
    # for it: never sooner than one write
    background = figures(mode="async", blocking_s=0.1, write_s=200.0)
    event, line = replan(s, figures=background, saved_step=179, step_s=0.5, world=8, mtbf_hours=1.0)
    cost = 0.1 + ASYNC_DRAG * 200.0
    assert event["cost_s"] == pytest.approx(cost) and round(math.sqrt(2 * cost * mtbf_s) / 0.5) == 329
    assert (
        event["interval"]
        == save_interval(
            cost_s=cost, write_s=200.0, step_time_s=0.5, world=8, steps=1000, async_save=True, mtbf_hours=1.0
        ).steps
        == 400
    )  # 200 s / 0.5 s
    assert line.endswith("; no shorter than a write (200 s)")
    assert "the step waited 0.1 s + 0.15 x the 200 s write" in line
    assert events_text([event]) == "--save-interval auto re-planned after 1 save(s): 85 -> 400 steps"
