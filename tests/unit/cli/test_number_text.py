"""User text that is meant to be a number, on every numeric option of every subcommand (generated from the commands
themselves, so a new option is covered) and in --config files: a 5,000-digit integer (beyond Python's int-from-text
limit of 4,300 digits), hex, underscores, fullwidth and Arabic-Indic digits, 1e999, nan and -0. Each refused value is
one short `dspipe: error:` line naming the option, exit 2, nothing written."""

from __future__ import annotations

import click
import pytest

from dspipe.cli.app import cli
from dspipe.cli.options import AutoInt, StrictFloat, StrictInt, TokenBudget
from dspipe.spec.options import TABLE
from tests.helpers import run_cli

HUGE = "1" * 5000
NOT_NUMBERS = ["0x10", "1_000", "\uff11\uff12", "\u0661\u0662", "1e3x", "--1"]
"""Text Python's int() or float() would read (hex aside), that no option takes: each is refused at parse time."""
CPU2 = ["--model", "tiny", "--gpu", "cpu", "--gpus-per-node", "2", "--global-batch", "16", "--micro-batch", "4"]


def _numeric_options():
    out = []
    for name, command in sorted(cli.commands.items()):
        for p in command.params:
            if isinstance(p, click.Option) and isinstance(p.type, (StrictInt, StrictFloat, AutoInt, TokenBudget)):
                out.append((name, max(p.opts, key=len), p.type))
    return out


NUMERIC = _numeric_options()
INTEGER = [(c, f, t) for c, f, t in NUMERIC if isinstance(t, (StrictInt, AutoInt))]


def _one_short_line(code, err, *, flag):
    assert code == 2, (flag, code, err)
    assert err.startswith("dspipe: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert len(err) < 300, f"{flag}: a {len(err)}-character message"


def test_every_command_has_numeric_options_covered():
    commands = {c for c, _, _ in NUMERIC}
    assert {
        "plan",
        "gen-config",
        "bench",
        "prepare-data",
        "launch",
        "doctor",
        "generate",
        "extend",
        "calibrate",
        "slurm-script",
    } <= commands
    assert len(INTEGER) > 150


@pytest.mark.parametrize("command,flag", [(c, f) for c, f, _ in INTEGER], ids=[f"{c} {f}" for c, f, _ in INTEGER])
def test_a_5000_digit_integer_is_one_line_with_the_limit(command, flag, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = run_cli(command, flag, HUGE)
    err = capsys.readouterr().err
    _one_short_line(code, err, flag=flag)
    assert f"'{flag}': 1111111111111111... (5,000 digits) is too large" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "section,key", [(s.section, s.key) for body in TABLE.values() for s in body if s.kind in ("int", "auto_int")]
)
def test_the_option_table_states_each_integer_limit(section, key, tmp_path, capsys, monkeypatch):
    """plan and gen-config: the flag and the --config key both name the largest value the option takes."""
    from dspipe.spec.options import SETTINGS

    monkeypatch.chdir(tmp_path)
    limit = SETTINGS[key].limit
    most = f"(at most {limit:,})" if limit is not None else "(at most 1,000 digits)"
    (tmp_path / "c.yaml").write_text(f"{section}:\n  {key}: {HUGE}\n")
    for argv in (
        ["plan", *CPU2, SETTINGS[key].flag_name, HUGE],
        ["gen-config", *CPU2, "--config", "c.yaml", "--out", "run"],
    ):
        code = run_cli(*argv)
        err = capsys.readouterr().err
        _one_short_line(code, err, flag=key)
        assert f"(5,000 digits) is too large {most}" in err, err
        if "--config" in argv:
            assert f"c.yaml: {section}.{key}: " in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


@pytest.mark.parametrize("command,flag", [(c, f) for c, f, _ in NUMERIC], ids=[f"{c} {f}" for c, f, _ in NUMERIC])
def test_text_that_is_no_number_is_refused_at_parse_time(command, flag, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for value in NOT_NUMBERS:
        code = run_cli(command, flag, value)
        err = capsys.readouterr().err
        _one_short_line(code, err, flag=f"{flag} {value!r}")
        assert flag in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "section,key,value",
    [
        ("train", "lr", HUGE),
        ("train", "tokens", HUGE),
        ("model", "model", HUGE),
        ("strategy", "zero", HUGE),
        ("train", "lr", ".nan"),
        ("train", "lr", "1e999"),
        ("train", "global_batch", "0x10"),
        ("train", "global_batch", "1_000"),
        ("train", "global_batch", "'16'"),
        ("cluster", "gpu", HUGE),
    ],
)
def test_config_file_numbers(section, key, value, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(f"{section}:\n  {key}: {value}\n")
    code = run_cli("gen-config", *CPU2, "--config", "c.yaml", "--out", "run")
    err = capsys.readouterr().err
    _one_short_line(code, err, flag=key)
    assert key in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_minus_zero_is_zero_in_every_written_file(tmp_path, capsys, corpus):
    """-0 is a valid spelling of 0 (the value is not changed), but no written file shows -0.0."""
    out = tmp_path / "run"
    code = run_cli(
        "gen-config", *CPU2, "--dropout", "-0", "--weight-decay", "-0.0", "--seed", "-0", "--data", corpus, "--out", out
    )
    capsys.readouterr()
    assert code == 0
    for name in ("dspipe.json", "ds_config.json", "config.yaml"):
        text = (out / name).read_text().replace(str(out), "").replace(str(corpus), "")  # paths may hold "-0"
        assert "-0" not in text.replace("e-0", ""), name
    import json

    spec = json.loads((out / "dspipe.json").read_text())
    assert spec["model"]["dropout"] == 0.0 and spec["train"]["weight_decay"] == 0.0 and spec["train"]["seed"] == 0


@pytest.mark.parametrize("flag", ["--layers", "--seed", "--pp", "--global-batch"])
def test_a_5000_digit_negative_integer_is_out_of_range(flag, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = run_cli("plan", *CPU2, flag, "-" + HUGE)
    err = capsys.readouterr().err
    _one_short_line(code, err, flag=flag)
    assert "-111111111111111... (5,000 digits) is negative, out of every allowed range" in err, err
