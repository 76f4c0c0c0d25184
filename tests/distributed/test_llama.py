"""The Llama-family decoder (RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases, untied head) on
real CPU ranks: ZeRO-1, ZeRO-3, a 2-stage pipeline, selective recomputation and ZeRO-2 with CPU offload and full
recomputation train (the loss falls), and ZeRO-3, tensor parallelism (dspipe's layers with the unequal q/k/v and
paired gate/up splits, vocabulary-parallel embedding and head), sequence parallelism (rotary angles offset per slice),
recomputation and offload give the ZeRO-1 losses and gradient norms at every step. One launch per layout."""

import json

import pytest

from tests.helpers import free_port, launch, make_run, metrics

pytestmark = pytest.mark.distributed

STEPS = 10
LAYOUTS = {
    "zero1": ["--zero", "1"],
    "zero3": ["--zero", "3"],
    "pp2": ["--zero", "1", "--pp", "2"],
    "tp2": ["--zero", "1", "--tp", "2"],
    "sp2": ["--zero", "1", "--sp", "2"],
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
        2 if name == "pp2" else 1,
        2 if name == "tp2" else 1,
        2 if name == "sp2" else 1,
        zero,
        name == "zero2-offload-full",
    )


@pytest.mark.parametrize("name", ["zero3", "tp2", "sp2", "selective", "zero2-offload-full"])
def test_same_losses_and_grad_norms_as_zero1(runs, name):
    ref, got = metrics(runs["zero1"], "loss", "grad_norm"), metrics(runs[name], "loss", "grad_norm")
    for step, ((loss_a, norm_a), (loss_b, norm_b)) in enumerate(zip(ref, got, strict=True), start=1):
        assert loss_b == pytest.approx(loss_a, rel=1e-5, abs=1e-5), (name, step, loss_a, loss_b)
        assert norm_b == pytest.approx(norm_a, rel=1e-4, abs=1e-6), (name, step, norm_a, norm_b)


def test_pipeline_starts_from_the_same_loss_and_tp_shards_every_projection(runs):
    assert metrics(runs["pp2"], "loss")[0] == pytest.approx(metrics(runs["zero1"], "loss")[0], rel=1e-6)
    live = json.loads((runs["tp2"] / "engine.json").read_text())
    assert live["tp_sharded_params"] == 2 * 4 + 2  # 2 blocks x (qkv, out, gate/up, down), no biases; wte, lm_head
    assert json.loads((runs["tp2"] / "ds_config.json").read_text())["tensor_parallel"]["autotp_size"] == 0
