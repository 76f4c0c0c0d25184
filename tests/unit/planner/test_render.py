"""Rendering: every value explicit, parsed by DeepSpeed's own config class, presets reproducible."""

import json

import pytest

from dspipe.jsonio import dumps
from dspipe.planner import ds_schema
from dspipe.planner.plan import make_plan
from dspipe.planner.render import DS_PRESETS, import_ds_preset, render_ds_config, shipped_preset
from dspipe.runtime.dscheck import parse_with_deepspeed
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.presets import MODEL_PRESETS
from dspipe.spec.strategy import StrategySpec
from dspipe.spec.train import TrainSpec
from tests.helpers import dspipe, run_cli

STRATEGIES = [
    StrategySpec(zero=0),
    StrategySpec(zero=1),
    StrategySpec(zero=2),
    StrategySpec(zero=3),
    StrategySpec(zero=2, offload="cpu"),
    StrategySpec(zero=3, offload="cpu", offload_params=True),
    StrategySpec(zero=3, offload="nvme", offload_params=True, nvme_path="/nvme"),
    StrategySpec(zero=1, pp=2, checkpointing="full"),
    StrategySpec(zero=0, pp=2),
    StrategySpec(zero=1, checkpointing="selective"),
]


def render(model_name, strategy, precision="bf16"):
    model = MODEL_PRESETS[model_name]
    train = TrainSpec(global_batch=64, micro_batch=2, steps=100, warmup_steps=10, precision=precision)
    plan = make_plan(model=model, cluster=ClusterSpec(1, 8, "h100-80g"), train=train, strategy=strategy)
    return plan, train, render_ds_config(plan=plan, model=model, train=train, monitor_dir="runs/x/monitor")


def leaves(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


@pytest.mark.parametrize("model_name", list(MODEL_PRESETS))
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: f"z{s.zero}-{s.offload}-pp{s.pp}-{s.checkpointing}")
def test_every_preset_and_strategy_parses_in_deepspeed(model_name, strategy):
    plan, train, cfg = render(model_name, strategy)
    ds = parse_with_deepspeed(cfg, dp=plan.dp)
    assert ds.train_batch_size == plan.global_batch == 64
    assert ds.train_micro_batch_size_per_gpu * ds.gradient_accumulation_steps * plan.dp == 64
    assert ds.zero_optimization_stage == strategy.zero
    assert ds.gradient_clipping == 1.0
    assert ds.bfloat16_config.enabled and not ds.float16_config.enabled
    assert ds.zero_config.offload_optimizer.device == strategy.offload
    assert ds.zero_config.offload_param.device == (strategy.offload if strategy.offload_params else "none")
    assert ds.zero_config.reduce_bucket_size == plan.reduce_bucket_size
    assert ds.pipeline["stages"] == plan.pp
    assert ds.pipeline["activation_checkpoint_interval"] == plan.activation_checkpoint_interval
    assert ds.grad_accum_dtype == plan.grad_accum_dtype
    assert ds.scheduler_name == "WarmupCosineLR" and ds.scheduler_params["total_num_steps"] == 100
    assert ds.optimizer_name == "adamw" and ds.optimizer_params["betas"] == [0.9, 0.95]
    assert ds.optimizer_params["weight_decay"] == 0.1
    assert ds.monitor_config.tensorboard.enabled and ds.monitor_config.csv_monitor.output_path == "runs/x/monitor"


def test_fp16_renders_dynamic_loss_scaling():
    plan, _, cfg = render("gpt2-124m", StrategySpec(zero=2), precision="fp16")
    ds = parse_with_deepspeed(cfg, dp=plan.dp)
    assert ds.float16_config.enabled and ds.float16_config.loss_scale == 0  # 0 = dynamic
    assert cfg["fp16"]["initial_scale_power"] == 16 and cfg["data_types"]["grad_accum_dtype"] == "fp16"


def test_the_same_keys_are_written_for_every_strategy():
    """Nothing is left to DeepSpeed's defaults: the key set does not depend on the strategy."""
    key_sets = {tuple(k for k, _ in leaves(render("tiny", s)[2])) for s in STRATEGIES}
    assert len(key_sets) == 1
    keys = key_sets.pop()
    for required in (
        "gradient_clipping",
        "zero_optimization.overlap_comm",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.offload_optimizer.device",
        "zero_optimization.offload_param.device",
        "data_types.grad_accum_dtype",
        "wall_clock_breakdown",
        "steps_per_print",
        "pipeline.activation_checkpoint_interval",
        "activation_checkpointing.partition_activations",
    ):
        assert required in keys


def _leaves(d: dict, prefix: str = "", *, whole: frozenset):
    """Dotted keys of d; a dict whose key is in `whole` (a value of its own, e.g. scheduler.params) is one leaf."""
    for key, value in d.items():
        if isinstance(value, dict) and f"{prefix}{key}" not in whole:
            yield from _leaves(value, f"{prefix}{key}.", whole=whole)
        else:
            yield f"{prefix}{key}"


def test_schema_is_every_rendered_key_each_with_a_source_and_values_must_match_exactly():
    paths = [key.path for key in ds_schema.SCHEMA]
    assert len(paths) == len(set(paths))
    assert all(
        key.name and (isinstance(key.default, ds_schema.Derived) or key.name in ds_schema.DEFAULTS)
        for key in ds_schema.SCHEMA
    )
    train = TrainSpec(global_batch=16, micro_batch=2, steps=10, warmup_steps=2, precision="fp32")
    plan = make_plan(
        model=MODEL_PRESETS["tiny"],
        cluster=ClusterSpec(nodes=1, gpus_per_node=2, gpu="cpu"),
        train=train,
        strategy=StrategySpec(zero=1),
    )
    cfg = render_ds_config(plan=plan, model=MODEL_PRESETS["tiny"], train=train, monitor_dir="/m")
    # every table key rendered, in the table's order, and nothing else
    assert list(_leaves(cfg, whole=frozenset(paths))) == paths
    with pytest.raises(KeyError, match="missing values"):
        ds_schema.build({"global_batch": 1})
    # what a preset's value of each key does: a target and a check, except the sections with their own reader
    assert all((key.take is None) == (key.check is None) for key in ds_schema.SCHEMA)
    assert {key.path for key in ds_schema.SCHEMA if key.take is None} == {
        "optimizer.type",
        "scheduler.type",
        "scheduler.params",
        "data_types.grad_accum_dtype",
    }


RECIPES = json.loads((DS_PRESETS / "recipes.json").read_text())


def test_every_shipped_preset_has_a_recipe():
    assert sorted(p.stem for p in DS_PRESETS.glob("*.json") if p.stem != "recipes") == sorted(RECIPES["presets"])


@pytest.mark.parametrize("name", sorted(RECIPES["presets"]))
def test_preset_rerenders_identically(name, tmp_path, monkeypatch, capsys):
    """ds_configs/NAME.json is, byte for byte, what its recipe (the reference model/cluster + the preset's flags)
    renders with the keys recipes.json leaves to the run set to "auto" (scripts/refresh_ds_presets.py); and --preset
    NAME with the reference flags renders that same ds_config.json: every "auto" resolves to the reference's value."""
    shipped = (DS_PRESETS / f"{name}.json").read_text()
    recipe = RECIPES["presets"][name]
    drive = recipe[recipe.index("--nvme-path") :][:2] if "--nvme-path" in recipe else []  # the machine's: not pinned
    rendered = {}
    for how, flags in (("recipe", recipe), ("preset", ["--preset", name, *drive])):
        (tmp_path / how).mkdir()
        monkeypatch.chdir(tmp_path / how)
        assert run_cli("gen-config", *RECIPES["reference"], *flags, "--out", f"runs/{name}") == 0, (
            capsys.readouterr().err
        )
        rendered[how] = json.loads((tmp_path / how / "runs" / name / "ds_config.json").read_text())
    assert dumps(shipped_preset(name, rendered["recipe"]), what=name) == shipped
    assert rendered["preset"] == rendered["recipe"]
    assert rendered["recipe"]["scheduler"]["params"]["total_num_steps"] == 20000  # the reference's --steps
    out = tmp_path / "preset" / "runs" / name
    zero = import_ds_preset(name).options["zero"]
    assert json.loads((out / "dspipe.json").read_text())["strategy"]["zero"] == zero


def test_recipes_leave_only_keys_the_presets_have():
    """recipes.json's "keep" names shipped presets and keys of its "auto" lists; no key is listed twice."""
    listed = [path for paths in RECIPES["auto"].values() for path in paths]
    assert len(listed) == len(set(listed))
    assert set(RECIPES["keep"]) <= set(RECIPES["presets"])
    assert all(set(keys) <= set(listed) for keys in RECIPES["keep"].values())


def test_flags_that_contradict_the_preset_are_one_line_errors(tmp_path):
    """A value the preset sets is never silently replaced by a flag: the conflict is one line, nothing written."""
    r = dspipe(
        "gen-config",
        *RECIPES["reference"],
        "--preset",
        "zero3-cpu-offload",
        "--offload",
        "none",
        "--out",
        "runs/x",
        cwd=tmp_path,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert '--offload none contradicts zero_optimization.offload_optimizer.device "cpu"' in r.stderr
    r = dspipe(
        "gen-config",
        *RECIPES["reference"],
        "--preset",
        "pipeline-zero1-bf16",
        "--pp",
        "4",
        "--out",
        "runs/x",
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "--pp 4 contradicts pipeline.stages 2" in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()
    r = dspipe(
        "gen-config",
        *RECIPES["reference"],
        "--preset",
        "pipeline-zero1-bf16",
        "--pp",
        "2",
        "--out",
        "runs/x",
        cwd=tmp_path,
    )  # a flag that agrees with the preset is fine
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "runs/x/ds_config.json").read_text())
    assert cfg["pipeline"]["stages"] == 2 and cfg["gradient_accumulation_steps"] == 512 // (4 * 4)


def test_preset_with_both_precisions_is_rejected(tmp_path):
    bad = json.loads((DS_PRESETS / "zero1-bf16.json").read_text())
    bad["fp16"]["enabled"] = True
    path = tmp_path / "both.json"
    path.write_text(json.dumps(bad))
    r = dspipe("gen-config", "--model", "tiny", "--preset", path, "--out", "runs/x", cwd=tmp_path)
    assert r.returncode == 2
    assert "fp16 and bf16 are both enabled" in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "runs").exists()
