"""--preset with DeepSpeed JSON written by others: every key honoured in ds_config.json, reported, or refused by name.

Fixtures: tests/data/third_party_ds_configs/ (real configs; README.md names each source). gen-config runs on the
default cluster (1 node x 8 h100-80g: planning and DeepSpeed's config parse need no GPU).
"""

import json
import math
import shutil

import pytest

from dspipe.planner.ds_preset import import_preset
from dspipe.planner.render import DS_PRESETS, RECIPES
from tests.helpers import ROOT, dspipe

FIXTURES = ROOT / "tests" / "data" / "third_party_ds_configs"
MODEL = ["--model", "gpt2-124m", "--data", "none"]

OUTCOME = {  # file -> None (accepted) or the refused key the one error line must name
    "hf_transformers_zero2_auto.json": None,
    "hf_transformers_zero3.json": "zero_optimization.reduce_bucket_size 0",  # DeepSpeed 0.19 refuses 0 too (gt=0)
    "accelerate_zero_stage3_offload.json": None,
    "accelerate_zero_stage2.json": "optimizer.params.torch_adam",
    "bigscience_megatron_ds_config_bf16.json": None,
    "bigscience_megatron_tests_ds_config.json": None,
    "bigscience_megatron_flops_profiler.json": "flops_profiler",
    "deepspeedexamples_megatron_zero2.json": None,
    "deepspeedexamples_zero_infinity.json": "zero_optimization.stage3_param_persitance_threshold",
    "deepspeedexamples_cifar.json": "fp16.fp16_master_weights_and_grads",
}


def leaves(d, prefix=""):
    for key, value in d.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def lookup(d, path):
    for part in path.split("."):
        if not isinstance(d, dict) or part not in d:
            return KeyError
        d = d[part]
    return d


def same(a, b):
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=0, abs_tol=0)
    return a == b


def report_lines(r):
    return [line for line in r.stdout.splitlines() if line.startswith("preset: ")]


def gen(tmp_path, preset, *flags, out="runs/p"):
    return dspipe("gen-config", *MODEL, "--preset", preset, *flags, "--out", out, cwd=tmp_path)


def assert_refused(r, tmp_path, key):
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("dspipe: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert key in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists()


def test_every_fixture_has_a_readme_line_and_an_expected_outcome():
    readme = (FIXTURES / "README.md").read_text()
    files = sorted(p.name for p in FIXTURES.glob("*.json"))
    assert files == sorted(OUTCOME) and len(files) >= 6
    for name in files:
        assert f"- {name}: " in readme


@pytest.mark.parametrize("name", sorted(OUTCOME))
def test_third_party_preset_is_accounted_for_key_by_key(name, tmp_path):
    path = FIXTURES / name
    r = gen(tmp_path, path)
    refused = OUTCOME[name]
    if refused:
        assert_refused(r, tmp_path, refused)
        return
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "runs/p/ds_config.json").read_text())
    lines = report_lines(r)
    for key, value in leaves(json.loads(path.read_text())):
        got = lookup(cfg, key)
        if value == "auto":
            assert f'preset: {key} "auto" -> {json.dumps(got)} (' in r.stdout, (key, lines)
        elif got is not KeyError and same(value, got):
            continue  # honoured: the same value in ds_config.json
        else:
            assert any(key.split(".")[-1] in line and key.split(".")[0] in line for line in lines), (key, value, got)


def test_hf_auto_values_resolve_to_dspipe_values_and_are_reported(tmp_path):
    r = gen(tmp_path, FIXTURES / "hf_transformers_zero2_auto.json", "--lr", "1e-4", "--global-batch", "64")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "runs/p/ds_config.json").read_text())
    assert cfg["optimizer"]["params"]["lr"] == 1e-4 and cfg["scheduler"]["params"]["warmup_max_lr"] == 1e-4
    assert 'preset: optimizer.params.lr "auto" -> 0.0001 (--lr)' in r.stdout
    assert 'preset: train_batch_size "auto" -> 64 (--global-batch)' in r.stdout
    assert (
        f'preset: optimizer.params.betas "auto" -> {json.dumps(cfg["optimizer"]["params"]["betas"])} '
        f"(dspipe default)" in r.stdout
    )
    assert (
        cfg["train_batch_size"] == 64
        and cfg["gradient_accumulation_steps"] * cfg["train_micro_batch_size_per_gpu"] * 8 == 64
    )
    # the preset's own values reach the config: scheduler type, bucket sizes, offload, steps_per_print
    assert cfg["scheduler"]["type"] == "WarmupLR" and cfg["scheduler"]["params"]["warmup_min_lr"] == 0.0
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 200000000
    assert cfg["zero_optimization"]["allgather_bucket_size"] == 200000000
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu" and cfg["steps_per_print"] == 2000
    spec = json.loads((tmp_path / "runs/p/dspipe.json").read_text())
    assert spec["train"]["lr"] == 1e-4 and spec["strategy"]["zero"] == 2 and spec["strategy"]["offload"] == "cpu"


def test_enabled_auto_is_not_true_dspipe_decides(tmp_path):
    r = gen(tmp_path, FIXTURES / "hf_transformers_zero2_auto.json")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "runs/p/ds_config.json").read_text())
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False  # planner: bf16 on GPUs, not both
    assert 'preset: fp16.enabled "auto" -> false (planner)' in r.stdout
    r = gen(tmp_path, FIXTURES / "hf_transformers_zero2_auto.json", "--precision", "fp16", out="runs/q")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "runs/q/ds_config.json").read_text())
    assert cfg["fp16"]["enabled"] is True and cfg["bf16"]["enabled"] is False
    assert 'preset: fp16.enabled "auto" -> true (--precision)' in r.stdout
    assert cfg["fp16"]["initial_scale_power"] == 16 and cfg["fp16"]["loss_scale_window"] == 1000


def write(tmp_path, cfg, name="preset.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


def test_aliases_mean_what_deepspeed_says(tmp_path):
    cifar = json.loads((FIXTURES / "deepspeedexamples_cifar.json").read_text())
    del cifar["fp16"]["fp16_master_weights_and_grads"]
    cifar["train_batch_size"] = 64
    r = gen(tmp_path, write(tmp_path, cifar), "--steps", "2000")  # WarmupLR: 1000 warmup steps, then constant
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "runs/p/ds_config.json").read_text())
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"  # legacy cpu_offload: true
    assert (
        "preset: zero_optimization.cpu_offload true is DeepSpeed's deprecated form; read as "
        "offload_optimizer.device cpu" in r.stdout
    )
    assert cfg["optimizer"]["type"] == "Adam" and cfg["optimizer"]["params"]["betas"] == [0.8, 0.999]
    assert cfg["optimizer"]["params"]["eps"] == 1e-8 and cfg["optimizer"]["params"]["weight_decay"] == 3e-7
    assert cfg["fp16"]["enabled"] and cfg["fp16"]["initial_scale_power"] == 15
    assert cfg["fp16"]["loss_scale_window"] == 500
    assert cfg["scheduler"] == {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log"},
    }
    spec = json.loads((tmp_path / "runs/p/dspipe.json").read_text())
    assert spec["train"]["weight_decay"] == 3e-7 and spec["train"]["warmup_steps"] == 1000  # the engine's groups

    bf = {
        "train_batch_size": 64,
        "bfloat16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "stage3_gather_fp16_weights_on_model_save": True,
            "prefetch_bucket_size": 5e7,
            "cpu_offload_param": True,
            "cpu_offload": True,
        },
    }
    r = gen(tmp_path, write(tmp_path, bf, "bf.json"), out="runs/bf")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "runs/bf/ds_config.json").read_text())
    assert cfg["bf16"]["enabled"] is True and "preset: bfloat16 is DeepSpeed's old name of bf16" in r.stdout
    zero = cfg["zero_optimization"]
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True and zero["stage3_prefetch_bucket_size"] == 5e7
    assert zero["offload_param"]["device"] == "cpu" and zero["offload_optimizer"]["device"] == "cpu"
    # the live-parameter knobs are the planner's: the plan (and its memory estimate) uses the preset's values
    live = dict(
        bf,
        zero_optimization=dict(bf["zero_optimization"], stage3_max_live_parameters=1e9, stage3_max_reuse_distance=1e9),
    )
    r = gen(tmp_path, write(tmp_path, live, "live.json"), out="runs/live")
    assert r.returncode == 0, r.stderr
    zero = json.loads((tmp_path / "runs/live/ds_config.json").read_text())["zero_optimization"]
    plan = json.loads((tmp_path / "runs/live/dspipe.json").read_text())["plan"]
    assert zero["stage3_max_live_parameters"] == plan["max_live_parameters"] == 10**9
    assert zero["stage3_max_reuse_distance"] == plan["max_reuse_distance"] == 10**9


def test_unknown_keys_are_handled_as_deepspeed_handles_them(tmp_path):
    base = json.loads((FIXTURES / "bigscience_megatron_ds_config_bf16.json").read_text())
    bad = dict(base, zero_optimization={"stage": 1, "reduce_bucket_sise": 5e8})
    r = gen(tmp_path, write(tmp_path, bad))
    assert_refused(r, tmp_path, "zero_optimization.reduce_bucket_sise")
    assert "did you mean reduce_bucket_size" in r.stderr
    r = gen(tmp_path, write(tmp_path, dict(base, amp={"enabled": True})))
    assert_refused(r, tmp_path, "amp")  # removed from DeepSpeed 0.19, which refuses it
    r = gen(tmp_path, write(tmp_path, dict(base, bf16={"enabled": True, "enabeld": False})))
    assert_refused(r, tmp_path, "bf16.enabeld")
    # top level: DeepSpeedConfig ignores unknown keys; dspipe ignores them too, and says so
    r = gen(tmp_path, write(tmp_path, dict(base, gradient_cliping=0.5)))
    assert r.returncode == 0, r.stderr
    assert (
        "preset: gradient_cliping is not a DeepSpeed setting; ignored, as DeepSpeed ignores unknown top-level "
        "keys (did you mean gradient_clipping?)" in r.stdout
    )
    assert json.loads((tmp_path / "runs/p/ds_config.json").read_text())["gradient_clipping"] == 1.0


def test_flag_that_contradicts_the_preset_is_one_line(tmp_path):
    preset = FIXTURES / "bigscience_megatron_ds_config_bf16.json"
    r = gen(tmp_path, preset, "--global-batch", "64")
    assert_refused(r, tmp_path, "--global-batch 64 contradicts train_batch_size 16 in preset")
    r = gen(tmp_path, preset, "--precision", "fp16")
    assert_refused(r, tmp_path, "--precision fp16 contradicts bf16.enabled true in preset")
    r = gen(tmp_path, preset, "--grad-clip", "0.5")
    assert_refused(r, tmp_path, "--grad-clip 0.5 contradicts gradient_clipping 1.0")
    r = gen(tmp_path, preset, "--global-batch", "16", "--grad-clip", "1.0", "--zero", "1")  # agreeing flags are fine
    assert r.returncode == 0, r.stderr


def test_values_the_user_set_reach_the_config(tmp_path):
    cfg_in = {
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.5,
        "steps_per_print": 7,
        "wall_clock_breakdown": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.05}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "total_num_steps": 500,
                "warmup_num_steps": 20,
                "warmup_max_lr": 2e-4,
                "warmup_min_lr": 1e-6,
                "warmup_type": "linear",
            },
        },
        "fp16": {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 12,
            "loss_scale_window": 200,
            "hysteresis": 4,
            "min_loss_scale": 2,
        },
        "zero_optimization": {
            "stage": 2,
            "overlap_comm": False,
            "contiguous_gradients": False,
            "reduce_bucket_size": 3e7,
            "allgather_bucket_size": 4e7,
        },
        "activation_checkpointing": {"partition_activations": True, "number_checkpoints": 4},
        "tensorboard": {"enabled": False, "output_path": "logs/", "job_name": "tb"},
        "wandb": {"enabled": True, "project": "mine", "team": "t"},
        "csv_monitor": {"enabled": True, "job_name": "c"},
        "pipeline": {"stages": 1},
    }
    r = gen(tmp_path, write(tmp_path, cfg_in))
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "runs/p/ds_config.json").read_text())
    for key, value in leaves(cfg_in):
        if key != "tensorboard.output_path":
            assert same(lookup(cfg, key), value), (key, value, lookup(cfg, key))
    assert cfg["tensorboard"]["output_path"] == "runs/p/monitor"
    assert 'preset: tensorboard.output_path "logs/" -> "runs/p/monitor" (the run directory\'s monitor/)' in r.stdout
    spec = json.loads((tmp_path / "runs/p/dspipe.json").read_text())
    assert (spec["train"]["lr"], spec["train"]["steps"], spec["train"]["warmup_steps"], spec["train"]["grad_clip"]) == (
        2e-4,
        500,
        20,
        0.5,
    )
    assert spec["plan"]["grad_accum"] == 4 and spec["plan"]["precision"] == "fp16"


def test_values_dspipe_cannot_honour_are_refused(tmp_path):
    r = gen(
        tmp_path,
        write(
            tmp_path,
            {
                "train_batch_size": 64,
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 3,
                "pipeline": {"stages": 1},
            },
        ),
    )
    assert_refused(r, tmp_path, "train_batch_size 64 != micro 2 x gradient_accumulation_steps 3 x dp 8")
    r = gen(
        tmp_path,
        write(
            tmp_path,
            {
                "train_batch_size": 64,
                "data_types": {"grad_accum_dtype": "bf16"},
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 1},
            },
        ),
    )
    assert_refused(r, tmp_path, 'data_types.grad_accum_dtype "bf16" cannot be honoured: this plan renders "fp32"')
    r = gen(tmp_path, write(tmp_path, {"train_batch_size": 64, "optimizer": {"type": "Lamb", "params": {}}}))
    assert_refused(r, tmp_path, 'optimizer.type "Lamb" is not supported')
    r = gen(
        tmp_path,
        write(
            tmp_path,
            {
                "train_batch_size": 64,
                "optimizer": {"params": {"lr": 1e-3}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 2e-3}},
            },
        ),
    )
    assert_refused(r, tmp_path, "optimizer.params.lr 0.001 and scheduler.params.warmup_max_lr 0.002 disagree")
    for bad, key in (
        ('{"train_batch_size": NaN}', "NaN"),
        ('{"a": 1, "a": 2}', "duplicate key 'a'"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"train_batch_size": true}', "train_batch_size true"),
    ):
        path = tmp_path / "bad.json"
        path.write_text(bad)
        assert_refused(gen(tmp_path, path), tmp_path, key)


def test_presets_lists_only_deepspeed_presets():
    r = dspipe("presets")
    assert r.returncode == 0
    listed = r.stdout.splitlines()[-1].removeprefix("deepspeed presets: ").split(", ")
    assert RECIPES not in listed and sorted(listed) == sorted(
        p.stem for p in DS_PRESETS.glob("*.json") if p.stem != RECIPES
    )
    r = dspipe("gen-config", *MODEL, "--preset", RECIPES, "--out", "runs/x")
    assert r.returncode == 2 and "unknown DeepSpeed preset 'recipes'" in r.stderr


def test_import_is_torch_free_and_keeps_canonical_names():
    imp = import_preset(
        {"bfloat16": {"enabled": True}, "zero_optimization": {"stage": 3, "max_live_parameters": 1e9}}, source="x"
    )
    assert imp.canon["bf16"] == {"enabled": True} and imp.options["precision"] == "bf16"
    assert imp.canon["zero_optimization"]["stage3_max_live_parameters"] == 1000000000
    assert imp.options["max_live_parameters"] == 1000000000 and imp.options["zero"] == 3


def test_aio_of_a_zero_infinity_config_is_rendered_and_what_deepspeed_ignores_is_said(tmp_path):
    """DeepSpeedExamples' ZeRO-Infinity config with its misspelt key corrected: its aio section reaches ds_config.json
    (DeepSpeed reads it at every NVMe swap), its thread_count, which DeepSpeed 0.19 no longer reads, is reported."""
    cfg_in = json.loads((FIXTURES / "deepspeedexamples_zero_infinity.json").read_text())
    zero = cfg_in["zero_optimization"]
    zero["stage3_param_persistence_threshold"] = zero.pop("stage3_param_persitance_threshold")
    r = gen(tmp_path, write(tmp_path, cfg_in))
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "runs/p/ds_config.json").read_text())
    assert cfg["aio"] == {
        "block_size": 1048576,
        "queue_depth": 16,
        "intra_op_parallelism": 1,
        "single_submit": False,
        "overlap_events": True,
        "use_gds": False,
    }
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    assert "preset: aio.thread_count is not read by DeepSpeed 0.19 (intra_op_parallelism replaced it)" in r.stdout
    shutil.rmtree(tmp_path / "runs")
    plain = json.loads((FIXTURES / "bigscience_megatron_ds_config_bf16.json").read_text())
    r = gen(tmp_path, write(tmp_path, dict(plain, aio={"use_gds": True})))
    assert_refused(r, tmp_path, "aio.use_gds true must be false (GPUDirect Storage is not verified by dspipe")
    r = gen(tmp_path, write(tmp_path, dict(plain, aio={"queue_depth": 0})))
    assert_refused(r, tmp_path, "aio.queue_depth 0 must be an integer >= 1")
    # a section dspipe does not render, without a switch of its own: removing it is the one way
    r = gen(tmp_path, write(tmp_path, dict(plain, checkpoint={"use_node_local_storage": True})))
    assert_refused(r, tmp_path, 'checkpoint "{...}" is not supported by dspipe; remove it')
    assert "enabled" not in r.stderr


def test_a_pipeline_sections_recomputation_holds_at_pp_1(tmp_path):
    """activation_checkpoint_interval 1 asks for full recomputation; at pp 1 no pipeline engine reads the key (0 is
    rendered) and dspipe recomputes the blocks itself: a report line, not a refusal."""
    plain = json.loads((FIXTURES / "bigscience_megatron_ds_config_bf16.json").read_text())
    preset = write(tmp_path, dict(plain, pipeline={"activation_checkpoint_interval": 1}))
    r = gen(tmp_path, preset, "--pp", "1")
    assert r.returncode == 0, r.stderr
    assert "preset: pipeline.activation_checkpoint_interval 1 -> 0 (pp 1: no pipeline engine reads it" in r.stdout
    plan = json.loads((tmp_path / "runs/p/dspipe.json").read_text())["plan"]
    assert plan["checkpointing"] == "full" and plan["pp"] == 1
    r = gen(tmp_path, preset, "--pp", "1", "--checkpointing", "none", out="runs/q")
    assert_refused_at(r, "--checkpointing none contradicts pipeline.activation_checkpoint_interval 1")


def assert_refused_at(r, words):
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr
