"""The Llama-family decoder (RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases, untied head) on
real CPU ranks: ZeRO-1, ZeRO-3, selective recomputation and ZeRO-2 with CPU offload and full recomputation train
(the loss falls), and ZeRO-3, recomputation and offload give the ZeRO-1 losses and gradient norms at every step. One
launch per layout. Its tensor, sequence and pipeline layouts against the plain model: test_tp_pp.py (tp x pp, tp x
sp) and test_families.py (tp 2, pp 2, sp 2 for every Llama-family architecture, from transformers' loss)."""

import json

import pytest

from tests.helpers import free_port, launch, make_run, metrics

pytestmark = pytest.mark.distributed

STEPS = 10
LAYOUTS = {
    "zero1": ["--zero", "1"],
    "zero3": ["--zero", "3"],
    "selective": ["--zero", "1", "--checkpointing", "selective"],
    "zero2-offload-full": ["--zero", "2", "--offload", "cpu", "--checkpointing", "full"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    out = {}
    for name, flags in LAYOUTS.items():
        run_dir = make_run(
            tmp_path_factory.mktemp(name), corpus, "--model", "tiny-llama", "--precision", "fp32", *flags, steps=STEPS
        )
        r = launch(run_dir, port=free_port())
        assert r.returncode == 0, name + ": " + r.stdout[-3000:] + r.stderr[-3000:]
        out[name] = run_dir
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tiny_llama_trains(runs, name):
    got = metrics(runs[name], "loss", "grad_norm")
    assert len(got) == STEPS
    assert sum(loss for loss, _ in got[-3:]) / 3 < got[0][0] - 0.3, got  # the loss falls
    live = json.loads((runs[name] / "engine.json").read_text())
    zero = {"zero3": 3, "zero2-offload-full": 2}.get(name, 1)
    assert (live["pp"], live["tp"], live["sp"], live["zero_stage"], live["offload_optimizer"]) == (
        1,
        1,
        1,
        zero,
        name == "zero2-offload-full",
    )


@pytest.mark.parametrize("name", ["zero3", "selective", "zero2-offload-full"])
def test_same_losses_and_grad_norms_as_zero1(runs, name):
    ref, got = metrics(runs["zero1"], "loss", "grad_norm"), metrics(runs[name], "loss", "grad_norm")
    for step, ((loss_a, norm_a), (loss_b, norm_b)) in enumerate(zip(ref, got, strict=True), start=1):
        assert loss_b == pytest.approx(loss_a, rel=1e-5, abs=1e-5), (name, step, loss_a, loss_b)
        assert norm_b == pytest.approx(norm_a, rel=1e-4, abs=1e-6), (name, step, norm_a, norm_b)
