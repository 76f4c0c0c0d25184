"""Plan -> DeepSpeed JSON through the jinja2 template; DeepSpeed JSON preset -> strategy. No torch, no deepspeed."""
from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

import jinja2
import jinja2.meta

from dspipe.errors import SpecError
from dspipe.planner.ds_preset import PresetImport, import_preset, read_preset, scheduler_block
from dspipe.planner import autotp
from dspipe.planner.plan import Plan
from dspipe.spec.core import ModelSpec, TrainSpec

RESOURCES = Path(str(importlib.resources.files("dspipe") / "resources"))  # shipped inside the package
TEMPLATES = RESOURCES / "templates"
DS_PRESETS = RESOURCES / "ds_configs"
RECIPES = "recipes"  # ds_configs/recipes.json: the flags each shipped preset is rendered from


def render_template(name: str, values: dict) -> str:
    """Render templates/NAME; the values given must be exactly the template's variables (no more, no fewer).
    Dict values keep their key order (tojson without sorting) so that a rendered config reads like the template."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    env.policies["json.dumps_kwargs"] = {"sort_keys": False}
    source = env.loader.get_source(env, name)[0]
    wanted = jinja2.meta.find_undeclared_variables(env.parse(source))
    if wanted != set(values):
        raise KeyError(f"{name}: missing values {sorted(wanted - set(values))}, unused {sorted(set(values) - wanted)}")
    return env.get_template(name).render(**values)


DS_DEFAULTS = dict(
    prescale_gradients=False, gradient_predivide_factor=1.0, zero_allow_untested_optimizer=False,
    optimizer_type="AdamW", betas=[0.9, 0.95], eps=1e-08,
    bf16_immediate_grad_update=False, bf16_check_grad_overflow=True,
    fp16_auto_cast=False, fp16_loss_scale=0, fp16_initial_scale_power=16, fp16_loss_scale_window=1000,
    fp16_hysteresis=2, fp16_consecutive_hysteresis=False, fp16_min_loss_scale=1,
    allgather_partitions=True, round_robin_gradients=False, load_from_fp32_weights=True,
    elastic_checkpoint=False, ignore_unused_parameters=True, sub_group_size=1000000000,
    gather_16bit_weights_on_model_save=False,
    offload_optimizer_buffer_count=4, offload_optimizer_fast_init=False, offload_optimizer_ratio=1.0,
    offload_param_buffer_count=5, offload_param_buffer_size=100000000, offload_param_max_in_cpu=1000000000,
    pipe_partitioned=True, grad_partitioned=True,
    ac_partition_activations=False, ac_cpu_checkpointing=False, ac_contiguous_memory_optimization=False,
    ac_number_checkpoints=None, ac_synchronize_checkpoint_boundary=False, ac_profile=False,
    tensorboard_enabled=True, tensorboard_job_name="tensorboard", csv_monitor_enabled=True, csv_monitor_job_name="csv",
    wandb_enabled=False, wandb_group=None, wandb_team=None, wandb_project="deepspeed",
    comet_enabled=False, comet_samples_log_interval=100, comet_project=None, comet_workspace=None,
    comet_api_key=None, comet_experiment_name=None, comet_experiment_key=None, comet_online=True,
    comet_mode="get_or_create",
    tp_overlap_comm=False, vocab_parallel_lm_head=False, vocab_parallel_ce_backend="torch", tp_grain_size=1,
)
"""dspipe's own value of every DeepSpeed setting the plan does not derive; a --preset may set each of them."""


MONITOR_OPTIONS = {  # gen-config option -> template value; W&B and Comet through DeepSpeed's own monitor config
    "wandb_project": "wandb_project", "wandb_group": "wandb_group", "wandb_team": "wandb_team",
    "comet_project": "comet_project", "comet_workspace": "comet_workspace",
    "comet_experiment": "comet_experiment_name"}


def monitor_values(options: dict) -> dict:
    """Template values for the monitors the options turn on: --wandb-project enables W&B, --comet-project Comet
    (--comet-offline: an offline experiment). API keys are never written: W&B and Comet read them from their own
    environment variables or login files."""
    values = {}
    for key, value in options.items():
        if key not in MONITOR_OPTIONS or value is None:
            continue
        if not isinstance(value, str) or not value.strip() or not value.isprintable() or len(value) > 128:
            raise SpecError(f"--{key.replace('_', '-')} {value!r} must be a name: 1-128 printable characters")
        values[MONITOR_OPTIONS[key]] = value
    if options.get("wandb_project"):
        values["wandb_enabled"] = True
    if options.get("comet_project"):
        values["comet_enabled"] = True
        values["comet_samples_log_interval"] = 1  # dspipe logs its own events once per step, indexed by step
        values["comet_online"] = not options.get("comet_offline", False)
    return values


def render_ds_config(*, plan: Plan, model: ModelSpec, train: TrainSpec, monitor_dir: str,
                     wall_clock_breakdown: bool = False, preset: PresetImport | None = None,
                     monitors: dict | None = None) -> dict:
    """The complete DeepSpeed config for `plan`: every key explicit, nothing left to DeepSpeed's defaults. `preset`:
    the values a --preset sets (its import already checked them against the plan's options); `monitors`: template
    values from monitor_values()."""
    scheduler_type, scheduler_params = scheduler_block(preset, lr=train.lr, steps=train.steps,
                                                       warmup=train.warmup_steps, min_lr_ratio=train.min_lr_ratio)
    values = dict(
        DS_DEFAULTS,
        global_batch=plan.ds_train_batch_size, micro_batch=plan.micro_batch, grad_accum=plan.grad_accum,
        steps_per_print=train.log_interval, wall_clock_breakdown=wall_clock_breakdown,
        grad_clip=train.grad_clip, lr=train.lr, weight_decay=train.weight_decay,
        scheduler_type=scheduler_type, scheduler_params=scheduler_params,
        bf16=plan.precision == "bf16", fp16=plan.precision == "fp16", grad_accum_dtype=plan.grad_accum_dtype,
        zero_stage=plan.zero_stage, contiguous_gradients=plan.contiguous_gradients, overlap_comm=plan.overlap_comm,
        reduce_bucket_size=plan.reduce_bucket_size, allgather_bucket_size=plan.allgather_bucket_size,
        prefetch_bucket_size=plan.prefetch_bucket_size,
        param_persistence_threshold=plan.param_persistence_threshold,
        max_live_parameters=plan.max_live_parameters, max_reuse_distance=plan.max_reuse_distance,
        offload_optimizer_device=plan.offload,
        offload_param_device=plan.offload if plan.offload_params else "none",
        offload_optimizer_nvme_path=plan.nvme_path, offload_param_nvme_path=plan.nvme_path,
        offload_optimizer_pin_memory=plan.pin_memory, offload_param_pin_memory=plan.pin_memory,
        pp=plan.pp, partition_method=plan.partition_method,
        activation_checkpoint_interval=plan.activation_checkpoint_interval,
        monitor_dir=monitor_dir, reduce_scatter=plan.reduce_scatter,
        autotp_size=plan.tp if plan.tp > 1 else 0, tp_size=plan.tp, tp_partition_config=autotp.partition_config(model),
        sp=plan.sp,
    )
    if preset is not None:
        unknown = set(preset.values) - set(values)
        if unknown:
            raise KeyError(f"preset values without a template variable: {sorted(unknown)}")
        values.update(preset.values)
        if values["reduce_scatter"] and not plan.reduce_scatter:
            raise SpecError(f"{preset.source}: zero_optimization.reduce_scatter true with ZeRO-3 and sp {plan.sp}: "
                            f"stage 3's reduce-scatter averaging lacks the sequence-parallel correction "
                            f"(gradients 1/{plan.sp} of their value); set it to false")
        values["wall_clock_breakdown"] = wall_clock_breakdown or preset.values.get("wall_clock_breakdown", False)
    if monitors:
        values.update(monitors)  # flags win over a preset's monitor settings
    return json.loads(render_template("ds_config.json.j2", values))


def preset_names() -> list[str]:
    """The DeepSpeed presets shipped in ds_configs/ (recipes.json is how they are made, not a preset)."""
    return sorted(p.stem for p in DS_PRESETS.glob("*.json") if p.stem != RECIPES)


def preset_path(name_or_path: str) -> Path:
    """ds_configs/NAME.json for a shipped preset's name, else the path given (any .json file)."""
    if name_or_path in preset_names():
        return DS_PRESETS / f"{name_or_path}.json"
    path = Path(name_or_path)
    if path.suffix != ".json" or not path.is_file():
        raise SpecError(f"unknown DeepSpeed preset {name_or_path!r}; valid: {', '.join(preset_names())} "
                        f"(or a path to a .json file)")
    return path


def load_ds_preset(name_or_path: str) -> dict:
    """A preset from ds_configs/ by name, or any DeepSpeed JSON file by path, as parsed (checked: a JSON object)."""
    return read_preset(preset_path(name_or_path))


def import_ds_preset(name_or_path: str) -> PresetImport:
    """Load and import a preset: every key honoured, refused (SpecError) or noted; see dspipe.planner.ds_preset."""
    return import_preset(load_ds_preset(name_or_path), source=name_or_path)


def strategy_from_ds_config(cfg: dict, *, source: str) -> dict:
    """The strategy choices a DeepSpeed JSON encodes, as gen-config option values."""
    options = import_preset(cfg, source=source).options
    return {k: options[k] for k in ("zero", "offload", "offload_params", "nvme_path", "precision", "pp", "tp", "sp",
                                    "checkpointing", "partition_method") if k in options}
