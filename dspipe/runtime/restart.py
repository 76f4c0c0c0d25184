"""`--restart`: the run's training outputs move into runs/NAME/previous/<UTC timestamp>/, nothing is deleted."""

from __future__ import annotations

import os
from pathlib import Path

PREVIOUS_DIR = "previous"
RUN_OUTPUTS = (
    "checkpoints",
    "metrics.csv",
    "metrics.rewound.csv",
    "val_metrics.csv",
    "engine.json",
    "monitor",
    "events.jsonl",
)
"""What a run writes while training; `--restart` moves these into previous/<UTC timestamp>/."""


def previous_slot(run_path: Path, *, now: str) -> Path:
    """runs/NAME/previous/<now>/, or <now>-2, -3... when that name is taken (two restarts in one second)."""
    base = Path(run_path) / PREVIOUS_DIR
    slot, n = base / now, 1
    while slot.exists():
        n += 1
        slot = base / f"{now}-{n}"
    return slot


def move_to_previous(run_path: Path, *, now: str) -> tuple[Path | None, list[str]]:
    """Move the run's training outputs (RUN_OUTPUTS that exist) into previous/<now>/ by rename, deleting nothing;
    returns (that directory, the names moved), or (None, []) when there was nothing to move. `now` is a UTC
    timestamp such as 20261123T093012Z."""
    run_path = Path(run_path)
    present = [name for name in RUN_OUTPUTS if os.path.lexists(run_path / name)]
    if not present:
        return None, []
    slot = previous_slot(run_path, now=now)
    slot.mkdir(parents=True)
    for name in present:
        os.rename(run_path / name, slot / name)
    return slot, present


def utc_stamp() -> str:
    import time

    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
