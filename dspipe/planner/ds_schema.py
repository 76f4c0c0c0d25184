"""The one table of the DeepSpeed keys dspipe writes and imports, in the order ds_config.json lists them. Each row:
its value name and source (dspipe's fixed default, or Derived: from the plan, the options and the run), and what a
--preset's value of it does (its import target and check). No torch, no deepspeed.

Rendering (planner/render.py), the defaults, preset import and account() (planner/ds_preset.py) read this table; a
new DeepSpeed key is one row here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dspipe.planner import autotp
from dspipe.planner import ds_checks as c
from dspipe.planner.ds_checks import Check
from dspipe.spec.kinds import Precision
from dspipe.spec.values import PARTITION_METHODS

if TYPE_CHECKING:
    from dspipe.planner.plan import Plan
    from dspipe.spec.model import ModelSpec
    from dspipe.spec.train import TrainSpec


@dataclass(frozen=True)
class Sources:
    """What a rendered value may be derived from."""

    plan: Plan
    """The Plan."""
    model: ModelSpec
    """The ModelSpec (the tensor_parallel block's partition config)."""
    train: TrainSpec
    """The TrainSpec."""
    monitor_dir: str
    """The run directory's monitor/ (tensorboard and csv_monitor output)."""
    wall_clock_breakdown: bool
    """--wall-clock-breakdown."""
    scheduler: tuple[str, dict[str, object]]
    """(type, params) of the rendered scheduler (ds_preset.scheduler_block)."""


@dataclass(frozen=True)
class Derived:
    """A value derived when rendering (not a fixed default)."""

    of: Callable[[Sources], object]
    """Sources -> the value."""


def _plan(attr: str) -> Derived:
    return Derived(lambda r: getattr(r.plan, attr))


def _train(attr: str) -> Derived:
    return Derived(lambda r: getattr(r.train, attr))


SETS = ("var",)
"""Import target: the preset's value is rendered as is (it sets the row's value name)."""
PLANNED = ("plan",)
"""Import target: the plan derives the value; a preset's value must equal it (account() compares after rendering)."""


def option(name: str) -> tuple[str, str]:
    """Import target: the preset's value becomes gen-config option `name` (planned with it, conflicts refused)."""
    return ("opt", name)


# Other import targets: ("ga",) gradient_accumulation_steps; ("precision",) bf16/fp16.enabled; ("offload", which) an
# offload device; ("tp",) a preset's AutoTP autotp_size -> --tp; ("checkpointing",) the pipeline's
# activation_checkpoint_interval; ("moved",) a monitor path (always the run directory's monitor/). None: imported by
# its section's own reader (optimizer.type, scheduler, data_types).


@dataclass(frozen=True)
class DsKey:
    """One DeepSpeed key of the rendered config."""

    path: str
    """Dotted DeepSpeed key, e.g. zero_optimization.offload_param.device."""
    name: str
    """Value name it is rendered from (a preset's values and the monitor flags use the same names)."""
    default: object
    """dspipe's own value, or Derived: from the plan, the options and the run."""
    take: tuple[str, ...] | None = None
    """What a preset's value does (see the import targets above); None: its section's reader handles it."""
    check: Check | None = None
    """The preset value's check (planner/ds_checks): the value as rendered, or ValueError(what is allowed)."""
    planner_auto: bool = False
    """A preset's "auto" is resolved by the planner (reported so); otherwise by an option or dspipe's default."""

    @property
    def target(self) -> tuple[str, ...] | None:
        """The import target with SETS resolved to this row's value name."""
        return ("var", self.name) if self.take is SETS else self.take


def _k(
    path: str,
    name: str,
    default: object,
    take: tuple[str, ...] | None = None,
    check: Check | None = None,
    *,
    planner_auto: bool = False,
) -> DsKey:
    return DsKey(path=path, name=name, default=default, take=take, check=check, planner_auto=planner_auto)


SCHEMA = (
    _k("train_batch_size", "global_batch", _plan("ds_train_batch_size"), option("global_batch"), c.integer(1)),
    _k(
        "train_micro_batch_size_per_gpu",
        "micro_batch",
        _plan("micro_batch"),
        option("micro_batch"),
        c.integer(1),
        planner_auto=True,
    ),
    _k("gradient_accumulation_steps", "grad_accum", _plan("grad_accum"), ("ga",), c.integer(1), planner_auto=True),
    _k("steps_per_print", "steps_per_print", _train("log_interval"), SETS, c.integer(1)),
    _k("wall_clock_breakdown", "wall_clock_breakdown", Derived(lambda r: r.wall_clock_breakdown), SETS, c.boolean),
    _k("gradient_clipping", "grad_clip", _train("grad_clip"), option("grad_clip"), c.number(0)),
    _k("prescale_gradients", "prescale_gradients", False, SETS, c.boolean),
    _k("gradient_predivide_factor", "gradient_predivide_factor", 1.0, SETS, c.number(0, open_lo=True)),
    _k("zero_allow_untested_optimizer", "zero_allow_untested_optimizer", False, SETS, c.boolean),
    _k("optimizer.type", "optimizer_type", "AdamW"),
    _k("optimizer.params.lr", "lr", _train("lr"), option("lr"), c.number(0, open_lo=True)),
    _k("optimizer.params.betas", "betas", [0.9, 0.95], SETS, c.betas),
    _k("optimizer.params.eps", "eps", 1e-08, SETS, c.number(0, open_lo=True)),
    _k("optimizer.params.weight_decay", "weight_decay", _train("weight_decay"), option("weight_decay"), c.number(0)),
    _k("scheduler.type", "scheduler_type", Derived(lambda r: r.scheduler[0])),
    _k("scheduler.params", "scheduler_params", Derived(lambda r: r.scheduler[1])),
    _k(
        "bf16.enabled",
        "bf16",
        Derived(lambda r: r.plan.precision == Precision.BF16),
        ("precision",),
        c.boolean,
        planner_auto=True,
    ),
    _k(
        "bf16.immediate_grad_update",
        "immediate_grad_update",
        _plan("immediate_grad_update"),
        option("immediate_grad_update"),
        c.boolean,
    ),
    _k("bf16.check_grad_overflow", "bf16_check_grad_overflow", True, SETS, c.boolean),
    _k(
        "fp16.enabled",
        "fp16",
        Derived(lambda r: r.plan.precision == Precision.FP16),
        ("precision",),
        c.boolean,
        planner_auto=True,
    ),
    _k("fp16.auto_cast", "fp16_auto_cast", False, SETS, c.boolean),
    _k("fp16.loss_scale", "fp16_loss_scale", 0, SETS, c.number(0)),
    _k("fp16.initial_scale_power", "fp16_initial_scale_power", 16, SETS, c.integer(0, 64)),
    _k("fp16.loss_scale_window", "fp16_loss_scale_window", 1000, SETS, c.integer(1)),
    _k("fp16.hysteresis", "fp16_hysteresis", 2, SETS, c.integer(1)),
    _k("fp16.consecutive_hysteresis", "fp16_consecutive_hysteresis", False, SETS, c.boolean),
    _k("fp16.min_loss_scale", "fp16_min_loss_scale", 1, SETS, c.integer(1)),
    _k("data_types.grad_accum_dtype", "grad_accum_dtype", _plan("grad_accum_dtype"), planner_auto=True),
    _k(
        "zero_optimization.stage", "zero_stage", _plan("zero_stage"), option("zero"), c.integer(0, 3), planner_auto=True
    ),
    _k(
        "zero_optimization.contiguous_gradients",
        "contiguous_gradients",
        _plan("contiguous_gradients"),
        SETS,
        c.boolean,
        planner_auto=True,
    ),
    _k("zero_optimization.overlap_comm", "overlap_comm", _plan("overlap_comm"), SETS, c.boolean, planner_auto=True),
    _k("zero_optimization.reduce_scatter", "reduce_scatter", _plan("reduce_scatter"), SETS, c.boolean),
    _k(
        "zero_optimization.reduce_bucket_size",
        "reduce_bucket_size",
        _plan("reduce_bucket_size"),
        option("reduce_bucket_size"),
        c.integer(1),
        planner_auto=True,
    ),
    _k("zero_optimization.allgather_partitions", "allgather_partitions", True, SETS, c.boolean),
    _k(
        "zero_optimization.allgather_bucket_size",
        "allgather_bucket_size",
        _plan("allgather_bucket_size"),
        SETS,
        c.integer(1),
        planner_auto=True,
    ),
    _k("zero_optimization.round_robin_gradients", "round_robin_gradients", False, SETS, c.boolean),
    _k("zero_optimization.load_from_fp32_weights", "load_from_fp32_weights", True, SETS, c.boolean),
    _k("zero_optimization.elastic_checkpoint", "elastic_checkpoint", False, SETS, c.boolean),
    _k("zero_optimization.ignore_unused_parameters", "ignore_unused_parameters", True, SETS, c.boolean),
    _k("zero_optimization.sub_group_size", "sub_group_size", 1000000000, SETS, c.integer(1)),
    _k(
        "zero_optimization.stage3_prefetch_bucket_size",
        "prefetch_bucket_size",
        _plan("prefetch_bucket_size"),
        option("prefetch_bucket_size"),
        c.integer(1),
        planner_auto=True,
    ),
    _k(
        "zero_optimization.stage3_param_persistence_threshold",
        "param_persistence_threshold",
        _plan("param_persistence_threshold"),
        option("param_persistence_threshold"),
        c.integer(1),
        planner_auto=True,
    ),
    _k(
        "zero_optimization.stage3_max_live_parameters",
        "max_live_parameters",
        _plan("max_live_parameters"),
        option("max_live_parameters"),
        c.integer(0),
        planner_auto=True,
    ),
    _k(
        "zero_optimization.stage3_max_reuse_distance",
        "max_reuse_distance",
        _plan("max_reuse_distance"),
        option("max_reuse_distance"),
        c.integer(0),
        planner_auto=True,
    ),
    _k(
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "gather_16bit_weights_on_model_save",
        False,
        SETS,
        c.boolean,
    ),
    _k(
        "zero_optimization.offload_optimizer.device",
        "offload_optimizer_device",
        _plan("offload"),
        ("offload", "optimizer"),
        c.offload_device,
        planner_auto=True,
    ),
    _k(
        "zero_optimization.offload_optimizer.nvme_path",
        "offload_optimizer_nvme_path",
        _plan("nvme_path"),
        SETS,
        c.str_or_null,
    ),
    _k(
        "zero_optimization.offload_optimizer.pin_memory",
        "offload_optimizer_pin_memory",
        _plan("pin_memory"),
        SETS,
        c.boolean,
    ),
    _k("zero_optimization.offload_optimizer.buffer_count", "offload_optimizer_buffer_count", 4, SETS, c.integer(0)),
    _k("zero_optimization.offload_optimizer.fast_init", "offload_optimizer_fast_init", False, SETS, c.boolean),
    _k("zero_optimization.offload_optimizer.ratio", "offload_optimizer_ratio", 1.0, SETS, c.number(0, 1)),
    _k(
        "zero_optimization.offload_param.device",
        "offload_param_device",
        Derived(lambda r: r.plan.offload if r.plan.offload_params else "none"),
        ("offload", "param"),
        c.offload_device,
        planner_auto=True,
    ),
    _k("zero_optimization.offload_param.nvme_path", "offload_param_nvme_path", _plan("nvme_path"), SETS, c.str_or_null),
    _k("zero_optimization.offload_param.pin_memory", "offload_param_pin_memory", _plan("pin_memory"), SETS, c.boolean),
    _k("zero_optimization.offload_param.buffer_count", "offload_param_buffer_count", 5, SETS, c.integer(0)),
    _k("zero_optimization.offload_param.buffer_size", "offload_param_buffer_size", 100000000, SETS, c.integer(0)),
    _k("zero_optimization.offload_param.max_in_cpu", "offload_param_max_in_cpu", 1000000000, SETS, c.integer(0)),
    # DeepSpeed's async I/O for NVMe offload (runtime/swap_tensor/aio_config.py), written with its defaults; a
    # preset's values are rendered as they are
    _k("aio.block_size", "aio_block_size", 1048576, SETS, c.integer(1)),
    _k("aio.queue_depth", "aio_queue_depth", 8, SETS, c.integer(1)),
    _k("aio.intra_op_parallelism", "aio_intra_op_parallelism", 1, SETS, c.integer(1)),
    _k("aio.single_submit", "aio_single_submit", False, SETS, c.boolean),
    _k("aio.overlap_events", "aio_overlap_events", True, SETS, c.boolean),
    _k(
        "aio.use_gds",
        "aio_use_gds",
        False,
        SETS,
        c.off("GPUDirect Storage is not verified by dspipe, and DeepSpeed 0.19.8 asserts a CUDA accelerator for it"),
    ),
    _k("pipeline.stages", "pp", _plan("pp"), option("pp"), c.integer(1), planner_auto=True),
    _k(
        "pipeline.partition",
        "partition_method",
        _plan("partition_method"),
        option("partition_method"),
        c.choice(*PARTITION_METHODS),
    ),
    _k("pipeline.seed_layers", "seed_layers", False, PLANNED, c.boolean),
    _k(
        "pipeline.activation_checkpoint_interval",
        "activation_checkpoint_interval",
        _plan("activation_checkpoint_interval"),
        ("checkpointing",),
        c.integer(0, 1),
    ),
    # under Megatron sequence parallelism the tp ranks' stage outputs differ (each its sequence slice): each sends its
    # own whole, which is what the partitioned send would carry (1/tp of the activation)
    _k("pipeline.pipe_partitioned", "pipe_partitioned", Derived(lambda r: not r.plan.tp_sp), PLANNED, c.boolean),
    _k("pipeline.grad_partitioned", "grad_partitioned", Derived(lambda r: not r.plan.tp_sp), PLANNED, c.boolean),
    # DeepSpeed's AutoTP stays off at every tp (0, as at tp 1): dspipe's own tensor-parallel layers split the model
    # before deepspeed.initialize; a preset's autotp_size N imports as --tp N (planner/ds_preset.py)
    _k("tensor_parallel.autotp_size", "autotp_size", Derived(lambda r: 0), ("tp",), c.integer(0)),
    _k("tensor_parallel.tp_overlap_comm", "tp_overlap_comm", False, SETS, c.boolean),
    _k(
        "tensor_parallel.vocab_parallel_lm_head",
        "vocab_parallel_lm_head",
        False,
        SETS,
        lambda v: c.choice(False, None)(v) or False,
    ),
    _k("tensor_parallel.vocab_parallel_ce_backend", "vocab_parallel_ce_backend", "torch", SETS, c.choice("torch")),
    _k("tensor_parallel.tp.tp_size", "tp_size", Derived(lambda r: 1), PLANNED, c.integer(1)),
    _k("tensor_parallel.tp.tp_grain_size", "tp_grain_size", 1, SETS, c.integer(1)),
    _k(
        "tensor_parallel.partition_config",
        "tp_partition_config",
        Derived(lambda r: autotp.partition_config(r.model)),
        PLANNED,
        lambda v: v,
    ),
    _k("sequence_parallel_size", "sp", _plan("sp"), option("sp"), c.integer(1)),
    _k("activation_checkpointing.partition_activations", "ac_partition_activations", False, SETS, c.boolean),
    _k("activation_checkpointing.cpu_checkpointing", "ac_cpu_checkpointing", False, SETS, c.boolean),
    _k(
        "activation_checkpointing.contiguous_memory_optimization",
        "ac_contiguous_memory_optimization",
        False,
        SETS,
        c.boolean,
    ),
    _k("activation_checkpointing.number_checkpoints", "ac_number_checkpoints", None, SETS, c.number_checkpoints),
    _k(
        "activation_checkpointing.synchronize_checkpoint_boundary",
        "ac_synchronize_checkpoint_boundary",
        False,
        SETS,
        c.boolean,
    ),
    _k("activation_checkpointing.profile", "ac_profile", False, SETS, c.boolean),
    _k("tensorboard.enabled", "tensorboard_enabled", True, SETS, c.boolean),
    _k("tensorboard.output_path", "monitor_dir", Derived(lambda r: r.monitor_dir), ("moved",), c.str_or_null),
    _k("tensorboard.job_name", "tensorboard_job_name", "tensorboard", SETS, c.str_or_null),
    _k("csv_monitor.enabled", "csv_monitor_enabled", True, SETS, c.boolean),
    _k("csv_monitor.output_path", "monitor_dir", Derived(lambda r: r.monitor_dir), ("moved",), c.str_or_null),
    _k("csv_monitor.job_name", "csv_monitor_job_name", "csv", SETS, c.str_or_null),
    _k("wandb.enabled", "wandb_enabled", False, SETS, c.boolean),
    _k("wandb.group", "wandb_group", None, SETS, c.str_or_null),
    _k("wandb.team", "wandb_team", None, SETS, c.str_or_null),
    _k("wandb.project", "wandb_project", "deepspeed", SETS, c.str_or_null),
    _k("comet.enabled", "comet_enabled", False, SETS, c.boolean),
    _k("comet.samples_log_interval", "comet_samples_log_interval", 100, SETS, c.integer(1)),
    _k("comet.project", "comet_project", None, SETS, c.str_or_null),
    _k("comet.workspace", "comet_workspace", None, SETS, c.str_or_null),
    _k("comet.api_key", "comet_api_key", None, SETS, c.choice(None)),
    _k("comet.experiment_name", "comet_experiment_name", None, SETS, c.str_or_null),
    _k("comet.experiment_key", "comet_experiment_key", None, SETS, c.str_or_null),
    _k("comet.online", "comet_online", True, SETS, lambda v: True if v is None else c.boolean(v)),
    _k(
        "comet.mode",
        "comet_mode",
        "get_or_create",
        SETS,
        lambda v: "get_or_create" if v is None else c.choice("get", "create", "get_or_create")(v),
    ),
)
"""Every key of the rendered ds_config.json, in its order."""

LATER_KEYS = frozenset(key.path for key in SCHEMA if key.path.startswith("aio."))
"""Keys gen-config renders since dspipe wrote the aio section (2026-12): a run directory written before lacks the
section, which is then DeepSpeed's defaults, the values dspipe renders without a preset (rundir.check_ds_keys accepts
the section missing whole, not in part)."""
DEFAULTS = {key.name: key.default for key in SCHEMA if not isinstance(key.default, Derived)}
"""dspipe's own value of every DeepSpeed setting the plan does not derive; a --preset may set each of them."""
NAMES = frozenset(key.name for key in SCHEMA)
PLANNER_AUTO = frozenset(key.path for key in SCHEMA if key.planner_auto)
"""Keys whose "auto" the planner resolves (the rest resolve to dspipe's options or defaults)."""


def section(prefix: str) -> dict[str, tuple[tuple[str, ...] | None, Check | None]]:
    """A preset section's keys (prefix "": the top level) -> (import target, check), for the rows a preset sets."""
    depth = prefix.count(".") + 1 if prefix else 0
    return {
        key.path.split(".")[-1]: (key.target, key.check)
        for key in SCHEMA
        if key.take is not None and key.path.startswith(f"{prefix}." if prefix else "") and key.path.count(".") == depth
    }


def derived(sources: Sources) -> dict[str, object]:
    """Value name -> value of every Derived row."""
    return {key.name: key.default.of(sources) for key in SCHEMA if isinstance(key.default, Derived)}


def build(values: dict[str, object]) -> dict[str, Any]:  # the JSON object
    """The DeepSpeed config from a value for every name of SCHEMA (no more, no fewer), nested in SCHEMA's order."""
    missing, unused = NAMES - set(values), set(values) - NAMES
    if missing or unused:
        raise KeyError(f"ds_config: missing values {sorted(missing)}, unused {sorted(unused)}")
    config: dict[str, Any] = {}
    for key in SCHEMA:
        *sections, leaf = key.path.split(".")
        node = config
        for part in sections:
            node = node.setdefault(part, {})
        node[leaf] = values[key.name]
    return config
