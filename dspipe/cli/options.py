"""Options shared by `dspipe plan`, `gen-config` and `bench`, and the request they describe.

The click options are generated from the option table (TABLE): the settings declared on the spec fields
(dspipe.spec.settings, their flag, help, kind, limit and --config section) and EXTRAS, the few options that set no
spec field. A flag whose default is None means auto (the planner chooses) or derived (the rule is in its help text).
Imports no torch/deepspeed.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import NamedTuple

import click

from dspipe.cli.config_file import config_options
from dspipe.digits import MAX_DIGITS, digits_text, too_many_digits
from dspipe.errors import SpecError
from dspipe.jsonio import show
from dspipe.planner.ds_preset import AUTO_OPTIONS, PresetImport, account
from dspipe.planner.memory import MEMORY_HEADROOM
from dspipe.planner.render import import_ds_preset, render_ds_config
from dspipe.planner.search import SearchResult
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.core import LIMITS, SPEC_SETTINGS, StrategyRequest
from dspipe.spec.hardware import names_text
from dspipe.spec.kinds import Offload
from dspipe.spec.layout import ParallelLayout
from dspipe.spec.model import ModelSpec
from dspipe.spec.options import BY_COMMAND, MONITOR, SETTINGS, TABLE
from dspipe.spec.presets import MODEL_PRESETS, model_preset
from dspipe.spec.settings import AUTO, Setting
from dspipe.spec.train import TrainSpec
from dspipe.spec.values import TOKEN_SCALE, steps_of_tokens, token_count
from dspipe.tools.machine import MEASURE_CHOICES

DEFAULT_DATA = "data/stdlib"
"""Prepared token directory of gen-config --data and prepare-data --out."""

WARMUP_FRACTION, WARMUP_MAX = 10, 2000


def default_warmup(steps: int) -> int:
    """--warmup when not given (the rule its help states)."""
    return max(1, min(WARMUP_MAX, steps // WARMUP_FRACTION))


_ASCII_INT = re.compile(r"[+-]?[0-9]+")
_NON_FINITE = re.compile(r"[+-]?(nan|inf|infinity)", re.I)
_ASCII_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


class StrictInt(click.ParamType):
    """An integer written in ASCII digits (Python's int() also reads '\u0663' or fullwidth digits: refused), of at
    most MAX_DIGITS digits. `limit`: the largest the option takes, named when a value has more digits than that."""

    name = "integer"

    def __init__(self, limit: int | None = None):
        self.limit = limit

    def convert(self, value, param, ctx):
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        text = str(value).strip()
        if not _ASCII_INT.fullmatch(text):
            self.fail(f"{show(value)} is not an integer (ASCII digits)", param, ctx)
        if too_many_digits(text) and text.startswith("-"):
            self.fail(f"{digits_text(text)} is negative, out of every allowed range", param, ctx)
        if too_many_digits(text):
            most = f" (at most {self.limit:,})" if self.limit is not None else f" (at most {MAX_DIGITS:,} digits)"
            self.fail(f"{digits_text(text)} is too large{most}", param, ctx)
        return int(text)


class StrictFloat(click.ParamType):
    """A number written in ASCII ('\u0663', fullwidth digits, '1_000' and hex are refused). nan and inf convert, so
    that the spec that owns the field refuses them with its allowed range; -0 is 0.0 (a file never shows -0.0)."""

    name = "float"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, float):
            return None if value is None else value + 0.0
        text = str(value).strip()
        if not (_ASCII_FLOAT.fullmatch(text) or _NON_FINITE.fullmatch(text)):
            self.fail(f"{show(value)} is not a number", param, ctx)
        return float(text) + 0.0


class Text(click.ParamType):
    """A string option's value: an empty (or blank) one is refused rather than read as 'not given'."""

    name = "text"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            leave = ", or leave the option out" if getattr(param, "param_type_name", "") == "option" else ""
            self.fail(f"{value!r} is empty: give a value{leave}", param, ctx)
        return value


class PathText(Text):
    """A path argument: refused when empty (click.Path would read '' as '.', this directory), else a Path."""

    name = "path"

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)
        return Path(value) if isinstance(value, str) else value


INT, FLOAT = StrictInt(), StrictFloat()
TOKEN_HELP = "use a number like 300B, 1.5T or 2e9"


def parse_tokens(text: str | None, *, flag: str) -> float | None:
    """'300B', '1.5T', '2e9', '500M' -> a token count (finite, > 0); None stays None."""
    if text is None:
        return None
    value = token_count(text)
    if value is None:
        raise SpecError(f"{flag} {_token_text(text)} {_token_problem(text)}")
    return value


def _token_text(text: str) -> str:
    return digits_text(text) if len(text) > 40 and text.strip().isdigit() else show(text)


def _token_problem(text: str) -> str:
    """Why `text` is no token count: not positive, beyond a number's range, or not a count at all."""
    t = text.strip().upper()
    number = t[:-1] if t and t[-1] in TOKEN_SCALE else t
    if not _ASCII_FLOAT.fullmatch(number):
        return f"does not parse as a token count: {TOKEN_HELP}"
    if number.startswith("-") or float(number) == 0:
        return f"is not a positive number of tokens: {TOKEN_HELP}"
    return f"is beyond the range of a number (at most {LIMITS['tokens']:.0e} tokens)"


class TokenBudget(click.ParamType):
    """A token budget, kept as written ('300B'; a number from a config file as its digits): the value of
    --tokens. A flag that does not parse is parse_tokens' one-line error."""

    name = "tokens"

    def convert(self, value, param, ctx):
        if value is None:
            return None
        if isinstance(value, bool):
            self.fail(f"{show(value)} is not a token count: {TOKEN_HELP}", param, ctx)
        if isinstance(value, float):
            exact = value.is_integer() and abs(value) < 2**53  # its digits are the value (3e29 as digits is not)
            text = str(int(value)) if exact else repr(value)
        else:
            text = str(value).strip()
        if token_count(text) is None:
            if param is not None:
                parse_tokens(str(value), flag=max(param.opts, key=len))
            self.fail(f"{_token_text(text)} {_token_problem(text)}", param, ctx)
        return text


def tokens_option(help: str):
    """--tokens: the run's length as a token budget (instead of --steps), with the command's own help."""
    return click_option(replace(SETTINGS["tokens"], help=help))


def steps_for_tokens(tokens: str, *, global_batch: int, seq_len: int) -> int:
    """ceil(tokens / (global_batch x seq_len)): the optimizer steps of a token budget; one line when it is more
    steps than a run may have."""
    if token_count(tokens) is None:
        raise SpecError(f"--tokens {show(tokens)} does not parse as a token count: {TOKEN_HELP}")
    steps = steps_of_tokens(tokens, tokens_per_step=global_batch * seq_len)
    if steps > LIMITS["steps"]:
        raise SpecError(
            f"--tokens {tokens} is {steps:,} steps of {global_batch} x {seq_len} tokens: more than the "
            f"{LIMITS['steps']:,} steps a run may have"
        )
    return steps


def token_budget_line(train: TrainSpec, *, seq_len: int) -> str | None:
    """`steps 143,052 = ceil(300B tokens / (512 x 4096 tokens per step))`, or None without a token budget."""
    if train.tokens is None:
        return None
    return f"steps {train.steps:,} = ceil({train.tokens} tokens / ({train.global_batch} x {seq_len} tokens per step))"


class AutoInt(click.ParamType):
    """An integer or 'auto' (None: let the planner choose); `limit` as StrictInt's. `keep_auto`: 'auto' stays the
    string 'auto', for an option whose default is a number (None would read as "not given", i.e. the default)."""

    name = "auto|N"

    def __init__(self, limit: int | None = None, *, keep_auto: bool = False):
        self.integer = StrictInt(limit)
        self.keep_auto = keep_auto

    def convert(self, value, param, ctx):
        if value is None or value == AUTO or isinstance(value, int):
            return (AUTO if self.keep_auto else None) if value == AUTO else value
        return self.integer.convert(value, param, ctx)


class AutoChoice(click.ParamType):
    """One of `choices` or 'auto'."""

    def __init__(self, choices):
        self.choices = tuple(choices)
        self.name = "|".join((AUTO, *self.choices))

    def convert(self, value, param, ctx):
        if value is None or value == AUTO:
            return None
        if value not in self.choices:
            self.fail(f"{show(value)} is not one of: auto, {', '.join(self.choices)}", param, ctx)
        return value


WARMUP_HELP = SETTINGS["warmup"].help


def _help(s: Setting) -> str | None:
    """The setting's help with its {default}, {fallback} and the catalogs' names filled in."""
    if s.help is None:
        return None
    return s.help.format(
        default=s.default,
        fallback=s.fallback,
        presets=", ".join(MODEL_PRESETS),
        gpus=names_text(),
        headroom=100 * MEMORY_HEADROOM,
    )


def click_option(s: Setting):
    """The click option of setting `s`."""
    kw = dict(default=s.cli_default, help=_help(s))
    if s.metavar:
        kw["metavar"] = s.metavar
    if s.kind == "flag":
        kw.update(is_flag=True, default=False)
    elif s.kind != "bool":
        kw["type"] = {
            "int": StrictInt(s.limit),
            "float": FLOAT,
            "str": Text(),
            "tokens": TokenBudget(),
            "auto_int": AutoInt(s.limit, keep_auto=s.cli_default is not None),
            "choice": click.Choice(s.choices),
            "auto_choice": AutoChoice(s.choices),
        }[s.kind]
        kw["show_default"] = s.cli_default is not None
    return click.option(s.flags, **kw)


def _options(f, keys):
    for key in reversed(keys):
        f = click_option(SETTINGS[key])(f)
    return f


def model_options(f):
    """The model section's options (a preset, a Hugging Face directory, or the shape and architecture)."""
    return _options(f, [s.key for s in TABLE["model"] if s.key not in BY_COMMAND])


def spec_options(f):
    """Model, cluster, training and strategy options shared by plan, gen-config and bench (and --config,
    --print-config)."""
    keys = [
        s.key
        for section in ("cluster", "train", "strategy", "logging")
        for s in TABLE[section]
        if s.key not in BY_COMMAND and s.key not in MONITOR
    ]
    return config_options(model_options(_options(f, keys)), check=_check_specs)


def _check_specs(o: dict) -> None:
    """What --print-config checks: the options make valid specs (the command's own one-line errors; no search)."""
    cluster = cluster_from_options(o)
    o, _ = with_preset(o, cluster=cluster)
    request_from_options(o, cluster=cluster)


def cluster_from_options(o: dict) -> ClusterSpec:
    """The cluster: --nodes/--gpus-per-node, or derived from --hostfile (and then checked against them)."""
    from dspipe.cluster.hostfile import read_hostfile

    calibration = _calibration(o)
    if not o.get("hostfile"):
        return ClusterSpec(
            nodes=o["nodes"],
            gpus_per_node=o["gpus_per_node"],
            gpu=o["gpu"],
            host_memory_gib=o.get("host_memory_gib"),
            **_failure_rate(o),
            **calibration,
        )
    hostfile = read_hostfile(o["hostfile"])
    derived = {"nodes": len(hostfile.hosts), "gpus_per_node": hostfile.equal_slots()}
    given = _given_on_command_line(o)
    for key, value in derived.items():
        if key in given and o[key] != value:
            raise SpecError(
                f"--{key.replace('_', '-')} {o[key]} contradicts hostfile {hostfile.source} "
                f"({derived['nodes']} nodes x {derived['gpus_per_node']} slots); drop one of them"
            )
    return ClusterSpec(
        nodes=derived["nodes"],
        gpus_per_node=derived["gpus_per_node"],
        gpu=o["gpu"],
        host_memory_gib=o.get("host_memory_gib"),
        **_failure_rate(o),
        **calibration,
    )


def _failure_rate(o: dict) -> dict:
    """ClusterSpec's gpu_mtbf_hours from --gpu-mtbf-hours (a command without the option: the default); only
    --save-interval auto reads it (the planner's interval and the runner's re-plans)."""
    if o.get("gpu_mtbf_hours") is None:
        return {}
    if o.get("save_interval") != AUTO and "gpu_mtbf_hours" in _given_on_command_line(o):
        raise SpecError(
            f"--gpu-mtbf-hours {o['gpu_mtbf_hours']:g} has no effect without --save-interval auto (the failure "
            f"rate it plans the interval against); give --save-interval auto or leave it out"
        )
    return {"gpu_mtbf_hours": o["gpu_mtbf_hours"]}


def _calibration(o: dict) -> dict:
    """ClusterSpec's time-model inputs from --profile FILE (read and checked against --gpu) and the bandwidth
    overrides; a bad value is one line naming the flag."""
    from dspipe.spec.cluster import MIN_GBPS
    from dspipe.spec.profile import read_profile

    for name in ("intra_node_gbps", "inter_node_gbps"):
        value = o.get(name)
        if value is not None and not (math.isfinite(value) and MIN_GBPS <= value <= LIMITS[name]):
            raise SpecError(
                f"--{name.replace('_', '-')} must be at least {MIN_GBPS:g} GB/s (1 MB/s), got {value:g} "
                f"(allowed: finite, [{MIN_GBPS:g}, {LIMITS[name]:g}])"
            )
    if o.get("gpu") is not None:
        from dspipe.spec.hardware import gpu_type

        gpu_type(o["gpu"])  # an unknown --gpu is named before its profile is judged
    profile = read_profile(o["profile"], gpu=o.get("gpu")) if o.get("profile") else None
    return dict(intra_node_gbps=o.get("intra_node_gbps"), inter_node_gbps=o.get("inter_node_gbps"), profile=profile)


def data_options(f):
    """gen-config's --data-order (the run's training sample order) and --tokenizer (of Megatron prefixes)."""
    return _options(f, ["data_order", "tokenizer"])


def monitor_options(f):
    """W&B and Comet through DeepSpeed's own monitor config (off unless a project is given)."""
    return _options(f, MONITOR)


def _model_from_options(o: dict) -> ModelSpec:
    """The model: the --model preset with the shape and architecture flags given, or a custom shape (the layers,
    hidden, heads and vocab flags required; each other field its fallback or ModelSpec's default)."""
    names = {f.name for f in fields(ModelSpec)} - {"name"}
    shape = {s.field: o.get(s.key) for s in TABLE["model"] if s.field in names}
    shape["tied_embeddings"] = False if o.get("untied") else None
    if o["model"]:
        return model_preset(o["model"], **shape)
    if o.get("pad_vocab") and shape["vocab"] is None:  # a custom shape's vocab is then the data's
        shape["vocab"] = _padded_vocab(o, fallback=None)
    required = ("layers", "hidden", "heads", "vocab")
    missing = [f"--{k}" for k in required if shape[k] is None]
    if missing:
        raise SpecError(
            f"give --model NAME ({', '.join(MODEL_PRESETS)}) or all of --layers/--hidden/--heads/--vocab "
            f"(missing {' '.join(missing)})"
        )
    derived = {"seq_len": SETTINGS["seq_len"].fallback, "ffn": 4 * shape["hidden"]}
    given = {k: v for k, v in shape.items() if v is not None}  # else the fallback, or ModelSpec's default
    return ModelSpec(name="custom", **{**derived, **given})


def _padded_vocab(o: dict, *, fallback: int | None) -> int:
    """--pad-vocab's vocabulary: the largest tokenizer vocab of --data's sources (Megatron prefixes without one: the
    largest id + 1 of them all; a source not prepared: `fallback`, the preset's) and of --tokenizer, rounded up
    (dspipe.data.padded_vocab)."""
    from dspipe.data import padded_vocab, read_meta
    from dspipe.data.blend import parse as parse_data
    from dspipe.data.shards import is_prepared

    vocabs, sources = [], parse_data(o["data"]).sources
    for source in sources:  # the sources of a blend share one tokenizer
        if is_prepared(source.path):
            vocabs.append(read_meta(source.path)["vocab_size"])
        elif fallback is None:
            raise SpecError(
                f"--pad-vocab pads the data's tokenizer vocab, but {source.path} is not prepared (dspipe "
                f"prepare-data): prepare it, or give --vocab without --pad-vocab"
            )
        else:
            vocabs.append(fallback)
    if o.get("tokenizer") is not None:  # Megatron prefixes' --tokenizer: checked against them, its vocab held too
        from dspipe.data.checks import check_tokenizer

        vocabs.append(check_tokenizer([s.path for s in sources], o["tokenizer"]))
    return padded_vocab(max(vocabs))


def _given_on_command_line(o: dict) -> set[str]:
    """The options the user set: typed, or set in the --config file to other than their default (a preset value
    or the hostfile may fill the others)."""
    from dspipe.cli.config_file import given

    return given(click.get_current_context(silent=True), o)


def _normal(name: str, value):
    return int(value) if name == "zero" and value is not None else value


def _flag_text(name: str, value) -> str:
    """A typed option as the user wrote it: '--zero 3', '--offload-params' (a flag), '--no-tp-sp'."""
    flag = SETTINGS[name].flag_name
    if isinstance(value, bool):
        return flag if value else "--no-" + flag.removeprefix("--")
    return f"{flag} {value}"


def _tp_of_the_batch(o: dict, *, ga: int, imp: PresetImport, cluster: ClusterSpec) -> None:
    """A preset whose batch keys are all numbers fixes dp = train_batch_size / (micro x ga); with AutoTP off in it
    (autotp_size 0, as gen-config renders at every tp) and --tp not given, dspipe's tp is what that dp leaves of
    the world (so a run's own ds_config.json is a preset that gives the same run back). Said in a note."""
    per_replica, sp = o["micro_batch"] * ga, o.get("sp") or 1
    if not o.get("global_batch") or o["global_batch"] % per_replica:
        return
    dp = o["global_batch"] // per_replica
    ranks, rest = divmod(cluster.world_size, dp * o["pp"] * sp)
    if rest == 0 and ranks > 1:
        o["tp"] = ranks
        imp.note(
            f"tp {ranks} = world {cluster.world_size} / (dp {dp} x pp {o['pp']} x sp {sp}), dp {dp} = "
            f"train_batch_size {o['global_batch']} / (micro {o['micro_batch']} x gradient_accumulation_steps {ga})"
        )


def _merge_preset(o: dict, imp: PresetImport, given: set[str], cluster: ClusterSpec) -> dict:
    """`o` with the preset's values for the options not typed; a typed flag that contradicts the preset is an error."""
    o = dict(o)
    for name, value in imp.options.items():
        if name in given and o[name] is not None and _normal(name, o[name]) != value:  # None: typed as auto
            raise SpecError(
                f"{_flag_text(name, o[name])} contradicts {imp.shown(name)} in preset {imp.source}; drop the flag "
                "or edit the preset"
            )
        o[name] = value
    if "min_lr_ratio" in given and imp.scheduler_type not in (None, "WarmupCosineLR"):
        raise SpecError(
            f"--min-lr-ratio applies to WarmupCosineLR; preset {imp.source} schedules {imp.scheduler_type}"
            f"; drop the flag or edit the preset"
        )
    if o.get("wall_clock_breakdown") and imp.values.get("wall_clock_breakdown") is False:
        raise SpecError(
            f"--wall-clock-breakdown contradicts wall_clock_breakdown false in preset {imp.source}; "
            "drop the flag or edit the preset"
        )
    ga = imp.grad_accum
    if ga is not None and o.get("tp") is None and o.get("pp") and o.get("micro_batch"):
        _tp_of_the_batch(o, ga=ga, imp=imp, cluster=cluster)
    pp, tp, sp = o.get("pp") or 1, o.get("tp") or 1, o.get("sp") or 1
    divides = cluster.world_size % (pp * tp * sp) == 0
    if ga is not None and o.get("pp") and o.get("micro_batch") and divides:
        dp = ParallelLayout(world=cluster.world_size, pp=pp, tp=tp, sp=sp).dp
        if o["global_batch"] != o["micro_batch"] * ga * dp:
            raise SpecError(
                f"preset {imp.source}: train_batch_size {o['global_batch']} != micro "
                f"{o['micro_batch']} x gradient_accumulation_steps {ga} x dp {dp} (world "
                f"{cluster.world_size} / (pp {pp} x tp {tp} x sp {sp})) = {o['micro_batch'] * ga * dp}: "
                "this cluster needs "
                f"gradient_accumulation_steps {o['global_batch'] / (o['micro_batch'] * dp):g}; set it "
                '(or "auto") in the preset'
            )
    if ga is not None and divides:  # DeepSpeed derives the missing one of the batch triple
        dp = ParallelLayout(world=cluster.world_size, pp=pp, tp=tp, sp=sp).dp
        if "global_batch" not in imp.options and "global_batch" not in given and o.get("micro_batch"):
            o["global_batch"] = o["micro_batch"] * ga * dp
            imp.note(
                f"train_batch_size not set -> {o['global_batch']} = micro {o['micro_batch']} x ga {ga} x dp {dp} "
                "(as DeepSpeed derives it)"
            )
        elif not o.get("micro_batch") and o["global_batch"] % (ga * dp) == 0:
            o["micro_batch"] = o["global_batch"] // (ga * dp)
            imp.note(
                f"train_micro_batch_size_per_gpu not set -> {o['micro_batch']} = global {o['global_batch']} / "
                f"(ga {ga} x dp {dp}) (as DeepSpeed derives it)"
            )
    return o


@dataclass(frozen=True)
class AppliedPreset:
    """The --preset in effect: its import, and the flag that set each of its "auto" keys a typed option settled."""

    imp: PresetImport
    labels: dict[str, str]

    def report(self, ds_config: dict) -> list[str]:
        """What became of the preset's keys in `ds_config` (rendered with it): report lines; SpecError when the plan
        contradicts one of them."""
        from dspipe.planner.render import preset_names

        return account(self.imp, ds_config, given=self.labels, shipped=self.imp.source in preset_names())

    def report_for(self, best, *, model: ModelSpec, monitor_dir: str) -> list[str]:
        """report() for a search's best candidate (plan: nothing is written)."""
        return self.report(
            render_ds_config(plan=best.plan, model=model, train=best.train, monitor_dir=monitor_dir, preset=self.imp)
        )


def with_preset(o: dict, *, cluster: ClusterSpec) -> tuple[dict, AppliedPreset | None]:
    """`o` with the --preset's values for the options not typed (a typed flag that contradicts it is an error), and
    the preset applied; (o, None) without --preset."""
    if o.get("preset") is None:
        return o, None
    imp = import_ds_preset(o["preset"])
    given = _given_on_command_line(o)
    o = _merge_preset(o, imp, given, cluster)
    for axis in ("tp", "sp"):  # a DeepSpeed config without tensor_parallel / sequence_parallel_size runs
        if o.get(axis) is None:  # neither: the preset means 1, not "let the planner choose"
            o = {**o, axis: 1}
    labels = {path: SETTINGS[name].flag_name for path, name in AUTO_OPTIONS.items() if name in given}
    if o.get("tokens") is not None:  # the run length comes from the token budget
        labels.update({path: "--tokens" for path, name in AUTO_OPTIONS.items() if name == "steps"})
    return o, AppliedPreset(imp=imp, labels=labels)


def request_from_options(
    o: dict, *, cluster: ClusterSpec | None = None
) -> tuple[ModelSpec, ClusterSpec, TrainSpec, StrategyRequest]:
    """(model, cluster, train, the strategy asked for): a flag given, else (after with_preset) the --preset's value,
    else auto (None) or the option's default. `cluster`: cluster_from_options(o) when already built."""
    cluster = cluster or cluster_from_options(o)  # --nodes/--gpus-per-node, or from --hostfile
    asked = {f.name: o.get(f.name) for f in fields(StrategyRequest)}
    request = StrategyRequest(**{**asked, "zero": None if asked["zero"] is None else int(asked["zero"])})
    if o.get("init_from"):  # the model is HF_DIR's (shape flags checked against its config.json)
        from dspipe.cli.init_from import init_from_spec

        model = init_from_spec(o["init_from"], o)
    else:
        model = _model_from_options(o)
    if o.get("pad_vocab"):  # the data's vocab, padded: a --vocab must be that number
        vocab = _padded_vocab(o, fallback=model.vocab)
        if o.get("vocab") is not None and o["vocab"] != vocab:
            raise SpecError(f"--vocab {o['vocab']} contradicts --pad-vocab, which makes it {vocab}; drop one of them")
        model = replace(model, vocab=vocab)
    blocks = request.recompute_blocks
    if isinstance(blocks, int) and blocks > model.layers:
        raise SpecError(
            f"--recompute-blocks {blocks} is more than the model's {model.layers} layers (it is how many of each "
            f"stage's blocks full recomputation re-runs; 0 or --checkpointing full alone: all of them)"
        )
    steps, tokens = o["steps"], o.get("tokens")
    if tokens is not None and isinstance(o["global_batch"], int) and o["global_batch"] >= 1:
        derived = steps_for_tokens(tokens, global_batch=o["global_batch"], seq_len=model.seq_len)
        if steps is not None and steps != derived:  # flags and the file were reconciled: this is the --preset's
            raise SpecError(
                f"--tokens {tokens} is {derived:,} steps of {o['global_batch']} x {model.seq_len} tokens, "
                f"but the --preset's scheduler total_num_steps is {steps}: drop --tokens or edit the "
                f"preset"
            )
        steps = derived
    elif steps is None:
        steps = SETTINGS["steps"].fallback
    if o["warmup"] is None and isinstance(steps, int) and steps == 1:  # the derived warmup has no room
        where = f" (--tokens {o['tokens']})" if tokens is not None else ""
        raise SpecError(
            f"steps 1{where} leaves no room for the lr warmup (at least 1 step, ending before the last): a run "
            f"needs steps >= 2"
        )
    auto_save = o.get("save_interval") == AUTO  # chosen after the search, from the plan (gen-config)
    if auto_save and o.get("keep_every"):
        raise SpecError(
            f"--save-interval auto with --keep-every {o['keep_every']}: milestones need a fixed interval "
            f"(they are kept at multiples of it); give --save-interval N"
        )
    derived = {
        "micro_batch": request.micro_batch or 1,
        "precision": request.precision or TrainSpec.precision,
        **({"save_interval": 0} if auto_save else {}),
        "steps": steps,
        "tokens": tokens,
        "warmup_steps": o["warmup"] if o["warmup"] is not None else default_warmup(steps),
        "init_from": os.path.abspath(o["init_from"]) if o.get("init_from") else None,
    }
    given = {
        s.field: o[s.key]
        for s in SPEC_SETTINGS
        if s.field in TRAIN_FIELDS and s.field not in derived and (s.key in o or s.key not in BY_COMMAND)
    }  # a command's own option (gen-config's --data-order)
    return model, cluster, TrainSpec(**given, **derived), request


TRAIN_FIELDS = frozenset(f.name for f in fields(TrainSpec))


class Chosen(NamedTuple):
    """What choose() found: the model and cluster asked for, the search's result, and the --preset applied."""

    model: ModelSpec
    cluster: ClusterSpec
    result: SearchResult
    preset: AppliedPreset | None


def measure_option(f):
    """plan's and gen-config's --measure: whether this machine is measured for a plan of it (dspipe.tools.machine)."""
    return click.option(
        "--measure",
        type=click.Choice(MEASURE_CHOICES),
        default=None,
        help="measure this machine at the model's shapes (seconds, cached) when the plan is for it and no --profile "
        "is given: auto; always (or fail); never (the catalog's figures) [auto; $DSPIPE_MEASURE]",
    )(f)


def _measured(o: dict, *, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, request) -> ClusterSpec:
    """The cluster with this machine's quick measurement as its profile, where --measure (or $DSPIPE_MEASURE; auto)
    asks for it and no --profile is given."""
    mode = o.get("measure") or os.environ.get("DSPIPE_MEASURE") or "auto"
    if mode not in MEASURE_CHOICES:
        raise SpecError(f"$DSPIPE_MEASURE must be one of {', '.join(MEASURE_CHOICES)}, got {mode!r}")
    if cluster.profile is not None or mode == "never":
        return cluster
    from dspipe.tools.machine import here, machine_profile, too_big

    if not here(cluster.gpu):
        if mode == "always":
            raise SpecError(
                f"--measure always: this machine has no {cluster.gpu} GPU to measure; plan on one, or give --profile"
            )
        return cluster
    skip = too_big(gpu=cluster.gpu, model=model, micro_batch=request.micro_batch)
    if skip is not None and mode == "auto":
        click.echo(skip, err=True)
        return cluster
    profile = machine_profile(
        gpu=cluster.gpu,
        model=model,
        precision=train.precision,
        micro_batch=request.micro_batch,
        ranks=cluster.gpus_per_node,
        say=lambda line: click.echo(line, err=True),
    )
    return replace(cluster, profile=profile)


def _with_ops(result, *, cluster: ClusterSpec):
    """The search's result with its best plan's JIT term for the ops this machine's extension cache lacks."""
    from dspipe.cluster.opcache import missing_ops, ops_needed

    best = result.best
    if best is None or best.est.first_step is None:
        return result
    offload = best.plan.offload != Offload.NONE
    needed = ops_needed(backend=cluster.gpu_type.backend, offload=offload, ranks=cluster.world_size)
    est = best.est.with_ops(missing_ops(needed), gpu=cluster.gpu_type)
    best = replace(best, est=est)
    return replace(result, best=best, ranked=[best if c is result.best else c for c in result.ranked])


def choose(o: dict, *, check_model=None) -> Chosen:
    """Search the strategies the options leave open; one-line error when none is valid or none fits."""
    from dspipe.data.blend import blend_option, check_blend_for_run
    from dspipe.planner.search import nothing_fits_message, search

    blend = blend_option(o)  # gen-config --data a:0.7,b:0.3: normalised in o; None for one data directory
    cluster = cluster_from_options(o)  # --nodes/--gpus-per-node, or from --hostfile
    o, preset = with_preset(o, cluster=cluster)
    model, cluster, train, request = request_from_options(o, cluster=cluster)
    cluster = _measured(o, model=model, cluster=cluster, train=train, request=request)
    if blend is not None:  # every source, instead of check_model's one directory
        check_blend_for_run(blend, model_vocab=model.vocab, seq_len=model.seq_len)
    elif check_model:
        check_model(model)
    headroom = o.get("memory_headroom")
    if headroom is not None and not (math.isfinite(headroom) and 0 <= headroom < 100):
        raise SpecError(
            f"--memory-headroom must be a percentage in [0, 100), got {headroom:g} (allowed: finite, [0, 100))"
        )
    headroom = MEMORY_HEADROOM if headroom is None else headroom / 100
    import_bytes = None
    if o.get("init_from"):  # the start-up reads these bytes instead of drawing (headers only: no tensor is read)
        from dspipe.model.hf_weights import check_weights

        import_bytes = check_weights(o["init_from"], model)
    result = search(
        model=model, cluster=cluster, train=train, request=request, headroom=headroom, import_bytes=import_bytes
    )
    if result.best is None:
        raise SpecError(
            nothing_fits_message(
                result=result,
                model=model,
                cluster=cluster,
                train=train,
                request=request,
                headroom=headroom,
                import_bytes=import_bytes,
            )
        )
    result = _with_ops(result, cluster=cluster)
    if blend is not None:
        best = result.best
        if best.train.eval_interval:
            check_blend_for_run(
                blend,
                model_vocab=model.vocab,
                seq_len=model.seq_len,
                dp=best.plan.dp,
                micro_batch=best.plan.micro_batch,
            )
        click.echo(f"{blend.describe()} (weights normalised to sum to 100%)")
    return Chosen(model=model, cluster=cluster, result=result, preset=preset)
