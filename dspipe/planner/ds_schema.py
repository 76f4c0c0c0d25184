"""The DeepSpeed keys dspipe writes, in the order ds_config.json lists them, each with the value name it is rendered
from and dspipe's fixed default (PLAN: derived from the plan and options when rendering). No torch, no deepspeed.

A preset's values and the monitor flags set these names too (planner/ds_preset.py, planner/render.py); a new
DeepSpeed key is one row here (plus its check in ds_preset.py when a preset may set it)."""
from __future__ import annotations

from dataclasses import dataclass

PLAN = object()
"""Default of a key whose value comes from the plan or the options (render_ds_config gives it every time)."""


@dataclass(frozen=True)
class DsKey:
    """One DeepSpeed key of the rendered config."""

    path: str
    """Dotted DeepSpeed key, e.g. zero_optimization.offload_param.device."""
    name: str
    """Value name it is rendered from (a preset's values and the monitor flags use the same names)."""
    default: object = PLAN
    """dspipe's own value; PLAN: derived from the plan or the options."""


def _k(path: str, name: str, default: object = PLAN) -> DsKey:
    return DsKey(path=path, name=name, default=default)


SCHEMA = (
    _k("train_batch_size", "global_batch"),
    _k("train_micro_batch_size_per_gpu", "micro_batch"),
    _k("gradient_accumulation_steps", "grad_accum"),
    _k("steps_per_print", "steps_per_print"),
    _k("wall_clock_breakdown", "wall_clock_breakdown"),
    _k("gradient_clipping", "grad_clip"),
    _k("prescale_gradients", "prescale_gradients", False),
    _k("gradient_predivide_factor", "gradient_predivide_factor", 1.0),
    _k("zero_allow_untested_optimizer", "zero_allow_untested_optimizer", False),
    _k("optimizer.type", "optimizer_type", "AdamW"),
    _k("optimizer.params.lr", "lr"),
    _k("optimizer.params.betas", "betas", [0.9, 0.95]),
    _k("optimizer.params.eps", "eps", 1e-08),
    _k("optimizer.params.weight_decay", "weight_decay"),
    _k("scheduler.type", "scheduler_type"),
    _k("scheduler.params", "scheduler_params"),
    _k("bf16.enabled", "bf16"),
    _k("bf16.immediate_grad_update", "bf16_immediate_grad_update", False),
    _k("bf16.check_grad_overflow", "bf16_check_grad_overflow", True),
    _k("fp16.enabled", "fp16"),
    _k("fp16.auto_cast", "fp16_auto_cast", False),
    _k("fp16.loss_scale", "fp16_loss_scale", 0),
    _k("fp16.initial_scale_power", "fp16_initial_scale_power", 16),
    _k("fp16.loss_scale_window", "fp16_loss_scale_window", 1000),
    _k("fp16.hysteresis", "fp16_hysteresis", 2),
    _k("fp16.consecutive_hysteresis", "fp16_consecutive_hysteresis", False),
    _k("fp16.min_loss_scale", "fp16_min_loss_scale", 1),
    _k("data_types.grad_accum_dtype", "grad_accum_dtype"),
    _k("zero_optimization.stage", "zero_stage"),
    _k("zero_optimization.contiguous_gradients", "contiguous_gradients"),
    _k("zero_optimization.overlap_comm", "overlap_comm"),
    _k("zero_optimization.reduce_scatter", "reduce_scatter"),
    _k("zero_optimization.reduce_bucket_size", "reduce_bucket_size"),
    _k("zero_optimization.allgather_partitions", "allgather_partitions", True),
    _k("zero_optimization.allgather_bucket_size", "allgather_bucket_size"),
    _k("zero_optimization.round_robin_gradients", "round_robin_gradients", False),
    _k("zero_optimization.load_from_fp32_weights", "load_from_fp32_weights", True),
    _k("zero_optimization.elastic_checkpoint", "elastic_checkpoint", False),
    _k("zero_optimization.ignore_unused_parameters", "ignore_unused_parameters", True),
    _k("zero_optimization.sub_group_size", "sub_group_size", 1000000000),
    _k("zero_optimization.stage3_prefetch_bucket_size", "prefetch_bucket_size"),
    _k("zero_optimization.stage3_param_persistence_threshold", "param_persistence_threshold"),
    _k("zero_optimization.stage3_max_live_parameters", "max_live_parameters"),
    _k("zero_optimization.stage3_max_reuse_distance", "max_reuse_distance"),
    _k("zero_optimization.stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save", False),
    _k("zero_optimization.offload_optimizer.device", "offload_optimizer_device"),
    _k("zero_optimization.offload_optimizer.nvme_path", "offload_optimizer_nvme_path"),
    _k("zero_optimization.offload_optimizer.pin_memory", "offload_optimizer_pin_memory"),
    _k("zero_optimization.offload_optimizer.buffer_count", "offload_optimizer_buffer_count", 4),
    _k("zero_optimization.offload_optimizer.fast_init", "offload_optimizer_fast_init", False),
    _k("zero_optimization.offload_optimizer.ratio", "offload_optimizer_ratio", 1.0),
    _k("zero_optimization.offload_param.device", "offload_param_device"),
    _k("zero_optimization.offload_param.nvme_path", "offload_param_nvme_path"),
    _k("zero_optimization.offload_param.pin_memory", "offload_param_pin_memory"),
    _k("zero_optimization.offload_param.buffer_count", "offload_param_buffer_count", 5),
    _k("zero_optimization.offload_param.buffer_size", "offload_param_buffer_size", 100000000),
    _k("zero_optimization.offload_param.max_in_cpu", "offload_param_max_in_cpu", 1000000000),
    _k("pipeline.stages", "pp"),
    _k("pipeline.partition", "partition_method"),
    _k("pipeline.seed_layers", "seed_layers", False),
    _k("pipeline.activation_checkpoint_interval", "activation_checkpoint_interval"),
    _k("pipeline.pipe_partitioned", "pipe_partitioned", True),
    _k("pipeline.grad_partitioned", "grad_partitioned", True),
    _k("tensor_parallel.autotp_size", "autotp_size"),
    _k("tensor_parallel.tp_overlap_comm", "tp_overlap_comm", False),
    _k("tensor_parallel.vocab_parallel_lm_head", "vocab_parallel_lm_head", False),
    _k("tensor_parallel.vocab_parallel_ce_backend", "vocab_parallel_ce_backend", "torch"),
    _k("tensor_parallel.tp.tp_size", "tp_size"),
    _k("tensor_parallel.tp.tp_grain_size", "tp_grain_size", 1),
    _k("tensor_parallel.partition_config", "tp_partition_config"),
    _k("sequence_parallel_size", "sp"),
    _k("activation_checkpointing.partition_activations", "ac_partition_activations", False),
    _k("activation_checkpointing.cpu_checkpointing", "ac_cpu_checkpointing", False),
    _k("activation_checkpointing.contiguous_memory_optimization", "ac_contiguous_memory_optimization", False),
    _k("activation_checkpointing.number_checkpoints", "ac_number_checkpoints", None),
    _k("activation_checkpointing.synchronize_checkpoint_boundary", "ac_synchronize_checkpoint_boundary", False),
    _k("activation_checkpointing.profile", "ac_profile", False),
    _k("tensorboard.enabled", "tensorboard_enabled", True),
    _k("tensorboard.output_path", "monitor_dir"),
    _k("tensorboard.job_name", "tensorboard_job_name", "tensorboard"),
    _k("csv_monitor.enabled", "csv_monitor_enabled", True),
    _k("csv_monitor.output_path", "monitor_dir"),
    _k("csv_monitor.job_name", "csv_monitor_job_name", "csv"),
    _k("wandb.enabled", "wandb_enabled", False),
    _k("wandb.group", "wandb_group", None),
    _k("wandb.team", "wandb_team", None),
    _k("wandb.project", "wandb_project", "deepspeed"),
    _k("comet.enabled", "comet_enabled", False),
    _k("comet.samples_log_interval", "comet_samples_log_interval", 100),
    _k("comet.project", "comet_project", None),
    _k("comet.workspace", "comet_workspace", None),
    _k("comet.api_key", "comet_api_key", None),
    _k("comet.experiment_name", "comet_experiment_name", None),
    _k("comet.experiment_key", "comet_experiment_key", None),
    _k("comet.online", "comet_online", True),
    _k("comet.mode", "comet_mode", "get_or_create"),
)
"""Every key of the rendered ds_config.json, in its order."""

DEFAULTS = {key.name: key.default for key in SCHEMA if key.default is not PLAN}
"""dspipe's own value of every DeepSpeed setting the plan does not derive; a --preset may set each of them."""
NAMES = frozenset(key.name for key in SCHEMA)


def build(values: dict) -> dict:
    """The DeepSpeed config from a value for every name of SCHEMA (no more, no fewer), nested in SCHEMA's order."""
    missing, unused = NAMES - set(values), set(values) - NAMES
    if missing or unused:
        raise KeyError(f"ds_config: missing values {sorted(missing)}, unused {sorted(unused)}")
    config: dict = {}
    for key in SCHEMA:
        *sections, leaf = key.path.split(".")
        node = config
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = values[key.name]
    return config
