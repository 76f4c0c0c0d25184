"""The checkpoint directory's names: runs/NAME/checkpoints/ holds

    .partial-global_stepN/  a save in progress (DeepSpeed's files, then one rng-rankR.pt per rank)
    global_stepN/           the same directory renamed once every rank finished; dspipe.json inside marks it complete
    latest                  the newest complete tag, replaced atomically after the rename

Finding a checkpoint (--resume), reading `latest`, and which checkpoints a save keeps (retention). Imports no torch."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from dspipe.errors import SpecError, cannot_read, file_problem
from dspipe.runtime.reshard import UNIVERSAL_PREFIX

META_FILE = "dspipe.json"
LATEST_FILE = "latest"
PARTIAL_PREFIX = ".partial-"
TAG_RE = re.compile(r"^global_step([0-9]+)\Z")


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


@dataclass(frozen=True)
class Retention:
    """Which complete checkpoints a save keeps: the newest `last` (--keep-checkpoints), every one at a multiple of
    `every` steps for good (--keep-every, milestones; 0: none), and those `protect` names (the one this launch
    resumed from), besides the one `latest` names."""

    last: int
    every: int = 0
    protect: frozenset = field(default_factory=frozenset)
    """Checkpoint directory names never deleted."""


def to_delete(ckpt_dir: Path, keep: Retention | int) -> list[Path]:
    """Complete checkpoints `keep` (a Retention, or an int: the newest that many) does not keep, and leftovers of
    interrupted saves and resharding."""
    ckpt_dir = Path(ckpt_dir)
    keep = keep if isinstance(keep, Retention) else Retention(last=keep)
    complete = complete_checkpoints(ckpt_dir)
    kept = {p.name for _, p in complete[-keep.last :]} if keep.last > 0 else set()
    kept |= {p.name for step, p in complete if keep.every and step % keep.every == 0} | set(keep.protect)
    try:
        kept.add(read_latest(ckpt_dir))
    except SpecError:
        pass
    old = [p for _, p in complete if p.name not in kept]
    partial = (
        sorted(p for p in ckpt_dir.iterdir() if p.name.startswith((PARTIAL_PREFIX, UNIVERSAL_PREFIX)))
        if ckpt_dir.is_dir()
        else []
    )
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


def find_checkpoint(ckpt_dir: Path, resume: str, *, hint: str = "") -> Path | None:
    """The checkpoint `--resume` names: 'auto' = the newest complete one (None if there is none), else a tag
    under ckpt_dir or a path. A missing or partial checkpoint is a SpecError. `hint`: what to do about a bad
    `latest` (default: give --resume a complete checkpoint)."""
    ckpt_dir = Path(ckpt_dir)
    hint = hint or f"give --resume a complete checkpoint under {ckpt_dir}"
    if resume == "auto":
        latest = ckpt_dir / LATEST_FILE
        if latest.is_dir() or latest.is_symlink() and not latest.exists():
            raise SpecError(f"{latest} {file_problem(latest)}: it should name the newest checkpoint; {hint}")
        if latest.is_file():
            tag = read_latest(ckpt_dir, hint=hint)
            if not is_complete(ckpt_dir / tag):
                raise SpecError(
                    f"{latest} names {tag!r}, which is missing or incomplete; pass --resume "
                    f"with a complete checkpoint under {ckpt_dir}"
                )
        complete = complete_checkpoints(ckpt_dir)
        return complete[-1][1] if complete else None
    path = Path(resume)
    if not path.exists() and (ckpt_dir / resume).exists():
        path = ckpt_dir / resume
    if not path.is_dir():
        raise SpecError(f"checkpoint {resume} not found (neither a directory nor a tag under {ckpt_dir})")
    if not is_complete(path):
        raise SpecError(
            f"checkpoint {path} is incomplete (no {META_FILE}: its save was interrupted); "
            f"resume from a complete one, e.g. --resume auto"
        )
    return path


def read_latest(ckpt_dir: Path, *, hint: str = "") -> str:
    """The tag `latest` names: a global_stepN name (never a path), or a SpecError naming the file and ending with
    `hint` (default: give --resume a complete checkpoint)."""
    latest = Path(ckpt_dir) / LATEST_FILE
    try:
        tag = latest.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = None
    except OSError as e:
        raise cannot_read(latest, e) from None
    if tag is None or not TAG_RE.match(tag):
        shown = "bytes that are not UTF-8" if tag is None else repr(tag[:40])
        hint = hint or f"give --resume a complete checkpoint under {ckpt_dir}"
        raise SpecError(f"{latest} names {shown}, not a checkpoint tag global_stepN; {hint}")
    return tag
