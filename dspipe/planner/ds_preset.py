"""A DeepSpeed JSON written by someone else (--preset) -> what dspipe does with every one of its keys. No torch, no
deepspeed.

`read_preset` parses the file (duplicate keys, NaN and non-objects refused, as DeepSpeed's own reader refuses
duplicates). `import_preset` puts DeepSpeed's aliases under their canonical names (bfloat16 -> bf16, legacy
zero_optimization.cpu_offload -> offload_optimizer.device cpu, stage3_gather_fp16_weights_on_model_save, pydantic
field names such as prefetch_bucket_size), refuses what DeepSpeed 0.19 refuses (removed sections, unknown keys in its
pydantic sections: zero_optimization, offload_*, fp16, bf16, monitors) and what dspipe cannot render, and splits the
rest into gen-config option values (strategy and training), rendered values and "auto" keys, as each key's row of
planner/ds_schema.SCHEMA says (its import target and check). Unknown top-level keys and unknown keys of DeepSpeed's
dict sections (pipeline, activation_checkpointing) are ignored by DeepSpeed; dspipe ignores
them too and says so. `account` runs after planning and rendering: every key of the preset is the same value in the
rendered config, or a report line ("auto" resolved, a monitor path moved into the run directory), or an error.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from dspipe.errors import SpecError, cannot_read
from dspipe.jsonio import MISSING, dotted_get, leaves, number_hooks
from dspipe.planner.ds_checks import Check, choice, integer, number
from dspipe.planner.ds_schema import PLANNER_AUTO, option, section
from dspipe.spec.kinds import Offload
from dspipe.spec.settings import AUTO
from dspipe.spec.strategy import ZERO3_KNOBS

UNKNOWN_KEY = "is not a DeepSpeed setting"
"""The words of import_preset's note on a key DeepSpeed ignores (an unknown top-level key, or one of a dict section)."""


SCHEDULERS = ("WarmupCosineLR", "WarmupLR", "WarmupDecayLR")
OPTIMIZERS = ("adam", "adamw")  # DeepSpeed lower-cases its own optimizer names; Adam is decoupled (adam_w_mode) too

# DeepSpeed 0.19 refuses these outright (runtime/config.py _REMOVED_*_CONFIG_KEYS).
REMOVED_TOP = (
    "nebula",
    "compression_training",
    "amp",
    "quantize_training",
    "sparse_gradients",
    "eigenvalue",
    "sparse_attention",
    "elasticity",
    "graph_harvesting",
    "curriculum_learning",
    "progressive_layer_drop",
)
REMOVED_ZERO = ("mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param")

# DeepSpeed settings dspipe does not render: accepted only at DeepSpeed's default (then DeepSpeed applies that very
# value); sections only when disabled.
UNRENDERED_TOP = {
    "zero_force_ds_cpu_optimizer": True,
    "managed_gradient_accumulation": True,
    "communication_data_type": None,
    "seq_parallel_communication_data_type": "fp32",
    "gradient_allreduce_op": "mean",
    "disable_allgather": False,
    "disable_python_gc": False,
    "dump_state": False,
    "memory_breakdown": False,
    "dataloader_drop_last": False,
    "use_data_before_expert_parallelism": False,
    "vocabulary_size": None,
    "log_level": None,
}
UNRENDERED_SECTIONS = (
    "flops_profiler",
    "comms_logger",
    "autotuning",
    "checkpoint",
    "data_efficiency",
    "compile",
    "timers",
    "expert_parallel",
    "weight_quantization",
    "hybrid_engine",
    "torch_autocast",
    "datastates",
    "optimizer.legacy_fusion",
)
UNRENDERED_ZERO = {
    "use_multi_rank_bucket_allreduce": True,
    "compute_grad_norm": True,
    "zenflow": None,
    "stage3_model_persistence_threshold": None,
    "stage3_module_granularity_threshold": 0,
    "stage3_use_all_reduce_for_fetch_params": False,
    "stage3_allgather_sequential": False,
    "legacy_stage1": False,
    "parameter_alignment": False,
    "zero_hpz_partition_size": 1,
    "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False,
    "zero_quantized_gradients": False,
    "memory_efficient_linear": True,
    "pipeline_loading_checkpoint": False,
    "override_module_apply": True,
    "log_trace_cache_warnings": False,
    "enable_sanity_checks": False,
    "save_muon_momentum_buffer_in_memory": False,
}
UNRENDERED_OFFLOAD = {
    "pipeline_read": False,
    "pipeline_write": False,
    "super_offload": False,
    "cpuadam_cores_perc": 0.8,
}
UNRENDERED_PRECISION = {
    "fp16_master_weights_and_grads": False,
    "bf16_master_weights_and_grads": False,
    "bf16_optimizer_states": False,
}
ZERO_FIELD_NAMES = {  # DeepSpeedZeroConfig populates by field name too: field name -> the alias dspipe renders
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}
MONITOR_DIR_KEYS = ("tensorboard.output_path", "csv_monitor.output_path")
"""Always the run directory's monitor/ (dspipe report and the metrics log read it there): reported when moved."""


# ---- key tables: DeepSpeed key -> (import target, check), from planner/ds_schema.SCHEMA -----------------------------

Table = dict[str, tuple[tuple[str, ...] | None, Check | None]]
"""A section's keys -> (import target, check): ds_schema.section()."""
Reader = Callable[["PresetImport", dict[str, Any], dict[str, Any]], None]
"""A section's reader: (the import, the preset's section, its canonical copy)."""
_NOTHING: Mapping[str, object] = MappingProxyType({})
TOP = section("")
OPTIMIZER_PARAMS = section("optimizer.params")
OPTIMIZER_PARAM_DEFAULTS = {"adam_w_mode": True, "torch_adam": False, "bias_correction": True, "amsgrad": False}
SCHEDULER_PARAMS = {  # type -> param -> (target, check); targets "opt" feed TrainSpec, "sched" stay scheduler params
    "WarmupCosineLR": {
        "total_num_steps": (option("steps"), integer(1)),
        "warmup_num_steps": (option("warmup"), integer(1)),
        "cos_min_ratio": (option("min_lr_ratio"), number(0, 1)),
        "warmup_min_ratio": (("sched",), number(0, 1)),
        "warmup_type": (("sched",), choice("log", "linear")),
    },
    "WarmupDecayLR": {
        "total_num_steps": (option("steps"), integer(1)),
        "warmup_num_steps": (option("warmup"), integer(1)),
        "warmup_max_lr": (option("lr"), number(0, open_lo=True)),
        "warmup_min_lr": (("sched",), number(0)),
        "warmup_type": (("sched",), choice("log", "linear")),
    },
    "WarmupLR": {
        "warmup_num_steps": (option("warmup"), integer(1)),
        "warmup_max_lr": (option("lr"), number(0, open_lo=True)),
        "warmup_min_lr": (("sched",), number(0)),
        "warmup_type": (("sched",), choice("log", "linear")),
    },
}
SCHEDULER_DEFAULTS = {"warmup_min_ratio": 0.0, "warmup_type": "log", "warmup_min_lr": 0.0}
"""DeepSpeed's defaults (runtime/lr_schedules.py) for the parameters dspipe does not derive from its own options."""
FP16 = section("fp16")
BF16 = section("bf16")
ZERO = section("zero_optimization")
OFFLOAD_OPTIMIZER = section("zero_optimization.offload_optimizer")
OFFLOAD_PARAM = section("zero_optimization.offload_param")
PIPELINE = section("pipeline")
AIO = section("aio")
ACTIVATION_CHECKPOINTING = section("activation_checkpointing")
TENSOR_PARALLEL = section("tensor_parallel")
TENSOR_PARALLEL_TP = section("tensor_parallel.tp")
UNRENDERED_TENSOR_PARALLEL = {
    "preset_model": None,
    "keep_module_on_host": False,
    "kernel_inject": False,
    "replace_with_kernel_inject": False,
    "injection_policy_tuple": None,
    "dtype": None,
}
MONITORS = {name: section(name) for name in ("tensorboard", "csv_monitor", "wandb", "comet")}


@dataclass
class PresetImport:
    """What a preset asks for, in dspipe's terms."""

    source: str
    canon: dict[str, Any]
    label: str = ""
    """How errors name the file ("preset SOURCE" unless given: a run's ds_config.json names its path)."""
    """The preset under DeepSpeed's canonical names, without the keys already reported (the keys account() checks)."""
    options: dict[str, Any] = field(default_factory=dict)
    """gen-config option -> the preset's value (strategy and training)."""
    origins: dict[str, str] = field(default_factory=dict)
    """gen-config option -> the preset key it came from."""
    grad_accum: int | None = None
    values: dict[str, Any] = field(default_factory=dict)
    """ds_schema value name -> the preset's value."""
    scheduler_type: str | None = None
    scheduler_params: dict[str, Any] = field(default_factory=dict)
    """The preset's own scheduler parameters that dspipe does not derive from its options (auto removed)."""
    notes: list[str] = field(default_factory=list)
    """Report lines known before planning (aliases, ignored keys)."""

    def error(self, path: str, value: object, why: str) -> SpecError:
        return SpecError(f"{self.label or 'preset ' + self.source}: {path} {_show(value)} {why}")

    def shown(self, option: str) -> str:
        """The preset's key(s) behind a gen-config option and their values, e.g. 'bf16.enabled true'."""
        parts = []
        for path in self.origins[option].split("/"):
            value = dotted_get(self.canon, path)
            parts.append(f"{path} {_show(self.options[option] if value is MISSING else value)}")
        return " and ".join(parts)

    def note(self, text: str) -> None:
        self.notes.append(f"preset: {text}")


def _show(value: object) -> str:
    return json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)


# ---- reading ---------------------------------------------------------------------------------------------------------


def _no_duplicates(pairs: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def read_preset(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; one-line errors for unreadable files, invalid JSON, duplicate keys and NaN."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise cannot_read(f"preset {path}", e) from None
    except UnicodeDecodeError as e:
        raise SpecError(f"preset {path}: not UTF-8 text (byte offset {e.start})") from None
    try:
        cfg = json.loads(text, object_pairs_hook=_no_duplicates, **number_hooks(f"preset {path}"))
    except SpecError:
        raise
    except json.JSONDecodeError as e:
        raise SpecError(f"preset {path} is not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from None
    except (ValueError, RecursionError) as e:
        raise SpecError(f"preset {path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise SpecError(f"preset {path} must hold a JSON object (a DeepSpeed config), got {type(cfg).__name__}")
    return cfg


# ---- import ----------------------------------------------------------------------------------------------------------


def import_preset(cfg: dict[str, Any], *, source: str, label: str = "") -> PresetImport:
    """Refuse or normalise every key of `cfg`; see the module docstring. `label`: how errors name the file."""
    imp = PresetImport(source=source, canon={}, label=label)
    canon = imp.canon
    cfg = dict(cfg)
    for key in REMOVED_TOP:
        if key in cfg:
            raise imp.error(key, cfg[key], "was removed from DeepSpeed 0.19 (it refuses the key); remove it")
    if "bfloat16" in cfg:
        if "bf16" in cfg:
            raise imp.error("bfloat16", cfg["bfloat16"], "and bf16 are both given; DeepSpeed reads bf16 only: keep one")
        cfg["bf16"] = cfg.pop("bfloat16")
        imp.note("bfloat16 is DeepSpeed's old name of bf16; read as bf16")
    if isinstance(cfg.get("zero_optimization"), bool):  # DeepSpeed's oldest format: true = stage 1
        flag = cfg.pop("zero_optimization")
        cfg["zero_optimization"] = {"stage": 1 if flag else 0}
        imp.note(f"zero_optimization {_show(flag)} is DeepSpeed's legacy format; read as stage {1 if flag else 0}")
        if "allgather_size" in cfg:
            cfg["zero_optimization"]["allgather_bucket_size"] = cfg.pop("allgather_size")
    for key, value in cfg.items():
        if key in TOP:
            _take(imp, canon, key, key, value, TOP[key])
        elif key in (
            "optimizer",
            "scheduler",
            "fp16",
            "bf16",
            "data_types",
            "zero_optimization",
            "pipeline",
            "activation_checkpointing",
            "tensor_parallel",
            "aio",
            *MONITORS,
        ):
            if not isinstance(value, dict):
                raise imp.error(key, value, "must be a JSON object")
            canon[key] = {}
            SECTIONS[key](imp, value, canon[key])
        elif key in UNRENDERED_TOP:
            _unrendered(imp, key, value, UNRENDERED_TOP[key])
        elif key in UNRENDERED_SECTIONS:
            _unrendered_section(imp, key, value)
        else:
            close = difflib.get_close_matches(key, [*TOP, *SECTIONS, *UNRENDERED_TOP, *UNRENDERED_SECTIONS], n=1)
            imp.note(
                f"{key} {UNKNOWN_KEY}; ignored, as DeepSpeed ignores unknown top-level keys"
                + (f" (did you mean {close[0]}?)" if close else "")
            )
    _precision(imp)
    _lr_agreement(imp)
    _tensor_parallel_batch(imp)
    _stage3_knobs(imp)
    return imp


def _stage3_knobs(imp: PresetImport) -> None:
    """A preset of stage 0-2 with stage3_* values (a rendered config writes them all): DeepSpeed reads them only
    under stage 3, so they set no option (given as flags, they restrict the plan to ZeRO-3)."""
    zero = imp.options.get("zero")
    if isinstance(zero, int) and zero != 3:
        for name in ZERO3_KNOBS:
            imp.options.pop(name, None)
            imp.origins.pop(name, None)


def _tensor_parallel_batch(imp: PresetImport) -> None:
    """A preset's tensor_parallel.autotp_size N > 1 was written for DeepSpeed 0.19.8's AutoTP, which counts the tp
    ranks of a replica in train_batch_size: it imports as --tp N with the global batch train_batch_size / N. dspipe
    runs tp with its own tensor-parallel layers (AutoTP off: autotp_size 0, tp.tp_size 1) and renders
    train_batch_size as the global batch, so these keys are translated here (and said so), not compared after
    rendering; a tp.tp_size other than N is refused."""
    tp, total = imp.options.get("tp", 1), imp.options.get("global_batch")
    if tp <= 1:
        return
    section = imp.canon.get("tensor_parallel", {})
    inner = section.get("tp", {})
    if inner.get("tp_size", AUTO) not in (AUTO, tp, 1):
        raise imp.error(
            "tensor_parallel.tp.tp_size",
            inner["tp_size"],
            f"disagrees with tensor_parallel.autotp_size {tp}; give both the same tp, or tp_size 1",
        )
    section.pop("autotp_size", None)
    if inner.get("tp_size") == tp:
        inner.pop("tp_size")
    imp.note(
        f"tensor_parallel.autotp_size {tp} -> --tp {tp}: dspipe runs tp with its own tensor-parallel layers "
        f"(Megatron layout) and renders DeepSpeed's AutoTP off (autotp_size 0, tp.tp_size 1)"
    )
    if total is not None:
        batch, rest = divmod(total, tp)
        if rest:
            raise imp.error(
                "train_batch_size",
                total,
                f"is not divisible by tensor_parallel.autotp_size {tp} (DeepSpeed's AutoTP counts the tp ranks in it)",
            )
        imp.options["global_batch"] = batch
        imp.canon.pop("train_batch_size", None)
        imp.note(
            f"train_batch_size {total} counts the {tp} AutoTP ranks of each replica (DeepSpeed 0.19.8's AutoTP "
            f"semantics): global batch {batch} sequences, which dspipe renders as train_batch_size {batch} "
            f"(its tensor-parallel layers' ranks are not data-parallel)"
        )


def _take(
    imp: PresetImport,
    canon: dict[str, Any],
    key: str,
    path: str,
    value: Any,
    spec: tuple[tuple[str, ...] | None, Check | None],
) -> None:
    """Check one value and file it under its target; "auto" is kept in canon only (account() reports it)."""
    target, check = spec
    assert target is not None and check is not None  # a row a preset sets has both (ds_schema.section)
    if value == AUTO:
        canon[key] = AUTO
        return
    try:
        value = check(value)
    except ValueError as e:
        raise imp.error(path, value, str(e)) from None
    canon[key] = value
    kind = target[0]
    if kind == "opt":
        imp.options[target[1]] = value
        imp.origins[target[1]] = path
    elif kind == "var":
        imp.values[target[1]] = value
    elif kind == "ga":
        imp.grad_accum = value
    elif kind == "sched":
        imp.scheduler_params[key] = value
    elif kind == "tp" and value > 1:  # 0 or 1: DeepSpeed's AutoTP off, which leaves dspipe's own tp free
        imp.options["tp"] = value
        imp.origins["tp"] = path
    elif kind == "checkpointing":
        imp.options["checkpointing"] = "full" if value else "none"
        imp.origins["checkpointing"] = path


def _unrendered(imp: PresetImport, path: str, value: object, default: object) -> None:
    if value == default or value == AUTO:
        imp.note(f"{path} {_show(value)} is DeepSpeed's default; not rendered (DeepSpeed applies the same)")
        return
    raise imp.error(path, value, f"is not supported by dspipe (only DeepSpeed's default {_show(default)}); remove it")


def _unrendered_section(imp: PresetImport, path: str, value: object) -> None:
    """A DeepSpeed section dspipe does not render: accepted (and reported) only when it is disabled."""
    if (
        isinstance(value, dict)
        and value.get("enabled", AUTO) in (False, AUTO)
        and (value.get("enabled") is False or set(value) <= {"enabled"})
    ):
        imp.note(f"{path} is disabled; not rendered (off in DeepSpeed without it too)")
        return
    switch = isinstance(value, dict) and "enabled" in value  # a section without its own switch is only removed
    raise imp.error(
        path,
        value if not isinstance(value, dict) else "{...}",
        'is not supported by dspipe; remove it (or set "enabled": false)'
        if switch
        else "is not supported by dspipe; remove it",
    )


def _section(
    imp: PresetImport,
    prefix: str,
    value: dict[str, Any],
    canon: dict[str, Any],
    table: Table,
    *,
    unrendered: Mapping[str, object] = _NOTHING,
    strict: bool = True,
) -> None:
    """Keys of a DeepSpeed section. strict: DeepSpeed's pydantic model forbids unknown keys (so does dspipe);
    otherwise DeepSpeed ignores them and dspipe reports them as ignored."""
    for key, v in value.items():
        path = f"{prefix}.{key}"
        if key in table:
            _take(imp, canon, key, path, v, table[key])
        elif key in unrendered:
            _unrendered(imp, path, v, unrendered[key])
        elif strict:
            close = difflib.get_close_matches(key, [*table, *unrendered], n=1)
            raise imp.error(
                path,
                v,
                f"is not a key of DeepSpeed's {prefix} (it forbids unknown keys)"
                + (f"; did you mean {close[0]}?" if close else ""),
            )
        else:
            imp.note(f"{path} {UNKNOWN_KEY}; ignored, as DeepSpeed ignores it")


def _optimizer(imp: PresetImport, value: dict[str, Any], canon: dict[str, Any]) -> None:
    for key, v in value.items():
        if key == "type":
            if v != AUTO and (not isinstance(v, str) or v.lower() not in OPTIMIZERS):
                raise imp.error(
                    "optimizer.type",
                    v,
                    "is not supported by dspipe: it trains with Adam or AdamW (decoupled weight decay)",
                )
            canon["type"] = v
            if v != AUTO:
                imp.values["optimizer_type"] = v
        elif key == "params":
            if not isinstance(v, dict):
                raise imp.error("optimizer.params", v, "must be a JSON object")
            canon["params"] = {}
            _section(imp, "optimizer.params", v, canon["params"], OPTIMIZER_PARAMS, unrendered=OPTIMIZER_PARAM_DEFAULTS)
        elif key == "legacy_fusion":
            _unrendered(imp, "optimizer.legacy_fusion", v, False)
        else:
            raise imp.error(f"optimizer.{key}", v, "is not a key of DeepSpeed's optimizer (type, params)")


def _scheduler(imp: PresetImport, value: dict[str, Any], canon: dict[str, Any]) -> None:
    kind = value.get("type", AUTO)
    if kind != AUTO and kind not in SCHEDULERS:
        raise imp.error("scheduler.type", kind, f"is not supported by dspipe (supported: {', '.join(SCHEDULERS)})")
    for key in value:
        if key not in ("type", "params"):
            raise imp.error(f"scheduler.{key}", value[key], "is not a key of DeepSpeed's scheduler (type, params)")
    canon["type"] = kind
    imp.scheduler_type = None if kind == AUTO else kind
    params = value.get("params", {})
    if not isinstance(params, dict):
        raise imp.error("scheduler.params", params, "must be a JSON object")
    table = SCHEDULER_PARAMS[kind if kind != AUTO else "WarmupCosineLR"]
    canon["params"] = {}
    for key, v in params.items():
        if key not in table:
            if key == "last_batch_iteration" and v == -1:
                imp.note("scheduler.params.last_batch_iteration -1 is DeepSpeed's default; not rendered")
                continue
            raise imp.error(
                f"scheduler.params.{key}", v, f"is not a parameter of {kind} that dspipe renders ({', '.join(table)})"
            )
        _take(imp, canon["params"], key, f"scheduler.params.{key}", v, table[key])


def _fp16(imp: PresetImport, value: dict[str, Any], canon: dict[str, Any]) -> None:
    _section(imp, "fp16", value, canon, FP16, unrendered=UNRENDERED_PRECISION)


def _bf16(imp: PresetImport, value: dict[str, Any], canon: dict[str, Any]) -> None:
    _section(imp, "bf16", value, canon, BF16, unrendered=UNRENDERED_PRECISION)


def _data_types(imp: PresetImport, value: dict[str, Any], canon: dict[str, Any]) -> None:
    for key, v in value.items():
        if key != "grad_accum_dtype":
            raise imp.error(
                f"data_types.{key}", v, "is not supported by dspipe (only grad_accum_dtype, which the plan derives)"
            )
        if v != AUTO and v not in ("fp32", "bf16", "fp16"):
            raise imp.error(f"data_types.{key}", v, 'must be one of: "fp32", "bf16", "fp16"')
        canon[key] = v  # compared with the plan's grad_accum_dtype after rendering


def _zero_key_names(imp: PresetImport, value: dict[str, Any]) -> None:
    """Rewrite zero_optimization's alias, deprecated and legacy keys in `value` to the names dspipe reads, refusing
    the removed ones and a key given twice."""
    for key in REMOVED_ZERO:
        if key in value:
            raise imp.error(
                f"zero_optimization.{key}",
                value[key],
                "was removed from DeepSpeed 0.19 (it refuses the key); remove it",
            )
    for name, alias in ZERO_FIELD_NAMES.items():  # field names DeepSpeed also accepts
        if name in value:
            if alias in value:
                raise imp.error(f"zero_optimization.{name}", value[name], f"and {alias} are the same setting; keep one")
            value[alias] = value.pop(name)
    legacy = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
    for old, new in legacy.items():
        if old in value:
            flag = value.pop(old)
            if flag not in (True, False):
                raise imp.error(f"zero_optimization.{old}", flag, "must be true or false")
            if new in value:
                raise imp.error(
                    f"zero_optimization.{old}",
                    flag,
                    f"and {new} are both given; DeepSpeed refuses a deprecated key next to its replacement",
                )
            if flag:
                value[new] = {"device": "cpu"}
            imp.note(
                f"zero_optimization.{old} {_show(flag)} is DeepSpeed's deprecated form; read as "
                f"{new}.device {'cpu' if flag else 'none (not given)'}"
            )
    if "cpu_offload_use_pin_memory" in value:
        imp.note(
            "zero_optimization.cpu_offload_use_pin_memory is deprecated and ignored by DeepSpeed; ignored "
            "(set pin_memory in offload_optimizer/offload_param)"
        )
        value.pop("cpu_offload_use_pin_memory")
    old = "stage3_gather_fp16_weights_on_model_save"
    if old in value:
        new = "stage3_gather_16bit_weights_on_model_save"
        if new in value:
            raise imp.error(
                f"zero_optimization.{old}",
                value[old],
                f"and {new} are both given; DeepSpeed refuses a deprecated key next to its replacement",
            )
        value[new] = value.pop(old)
        imp.note(f"zero_optimization.{old} is DeepSpeed's deprecated name; read as {new}")


def _zero_offload_options(imp: PresetImport, canon: dict[str, Any]) -> None:
    """The offload, offload_params and nvme_path options a canonical zero_optimization's offload devices set."""
    opt_dev = canon.get("offload_optimizer", {}).get("device", "none")
    par_dev = canon.get("offload_param", {}).get("device", "none")
    if AUTO not in (opt_dev, par_dev):
        if (
            opt_dev != Offload.NONE
            or par_dev != Offload.NONE
            or "offload_optimizer" in canon
            or "offload_param" in canon
        ):
            imp.options["offload"] = opt_dev if opt_dev != Offload.NONE else par_dev
            imp.options["offload_params"] = par_dev != Offload.NONE
            imp.origins["offload"] = "zero_optimization.offload_optimizer.device"
            imp.origins["offload_params"] = "zero_optimization.offload_param.device"
        path = (
            canon.get("offload_optimizer", {}).get("nvme_path")
            if opt_dev == Offload.NVME
            else canon.get("offload_param", {}).get("nvme_path")
            if par_dev == Offload.NVME
            else None
        )
        if path and path != AUTO:
            imp.options["nvme_path"] = path
            imp.origins["nvme_path"] = (
                f"zero_optimization.offload_{'optimizer' if opt_dev == 'nvme' else 'param'}.nvme_path"
            )


def _zero(imp: PresetImport, value: dict[str, Any], canon: dict[str, Any]) -> None:
    value = dict(value)
    _zero_key_names(imp, value)
    for sub, table in (("offload_optimizer", OFFLOAD_OPTIMIZER), ("offload_param", OFFLOAD_PARAM)):
        if sub in value:
            block = value.pop(sub)
            if block is None:
                continue
            if not isinstance(block, dict):
                raise imp.error(f"zero_optimization.{sub}", block, "must be a JSON object")
            canon[sub] = {}
            _section(imp, f"zero_optimization.{sub}", block, canon[sub], table, unrendered=UNRENDERED_OFFLOAD)
    _section(imp, "zero_optimization", value, canon, ZERO, unrendered=UNRENDERED_ZERO)
    _zero_offload_options(imp, canon)


def _pipeline(imp: PresetImport, value: dict[str, Any], canon: dict[str, Any]) -> None:
    _section(imp, "pipeline", value, canon, PIPELINE, strict=False)


def _activation_checkpointing(imp: PresetImport, value: dict[str, Any], canon: dict[str, Any]) -> None:
    _section(imp, "activation_checkpointing", value, canon, ACTIVATION_CHECKPOINTING, strict=False)


def _aio(imp: PresetImport, value: dict[str, Any], canon: dict[str, Any]) -> None:
    """DeepSpeed reads its aio keys one by one (get_scalar_param) and ignores others, such as the thread_count of
    older releases (now intra_op_parallelism): reported as ignored."""
    for key in value:
        if key == "thread_count":
            imp.note(
                "aio.thread_count is not read by DeepSpeed 0.19 (intra_op_parallelism replaced it); ignored, as "
                "DeepSpeed ignores it"
            )
    _section(imp, "aio", {k: v for k, v in value.items() if k != "thread_count"}, canon, AIO, strict=False)


def _tensor_parallel(imp: PresetImport, value: dict[str, Any], canon: dict[str, Any]) -> None:
    value = dict(value)
    if "tensor_parallel" in value:  # the pydantic field name of the "tp" alias
        value.setdefault("tp", value.pop("tensor_parallel"))
    sub = value.pop("tp", None)
    _section(imp, "tensor_parallel", value, canon, TENSOR_PARALLEL, unrendered=UNRENDERED_TENSOR_PARALLEL)
    if sub is not None:
        if not isinstance(sub, dict):
            raise imp.error("tensor_parallel.tp", sub, "must be a JSON object")
        canon["tp"] = {}
        _section(
            imp, "tensor_parallel.tp", sub, canon["tp"], TENSOR_PARALLEL_TP, unrendered={"mpu": None, "tp_group": None}
        )


def _monitor(name: str) -> Reader:
    def read(imp: PresetImport, value: dict[str, Any], canon: dict[str, Any]) -> None:
        _section(imp, name, value, canon, MONITORS[name])

    return read


SECTIONS: dict[str, Reader] = {
    "optimizer": _optimizer,
    "scheduler": _scheduler,
    "fp16": _fp16,
    "bf16": _bf16,
    "data_types": _data_types,
    "zero_optimization": _zero,
    "pipeline": _pipeline,
    "activation_checkpointing": _activation_checkpointing,
    "tensor_parallel": _tensor_parallel,
    "aio": _aio,
    **{name: _monitor(name) for name in MONITORS},
}


def _precision(imp: PresetImport) -> None:
    """bf16/fp16 "enabled": true pins the precision; sections present with neither enabled nor "auto" mean fp32 (as in
    DeepSpeed); "auto", or no section at all, leaves the precision to dspipe."""
    present = [name for name in ("bf16", "fp16") if name in imp.canon]
    enabled = {name: imp.canon[name].get("enabled", False) for name in present}
    if enabled.get("bf16") is True and enabled.get("fp16") is True:
        raise SpecError(f"preset {imp.source}: fp16 and bf16 are both enabled; DeepSpeed allows one (pick --precision)")
    if True in enabled.values():
        imp.options["precision"] = "bf16" if enabled.get("bf16") is True else "fp16"
        imp.origins["precision"] = f"{imp.options['precision']}.enabled"
    elif present and AUTO not in enabled.values():
        imp.options["precision"] = "fp32"
        imp.origins["precision"] = "/".join(f"{name}.enabled" for name in present)
    elif not present:
        imp.note("no bf16/fp16 section (DeepSpeed alone would train fp32); the precision is dspipe's choice")


def _lr_agreement(imp: PresetImport) -> None:
    lr = imp.canon.get("optimizer", {}).get("params", {}).get("lr")
    peak = imp.canon.get("scheduler", {}).get("params", {}).get("warmup_max_lr")
    number = (int, float)
    if isinstance(lr, number) and isinstance(peak, number) and lr != peak:
        raise SpecError(
            f"preset {imp.source}: optimizer.params.lr {lr:g} and scheduler.params.warmup_max_lr "
            f"{peak:g} disagree; DeepSpeed would train at {peak:g} after warmup: make them equal"
        )
    if isinstance(peak, number):
        imp.options["lr"] = peak
        imp.origins["lr"] = "scheduler.params.warmup_max_lr" if lr is None else "optimizer.params.lr"


# ---- rendering and accounting ----------------------------------------------------------------------------------------


def scheduler_block(
    imp: PresetImport | None, *, lr: float, steps: int, warmup: int, min_lr_ratio: float
) -> tuple[str, dict[str, object]]:
    """(type, params) of the rendered scheduler: dspipe's cosine schedule unless the preset names another; every
    parameter explicit (the preset's, dspipe's options, or DeepSpeed's default)."""
    kind = (imp.scheduler_type if imp else None) or "WarmupCosineLR"
    own = dict(imp.scheduler_params) if imp else {}
    if kind == "WarmupCosineLR":
        params = {
            "total_num_steps": steps,
            "warmup_num_steps": warmup,
            "warmup_min_ratio": own.get("warmup_min_ratio", 0.0),
            "warmup_type": own.get("warmup_type", "log" if imp and imp.scheduler_type else "linear"),
            "cos_min_ratio": min_lr_ratio,
        }
    else:
        params = {
            "warmup_min_lr": own.get("warmup_min_lr", SCHEDULER_DEFAULTS["warmup_min_lr"]),
            "warmup_max_lr": lr,
            "warmup_num_steps": warmup,
            "warmup_type": own.get("warmup_type", SCHEDULER_DEFAULTS["warmup_type"]),
        }
        if kind == "WarmupDecayLR":
            params["total_num_steps"] = steps
    return kind, params


def auto_keys(imp: PresetImport) -> list[str]:
    """The dotted keys whose value is "auto" (gen-config resolves them; DeepSpeed does not)."""
    return [path for path, value in leaves(imp.canon) if value == AUTO]


AUTO_OPTIONS = {
    "train_batch_size": "global_batch",
    "train_micro_batch_size_per_gpu": "micro_batch",
    "gradient_clipping": "grad_clip",
    "optimizer.params.lr": "lr",
    "scheduler.params.warmup_max_lr": "lr",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.total_num_steps": "steps",
    "scheduler.params.warmup_num_steps": "warmup",
    "scheduler.params.cos_min_ratio": "min_lr_ratio",
    "bf16.enabled": "precision",
    "fp16.enabled": "precision",
    "zero_optimization.stage": "zero",
    "zero_optimization.reduce_bucket_size": "reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold": "param_persistence_threshold",
    "zero_optimization.stage3_max_live_parameters": "max_live_parameters",
    "zero_optimization.stage3_max_reuse_distance": "max_reuse_distance",
    "pipeline.stages": "pp",
    "wall_clock_breakdown": "wall_clock_breakdown",
    "steps_per_print": "log_interval",
    "pipeline.partition": "partition_method",
    "pipeline.activation_checkpoint_interval": "checkpointing",
    "zero_optimization.offload_optimizer.nvme_path": "nvme_path",
    "zero_optimization.offload_param.nvme_path": "nvme_path",
    "wandb.enabled": "wandb_project",
    "wandb.project": "wandb_project",
    "wandb.group": "wandb_group",
    "wandb.team": "wandb_team",
    "comet.enabled": "comet_project",
    "comet.project": "comet_project",
    "comet.samples_log_interval": "comet_project",
    "comet.workspace": "comet_workspace",
    "comet.experiment_name": "comet_experiment",
    "comet.online": "comet_offline",
}
"""Preset keys whose "auto" a gen-config option resolves (labelled with the flag when the user typed it)."""
PLAN_DERIVED = frozenset(
    {
        "pipeline.activation_checkpoint_interval",
        "pipeline.partition",
        "zero_optimization.reduce_scatter",
        "zero_optimization.offload_optimizer.pin_memory",
        "zero_optimization.offload_param.pin_memory",
    }
)
"""Keys outside ds_schema.PLANNER_AUTO whose "auto" the plan resolves too (labelled "planner")."""


def account(imp: PresetImport, rendered: dict[str, Any], *, given: dict[str, str], shipped: bool = False) -> list[str]:
    """Report lines for the preset's keys that the rendered config does not carry verbatim; a SpecError for a key
    whose value the rendered config contradicts. `given`: preset key -> the flag that set it (for the labels).
    `shipped`: a preset of dspipe's own, whose "auto" keys are the run's by design: only those a typed flag set get
    a line each, the rest one line that counts them (ds_config.json holds every value)."""
    lines = account_lines(imp, rendered, given=given)
    if not shipped:
        return lines
    quiet = [
        line
        for line in lines
        if line.startswith("preset: ")
        and '"auto" ->' in line
        and not any(line.endswith(f"({flag})") for flag in set(given.values()))
    ]
    if not quiet:
        return lines
    return [line for line in lines if line not in quiet] + [
        f"preset {imp.source}: {len(quiet)} more keys it leaves to the run (\"auto\") took the planner's or dspipe's "
        f"values (ds_config.json holds each)"
    ]


def account_lines(imp: PresetImport, rendered: dict[str, Any], *, given: dict[str, str]) -> list[str]:
    """account()'s lines, one for every key."""
    lines = list(imp.notes)
    if imp.values.get("overlap_comm") and rendered["pipeline"]["stages"] > 1:
        raise imp.error(
            "zero_optimization.overlap_comm",
            True,
            f"cannot be honoured with pp "
            f"{rendered['pipeline']['stages']}: DeepSpeed's "
            "pipeline engine runs without overlap_comm",
        )
    for path, value in leaves(imp.canon):
        if path in ("optimizer.params", "scheduler.params") or value == {}:
            continue
        got = dotted_get(rendered, path)
        if got is MISSING:
            raise imp.error(path, value, "is not rendered by dspipe")
        if value == AUTO:
            label = (
                given.get(path)
                or ("the run directory's monitor/" if path in MONITOR_DIR_KEYS else None)
                or ("planner" if path in PLANNER_AUTO | PLAN_DERIVED else "dspipe default")
            )
            shown = _show(got) if not isinstance(got, dict) else "the object gen-config writes"
            lines.append(f'preset: {path} "auto" -> {shown} ({label})')
        elif path in MONITOR_DIR_KEYS:
            if value != got:
                lines.append(f"preset: {path} {_show(value)} -> {_show(got)} (the run directory's monitor/)")
        elif path == "pipeline.activation_checkpoint_interval" and value == 1 and rendered["pipeline"]["stages"] == 1:
            lines.append(  # the import asked for full recomputation, which the plan does without a pipeline engine
                f"preset: {path} 1 -> {_show(got)} (pp 1: no pipeline engine reads it; dspipe recomputes the "
                "blocks itself, --checkpointing full)"
            )
        elif not _same(value, got):
            raise imp.error(path, value, f"cannot be honoured: this plan renders {_show(got)}" + _why(path, rendered))
    return lines


def _same(a: object, b: object) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def _why(path: str, rendered: dict[str, Any]) -> str:
    if path == "gradient_accumulation_steps":
        batch, micro, ga = (rendered[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu", path))
        return (
            f' (= train_batch_size {batch} / (micro {micro} x dp {batch // (micro * ga)}); set it to "auto" '
            "or change the batch)"
        )
    if path in ("bf16.enabled", "fp16.enabled"):
        return " (give --precision)"
    if path == "zero_optimization.overlap_comm":
        return " (DeepSpeed's pipeline engine runs without overlap_comm)"
    stage = rendered["zero_optimization"]["stage"]
    if path.startswith("zero_optimization.stage3_") and stage != 3:
        return f' (stage {stage}: DeepSpeed reads it under stage 3 only; set it to "auto" or remove it)'
    if path in ("pipeline.pipe_partitioned", "pipeline.grad_partitioned"):
        return (
            " (false exactly when Megatron sequence parallelism is on, --tp-sp at tp > 1: the stages then send each "
            'tp rank its own sequence slice already; set it to "auto", or give --tp-sp / --no-tp-sp)'
        )
    return ""
