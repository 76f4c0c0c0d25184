"""Process-group helpers: CPU threads per rank, the shm segment name DeepSpeed's CPU all-reduce uses."""
import os

from dspipe.comm import cpu_threads_per_rank, shm_segment


def test_cpu_ranks_split_the_cores_instead_of_oversubscribing_them():
    cores = len(os.sched_getaffinity(0))
    assert cpu_threads_per_rank(env={"LOCAL_SIZE": "1"}) == cores
    assert cpu_threads_per_rank(env={"LOCAL_SIZE": str(cores)}) == 1
    assert cpu_threads_per_rank(env={"LOCAL_SIZE": str(4 * cores)}) == 1  # never 0
    assert cpu_threads_per_rank(env={"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "3"}) is None  # the user's choice stands


def test_shm_segment_name_matches_deepspeeds():
    # deepspeed/ops/csrc/cpu/comm/shm.cpp: "%s_%d_%s_%s" (SHM_BUFFER_NAME, getuid(), MASTER_ADDR, MASTER_PORT) + "_%d" rank
    path = shm_segment(rank=1, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert str(path) == f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_29500_1"
