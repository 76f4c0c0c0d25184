"""Plan -> DeepSpeed JSON (the keys of planner/ds_schema.SCHEMA); DeepSpeed JSON preset -> strategy; the jinja2
templates (the sbatch script). No torch, no deepspeed."""

from __future__ import annotations

import importlib.resources
import json
import os
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta

from dspipe.errors import SpecError, file_problem
from dspipe.jsonio import read_object
from dspipe.planner.ds_preset import PresetImport, import_preset, read_preset, scheduler_block
from dspipe.planner.ds_schema import DEFAULTS, Sources, build, derived
from dspipe.planner.plan import Plan
from dspipe.spec.model import ModelSpec
from dspipe.spec.train import TrainSpec

RESOURCES = Path(str(importlib.resources.files("dspipe") / "resources"))  # shipped inside the package
TEMPLATES = RESOURCES / "templates"
DS_PRESETS = RESOURCES / "ds_configs"
RECIPES = "recipes"  # ds_configs/recipes.json: the flags each shipped preset is rendered from


def render_template(name: str, values: dict[str, object]) -> str:
    """Render templates/NAME; the values given must be exactly the template's variables (no more, no fewer).
    Dict values keep their key order (tojson without sorting)."""
    loader = jinja2.FileSystemLoader(str(TEMPLATES))
    env = jinja2.Environment(
        loader=loader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False
    )
    env.policies["json.dumps_kwargs"] = {"sort_keys": False}
    source = loader.get_source(env, name)[0]
    wanted = jinja2.meta.find_undeclared_variables(env.parse(source))
    if wanted != set(values):
        raise KeyError(f"{name}: missing values {sorted(wanted - set(values))}, unused {sorted(set(values) - wanted)}")
    return env.get_template(name).render(**values)


MONITOR_OPTIONS = {  # gen-config option -> ds_schema value name; W&B and Comet through DeepSpeed's own monitor config
    "wandb_project": "wandb_project",
    "wandb_group": "wandb_group",
    "wandb_team": "wandb_team",
    "comet_project": "comet_project",
    "comet_workspace": "comet_workspace",
    "comet_experiment": "comet_experiment_name",
}


def monitor_values(options: dict[str, object]) -> dict[str, object]:
    """ds_schema values for the monitors the options turn on: --wandb-project enables W&B, --comet-project Comet
    (--comet-offline: an offline experiment). API keys are never written: W&B and Comet read them from their own
    environment variables or login files."""
    values: dict[str, object] = {}
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


def render_ds_config(
    *,
    plan: Plan,
    model: ModelSpec,
    train: TrainSpec,
    monitor_dir: str,
    wall_clock_breakdown: bool = False,
    preset: PresetImport | None = None,
    monitors: dict[str, object] | None = None,
) -> dict[str, Any]:
    """The complete DeepSpeed config for `plan`: every key explicit, nothing left to DeepSpeed's defaults. `preset`:
    the values a --preset sets (its import already checked them against the plan's options); `monitors`:
    values from monitor_values()."""
    scheduler = scheduler_block(
        preset, lr=train.lr, steps=train.steps, warmup=train.warmup_steps, min_lr_ratio=train.min_lr_ratio
    )
    sources = Sources(
        plan=plan,
        model=model,
        train=train,
        monitor_dir=monitor_dir,
        wall_clock_breakdown=wall_clock_breakdown,
        scheduler=scheduler,
    )
    values = {**DEFAULTS, **derived(sources)}
    if preset is not None:
        unknown = set(preset.values) - set(values)
        if unknown:
            raise KeyError(f"preset values without a DeepSpeed key: {sorted(unknown)}")
        values.update(preset.values)
        if values["reduce_scatter"] and not plan.reduce_scatter:
            raise SpecError(
                f"{preset.source}: zero_optimization.reduce_scatter true with ZeRO-3 and sp {plan.sp}: "
                f"stage 3's reduce-scatter averaging lacks the sequence-parallel correction "
                f"(gradients 1/{plan.sp} of their value); set it to false"
            )
        values["wall_clock_breakdown"] = wall_clock_breakdown or preset.values.get("wall_clock_breakdown", False)
    if monitors:
        values.update(monitors)  # flags win over a preset's monitor settings
    config: dict[str, Any] = json.loads(json.dumps(build(values)))  # a fresh copy: JSON types only, no shared defaults
    return config


def preset_names() -> list[str]:
    """The DeepSpeed presets shipped in ds_configs/ (recipes.json is how they are made, not a preset)."""
    return sorted(p.stem for p in DS_PRESETS.glob("*.json") if p.stem != RECIPES)


def recipes() -> dict[str, Any]:
    """ds_configs/recipes.json: the reference run ("reference"), the flags each shipped preset is rendered with
    ("presets"), the keys every shipped preset leaves to the run, grouped by why ("auto"), and the ones a preset keeps
    all the same because its recipe names them ("keep")."""
    book = read_object(DS_PRESETS / f"{RECIPES}.json")
    assert book is not None  # None only with partial_ok
    return book


def left_to_the_run(name: str) -> list[str]:
    """The keys of shipped preset `name` that are "auto" (its recipe's run length, batch, hyperparameters, model- and
    machine-sized values...): a preset is its ZeRO stage, precision, offload and layout, not one run's numbers."""
    book = recipes()
    keep = set(book.get("keep", {}).get(name, ()))
    return [path for paths in book["auto"].values() for path in paths if path not in keep]


def shipped_preset(name: str, rendered: dict[str, Any]) -> dict[str, Any]:
    """ds_configs/NAME.json made from the ds_config.json its recipe renders: every key of left_to_the_run(name) set
    to "auto" (KeyError for a key the config does not have)."""
    cfg: dict[str, Any] = json.loads(json.dumps(rendered))
    for path in left_to_the_run(name):
        *sections, leaf = path.split(".")
        node = cfg
        for part in sections:
            node = node[part]
        if leaf not in node:
            raise KeyError(f"recipes.json: {path} is not a key of the rendered {name}")
        node[leaf] = "auto"
    return cfg


def preset_path(name_or_path: str) -> Path:
    """ds_configs/NAME.json for a shipped preset's name, else the path given (any .json file)."""
    if name_or_path in preset_names():
        return DS_PRESETS / f"{name_or_path}.json"
    path = Path(name_or_path)
    there = os.path.lexists(path)
    problem = file_problem(path) if there else None
    if problem:
        raise SpecError(f"DeepSpeed preset {name_or_path} {problem} (--preset: a name or a .json file)")
    if there and path.suffix != ".json":
        raise SpecError(f"DeepSpeed preset {name_or_path} is not a .json file (--preset: a name or a .json file)")
    if not there:
        raise SpecError(
            f"unknown DeepSpeed preset {name_or_path!r}; valid: {', '.join(preset_names())} (or a path to a .json file)"
        )
    return path


def load_ds_preset(name_or_path: str) -> dict[str, Any]:
    """A preset from ds_configs/ by name, or any DeepSpeed JSON file by path, as parsed (checked: a JSON object)."""
    return read_preset(preset_path(name_or_path))


def import_ds_preset(name_or_path: str) -> PresetImport:
    """Load and import a preset: every key honoured, refused (SpecError) or noted; see dspipe.planner.ds_preset."""
    return import_preset(load_ds_preset(name_or_path), source=name_or_path)
