"""dspipe.runtime.engine.to_device: a host batch on the rank's device, the same values; on CUDA without making the
host wait (CUDA's sync debug mode raises on a wait), from a slice too (Ulysses' local_slice is not contiguous)."""

import pytest
import torch

from dspipe.runtime.engine import to_device

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif("not torch.cuda.is_available()"))]


@pytest.mark.parametrize("device", DEVICES)
def test_a_host_batch_arrives_whole_without_a_host_wait(device):
    batch = torch.arange(4 * 64).reshape(4, 64)
    pieces = {"whole": batch, "slice": batch[:, 16:48]}
    target = torch.device(device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        moved = {name: to_device(t, target) for name, t in pieces.items()}
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    for name, t in moved.items():
        assert t.device.type == device and t.dtype == torch.long
        assert torch.equal(t.cpu(), pieces[name]), name
    if device == "cuda":  # a batch already there stays as it is
        assert to_device(moved["whole"], target) is moved["whole"]
