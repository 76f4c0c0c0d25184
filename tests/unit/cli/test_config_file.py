"""`--config FILE.yaml` and `--print-config` (dspipe/cli/config_file.py): every option of gen-config, plan and bench in
one table of sections; flags override the file; the printed (and written) config reproduces the run; each kind of
bad file is one line naming the file and the key, exit code 2, nothing written; the shipped examples plan."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
import yaml

from dspipe.cli import app, config_file, yaml_dialect
from dspipe.cli.bench import BENCH_OPTIONS
from dspipe.cli.config_file import COMMAND_LINE_ONLY, CONFIG_COMMANDS, OWN_MEANING, SECTIONS, file_key
from dspipe.spec.presets import MODEL_PRESETS
from tests.helpers import ROOT, run_cli

CPU2 = ["--model", "tiny", "--gpu", "cpu", "--gpus-per-node", "2", "--global-batch", "16", "--micro-batch", "4"]
EXAMPLES = sorted((ROOT / "examples" / "configs").glob("*.yaml"))


def unplaced(commands) -> list[str]:
    """'command --flag: why' for every option of `commands` that is in no section, in two, or in a section while
    also command-line only."""
    problems = []
    for cmd in commands:
        for p in cmd.params:
            if not isinstance(p, click.Option) or p.name == "help":
                continue
            key = file_key(p)
            homes = [s for s, keys in SECTIONS.items() if key in keys]
            if key in COMMAND_LINE_ONLY:
                if homes:
                    problems.append(f"{cmd.name} {p.opts[0]}: command-line only and in {homes}")
            elif len(homes) != 1:
                problems.append(
                    f"{cmd.name} {p.opts[0]}: in {len(homes)} sections {homes}; add it to one of config_file.SECTIONS"
                )
    return problems


def _commands():
    return [app.cli.commands[name] for name in CONFIG_COMMANDS]


# ---- the table ---------------------------------------------------------------------------------------------------


def test_every_option_of_gen_config_plan_and_bench_is_in_exactly_one_section():
    assert unplaced(_commands()) == []
    known = {file_key(p) for cmd in _commands() for p in cmd.params if isinstance(p, click.Option)}
    stale = [key for keys in SECTIONS.values() for key in keys if key not in known]
    assert stale == [], f"SECTIONS names options no command has: {stale}"
    assert set(COMMAND_LINE_ONLY) <= known
    assert OWN_MEANING["bench"] == tuple(BENCH_OPTIONS)  # bench's --steps/--warmup count benchmark steps


def test_a_new_option_in_no_section_fails_the_check():
    cmd = app.cli.commands["gen-config"]
    extended = click.Command(cmd.name, params=[*cmd.params, click.Option(["--new-knob"], type=int)])
    assert unplaced([extended]) == ["gen-config --new-knob: in 0 sections []; add it to one of config_file.SECTIONS"]


def test_every_option_is_declared_once_in_the_option_table():
    """Each option of gen-config, plan and bench is a setting of the option table (declared on its spec field, or
    one of its EXTRAS) or command-line only; a generated option's flag, help, default and type are its setting's."""
    from dspipe.cli.options import click_option
    from dspipe.spec.options import BY_COMMAND, SETTINGS

    undeclared, differs = [], []
    for cmd in _commands():
        for p in cmd.params:
            if not isinstance(p, click.Option) or p.name == "help":
                continue
            key = file_key(p)
            if key not in SETTINGS and key not in COMMAND_LINE_ONLY:
                undeclared.append(f"{cmd.name} {p.opts[0]}")
            if key in SETTINGS and key not in BY_COMMAND and key not in OWN_MEANING.get(cmd.name, ()):
                made = click_option(SETTINGS[key])(lambda **o: None).__click_params__[0]
                same = (made.opts, made.secondary_opts, made.help, made.default, type(made.type), made.is_flag)
                if same != (p.opts, p.secondary_opts, p.help, p.default, type(p.type), p.is_flag):
                    differs.append(f"{cmd.name} {p.opts[0]}")
    assert undeclared == [] and differs == []
    assert SECTIONS == {section: tuple(s.key for s in body) for section, body in config_file.TABLE.items()}


# ---- round trip --------------------------------------------------------------------------------------------------


def _leaves(d, prefix=""):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], d


def _diff(a: dict, b: dict) -> dict:
    x, y = dict(_leaves(a)), dict(_leaves(b))
    return {k: (x.get(k), y.get(k)) for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)}


FLAGS = [
    *CPU2,
    "--tokens",
    "1M",
    "--lr",
    "3e-4",
    "--zero",
    "2",
    "--log-interval",
    "5",
    "--eval-interval",
    "0",
    "--save-interval",
    "50",
    "--seed",
    "7",
]


def test_gen_config_from_the_printed_config_reproduces_the_run(tmp_path, capsys, monkeypatch, corpus):
    monkeypatch.chdir(tmp_path)
    assert run_cli("gen-config", *FLAGS, "--data", corpus, "--out", "runs/a", "--print-config") == 0
    printed = capsys.readouterr().out
    assert not (tmp_path / "runs").exists()  # --print-config plans and writes nothing
    (tmp_path / "my.yaml").write_text(printed)
    doc = yaml.safe_load(printed)
    assert list(doc) == ["model", "cluster", "train", "strategy", "data", "logging"]
    assert doc["train"]["tokens"] == "1M" and doc["train"]["steps"] is None and doc["train"]["warmup"] is None
    assert doc["strategy"]["zero"] == 2 and doc["strategy"]["micro_batch"] == 4
    assert doc["strategy"]["pp"] == "auto" and doc["strategy"]["offload_params"] == "auto"  # left auto: kept auto
    assert doc["data"] == {"data": str(corpus), "data_order": "dspipe", "tokenizer": None}
    assert doc["train"]["lr"] == 3e-4

    assert run_cli("gen-config", *FLAGS, "--data", corpus, "--out", "runs/a") == 0
    capsys.readouterr()
    a = tmp_path / "runs/a"
    assert sorted(p.name for p in a.iterdir()) == ["config.yaml", "ds_config.json", "dspipe.json"]
    assert (a / "config.yaml").read_text() == printed

    # another directory: the same run but for the paths that name it
    assert run_cli("gen-config", "--config", "my.yaml", "--out", "runs/b") == 0
    out = capsys.readouterr().out
    b = tmp_path / "runs/b"
    ds_a, ds_b = (json.loads((d / "ds_config.json").read_text()) for d in (a, b))
    assert _diff(ds_a, ds_b) == {
        "tensorboard.output_path": ("runs/a/monitor", "runs/b/monitor"),
        "csv_monitor.output_path": ("runs/a/monitor", "runs/b/monitor"),
    }
    spec_a, spec_b = (json.loads((d / "dspipe.json").read_text()) for d in (a, b))
    assert _diff(spec_a, spec_b) == {"command": (spec_a["command"], spec_a["command"].replace("runs/a", "runs/b"))}
    assert (b / "config.yaml").read_text() == printed
    assert "steps 977 = ceil(1M tokens / (16 x 64 tokens per step))" in out

    # the same --out from another working directory: ds_config.json byte for byte
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)
    assert run_cli("gen-config", "--config", tmp_path / "runs/a/config.yaml", "--out", "runs/a") == 0
    assert (other / "runs/a/ds_config.json").read_bytes() == (a / "ds_config.json").read_bytes()
    spec_c = json.loads((other / "runs/a/dspipe.json").read_text())
    assert _diff(spec_a, spec_c) == {
        "command": (spec_a["command"], spec_a["command"].replace(str(tmp_path), str(other)))
    }
    assert (other / "runs/a/config.yaml").read_text() == printed


def test_force_rewrites_config_yaml_with_the_other_config_files(tmp_path, capsys, monkeypatch):
    from dspipe.rundir import load_run

    monkeypatch.chdir(tmp_path)
    assert run_cli("gen-config", *CPU2, "--steps", "20", "--out", "run") == 0
    (tmp_path / "run/metrics.csv").write_text("step,tokens,loss\n1,1024,8.3\n")
    assert run_cli("gen-config", *CPU2, "--steps", "30", "--out", "run", "--force") == 0
    capsys.readouterr()
    assert yaml.safe_load((tmp_path / "run/config.yaml").read_text())["train"]["steps"] == 30
    assert (tmp_path / "run/metrics.csv").read_text() == "step,tokens,loss\n1,1024,8.3\n"
    assert load_run(tmp_path / "run").train.steps == 30
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if not p.name.startswith(".")) == [
        "config.yaml",
        "ds_config.json",
        "dspipe.json",
        "metrics.csv",
    ]


def test_a_preset_run_round_trips(tmp_path, capsys, monkeypatch):
    """A printed file states every default; those do not override the --preset's values (else they would
    contradict it on the way back)."""
    monkeypatch.chdir(tmp_path)
    flags = ["--model", "gpt2-124m", "--gpu", "h100-80g", "--preset", "zero2-bf16", "--data", "d"]
    assert run_cli("gen-config", *flags, "--out", "runs/a") == 0
    assert run_cli("gen-config", "--config", "runs/a/config.yaml", "--out", "runs/a2") == 0
    assert run_cli("gen-config", *flags, "--out", "runs/b", "--print-config") == 0
    text = capsys.readouterr().out
    assert "preset: zero2-bf16" in text and "global_batch: 256" in text  # the option's default, printed
    ds = [json.loads((tmp_path / d / "ds_config.json").read_text()) for d in ("runs/a", "runs/a2")]
    assert set(_diff(*ds)) == {"tensorboard.output_path", "csv_monitor.output_path"}


def test_a_hostfile_run_round_trips(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts").write_text("node1 slots=4\nnode2 slots=4\n")
    assert (
        run_cli(
            "gen-config",
            "--model",
            "gpt2-124m",
            "--gpu",
            "a100-80g",
            "--hostfile",
            "hosts",
            "--zero",
            "1",
            "--data",
            "d",
            "--out",
            "a",
        )
        == 0
    )
    assert run_cli("gen-config", "--config", "a/config.yaml", "--out", "b") == 0
    capsys.readouterr()
    specs = [json.loads((tmp_path / d / "dspipe.json").read_text()) for d in "ab"]
    assert specs[0]["cluster"] == specs[1]["cluster"] and specs[1]["cluster"]["nodes"] == 2
    assert specs[0]["plan"] == specs[1]["plan"]


# ---- overrides ---------------------------------------------------------------------------------------------------

BASE = """model:
  model: tiny
cluster:
  gpu: cpu
  gpus_per_node: 2
train:
  global_batch: 16
  steps: 20
  lr: 6e-4
strategy:
  micro_batch: 4
  zero: 1
"""


def _spec(path: Path) -> dict:
    return json.loads((path / "dspipe.json").read_text())


def test_flags_override_the_file_and_the_rest_comes_from_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(BASE)
    assert run_cli("gen-config", "--config", "c.yaml", "--out", "file") == 0
    assert (
        run_cli(
            "gen-config", "--config", "c.yaml", "--global-batch", "32", "--zero", "2", "--lr", "1e-3", "--out", "flags"
        )
        == 0
    )
    capsys.readouterr()
    f, g = _spec(tmp_path / "file"), _spec(tmp_path / "flags")
    assert (f["train"]["global_batch"], f["plan"]["zero_stage"], f["train"]["lr"]) == (16, 1, 6e-4)
    assert (g["train"]["global_batch"], g["plan"]["zero_stage"], g["train"]["lr"]) == (32, 2, 1e-3)
    assert f["train"]["steps"] == g["train"]["steps"] == 20 and g["plan"]["micro_batch"] == 4
    printed = yaml.safe_load((tmp_path / "flags/config.yaml").read_text())
    assert printed["train"]["global_batch"] == 32 and printed["strategy"]["zero"] == 2


def test_a_flag_replaces_the_files_other_run_length(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "steps.yaml").write_text(BASE)
    (tmp_path / "tokens.yaml").write_text(BASE.replace("  steps: 20\n", "  tokens: 20K\n"))
    assert run_cli("gen-config", "--config", "steps.yaml", "--tokens", "1M", "--out", "a") == 0
    assert run_cli("gen-config", "--config", "tokens.yaml", "--steps", "7", "--out", "b") == 0
    assert run_cli("gen-config", "--config", "tokens.yaml", "--out", "c") == 0
    capsys.readouterr()
    assert (_spec(tmp_path / "a")["train"]["steps"], _spec(tmp_path / "a")["train"]["tokens"]) == (977, "1M")
    assert (_spec(tmp_path / "b")["train"]["steps"], _spec(tmp_path / "b")["train"]["tokens"]) == (7, None)
    assert (_spec(tmp_path / "c")["train"]["steps"], _spec(tmp_path / "c")["train"]["tokens"]) == (20, "20K")


def test_one_file_serves_plan_gen_config_and_bench(tmp_path, capsys, monkeypatch):
    """A key another command uses (data.data, logging.compare) is checked and kept; bench keeps the file's
    train.steps (the run's) and counts its own benchmark steps."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(BASE + "data:\n  data: data/web\nlogging:\n  compare: true\n  json: true\n")
    assert run_cli("plan", "--config", "c.yaml") == 0
    assert json.loads(capsys.readouterr().out)["zero_stage"] == 1  # logging.json: true
    assert run_cli("plan", "--config", "c.yaml", "--print-config") == 0
    plan_doc = yaml.safe_load(capsys.readouterr().out)
    assert plan_doc["data"] == {"data": "data/web"} and plan_doc["logging"]["compare"] is True
    assert run_cli("bench", "--config", "c.yaml", "--print-config", "--steps", "5") == 0
    bench_doc = yaml.safe_load(capsys.readouterr().out)
    assert bench_doc["train"]["steps"] == 20 and "warmup" not in bench_doc["train"]
    assert bench_doc["logging"]["compare"] is True and bench_doc["logging"]["json"] is True
    assert list(tmp_path.iterdir()) == [tmp_path / "c.yaml"]


def test_yaml_1_2_scalars(tmp_path, capsys, monkeypatch):
    """6e-4 is a number (YAML 1.1 reads a string), no is a string (not false), 010 refused (YAML 1.1: octal 8,
    YAML 1.2: ten)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(BASE.replace("  steps: 20\n", "  steps: 10\n") + "data:\n  data: no\n")
    assert run_cli("gen-config", "--config", "c.yaml", "--out", "r", "--print-config") == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["train"]["lr"] == 6e-4 and doc["train"]["steps"] == 10 and doc["data"]["data"] == "no"
    for octal in ("010", "-07", "+00"):
        (tmp_path / "c.yaml").write_text(BASE.replace("  steps: 20\n", f"  steps: {octal}\n"))
        assert run_cli("gen-config", "--config", "c.yaml", "--out", "r") == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"dspipe: error: c.yaml: not valid YAML: {octal} has a leading zero: YAML 1.1 readers (PyYAML) take it "
            "as octal, YAML 1.2 as decimal; write it without the zero (line 8, column 10)"
        ], err
    assert not (tmp_path / "r").exists()


# ---- errors: one line, exit 2, nothing written -------------------------------------------------------------------

BAD_FILES = {
    "unknown section": (
        "foo:\n  x: 1\n",
        "unknown section 'foo' (the sections: model, cluster, train, strategy, data, logging)",
    ),
    "unknown key": (
        "strategy:\n  zeroo: 1\n",
        "strategy.zeroo: unknown option (the strategy options: micro_batch, zero, offload, "
        "offload_params, nvme_path, precision, pp, tp, tp_sp, immediate_grad_update, sp, ep, checkpointing, "
        "recompute_blocks, loss_chunk, "
        "partition_method, reduce_bucket_size, prefetch_bucket_size, param_persistence_threshold, "
        "max_live_parameters, max_reuse_distance, preset, memory_headroom)",
    ),
    "key in another section": (
        "strategy:\n  steps: 5\n",
        "strategy.steps: unknown option in strategy (steps belongs in train)",
    ),
    "command-line only": (
        "logging:\n  force: true\n",
        "logging.force: --force is given on the command line only "
        "(whether this invocation may rewrite an existing run "
        "directory)",
    ),
    "string for an int": ('train:\n  steps: "20"\n', "train.steps: expected an integer or null, got '20' (a string)"),
    "bool for an int": ("cluster:\n  nodes: true\n", "cluster.nodes: expected an integer, got true"),
    "float for an int": ("train:\n  global_batch: 16.0\n", "train.global_batch: expected an integer, got 16.0"),
    "list for an int": ("train:\n  seed: [1, 2]\n", "train.seed: expected an integer, got a list"),
    "null not allowed": ("train:\n  lr:\n", "train.lr: expected a number, got null"),
    "string for a number": ("train:\n  lr: fast\n", "train.lr: expected a number, got 'fast' (a string)"),
    "bool for a stage": ("strategy:\n  zero: true\n", "strategy.zero: expected auto or one of 0, 1, 2, 3, got true"),
    "stage out of range": ("strategy:\n  zero: 4\n", "strategy.zero: expected auto or one of 0, 1, 2, 3, got 4"),
    "bad choice": (
        "strategy:\n  offload: disk\n",
        "strategy.offload: expected auto or one of none, cpu, nvme, got 'disk' (a string)",
    ),
    "string for a flag": ("model:\n  untied: 'yes'\n", "model.untied: expected true or false, got 'yes' (a string)"),
    "int for a string": ("cluster:\n  gpu: 100\n", "cluster.gpu: expected a string, got 100"),
    "mapping for a string": ("data:\n  data: {a: 0.7}\n", "data.data: expected a string, got a mapping"),
    "bad auto int": ("strategy:\n  pp: two\n", "strategy.pp: expected auto or an integer, got 'two' (a string)"),
    "bad token budget": (
        "train:\n  tokens: lots\n",
        "train.tokens: 'lots' does not parse as a token count: use a number like 300B, 1.5T or 2e9",
    ),
    "steps and tokens": (
        "train:\n  steps: 5\n  tokens: 1M\n",
        "train.steps and train.tokens: give one of them (the run's length), not both",
    ),
    "section not a mapping": ("train: 5\n", "train: expected a mapping of options, got 5"),
    "not a mapping": (
        "- model: tiny\n",
        "expected a mapping of sections (model, cluster, train, strategy, data, logging), got a list",
    ),
    "a scalar": (
        "tiny\n",
        "expected a mapping of sections (model, cluster, train, strategy, data, logging), got 'tiny' (a string)",
    ),
    "empty": (
        "",
        "expected a mapping of sections (model, cluster, train, strategy, data, logging), got null (an empty file)",
    ),
    "duplicate key": (
        "train:\n  steps: 5\n  lr: 1e-4\n  steps: 6\n",
        "train.steps: duplicate key (line 4; first on line 2)",
    ),
    "duplicate section": (
        "train:\n  steps: 5\ntrain:\n  lr: 1e-4\n",
        "train: duplicate section (line 3; first on line 1)",
    ),
    "recursive alias": ("train: &x {steps: *x}\n", "train.steps: expected an integer or null, got a mapping"),
    "nested too deeply": (
        "train: " + "[" * 600 + "]" * 600 + "\n",
        "not a config file: nested too deeply for the YAML parser (--config)",
    ),
    "does not parse": (
        "train:\n  steps: [5\n",
        "not valid YAML: expected ',' or ']', but got '<stream end>' (line 3, column 1)",
    ),
    "tab indentation": (
        "train:\n\tsteps: 5\n",
        "not valid YAML: found character '\\t' that cannot start any token (line 2, column 1)",
    ),
    "two documents": (
        "train: {}\n---\nmodel: {}\n",
        "not valid YAML: expected a single document in the stream, but found another document (line 2, column 1)",
    ),
    # a value its explicit tag does not fit: the place and the tag, not the bare conversion error
    "float tag": (
        "train:\n  lr: !!float abc\n",
        "line 2, column 7: !!float 'abc' is not a valid float (could not convert string to float: 'abc')",
    ),
    "timestamp tag": (
        "train:\n  steps: 5\n  lr: !!timestamp 2020-13-45\n",
        "line 3, column 7: !!timestamp '2020-13-45' is not a valid timestamp (month must be in 1..12)",
    ),
    "python tag": (
        "train: !!python/object:os.system {}\n",
        "not valid YAML: could not determine a constructor for "
        "the tag 'tag:yaml.org,2002:python/object:os.system' "
        "(line 1, column 8)",
    ),
}


def _refused(tmp_path, capsys, argv, message):
    code = run_cli(*argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err == f"dspipe: error: {message}\n"
    return err


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_file_is_one_line_naming_the_key_and_nothing_is_written(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text, message = BAD_FILES[case]
    (tmp_path / "config.yaml").write_text(text)
    for command in (
        ["gen-config", "--out", "run"],
        ["plan"],
        ["bench"],
        ["gen-config", "--out", "run", "--print-config"],
    ):
        _refused(tmp_path, capsys, [*command, "--config", "config.yaml", *CPU2], f"config.yaml: {message}")
        assert capsys.readouterr().out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


@pytest.mark.parametrize(
    "case,make,message",
    [
        ("missing", None, "nope.yaml: no such file (--config)"),
        ("directory", "dir", "nope.yaml: is a directory, not a YAML file (--config)"),
        ("not UTF-8", b"train:\n  steps: \xff\n", "nope.yaml: not UTF-8 text (byte 0xff at offset 16)"),
        ("huge", b"#" * (yaml_dialect.MAX_BYTES + 1), "nope.yaml: larger than 1 MiB: not a config file (--config)"),
    ],
)
def test_a_file_that_cannot_be_read_is_one_line(case, make, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if make == "dir":
        (tmp_path / "nope.yaml").mkdir()
    elif make is not None:
        (tmp_path / "nope.yaml").write_bytes(make)
    before = sorted(tmp_path.iterdir())
    _refused(tmp_path, capsys, ["gen-config", "--config", "nope.yaml", *CPU2, "--out", "run"], message)
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_config_path_is_not_this_directory(value, tmp_path, capsys, monkeypatch):
    """Path('') is '.': an empty --config was told 'is a directory'."""
    monkeypatch.chdir(tmp_path)
    message = f"Invalid value for '--config': {value!r} is empty: give a YAML file, or leave the option out"
    _refused(tmp_path, capsys, ["gen-config", "--config", value, *CPU2, "--out", "run"], message)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "key,flag,value",
    [
        ("train.steps", "--steps", -5),
        ("train.lr", "--lr", 2.0),
        ("cluster.nodes", "--nodes", 0),
        ("train.seed", "--seed", 2**32),
        ("model.dropout", "--dropout", 1.0),
        ("strategy.pp", "--pp", 0),
        ("cluster.gpu", "--gpu", "tpu"),
        ("train.spike_sigma", "--spike-sigma", ".inf"),
    ],
)
def test_a_file_value_gets_the_flags_range_check(key, flag, value, tmp_path, capsys, monkeypatch):
    """Values go through the flags' click types and the specs: the same refusal as the flag, word for word."""
    monkeypatch.chdir(tmp_path)
    section, name = key.split(".")
    (tmp_path / "c.yaml").write_text(f"{section}:\n  {name}: {value}\n")
    base = [a for a in CPU2 if a not in ("--gpu", "cpu")] if flag == "--gpu" else CPU2
    assert run_cli("plan", *base, flag, "inf" if value == ".inf" else value) == 2
    by_flag = capsys.readouterr().err
    assert run_cli("plan", "--config", "c.yaml", *[a for a in base if a != flag]) == 2
    by_file = capsys.readouterr().err
    assert by_file == by_flag and by_file.count("\n") == 1 and by_file.startswith("dspipe: error: ")


def test_print_config_exits_0_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for command in (["gen-config", "--out", "run"], ["gen-config"], ["plan"], ["bench"]):
        assert run_cli(*command, *CPU2, "--print-config") == 0
        text = capsys.readouterr().out
        assert text.startswith(f"# dspipe {command[0]}: ") and yaml.safe_load(text)["model"]["model"] == "tiny"
    assert list(tmp_path.iterdir()) == []
    assert run_cli("gen-config", *CPU2) == 2  # --out is needed to write
    assert capsys.readouterr().err == "dspipe: error: Missing option '--out'.\n"


# ---- examples ----------------------------------------------------------------------------------------------------


def test_every_model_preset_has_an_example():
    assert sorted(p.stem for p in EXAMPLES) == sorted(MODEL_PRESETS)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_each_example_plans(path, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_cli("plan", "--config", path) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    doc = yaml.safe_load(path.read_text())
    assert doc["model"]["model"] == path.stem
    if "tokens" in doc["train"]:
        assert f"ceil({doc['train']['tokens']} tokens / (" in out
    assert run_cli("gen-config", "--config", path, "--out", "run", "--print-config") == 0  # every key resolves
    assert yaml.safe_load(capsys.readouterr().out)["cluster"]["nodes"] == doc["cluster"]["nodes"]


def test_the_tiny_example_writes_a_run(tmp_path, capsys, monkeypatch, corpus):
    from dspipe.rundir import load_run

    monkeypatch.chdir(tmp_path)
    assert run_cli("gen-config", "--config", ROOT / "examples/configs/tiny.yaml", "--data", corpus, "--out", "run") == 0
    run = load_run(tmp_path / "run")
    assert (run.model.name, run.cluster.world_size, run.train.steps, run.train.lr) == ("tiny", 2, 300, 3e-3)
    assert run.data == str(corpus)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "foo"], "unknown model preset 'foo'"),
        (["--model", "tiny", "--lr", "nan"], "train.lr must be positive, got nan"),
        (["--model", "tiny", "--layers", "-1"], "layers"),
    ],
)
def test_print_config_refuses_what_the_command_would(args, message, capsys):
    """--print-config prints a file the command would accept, or the command's own one-line error (exit 2)."""
    code = run_cli("plan", *args, "--gpu", "cpu", "--print-config")
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and captured.err.count("\n") == 1 and message in captured.err, captured
