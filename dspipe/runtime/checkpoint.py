"""Checkpoints of a run: every N steps, at the end and on SIGTERM/SIGINT; keep the last K and every M-th step's;
resume exactly.

Layout of runs/NAME/checkpoints/:

    .partial-global_stepN/  a save in progress (DeepSpeed's files, then one rng-rankR.pt per rank)
    global_stepN/           the same directory renamed once every rank finished; dspipe.json inside marks it complete
    latest                  the newest complete tag, replaced atomically after the rename

`save` writes the files in the step, or hands them to the rank's background writer (dspipe.runtime.async_save);
`complete` (at a step's end) agrees that every rank's files are written before the complete mark, the rename and
`latest`. A process killed during a save or its background write leaves only a .partial-* directory (deleted by
the next save or resume), so `latest` always names a complete checkpoint. A save that fails to write (disk full, quota, I/O error) on any rank
is agreed on by every rank: the partial directory is removed and every rank raises one SpecError naming the
intact checkpoint.

Resuming under another layout (dp, tp, pp): dspipe/runtime/reshard.py. The pure functions here import no torch."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dspipe.atomic import replace_dir
from dspipe.errors import SpecError, cannot_read
from dspipe.jsonio import read_object, show
from dspipe.spec.core import DATA_ORDERS, ZERO_STAGES, ModelSpec, from_dict
from dspipe.rundir import SPEC_FILE
from dspipe.runtime.ckptfiles import check_checkpoint
from dspipe.runtime.faults import NO_FAULTS, Faults
from dspipe.runtime.experts import expert_parallel
from dspipe.runtime.reshard import (MOE_RESHARD, UNIVERSAL_PREFIX, layout_change_refusal, load_resharded,
                                    pipeline_names)
from dspipe.runtime.safeload import load as safe_load, weights_only_loads
from dspipe.runtime.writefail import WriteFailures, free_mib

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
    kept = {p.name for _, p in complete[-keep.last:]} if keep.last > 0 else set()
    kept |= {p.name for step, p in complete if keep.every and step % keep.every == 0} | set(keep.protect)
    try:
        kept.add(read_latest(ckpt_dir))
    except SpecError:
        pass
    old = [p for _, p in complete if p.name not in kept]
    partial = sorted(p for p in ckpt_dir.iterdir() if p.name.startswith((PARTIAL_PREFIX, UNIVERSAL_PREFIX))
                     ) if ckpt_dir.is_dir() else []
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
            tag = read_latest(ckpt_dir)
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
    """A checkpoint's dspipe.json, validated: the keys and types every reader uses (step, position, data state,
    model shape, pp, ZeRO stage, dp x pp = world size). Anything else is one SpecError naming the file and field."""
    source = Path(path) / META_FILE
    meta = read_object(source)
    missing = [k for k in CHECKPOINT_KEYS if k not in meta]
    if missing:
        raise SpecError(f"{source}: missing key {', '.join(missing)}")

    def count(key: str, value, low: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise SpecError(f"{source}: {key} must be an integer >= {low}, got {show(value)}")

    for key, low in (("step", 0), ("consumed_samples", 0), ("pp", 1), ("dp", 1), ("world_size", 1)):
        count(key, meta[key], low)
    if meta["zero_stage"] not in ZERO_STAGES or isinstance(meta["zero_stage"], bool):
        raise SpecError(f"{source}: zero_stage {show(meta['zero_stage'])} is not one of: "
                        f"{', '.join(map(str, ZERO_STAGES))}")
    if "save_interval" in meta:  # the interval in force when saved (absent before --save-interval auto re-planned)
        count("save_interval", meta["save_interval"], 0)
    for key in ("tp", "sp", "ep"):  # absent in checkpoints saved before tensor/sequence/expert parallelism: 1
        count(key, meta.setdefault(key, 1), 1)
    ranks = meta["dp"] * meta["pp"] * meta["tp"] * meta["sp"]
    if ranks != meta["world_size"]:
        raise SpecError(f"{source}: dp {meta['dp']} x pp {meta['pp']} x tp {meta['tp']} x sp {meta['sp']} = {ranks} "
                        f"!= world_size {meta['world_size']}")
    try:
        model = from_dict(ModelSpec, meta["model"])
    except (SpecError, TypeError) as e:
        raise SpecError(f"{source}: model: {e}") from None
    if meta["pp"] > model.layers:
        raise SpecError(f"{source}: pp {meta['pp']} > model.layers {model.layers}")
    data = meta["data"]
    if not isinstance(data, dict):
        raise SpecError(f"{source}: data must be an object (the loader's position), got {type(data).__name__}")
    blend = "sources" in data  # a blend of data directories (dspipe.data.blend.BlendLoader.state_dict)
    counts = (("consumed_samples", 0), ("seed", 0), ("seq_len", 1), *(() if blend else (("num_samples", 1),)))
    for key, low in counts:
        if key not in data:
            raise SpecError(f"{source}: missing data.{key}")
        count(f"data.{key}", data[key], low)
    for key in ("split", *(() if blend else ("fingerprint",))):
        if not isinstance(data.get(key), str):
            raise SpecError(f"{source}: data.{key} must be a string, got {show(data.get(key))}")
    if data.get("order", "dspipe") not in DATA_ORDERS:  # absent before --data-order: dspipe's
        raise SpecError(f"{source}: data.order {show(data.get('order'))} is not one of: {', '.join(DATA_ORDERS)}")
    if blend:
        _check_blend_state(source, data, count)
    if data["consumed_samples"] != meta["consumed_samples"]:
        raise SpecError(f"{source}: data.consumed_samples {data['consumed_samples']} != consumed_samples "
                        f"{meta['consumed_samples']}")
    if "run_spec" in meta and not isinstance(meta["run_spec"], dict):
        raise SpecError(f"{source}: run_spec must be an object, got {type(meta['run_spec']).__name__}")
    return meta


def _check_blend_state(source: Path, data: dict, count) -> None:
    """data.sources of a blend: two or more objects with path, fingerprint, num_samples, weight (in (0, 1], summing
    to 1), drawn and epoch (= drawn // num_samples); the drawn samples add up to data.consumed_samples and each is
    within 1 of weight x consumed_samples, as the blend's rule keeps them (Megatron's max-error rule, data.order
    megatron: within the number of sources; it reaches 1.8 for 8 skewed weights)."""
    import math

    sources = data["sources"]
    if not isinstance(sources, list) or len(sources) < 2:
        raise SpecError(f"{source}: data.sources must be a list of two or more blend sources, got {show(sources)}")
    total_weight, drawn, consumed = 0.0, 0, data["consumed_samples"]
    slack = len(sources) if data.get("order") == "megatron" else 1
    for i, s in enumerate(sources):
        at = f"data.sources[{i}]"
        if not isinstance(s, dict):
            raise SpecError(f"{source}: {at} must be an object, got {type(s).__name__}")
        for key in ("path", "fingerprint"):
            if not isinstance(s.get(key), str) or not s[key]:
                raise SpecError(f"{source}: {at}.{key} must be a non-empty string, got {show(s.get(key))}")
        for key, low in (("num_samples", 1), ("drawn", 0), ("epoch", 0)):
            if key not in s:
                raise SpecError(f"{source}: missing {at}.{key}")
            count(f"{at}.{key}", s[key], low)
        w = s.get("weight")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and 0 < w <= 1):
            raise SpecError(f"{source}: {at}.weight must be a number in (0, 1], got {show(w)}")
        if s["epoch"] != s["drawn"] // s["num_samples"]:
            raise SpecError(f"{source}: {at}.epoch {s['epoch']} != drawn {s['drawn']} // num_samples "
                            f"{s['num_samples']}")
        if abs(s["drawn"] - w * consumed) > slack:
            raise SpecError(f"{source}: {at}.drawn {s['drawn']} is not the blend's share of data.consumed_samples "
                            f"{consumed} at weight {w!r}")
        total_weight += w
        drawn += s["drawn"]
    if abs(total_weight - 1) > 1e-9:
        raise SpecError(f"{source}: data.sources weights sum to {total_weight!r}, not 1")
    if drawn != consumed:
        raise SpecError(f"{source}: data.sources drawn {drawn} in all != data.consumed_samples {consumed}")


CHECKPOINT_KEYS = ("step", "consumed_samples", "data", "model", "pp", "zero_stage", "dp", "world_size")
"""What a checkpoint's dspipe.json must hold (checkpoint_meta writes them, with run_spec)."""


def read_latest(ckpt_dir: Path) -> str:
    """The tag `latest` names: a global_stepN name (never a path), or a SpecError naming the file."""
    latest = Path(ckpt_dir) / LATEST_FILE
    try:
        tag = latest.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = None
    except OSError as e:
        raise cannot_read(latest, e) from None
    if tag is None or not TAG_RE.match(tag):
        shown = "bytes that are not UTF-8" if tag is None else repr(tag[:40])
        raise SpecError(f"{latest} names {shown}, not a checkpoint tag global_stepN; give --resume a complete "
                        f"checkpoint under {ckpt_dir}")
    return tag


def check_compatible(meta: dict, run, path: Path) -> None:
    """Refuse a checkpoint whose model shape or ZeRO stage differ from this run's, or whose layout (dp, tp, pp,
    sp) differs where DeepSpeed cannot re-partition the state (layout_change_refusal)."""
    saved, now = asdict(from_dict(ModelSpec, meta["model"])), asdict(run.model)  # keys added since: their defaults
    diff = [f"{k} {saved.get(k)} -> {now[k]}" for k in now if k != "name" and saved.get(k) != now[k]]
    if diff:
        raise SpecError(f"checkpoint {path} holds a different model shape: {', '.join(diff)}")
    if meta["zero_stage"] != run.plan.zero_stage:
        raise SpecError(f"checkpoint {path} was saved with zero_stage {meta['zero_stage']}, this run has zero_stage "
                        f"{run.plan.zero_stage}; resume with the same zero_stage")
    ep = expert_parallel(run) if run.model.experts else 1
    if ep != meta.get("ep", 1) and run.model.experts:
        raise SpecError(f"checkpoint {path} was saved with ep {meta['ep']}, this run has ep {ep}: {MOE_RESHARD}; "
                        f"resume with ep {meta['ep']}")
    plan = run.plan
    why = layout_change_refusal(meta=meta, zero_stage=plan.zero_stage, dp=plan.dp, tp=plan.tp, pp=plan.pp,
                                sp=plan.sp, offload=plan.offload, path=path)
    if why:
        saved_layout = layout_text(meta)
        now_layout = layout_text({"dp": plan.dp, "tp": plan.tp, "pp": plan.pp, "sp": plan.sp})
        raise SpecError(f"checkpoint {path} was saved with {saved_layout}, this run has {now_layout}: {why}; resume "
                        f"with {saved_layout} (world size "
                        f"{meta['dp'] * meta['pp'] * meta.get('tp', 1) * meta.get('sp', 1)})")


def layout_text(layout: dict) -> str:
    """'dp 2' or 'dp 1 x tp 2 x pp 2': the data-parallel size and every other dimension that is not 1 (tp/sp
    absent: 1, checkpoints from before tensor/sequence parallelism)."""
    parts = [f"dp {layout['dp']}"] + [f"{k} {layout.get(k, 1)}" for k in ("tp", "pp", "sp") if layout.get(k, 1) > 1]
    return " x ".join(parts)


def layout_of(meta: dict) -> tuple[int, int, int]:
    """(dp, tp, pp) a checkpoint was saved with."""
    return meta["dp"], meta.get("tp", 1), meta["pp"]


def engine_layout(engine) -> tuple[int, int, int]:
    """(dp, tp, pp) of a live DeepSpeed engine: its data-parallel size, its grid's (mpu's) tp group, its stages."""
    from dspipe.runtime.engine import dp_world_size

    grid = getattr(engine, "grid", None) or getattr(engine, "mpu", None)
    tp = getattr(grid, "get_slice_parallel_world_size", None)
    return dp_world_size(engine), int(tp()) if tp is not None else 1, int(getattr(engine, "num_stages", 1) or 1)


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


def save_failure_message(*, code: int, detail: str, ckpt_dir: Path, tag: str, free_before: float | None) -> str:
    """One line: what failed, the free space, and which checkpoint is intact (read back from disk)."""
    reason = os.strerror(code) if code != WriteFailures.GENERIC else (detail or "a write failed")
    after = free_mib(ckpt_dir)
    free = "free space unknown" if free_before is None or after is None else \
        f"{free_before:.1f} MiB free, {after:.1f} MiB after removing the partial save"
    latest = ckpt_dir / LATEST_FILE
    try:
        intact = latest.read_text().strip() if latest.is_file() else ""
    except (OSError, UnicodeDecodeError):
        intact = ""
    if intact and is_complete(ckpt_dir / intact):
        kept = f"the last complete checkpoint {ckpt_dir / intact} is intact and {LATEST_FILE!r} names it"
    else:
        kept = "there is no earlier complete checkpoint"
    return (f"saving checkpoint {tag} in {ckpt_dir} failed: {reason} ({free}); {kept}; "
            f"free space there, then continue with --resume auto")


@dataclass
class PendingSave:
    """A checkpoint whose files are written (or being written in the background); `complete` marks it complete."""

    ckpt_dir: Path
    step: int
    meta: dict
    keep: Retention
    failures: WriteFailures
    """This rank's failed writes of the part written in the step (directories, and every file when synchronous)."""
    writer: object | None
    """The rank's dspipe.runtime.async_engine.BackgroundWriter writing the files, None when they were written in
    the step."""
    blocking_s: float
    """Seconds the step waited for the save (the whole write when synchronous, the snapshot when not)."""

    @property
    def tag(self) -> str:
        return tag_for(self.step)

    @property
    def partial(self) -> Path:
        return self.ckpt_dir / (PARTIAL_PREFIX + self.tag)

    @property
    def final(self) -> Path:
        return self.ckpt_dir / self.tag


def save(engine, ckpt_dir: Path, *, step: int, meta: dict, keep: Retention, writer=None) -> PendingSave:
    """Collective: every rank calls it. Partial dir -> DeepSpeed files + per-rank RNG, through `writer` (a
    BackgroundWriter: snapshot now, written in the background) or written here (None). Returns the pending save;
    `complete` then agrees that every rank's files are written and marks it complete."""
    import time

    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    rank = dist.get_rank()
    ckpt_dir = Path(ckpt_dir)
    pending = PendingSave(ckpt_dir=ckpt_dir, step=step, meta=meta, keep=keep,
                          failures=WriteFailures(), writer=writer, blocking_s=0.0)
    failures, partial = pending.failures, pending.partial
    if rank == 0:
        failures.call(ckpt_dir.mkdir, parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    client = {"step": step, "consumed_samples": meta["consumed_samples"], "data": meta["data"]}
    with writing_through(engine, writer), failures.deepspeed_writes(engine):
        engine.save_checkpoint(str(ckpt_dir), tag=partial.name, client_state=client, save_latest=False)
    failures.call(torch.save if writer is None else writer.save, rng_state(), str(partial / f"rng-rank{rank}.pt"))
    if writer is not None:
        writer.release()
    pending.blocking_s = time.perf_counter() - t0
    return pending


@contextlib.contextmanager
def writing_through(engine, writer):
    """DeepSpeed writes the checkpoint's files through `writer` (its checkpoint engine) while active."""
    if writer is None:
        yield
        return
    own, engine.checkpoint_engine = engine.checkpoint_engine, writer
    writer.begin()
    try:
        yield
    finally:
        engine.checkpoint_engine = own


def complete(pending: PendingSave, *, wait: bool, now: int, faults: Faults = NO_FAULTS) -> dict | None:
    """Collective: once every rank's files of `pending` are written (waiting for them with `wait`, else None at
    once while any rank's background writer is busy), rank 0 writes the meta (the complete mark, with the save's
    figures), renames the partial dir into place, replaces `latest` atomically and applies the retention; returns
    the figures (meta "save": mode, completed_after_step (`now`, the last step done), blocking_s, write_s and
    writer_cpu_s of the slowest rank, rank_max_bytes, bytes on rank 0's disk or None elsewhere). A failed write on
    any rank: the partial dir is removed and every rank raises the same SpecError. `faults`: a test's failures (a
    write failing, a kill) injected once the files are written."""
    import torch
    import torch.distributed as dist

    from dspipe.runtime.comm import collective_tensor

    writer, failures = pending.writer, pending.failures
    if writer is not None and wait:
        writer.wait()
    busy = writer is not None and not writer.drained()
    written = (writer.bytes, writer.write_s, writer.write_cpu_s) if writer is not None else (0, pending.blocking_s, 0)
    agreed = collective_tensor([float(busy), *written, pending.blocking_s], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    if agreed[0].item():
        return None
    if writer is not None and writer.failures.code and not failures.code:
        failures.code, failures.detail = writer.failures.code, writer.failures.detail
    rank, ckpt_dir, partial, tag = dist.get_rank(), pending.ckpt_dir, pending.partial, pending.tag
    faults.fail_write(failures, step=pending.step, rank=rank)
    faults.kill_inside_save(pending.step)
    raise_if_failed(failures, ckpt_dir=ckpt_dir, partial=partial, tag=tag)
    figures = {"mode": "sync" if writer is None else "async", "completed_after_step": now,
               "blocking_s": round(agreed[4].item(), 6),
               "write_s": round(agreed[2].item(), 6), "writer_cpu_s": round(agreed[3].item(), 6),
               "rank_max_bytes": int(agreed[1].item()),
               "bytes": directory_bytes(partial) if rank == 0 else None}
    if rank == 0:
        meta = {**pending.meta, "save": figures}
        # inside the routed call: a non-finite value (ValueError) is a failed save that every rank agrees on
        failures.call(lambda: write_atomic(partial / META_FILE, json.dumps(meta, indent=2, allow_nan=False) + "\n"))
        if not failures.code:  # the same step may have been saved before (resumed from an older one)
            failures.call(replace_dir, partial, ckpt_dir / tag)
        if not failures.code:
            failures.call(write_atomic, ckpt_dir / LATEST_FILE, tag)
        if not failures.code:
            for p in to_delete(ckpt_dir, pending.keep):
                shutil.rmtree(p, ignore_errors=True)
    raise_if_failed(failures, ckpt_dir=ckpt_dir, partial=partial, tag=tag)
    return figures


def saved_line(pending: PendingSave, figures: dict) -> str:
    """The runner's line for a completed checkpoint (rank 0's figures)."""
    size = f"{figures['bytes'] / 2**30:,.2f} GiB" if figures["bytes"] is not None else "size unknown"
    if figures["mode"] == "sync":
        return f"checkpoint {pending.final} saved: {size}, written in {figures['blocking_s']:.2f} s (the step waited)"
    return (f"checkpoint {pending.final} saved: {size}, written in {figures['write_s']:.2f} s in the background "
            f"(the step waited {figures['blocking_s']:.2f} s for the copy)")


def directory_bytes(path: Path) -> int:
    """Bytes of the files under `path` (their sizes; what the checkpoint adds to its disk)."""
    total = 0
    for p in Path(path).rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            continue
    return total


def raise_if_failed(failures: WriteFailures, *, ckpt_dir: Path, partial: Path, tag: str) -> None:
    """Collective: when any rank failed to write, rank 0 removes the partial save and every rank raises.
    torch's writers report a full disk as a RuntimeError without errno (its text depends on where the write
    stopped): counted as ENOSPC when the target's free space confirms it, else named by type and first line."""
    import torch.distributed as dist

    free_before = free_mib(ckpt_dir)
    failures.confirm_full(free_before)
    code = failures.agreed()
    if not code:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    raise SpecError(save_failure_message(code=code, detail=failures.detail if failures.code == code else "",
                                         ckpt_dir=ckpt_dir, tag=tag, free_before=free_before))


def load(engine, path: Path, loader) -> dict:
    """Collective: DeepSpeed state, data position and this rank's RNG from a complete checkpoint; returns meta.
    Under another layout (dp, tp, pp) ZeRO-1/2/3 state is loaded through a universal checkpoint
    (dspipe.runtime.reshard).
    Its files were checked by resume_point (dspipe.runtime.ckptfiles); every torch.load here is weights-only."""
    import torch.distributed as dist

    path = Path(path)
    meta = read_meta(path)
    now = engine_layout(engine)
    with weights_only_loads():  # DeepSpeed's own torch.load calls (weights_only=False) run weights-only too
        if layout_of(meta) != now and engine.zero_optimization():
            rename = None
            if (meta["pp"] > 1) != (now[2] > 1):  # a pipeline <-> the plain model: other parameter names
                rename = pipeline_names(from_dict(ModelSpec, meta["model"]), to_pipeline=now[2] > 1)
            load_path = load_resharded(engine, path, saved=layout_text(meta),
                                       now=layout_text(dict(zip(("dp", "tp", "pp"), now))), rename=rename)
        elif bf16_optimizer_without_zero(engine):
            load_path = load_bf16_without_zero(engine, path)
        else:
            load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name)
    if load_path is None:
        raise SpecError(f"DeepSpeed could not load checkpoint {path}")
    reapply_schedule(engine)
    loader.load_state_dict(meta["data"])
    restore_rng(path, meta=meta, seed=loader.seed, rank=dist.get_rank(), world=dist.get_world_size(),
                same_layout=layout_of(meta) == now, tp=now[1])
    return meta


def reapply_schedule(engine) -> None:
    """Set the optimizer's lr from the loaded schedule at its loaded position. DeepSpeed restores the optimizer's
    saved lr and the scheduler's position separately; after `dspipe extend` (a longer total_num_steps) the saved
    lr is the old schedule's, and the first resumed step would apply it. At an unchanged schedule this writes the
    same value."""
    sched = engine.lr_scheduler
    at = getattr(sched, "last_batch_iteration", None)
    if isinstance(at, int) and at >= 0:
        sched.step(at)


def bf16_optimizer_without_zero(engine) -> bool:
    """DeepSpeed's BF16_Optimizer at ZeRO stage 0 (bf16 under a pipeline): it keeps partitioned fp32 master weights
    and Adam moments like ZeRO-1 and saves them in bf16_zero_pp_rank_* files, but DeepSpeed 0.19's load_checkpoint
    reads those files only when ZeRO is on and otherwise hands the optimizer a single dict where it indexes a
    per-rank list (KeyError 0): such a run could not resume at all."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    return isinstance(engine.optimizer, BF16_Optimizer) and not engine.zero_optimization()


def load_bf16_without_zero(engine, path: Path):
    """Weights, lr schedule and counters through load_checkpoint without its optimizer step, then the optimizer
    (fp32 master partitions, Adam moments) from its per-rank files through the engine's own ZeRO-file reader."""
    load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=False)
    if load_path is None or not engine._load_zero_checkpoint(str(path.parent), path.name, load_optimizer_states=True):
        return None
    return load_path


def restore_rng(path: Path, *, meta: dict, seed: int, rank: int, world: int, same_layout: bool = True,
                tp: int = 1) -> None:
    """This rank's saved RNG streams at the same world size and layout; under another one the saved per-rank
    streams mean nothing, so each rank starts new ones derived from (seed, step, the index of its tensor-parallel
    group in the layout's rank order): tensor-parallel peers
    share one stream, as at the start of a run (dspipe.runtime.loop), so that their dropout on the replicated
    activations agrees."""
    import random

    import numpy as np
    import torch

    rng = Path(path) / f"rng-rank{rank}.pt"
    if meta.get("world_size") == world and same_layout and rng.is_file():
        set_rng_state(safe_load(rng))  # checked by resume_point (ckptfiles.check_rng_state)
        return
    group, _ = divmod(rank, tp)  # the layout's rank order: tensor fastest (dspipe.spec.layout)
    derived = (seed * 1_000_003 + meta["step"] * 4099 + group) % 2**31
    random.seed(derived)
    np.random.seed(derived)
    torch.manual_seed(derived)


def checkpoint_meta(run, *, step: int, loader, world: int) -> dict:
    """What dspipe.json in a checkpoint holds: position, data state, the shape it was saved with, and the run's
    whole resolved spec (the run directory's dspipe.json: model, cluster, train, strategy, plan, data)."""
    return {"step": step, "consumed_samples": loader.consumed_samples, "data": loader.state_dict(),
            "model": asdict(run.model), "pp": run.plan.pp, "tp": run.plan.tp, "sp": run.plan.sp,
            "zero_stage": run.plan.zero_stage, "dp": run.plan.dp, "ep": expert_parallel(run),
            "world_size": world, "run_spec": json.loads((run.path / SPEC_FILE).read_text())}


def resume_point(run, resume: str = "auto") -> Path | None:
    """The checkpoint to resume from, checked against the run: `resume` 'auto' (the default) = the newest complete
    one, or None when the run has none (a fresh start); a tag under checkpoints/ or a path = that one. Its files are
    checked (dspipe.runtime.ckptfiles): a damaged or foreign checkpoint is one SpecError before anything is built."""
    path = find_checkpoint(run.checkpoint_dir, resume)
    if path is not None:
        meta = read_meta(path)
        check_compatible(meta, run, path)
        check_checkpoint(path, meta=meta)  # every file, weights-only, before DeepSpeed reads any (same on every rank)
    return path


PREVIOUS_DIR = "previous"
RUN_OUTPUTS = ("checkpoints", "metrics.csv", "metrics.rewound.csv", "val_metrics.csv", "engine.json", "monitor",
               "events.jsonl")
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


def check_disk_space(run) -> None:
    """Refuse the launch (one line, before anything is built) when the run's checkpoints cannot fit the disk of its
    checkpoint directory: keep_checkpoints of them, the one being written and the --keep-every milestones, at the
    planner's size (dspipe.planner.checkpoint_size), against the filesystem's free space plus the checkpoints
    already there (they rotate out). The directory is taken as one filesystem for every rank (shared storage)."""
    from dspipe.planner.checkpoint_size import check_disk, checkpoint_size, milestones

    ckpt_dir, tr = run.checkpoint_dir, run.train
    probe = ckpt_dir
    while not probe.exists():  # not made yet: the filesystem it will be made on
        probe = probe.parent
    held = directory_bytes(ckpt_dir) if ckpt_dir.exists() else 0
    size = checkpoint_size(model=run.model, plan=run.plan, ranks_per_node=run.cluster.gpus_per_node)
    check_disk(size=size, keep=tr.keep_checkpoints,
               kept_for_good=milestones(steps=tr.steps, keep_every=tr.keep_every),
               free=shutil.disk_usage(probe).free, held=held, where=str(ckpt_dir))
