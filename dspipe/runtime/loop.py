"""The training loop on every rank: run dir -> engine (dspipe.runtime.engine) -> steps, validation, checkpoints, logs.

In three parts: `setup` (the checks, the engine, the data at the resumed position, the log) gives a `Training`
state, `step_loop` runs the steps on it, `finish` saves the last one and sums up. The rank's command line is
dspipe.runtime.entry's."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from dspipe.atomic import write_file
from dspipe.data.blend import make_loader, open_sources
from dspipe.data.blend import parse as parse_data
from dspipe.errors import RunHalted, SpecError
from dspipe.log import get_logger
from dspipe.planner.startup import build_mode
from dspipe.planner.throughput import model_flops_per_token, step_rates
from dspipe.rundir import Run
from dspipe.runtime import checkpoint as ckpt
from dspipe.runtime import ckpt_meta, ckpt_tags, signals
from dspipe.runtime import restart as outputs
from dspipe.runtime.comm import collective_tensor, process_group
from dspipe.runtime.engine import build_engine
from dspipe.runtime.engine_file import engine_text
from dspipe.runtime.evaluate import evaluate_sets, val_columns, val_sets
from dspipe.runtime.faults import NO_FAULTS, Faults
from dspipe.runtime.metrics_log import RunLog
from dspipe.runtime.save_schedule import STEP_WINDOW, SaveSchedule, replan, resumed_schedule, step_time
from dspipe.runtime.stability import Health, guard_base_optimizer
from dspipe.runtime.startup import StartupClock
from dspipe.runtime.watchdog import Watchdog, record_event
from dspipe.spec.hardware import GIB

STEP_MOE_COLUMNS = ("aux_loss", "expert_load", "dropped_routes")
"""metrics.csv's columns after dspipe.planner.throughput.STEP_COLUMNS for a mixture-of-experts model: the mean
load-balancing loss over its sparse blocks (before aux_loss_coef; `loss` is the LM loss), the step's load
imbalance (the busiest expert's tokens over the mean, worst sparse block, all ranks; 1 is balanced), and the routes
its capacity dropped in the step (all ranks; 0 when dropless)."""


def device_peak_tflops(*, precision: str) -> tuple[str, float | None]:
    """(device name, its catalog peak for the precision); the peak is None on CPUs and unknown devices."""
    from dspipe.spec.hardware import detect

    found = detect()
    gpu = found.gpu if found.gpu and found.gpu.backend == "nccl" else None  # no MFU on CPU ranks
    return found.device_name, (gpu.peak_tflops(precision) if gpu else None)


def peak_memory_gib() -> tuple[float, float]:
    """Peak memory allocated / reserved on this rank's device since start (host RSS on the CPU accelerator)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    return acc.max_memory_allocated() / GIB, acc.max_memory_reserved() / GIB


def train(
    run: Run,
    resume: str = "auto",
    *,
    restart: bool = False,
    faults: Faults = NO_FAULTS,
    hang_timeout: float = 0.0,
    attempt: int | None = None,
    resized: str | None = None,
) -> dict:
    """Train from a run directory; the process group lives exactly as long as the training (see dspipe.runtime.comm).
    `resume`: 'auto' (the newest complete checkpoint, else a fresh start), a tag or a path; `restart`: move the
    previous outputs into previous/<UTC timestamp>/ and start from step 0; `faults`: a test's injected failures;
    `hang_timeout`: seconds a rank may wait inside one collective during the steps (0: no limit); `attempt`: the
    elastic agent's restart count (None: not started by it); `resized`: the line saying how this start's layout
    differs from the plan (dspipe.runtime.elastic), None when it does not."""
    with process_group(agreed=(SpecError, RunHalted)) as backend:  # both are raised by every rank at once
        return train_in_group(
            run,
            resume=resume,
            restart=restart,
            backend=backend,
            faults=faults,
            hang_timeout=hang_timeout,
            attempt=attempt,
            resized=resized,
        )


def restart_run(run: Run, *, rank: int) -> None:
    """Collective (--restart): rank 0 moves checkpoints/, the metrics, engine.json and monitor/ into
    runs/NAME/previous/<UTC timestamp>/ (nothing is deleted) and says where; every rank waits for it and raises
    the same SpecError when the move failed."""
    import torch
    import torch.distributed as dist

    error = ""
    if rank == 0:
        try:
            slot, moved = outputs.move_to_previous(run.path, now=outputs.utc_stamp())
        except OSError as e:
            error = (
                f"--restart: moving the previous outputs of {run.path} into {run.path / outputs.PREVIOUS_DIR} "
                f"failed ({e}); nothing was deleted: what was moved is there, the rest is in place"
            )
        else:
            get_logger(__name__).info(
                f"dspipe: --restart: moved {', '.join(moved)} to {slot}; starting from step 0"
                if slot
                else f"dspipe: --restart: {run.path} holds no previous outputs; starting from step 0"
            )
    failed = collective_tensor([1 if error else 0], dtype=torch.int32)
    dist.broadcast(failed, src=0)
    if failed.item():
        raise SpecError(error or f"--restart: rank 0 could not move the previous outputs of {run.path}")


def train_in_group(
    run: Run,
    *,
    resume: str,
    restart: bool,
    backend: str,
    faults: Faults,
    hang_timeout: float = 0.0,
    attempt: int | None = None,
    resized: str | None = None,
) -> dict:
    """Setup -> the step loop -> finish, inside the process group. Under torch's elastic agent a restart (any
    rank's agent counted one) continues from the newest checkpoint: --restart / --resume TAG were the first start's."""
    if attempt is not None:
        attempt = _agreed_attempt(attempt)
        if attempt:
            restart, resume = False, "auto"
    state = setup(run, resume=resume, restart=restart, backend=backend, faults=faults)
    if state.rank == 0 and attempt:
        _restarted(state, attempt=attempt, resized=resized)
    state.watchdog = Watchdog(
        timeout_s=hang_timeout,
        rank=state.rank,
        world=state.world,
        run_path=run.path,
        hang_step=faults.hang_step(state.rank),
    )
    if hang_timeout > 0:  # else nothing is watched: torch.distributed stays as it is
        state.watchdog.install()
    step_loop(state)
    return finish(state)


def _agreed_attempt(attempt: int) -> int:
    """Collective: the job's restart count. Each node's agent counts only the restarts it caused (its own ranks
    failed); a node whose ranks were stopped because another node's failed restarts them without counting, so its
    ranks read 0. The ranks agree on the largest."""
    import torch
    import torch.distributed as dist

    count = collective_tensor([attempt], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def _restarted(t: "Training", *, attempt: int, resized: str | None) -> None:
    """Rank 0 of a restarted job: the restart (and what changed, which the entry point said) in events.jsonl."""
    record_event(
        t.run.path,
        {
            "event": "restart",
            "attempt": attempt,
            "world": t.world,
            "step": t.start_step,
            **({"resized": resized} if resized else {}),
        },
    )


@dataclass
class Training:
    """What setup builds for the step loop and finish, and where the loop got to."""

    run: Run
    rank: int
    world: int
    eng: object
    """The dspipe.runtime.engine.Engine."""
    loader: object
    """The training batches (dspipe.data.blend), at the resumed position."""
    val: list
    """The validation sets (dspipe.runtime.evaluate.val_sets), empty without validation."""
    log: RunLog
    health: Health
    say: Callable
    """A result line (the banner, the summary): print on rank 0, nothing elsewhere."""
    note: Callable
    """A diagnostic line (resumed, saved, a skipped step, a signal): the "dspipe" logger on rank 0 (dspipe.log)."""
    peak_tflops: float | None
    faults: Faults
    start_step: int
    step: int
    """The last step done (start_step before the loop)."""
    saved_at: int
    """The step of the newest checkpoint this launch saved or resumed from."""
    losses: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    writer: object | None = None
    """The rank's background checkpoint writer (dspipe.runtime.async_save), None under --sync-save."""
    pending: object | None = None
    """The checkpoint being written in the background (dspipe.runtime.checkpoint.PendingSave), None when none is."""
    retention: ckpt_tags.Retention | None = None
    watchdog: Watchdog | None = None
    """Hang detection around the steps (dspipe.runtime.watchdog); set after setup."""
    schedule: SaveSchedule | None = None
    """When the loop saves (dspipe.runtime.save_schedule)."""
    step_times: deque = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    """This rank's latest step times, for --save-interval auto's re-planning."""

    def save(self, at: int, *, wait: bool = False) -> None:
        """Checkpoint step `at`: the previous background save completes first. With `wait` (the run's end, a signal,
        a halt) this one is written in the step: the launch waits for it anyway, so a background write would only
        add the host copy (and, for a run's only checkpoint, the writer process's start), as torchtitan writes its
        last step synchronously."""
        self.settle(wait=True)
        meta = ckpt_meta.checkpoint_meta(
            self.run, step=at, loader=self.loader, world=self.world, save_interval=self.schedule.every
        )
        writer = None if wait else self.writer
        self.pending = ckpt.save(
            self.eng.engine, self.run.checkpoint_dir, step=at, keep=self.retention, meta=meta, writer=writer
        )
        if writer is None:
            self.settle(wait=True)
        self.saved_at = at

    def prepare_buffers(self, step: int) -> None:
        """Collective, once, after the launch's first step (Adam's moments exist then) when its first save is in
        the background: the writer's host buffers allocated and faulted in here, not in that save's step; an event
        in events.jsonl and a line."""
        prepared = ckpt.prepare_buffers(self.eng.engine, writer=self.writer, into=self.run.checkpoint_dir)
        if prepared is None:
            return
        nbytes, seconds = prepared
        if self.rank == 0:
            record_event(
                self.run.path, {"event": "host_buffers", "step": step, "bytes": nbytes, "seconds": round(seconds, 3)}
            )
        self.note(
            f"dspipe: host buffers for the background checkpoints: {nbytes / 2**30:.2f} GiB on rank 0, allocated "
            f"after step {step} in {seconds:.2f} s (once; each save copies into them)"
        )

    def settle(self, *, wait: bool) -> None:
        """Collective: complete the background save once every rank's files are written (`wait`: wait for them)."""
        if self.pending is not None and (
            figures := ckpt.complete(self.pending, wait=wait, now=self.step, faults=self.faults)
        ):
            self.note(f"dspipe: {ckpt.saved_line(self.pending, figures)}")
            if self.schedule.auto and self.step < self.run.train.steps:
                self._replan(figures)
            self.pending = None

    def _replan(self, figures: ckpt_meta.SaveRecord) -> None:
        """Collective (--save-interval auto): the interval re-planned from the save just completed and the slowest
        rank's step time; an event in events.jsonl, and a line when the interval changed."""
        import torch
        import torch.distributed as dist

        slowest = collective_tensor([step_time(self.step_times)], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if slowest.item() <= 0:
            return
        event, line = replan(
            self.schedule,
            figures=figures,
            saved_step=self.pending.step,
            step_s=slowest.item(),
            world=self.world,
            mtbf_hours=self.run.cluster.gpu_mtbf_hours,
        )
        if self.rank == 0:
            record_event(self.run.path, event)
        if line:
            self.note(f"dspipe: {line}")


def setup(run: Run, *, resume: str, restart: bool, backend: str, faults: Faults) -> Training:
    """Every check that can refuse the launch before the engine exists (world size, data, the resume point), then
    the engine, the loader at the resumed position, engine.json and the start-up report, the log."""
    import torch.distributed as dist

    rank, world, layout = dist.get_rank(), dist.get_world_size(), run.plan.layout
    _check_world(run, world=world)
    _seed_dropout(seed=run.train.seed, rank=rank, layout=layout)
    plan, tr = run.plan, run.train
    data, windows, val = _open_data(run)
    resume_from = _resume_point(run, resume=resume, restart=restart, rank=rank, disk_fills=faults.disk_fills_later)

    clock = StartupClock()
    eng = build_engine(run, clock=clock)
    faults.after_build()
    guarded = guard_base_optimizer(eng.engine)
    loader = make_loader(data, windows, seed=tr.seed, micro_batch=plan.micro_batch, dp=layout.dp, dp_rank=eng.dp_rank)
    device, peak = device_peak_tflops(precision=plan.precision)
    say = print if rank == 0 else (lambda *a, **k: None)
    note = get_logger(__name__).info if rank == 0 else (lambda *a, **k: None)
    say(_banner(run, backend=backend, device=device), flush=True)
    if plan.loss_chunk:
        note(f"dspipe: loss without the full logits: {_loss_kernel(chunk=plan.loss_chunk, device=eng.device)}")

    start_step, meta = 0, None
    if resume_from is not None:
        meta = ckpt.load(eng.engine, resume_from, loader)
        start_step = meta.step
        note(f"dspipe: resumed from {resume_from} at step {start_step} ({loader.consumed_samples} samples)")
    elif not restart:
        note(f"dspipe: no checkpoint in {run.checkpoint_dir}: starting fresh from step 0")
    _startup_report(run, eng=eng, clock=clock, guarded=guarded, rank=rank, note=note)

    log = _run_log(run, monitor=eng.engine.monitor, enabled=rank == 0, resumed_at=start_step, val=val)
    health = Health(max_skips=tr.max_skipped_steps, window=tr.spike_window, sigma=tr.spike_sigma)
    retention = _retention(tr, resume_from=resume_from)
    return Training(
        run=run,
        rank=rank,
        world=world,
        eng=eng,
        loader=loader,
        val=val,
        log=log,
        health=health,
        say=say,
        note=note,
        peak_tflops=peak,
        faults=faults,
        start_step=start_step,
        step=start_step,
        saved_at=start_step,
        writer=_writer(eng.engine, async_save=tr.async_save, early=0 < tr.save_interval < tr.steps, faults=faults),
        retention=retention,
        schedule=resumed_schedule(
            every=tr.save_interval, steps=tr.steps, meta=meta, auto=run.estimate.save_interval_auto
        ),
    )


def _loss_kernel(*, chunk: int, device) -> str:
    """Which kernel computes the chunked loss here: liger-kernel's on CUDA where installed, else dspipe's."""
    from dspipe.model.loss import HeadLoss

    return HeadLoss(chunk=chunk).describe(str(device).split(":")[0])


def _check_world(run: Run, *, world: int) -> None:
    """Refuse a launch whose world size is not the one the run was generated for."""
    if world != run.plan.layout.world:
        raise SpecError(
            f"{run.path} was generated for world size {run.plan.world_size} "
            f"({run.cluster.nodes} nodes x {run.cluster.gpus_per_node}), launched with {world}; "
            f"regenerate with matching --nodes/--gpus-per-node"
        )


def _seed_dropout(*, seed: int, rank: int, layout) -> None:
    """Seed the rank's dropout stream."""
    import torch

    # dropout streams (weights come from per-layer generators); tensor-parallel peers share one, so that the
    # dropout after their all-reduce drops the same elements of the replicated activations on every peer
    torch.manual_seed(seed + rank // layout.tp)


def _resume_point(run: Run, *, resume: str, restart: bool, rank: int, disk_fills: bool):
    """The checkpoint to resume from (None: from step 0; --restart moves the old outputs aside first), checked before
    building anything, and the disk space the checkpoints to come need."""
    if restart:
        restart_run(run, rank=rank)  # before the engine opens monitor/
        resume_from = None
    else:
        resume_from = ckpt.resume_point(run, resume)  # checked before building anything
    if not disk_fills:  # a test's fault fills the disk later: the space is not checked up front
        ckpt.check_disk_space(run)  # the checkpoints to come fit their disk
    return resume_from


def _run_log(run: Run, *, monitor, enabled: bool, resumed_at: int, val) -> RunLog:
    """The run's metrics log (rank 0 writes it), its columns as this run's data and model have them."""
    tr = run.train
    return RunLog(
        run.path,
        monitor=monitor,
        enabled=enabled,
        resumed_at=resumed_at,
        log_interval=tr.log_interval,
        steps=tr.steps,
        validating=bool(tr.eval_interval),
        tokens_per_step=run.plan.tokens_per_step,
        val_columns=val_columns(val),
        step_columns=STEP_MOE_COLUMNS if run.model.experts else (),
    )


def _retention(tr, *, resume_from) -> ckpt_tags.Retention:
    """Which checkpoints the run keeps: the last ones, the milestones, and the one it resumed from."""
    return ckpt_tags.Retention(
        last=tr.keep_checkpoints,
        every=tr.keep_every,
        protect=frozenset({resume_from.name} if resume_from is not None else ()),
    )


def _writer(engine, *, async_save: bool, early: bool, faults: Faults):
    """The rank's background checkpoint writer (None: checkpoints written in the step), in the serialization
    format DeepSpeed's own writer was configured with; its process spawned now when the run saves before its last
    step (`early`: it starts alongside the rank's own start-up), else at the first background save, if any."""
    if not async_save:
        return None
    from dspipe.runtime.async_engine import BackgroundWriter

    writer = BackgroundWriter(
        zipfile_serialization=getattr(engine.checkpoint_engine, "zipfile_serialization", True),
        kill_tag=faults.async_write_kill_tag,
    )
    if early:
        writer.start()
    return writer


def _open_data(run: Run) -> tuple:
    """(the data: one directory or a blend, its opened sources, the validation sets: per source for a blend, none
    without validation). Every source is checked against the model and the others (one tokenizer), its memory
    maps against its meta.json."""
    plan, tr = run.plan, run.train
    data = parse_data(run.data)  # one data directory, or a blend of several (dspipe.data.blend)
    windows = open_sources(
        data,
        model_vocab=run.model.vocab,
        seq_len=run.model.seq_len,
        order=tr.data_order,
        seed=tr.seed,
        num_samples=tr.steps * plan.global_batch,
    )
    val = (
        val_sets(
            data, seq_len=run.model.seq_len, micro_batch=plan.micro_batch, dp=plan.layout.dp, batches=tr.eval_batches
        )
        if tr.eval_interval
        else []
    )
    return data, windows, val


def _banner(run: Run, *, backend: str, device: str) -> str:
    """The run's first line: model, layout, ZeRO, precision, devices, recomputation, batch, steps."""
    plan, tr, layout = run.plan, run.train, run.plan.layout
    return (
        f"dspipe: {run.model.name} {plan.num_params / 1e6:.2f}M params | {layout.describe()} "
        f"| ZeRO-{plan.zero_stage} offload {plan.offload} | {plan.precision} | {backend} on {device} | recompute "
        f"{plan.recomputation} | batch {plan.micro_batch} x ga {plan.grad_accum} x dp {layout.dp} = "
        f"{plan.global_batch} seq x {run.model.seq_len} tok"
        f"{f' | {tr.steps:,} steps (token budget {tr.tokens})' if tr.tokens else ''}"
        f"{' | blocks compiled' if tr.compile else ''}"
    )


def _startup_report(run: Run, *, eng, clock: StartupClock, guarded: bool, rank: int, note: Callable) -> None:
    """engine.json (the live settings and the start-up measurements, rank 0) and the start-up line."""
    plan = run.plan
    clock.mark("ready")
    startup = clock.gathered(
        mode=build_mode(zero_stage=plan.zero_stage, tp=plan.tp, pp=plan.pp, ep=plan.ep),
        host_is_device=str(eng.device).startswith("cpu"),
    )
    if rank == 0:
        write_file(  # whole or not at all: report and calibrate --from-run read it while the run goes on
            run.engine_path, engine_text(eng.settings, guarded=guarded, startup=startup, what=str(run.engine_path))
        )
    note(
        f"dspipe: start-up ({startup.mode} build): peak host RSS {max(startup.peak_rss_mib):,.0f} MiB on the "
        f"worst rank ({max(startup.build_rss_mib):,.0f} MiB after the build, "
        f"{max(startup.rss_before_build_mib):,.0f} before it); "
        f"first step {max(startup.seconds_to_first_step):.1f} s "
        f"after the process start"
    )


def step_loop(t: Training) -> None:
    """Steps start_step + 1 .. steps: train, log, validate, checkpoint; stops early on a signal (saved, returns) or
    after too many skipped steps in a row (saved, RunHalted)."""
    run = t.run
    flops_per_token = model_flops_per_token(run.model)
    nan_loss = t.faults.nan_loss(t.eng.engine, pipeline=run.plan.pp > 1)
    t.started = time.perf_counter()
    stop = signals.StopRequest()
    watchdog = t.watchdog or Watchdog(timeout_s=0, rank=t.rank, run_path=run.path)
    with watchdog.armed():
        _steps(t, stop=stop, watchdog=watchdog, nan_loss=nan_loss, flops_per_token=flops_per_token)


def _steps(t: Training, *, stop, watchdog: Watchdog, nan_loss, flops_per_token: float) -> None:
    run, eng, plan, tr = t.run, t.eng, t.run.plan, t.run.train
    engine, reads_data = eng.engine, eng.reads_data  # under a pipeline only the first and last stages read
    for step in range(t.start_step + 1, tr.steps + 1):
        t.step = watchdog.step = step
        skipped_before = engine.skipped_steps
        if nan_loss:
            nan_loss.arm(step)
        lr = engine.get_lr()[0]  # the lr this step applies (the scheduler moves it on at the step's end)
        t0 = time.perf_counter()
        loss = eng.train_step(t.loader if reads_data else None)
        if not reads_data:  # the others skip along
            t.loader.skip(plan.grad_accum)
        dt = time.perf_counter() - t0
        t.step_times.append(dt)
        if nan_loss:
            nan_loss.disarm()
        skipped = engine.skipped_steps > skipped_before
        t.losses.append(loss)
        note = t.health.record(step=step, loss=loss, skipped=skipped)
        if note:
            t.note(f"dspipe: {note}")
        if t.rank == 0:
            _log_step(t, step=step, loss=loss, lr=lr, seconds=dt, skipped=skipped, flops_per_token=flops_per_token)
        if tr.eval_interval and (step % tr.eval_interval == 0 or step == tr.steps):
            t.log.validation(
                {
                    "step": step,
                    "tokens": step * plan.tokens_per_step,
                    **evaluate_sets(eng, t.val, micro_batch=plan.micro_batch),
                }
            )
        t.settle(wait=False)  # a background save completes at the first step end after its files are written
        t.faults.kill_after_step(step, rank=t.rank, drain=lambda: t.settle(wait=True))
        stopping = stop.agreed()
        if stopping or t.health.halted or t.schedule.due(step, saved_at=t.saved_at):
            with watchdog.paused():  # a sync save keeps peers in a barrier for the length of the write
                t.save(step, wait=stopping or t.health.halted)
        if stopping:
            t.note(f"dspipe: stopped by a signal after step {step}; checkpoint saved")
            return
        if t.health.halted:
            t.log.close()
            raise RunHalted(
                f"{t.health.consecutive} consecutive steps skipped (non-finite loss or gradient norm), "
                f"the last at step {step}; saved {run.checkpoint_dir / ckpt_tags.tag_for(step)} (weights "
                f"from before the first skipped step); lower the lr or check the data, then relaunch to "
                f"resume"
            )
        if t.writer is not None and t.writer.started and not t.writer.prepared and step < tr.steps:
            with watchdog.paused():
                t.prepare_buffers(step)


def _log_step(
    t: Training, *, step: int, loss: float, lr: float, seconds: float, skipped: bool, flops_per_token: float
) -> None:
    """One metrics row (rank 0); `lr` is the one the step applied."""
    engine, plan = t.eng.engine, t.run.plan
    norm = engine.get_global_grad_norm()
    alloc, reserved = peak_memory_gib()
    t.log.step(
        {
            "step": step,
            "tokens": step * plan.tokens_per_step,
            "loss": loss,
            "lr": lr,
            "grad_norm": None if norm is None else float(norm),
            "step_time_s": seconds,
            **dict(zip(("forward_s", "backward_s", "optimizer_s"), t.eng.phases or (None, None, None), strict=True)),
            **step_rates(
                tokens=plan.tokens_per_step,
                samples=plan.global_batch,
                seconds=seconds,
                flops_per_token=flops_per_token,
                world_size=t.world,
                peak_tflops=t.peak_tflops,
            ),
            "mem_allocated_gib": alloc,
            "mem_reserved_gib": reserved,
            "skipped": int(skipped),
            "aux_loss": t.eng.aux_loss,
            "expert_load": t.eng.expert_load,
            "dropped_routes": t.eng.dropped_routes,
        }
    )


def finish(t: Training) -> dict:
    """Close the log, check the data position, save the last step if not saved yet; the summary (and its line)."""
    run, plan, step, steps = t.run, t.run.plan, t.step, t.run.train.steps
    t.log.close()
    if t.loader.consumed_samples != step * plan.global_batch:  # every rank, reading or not, at the same position
        raise RuntimeError(f"data position {t.loader.consumed_samples} != {step} steps x {plan.global_batch}")
    if step > t.saved_at:
        t.save(step, wait=True)
    t.settle(wait=True)
    tag = ckpt_tags.tag_for(step)
    losses = t.losses
    summary = {
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "steps": step,
        "seconds": time.perf_counter() - t.started,
        "checkpoint": str(run.checkpoint_dir / tag),
        "skipped_steps": t.health.total_skipped,
    }
    if losses:
        t.say(
            f"done: loss {losses[0]:.3f} -> {losses[-1]:.3f} in steps {t.start_step + 1}-{step} "
            f"({summary['seconds']:.0f} s, {t.health.total_skipped} skipped, {t.health.spikes} loss spikes); "
            f"checkpoint {summary['checkpoint']}; metrics {run.metrics_path}; run dir {run.path}",
            flush=True,
        )
    else:
        t.say(
            f"done: nothing to do, the checkpoint is at step {step} of {steps}; to train longer: "
            f"dspipe extend {run.path} --steps N (N > {steps}), then the same launch command",
            flush=True,
        )
    return summary
