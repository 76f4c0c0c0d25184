"""Checkpoints of a run: every N steps, at the end and on SIGTERM/SIGINT; keep the last K; resume exactly.

Layout of runs/NAME/checkpoints/:

    .partial-global_stepN/  a save in progress (DeepSpeed's files, then one rng-rankR.pt per rank)
    global_stepN/           the same directory renamed once every rank finished; dspipe.json inside marks it complete
    latest                  the newest complete tag, replaced atomically after the rename

A process killed during a save leaves only a .partial-* directory (deleted by the next save or resume), so
`latest` always names a complete checkpoint. The pure functions here import no torch."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
from dataclasses import asdict
from pathlib import Path

from dspipe.atomic import replace_dir
from dspipe.errors import SpecError

META_FILE = "dspipe.json"
LATEST_FILE = "latest"
PARTIAL_PREFIX = ".partial-"
TAG_RE = re.compile(r"^global_step(\d+)$")
TEST_KILL_AT_STEP = "DSPIPE_TEST_KILL_AT_STEP"  # test-only: SIGKILL every rank right after this step
TEST_KILL_IN_SAVE = "DSPIPE_TEST_KILL_IN_SAVE"  # test-only: SIGKILL every rank inside the save at this step


def tag_for(step: int) -> str:
    return f"global_step{step}"


def is_complete(path: Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def complete_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := TAG_RE.match(p.name)) and is_complete(p)]
    return sorted(found)


def to_delete(ckpt_dir: Path, keep: int) -> list[Path]:
    """Complete checkpoints beyond the newest `keep`, and leftovers of interrupted saves."""
    ckpt_dir = Path(ckpt_dir)
    old = [p for _, p in complete_checkpoints(ckpt_dir)[:-keep]] if keep > 0 else []
    partial = sorted(p for p in ckpt_dir.iterdir() if p.name.startswith(PARTIAL_PREFIX)) if ckpt_dir.is_dir() else []
    return old + partial


def write_atomic(path: Path, text: str) -> None:
    """Write a sibling temp file, fsync it, rename it over `path`: readers see the old or the new content."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def find_checkpoint(ckpt_dir: Path, resume: str) -> Path | None:
    """The checkpoint `--resume` names: 'auto' = the newest complete one (None if there is none), else a tag
    under ckpt_dir or a path. A missing or partial checkpoint is a SpecError."""
    ckpt_dir = Path(ckpt_dir)
    if resume == "auto":
        latest = ckpt_dir / LATEST_FILE
        if latest.is_file():
            tag = latest.read_text().strip()
            if not is_complete(ckpt_dir / tag):
                raise SpecError(f"{latest} names {tag!r}, which is missing or incomplete; pass --resume "
                                f"with a complete checkpoint under {ckpt_dir}")
        complete = complete_checkpoints(ckpt_dir)
        return complete[-1][1] if complete else None
    path = Path(resume)
    if not path.exists() and (ckpt_dir / resume).exists():
        path = ckpt_dir / resume
    if not path.is_dir():
        raise SpecError(f"checkpoint {resume} not found (neither a directory nor a tag under {ckpt_dir})")
    if not is_complete(path):
        raise SpecError(f"checkpoint {path} is incomplete (no {META_FILE}: its save was interrupted); "
                        f"resume from a complete one, e.g. --resume auto")
    return path


def read_meta(path: Path) -> dict:
    try:
        return json.loads((Path(path) / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise SpecError(f"checkpoint {path}: cannot read {META_FILE}: {e}") from None


def check_compatible(meta: dict, run, path: Path) -> None:
    """Refuse a checkpoint whose model shape, pipeline stages or ZeRO stage differ from this run's.
    A different data-parallel size is fine: the loader keeps the global sample order."""
    saved, now = meta["model"], asdict(run.model)
    diff = [f"{k} {saved.get(k)} -> {now[k]}" for k in now if k != "name" and saved.get(k) != now[k]]
    if diff:
        raise SpecError(f"checkpoint {path} holds a different model shape: {', '.join(diff)}")
    for key, value in (("pp", run.plan.pp), ("zero_stage", run.plan.zero_stage)):
        if meta[key] != value:
            raise SpecError(f"checkpoint {path} was saved with {key} {meta[key]}, this run has {key} {value}; "
                            f"resume with the same {key}")


def trim_metrics(path: Path, step: int) -> None:
    """Keep the header and the rows of steps <= `step` (rows after a resumed step are rewritten)."""
    path = Path(path)
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = lines[:1] + [line for line in lines[1:] if line.split(",", 1)[0].isdigit()
                        and int(line.split(",", 1)[0]) <= step]
    write_atomic(path, "".join(kept))


def maybe_test_kill(var: str, step: int) -> None:
    """Test-only hook: SIGKILL this process when env var `var` equals `step` (simulates a crash)."""
    if os.environ.get(var) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


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

        flag = torch.tensor([0 if self.signum is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def rng_state() -> dict:
    import random

    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(engine, ckpt_dir: Path, *, step: int, meta: dict, keep: int) -> Path:
    """Collective: every rank calls it. Partial dir -> DeepSpeed files + per-rank RNG -> barrier -> rank 0 writes
    the meta (complete mark), renames into place, replaces `latest` atomically, deletes beyond the last `keep`."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    ckpt_dir, tag = Path(ckpt_dir), tag_for(step)
    partial, final = ckpt_dir / (PARTIAL_PREFIX + tag), ckpt_dir / tag
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    client = {"step": step, "consumed_samples": meta["consumed_samples"], "data": meta["data"]}
    engine.save_checkpoint(str(ckpt_dir), tag=partial.name, client_state=client, save_latest=False)
    torch.save(rng_state(), partial / f"rng-rank{rank}.pt")
    maybe_test_kill(TEST_KILL_IN_SAVE, step)
    dist.barrier()
    if rank == 0:
        write_atomic(partial / META_FILE, json.dumps(meta, indent=2) + "\n")
        replace_dir(partial, final)  # the same step may have been saved before (resumed from an older one)
        write_atomic(ckpt_dir / LATEST_FILE, tag)
        for p in to_delete(ckpt_dir, keep):
            shutil.rmtree(p, ignore_errors=True)
    dist.barrier()
    return final


def load(engine, path: Path, loader) -> dict:
    """Collective: DeepSpeed state, data position and this rank's RNG from a complete checkpoint; returns meta."""
    import torch
    import torch.distributed as dist

    path = Path(path)
    meta = read_meta(path)
    load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name)
    if load_path is None:
        raise SpecError(f"DeepSpeed could not load checkpoint {path}")
    loader.load_state_dict(meta["data"])
    rng = path / f"rng-rank{dist.get_rank()}.pt"
    if rng.is_file():
        set_rng_state(torch.load(rng, weights_only=False))
    return meta


def checkpoint_meta(run, *, step: int, loader, world: int) -> dict:
    """What dspipe.json in a checkpoint holds: position, data state and the shape it was saved with."""
    return {"step": step, "consumed_samples": loader.consumed_samples, "data": loader.state_dict(),
            "model": asdict(run.model), "pp": run.plan.pp, "zero_stage": run.plan.zero_stage, "dp": run.plan.dp,
            "world_size": world}


def resume_point(run, resume: str | None) -> Path | None:
    """The checkpoint to resume from, checked against the run; without --resume, refuse to overwrite checkpoints."""
    if resume is None:
        existing = complete_checkpoints(run.checkpoint_dir)
        if existing:
            raise SpecError(f"{run.checkpoint_dir} already holds checkpoints up to step {existing[-1][0]}; pass "
                            f"--resume auto to continue (or delete that directory to start over)")
        return None
    path = find_checkpoint(run.checkpoint_dir, resume)
    if path is not None:
        check_compatible(read_meta(path), run, path)
    return path
