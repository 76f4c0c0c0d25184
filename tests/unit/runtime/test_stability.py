"""Non-finite step guard and loss-spike / skip accounting (fast: one in-process gloo rank)."""

import math
import os
import types

import pytest
import torch
import torch.distributed as dist

from dspipe.runtime.stability import Health, guard_base_optimizer
from tests.helpers import free_port


@pytest.fixture(scope="module")
def one_rank():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_guard_skips_a_non_finite_step_and_leaves_weights_and_moments_alone(one_rank):
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([w], lr=0.1)
    engine = types.SimpleNamespace(optimizer=opt, module=None, mpu=None)
    assert guard_base_optimizer(engine) is True
    w.grad = torch.full((4,), 0.5)
    opt.step()
    assert opt.overflow is False and not torch.equal(w.detach(), torch.ones(4))
    assert opt._global_grad_norm == pytest.approx(1.0)  # ||(0.5, 0.5, 0.5, 0.5)||
    before, moments = w.detach().clone(), opt.state[w]["exp_avg"].clone()
    w.grad = torch.tensor([0.5, float("nan"), 0.5, 0.5])
    opt.step()
    assert opt.overflow is True
    assert torch.equal(w.detach(), before) and torch.equal(opt.state[w]["exp_avg"], moments)
    w.grad = torch.tensor([0.5, float("inf"), 0.5, 0.5])
    opt.step()
    assert opt.overflow is True and torch.equal(w.detach(), before)
    w.grad = torch.full((4,), 0.5)
    opt.step()
    assert opt.overflow is False and not torch.equal(w.detach(), before)


def test_guard_leaves_deepspeeds_own_overflow_checks_in_place(one_rank):
    opt = types.SimpleNamespace(overflow=False, step=lambda: None)  # e.g. a ZeRO / BF16 / fp16 wrapper
    assert guard_base_optimizer(types.SimpleNamespace(optimizer=opt)) is False


def test_consecutive_skips_halt_and_a_finite_step_resets_the_count():
    h = Health(max_skips=3, window=20, sigma=4.0)
    for step in range(1, 21):
        assert h.record(step=step, loss=5.0 + 0.01 * (step % 3), skipped=False) is None
    assert "skipped" in h.record(step=21, loss=float("nan"), skipped=True)
    assert "2 in a row" in h.record(step=22, loss=float("inf"), skipped=True)
    assert not h.halted
    h.record(step=23, loss=5.0, skipped=False)
    assert h.consecutive == 0 and h.total_skipped == 2
    for step in (24, 25, 26):
        h.record(step=step, loss=float("nan"), skipped=True)
    assert h.halted and h.total_skipped == 5


def test_a_loss_spike_is_logged_with_its_statistics():
    h = Health(max_skips=0, window=50, sigma=4.0)
    for step in range(1, 31):
        assert h.record(step=step, loss=3.0 + 0.1 * math.sin(step), skipped=False) is None
    line = h.record(step=31, loss=9.0, skipped=False)
    assert line.startswith("loss spike at step 31: 9.0000 > mean 3.0") and "of the last 30 steps" in line
    assert h.spikes == 1
    assert h.record(step=32, loss=3.05, skipped=False) is None
    for step in range(33, 100):  # max_skips 0: never halts
        h.record(step=step, loss=float("nan"), skipped=True)
    assert not h.halted
