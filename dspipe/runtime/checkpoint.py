"""Saving and loading checkpoints: every N steps, at the end and on SIGTERM/SIGINT (dspipe.runtime.signals); keep
the last K and every M-th step's (dspipe.runtime.ckpt_tags: the directory's names, retention); resume exactly.

`save` writes the files in the step, or hands them to the rank's background writer (dspipe.runtime.async_save);
`complete` (at a step's end) agrees that every rank's files are written before the complete mark (dspipe.json,
dspipe.runtime.ckpt_meta), the rename and `latest`. A process killed during a save or its background write leaves
only a .partial-* directory (deleted by the next save or resume), so `latest` always names a complete checkpoint. A
save that fails to write (disk full, quota, I/O error) on any rank is agreed on by every rank: the partial directory
is removed and every rank raises one SpecError naming the intact checkpoint.

RNG streams: dspipe.runtime.rng; --restart: dspipe.runtime.restart; resuming under another layout (dp, tp, pp):
dspipe.runtime.reshard."""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dspipe.atomic import replace_dir
from dspipe.errors import SpecError
from dspipe.runtime import bf16_reshard
from dspipe.runtime.ckpt_meta import CheckpointMeta, SaveRecord, check_compatible, layout_text, read_meta, write_meta
from dspipe.runtime.ckpt_tags import (
    LATEST_FILE,
    PARTIAL_PREFIX,
    Retention,
    find_checkpoint,
    is_complete,
    tag_for,
    to_delete,
    write_atomic,
)
from dspipe.runtime.ckptfiles import check_checkpoint
from dspipe.runtime.experts import beyond_tp
from dspipe.runtime.faults import NO_FAULTS, Faults
from dspipe.runtime.moe_reshard import engine_ep
from dspipe.runtime.reshard import load_resharded, pipeline_names
from dspipe.runtime.rng import restore_rng, rng_state
from dspipe.runtime.safeload import weights_only_loads
from dspipe.runtime.writefail import WriteFailures, free_mib
from dspipe.spec.kinds import Axis


def engine_layout(engine) -> tuple[int, int, int]:
    """(dp, tp, pp) of a live DeepSpeed engine: its data-parallel size, its grid's (mpu's) tp group, its stages."""
    from dspipe.runtime.engine import dp_world_size

    grid = getattr(engine, "grid", None) or getattr(engine, "mpu", None)
    tp = getattr(grid, "get_slice_parallel_world_size", None)
    return dp_world_size(engine), int(tp()) if tp is not None else 1, int(getattr(engine, "num_stages", 1) or 1)


def save_failure_message(*, code: int, detail: str, ckpt_dir: Path, tag: str, free_before: float | None) -> str:
    """One line: what failed, the free space, and which checkpoint is intact (read back from disk)."""
    reason = os.strerror(code) if code != WriteFailures.GENERIC else (detail or "a write failed")
    after = free_mib(ckpt_dir)
    free = (
        "free space unknown"
        if free_before is None or after is None
        else f"{free_before:.1f} MiB free, {after:.1f} MiB after removing the partial save"
    )
    latest = ckpt_dir / LATEST_FILE
    try:
        intact = latest.read_text().strip() if latest.is_file() else ""
    except (OSError, UnicodeDecodeError):
        intact = ""
    if intact and is_complete(ckpt_dir / intact):
        kept = f"the last complete checkpoint {ckpt_dir / intact} is intact and {LATEST_FILE!r} names it"
    else:
        kept = "there is no earlier complete checkpoint"
    return (
        f"saving checkpoint {tag} in {ckpt_dir} failed: {reason} ({free}); {kept}; "
        f"free space there, then continue with --resume auto"
    )


@dataclass
class PendingSave:
    """A checkpoint whose files are written (or being written in the background); `complete` marks it complete."""

    ckpt_dir: Path
    step: int
    meta: CheckpointMeta
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


def save(engine, ckpt_dir: Path, *, step: int, meta: CheckpointMeta, keep: Retention, writer=None) -> PendingSave:
    """Collective: every rank calls it. Partial dir -> DeepSpeed files + per-rank RNG, through `writer` (a
    BackgroundWriter: snapshot now, written in the background) or written here (None). Returns the pending save;
    `complete` then agrees that every rank's files are written and marks it complete."""
    import time

    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    rank = dist.get_rank()
    ckpt_dir = Path(ckpt_dir)
    pending = PendingSave(
        ckpt_dir=ckpt_dir, step=step, meta=meta, keep=keep, failures=WriteFailures(), writer=writer, blocking_s=0.0
    )
    failures, partial = pending.failures, pending.partial
    if rank == 0:
        failures.call(ckpt_dir.mkdir, parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    client = {"step": step, "consumed_samples": meta.consumed_samples, "data": meta.data}
    with writing_through(engine, writer), failures.deepspeed_writes(engine):
        engine.save_checkpoint(str(ckpt_dir), tag=partial.name, client_state=client, save_latest=False)
    failures.call(torch.save if writer is None else writer.save, rng_state(), str(partial / f"rng-rank{rank}.pt"))
    if writer is not None:
        writer.release()
    pending.blocking_s = time.perf_counter() - t0
    return pending


def prepare_buffers(engine, *, writer, into: Path) -> tuple[int, float] | None:
    """Collective: `writer`'s host buffers allocated and faulted in now, outside the steps, so that the run's first
    background save is a plain memory copy like the later ones (allocating them in the save step made it 1.91x a
    clean step where the later saves were 1.00-1.12x, measured). A rehearsal: DeepSpeed's save_checkpoint through
    the writer sizes each file it would write (dspipe.runtime.async_engine.BackgroundWriter.rehearsal), with the
    RNG file, into a scratch directory of this rank's own in the checkpoint directory `into` (only DeepSpeed's
    recovery scripts are written there; a `.partial-` name, so a kill's leftover goes with the interrupted saves),
    removed after. Call it once the optimizer has stepped (Adam's moments are created at the first step). Returns
    (bytes, seconds) of this rank; None, rehearsing nothing, under NVMe optimizer offload (DeepSpeed's save copies the
    swap files, the optimizer's whole state, into the checkpoint directory: a rehearsal would copy them too)."""
    import time

    import torch.distributed as dist

    if engine.zero_nvme_offload_optimizer():
        writer.prepared = True
        return None
    t0 = time.perf_counter()
    scratch = Path(into) / f"{PARTIAL_PREFIX}rehearsal-rank{dist.get_rank()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        with writer.rehearsal(), writing_through(engine, writer):
            engine.save_checkpoint(str(scratch), tag="rehearsal", client_state={}, save_latest=False)
            writer.save(rng_state(), str(scratch / "rehearsal" / f"rng-rank{dist.get_rank()}.pt"))
            nbytes = writer.bytes
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    writer.begin()
    return nbytes, time.perf_counter() - t0


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


def complete(pending: PendingSave, *, wait: bool, now: int, faults: Faults = NO_FAULTS) -> SaveRecord | None:
    """Collective: once every rank's files of `pending` are written (waiting for them with `wait`, else None at
    once while any rank's background writer is busy), rank 0 writes the meta (the complete mark, with the save's
    figures), renames the partial dir into place, replaces `latest` atomically and applies the retention; returns
    the figures (the meta's "save", a SaveRecord: mode, completed_after_step (`now`, the last step done),
    blocking_s, write_s and writer_cpu_s of the slowest rank, rank_max_bytes, bytes on rank 0's disk or None
    elsewhere). A failed write on any rank: the partial dir is removed and every rank raises the same SpecError.
    `faults`: a test's failures (a write failing, a kill) injected once the files are written."""
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
    figures = SaveRecord(
        mode="sync" if writer is None else "async",
        completed_after_step=now,
        blocking_s=round(agreed[4].item(), 6),
        write_s=round(agreed[2].item(), 6),
        writer_cpu_s=round(agreed[3].item(), 6),
        rank_max_bytes=int(agreed[1].item()),
        bytes=directory_bytes(partial) if rank == 0 else None,
    )
    if rank == 0:
        # inside the routed call: a non-finite value (ValueError) is a failed save that every rank agrees on
        failures.call(write_meta, partial, pending.meta.with_save(figures))
        if not failures.code:  # the same step may have been saved before (resumed from an older one)
            failures.call(replace_dir, partial, ckpt_dir / tag)
        if not failures.code:
            failures.call(write_atomic, ckpt_dir / LATEST_FILE, tag)
        if not failures.code:
            for p in to_delete(ckpt_dir, pending.keep):
                shutil.rmtree(p, ignore_errors=True)
    raise_if_failed(failures, ckpt_dir=ckpt_dir, partial=partial, tag=tag)
    return figures


def saved_line(pending: PendingSave, figures: SaveRecord) -> str:
    """The runner's line for a completed checkpoint (rank 0's figures)."""
    size = f"{figures.bytes / 2**30:,.2f} GiB" if figures.bytes is not None else "size unknown"
    if figures.mode == "sync":
        return f"checkpoint {pending.final} saved: {size}, written in {figures.blocking_s:.2f} s (the step waited)"
    return (
        f"checkpoint {pending.final} saved: {size}, written in {figures.write_s:.2f} s in the background "
        f"(the step waited {figures.blocking_s:.2f} s for the copy)"
    )


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
    raise SpecError(
        save_failure_message(
            code=code,
            detail=failures.detail if failures.code == code else "",
            ckpt_dir=ckpt_dir,
            tag=tag,
            free_before=free_before,
        )
    )


def load(engine, path: Path, loader) -> CheckpointMeta:
    """Collective: DeepSpeed state, data position and this rank's RNG from a complete checkpoint; returns meta.
    Under another layout (dp, tp, pp, ep) ZeRO-1/2/3 state is loaded through a universal checkpoint
    (dspipe.runtime.reshard; a mixture of experts' by dspipe.runtime.moe_reshard).
    Its files were checked by resume_point (dspipe.runtime.ckptfiles); every torch.load here is weights-only."""
    import torch.distributed as dist

    path = Path(path)
    meta = read_meta(path)
    now = engine_layout(engine)
    ep = engine_ep(engine)
    with weights_only_loads():  # DeepSpeed's own torch.load calls (weights_only=False) run weights-only too
        if (meta.layout != now or meta.ep != ep) and engine.zero_optimization():
            rename = None
            if (meta.pp > 1) != (now[2] > 1):  # a pipeline <-> the plain model: other parameter names
                rename = pipeline_names(meta.spec, to_pipeline=now[2] > 1)
            load_path = load_resharded(
                engine,
                path,
                saved=layout_text(meta.dims),
                now=layout_text({**dict(zip((Axis.DP, Axis.TP, Axis.PP), now, strict=True)), Axis.EP: ep}),
                rename=rename,
                experts=meta.spec.experts if meta.tp == 1 or beyond_tp(tp=meta.tp, ep=meta.ep or 1) else 0,
                saved_ep=meta.ep,
                saved_zero=meta.zero_stage,
                saved_tp=meta.tp,
                spec=meta.spec,
            )
        elif bf16_optimizer_without_zero(engine) and meta.layout != now:  # another dp (layout_change_refusal)
            load_path = bf16_reshard.load(engine, path, saved_dp=meta.dp)
        elif bf16_optimizer_without_zero(engine):
            load_path = load_bf16_without_zero(engine, path)
        else:
            load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name)
    if load_path is None:
        raise SpecError(f"DeepSpeed could not load checkpoint {path}")
    reapply_schedule(engine)
    loader.load_state_dict(meta.data)
    restore_rng(
        path,
        meta=meta,
        seed=loader.seed,
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        same_layout=meta.layout == now,
        tp=now[1],
    )
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
    check_disk(
        size=size,
        keep=tr.keep_checkpoints,
        kept_for_good=milestones(steps=tr.steps, keep_every=tr.keep_every),
        free=shutil.disk_usage(probe).free,
        held=held,
        where=str(ckpt_dir),
    )
