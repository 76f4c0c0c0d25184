"""Process-group helpers: CPU threads per rank, the shm segment name DeepSpeed's CPU all-reduce uses, the group's
lifetime."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from dspipe.errors import SpecError
from dspipe.runtime.comm import check_cuda_arch_list, cpu_threads_per_rank, process_group, shm_segment
from tests.helpers import ROOT, free_port


def test_cpu_ranks_split_the_cores_instead_of_oversubscribing_them():
    cores = len(os.sched_getaffinity(0))
    assert cpu_threads_per_rank(env={"LOCAL_SIZE": "1"}) == cores
    assert cpu_threads_per_rank(env={"LOCAL_SIZE": str(cores)}) == 1
    assert cpu_threads_per_rank(env={"LOCAL_SIZE": str(4 * cores)}) == 1  # never 0
    assert cpu_threads_per_rank(env={"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "3"}) is None  # the user's choice stands


def test_shm_segment_name_matches_deepspeeds():
    # deepspeed/ops/csrc/cpu/comm/shm.cpp: "%s_%d_%s_%s" (SHM_BUFFER_NAME, getuid(), MASTER_ADDR, MASTER_PORT) + "_%d"
    # rank
    path = shm_segment(rank=1, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert str(path) == f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_29500_1"


def test_process_group_is_destroyed_at_the_end_and_on_agreed_errors_only(monkeypatch):
    """A group left to interpreter exit can abort a finished gloo rank (SIGABRT); every entry point uses this."""
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
    }.items():
        monkeypatch.setenv(key, value)
    with process_group() as backend:
        assert backend == "gloo" and dist.is_initialized()
        t = torch.ones(3)
        dist.all_reduce(t, async_op=True).wait()  # finished async work, as ZeRO's overlapped reductions leave
        assert t.tolist() == [1.0, 1.0, 1.0]
    assert not dist.is_initialized()
    assert not shm_segment(rank=0).exists()
    with pytest.raises(SpecError, match="agreed"):
        with process_group(agreed=(SpecError,)):
            raise SpecError("agreed")
    assert not dist.is_initialized()
    with pytest.raises(ZeroDivisionError):  # one rank's bug: a peer may sit in a collective, leave the group be
        with process_group(agreed=(SpecError,)):
            raise ZeroDivisionError
    assert dist.is_initialized()
    dist.destroy_process_group()


def test_exit_rank_flushes_what_was_printed_and_keeps_the_exit_code():
    code = (
        "import sys; from dspipe.runtime.comm import exit_rank; "
        "print('done', end=''); sys.stderr.write('dspipe: error'); exit_rank(3)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)  # pipes: buffered
    assert (r.returncode, r.stdout, r.stderr) == (3, "done", "dspipe: error")


def test_collective_tensors_live_where_the_backend_takes_them(monkeypatch):
    """NCCL refuses host tensors ("No backend type associated with device type cpu": the runner's flags and
    start-up figures failed so on an H200 before collective_tensor); gloo takes only host tensors."""
    from deepspeed.accelerator import get_accelerator

    from dspipe.runtime.comm import collective_tensor

    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
    }.items():
        monkeypatch.setenv(key, value)
    with process_group():
        t = collective_tensor([3], dtype=torch.int32)
        assert t.device.type == "cpu" and t.dtype == torch.int32 and t.tolist() == [3]
        monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "nccl")
        monkeypatch.setattr(type(get_accelerator()), "current_device_name", lambda self: "meta")
        t = collective_tensor([0.0, 1.0], dtype=torch.float64)
        assert t.device.type == "meta" and t.shape == (2,)


@pytest.mark.parametrize("value", ["", "9.0", "8.0;9.0", "8.0 8.6 9.0+PTX", " 9.0 "])
def test_cuda_arch_lists_deepspeed_reads_pass(value):
    check_cuda_arch_list({"TORCH_CUDA_ARCH_LIST": value})
    check_cuda_arch_list({})


@pytest.mark.parametrize(
    "value,bad,fix", [("9.0a", "'9.0a'", "9.0"), ("8.0;10.0a", "'10.0a'", "10.0"), ("sm_90", "'sm_90'", "9.0")]
)
def test_cuda_arch_lists_deepspeed_dies_on_are_one_line(value, bad, fix):
    with pytest.raises(SpecError) as e:
        check_cuda_arch_list({"TORCH_CUDA_ARCH_LIST": value})
    assert f"not {bad}; set e.g. TORCH_CUDA_ARCH_LIST={fix} " in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("value", ["9.0", "8.0;9.0", "8.0 8.6 9.0+PTX", "9.0a", "8.0;10.0a", "sm_90", "10.0+PTX"])
def test_the_check_agrees_with_deepspeeds_op_builder(value):
    """DeepSpeed's own parse of the list (CUDAOpBuilder.compute_capability_args, JIT mode): it raises exactly where
    the check refuses."""
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder

    class Builder(CUDAOpBuilder):
        BUILD_VAR, NAME = "DS_BUILD_DSPIPE_TEST", "dspipe_test"

        def __init__(self):
            super().__init__(name=self.NAME)

        def absolute_name(self):
            return self.NAME

        def sources(self):
            return []

    builder = Builder()
    builder.jit_mode, builder._jit_arch_list = True, value
    try:
        builder.compute_capability_args()
        deepspeed_reads = True
    except ValueError:
        deepspeed_reads = False
    try:
        check_cuda_arch_list({"TORCH_CUDA_ARCH_LIST": value})
        we_pass = True
    except SpecError:
        we_pass = False
    assert we_pass == deepspeed_reads
