"""The DeepSpeed presets dspipe ships (ds_configs/) pin a strategy (ZeRO stage, precision, offload, layout), not one
run: the run's length, batch, hyperparameters and the values sized for a model or a machine are "auto", so the flags
that set them work with every shipped preset (issue 41). A user's own preset that pins them still refuses a flag that
contradicts it. Every test walks the presets found in ds_configs/, so a new preset is covered."""

import json
import math

import pytest

from dspipe.cli.options import default_warmup
from dspipe.planner.render import DS_PRESETS, import_ds_preset, preset_names
from dspipe.spec.options import SETTINGS
from tests.helpers import run_cli

SHIPPED = preset_names()
RUN = ["--model", "tiny", "--gpu", "h100-80g", "--gpus-per-node", "2", "--global-batch", "16"]  # plan's flags
STRATEGY = {"zero", "precision", "offload", "offload_params", "pp", "tp", "sp", "checkpointing"}
"""The gen-config options a shipped preset may pin: its strategy."""


def test_the_presets_are_found():
    assert len(SHIPPED) >= 8 and "zero1-bf16" in SHIPPED and "recipes" not in SHIPPED


def shipped(name: str) -> dict:
    return json.loads((DS_PRESETS / f"{name}.json").read_text())


def machine(name: str, tmp_path) -> list:
    """--nvme-path for a preset that offloads to NVMe: the drive is the machine's, so the preset leaves it open."""
    zero = shipped(name)["zero_optimization"]
    nvme = "nvme" in (zero["offload_optimizer"]["device"], zero["offload_param"]["device"])
    return ["--nvme-path", str(tmp_path / "nvme")] if nvme else []


def gen(tmp_path, monkeypatch, preset, *flags):
    """gen-config --preset PRESET into runs/x: (exit code, stdout, stderr, ds_config.json, dspipe.json or None)."""
    monkeypatch.chdir(tmp_path)
    code = run_cli("gen-config", *RUN, "--data", "none", "--preset", preset, *flags, "--out", "runs/x")
    return code, *_read(tmp_path / "runs" / "x")


def _read(out):
    files = [out / "ds_config.json", out / "dspipe.json"]
    return [json.loads(f.read_text()) if f.is_file() else None for f in files]


def schedule_length_ok(cfg: dict, *, steps: int, warmup: int) -> None:
    """The rendered schedule runs `steps` steps: total_num_steps where the scheduler has it (WarmupCosineLR,
    WarmupDecayLR), and the warmup derived from that length (WarmupLR's only length)."""
    params = cfg["scheduler"]["params"]
    if cfg["scheduler"]["type"] in ("WarmupCosineLR", "WarmupDecayLR"):
        assert params["total_num_steps"] == steps
    assert params["warmup_num_steps"] == warmup


@pytest.mark.parametrize("name", SHIPPED)
def test_the_preset_pins_its_strategy_and_no_run_value(name):
    """What importing the shipped file sets: only strategy options; the schedule's length and warmup, the batch and
    the optimizer's numbers are "auto" in the file itself."""
    imp = import_ds_preset(name)
    assert set(imp.options) <= STRATEGY, sorted(set(imp.options) - STRATEGY)
    assert {"zero", "precision"} <= set(imp.options) and imp.grad_accum is None
    cfg = shipped(name)
    for path in (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "optimizer.params.lr",
        "optimizer.params.weight_decay",
        "scheduler.params.total_num_steps",
        "scheduler.params.warmup_num_steps",
        "scheduler.params.cos_min_ratio",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.offload_optimizer.nvme_path",
        "tensor_parallel.partition_config",
    ):
        node = cfg
        for part in path.split("."):
            node = node[part]
        assert node == "auto", (path, node)


@pytest.mark.parametrize("name", SHIPPED)
def test_steps_sets_the_schedule_of_every_shipped_preset(name, tmp_path, monkeypatch, capsys):
    """The issue's command, for every shipped preset: --steps 1000 is the run's length in the ds_config.json
    written, and the warmup follows it (a tenth: 100), not the reference run's 20000 / 2000."""
    code, cfg, spec = gen(tmp_path, monkeypatch, name, "--steps", "1000", *machine(name, tmp_path))
    out = capsys.readouterr()
    assert code == 0, out.err
    schedule_length_ok(cfg, steps=1000, warmup=100)
    assert spec["train"]["steps"] == 1000 and spec["train"]["warmup_steps"] == 100
    assert cfg["train_batch_size"] == 16  # --global-batch, not the reference's 512
    assert 'preset: scheduler.params.total_num_steps "auto" -> 1000 (--steps)' in out.out.splitlines()


@pytest.mark.parametrize("name", SHIPPED)
def test_without_a_length_the_run_gets_the_default(name, tmp_path, monkeypatch, capsys):
    """Neither --steps nor --tokens: the schedule is --steps' fallback (1000 steps), as without a preset."""
    fallback = SETTINGS["steps"].fallback
    assert fallback == 1000
    code, cfg, spec = gen(tmp_path, monkeypatch, name, *machine(name, tmp_path))
    out = capsys.readouterr()
    assert code == 0, out.err
    schedule_length_ok(cfg, steps=fallback, warmup=default_warmup(fallback))
    assert spec["train"]["steps"] == fallback
    lines = out.out.splitlines()  # a shipped preset's "auto" keys that no typed flag set are counted in one line
    assert not any(line.startswith("preset: scheduler.") for line in lines), lines
    assert any(
        line.startswith(f"preset {name}: ") and 'more keys it leaves to the run ("auto")' in line for line in lines
    ), lines


@pytest.mark.parametrize("name", SHIPPED)
def test_tokens_derive_the_steps_with_a_shipped_preset(name, tmp_path, monkeypatch, capsys):
    """--tokens 2e9 on 16 x 64-token sequences: ceil(2e9 / 1024) = 1,953,125 steps, warmup at its cap of 2000."""
    steps = math.ceil(2e9 / (16 * 64))
    assert steps == 1_953_125 and default_warmup(steps) == 2000
    code, cfg, spec = gen(tmp_path, monkeypatch, name, "--tokens", "2e9", *machine(name, tmp_path))
    out = capsys.readouterr()
    assert code == 0, out.err
    schedule_length_ok(cfg, steps=steps, warmup=2000)
    assert spec["train"]["steps"] == steps and spec["train"]["tokens"] == "2e9"
    assert f'preset: scheduler.params.total_num_steps "auto" -> {steps} (--tokens)' in out.out.splitlines()


@pytest.mark.parametrize("name", SHIPPED)
def test_plan_takes_a_shipped_preset(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = run_cli("plan", *RUN, "--preset", name, "--steps", "1000", *machine(name, tmp_path))
    out = capsys.readouterr()
    assert code == 0, out.err
    assert 'preset: scheduler.params.total_num_steps "auto" -> 1000 (--steps)' in out.out.splitlines()
    assert 'preset: train_batch_size "auto" -> 16 (--global-batch)' in out.out.splitlines()
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name", SHIPPED)
def test_the_common_run_flags_work_with_every_shipped_preset(name, tmp_path, monkeypatch, capsys):
    """Each of these was refused as contradicting the preset's reference-run value (global batch 512, micro 4,
    lr 6e-4, ...) or, for the monitors and the timers, its pinned false."""
    code, cfg, spec = gen(
        tmp_path,
        monkeypatch,
        name,
        "--steps",
        "300",
        "--micro-batch",
        "2",
        "--lr",
        "3e-4",
        "--min-lr-ratio",
        "0.05",
        "--warmup",
        "50",
        "--weight-decay",
        "0.01",
        "--grad-clip",
        "0.5",
        "--log-interval",
        "5",
        "--wall-clock-breakdown",
        "--reduce-bucket-size",
        "100000",
        "--checkpointing",
        "full",
        "--wandb-project",
        "p",
        *machine(name, tmp_path),
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    dp = spec["plan"]["dp"]
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"]) == (16, 2)
    assert cfg["gradient_accumulation_steps"] == 16 // (2 * dp)
    assert cfg["optimizer"]["params"]["lr"] == 3e-4 and cfg["optimizer"]["params"]["weight_decay"] == 0.01
    params = cfg["scheduler"]["params"]
    assert (params["total_num_steps"], params["warmup_num_steps"], params["cos_min_ratio"]) == (300, 50, 0.05)
    assert cfg["gradient_clipping"] == 0.5 and cfg["steps_per_print"] == 5 and cfg["wall_clock_breakdown"] is True
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 100000
    assert cfg["wandb"]["enabled"] is True and cfg["wandb"]["project"] == "p"
    assert spec["strategy"]["checkpointing"] == "full"
    assert 'preset: steps_per_print "auto" -> 5 (--log-interval)' in out.out.splitlines()


def test_the_nvme_preset_takes_the_machines_drive(tmp_path, monkeypatch, capsys):
    """zero3-nvme-offload leaves the drive to --nvme-path (the reference's /local_nvme is no one's in particular);
    without it, the one-line error that --offload nvme gives."""
    code, cfg, _ = gen(tmp_path, monkeypatch, "zero3-nvme-offload", "--nvme-path", "/mnt/nvme0")
    assert code == 0, capsys.readouterr().err
    zero = cfg["zero_optimization"]
    assert zero["offload_optimizer"]["nvme_path"] == zero["offload_param"]["nvme_path"] == "/mnt/nvme0"
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "nvme"
    capsys.readouterr()
    code = run_cli("gen-config", *RUN, "--data", "none", "--preset", "zero3-nvme-offload", "--out", "runs/y")
    err = capsys.readouterr().err
    assert code == 2 and err == "dspipe: error: --offload nvme needs --nvme-path DIR on a local NVMe drive\n"
    assert not (tmp_path / "runs" / "y").exists()


def test_a_shipped_preset_still_refuses_a_flag_against_its_strategy(tmp_path, monkeypatch, capsys):
    code, _, _ = gen(tmp_path, monkeypatch, "zero1-bf16", "--zero", "3")
    err = capsys.readouterr().err
    assert code == 2 and err == (
        "dspipe: error: --zero 3 contradicts zero_optimization.stage 1 in preset zero1-bf16; "
        "drop the flag or edit the preset\n"
    )
    assert not (tmp_path / "runs").exists()


def user_preset(tmp_path, **pins) -> str:
    """A copy of zero1-bf16 with a run value pinned again: total_num_steps, train_batch_size."""
    cfg = shipped("zero1-bf16")
    if "steps" in pins:
        cfg["scheduler"]["params"]["total_num_steps"] = pins["steps"]
    if "batch" in pins:
        cfg["train_batch_size"] = pins["batch"]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_a_user_preset_that_pins_the_length_still_refuses_steps(tmp_path, monkeypatch, capsys):
    preset = user_preset(tmp_path, steps=20000)
    code, cfg, _ = gen(tmp_path, monkeypatch, preset, "--steps", "1000")
    err = capsys.readouterr().err
    assert code == 2 and err == (
        f"dspipe: error: --steps 1000 contradicts scheduler.params.total_num_steps 20000 in "
        f"preset {preset}; drop the flag or edit the preset\n"
    )
    assert cfg is None and not (tmp_path / "runs").exists()
    code = run_cli("plan", *RUN, "--preset", preset, "--tokens", "2e9")  # 1,953,125 steps: not the preset's
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "total_num_steps is 20000" in err
    # its pinned length is the run's when no flag says otherwise, and the warmup (auto) follows it
    code, cfg, spec = gen(tmp_path, monkeypatch, preset)
    assert code == 0, capsys.readouterr().err
    schedule_length_ok(cfg, steps=20000, warmup=2000)
    assert spec["train"]["steps"] == 20000


def test_a_user_preset_that_pins_the_batch_still_refuses_global_batch(tmp_path, monkeypatch, capsys):
    preset = user_preset(tmp_path, batch=512)
    code, _, _ = gen(tmp_path, monkeypatch, preset, "--steps", "1000")  # RUN has --global-batch 16
    err = capsys.readouterr().err
    assert code == 2 and err == (
        f"dspipe: error: --global-batch 16 contradicts train_batch_size 512 in preset "
        f"{preset}; drop the flag or edit the preset\n"
    )
    assert not (tmp_path / "runs").exists()
