"""Preflight for a cluster: versions, devices, DeepSpeed ops, ssh to every host, and a real all-reduce started by
the same launcher a training run uses. Imports torch/deepspeed only inside the functions that report on them."""

from __future__ import annotations

import json
import math
import platform
import subprocess
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata

from dspipe.cluster.allreduce import MARKER
from dspipe.cluster.hostfile import Host
from dspipe.cluster.launch import Launch
from dspipe.errors import SpecError
from dspipe.spec.hardware import GIB

OPS = ("fused_adam", "cpu_adam", "async_io")  # FusedAdam (GPU), CPUAdam (ZeRO-Offload), AIO (NVMe offload)


def versions(*, sep: str = ", ") -> str:
    """python, torch and deepspeed as installed, read from the package metadata (imports neither): what bench and
    calibrate record, and the start of doctor's environment line."""

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return sep.join(
        (f"python {platform.python_version()}", f"torch {version('torch')}", f"deepspeed {version('deepspeed')}")
    )


def environment() -> str:
    """doctor's first line: the versions, then CUDA and NCCL as torch sees them ("none" without CUDA)."""
    import torch

    cuda = torch.version.cuda or "none"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none"
    return f"{versions(sep=' | ')} | CUDA {cuda} | NCCL {nccl}"


def devices() -> list[str]:
    import os

    import torch

    if not torch.cuda.is_available():
        return [f"no CUDA GPUs: DeepSpeed's cpu accelerator, {os.cpu_count()} cores (gloo)"]
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(f"GPU {i}: {p.name}, {p.total_memory / GIB:.1f} GiB, compute {p.major}.{p.minor}")
    return out


def detect_gpu() -> str | None:
    """The catalog key for GPU 0 ('cpu' without CUDA), or None when the catalog has no such GPU."""
    from dspipe.spec.hardware import detect

    gpu = detect().gpu
    return gpu.name if gpu else None


def op_report() -> list[str]:
    """The ops this project uses: prebuilt (installed) or JIT-compatible on this machine."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS
    from deepspeed.ops.op_builder.builder import probe_is_compatible

    out = []
    for name in OPS:
        builder = ALL_OPS.get(name)
        compatible = builder is not None and probe_is_compatible(builder, False)
        installed = bool(installed_ops.get(name, False))
        out.append(f"{name} {'prebuilt' if installed else 'JIT' if compatible else 'NOT AVAILABLE'}")
    return [f"deepspeed ops ({get_accelerator()._name}): " + ", ".join(out)]


def ssh_unreachable(
    hosts: tuple[Host, ...] | list[Host], *, source: str, ssh_port: int | None, timeout_s: int = 10
) -> list[str]:
    """Hosts that passwordless ssh cannot reach (what DeepSpeed's pdsh launcher needs for every host)."""

    def probe(host: Host) -> str | None:
        cmd = [
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            f"ConnectTimeout={timeout_s}",
            *(["-p", str(ssh_port)] if ssh_port else []),
            host.name,
            "true",
        ]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 5)
        except subprocess.TimeoutExpired:
            return f"{host.name} ({source}:{host.line}): ssh timed out"
        except FileNotFoundError:
            return f"{host.name}: no ssh client on this machine"
        if r.returncode:
            why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
            return f"{host.name} ({source}:{host.line}): {why}"
        return None

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return [m for m in pool.map(probe, hosts) if m]


MAX_SIZE_MB = 16384.0  # 16 GiB per rank: far beyond any message that measures bandwidth
MIN_SIZE_MB = 0.001  # ~1 KiB: at least one fp32 element
MAX_ITERS = 100_000
MAX_TIMEOUT_S = 7 * 86400


def check_allreduce_options(*, size_mb: float, iters: int, timeout_s: int) -> None:
    """Refuse --size-mb, --iters, --timeout-s outside their ranges (with --skip-allreduce too: a value that is
    given is never ignored)."""
    if not (math.isfinite(size_mb) and MIN_SIZE_MB <= size_mb <= MAX_SIZE_MB):
        raise SpecError(
            f"--size-mb must be a finite number of MiB in {MIN_SIZE_MB:g}..{MAX_SIZE_MB:g}, got {size_mb:g}"
        )
    if not 1 <= iters <= MAX_ITERS:
        raise SpecError(f"--iters must be in 1..{MAX_ITERS:,}, got {iters}")
    if not 1 <= timeout_s <= MAX_TIMEOUT_S:
        raise SpecError(f"--timeout-s must be in 1..{MAX_TIMEOUT_S:,} seconds, got {timeout_s}")


def parse_allreduce(output: str) -> dict | None:
    for line in output.splitlines():
        if MARKER in line:
            return json.loads(line.split(MARKER, 1)[1])
    return None


def run_allreduce(launch: Launch, *, timeout_s: int) -> dict:
    """Start the all-reduce with the launch's one command and environment; the result rank 0 printed."""
    argv = list(launch.commands[0].argv)
    try:
        r = subprocess.run(argv, env=launch.child_env(), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SpecError(
            f"all-reduce across {launch.world_size} ranks did not finish in {timeout_s} s "
            f"(a node that never joined? check --master-addr and the firewall)"
        ) from None
    result = parse_allreduce(r.stdout)
    if r.returncode or result is None:
        lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln or "error" in ln] or lines
        raise SpecError(
            f"all-reduce across {launch.world_size} ranks failed (exit {r.returncode}): "
            f"{errors[-1].strip() if errors else 'no output'}"
        )
    return result


def env_mismatches(result: dict, expected: dict[str, str]) -> list[str]:
    """Ranks whose environment lacks a value of .deepspeed_env (propagation failed)."""
    out = []
    for rank, seen in enumerate(result["ranks"]):
        wrong = {k: v for k, v in seen["env"].items() if v != expected[k]}
        out += [f"rank {rank} on {seen['host']}: {k}={v} (expected {expected[k]})" for k, v in wrong.items()]
    return out
