"""3D parallelism on real CPU ranks, with dspipe's own Megatron-layout tensor-parallel layers: tp 2 x pp 2 (4 ranks),
tp 2 x pp 2 x dp 2 (8 ranks) and tp 2 x Ulysses sp 2 train the plain 1-rank model of the same global batch (fp32,
6 steps: every step's loss within 1e-5 relative, gradient norm within 1e-4), for a GPT-2-style model (biases,
learned positions, tied head) and a Llama-style one (GQA, SwiGLU, rotary, untied head), with Megatron sequence
parallelism on and off; the live engines report every axis asked for. One launch per layout."""

import json

import pytest

from tests.helpers import free_port, launch, make_run, metrics

pytestmark = [pytest.mark.distributed, pytest.mark.solo]  # 4+ ranks, or a time it measures

STEPS = 6
MODELS = {"gpt": "tiny", "llama": "tiny-llama"}
LAYOUTS = {  # name: (model, flags, ranks); each model in each layout family, sequence parallelism on and off
    "gpt-plain": ("gpt", ["--zero", "1"], 1),
    "llama-plain": ("llama", ["--zero", "1"], 1),
    "gpt-tp2pp2": ("gpt", ["--zero", "1", "--tp", "2", "--pp", "2", "--no-tp-sp"], 4),
    "llama-tp2pp2-tpsp": ("llama", ["--zero", "1", "--tp", "2", "--pp", "2", "--tp-sp"], 4),
    "gpt-tp2pp2dp2-tpsp": ("gpt", ["--zero", "1", "--tp", "2", "--pp", "2", "--tp-sp"], 8),
    "llama-tp2pp2dp2": ("llama", ["--zero", "1", "--tp", "2", "--pp", "2", "--no-tp-sp"], 8),
    "gpt-tp2sp2-tpsp-zero2": ("gpt", ["--zero", "2", "--tp", "2", "--sp", "2", "--tp-sp"], 4),
    "llama-tp2sp2": ("llama", ["--zero", "1", "--tp", "2", "--sp", "2", "--no-tp-sp"], 4),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    out = {}
    for name, (model, flags, ranks) in LAYOUTS.items():
        run_dir = make_run(
            tmp_path_factory.mktemp(name),
            corpus,
            "--model",
            MODELS[model],
            "--precision",
            "fp32",
            "--gpus-per-node",
            str(ranks),
            "--log-interval",
            "1",
            *flags,
            steps=STEPS,
        )
        r = launch(run_dir, num_gpus=ranks, port=free_port())
        assert r.returncode == 0, name + ": " + r.stdout[-3000:] + r.stderr[-3000:]
        out[name] = run_dir
    return out


@pytest.mark.parametrize("name", [n for n in LAYOUTS if not n.endswith("plain")])
def test_same_losses_and_grad_norms_as_the_plain_model(runs, name):
    model = LAYOUTS[name][0]
    ref, got = metrics(runs[f"{model}-plain"], "loss", "grad_norm"), metrics(runs[name], "loss", "grad_norm")
    assert len(got) == len(ref) == STEPS
    for step, ((loss_a, norm_a), (loss_b, norm_b)) in enumerate(zip(ref, got, strict=True), start=1):
        assert loss_b == pytest.approx(loss_a, rel=1e-5), (name, step, loss_a, loss_b)
        assert norm_b == pytest.approx(norm_a, rel=1e-4), (name, step, norm_a, norm_b)
    assert got[-1][0] < got[0][0] - 0.1  # and it trains


def _axis(flags, name, default=1):
    return int(flags[flags.index(name) + 1]) if name in flags else default


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_live_engine_uses_every_planned_axis(runs, name):
    model, flags, ranks = LAYOUTS[name]
    live = json.loads((runs[name] / "engine.json").read_text())
    tp, pp, sp = _axis(flags, "--tp"), _axis(flags, "--pp"), _axis(flags, "--sp")
    want = dict(
        world_size=ranks,
        tp=tp,
        pp=pp,
        sp=sp,
        dp=ranks // (tp * pp * sp),
        zero_stage=_axis(flags, "--zero"),
        train_batch_size=16,
    )  # DeepSpeed counts only the data-parallel ranks: the global batch itself
    assert {k: live[k] for k in want} == want
    if tp == 1:
        assert live["tp_sharded_params"] == 0
        return
    # sharded on each rank: the 4 projections of each block (+ the column-parallel biases of the GPT-2 style), the
    # embedding and, untied, the head (a pipeline stage holds its own layers only)
    per_block, tables = (6, 1) if model == "gpt" else (4, 2)
    expected = 2 * per_block + tables if pp == 1 else None
    if expected is not None:
        assert live["tp_sharded_params"] == expected
    else:
        assert live["tp_sharded_params"] > 0
    assert live["tp_sequence_parallel"] == ("--tp-sp" in flags)
    assert json.loads((runs[name] / "ds_config.json").read_text())["tensor_parallel"]["autotp_size"] == 0  # not AutoTP
