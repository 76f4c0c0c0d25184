"""Options shared by `dspipe plan`, `gen-config` and `bench`, and the request they describe.

Every option that sets a field of ModelSpec, ClusterSpec, TrainSpec or StrategySpec takes its default from that
dataclass field (spec_default); an option whose default is None means auto (the planner chooses) or derived (the
rule is in its help text). Defaults the dataclasses do not have (cluster shape, batch, steps) live in CLI_DEFAULTS.
Imports no torch/deepspeed.
"""
from __future__ import annotations

from dataclasses import MISSING, fields, replace
from pathlib import Path

import click

from dspipe.errors import SpecError
from dspipe.planner.hardware import names_text
from dspipe.planner.presets import MODEL_PRESETS, model_preset
from dspipe.planner.render import load_ds_preset, strategy_from_ds_config
from dspipe.planner.search import AUTO
from dspipe.planner.spec import (CHECKPOINTING, OFFLOADS, PARTITION_METHODS, PRECISIONS, ClusterSpec, ModelSpec,
                                 StrategySpec, TrainSpec)

DEFAULT_DATA = "data/stdlib"
"""Prepared token directory of gen-config --data and prepare-data --out."""

CLI_DEFAULTS = {"nodes": 1, "gpus_per_node": 8, "gpu": "h100-80g", "global_batch": 256, "steps": 1000,
                "seq_len": 1024}
"""Defaults for spec fields the dataclasses leave required (seq_len: a custom model's context length)."""

WARMUP_FRACTION, WARMUP_MAX = 10, 2000
WARMUP_HELP = f"lr warmup steps [default: steps/{WARMUP_FRACTION}, at least 1, at most {WARMUP_MAX}]"


def default_warmup(steps: int) -> int:
    """--warmup when not given (the rule WARMUP_HELP states)."""
    return max(1, min(WARMUP_MAX, steps // WARMUP_FRACTION))


def spec_default(cls, name: str):
    """The default of dataclass field cls.name: the one source of an option's default."""
    for f in fields(cls):
        if f.name == name:
            if f.default is MISSING:
                raise AssertionError(f"{cls.__name__}.{name} has no default")
            return f.default
    raise AssertionError(f"{cls.__name__} has no field {name}")


def _train(name: str):
    return spec_default(TrainSpec, name)


class AutoInt(click.ParamType):
    """An integer or 'auto' (None: let the planner choose)."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        if value is None or value == AUTO or isinstance(value, int):
            return None if value == AUTO else value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is not 'auto' or an integer", param, ctx)


class AutoChoice(click.ParamType):
    """One of `choices` or 'auto'."""

    def __init__(self, choices):
        self.choices = tuple(choices)
        self.name = "|".join(("auto", *self.choices))

    def convert(self, value, param, ctx):
        if value is None or value == AUTO:
            return None
        if value not in self.choices:
            self.fail(f"{value!r} is not one of: auto, {', '.join(self.choices)}", param, ctx)
        return value


STRATEGY_KEYS = ("zero", "offload", "offload_params", "nvme_path", "pp", "checkpointing", "partition_method",
                 "precision", "micro_batch", "reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold")


def model_options(f):
    for opt in reversed([
        click.option("--model", help=f"model preset: {', '.join(MODEL_PRESETS)}"),
        click.option("--layers", type=int, default=None, help="transformer blocks (overrides the preset)"),
        click.option("--hidden", type=int, default=None, help="model width"),
        click.option("--heads", type=int, default=None, help="attention heads"),
        click.option("--vocab", type=int, default=None, help="vocabulary size"),
        click.option("--seq-len", type=int, default=None,
                     help=f"context length [the preset's; custom {CLI_DEFAULTS['seq_len']}]"),
        click.option("--ffn", type=int, default=None, help="MLP width (default 4 x hidden)"),
        click.option("--dropout", type=float, default=None,
                     help=f"dropout probability [the preset's; custom {spec_default(ModelSpec, 'dropout'):g}]"),
        click.option("--untied", is_flag=True, default=False, help="separate output head (default: tied)"),
    ]):
        f = opt(f)
    return f


def spec_options(f):
    """Model, cluster, training and strategy options shared by plan, gen-config and bench."""
    strategy = {name: spec_default(StrategySpec, name)
                for name in ("nvme_path", "partition_method", "reduce_bucket_size", "prefetch_bucket_size",
                             "param_persistence_threshold")}
    for opt in reversed([
        click.option("--nodes", type=int, default=CLI_DEFAULTS["nodes"], show_default=True, help="machines"),
        click.option("--gpus-per-node", type=int, default=CLI_DEFAULTS["gpus_per_node"], show_default=True,
                     help="ranks per machine"),
        click.option("--gpu", default=CLI_DEFAULTS["gpu"], show_default=True, help=f"GPU type: {names_text()}"),
        click.option("--hostfile", default=None, help="hostfile: sets --nodes/--gpus-per-node (validated)"),
        click.option("--host-memory-gib", type=float, default=spec_default(ClusterSpec, "host_memory_gib"),
                     help="host RAM per node [default: a typical node for --gpu]"),
        click.option("--global-batch", type=int, default=CLI_DEFAULTS["global_batch"], show_default=True,
                     help="sequences per optimizer step"),
        click.option("--micro-batch", type=AutoInt(), default=None, help="sequences per rank per forward [auto]"),
        click.option("--steps", type=int, default=CLI_DEFAULTS["steps"], show_default=True, help="optimizer steps"),
        click.option("--lr", type=float, default=_train("lr"), show_default=True, help="peak learning rate"),
        click.option("--min-lr-ratio", type=float, default=_train("min_lr_ratio"), show_default=True,
                     help="final lr / peak lr"),
        click.option("--warmup", type=int, default=None, help=WARMUP_HELP),
        click.option("--weight-decay", type=float, default=_train("weight_decay"), show_default=True,
                     help="AdamW weight decay (not on biases and norms)"),
        click.option("--grad-clip", type=float, default=_train("grad_clip"), show_default=True,
                     help="global gradient-norm clipping"),
        click.option("--seed", type=int, default=_train("seed"), show_default=True),
        click.option("--log-interval", type=int, default=_train("log_interval"), show_default=True,
                     help="steps between log lines"),
        click.option("--save-interval", type=int, default=_train("save_interval"), show_default=True,
                     help="steps between checkpoints (0: only at the end and on SIGTERM/SIGINT)"),
        click.option("--keep-checkpoints", type=int, default=_train("keep_checkpoints"), show_default=True,
                     help="complete checkpoints to keep (older ones are deleted)"),
        click.option("--eval-interval", type=int, default=_train("eval_interval"), show_default=True,
                     help="steps between validation passes (0: none)"),
        click.option("--eval-batches", type=int, default=_train("eval_batches"), show_default=True,
                     help="micro-batches per data-parallel rank in one validation pass"),
        click.option("--max-skipped-steps", type=int, default=_train("max_skipped_steps"), show_default=True,
                     help="consecutive non-finite steps before the run saves and stops (0: never)"),
        click.option("--spike-window", type=int, default=_train("spike_window"), show_default=True,
                     help="steps of loss history for loss-spike detection"),
        click.option("--spike-sigma", type=float, default=_train("spike_sigma"), show_default=True,
                     help="log a loss spike above mean + this many std of the window"),
        click.option("--zero", type=AutoChoice(["0", "1", "2", "3"]), default=None, help="ZeRO stage [auto]"),
        click.option("--offload", type=AutoChoice(OFFLOADS), default=None, help="optimizer state offload [auto]"),
        click.option("--offload-params/--no-offload-params", default=None,
                     help="offload parameters too (ZeRO-3) [auto]"),
        click.option("--nvme-path", default=strategy["nvme_path"],
                     help="NVMe directory for --offload nvme (enables it in auto)"),
        click.option("--precision", type=AutoChoice(PRECISIONS), default=None,
                     help="[auto: bf16 on GPUs, fp32 on cpu]"),
        click.option("--pp", type=AutoInt(), default=None, help="pipeline stages [auto]"),
        click.option("--checkpointing", type=AutoChoice(CHECKPOINTING), default=None,
                     help="activation recomputation [auto]"),
        click.option("--partition-method", type=AutoChoice(PARTITION_METHODS), default=None,
                     help=f"pipeline partition [{strategy['partition_method']}]"),
        click.option("--reduce-bucket-size", type=int, default=strategy["reduce_bucket_size"],
                     help="gradient reduce / all-gather bucket, elements [hidden^2, at least 2^20]"),
        click.option("--prefetch-bucket-size", type=int, default=strategy["prefetch_bucket_size"],
                     help="ZeRO-3 prefetch bucket, elements [0.9 hidden^2, at least 2^20]"),
        click.option("--param-persistence-threshold", type=int, default=strategy["param_persistence_threshold"],
                     help="ZeRO-3: keep parameters smaller than this whole [10 hidden]"),
        click.option("--preset", default=None, help="DeepSpeed preset from ds_configs/ (or a .json path) to start "
                                                   "from; flags given override it"),
    ]):
        f = opt(f)
    return model_options(f)


def cluster_from_options(o: dict) -> ClusterSpec:
    """The cluster: --nodes/--gpus-per-node, or derived from --hostfile (and then checked against them)."""
    from dspipe.cluster.hostfile import read_hostfile

    if not o.get("hostfile"):
        return ClusterSpec(nodes=o["nodes"], gpus_per_node=o["gpus_per_node"], gpu=o["gpu"],
                           host_memory_gib=o.get("host_memory_gib"))
    hostfile = read_hostfile(o["hostfile"])
    derived = {"nodes": len(hostfile.hosts), "gpus_per_node": hostfile.equal_slots()}
    ctx = click.get_current_context()
    for key, value in derived.items():
        if ctx.get_parameter_source(key) == click.core.ParameterSource.COMMANDLINE and o[key] != value:
            raise SpecError(f"--{key.replace('_', '-')} {o[key]} contradicts hostfile {hostfile.source} "
                            f"({derived['nodes']} nodes x {derived['gpus_per_node']} slots); drop one of them")
    return ClusterSpec(nodes=derived["nodes"], gpus_per_node=derived["gpus_per_node"], gpu=o["gpu"],
                       host_memory_gib=o.get("host_memory_gib"))


def _model_from_options(o: dict) -> ModelSpec:
    shape = dict(layers=o["layers"], hidden=o["hidden"], heads=o["heads"], vocab=o["vocab"], seq_len=o["seq_len"],
                 ffn=o["ffn"], dropout=o["dropout"], tied_embeddings=False if o["untied"] else None)
    if o["model"]:
        return model_preset(o["model"], **shape)
    missing = [f"--{k}" for k in ("layers", "hidden", "heads", "vocab") if shape[k] is None]
    if missing:
        raise SpecError(f"give --model NAME ({', '.join(MODEL_PRESETS)}) or all of --layers/--hidden/--heads/--vocab "
                        f"(missing {' '.join(missing)})")
    hidden = shape["hidden"]
    given = {k: shape[k] for k in ("dropout", "tied_embeddings") if shape[k] is not None}  # else ModelSpec's default
    return ModelSpec("custom", shape["layers"], hidden, shape["heads"], shape["vocab"],
                     shape["seq_len"] or CLI_DEFAULTS["seq_len"], shape["ffn"] or 4 * hidden, **given)


def _with_padded_vocab(model: ModelSpec, data: str) -> ModelSpec:
    from dspipe.data import META_FILE, padded_vocab, read_meta

    vocab = read_meta(data)["vocab_size"] if (Path(data) / META_FILE).is_file() else model.vocab
    return replace(model, vocab=padded_vocab(vocab))


def request_from_options(o: dict) -> tuple[ModelSpec, ClusterSpec, TrainSpec, dict]:
    """(model, cluster, train, fixed strategy choices): a flag given wins, then the --preset, else auto (None)."""
    preset = strategy_from_ds_config(load_ds_preset(o["preset"]), source=o["preset"]) if o["preset"] else {}
    fixed = {k: o[k] if o[k] is not None else preset.get(k) for k in STRATEGY_KEYS}
    fixed["zero"] = None if fixed["zero"] is None else int(fixed["zero"])
    model = _model_from_options(o)
    if o.get("pad_vocab"):
        model = _with_padded_vocab(model, o["data"])
    cluster = cluster_from_options(o)  # --nodes/--gpus-per-node, or from --hostfile
    steps = o["steps"]
    train = TrainSpec(global_batch=o["global_batch"], micro_batch=fixed["micro_batch"] or 1, steps=steps, lr=o["lr"],
                      min_lr_ratio=o["min_lr_ratio"],
                      warmup_steps=o["warmup"] if o["warmup"] is not None else default_warmup(steps),
                      weight_decay=o["weight_decay"], grad_clip=o["grad_clip"],
                      precision=fixed["precision"] or _train("precision"), seed=o["seed"],
                      log_interval=o["log_interval"], save_interval=o["save_interval"],
                      keep_checkpoints=o["keep_checkpoints"], eval_interval=o["eval_interval"],
                      eval_batches=o["eval_batches"], max_skipped_steps=o["max_skipped_steps"],
                      spike_window=o["spike_window"], spike_sigma=o["spike_sigma"])
    return model, cluster, train, fixed


def choose(o: dict, *, check_model=None):
    """Search the strategies the options leave open; one-line error when none is valid or none fits."""
    from dspipe.planner.search import nothing_fits_message, search

    model, cluster, train, fixed = request_from_options(o)
    if check_model:
        check_model(model)
    result = search(model=model, cluster=cluster, train=train, fixed=fixed)
    if result.best is None:
        raise SpecError(nothing_fits_message(result=result, model=model, cluster=cluster, train=train, fixed=fixed))
    return model, cluster, result
