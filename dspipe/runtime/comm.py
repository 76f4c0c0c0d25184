"""Process-group start for every entry point that DeepSpeed's launcher runs (training, doctor, benchmarks).

DeepSpeed's CPU all-reduce (its shm_comm op) creates one shared-memory segment per rank,
/dev/shm/deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank} (~66 MB), maps every peer's, and
never unlinks them: each CPU launch leaks world x 66 MB of RAM-backed tmpfs until the machine reboots. Once
every rank has mapped every peer's segment (true after init returns and a barrier passes), each rank unlinks its
own name; the memory stays valid for the live mappings and is freed when the last rank exits, even on kill -9.

Training, `dspipe doctor` and the memory census hold the group in `process_group()`, which destroys it when the work
is done (bench's worker destroys its own), and every rank then leaves through `exit_rank()`. Interpreter teardown
in a rank that used gloo intermittently dies in C++ with "terminate called without an active exception" (SIGABRT,
exit -6, a worker thread destructed before it was joined; pytorch/pytorch#65513, #190489) after the run had
completed and saved: 2 of ~100 CPU launches in one CI run without the destroy, 1 of ~100 in another with it.
"""

from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, NoReturn

from dspipe.errors import SpecError

if TYPE_CHECKING:
    import torch

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "deepspeed_allreduce_buffer"


def shm_segment(*, rank: int, env: dict | None = None) -> Path:
    """The segment DeepSpeed's shm_comm creates for `rank` (named from MASTER_ADDR/MASTER_PORT)."""
    env = os.environ if env is None else env
    return SHM_DIR / f"{SHM_PREFIX}_{os.getuid()}_{env.get('MASTER_ADDR')}_{env.get('MASTER_PORT')}_{rank}"


def cpu_threads_per_rank(*, env: dict | None = None) -> int | None:
    """Intra-op threads for one CPU rank: the cores this process may use / the ranks on this node (DeepSpeed's
    launcher sets LOCAL_SIZE), unless OMP_NUM_THREADS says otherwise. Left alone, every rank starts one thread per
    core and N ranks oversubscribe the cores N-fold."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS"):
        return None
    return max(1, len(os.sched_getaffinity(0)) // max(1, int(env.get("LOCAL_SIZE", "1"))))


ARCH_ENTRY = re.compile(r"^[0-9]+\.[0-9]+(\+PTX)?$")
"""An entry of TORCH_CUDA_ARCH_LIST that DeepSpeed 0.19.8's op builder can read (CUDAOpBuilder.compute_capability_args
turns each into int major, int minor)."""


def check_cuda_arch_list(env: dict | None = None) -> None:
    """Refuse, in one line, a TORCH_CUDA_ARCH_LIST that DeepSpeed's JIT op builds would die on with a ValueError deep
    inside the first build (torch's arch-specific '9.0a' form; some container images set it)."""
    value = (os.environ if env is None else env).get("TORCH_CUDA_ARCH_LIST", "")
    bad = [cc for cc in value.replace(" ", ";").split(";") if cc.strip() and not ARCH_ENTRY.match(cc.strip())]
    if bad:
        raise SpecError(
            f"TORCH_CUDA_ARCH_LIST={value!r}: DeepSpeed 0.19.8 builds its ops only for MAJOR.MINOR or "
            f"MAJOR.MINOR+PTX entries, not {', '.join(map(repr, bad))}; set e.g. "
            f"TORCH_CUDA_ARCH_LIST={_plain_arch(bad[0])} (or unset it: the GPUs' own are used)"
        )


def _plain_arch(cc: str) -> str:
    m = re.match(r"^\s*([0-9]+)\.([0-9]+)", cc)
    return f"{m.group(1)}.{m.group(2)}" if m else "9.0"


def init_distributed() -> str:
    """Start torch.distributed through DeepSpeed with the accelerator's backend (nccl on GPUs, gloo on CPU) and
    release this rank's shm_comm segment name. Returns the backend name."""
    from dspipe.runtime.lean_start import cache_cpu_info

    cache_cpu_info()  # before DeepSpeed loads its first op (shm_comm here, the optimizer's in deepspeed.initialize)
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    backend = get_accelerator().communication_backend_name()
    if get_accelerator().device_name() == "cpu":
        threads = cpu_threads_per_rank()
        if threads:
            torch.set_num_threads(threads)
    else:  # each rank's own GPU before the first collective (else NCCL guesses it from the global rank)
        check_cuda_arch_list()  # before any op is built
        get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    dist.barrier()  # every peer has mapped every segment: the names are no longer needed
    shm_segment(rank=dist.get_rank()).unlink(missing_ok=True)
    return backend


def collective_tensor(values, *, dtype) -> "torch.Tensor":
    """A small tensor (a flag, a figure) for a collective, on the device the process group's backend takes: the
    rank's GPU under NCCL, which refuses host tensors ("No backend type associated with device type cpu"), the CPU
    under gloo. `.item()` / `.tolist()` bring the result back."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return torch.tensor(values, dtype=dtype)
    from deepspeed.accelerator import get_accelerator

    return torch.tensor(values, dtype=dtype, device=get_accelerator().current_device_name())


@contextmanager
def process_group(*, agreed: tuple[type[BaseException], ...] = ()) -> Iterator[str]:
    """init_distributed() for the length of a with-block, yielding the backend name. Every process group is
    destroyed when the block ends normally or by one of the `agreed` exceptions: errors every rank raises at the same
    point. Any other exception leaves the groups alone: a peer may be inside a collective, where destroying can hang
    (NCCL), and the launcher tears the ranks down anyway."""
    import torch.distributed as dist

    backend = init_distributed()
    try:
        yield backend
    except agreed:
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End a launched rank with `code` once its work is written: flush Python's streams, then os._exit, which skips
    the interpreter and C++ teardown where the gloo abort above happens. Callers have closed their files (metrics,
    TensorBoard, checkpoints are complete after their barrier); nothing is left that the OS does not release."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
