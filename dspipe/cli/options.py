"""Options shared by `dspipe plan`, `gen-config` and `bench`, and the request they describe.

Every option that sets a field of ModelSpec, ClusterSpec, TrainSpec or StrategySpec takes its default from that
dataclass field (spec_default); an option whose default is None means auto (the planner chooses) or derived (the
rule is in its help text). Defaults the dataclasses do not have (cluster shape, batch, steps) live in CLI_DEFAULTS.
Imports no torch/deepspeed.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import MISSING, fields, replace
from pathlib import Path

import click

from dspipe.errors import SpecError
from dspipe.spec.hardware import names_text
from dspipe.spec.layout import ParallelLayout
from dspipe.spec.presets import MODEL_PRESETS, model_preset
from dspipe.planner.ds_preset import AUTO_OPTIONS, OPTION_FLAGS, PresetImport, account
from dspipe.planner.render import import_ds_preset, render_ds_config
from dspipe.planner.search import AUTO
from dspipe.planner.estimate import MEMORY_HEADROOM
from dspipe.spec.core import (CHECKPOINTING, LIMITS, MLPS, NORMS, OFFLOADS, PARTITION_METHODS, POSITIONS,
                                 PRECISIONS, ClusterSpec, ModelSpec, StrategySpec, TrainSpec, token_count)

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
    file_kind = "int"  # what a --config file holds for it (dspipe.cli.config_file.kind)

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
    file_kind = "float"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, float):
            return value
        text = str(value).strip()
        if not (_ASCII_FLOAT.fullmatch(text) or _NON_FINITE.fullmatch(text)):
            self.fail(f"{value!r} is not a number", param, ctx)
        return float(text)


INT, FLOAT = StrictInt(), StrictFloat()
TOKEN_HELP = "use a number like 300B, 1.5T or 2e9"


def parse_tokens(text: str | None, *, flag: str) -> float | None:
    """'300B', '1.5T', '2e9', '500M' -> a token count (finite, > 0); None stays None."""
    if text is None:
        return None
    value = token_count(text)
    if value is None:
        raise SpecError(f"{flag} {text!r} does not parse as a token count: {TOKEN_HELP}")
    return value


class TokenBudget(click.ParamType):
    """A token budget, kept as written ('300B'; a number from a config file as its digits): the value of
    --tokens. A flag that does not parse is parse_tokens' one-line error."""

    name = "tokens"
    file_kind = "tokens"

    def convert(self, value, param, ctx):
        if value is None:
            return None
        if isinstance(value, bool):
            self.fail(f"{value!r} is not a token count: {TOKEN_HELP}", param, ctx)
        if isinstance(value, float):
            text = str(int(value)) if value.is_integer() else repr(value)
        else:
            text = str(value).strip()
        if token_count(text) is None:
            if param is not None:
                parse_tokens(str(value), flag=max(param.opts, key=len))
            self.fail(f"{value!r} does not parse as a token count: {TOKEN_HELP}", param, ctx)
        return text


def tokens_option(help: str):
    """--tokens: the run's length as a token budget (instead of --steps)."""
    return click.option("--tokens", type=TokenBudget(), default=None, help=help)


def steps_for_tokens(tokens: str, *, global_batch: int, seq_len: int) -> int:
    """ceil(tokens / (global_batch x seq_len)): the optimizer steps of a token budget; one line when it is more
    steps than a run may have."""
    count = token_count(tokens)
    if count is None:
        raise SpecError(f"--tokens {tokens!r} does not parse as a token count: {TOKEN_HELP}")
    steps = math.ceil(count / (global_batch * seq_len))
    if steps > LIMITS["steps"]:
        raise SpecError(f"--tokens {tokens} is {steps:,} steps of {global_batch} x {seq_len} tokens: more than the "
                        f"{LIMITS['steps']:,} steps a run may have")
    return steps


def token_budget_line(train: TrainSpec, *, seq_len: int) -> str | None:
    """`steps 143,052 = ceil(300B tokens / (512 x 4096 tokens per step))`, or None without a token budget."""
    if train.tokens is None:
        return None
    return (f"steps {train.steps:,} = ceil({train.tokens} tokens / ({train.global_batch} x {seq_len} tokens per "
            f"step))")


class AutoInt(click.ParamType):
    """An integer or 'auto' (None: let the planner choose)."""

    name = "auto|N"
    file_kind = "auto_int"

    def convert(self, value, param, ctx):
        if value is None or value == AUTO or isinstance(value, int):
            return None if value == AUTO else value
        return INT.convert(value, param, ctx)


class AutoChoice(click.ParamType):
    """One of `choices` or 'auto'."""

    file_kind = "auto_choice"

    def __init__(self, choices):
        self.choices = tuple(choices)
        self.name = "|".join(("auto", *self.choices))

    def convert(self, value, param, ctx):
        if value is None or value == AUTO:
            return None
        if value not in self.choices:
            self.fail(f"{value!r} is not one of: auto, {', '.join(self.choices)}", param, ctx)
        return value


STRATEGY_KEYS = ("zero", "offload", "offload_params", "nvme_path", "pp", "tp", "sp", "checkpointing", "partition_method",
                 "precision", "micro_batch", "reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold",
                 "max_live_parameters", "max_reuse_distance")


def model_options(f):
    for opt in reversed([
        click.option("--model", help=f"model preset: {', '.join(MODEL_PRESETS)}"),
        click.option("--init-from", metavar="HF_DIR", default=None,
                     help="continue pretraining a Hugging Face GPT2LMHeadModel/LlamaForCausalLM directory: its "
                          "config is the model, its weights step 0 (prepare the data with --tokenizer HF_DIR)"),
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
        click.option("--norm", type=click.Choice(NORMS), default=None, help="layernorm (GPT) or rmsnorm (Llama)"),
        click.option("--mlp", type=click.Choice(MLPS), default=None,
                     help="gelu (GPT) or swiglu (Llama; --ffn is the gate/up width)"),
        click.option("--positions", type=click.Choice(POSITIONS), default=None,
                     help="learned (GPT) or rope (rotary, Llama)"),
        click.option("--rope-theta", type=FLOAT, default=None,
                     help=f"rotary base [{spec_default(ModelSpec, 'rope_theta'):g}; Llama-3 500000]"),
        click.option("--kv-heads", type=INT, default=None,
                     help="key/value heads for grouped-query attention [= heads; 1: multi-query]"),
        click.option("--bias/--no-bias", default=None, help="biases in projections and LayerNorm [GPT: yes]"),
        click.option("--norm-eps", type=FLOAT, default=None,
                     help=f"normalisation epsilon [{spec_default(ModelSpec, 'norm_eps'):g}]"),
    ]):
        f = opt(f)
    return f


def spec_options(f):
    """Model, cluster, training and strategy options shared by plan, gen-config and bench."""
    strategy = {name: spec_default(StrategySpec, name)
                for name in ("nvme_path", "partition_method", "reduce_bucket_size", "prefetch_bucket_size",
                             "param_persistence_threshold", "max_live_parameters", "max_reuse_distance")}
    for opt in reversed([
        click.option("--nodes", type=INT, default=CLI_DEFAULTS["nodes"], show_default=True, help="machines"),
        click.option("--gpus-per-node", type=INT, default=CLI_DEFAULTS["gpus_per_node"], show_default=True,
                     help="ranks per machine"),
        click.option("--gpu", default=CLI_DEFAULTS["gpu"], show_default=True, help=f"GPU type: {names_text()}"),
        click.option("--hostfile", default=None, help="hostfile: sets --nodes/--gpus-per-node (validated)"),
        click.option("--host-memory-gib", type=FLOAT, default=spec_default(ClusterSpec, "host_memory_gib"),
                     help="host RAM per node [default: --gpu's reference RAM per GPU x --gpus-per-node]"),
        click.option("--profile", default=None, metavar="FILE",
                     help="calibration profile from 'dspipe calibrate': its measured compute, bandwidth, latency, "
                          "copy and optimizer rates replace the catalog's (gen-config keeps it in the run directory)"),
        click.option("--intra-node-gbps", type=FLOAT, default=None,
                     help="bandwidth per GPU inside a node, GB/s [the catalog's or the profile's]"),
        click.option("--inter-node-gbps", type=FLOAT, default=None,
                     help="per-GPU share of the network bandwidth across nodes, GB/s [the catalog's]"),
        click.option("--global-batch", type=INT, default=CLI_DEFAULTS["global_batch"], show_default=True,
                     help="sequences per optimizer step"),
        click.option("--micro-batch", type=AutoInt(), default=None, help="sequences per rank per forward [auto]"),
        click.option("--steps", type=INT, default=None,
                     help=f"optimizer steps [default: {CLI_DEFAULTS['steps']}; or from --tokens]"),
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
        click.option("--memory-headroom", type=FLOAT, default=None, metavar="PCT",
                     help=f"GPU memory a plan must leave free, percent [{100 * MEMORY_HEADROOM:g}]"),
        click.option("--tp", type=AutoInt(), default=None,
                     help="tensor-parallel ranks per replica, DeepSpeed AutoTP, inside a node [auto]"),
        click.option("--sp", type=AutoInt(), default=None,
                     help="sequence-parallel ranks per replica, DeepSpeed-Ulysses [auto: 1]"),
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
        click.option("--max-live-parameters", type=INT, default=strategy["max_live_parameters"],
                     help="ZeRO-3: prefetch only while fewer elements are gathered [prefetch bucket + largest tensor]"),
        click.option("--max-reuse-distance", type=INT, default=strategy["max_reuse_distance"],
                     help="ZeRO-3: keep a module gathered if reused within this many elements [prefetch bucket]"),
        click.option("--preset", default=None,
                     help="DeepSpeed JSON to start from: a name from 'dspipe presets' or a .json path. Every key is "
                          "honoured in ds_config.json, or reported (\"auto\" resolved), or refused; a flag that "
                          "contradicts it is an error"),
    ]):
        f = opt(f)
    from dspipe.cli.config_file import config_options  # imports this module

    return config_options(model_options(f))


def cluster_from_options(o: dict) -> ClusterSpec:
    """The cluster: --nodes/--gpus-per-node, or derived from --hostfile (and then checked against them)."""
    from dspipe.cluster.hostfile import read_hostfile

    calibration = _calibration(o)
    if not o.get("hostfile"):
        return ClusterSpec(nodes=o["nodes"], gpus_per_node=o["gpus_per_node"], gpu=o["gpu"],
                           host_memory_gib=o.get("host_memory_gib"), **calibration)
    hostfile = read_hostfile(o["hostfile"])
    derived = {"nodes": len(hostfile.hosts), "gpus_per_node": hostfile.equal_slots()}
    given = _given_on_command_line(o)
    for key, value in derived.items():
        if key in given and o[key] != value:
            raise SpecError(f"--{key.replace('_', '-')} {o[key]} contradicts hostfile {hostfile.source} "
                            f"({derived['nodes']} nodes x {derived['gpus_per_node']} slots); drop one of them")
    return ClusterSpec(nodes=derived["nodes"], gpus_per_node=derived["gpus_per_node"], gpu=o["gpu"],
                       host_memory_gib=o.get("host_memory_gib"), **calibration)


def _calibration(o: dict) -> dict:
    """ClusterSpec's time-model inputs from --profile FILE (read and checked against --gpu) and the bandwidth
    overrides; a bad value is one line naming the flag."""
    from dspipe.spec.profile import read_profile

    for name in ("intra_node_gbps", "inter_node_gbps"):
        value = o.get(name)
        if value is not None and not (math.isfinite(value) and 0 < value <= LIMITS[name]):
            raise SpecError(f"--{name.replace('_', '-')} must be a positive number of GB/s, got {value:g} "
                            f"(allowed: finite, (0, {LIMITS[name]:g}])")
    if o.get("gpu") is not None:
        from dspipe.spec.hardware import gpu_type
        gpu_type(o["gpu"])  # an unknown --gpu is named before its profile is judged
    profile = read_profile(o["profile"], gpu=o.get("gpu")) if o.get("profile") else None
    return dict(intra_node_gbps=o.get("intra_node_gbps"), inter_node_gbps=o.get("inter_node_gbps"), profile=profile)


ARCHITECTURE_KEYS = ("norm", "mlp", "positions", "rope_theta", "kv_heads", "bias", "norm_eps")
"""ModelSpec fields set by --norm --mlp --positions --rope-theta --kv-heads --bias/--no-bias --norm-eps."""


def monitor_options(f):
    """W&B and Comet through DeepSpeed's own monitor config (off unless a project is given)."""
    for opt in reversed([
        click.option("--wandb-project", default=None, help="log to Weights & Biases under this project "
                                                          "(WANDB_MODE=offline: no network, sync later)"),
        click.option("--wandb-group", default=None, help="W&B run group"),
        click.option("--wandb-team", default=None, help="W&B entity (team)"),
        click.option("--comet-project", default=None, help="log to Comet under this project (COMET_API_KEY from the "
                                                          "environment, never written)"),
        click.option("--comet-workspace", default=None, help="Comet workspace"),
        click.option("--comet-experiment", default=None, help="Comet experiment name"),
        click.option("--comet-offline", is_flag=True, default=False, help="Comet offline experiment (no network)"),
    ]):
        f = opt(f)
    return f


def _model_from_options(o: dict) -> ModelSpec:
    shape = dict(layers=o["layers"], hidden=o["hidden"], heads=o["heads"], vocab=o["vocab"], seq_len=o["seq_len"],
                 ffn=o["ffn"], dropout=o["dropout"], tied_embeddings=False if o["untied"] else None,
                 **{k: o.get(k) for k in ARCHITECTURE_KEYS})
    if o["model"]:
        return model_preset(o["model"], **shape)
    missing = [f"--{k}" for k in ("layers", "hidden", "heads", "vocab") if shape[k] is None]
    if missing:
        raise SpecError(f"give --model NAME ({', '.join(MODEL_PRESETS)}) or all of --layers/--hidden/--heads/--vocab "
                        f"(missing {' '.join(missing)})")
    hidden = shape["hidden"]
    given = {k: shape[k] for k in ("dropout", "tied_embeddings", *ARCHITECTURE_KEYS)
             if shape[k] is not None}  # else ModelSpec's default
    return ModelSpec("custom", shape["layers"], hidden, shape["heads"], shape["vocab"],
                     shape["seq_len"] or CLI_DEFAULTS["seq_len"], shape["ffn"] or 4 * hidden, **given)


def _with_padded_vocab(model: ModelSpec, data: str) -> ModelSpec:
    from dspipe.data import META_FILE, padded_vocab, read_meta
    from dspipe.data.blend import parse as parse_data

    data = parse_data(data).sources[0].path  # the sources of a blend share one tokenizer
    vocab = read_meta(data)["vocab_size"] if (Path(data) / META_FILE).is_file() else model.vocab
    return replace(model, vocab=padded_vocab(vocab))


def _given_on_command_line(o: dict) -> set[str]:
    """The options the user set: typed, or set in the --config file to other than their default (a preset value
    or the hostfile may fill the others)."""
    from dspipe.cli.config_file import given

    return given(click.get_current_context(silent=True), o)


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
    pp, tp, sp = o.get("pp") or 1, o.get("tp") or 1, o.get("sp") or 1
    divides = cluster.world_size % (pp * tp * sp) == 0
    if ga is not None and o.get("pp") and o.get("micro_batch") and divides:
        dp = ParallelLayout(world=cluster.world_size, pp=pp, tp=tp, sp=sp).dp
        if o["global_batch"] != o["micro_batch"] * ga * dp:
            raise SpecError(f"preset {imp.source}: train_batch_size {o['global_batch']} != micro "
                            f"{o['micro_batch']} x gradient_accumulation_steps {ga} x dp {dp} (world "
                            f"{cluster.world_size} / (pp {pp} x tp {tp} x sp {sp})) = {o['micro_batch'] * ga * dp}: this cluster needs "
                            f"gradient_accumulation_steps {o['global_batch'] / (o['micro_batch'] * dp):g}; set it "
                            "(or \"auto\") in the preset")
    if ga is not None and divides:  # DeepSpeed derives the missing one of the batch triple
        dp = ParallelLayout(world=cluster.world_size, pp=pp, tp=tp, sp=sp).dp
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
        for axis in ("tp", "sp"):  # a DeepSpeed config without tensor_parallel / sequence_parallel_size runs
            if o.get(axis) is None:  # neither: the preset means 1, not "let the planner choose"
                o = {**o, axis: 1}
        labels = {path: OPTION_FLAGS[name] for path, name in AUTO_OPTIONS.items() if name in given}
        if o.get("tokens") is not None:  # the run length comes from the token budget
            labels.update({path: "--tokens" for path, name in AUTO_OPTIONS.items() if name == "steps"})
        ctx = click.get_current_context(silent=True)
        if ctx is not None:
            ctx.meta[PRESET_META] = (imp, labels)
    fixed = {k: o[k] for k in STRATEGY_KEYS}
    fixed["zero"] = None if fixed["zero"] is None else int(fixed["zero"])
    if o.get("init_from"):  # the model is HF_DIR's (shape flags checked against its config.json)
        from dspipe.cli.init_from import init_from_spec
        model = init_from_spec(o["init_from"], o)
    else:
        model = _model_from_options(o)
    if o.get("pad_vocab"):
        model = _with_padded_vocab(model, o["data"])
    steps, tokens = o["steps"], o.get("tokens")
    if tokens is not None and isinstance(o["global_batch"], int) and o["global_batch"] >= 1:
        derived = steps_for_tokens(tokens, global_batch=o["global_batch"], seq_len=model.seq_len)
        if steps is not None and steps != derived:  # flags and the file were reconciled: this is the --preset's
            raise SpecError(f"--tokens {tokens} is {derived:,} steps of {o['global_batch']} x {model.seq_len} tokens, "
                            f"but the --preset's scheduler total_num_steps is {steps}: drop --tokens or edit the "
                            f"preset")
        steps = derived
    elif steps is None:
        steps = CLI_DEFAULTS["steps"]
    train = TrainSpec(global_batch=o["global_batch"], micro_batch=fixed["micro_batch"] or 1, steps=steps, lr=o["lr"],
                      min_lr_ratio=o["min_lr_ratio"],
                      warmup_steps=o["warmup"] if o["warmup"] is not None else default_warmup(steps),
                      weight_decay=o["weight_decay"], grad_clip=o["grad_clip"],
                      precision=fixed["precision"] or _train("precision"), seed=o["seed"],
                      log_interval=o["log_interval"], save_interval=o["save_interval"],
                      keep_checkpoints=o["keep_checkpoints"], eval_interval=o["eval_interval"],
                      eval_batches=o["eval_batches"], max_skipped_steps=o["max_skipped_steps"],
                      spike_window=o["spike_window"], spike_sigma=o["spike_sigma"],
                      init_from=os.path.abspath(o["init_from"]) if o.get("init_from") else None, tokens=tokens)
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


def preset_report_for(best, *, model: ModelSpec, monitor_dir: str) -> list[str]:
    """preset_report for a search's best candidate (plan: nothing is written)."""
    imp, _ = applied_preset()
    if imp is None:
        return []
    return preset_report(render_ds_config(plan=best.plan, model=model, train=best.train, monitor_dir=monitor_dir,
                                          preset=imp))


def choose(o: dict, *, check_model=None):
    """Search the strategies the options leave open; one-line error when none is valid or none fits."""
    from dspipe.data.blend import blend_option, check_blend_for_run
    from dspipe.planner.search import nothing_fits_message, search

    blend = blend_option(o)  # gen-config --data a:0.7,b:0.3: normalised in o; None for one data directory
    model, cluster, train, fixed = request_from_options(o)
    if blend is not None:  # every source, instead of check_model's one directory
        check_blend_for_run(blend, model_vocab=model.vocab, seq_len=model.seq_len)
    elif check_model:
        check_model(model)
    headroom = o.get("memory_headroom")
    if headroom is not None and not (math.isfinite(headroom) and 0 <= headroom < 100):
        raise SpecError(f"--memory-headroom must be a percentage in [0, 100), got {headroom:g} "
                        f"(allowed: finite, [0, 100))")
    headroom = MEMORY_HEADROOM if headroom is None else headroom / 100
    import_bytes = None
    if o.get("init_from"):  # the start-up reads these bytes instead of drawing (headers only: no tensor is read)
        from dspipe.model.hf_weights import check_weights
        import_bytes = check_weights(o["init_from"], model)
    result = search(model=model, cluster=cluster, train=train, fixed=fixed, headroom=headroom,
                    import_bytes=import_bytes)
    if result.best is None:
        raise SpecError(nothing_fits_message(result=result, model=model, cluster=cluster, train=train, fixed=fixed,
                                             headroom=headroom, import_bytes=import_bytes))
    if blend is not None:
        best = result.best
        if best.train.eval_interval:
            check_blend_for_run(blend, model_vocab=model.vocab, seq_len=model.seq_len, dp=best.plan.dp,
                                micro_batch=best.plan.micro_batch)
        click.echo(f"{blend.describe()} (weights normalised to sum to 100%)")
    return model, cluster, result
