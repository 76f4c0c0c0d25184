"""`dspipe calibrate`: measure this machine at a model's shapes and write a profile (dspipe.spec.profile) that the
planner uses instead of the catalog's figures.

Ranks run as the training ranks would: one process per GPU (NCCL), or on a CPU machine `ranks` processes on gloo with
the cores shared out (dspipe.tools.bench.cpu_threads: 1 thread each for the demo's 2 ranks on 2 cores), all measuring
at once, so that each rank's compute is slowed by its neighbours exactly as in a step. The slowest rank's figure is
kept (it sets the pace of a synchronous step).

What predicts a training step: the compute figure is the model's own forward + backward (dspipe.model.gpt.GPT at the
model's shapes, micro-batch and dtype, loss included), expressed as achieved model FLOP/s (6N + 6Lhs per token), not
the GEMMs alone. It is timed for at least `min_seconds` and averaged (a training run's step time is a mean, slow
steps included). Measured on this repository's CPU, the GEMMs alone run 1.5-2x faster than the whole step: LayerNorm,
GELU, softmax attention, dropout, the fp32 cross-entropy and the autograd bookkeeping between kernels are a large
share of a small model's step, and the planner has no other term for them. The GEMM rate is recorded beside it
(matmul_tflops) for comparison. A model too large to build whole here is measured at 1 and 2 blocks and extrapolated
(a block's time is the difference; embedding, head and loss the rest).

Communication: an all-reduce of `allreduce_mib` MiB (bus bandwidth = bytes x 2(n-1)/n / time, nccl-tests' definition)
and of 4 KiB (its time is the latency). Host copy: pinned host -> device and device -> host on a GPU; on a CPU machine
the host memcpy rate instead (reported as such; no pinned copy exists). CPU-Adam: DeepSpeedCPUAdam's step on 4M
fp32 parameters per rank, all ranks at once (node rate = the sum), when the op builds or loads; else null, said.
Optimizer step: torch.optim.AdamW (the engine's Adam without offload) on the rank's ZeRO shard size.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from dspipe.cluster.doctor import versions
from dspipe.errors import SpecError
from dspipe.jsonio import read_object
from dspipe.planner.throughput import model_flops_per_token
from dspipe.runtime.startup import STARTUP_MMAP_THRESHOLD, malloc_threshold
from dspipe.spec.kinds import Precision
from dspipe.spec.model import ModelSpec
from dspipe.spec.profile import Profile

MAX_WHOLE_PARAMS = 400_000_000
"""A model above this many parameters is timed at 1 and 2 blocks and extrapolated, not built whole."""
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _timed(fn, *, sync, repeats: int, warmup: int = 2, min_seconds: float = 0.0) -> float:
    """Median seconds of fn() over `repeats` runs after `warmup` untimed ones; with `min_seconds`, the mean over at
    least `repeats` runs and that long (a step's time as a training run sees it: every run counted, slow ones too)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    while len(times) < repeats or (min_seconds and sum(times) < min_seconds):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.fmean(times) if min_seconds else statistics.median(times)


def _step_seconds(
    model: ModelSpec, *, micro_batch: int, dtype, device, sync, repeats: int, min_seconds: float
) -> float:
    """Seconds of one forward + backward of `model` on a micro-batch (built whole, or extrapolated from 1 and 2
    blocks above MAX_WHOLE_PARAMS)."""
    import torch

    from dspipe.model.gpt import GPT

    def timed(spec: ModelSpec) -> float:
        net = GPT(spec, seed=0).to(device=device, dtype=dtype).train()
        gen = torch.Generator().manual_seed(0)
        idx = torch.randint(0, spec.vocab, (micro_batch, spec.seq_len + 1), generator=gen).to(device)

        def step():
            net(idx[:, :-1], labels=idx[:, 1:]).backward()
            net.zero_grad(set_to_none=True)

        return _timed(step, sync=sync, repeats=repeats, min_seconds=min_seconds)

    if model.num_params <= MAX_WHOLE_PARAMS or model.layers <= 2:
        return timed(model)
    one, two = timed(replace(model, layers=1)), timed(replace(model, layers=2))
    block = max(0.0, two - one)
    return one + (model.layers - 1) * block


def _gemm_shapes(model: ModelSpec) -> list[tuple[int, int, int]]:
    """(k, n, count) of the model's matrix products per step: x(T, k) @ W(k, n), `count` times (blocks, head)."""
    h, f, L = model.hidden, model.ffn, model.layers
    up = 2 * f if model.mlp == "swiglu" else f
    # q/k/v: hidden -> (heads + 2 kv_heads) x head_dim; attention output: heads x head_dim -> hidden
    return [(h, model.qkv_width, L), (model.q_width, h, L), (h, up, L), (f, h, L), (h, model.vocab, 1)]


def _matmul_tflops(model: ModelSpec, *, micro_batch: int, dtype, device, sync, repeats: int) -> float:
    """Achieved TFLOP/s of the model's GEMMs: forward x @ W, backward dY @ W^T and x^T @ dY, weighted by count."""
    import torch

    tokens = micro_batch * model.seq_len
    flops = seconds = 0.0
    for k, n, count in _gemm_shapes(model):
        x = torch.randn(tokens, k, device=device).to(dtype)
        w = torch.randn(k, n, device=device).to(dtype)
        dy = torch.randn(tokens, n, device=device).to(dtype)

        def three(x=x, w=w, dy=dy):  # bound now: the loop rebinds them
            x @ w
            dy @ w.t()
            x.t() @ dy

        seconds += count * _timed(three, sync=sync, repeats=repeats)
        flops += count * 3 * 2 * tokens * k * n
    return flops / seconds / 1e12


def _allreduce(nbytes: int, *, device, sync, repeats: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    return _timed(lambda: dist.all_reduce(t), sync=sync, repeats=repeats)


def _host_copy(*, device, sync, mib: int = 256) -> float | None:
    """GB/s of pinned host <-> device copies (mean of both directions); None on a CPU."""
    import torch

    if device.type != "cuda":
        return None
    n = mib * 2**20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), sync=sync, repeats=5)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), sync=sync, repeats=5)
    return 2 * n / (h2d + d2h) / 1e9


def _memcpy(mib: int = 64) -> float:
    """GB/s of a host tensor copy (bytes copied per second)."""
    import torch

    src = torch.ones(mib * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return mib * 2**20 / _timed(lambda: dst.copy_(src), sync=lambda: None, repeats=5) / 1e9


def _cpu_adam(params: int = 4 * 2**20) -> tuple[float | None, str]:
    """(params/s of DeepSpeedCPUAdam's step on this rank, note); (None, why) when it does not build or load."""
    import torch

    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p = torch.nn.Parameter(torch.zeros(params))
        p.grad = torch.full_like(p, 1e-3)
        opt = DeepSpeedCPUAdam([p], lr=1e-3)
        seconds = _timed(opt.step, sync=lambda: None, repeats=5, warmup=1)
    except Exception as e:  # the op's JIT build fails in many ways (no compiler, no ninja, no headers)
        return None, f"DeepSpeedCPUAdam unavailable: {' '.join(str(e).split())[:200]}"
    return params / seconds, "DeepSpeedCPUAdam"


def _adam(params: int, *, dtype, device, sync) -> float:
    """params/s of torch.optim.AdamW's step (the engine's Adam without offload) on `params` parameters."""
    import torch

    p = torch.nn.Parameter(torch.zeros(max(1, params), device=device, dtype=dtype))
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-3)
    return max(1, params) / _timed(opt.step, sync=sync, repeats=5)


def _worker(rank: int, world: int, cfg: dict) -> None:
    """One rank: join the group, measure, write rank<N>.json into cfg['out']."""
    import torch
    import torch.distributed as dist

    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    cuda = cfg["backend"] == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # a CPU rank's allocator as the runner leaves it for the steps: 1.25x slower than glibc's default
        malloc_threshold(STARTUP_MMAP_THRESHOLD)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    dist.init_process_group(cfg["backend"], rank=rank, world_size=world)
    model = ModelSpec(**cfg["model"])
    dtype = getattr(torch, DTYPES[cfg["dtype"]])
    repeats = cfg["repeats"]
    out = {}
    try:
        dist.barrier()  # every rank computes at once, as in a step
        step = _step_seconds(
            model,
            micro_batch=cfg["micro_batch"],
            dtype=dtype,
            device=device,
            sync=sync,
            repeats=repeats,
            min_seconds=cfg["min_seconds"],
        )
        out["compute_tflops"] = cfg["micro_batch"] * model.seq_len * model_flops_per_token(model) / step / 1e12
        dist.barrier()
        out["matmul_tflops"] = _matmul_tflops(
            model, micro_batch=cfg["micro_batch"], dtype=dtype, device=device, sync=sync, repeats=repeats
        )
        dist.barrier()
        if world > 1:
            nbytes = cfg["allreduce_mib"] * 2**20
            out["allreduce_busbw_gbps"] = (
                nbytes * 2 * (world - 1) / world / _allreduce(nbytes, device=device, sync=sync, repeats=repeats) / 1e9
            )
            out["allreduce_latency_s"] = _allreduce(4096, device=device, sync=sync, repeats=max(20, 4 * repeats))
        else:
            out["allreduce_busbw_gbps"] = out["allreduce_latency_s"] = None
        out["host_copy_gbps"] = _host_copy(device=device, sync=sync)
        out["host_memcpy_gbps"] = _memcpy()
        dist.barrier()
        out["cpu_adam_params_per_s"], out["cpu_adam_note"] = _cpu_adam() if cfg["cpu_adam"] else (None, "skipped")
        dist.barrier()
        shard = max(1, model.num_params // world)  # ZeRO-1's shard: what the rank's optimizer updates
        out["optimizer_params_per_s"] = _adam(shard, dtype=torch.float32, device=device, sync=sync)
        out["device"] = torch.cuda.get_device_name(device) if cuda else _cpu_name()
        out["threads"] = torch.get_num_threads()
    finally:
        dist.destroy_process_group()
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(out))
    from dspipe.runtime.comm import exit_rank

    exit_rank(0)  # the figures are written: skip the interpreter teardown where gloo can abort (dspipe.runtime.comm)


def _cpu_name() -> str:
    from dspipe.tools.bench_worker import cpu_model

    return cpu_model()


def _catalog_type(*, on_cpu: bool) -> str:
    """The catalog type the profile is of: 'cpu' for CPU ranks, else device 0's (one line where unknown)."""
    from dspipe.spec.hardware import detect

    if on_cpu:
        return "cpu"
    found = detect()
    if found.gpu is None:
        raise SpecError(f"GPU {found.device_name!r} is not in the catalog: the profile could not name its type")
    return found.gpu.name


def _gather(ranks: list[dict]) -> dict:
    """The node's figures from its ranks': the slowest rank's rate (it sets a synchronous step's pace), the node's
    CPU-Adam rate as the sum over its ranks (they step at once)."""
    out = {}
    for name in ("compute_tflops", "matmul_tflops", "host_memcpy_gbps", "optimizer_params_per_s"):
        out[name] = min(r[name] for r in ranks)
    for name in ("allreduce_busbw_gbps", "host_copy_gbps"):
        values = [r[name] for r in ranks]
        out[name] = None if None in values else min(values)
    latencies = [r["allreduce_latency_s"] for r in ranks]
    out["allreduce_latency_s"] = None if None in latencies else max(latencies)
    adam = [r["cpu_adam_params_per_s"] for r in ranks]
    out["cpu_adam_params_per_s"] = None if None in adam else sum(adam)
    return out


def _ranks_here(
    *, precision: str, ranks: int | None, threads: int | None, on_cpu: bool, say
) -> tuple[bool, int, str, int | None]:
    """(on CUDA, ranks, the catalog type, torch threads per rank) of this machine for calibrate."""
    import torch

    from dspipe.spec.hardware import CPU_RANKS
    from dspipe.tools.bench import cpu_threads

    cuda = torch.cuda.is_available() and not on_cpu
    count = torch.cuda.device_count() if cuda else 0
    ranks = ranks or (count if cuda else CPU_RANKS)
    if cuda and ranks > count:
        raise SpecError(f"--ranks {ranks}: this machine has {count} CUDA GPU(s)")
    if not cuda and precision != Precision.FP32:
        say(f"note: {precision} on a CPU runs without tensor cores; the demo trains in fp32")
    gpu = _catalog_type(on_cpu=on_cpu)
    if threads is None and not cuda:
        threads = cpu_threads(ranks=ranks)
    return cuda, ranks, gpu, threads


def calibrate(
    *,
    model: ModelSpec,
    precision: str,
    micro_batch: int,
    ranks: int | None = None,
    threads: int | None = None,
    repeats: int = 5,
    min_seconds: float = 5.0,
    allreduce_mib: int = 16,
    cpu_adam: bool = True,
    on_cpu: bool = False,
    say=print,
) -> Profile:
    """Measure this machine with `ranks` processes at once (default: every visible GPU, else 2 CPU ranks) and
    return its profile. `threads`: torch threads per rank (default: the cores shared out on a CPU machine);
    `min_seconds`: how long the forward + backward is timed at least (the mean over that window); `on_cpu`: CPU ranks
    on gloo even where GPUs are visible (the 'cpu' type)."""
    import torch.multiprocessing as mp

    from dspipe.cluster.ports import free_port

    cuda, ranks, gpu, threads = _ranks_here(precision=precision, ranks=ranks, threads=threads, on_cpu=on_cpu, say=say)
    with tempfile.TemporaryDirectory(prefix="dspipe-calibrate-") as tmp:
        cfg = {
            "model": {k: getattr(model, k) for k in model.__dataclass_fields__},
            "dtype": precision,
            "micro_batch": micro_batch,
            "backend": "nccl" if cuda else "gloo",
            "threads": threads,
            "port": free_port(),
            "out": tmp,
            "repeats": repeats,
            "min_seconds": min_seconds,
            "allreduce_mib": allreduce_mib,
            "cpu_adam": cpu_adam,
        }
        mp.start_processes(_worker, args=(ranks, cfg), nprocs=ranks, join=True, start_method="spawn")
        results = [read_object(Path(tmp, f"rank{r}.json")) for r in range(ranks)]
    figures = _gather(results)
    note = results[0]["cpu_adam_note"]
    if figures["cpu_adam_params_per_s"] is None:
        say(f"note: {note}; the planner keeps the catalog's CPU-Adam rate")
    return Profile(
        device=results[0]["device"],
        gpu=gpu,
        dtype=precision,
        ranks=ranks,
        threads_per_rank=results[0]["threads"],
        model=f"{model.shape_text} micro {micro_batch}",
        created=datetime.datetime.now().isoformat(timespec="seconds"),
        versions=versions(),
        **figures,
    )
