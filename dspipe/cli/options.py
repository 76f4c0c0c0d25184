"""Options shared by `dspipe plan`, `gen-config` and `bench`, and the request they describe.

Every option that sets a field of ModelSpec, ClusterSpec, TrainSpec or StrategySpec takes its default from that
dataclass field (spec_default); an option whose default is None means auto (the planner chooses) or derived (the
rule is in its help text). Defaults the dataclasses do not have (cluster shape, batch, steps) live in CLI_DEFAULTS.
Imports no torch/deepspeed.
"""
from __future__ import annotations

import math
import re
from dataclasses import MISSING, fields, replace
from pathlib import Path

import click

from dspipe.errors import SpecError
from dspipe.planner.hardware import names_text
from dspipe.planner.layout import ParallelLayout
from dspipe.planner.presets import MODEL_PRESETS, model_preset
from dspipe.planner.ds_preset import AUTO_OPTIONS, OPTION_FLAGS, PresetImport, account
from dspipe.planner.render import import_ds_preset, render_ds_config
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


_ASCII_INT = re.compile(r"[+-]?[0-9]+")
_NON_FINITE = re.compile(r"[+-]?(nan|inf|infinity)", re.I)
_ASCII_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


class StrictInt(click.ParamType):
    """An integer written in ASCII digits (Python's int() also reads '\u0663' or fullwidth digits: refused)."""

    name = "integer"

    def convert(self, value, param, ctx):
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        text = str(value).strip()
        if not _ASCII_INT.fullmatch(text):
            self.fail(f"{value!r} is not an integer (ASCII digits)", param, ctx)
        return int(text)


class StrictFloat(click.ParamType):
    """A number written in ASCII ('\u0663' or fullwidth digits are refused). nan and inf convert, so that the
    spec that owns the field refuses them with its allowed range."""

    name = "float"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, float):
            return value
        text = str(value).strip()
        if not (_ASCII_FLOAT.fullmatch(text) or _NON_FINITE.fullmatch(text)):
            self.fail(f"{value!r} is not a number", param, ctx)
        return float(text)


INT, FLOAT = StrictInt(), StrictFloat()
TOKEN_SCALE = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_tokens(text: str | None, *, flag: str) -> float | None:
    """'300B', '1.5T', '2e9', '500M' -> a token count (finite, > 0); None stays None."""
    if text is None:
        return None
    t = text.strip().upper()
    number = t[:-1] if t and t[-1] in TOKEN_SCALE else t
    value = float(number) * TOKEN_SCALE.get(t[-1:], 1.0) if _ASCII_FLOAT.fullmatch(number) else -1.0
    if not 0 < value < float("inf"):
        raise SpecError(f"{flag} {text!r} does not parse as a token count: use a number like 300B, 1.5T or 2e9")
    return value


class AutoInt(click.ParamType):
    """An integer or 'auto' (None: let the planner choose)."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        if value is None or value == AUTO or isinstance(value, int):
            return None if value == AUTO else value
        return INT.convert(value, param, ctx)


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
        click.option("--layers", type=INT, default=None, help="transformer blocks (overrides the preset)"),
        click.option("--hidden", type=INT, default=None, help="model width"),
        click.option("--heads", type=INT, default=None, help="attention heads"),
        click.option("--vocab", type=INT, default=None, help="vocabulary size"),
        click.option("--seq-len", type=INT, default=None,
                     help=f"context length [the preset's; custom {CLI_DEFAULTS['seq_len']}]"),
        click.option("--ffn", type=INT, default=None, help="MLP width (default 4 x hidden)"),
        click.option("--dropout", type=FLOAT, default=None,
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
        click.option("--nodes", type=INT, default=CLI_DEFAULTS["nodes"], show_default=True, help="machines"),
        click.option("--gpus-per-node", type=INT, default=CLI_DEFAULTS["gpus_per_node"], show_default=True,
                     help="ranks per machine"),
        click.option("--gpu", default=CLI_DEFAULTS["gpu"], show_default=True, help=f"GPU type: {names_text()}"),
        click.option("--hostfile", default=None, help="hostfile: sets --nodes/--gpus-per-node (validated)"),
        click.option("--host-memory-gib", type=FLOAT, default=spec_default(ClusterSpec, "host_memory_gib"),
                     help="host RAM per node [default: a typical node for --gpu]"),
        click.option("--global-batch", type=INT, default=CLI_DEFAULTS["global_batch"], show_default=True,
                     help="sequences per optimizer step"),
        click.option("--micro-batch", type=AutoInt(), default=None, help="sequences per rank per forward [auto]"),
        click.option("--steps", type=INT, default=CLI_DEFAULTS["steps"], show_default=True, help="optimizer steps"),
        click.option("--lr", type=FLOAT, default=_train("lr"), show_default=True, help="peak learning rate"),
        click.option("--min-lr-ratio", type=FLOAT, default=_train("min_lr_ratio"), show_default=True,
                     help="final lr / peak lr"),
        click.option("--warmup", type=INT, default=None, help=WARMUP_HELP),
        click.option("--weight-decay", type=FLOAT, default=_train("weight_decay"), show_default=True,
                     help="AdamW weight decay (not on biases and norms)"),
        click.option("--grad-clip", type=FLOAT, default=_train("grad_clip"), show_default=True,
                     help="global gradient-norm clipping"),
        click.option("--seed", type=INT, default=_train("seed"), show_default=True),
        click.option("--log-interval", type=INT, default=_train("log_interval"), show_default=True,
                     help="steps between log lines"),
        click.option("--save-interval", type=INT, default=_train("save_interval"), show_default=True,
                     help="steps between checkpoints (0: only at the end and on SIGTERM/SIGINT)"),
        click.option("--keep-checkpoints", type=INT, default=_train("keep_checkpoints"), show_default=True,
                     help="complete checkpoints to keep (older ones are deleted)"),
        click.option("--eval-interval", type=INT, default=_train("eval_interval"), show_default=True,
                     help="steps between validation passes (0: none)"),
        click.option("--eval-batches", type=INT, default=_train("eval_batches"), show_default=True,
                     help="micro-batches per data-parallel rank in one validation pass"),
        click.option("--max-skipped-steps", type=INT, default=_train("max_skipped_steps"), show_default=True,
                     help="consecutive non-finite steps before the run saves and stops (0: never)"),
        click.option("--spike-window", type=INT, default=_train("spike_window"), show_default=True,
                     help="steps of loss history for loss-spike detection"),
        click.option("--spike-sigma", type=FLOAT, default=_train("spike_sigma"), show_default=True,
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
        click.option("--reduce-bucket-size", type=INT, default=strategy["reduce_bucket_size"],
                     help="gradient reduce / all-gather bucket, elements [hidden^2, at least 2^20]"),
        click.option("--prefetch-bucket-size", type=INT, default=strategy["prefetch_bucket_size"],
                     help="ZeRO-3 prefetch bucket, elements [0.9 hidden^2, at least 2^20]"),
        click.option("--param-persistence-threshold", type=INT, default=strategy["param_persistence_threshold"],
                     help="ZeRO-3: keep parameters smaller than this whole [10 hidden]"),
        click.option("--preset", default=None,
                     help="DeepSpeed JSON to start from: a name from 'dspipe presets' or a .json path. Every key is "
                          "honoured in ds_config.json, or reported (\"auto\" resolved), or refused; a flag that "
                          "contradicts it is an error"),
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


def _given_on_command_line(o: dict) -> set[str]:
    """The options the user typed (a preset value may fill the others)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return set()
    return {name for name in o if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE}


def _normal(name: str, value):
    return int(value) if name == "zero" and value is not None else value


def _merge_preset(o: dict, imp: PresetImport, given: set[str], cluster: ClusterSpec) -> dict:
    """`o` with the preset's values for the options not typed; a typed flag that contradicts the preset is an error."""
    o = dict(o)
    for name, value in imp.options.items():
        if name in given and _normal(name, o[name]) != value:
            raise SpecError(f"{OPTION_FLAGS[name]} {o[name]} contradicts {imp.shown(name)} in preset {imp.source}; "
                            "drop the flag or edit the preset")
        o[name] = value
    if "min_lr_ratio" in given and imp.scheduler_type not in (None, "WarmupCosineLR"):
        raise SpecError(f"--min-lr-ratio applies to WarmupCosineLR; preset {imp.source} schedules {imp.scheduler_type}"
                        f"; drop the flag or edit the preset")
    if o.get("wall_clock_breakdown") and imp.values.get("wall_clock_breakdown") is False:
        raise SpecError(f"--wall-clock-breakdown contradicts wall_clock_breakdown false in preset {imp.source}; "
                        "drop the flag or edit the preset")
    ga = imp.grad_accum
    pp = o.get("pp") or 1
    if ga is not None and o.get("pp") and o.get("micro_batch") and cluster.world_size % pp == 0:
        dp = ParallelLayout(world=cluster.world_size, pp=pp).dp
        if o["global_batch"] != o["micro_batch"] * ga * dp:
            raise SpecError(f"preset {imp.source}: train_batch_size {o['global_batch']} != micro "
                            f"{o['micro_batch']} x gradient_accumulation_steps {ga} x dp {dp} (world "
                            f"{cluster.world_size} / pp {pp}) = {o['micro_batch'] * ga * dp}: this cluster needs "
                            f"gradient_accumulation_steps {o['global_batch'] / (o['micro_batch'] * dp):g}; set it "
                            "(or \"auto\") in the preset")
    if ga is not None and cluster.world_size % pp == 0:  # DeepSpeed derives the missing one of the batch triple
        dp = ParallelLayout(world=cluster.world_size, pp=pp).dp
        if "global_batch" not in imp.options and "global_batch" not in given and o.get("micro_batch"):
            o["global_batch"] = o["micro_batch"] * ga * dp
            imp.note(f"train_batch_size not set -> {o['global_batch']} = micro {o['micro_batch']} x ga {ga} x dp {dp} "
                     "(as DeepSpeed derives it)")
        elif not o.get("micro_batch") and o["global_batch"] % (ga * dp) == 0:
            o["micro_batch"] = o["global_batch"] // (ga * dp)
            imp.note(f"train_micro_batch_size_per_gpu not set -> {o['micro_batch']} = global {o['global_batch']} / "
                     f"(ga {ga} x dp {dp}) (as DeepSpeed derives it)")
    return o


PRESET_META = "dspipe.preset"
"""click context meta key: (PresetImport, labels) of the --preset in effect, for the report after planning."""


def request_from_options(o: dict) -> tuple[ModelSpec, ClusterSpec, TrainSpec, dict]:
    """(model, cluster, train, fixed strategy choices): a flag given, else the --preset's value, else auto (None)
    or the option's default. A flag that contradicts the preset is an error."""
    cluster = cluster_from_options(o)  # --nodes/--gpus-per-node, or from --hostfile
    if o.get("preset") is not None:
        imp = import_ds_preset(o["preset"])
        given = _given_on_command_line(o)
        o = _merge_preset(o, imp, given, cluster)
        labels = {path: OPTION_FLAGS[name] for path, name in AUTO_OPTIONS.items() if name in given}
        ctx = click.get_current_context(silent=True)
        if ctx is not None:
            ctx.meta[PRESET_META] = (imp, labels)
    fixed = {k: o[k] for k in STRATEGY_KEYS}
    fixed["zero"] = None if fixed["zero"] is None else int(fixed["zero"])
    model = _model_from_options(o)
    if o.get("pad_vocab"):
        model = _with_padded_vocab(model, o["data"])
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


def applied_preset() -> tuple[PresetImport | None, dict]:
    """The --preset of the running command (after request_from_options) and its flag labels; (None, {}) without."""
    ctx = click.get_current_context(silent=True)
    return ctx.meta.get(PRESET_META, (None, {})) if ctx is not None else (None, {})


def preset_report(ds_config: dict) -> list[str]:
    """What became of the --preset's keys in `ds_config` (rendered with it): report lines; SpecError when the plan
    contradicts one of them. Empty without --preset."""
    imp, labels = applied_preset()
    return account(imp, ds_config, given=labels) if imp is not None else []


def preset_report_for(best, *, monitor_dir: str) -> list[str]:
    """preset_report for a search's best candidate (plan: nothing is written)."""
    imp, _ = applied_preset()
    if imp is None:
        return []
    return preset_report(render_ds_config(plan=best.plan, train=best.train, monitor_dir=monitor_dir, preset=imp))


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
