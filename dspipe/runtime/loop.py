"""The training loop on every rank: run dir -> engine (dspipe.runtime.engine) -> steps, validation, checkpoints, logs."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from dspipe.runtime import checkpoint as ckpt
from dspipe.runtime.comm import process_group
from dspipe.runtime.engine import build_engine
from dspipe.data.blend import make_loader, open_sources, parse as parse_data
from dspipe.errors import RunHalted, SpecError
from dspipe.jsonio import dumps
from dspipe.runtime.evaluate import evaluate_sets, val_columns, val_sets
from dspipe.planner.throughput import model_flops_per_token, step_rates
from dspipe.rundir import Run, load_run
from dspipe.runtime.metrics_log import GIB, RunLog
from dspipe.planner.startup import build_mode
from dspipe.runtime.startup import StartupClock
from dspipe.runtime.stability import Health, PoisonedLoss, guard_base_optimizer, nan_test_steps

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


def train(run: Run, resume: str = "auto", *, restart: bool = False) -> dict:
    """Train from a run directory; the process group lives exactly as long as the training (see dspipe.runtime.comm).
    `resume`: 'auto' (the newest complete checkpoint, else a fresh start), a tag or a path; `restart`: move the
    previous outputs into previous/<UTC timestamp>/ and start from step 0."""
    with process_group(agreed=(SpecError, RunHalted)) as backend:  # both are raised by every rank at once
        return train_in_group(run, resume=resume, restart=restart, backend=backend)


def restart_run(run: Run, *, rank: int) -> None:
    """Collective (--restart): rank 0 moves checkpoints/, the metrics, engine.json and monitor/ into
    runs/NAME/previous/<UTC timestamp>/ (nothing is deleted) and says where; every rank waits for it and raises
    the same SpecError when the move failed."""
    import torch
    import torch.distributed as dist

    error = ""
    if rank == 0:
        try:
            slot, moved = ckpt.move_to_previous(run.path, now=ckpt.utc_stamp())
        except OSError as e:
            error = (f"--restart: moving the previous outputs of {run.path} into {run.path / ckpt.PREVIOUS_DIR} "
                     f"failed ({e}); nothing was deleted: what was moved is there, the rest is in place")
        else:
            print(f"dspipe: --restart: moved {', '.join(moved)} to {slot}; starting from step 0" if slot else
                  f"dspipe: --restart: {run.path} holds no previous outputs; starting from step 0", flush=True)
    failed = torch.tensor([1 if error else 0], dtype=torch.int32)
    dist.broadcast(failed, src=0)
    if failed.item():
        raise SpecError(error or f"--restart: rank 0 could not move the previous outputs of {run.path}")


def train_in_group(run: Run, *, resume: str, restart: bool, backend: str) -> dict:
    import torch
    import torch.distributed as dist

    rank, world, layout = dist.get_rank(), dist.get_world_size(), run.plan.layout
    if world != layout.world:
        raise SpecError(f"{run.path} was generated for world size {run.plan.world_size} "
                        f"({run.cluster.nodes} nodes x {run.cluster.gpus_per_node}), launched with {world}; "
                        f"regenerate with matching --nodes/--gpus-per-node")
    # dropout streams (weights come from per-layer generators); tensor-parallel peers share one, so that the
    # dropout after their all-reduce drops the same elements of the replicated activations on every peer
    torch.manual_seed(run.train.seed + rank // layout.tp)
    data = parse_data(run.data)  # one data directory, or a blend of several (dspipe.data.blend)
    # every source checked against the model and the others (one tokenizer); memory maps checked against meta.json
    windows = open_sources(data, model_vocab=run.model.vocab, seq_len=run.model.seq_len)
    plan, tr, steps = run.plan, run.train, run.train.steps
    val = val_sets(data, seq_len=run.model.seq_len, micro_batch=plan.micro_batch, dp=layout.dp,
                   batches=tr.eval_batches) if tr.eval_interval else []  # per source for a blend
    if restart:
        restart_run(run, rank=rank)  # before the engine opens monitor/
        resume_from = None
    else:
        resume_from = ckpt.resume_point(run, resume)  # checked before building anything

    clock = StartupClock()
    eng = build_engine(run, clock=clock)
    engine = eng.engine
    guarded = guard_base_optimizer(engine)
    loader = make_loader(data, windows, seed=tr.seed, micro_batch=plan.micro_batch, dp=layout.dp,
                         dp_rank=eng.dp_rank)
    reads_data = eng.reads_data  # under a pipeline only the first and last stages read; the others skip along
    device, peak = device_peak_tflops(precision=plan.precision)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"dspipe: {run.model.name} {plan.num_params / 1e6:.2f}M params | {layout.describe()} "
        f"| ZeRO-{plan.zero_stage} offload {plan.offload} | {plan.precision} | {backend} on {device} | recompute "
        f"{plan.checkpointing} | batch {plan.micro_batch} x ga {plan.grad_accum} x dp {layout.dp} = "
        f"{plan.global_batch} seq x {run.model.seq_len} tok"
        f"{f' | {steps:,} steps (token budget {tr.tokens})' if tr.tokens else ''}", flush=True)

    start_step = 0
    if resume_from is not None:
        start_step = ckpt.load(engine, resume_from, loader)["step"]
        say(f"dspipe: resumed from {resume_from} at step {start_step} ({loader.consumed_samples} samples)", flush=True)
    elif not restart:
        say(f"dspipe: no checkpoint in {run.checkpoint_dir}: starting fresh from step 0", flush=True)
    clock.mark("ready")
    startup = clock.gathered(mode=build_mode(zero_stage=plan.zero_stage, tp=plan.tp, pp=plan.pp),
                             host_is_device=str(eng.device).startswith("cpu"))
    if rank == 0:
        run.engine_path.write_text(dumps({**eng.settings, "nonfinite_guard": guarded, "startup": startup},
                                         what=str(run.engine_path)))
    say(f"dspipe: start-up ({startup['mode']} build): peak host RSS {max(startup['peak_rss_mib']):,.0f} MiB on the "
        f"worst rank ({max(startup['build_rss_mib']):,.0f} MiB after the build, "
        f"{max(startup['rss_before_build_mib']):,.0f} before it); first step {max(startup['seconds_to_first_step']):.1f} s "
        f"after the process start", flush=True)

    def save(at: int) -> None:
        ckpt.save(engine, run.checkpoint_dir, step=at, keep=tr.keep_checkpoints,
                  meta=ckpt.checkpoint_meta(run, step=at, loader=loader, world=world))

    def validate(at: int) -> None:
        log.validation({"step": at, "tokens": at * plan.tokens_per_step,
                        **evaluate_sets(eng, val, micro_batch=plan.micro_batch)})

    log = RunLog(run.path, monitor=engine.monitor, enabled=rank == 0, resumed_at=start_step,
                 log_interval=tr.log_interval, steps=steps, validating=bool(tr.eval_interval),
                 tokens_per_step=plan.tokens_per_step, val_columns=val_columns(val))
    health = Health(max_skips=tr.max_skipped_steps, window=tr.spike_window, sigma=tr.spike_sigma)
    flops_per_token = model_flops_per_token(run.model)
    poison_steps = nan_test_steps()
    poisoned = None
    if poison_steps and plan.pp > 1:
        poisoned = engine.module.loss_fn = PoisonedLoss(engine.module.loss_fn)
    losses, start = [], time.perf_counter()
    stop, step, saved_at = ckpt.StopRequest(), start_step, start_step
    for step in range(start_step + 1, steps + 1):
        skipped_before = engine.skipped_steps
        if poisoned:
            poisoned.on = step in poison_steps
        t0 = time.perf_counter()
        loss = eng.train_step(loader if reads_data else None, poison=step in poison_steps)
        if not reads_data:
            loader.skip(plan.grad_accum)
        dt = time.perf_counter() - t0
        if poisoned:
            poisoned.on = False
        skipped = engine.skipped_steps > skipped_before
        losses.append(loss)
        note = health.record(step=step, loss=loss, skipped=skipped)
        if note:
            say(f"dspipe: {note}", flush=True)
        if rank == 0:
            norm = engine.get_global_grad_norm()
            alloc, reserved = peak_memory_gib()
            log.step({"step": step, "tokens": step * plan.tokens_per_step, "loss": loss, "lr": engine.get_lr()[0],
                      "grad_norm": None if norm is None else float(norm), "step_time_s": dt,
                      **step_rates(tokens=plan.tokens_per_step, samples=plan.global_batch, seconds=dt,
                                   flops_per_token=flops_per_token, world_size=world, peak_tflops=peak),
                      "mem_allocated_gib": alloc, "mem_reserved_gib": reserved, "skipped": int(skipped)})
        if tr.eval_interval and (step % tr.eval_interval == 0 or step == steps):
            validate(step)
        ckpt.maybe_test_kill(ckpt.TEST_KILL_AT_STEP, step)
        stopping = stop.agreed()
        if stopping or health.halted or (tr.save_interval and step % tr.save_interval == 0 and step < steps):
            save(step)
            saved_at = step
        if stopping:
            say(f"dspipe: stopped by a signal after step {step}; checkpoint saved", flush=True)
            break
        if health.halted:
            log.close()
            raise RunHalted(f"{health.consecutive} consecutive steps skipped (non-finite loss or gradient norm), "
                            f"the last at step {step}; saved {run.checkpoint_dir / ckpt.tag_for(step)} (weights from "
                            f"before the first skipped step); lower the lr or check the data, then relaunch to resume")
    log.close()
    if loader.consumed_samples != step * plan.global_batch:  # every rank, reading or not, at the same position
        raise RuntimeError(f"data position {loader.consumed_samples} != {step} steps x {plan.global_batch}")
    if step > saved_at:
        save(step)
    tag = ckpt.tag_for(step)
    summary = {"first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
               "steps": step, "seconds": time.perf_counter() - start, "checkpoint": str(run.checkpoint_dir / tag),
               "skipped_steps": health.total_skipped}
    if losses:
        say(f"done: loss {losses[0]:.3f} -> {losses[-1]:.3f} in steps {start_step + 1}-{step} "
            f"({summary['seconds']:.0f} s, {health.total_skipped} skipped, {health.spikes} loss spikes); checkpoint "
            f"{summary['checkpoint']}; metrics {run.metrics_path}; run dir {run.path}", flush=True)
    else:
        say(f"done: nothing to do, the checkpoint is at step {step} of {steps}; to train longer: "
            f"dspipe extend {run.path} --steps N (N > {steps}), then the same launch command", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train a GPT from a dspipe run directory (start it with deepspeed).")
    parser.add_argument("--run", required=True, help="run directory written by 'dspipe gen-config'")
    parser.add_argument("--resume", default=None, metavar="auto|TAG|PATH",
                        help="continue from the newest complete checkpoint (auto, the default: a run without one "
                             "starts fresh), a tag under checkpoints/ or a path")
    parser.add_argument("--restart", action="store_true",
                        help="start from step 0; the previous checkpoints/, metrics, engine.json and monitor/ are "
                             "moved into runs/NAME/previous/<UTC timestamp>/ (nothing is deleted)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)
    if not os.environ.get("DSPIPE_VERBOSE"):
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    try:
        if args.restart and args.resume is not None:
            raise SpecError(f"--restart (start over from step 0) and --resume {args.resume} (continue a checkpoint) "
                            f"contradict each other: pass one of them")
        train(load_run(args.run), resume=args.resume or "auto", restart=args.restart)
    except (SpecError, RunHalted) as e:
        if os.environ.get("RANK", "0") == "0":  # every rank hits the same error: say it once
            print(f"dspipe: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0
