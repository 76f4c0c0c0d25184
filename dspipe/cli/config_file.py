"""`--config FILE.yaml` and `--print-config` for gen-config, plan and bench: every option from a YAML file.

The file has one section per spec, each a mapping of options named as their flags (`--global-batch` is
`train.global_batch`, `--json` is `logging.json`):

    model:    {model: gpt3-1.3b}
    cluster:  {nodes: 2, gpus_per_node: 8, gpu: a100-80g}
    train:    {global_batch: 512, tokens: 300B}
    strategy: {zero: auto, precision: bf16}
    data:     {data: data/stdlib}
    logging:  {log_interval: 10}

SECTIONS (from the option table, dspipe.spec.options.TABLE) says which option lives where; a unit test fails when an
option of gen-config, plan or bench is in no section (or in two). A flag given on the command line overrides the
file's value (the file fills click's default map, so click's own parameter source tells them apart). Every value goes
through the click type of its flag (StrictInt, StrictFloat, AutoInt, AutoChoice, ...), after a strict YAML type check
(an integer must be a YAML integer, not a string or a bool); ranges are the specs' checks, as for flags. A key the
table knows but the command does not have (data.data for plan) is checked and kept, so one file serves plan,
gen-config and bench. Every error is one line naming the file and the key (`config.yaml: strategy.zero: expected
...`), exit code 2, before anything is planned or written. Against a --preset or --hostfile, a file value counts as
given (and must agree with them) only where it differs from the option's default: a printed file states every
default.

`--print-config` writes the options as resolved (file, then flags, then defaults) as such a file, with `auto` and
null where the planner chooses or the value is derived, so that re-running with it reproduces the same choice;
gen-config writes the same text into the run directory as config.yaml. The YAML is read with YAML 1.2 core scalars
(`6e-4` is a number, `no`/`off` are strings, `010` is ten) and duplicate keys are refused.
The YAML dialect: dspipe.cli.yaml_dialect. Imports no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import click
import yaml

from dspipe.cli.yaml_dialect import Dumper, LongInt, read_yaml, shown
from dspipe.errors import SpecError
from dspipe.spec.options import SETTINGS, TABLE
from dspipe.spec.settings import AUTO

SECTIONS: dict[str, tuple[str, ...]] = {section: tuple(s.key for s in body) for section, body in TABLE.items()}
"""Section -> the options it holds, by file key (the flag's long name with '_' for '-'), generated from the option
table (dspipe.spec.options.TABLE: the settings declared on the spec fields, and its EXTRAS). Each option of
CONFIG_COMMANDS is in exactly one section or in COMMAND_LINE_ONLY (tests/unit/cli/test_config_file.py checks)."""

COMMAND_LINE_ONLY = {
    "config": "the file itself",
    "print_config": "what to do with the file",
    "out": "where this invocation writes: the run directory's config.yaml is reused for other directories",
    "force": "whether this invocation may rewrite an existing run directory",
    "measure": "whether this invocation measures the machine it runs on (what it measured is the run's profile)",
}
"""Options a file cannot set, and why: they say what this invocation does, not what the run is."""

CONFIG_COMMANDS = ("gen-config", "plan", "bench")
OWN_MEANING = {"bench": ("steps", "warmup")}
"""Options a command gives its own meaning (bench counts benchmark steps): the file's train.steps/warmup are the
run's, so that command takes them from its flags only (and keeps the file's values when it prints the file)."""

LOADED_META, TEXT_META = "dspipe.config_file", "dspipe.config_text"
"""click context meta keys: the ConfigFile read, and the resolved YAML text (for gen-config's config.yaml)."""
SOURCE = click.core.ParameterSource


def file_key(param: click.Parameter) -> str:
    """The name of an option in the file: its long flag ('--json' -> 'json', '--gpus-per-node' -> 'gpus_per_node')."""
    longs = [o for o in param.opts if o.startswith("--")]
    return longs[0][2:].replace("-", "_") if longs else param.name


SECTION_OF = {key: section for section, keys in SECTIONS.items() for key in keys}


# ---- values ------------------------------------------------------------------------------------------------------


def kind(param: click.Parameter) -> str:
    """What the file holds for `param`: bool, int, float, auto_int, auto_choice, choice, tokens or str (its setting's
    kind in the option table; a flag holds a bool)."""
    k = SETTINGS[file_key(param)].kind
    return "bool" if k == "flag" else k


def _nullable(param: click.Parameter) -> bool:
    """null (= not set: auto or derived) is allowed where the option's default is None."""
    return param.default is None


def _auto(param: click.Parameter) -> bool:
    """Whether None is written `auto` (the planner chooses) rather than null."""
    return kind(param) in ("auto_int", "auto_choice") or (kind(param) == "bool" and _nullable(param))


EXPECTED = {
    "bool": "true or false",
    "int": "an integer",
    "auto_int": "an integer",
    "float": "a number",
    "tokens": "a token count like 300B, 1.5T or 2e9",
    "str": "a string",
}


def expected(param: click.Parameter) -> str:
    """What a value of `param` must be, in words."""
    k = kind(param)
    what = f"one of {', '.join(map(str, param.type.choices))}" if k in ("choice", "auto_choice") else EXPECTED[k]
    if _auto(param):
        return f"auto or {what}"
    return what + (" or null" if _nullable(param) else "")


def _int(value) -> bool:
    """A YAML integer (one too long for int() included: StrictInt names its limit)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or isinstance(value, LongInt)


def convert(param: click.Parameter, value, ctx: click.Context | None):
    """A YAML value for `param`, checked for its YAML type, then converted by the flag's own click type; raises
    click.BadParameter (message without the key) when it is not one."""
    k = kind(param)

    def fail():
        raise click.BadParameter(f"expected {expected(param)}, got {shown(value)}")

    if value is None:
        if _nullable(param):
            return None
        fail()
    if not isinstance(value, (str, int, float, bool)):
        fail()
    if k == "bool":
        if isinstance(value, bool):
            return value
        if value == AUTO and _nullable(param):
            return None
        fail()
    if isinstance(value, bool):
        fail()
    text = isinstance(value, str) and not isinstance(value, LongInt)
    ok = {
        "int": _int(value),
        "auto_int": _int(value) or value == AUTO,
        "float": isinstance(value, (int, float, LongInt)),
        "tokens": True,
        "str": text,
        "choice": text,
        "auto_choice": (str(value) if _int(value) else value) in (AUTO, *getattr(param.type, "choices", ())),
    }
    if not ok[k]:
        fail()
    return param.type.convert(str(value) if k == "auto_choice" else value, None, ctx)


def file_value(param: click.Parameter, value):
    """An option's resolved value as the file writes it: None -> auto for auto options, ZeRO stages as integers."""
    if value is None:
        return AUTO if _auto(param) else None
    if kind(param) == "auto_choice" and isinstance(value, str) and value.isdigit():
        return int(value)
    if isinstance(value, Path):
        return str(value)
    return value


# ---- the file, read into a command's context ---------------------------------------------------------------------


@dataclass
class ConfigFile:
    """A --config file as read for one command."""

    path: str
    values: dict[str, object] = field(default_factory=dict)
    """param name -> converted value, for the command's own options (its default map)."""
    kept: dict[str, object] = field(default_factory=dict)
    """file key -> value as the file writes it, for keys this command does not use (another command's)."""
    keys: set[str] = field(default_factory=set)
    """The file keys the file sets (not null)."""


def command_params(command: click.Command) -> dict[str, click.Parameter]:
    """file key -> option of `command` that a file may set (not COMMAND_LINE_ONLY, not given its own meaning)."""
    own = OWN_MEANING.get(command.name, ())
    return {
        file_key(p): p
        for p in command.params
        if isinstance(p, click.Option)
        and p.name != "help"
        and file_key(p) not in COMMAND_LINE_ONLY
        and file_key(p) not in own
    }


def _sibling_params(ctx: click.Context) -> dict[str, click.Parameter]:
    """file key -> option, over every CONFIG_COMMANDS command of the group (to check keys another command uses)."""
    root = ctx.find_root().command
    out: dict[str, click.Parameter] = {}
    for name in CONFIG_COMMANDS:
        cmd = root.commands.get(name) if isinstance(root, click.Group) else None
        if cmd is not None:
            for key, p in command_params(cmd).items():
                out.setdefault(key, p)
    return out


def load(path: str, ctx: click.Context) -> ConfigFile:
    """Read and check `path` for ctx's command: every section and key known, every value of its option's type."""
    doc = read_yaml(path)
    mine = command_params(ctx.command)
    others = _sibling_params(ctx)
    loaded = ConfigFile(path=path)
    for section, body in doc.items():
        if section not in SECTIONS:
            raise SpecError(f"{path}: unknown section {_key(section)} (the sections: {', '.join(SECTIONS)})")
        if body is None:
            continue  # an empty section (every key commented out)
        if not isinstance(body, dict):
            raise SpecError(f"{path}: {section}: expected a mapping of options, got {shown(body)}")
        for key, value in body.items():
            where = f"{path}: {section}.{key}"
            if not isinstance(key, str) or key not in SECTIONS[section]:
                raise SpecError(f"{path}: {section}.{key}: {_unknown(section, key)}")
            param = mine.get(key) or others.get(key)
            if param is None:  # a key of the table that no command of this group has (a command used alone)
                if not isinstance(value, (str, int, float, bool, type(None))):
                    raise SpecError(f"{where}: expected a single value, got {shown(value)}")
                loaded.kept[key] = value
                continue
            try:
                converted = convert(param, value, ctx)
            except click.BadParameter as e:
                raise SpecError(f"{where}: {e.message}") from None
            if value is not None:
                loaded.keys.add(key)
            if key in mine:
                loaded.values[mine[key].name] = converted
            else:
                loaded.kept[key] = file_value(param, converted)
    if {"steps", "tokens"} <= loaded.keys:
        raise SpecError(f"{path}: train.steps and train.tokens: give one of them (the run's length), not both")
    return loaded


def _key(key) -> str:
    return repr(key) if isinstance(key, str) else f"{shown(key)}"


def _unknown(section: str, key) -> str:
    if isinstance(key, str) and key in SECTION_OF:
        return f"unknown option in {section} ({key} belongs in {SECTION_OF[key]})"
    if isinstance(key, str) and key in COMMAND_LINE_ONLY:
        return f"--{key.replace('_', '-')} is given on the command line only ({COMMAND_LINE_ONLY[key]})"
    return f"unknown option (the {section} options: {', '.join(SECTIONS[section])})"


def _load_callback(ctx: click.Context, param: click.Parameter, value):
    if value is None:
        return None
    if not value.strip():  # Path('') would be '.', this directory
        raise click.BadParameter(f"{value!r} is empty: give a YAML file, or leave the option out", ctx, param)
    loaded = load(value, ctx)
    ctx.default_map = {**(ctx.default_map or {}), **{name: v for name, v in loaded.values.items() if v is not None}}
    ctx.meta[LOADED_META] = loaded
    return value


def given(ctx: click.Context | None, o: dict) -> set[str]:
    """The options of `o` the user set: typed on the command line, or set in the --config file to a value other than
    the option's default (a printed config states every default; those do not override a --preset or --hostfile)."""
    if ctx is None:
        return set()
    params = {p.name: p for p in ctx.command.params}
    out = set()
    for name in o:
        try:
            source = ctx.get_parameter_source(name)
        except KeyError:
            continue
        if source == SOURCE.COMMANDLINE or (
            source == SOURCE.DEFAULT_MAP and name in params and o[name] != params[name].default
        ):
            out.add(name)
    return out


# ---- resolving, printing -----------------------------------------------------------------------------------------


def _run_length(ctx: click.Context, o: dict) -> dict:
    """--steps and --tokens are two ways to give the run's length: both on the command line (or both in the file,
    refused when it was read) is an error; a flag overrides the file's other one."""
    if "tokens" not in o or o.get("tokens") is None or o.get("steps") is None:
        return o
    steps_src, tokens_src = ctx.get_parameter_source("steps"), ctx.get_parameter_source("tokens")
    if steps_src == tokens_src or SOURCE.COMMANDLINE not in (steps_src, tokens_src):
        raise SpecError(
            f"--steps {o['steps']} and --tokens {o['tokens']}: give one of them (the run's length), not both"
        )
    return {**o, "tokens" if steps_src == SOURCE.COMMANDLINE else "steps": None}


def resolved_document(ctx: click.Context, o: dict) -> dict:
    """{section: {key: value}}: every option of the command as resolved, and the file's keys it does not use."""
    mine = command_params(ctx.command)
    loaded: ConfigFile | None = ctx.meta.get(LOADED_META)
    kept = loaded.kept if loaded else {}
    doc: dict[str, dict] = {}
    for section, keys in SECTIONS.items():
        body = {}
        for key in keys:
            if key in mine:
                body[key] = file_value(mine[key], o[mine[key].name])
            elif key in kept:
                body[key] = kept[key]
        if body:
            doc[section] = body
    return doc


def dump(doc: dict, *, command: str) -> str:
    head = (
        f"# dspipe {command}: every option as resolved (--config, then flags, then defaults).\n"
        f"# auto: the planner chooses; null: derived (steps from tokens, else 1000; warmup from steps) or unset.\n"
    )
    return head + yaml.dump(doc, Dumper=Dumper)


def resolved_text() -> str | None:
    """The resolved config of the running command (gen-config writes it as the run's config.yaml)."""
    ctx = click.get_current_context(silent=True)
    return ctx.meta.get(TEXT_META) if ctx is not None else None


def config_options(f, *, check=None):
    """Add --config and --print-config to a command built on spec_options; its callback gets the options resolved
    (file, flags, defaults; --steps/--tokens reconciled). `check(options)`: what --print-config validates first (a
    bad value gets its one-line error instead of a printed file)."""

    @functools.wraps(f)
    def run(**o):
        ctx = click.get_current_context()
        o.pop("config", None)
        print_only = o.pop("print_config", False)
        o = _run_length(ctx, o)
        text = dump(resolved_document(ctx, o), command=ctx.command.name)
        ctx.meta[TEXT_META] = text
        if print_only:
            if check is not None:
                check(o)
            click.echo(text, nl=False)
            return None
        return f(**o)

    run = click.option(
        "--print-config",
        is_flag=True,
        default=False,
        help="print every option as resolved (file, flags, defaults) as a --config file and exit",
    )(run)
    return click.option(
        "--config",
        metavar="FILE.yaml",
        default=None,
        is_eager=True,
        callback=_load_callback,
        help="read options from this YAML file (sections model, cluster, train, strategy, data, "
        "logging); flags given override it",
    )(run)
