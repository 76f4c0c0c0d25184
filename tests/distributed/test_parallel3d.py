"""Tensor parallelism (dspipe's Megatron-layout layers) and sequence parallelism (DeepSpeed-Ulysses) on real CPU
ranks: the same seed and batches give the tp = 1 losses and gradient norms at sp = 2 (ZeRO-3, reduce_scatter off) and
at tp 2 x dp 2 on 4 ranks (ZeRO-2); the live engines report the sizes asked for; the tp 2 x dp 2 checkpoint exports
to the same Hugging Face logits as the tp = 1 run's (tp x pp: test_tp_pp.py, test_tp_checkpoints.py). One launch per
layout, shared by the assertions."""

import json

import pytest

from tests.helpers import dspipe, free_port, launch, make_run, metrics

pytestmark = [pytest.mark.distributed, pytest.mark.solo]  # 4+ ranks, or a time it measures

STEPS = 10
LAYOUTS = {  # name: (gen-config flags, ranks)
    "tp1": (["--zero", "1"], 2),
    "sp2-zero3": (["--zero", "3", "--sp", "2"], 2),
    "tp2xdp2-zero2": (["--zero", "2", "--tp", "2", "--gpus-per-node", "4"], 4),
}


def _monitors_installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("wandb", "comet_ml"))


MONITORS = ["--wandb-project", "dspipe-test", "--comet-project", "dspipe-test", "--comet-offline"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    out = {}
    for name, (flags, ranks) in LAYOUTS.items():
        tmp = tmp_path_factory.mktemp(name)
        env = None
        if name == "tp1" and _monitors_installed():  # W&B and Comet offline, through DeepSpeed's monitor config
            flags = [*flags, *MONITORS]
            env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp), "COMET_OFFLINE_DIRECTORY": str(tmp / "comet")}
        run_dir = make_run(tmp, corpus, "--precision", "fp32", *flags, steps=STEPS)
        r = launch(run_dir, num_gpus=ranks, port=free_port(), env=env)
        assert r.returncode == 0, name + ": " + r.stdout[-3000:] + r.stderr[-3000:]
        out[name] = run_dir
    return out


@pytest.mark.parametrize("name", ["sp2-zero3", "tp2xdp2-zero2"])
def test_same_losses_and_grad_norms_as_tp1(runs, name):
    ref, got = metrics(runs["tp1"], "loss", "grad_norm"), metrics(runs[name], "loss", "grad_norm")
    assert len(got) == len(ref) == STEPS
    for step, ((loss_a, norm_a), (loss_b, norm_b)) in enumerate(zip(ref, got, strict=True), start=1):
        # fp32: only the summation order differs (measured differences <= 1e-6)
        assert loss_b == pytest.approx(loss_a, rel=1e-5, abs=1e-5), (step, loss_a, loss_b)
        assert norm_b == pytest.approx(norm_a, rel=1e-4, abs=1e-6), (step, norm_a, norm_b)
    assert sum(loss for loss, _ in got[-3:]) / 3 < got[0][0] - 0.3  # and it trains


def test_live_engines_use_the_planned_layout(runs):
    expected = {
        "tp1": dict(tp=1, sp=1, dp=2, world_size=2, tp_sharded_params=0, train_batch_size=16),
        # the tp ranks are not data-parallel (the mpu's data groups leave them out): train_batch_size = 16
        "sp2-zero3": dict(tp=1, sp=2, dp=1, world_size=2, train_batch_size=16, zero_stage=3),
        "tp2xdp2-zero2": dict(tp=2, sp=1, dp=2, world_size=4, train_batch_size=16, zero_stage=2),
    }
    for name, want in expected.items():
        live = json.loads((runs[name] / "engine.json").read_text())
        assert {k: live[k] for k in want} == want, name
        if want["tp"] > 1:  # 2 blocks x (q/k/v and MLP-up weight + bias, the 2 output weights) + the embedding
            assert live["tp_sharded_params"] == 2 * 6 + 1, name
    ds = json.loads((runs["sp2-zero3"] / "ds_config.json").read_text())
    assert ds["zero_optimization"]["reduce_scatter"] is False and ds["sequence_parallel_size"] == 2


def test_export_of_a_tp2_checkpoint_gives_the_tp1_logits(runs, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    logits = {}
    for name in ("tp1", "tp2xdp2-zero2", "sp2-zero3"):
        out = tmp_path / f"hf-{name}"
        r = dspipe("export-hf", runs[name], "--out", out)
        assert r.returncode == 0, r.stderr
        model = AutoModelForCausalLM.from_pretrained(out).eval()
        x = torch.arange(64).remainder(1000).view(1, 64)
        with torch.no_grad():
            logits[name] = model(x).logits
    assert logits["tp1"].abs().max() > 0.1
    for name in ("tp2xdp2-zero2", "sp2-zero3"):
        assert (logits[name] - logits["tp1"]).abs().max().item() < 1e-4, name


def test_wandb_and_comet_offline_runs_hold_every_step(runs):
    import glob
    import zipfile

    if not _monitors_installed():
        pytest.skip(
            "wandb / comet_ml not installed: the monitor block is checked through DeepSpeed's config class "
            "in tests/unit/planner/test_parallel_layout_rules.py"
        )
    tmp = runs["tp1"].parent
    ds = json.loads((runs["tp1"] / "ds_config.json").read_text())
    assert ds["wandb"]["enabled"] and ds["comet"]["enabled"] and ds["comet"]["online"] is False
    losses = [repr(loss).encode() for loss in metrics(runs["tp1"], "loss")]  # each step's loss, as metrics.csv has it
    (wandb_file,) = glob.glob(str(tmp / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = open(wandb_file, "rb").read()
    assert b"Train/loss" in data and b"Validation/val_loss" in data
    assert [loss in data for loss in losses] == [True] * STEPS
    (archive,) = glob.glob(str(tmp / "comet" / "*.zip"))
    with zipfile.ZipFile(archive) as z:
        text = b"".join(z.read(n) for n in z.namelist())
    assert b"Train/loss" in text and [loss in text for loss in losses] == [True] * STEPS
