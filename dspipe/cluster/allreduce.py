"""A short all-reduce across every rank, started by DeepSpeed's launcher for `dspipe doctor`.

Bus bandwidth as nccl-tests defines it: algbw = bytes / time, busbw = algbw x 2(n-1)/n, which is the per-rank
link bandwidth a ring all-reduce achieves and so compares with the planner's per-GPU GB/s. Rank 0 prints one line,
`DSPIPE_ALLREDUCE {json}`, which the doctor reads from the launcher's output (pdsh prefixes it with the host).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

MARKER = "DSPIPE_ALLREDUCE"


def measure(*, size_bytes: int, iters: int, warmup: int, env_keys: list[str]) -> dict | None:
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(acc.device_name(int(os.environ.get("LOCAL_RANK", 0))))
    check = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(check)
    correct = bool((check == world * (world + 1) / 2).all())
    x = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    for _ in range(warmup):
        dist.all_reduce(x)
    acc.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    acc.synchronize()
    seconds = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    seen = [None] * world
    dist.all_gather_object(seen, {"host": socket.gethostname(), "env": {k: os.environ.get(k) for k in env_keys}})
    if rank:
        return None
    t = float(seconds.item())
    algbw = size_bytes / t / 1e9
    return {
        "world_size": world,
        "backend": acc.communication_backend_name(),
        "bytes": size_bytes,
        "iters": iters,
        "seconds": t,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * 2 * (world - 1) / world if world > 1 else 0.0,
        "correct": correct,
        "ranks": seen,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="all-reduce bus bandwidth across the launched ranks")
    p.add_argument("--size-mb", type=float, default=64.0)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--env-keys", default="", help="comma-separated variables to report from every rank")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = p.parse_args(argv)
    from dspipe.runtime.comm import process_group

    with process_group():
        result = measure(
            size_bytes=int(args.size_mb * 2**20) // 4 * 4,
            iters=args.iters,
            warmup=args.warmup,
            env_keys=[k for k in args.env_keys.split(",") if k],
        )
    if result is not None:
        print(f"{MARKER} {json.dumps(result)}", flush=True)
    return 0


if __name__ == "__main__":
    from dspipe.runtime.comm import exit_rank

    exit_rank(main())
