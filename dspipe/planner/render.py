"""Plan -> DeepSpeed JSON through the jinja2 template; DeepSpeed JSON preset -> strategy. No torch, no deepspeed."""
from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

import jinja2
import jinja2.meta

from dspipe.errors import SpecError
from dspipe.planner.plan import Plan
from dspipe.planner.spec import TrainSpec

RESOURCES = Path(str(importlib.resources.files("dspipe") / "resources"))  # shipped inside the package
TEMPLATES = RESOURCES / "templates"
DS_PRESETS = RESOURCES / "ds_configs"


def render_template(name: str, values: dict) -> str:
    """Render templates/NAME; the values given must be exactly the template's variables (no more, no fewer)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    source = env.loader.get_source(env, name)[0]
    wanted = jinja2.meta.find_undeclared_variables(env.parse(source))
    if wanted != set(values):
        raise KeyError(f"{name}: missing values {sorted(wanted - set(values))}, unused {sorted(set(values) - wanted)}")
    return env.get_template(name).render(**values)


def render_ds_config(*, plan: Plan, train: TrainSpec, monitor_dir: str, wall_clock_breakdown: bool = False) -> dict:
    """The complete DeepSpeed config for `plan`: every key explicit, nothing left to DeepSpeed's defaults."""
    values = dict(
        global_batch=plan.global_batch, micro_batch=plan.micro_batch, grad_accum=plan.grad_accum,
        steps_per_print=train.log_interval, wall_clock_breakdown=wall_clock_breakdown,
        grad_clip=train.grad_clip, lr=train.lr, weight_decay=train.weight_decay,
        steps=train.steps, warmup_steps=train.warmup_steps, min_lr_ratio=train.min_lr_ratio,
        bf16=plan.precision == "bf16", fp16=plan.precision == "fp16", grad_accum_dtype=plan.grad_accum_dtype,
        zero_stage=plan.zero_stage, contiguous_gradients=plan.contiguous_gradients, overlap_comm=plan.overlap_comm,
        reduce_bucket_size=plan.reduce_bucket_size, allgather_bucket_size=plan.allgather_bucket_size,
        prefetch_bucket_size=plan.prefetch_bucket_size,
        param_persistence_threshold=plan.param_persistence_threshold,
        offload_optimizer_device=plan.offload,
        offload_param_device=plan.offload if plan.offload_params else "none",
        nvme_path=plan.nvme_path, pin_memory=plan.pin_memory,
        pp=plan.pp, partition_method=plan.partition_method,
        activation_checkpoint_interval=plan.activation_checkpoint_interval,
        monitor_dir=monitor_dir,
    )
    return json.loads(render_template("ds_config.json.j2", values))


def preset_names() -> list[str]:
    return sorted(p.stem for p in DS_PRESETS.glob("*.json"))


def load_ds_preset(name_or_path: str) -> dict:
    """A preset from ds_configs/ by name, or any DeepSpeed JSON file by path."""
    path = Path(name_or_path)
    if not path.suffix == ".json":
        path = DS_PRESETS / f"{name_or_path}.json"
    if not path.is_file():
        raise SpecError(f"unknown DeepSpeed preset {name_or_path!r}; valid: {', '.join(preset_names())} "
                        f"(or a path to a .json file)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SpecError(f"preset {path} is not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from None


def strategy_from_ds_config(cfg: dict, *, source: str) -> dict:
    """The strategy choices a DeepSpeed JSON encodes, as gen-config option values (flags override them)."""
    bf16 = bool(cfg.get("bf16", {}).get("enabled", False))
    fp16 = bool(cfg.get("fp16", {}).get("enabled", False))
    if bf16 and fp16:
        raise SpecError(f"{source}: fp16 and bf16 are both enabled; DeepSpeed allows one (pick --precision)")
    zero = cfg.get("zero_optimization", {})
    opt_dev = zero.get("offload_optimizer", {}).get("device", "none") or "none"
    par_dev = zero.get("offload_param", {}).get("device", "none") or "none"
    nvme = zero.get("offload_optimizer", {}).get("nvme_path") or zero.get("offload_param", {}).get("nvme_path")
    pipe = cfg.get("pipeline", {})
    stages = pipe.get("stages", 1)
    return dict(
        zero=int(zero.get("stage", 0)),
        offload=opt_dev if opt_dev != "none" else par_dev,
        offload_params=par_dev != "none",
        nvme_path=nvme,
        precision="bf16" if bf16 else "fp16" if fp16 else "fp32",
        pp=stages if isinstance(stages, int) else 1,
        checkpointing="full" if pipe.get("activation_checkpoint_interval", 0) else "none",
        partition_method=pipe.get("partition", "parameters") if pipe.get("partition") != "best" else "parameters",
    )
