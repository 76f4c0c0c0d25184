"""DeepSpeed's compiled ops a run loads on this machine, whether each is built, and building them ahead of time.

DeepSpeed 0.19.8 compiles an op the first time a process loads it (JIT, into torch's extension cache, ~/.cache/
torch_extensions/...), unless the installed DeepSpeed was built with it: the engine's AdamW is FusedAdam
(FusedAdamBuilder) or, with the optimizer offloaded, DeepSpeedCPUAdam (CPUAdamBuilder, and AsyncIOBuilder to NVMe,
where libaio is there); on the CPU accelerator
deepspeed.comm also loads the shared-memory collectives (ShareMemCommBuilder). On 2 CPU cores the first launch
spends ~2 minutes compiling, silently. `dspipe build-ops` (run by scripts/setup.sh) compiles them once ahead of time;
a launch that will still compile one says so in one line (notice)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    builder: str
    """DeepSpeed's op builder class name (the accelerator's create_op_builder key)."""
    name: str
    """The op's name (its JIT cache directory)."""
    built: bool
    """Installed prebuilt, or compiled into torch's extension cache."""
    where: str
    """Where it is or will be: 'prebuilt in deepspeed' or the cache directory."""


OPTIMIZER_BUILDERS = {
    "none": ["FusedAdamBuilder"],
    "cpu": ["CPUAdamBuilder"],
    "nvme": ["CPUAdamBuilder", "AsyncIOBuilder"],
}
"""The op builders of a plan's optimizer offload (plan.offload): FusedAdam on the device, DeepSpeedCPUAdam on the
host, plus the async I/O that swaps its state to NVMe."""


def runner_builders(*, offload: str | None) -> list[str]:
    """The op builders a run loads here: those of its optimizer offload (`offload`, plan.offload; None: every
    offload's, for any run), and the shared-memory collectives on the CPU accelerator."""
    from deepspeed.accelerator import get_accelerator

    kinds = [offload] if offload is not None else list(OPTIMIZER_BUILDERS)
    optimizer = list(dict.fromkeys(b for kind in kinds for b in OPTIMIZER_BUILDERS[kind]))
    comm = ["ShareMemCommBuilder"] if get_accelerator().device_name() == "cpu" else []
    return optimizer + comm


def runner_ops(*, offload: str | None) -> list[Op]:
    """runner_builders' ops that this accelerator has and can load (an incompatible one is never loaded)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    ops = []
    for key in runner_builders(offload=offload):
        builder = get_accelerator().create_op_builder(key)
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            continue
        built, where = _state(builder.NAME)
        ops.append(Op(builder=key, name=builder.NAME, built=built, where=where))
    return ops


def _state(name: str) -> tuple[bool, str]:
    """(built, where) of the op `name`: prebuilt into the installed DeepSpeed, or its JIT cache directory holding
    the compiled module."""
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get(name, False):
        return True, "prebuilt in deepspeed"
    from torch.utils.cpp_extension import _get_build_directory

    cache = _get_build_directory(name, verbose=False)
    return os.path.isfile(os.path.join(cache, f"{name}.so")), cache


def op_built(name: str) -> bool:
    """Whether the op `name` is prebuilt into DeepSpeed or compiled into the extension cache."""
    return _state(name)[0]


def notice(*, offload: str) -> str | None:
    """The launch's line when it will compile ops (None when every op it loads is built)."""
    pending = [op for op in runner_ops(offload=offload) if not op.built]
    if not pending:
        return None
    names = ", ".join(op.name for op in pending)
    return (
        f"building DeepSpeed's {names} op{'s' if len(pending) > 1 else ''} for this machine before the first step "
        f"(once: cached in {os.path.dirname(pending[0].where)}; a minute or two each; "
        f"'dspipe build-ops' builds them ahead of time)"
    )


def build(op: Op) -> float:
    """Compile and load `op` (DeepSpeed's own builder, JIT into the cache); the seconds it took."""
    from deepspeed.accelerator import get_accelerator

    start = time.perf_counter()
    get_accelerator().create_op_builder(op.builder).load(verbose=False)
    return time.perf_counter() - start
