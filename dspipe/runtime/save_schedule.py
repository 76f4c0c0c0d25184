"""When the step loop saves: every --save-interval steps, or, for --save-interval auto, at an interval the run
re-plans after each save from what it measured: Young's sqrt(2 x C x M) with C the save's measured cost (the
time the step waited for it, plus ASYNC_DRAG of a background write) and the measured step time, by the formula
gen-config planned the first interval with (dspipe.planner.checkpoint_size.save_interval)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dspipe.planner.checkpoint_size import ASYNC_DRAG, save_cost_s, save_interval, span

if TYPE_CHECKING:
    from dspipe.runtime.ckpt_meta import CheckpointMeta, SaveRecord

STEP_WINDOW = 20
"""The step time an interval is planned with: the median of this many latest steps (a compiled run's first steps
and a slow one among them do not move it)."""


@dataclass
class SaveSchedule:
    every: int
    """Steps between saves now (0: only at the end and on a signal)."""
    auto: bool
    """Re-planned from each save's measured time (--save-interval auto)."""
    steps: int
    """The run's last step (saved by finish, not here)."""

    def due(self, step: int, *, saved_at: int) -> bool:
        """Whether the loop saves after `step`; `saved_at`: the step of the newest checkpoint this launch saved or
        resumed from (auto: `every` steps after it; else at the multiples of `every`, where --keep-every's
        milestones fall)."""
        if not self.every or step >= self.steps:
            return False
        return step >= saved_at + self.every if self.auto else step % self.every == 0


def resumed_schedule(*, every: int, auto: bool, steps: int, meta: CheckpointMeta | None) -> SaveSchedule:
    """The schedule of a launch; auto and resumed: the interval in force when its checkpoint was saved."""
    kept = meta.save_interval if meta is not None and meta.save_interval is not None else 0  # validated: an int >= 0
    if auto and kept:
        every = min(kept, max(1, steps))
    return SaveSchedule(every=every, auto=auto, steps=steps)


def step_time(step_times) -> float:
    """This rank's step time for planning: the median of its latest STEP_WINDOW steps (0 before any)."""
    latest = list(step_times)[-STEP_WINDOW:]
    return statistics.median(latest) if latest else 0.0


def replan(
    schedule: SaveSchedule, *, figures: SaveRecord, saved_step: int, step_s: float, world: int, mtbf_hours: float
) -> tuple[dict, str | None]:
    """After the save of `saved_step` completed with `figures` (checkpoint.complete's, every rank's slowest):
    the schedule's interval re-planned (in place) from its measured cost and `step_s` (the slowest rank's step
    time); returns (the event for events.jsonl, the line to print when the interval changed, else None)."""
    background = figures.mode == "async"
    cost = save_cost_s(blocking_s=figures.blocking_s, write_s=figures.write_s, async_save=background)
    got = save_interval(
        cost_s=cost,
        write_s=figures.write_s,
        step_time_s=step_s,
        world=world,
        steps=schedule.steps,
        async_save=background,
        mtbf_hours=mtbf_hours,
    )
    was, schedule.every = schedule.every, got.steps
    event = {
        "event": "save_interval",
        "step": saved_step,
        "interval": got.steps,
        "was": was,
        "cost_s": cost,
        "blocking_s": figures.blocking_s,
        "write_s": figures.write_s,
        "mode": figures.mode,
        "step_time_s": step_s,
        "world": world,
        "mtbf_hours": mtbf_hours,
    }
    if got.steps == was:
        return event, None
    what = (
        "the step waited"
        if not background
        else f"the step waited {figures.blocking_s:.3g} s + {ASYNC_DRAG:g} x the {figures.write_s:.3g} s write"
    )
    every = "every step" if got.steps == 1 else f"every {got.steps:,} steps"
    line = (
        f"--save-interval auto: {every} from step {saved_step:,} (was {was:,}): the save cost "
        f"{cost:.3g} s ({what}) at {step_s:.3g} s per step; Young's sqrt(2 x {cost:.3g} s x "
        f"{span(got.mtbf_s)} between failures) = {span(got.young_s)}"
    )
    if got.steps == got.floor and got.floor > 1:
        line += f"; no shorter than a write ({figures.write_s:.3g} s)"
    return event, line
