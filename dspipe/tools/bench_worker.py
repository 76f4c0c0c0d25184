"""One rank of `dspipe bench`, started by DeepSpeed's launcher: warm-up steps, then measured steps on random tokens.

    deepspeed --num_gpus N --module dspipe.tools.bench_worker --run RUN_DIR --side dspipe|reference --out DIR

`--side dspipe` trains the run directory's DeepSpeed engine (built exactly as run.py builds it); `--side reference`
trains the same GPT (same seed, same batches) with plain PyTorch: DistributedDataParallel, torch.optim.AdamW with
the same parameter groups, autocast for bf16/fp16 plans, no DeepSpeed import at all. Both time the same phases
around the same calls with the accelerator synchronized: forward, backward (which includes the gradient
reduction on both sides) and the optimizer step. Each rank writes DIR/rankN.json; `dspipe.tools.bench` reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

from dspipe.rundir import Run, load_run
from dspipe.spec.kinds import Checkpointing, Precision

PHASES = ("forward", "backward", "step")
SIDES = ("dspipe", "reference", "eager")
"""What one launch measures: dspipe's engine, the plain-PyTorch reference (torch.compile) or the same without
compile (the eager reference)."""


def synthetic_batches(*, vocab: int, seq_len: int, micro_batch: int, seed: int, rank: int, count: int) -> list:
    """`count` micro-batches of uniform random tokens for `rank`, the same list on both sides (speed does not
    depend on the text). Generated up front so that no generation is timed."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=gen)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


class Device:
    """The accelerator behind both sides: cuda:LOCAL_RANK or cpu, synchronize and peak memory."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda.is_available()
        local = int(os.environ.get("LOCAL_RANK", 0))
        self.device = torch.device(f"cuda:{local}" if self.cuda else "cpu")
        if self.cuda:
            torch.cuda.set_device(self.device)

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def name(self) -> str:
        if self.cuda:
            import torch

            return torch.cuda.get_device_name(self.device)
        return cpu_model()

    def memory(self) -> dict:
        """Peak bytes allocated / reserved by the caching allocator (GPU) and the process's peak RSS."""
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        if not self.cuda:
            return {"peak_allocated": None, "peak_reserved": None, "peak_rss": rss}
        import torch

        return {
            "peak_allocated": torch.cuda.max_memory_allocated(self.device),
            "peak_reserved": torch.cuda.max_memory_reserved(self.device),
            "peak_rss": rss,
        }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


class Timer:
    """Seconds per phase, summed over the measured steps; each phase ends with a device synchronize."""

    def __init__(self, dev: Device) -> None:
        self.dev, self.totals, self.on = dev, dict.fromkeys(PHASES, 0.0), False
        self._t = 0.0

    def start(self) -> None:
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        self.dev.sync()
        now = time.perf_counter()
        if self.on:
            self.totals[phase] += now - self._t
        self._t = now


def _mean_loss(total, *, count: int, replicas: int) -> float:
    """Loss averaged over this rank's micro-batches and every replica (what the runner logs for a step): the sum
    over every rank / (count x world / sp), sequence-parallel ranks holding shares of their replica's loss."""
    import torch.distributed as dist

    total = total.detach().float().reshape(1)  # on the rank's device: NCCL takes no host tensor
    dist.all_reduce(total)
    return float(total) / (count * replicas)


def _start_window(dev: Device) -> float:
    """Start of the measured window: the device idle and every rank at the same point."""
    import torch.distributed as dist

    dev.sync()
    dist.barrier()
    return time.perf_counter()


def _loop(
    *,
    micro_step,
    optimizer_step,
    batches: list,
    grad_accum: int,
    warmup: int,
    steps: int,
    dev: Device,
    timer: Timer,
    replicas: int,
) -> dict:
    """warmup + steps optimizer steps of grad_accum micro-batches; the first step's loss, the measured seconds."""
    import torch

    it = iter(batches)
    first_loss, t0 = None, 0.0
    for step in range(warmup + steps):
        if step == warmup:
            t0 = _start_window(dev)
            timer.on = True
        total = torch.zeros((), device=dev.device)
        timer.start()
        for micro in range(grad_accum):
            loss = micro_step(next(it), last=micro == grad_accum - 1, timer=timer)
            if step == 0:
                total += loss.detach().float()
        optimizer_step()
        timer.lap("step")
        if step == 0:
            first_loss = _mean_loss(total, count=grad_accum, replicas=replicas)
    dev.sync()
    seconds = time.perf_counter() - t0
    return {"first_loss": first_loss, "seconds": seconds}


def run_dspipe(run: Run, *, dev: Device, batches: list, warmup: int, steps: int) -> dict:
    from dspipe.runtime.comm import init_distributed
    from dspipe.runtime.engine import PipelineEngine, build_engine

    init_distributed()
    eng = build_engine(run)  # built exactly as the runner builds it (train.compile: its blocks compiled)
    keys = ("zero_stage", "wrapper_optimizer", "base_optimizer", "grad_accum_dtype", "param_dtype", "backend")
    engine_info = {k: eng.settings[k] for k in keys}
    if isinstance(eng, PipelineEngine):
        return {
            **_pipeline_loop(eng, dev=dev, batches=batches, warmup=warmup, steps=steps),
            "phases": None,
            "engine": engine_info,
        }
    engine = eng.engine
    timer = Timer(dev)

    def micro_step(batch, *, last: bool, timer: Timer):
        loss = eng.micro_loss(*batch)
        timer.lap("forward")
        engine.backward(loss)  # DeepSpeed scales by 1/grad_accum and reduces gradients at the boundary
        timer.lap("backward")
        engine.step()  # a no-op between boundaries, the optimizer step at the last micro-batch
        if not last:
            timer.lap("step")
        return loss

    layout = run.plan.layout
    result = _loop(
        micro_step=micro_step,
        optimizer_step=lambda: None,
        batches=batches,
        grad_accum=run.plan.grad_accum,
        warmup=warmup,
        steps=steps,
        dev=dev,
        timer=timer,
        replicas=layout.loss_holders,
    )
    return {**result, "phases": timer.totals, "engine": engine_info}


def _pipeline_loop(eng, *, dev: Device, batches: list, warmup: int, steps: int) -> dict:
    """pp > 1: whole steps through train_batch (its forward/backward/step interleave: no breakdown). Every
    stage consumes the same batch list; only the first and last stages read it."""
    it = iter(batches)
    first_loss, t0 = None, 0.0
    for step in range(warmup + steps):
        if step == warmup:
            t0 = _start_window(dev)
        loss = eng.train_step(it)  # averaged over micro-batches and dp, broadcast to every stage
        if step == 0:
            first_loss = loss
    dev.sync()
    return {"first_loss": first_loss, "seconds": time.perf_counter() - t0}


def run_reference(run: Run, *, dev: Device, batches: list, warmup: int, steps: int, compile_: bool = True) -> dict:
    """The same model, batches and optimizer settings in plain PyTorch, as one would write the step: DDP, AdamW
    (fused on CUDA), autocast, SDPA's flash kernel (the model's attention), the same loss path, and with
    `compile_` (the reference; the eager reference without) every block torch.compile'd."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dspipe.model.gpt import GPT
    from dspipe.runtime.engine import param_groups

    dist.init_process_group("nccl" if dev.cuda else "gloo", device_id=dev.device if dev.cuda else None)
    plan, train = run.plan, run.train
    model = GPT(run.model, seed=train.seed).to(dev.device)
    groups = param_groups(model, train.weight_decay)
    fused = {"fused": True} if dev.cuda else {"foreach": True}
    optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=(0.9, 0.95), eps=1e-8, **fused)
    ddp = DDP(model, device_ids=[dev.device.index] if dev.cuda else None, gradient_as_bucket_view=True)
    _loss_and_compile(model, loss_chunk=plan.loss_chunk, compile_=compile_)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision)
    scaler = torch.amp.GradScaler(dev.device.type) if plan.precision == Precision.FP16 else None
    autocast = (lambda: torch.autocast(dev.device.type, dtype=amp_dtype)) if amp_dtype else contextlib.nullcontext
    params = [p for g in groups for p in g["params"]]
    if plan.checkpointing != Checkpointing.NONE:  # the same recomputation, through torch's own checkpoint
        _torch_recompute(model, mode=plan.checkpointing, blocks=plan.recompute_blocks)
    timer = Timer(dev)

    def micro_step(batch, *, last: bool, timer: Timer):
        inputs, labels = batch
        with autocast():
            loss = ddp(inputs.to(dev.device), labels.to(dev.device))
        timer.lap("forward")
        scaled = loss / plan.grad_accum
        with contextlib.nullcontext() if last else ddp.no_sync():  # all-reduce once, at the last micro-batch
            (scaler.scale(scaled) if scaler else scaled).backward()
        timer.lap("backward")
        return loss

    result = _loop(
        micro_step=micro_step,
        optimizer_step=_optimizer_step(optimizer=optimizer, scaler=scaler, params=params, grad_clip=train.grad_clip),
        batches=batches,
        grad_accum=plan.grad_accum,
        warmup=warmup,
        steps=steps,
        dev=dev,
        timer=timer,
        replicas=plan.world_size,
    )  # DDP: pp = tp = sp = 1
    return {**result, "phases": timer.totals}


def _loss_and_compile(model, *, loss_chunk: int, compile_: bool) -> None:
    """The reference's loss path and compile, as the runner sets them up."""
    if loss_chunk:  # the same loss path: without the full logits (liger's kernel on CUDA where installed)
        from dspipe.runtime.parallelize import chunked_loss

        chunked_loss(model, chunk=loss_chunk)
    if compile_:  # per block, as torchtitan compiles: one graph serves every block, the compile stays short
        for block in model.h:
            block.compile()


def _torch_recompute(model, *, mode, blocks: int) -> None:
    """The runner's recomputation of `mode` (of the first `blocks` blocks, 0: all) in the reference, through
    torch's own checkpoint."""
    import functools

    from torch.utils.checkpoint import checkpoint

    from dspipe.runtime.parallelize import recompute

    recompute(model, mode=mode, checkpoint_fn=functools.partial(checkpoint, use_reentrant=False), blocks=blocks)


def _optimizer_step(*, optimizer, scaler, params: list, grad_clip):
    """The reference's optimizer step at a step's end: unscale (fp16), clip, step, zero the gradients."""
    import torch

    def optimizer_step():
        if scaler:
            scaler.unscale_(optimizer)
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(params, grad_clip, foreach=True)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return optimizer_step


def finite_or_none(value):
    """The result with every NaN/infinite float replaced by None (a diverged first loss reads as n/a)."""
    import math

    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one rank of dspipe bench (start it with deepspeed --module)")
    p.add_argument("--run", required=True)
    p.add_argument("--side", choices=SIDES, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = p.parse_args(argv)
    if not os.environ.get("DSPIPE_VERBOSE"):
        import logging

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    import torch
    import torch.distributed as dist

    run = load_run(args.run)
    dev = Device()
    rank = int(os.environ.get("RANK", 0))
    layout = run.plan.layout
    torch.manual_seed(run.train.seed + rank // layout.tp)  # dropout streams, as the runner seeds them
    # the batches of this rank's data-parallel replica: its tensor/sequence-parallel peers read the same ones
    batches = synthetic_batches(
        vocab=run.model.vocab,
        seq_len=run.model.seq_len,
        micro_batch=run.plan.micro_batch,
        seed=run.train.seed,
        rank=layout.dp_rank(rank),
        count=(args.warmup + args.steps) * run.plan.grad_accum,
    )
    steps = dict(dev=dev, batches=batches, warmup=args.warmup, steps=args.steps)
    if args.side == "dspipe":
        result = run_dspipe(run, **steps)
    else:
        result = run_reference(run, compile_=args.side == "reference", **steps)
    result.update(dev.memory(), rank=rank, device_name=dev.name(), threads=torch.get_num_threads())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(finite_or_none(result), allow_nan=False))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from dspipe.runtime.comm import exit_rank

    exit_rank(main())
