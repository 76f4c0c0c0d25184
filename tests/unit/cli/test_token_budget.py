"""Token budgets: `gen-config/plan --tokens 300B` (or train.tokens in a config file) instead of --steps. steps =
ceil(tokens / (global batch x seq len)), shown with its equation and the budget as written; both --steps and
--tokens is an error; the budget is kept in dspipe.json's train.tokens (a TrainSpec field with a default, so run
directories from before it still load)."""

from __future__ import annotations

import json

import pytest

from dspipe.cli.options import steps_for_tokens
from dspipe.errors import SpecError
from dspipe.spec.train import TrainSpec
from dspipe.spec.values import token_count
from tests.helpers import run_cli

CPU2 = ["--model", "tiny", "--gpu", "cpu", "--gpus-per-node", "2", "--global-batch", "16", "--micro-batch", "4"]


@pytest.mark.parametrize(
    "tokens,global_batch,seq_len,steps",
    [
        ("300B", 512, 4096, 143_052),  # 3e11 / 2,097,152 = 143,051.15
        ("300B", 512, 2048, 286_103),  # 286,102.3
        ("1.5T", 1536, 2048, 476_838),  # 476,837.2
        ("1M", 16, 64, 977),  # 976.6
        ("1024", 16, 64, 1),  # exactly one step
        ("1025", 16, 64, 2),  # a token more: a step more
        ("2e9", 1024, 2048, 954),  # 953.7
        ("4K", 2, 1024, 2),  # 4,000 / 2,048
        ("1.07B", 1000, 1070, 1000),  # exactly 1,000 steps (1.07 x 1e9 in floats is 1070000000.0000001: 1,001)
        ("0.27T", 1000, 1000, 270_000),
    ],
)
def test_steps_are_the_budget_rounded_up_to_whole_steps(tokens, global_batch, seq_len, steps):
    assert steps_for_tokens(tokens, global_batch=global_batch, seq_len=seq_len) == steps


def test_a_huge_budget_is_counted_exactly_and_a_config_float_keeps_its_value():
    from dspipe.cli.options import TokenBudget

    with pytest.raises(SpecError, match=r"^--tokens 1e30 is 976,562,500,000,000,000,000,000 steps of 1024 x"):
        steps_for_tokens("1e30", global_batch=1024, seq_len=1000)  # a float's ceil: ...,999,999,991,...
    assert TokenBudget().convert(3e29, None, None) == "3e+29"  # a YAML float: its digits would be 29999...95805696
    assert TokenBudget().convert(3e11, None, None) == "300000000000"


def test_more_steps_than_a_run_may_have_is_one_line():
    with pytest.raises(
        SpecError,
        match=r"^--tokens 1e15 is 976,562,500,000 steps of 16 x 64 tokens: more than the "
        r"2,147,483,647 steps a run may have$",
    ):
        steps_for_tokens("1e15", global_batch=16, seq_len=64)


@pytest.mark.parametrize(
    "text,count",
    [
        ("300B", 3e11),
        ("300b", 3e11),
        ("1.5T", 1.5e12),
        ("2e9", 2e9),
        ("500M", 5e8),
        ("4K", 4e3),
        ("7G", 7e9),
        (" 12 ", 12.0),
    ],
)
def test_token_counts_parse(text, count):
    assert token_count(text) == count


@pytest.mark.parametrize("text", ["lots", "", "-5B", "0", "inf", "nan", "1e400", "3\u0663B", "B", "1.5X", None, 300])
def test_bad_token_counts_do_not(text):
    assert token_count(text) is None


def test_gen_config_derives_steps_and_shows_the_equation(tmp_path, capsys, monkeypatch):
    from dspipe.rundir import load_run

    monkeypatch.chdir(tmp_path)
    assert run_cli("gen-config", *CPU2, "--tokens", "1M", "--out", "run") == 0
    out = capsys.readouterr().out
    assert "\nsteps 977 = ceil(1M tokens / (16 x 64 tokens per step))\n" in out
    spec = json.loads((tmp_path / "run/dspipe.json").read_text())
    assert (spec["train"]["steps"], spec["train"]["tokens"], spec["train"]["warmup_steps"]) == (977, "1M", 97)
    ds = json.loads((tmp_path / "run/ds_config.json").read_text())
    assert ds["scheduler"]["params"]["total_num_steps"] == 977
    run = load_run(tmp_path / "run")
    assert (run.train.steps, run.train.tokens) == (977, "1M")


def test_plan_shows_the_budget_as_given_with_the_equation(capsys):
    assert (
        run_cli(
            "plan",
            "--model",
            "llama2-7b",
            "--nodes",
            "8",
            "--gpus-per-node",
            "8",
            "--gpu",
            "h100-80g",
            "--global-batch",
            "512",
            "--tokens",
            "300B",
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "token budget: steps 143,052 = ceil(300B tokens / (512 x 4096 tokens per step))" in out
    assert "3e+11" not in out.split("token budget:")[1]
    assert (
        run_cli(
            "plan",
            "--model",
            "llama2-7b",
            "--nodes",
            "8",
            "--gpus-per-node",
            "8",
            "--gpu",
            "h100-80g",
            "--global-batch",
            "512",
            "--tokens",
            "300B",
            "--json",
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert d["token_budget"] == {
        "tokens": "300B",
        "steps": 143_052,
        "tokens_per_step": 512 * 4096,
        "equation": "steps 143,052 = ceil(300B tokens / (512 x 4096 tokens per step))",
    }
    assert d["train_days"] == pytest.approx(3e11 / d["tokens_per_s"] / 86400)


def test_without_a_budget_nothing_changes(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_cli("gen-config", *CPU2, "--out", "run") == 0
    out = capsys.readouterr().out
    assert "ceil(" not in out
    spec = json.loads((tmp_path / "run/dspipe.json").read_text())
    assert (spec["train"]["steps"], spec["train"]["tokens"]) == (1000, None)  # the default length
    assert run_cli("plan", *CPU2, "--json") == 0
    assert "token_budget" not in json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("command", [["gen-config", "--out", "run"], ["plan"]])
def test_steps_and_tokens_together_are_refused(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_cli(*command, *CPU2, "--steps", "20", "--tokens", "1M") == 2
    assert capsys.readouterr().err == (
        "dspipe: error: --steps 20 and --tokens 1M: give one of them (the run's length), not both\n"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "value,message",
    [
        ("lots", "--tokens 'lots' does not parse as a token count: use a number like 300B, 1.5T or 2e9"),
        ("-5B", "--tokens '-5B' is not a positive number of tokens: use a number like 300B, 1.5T or 2e9"),
        ("1e999", "--tokens '1e999' is beyond the range of a number (at most 1e+18 tokens)"),
        (
            "1" * 5000,
            "--tokens 1111111111111111... (5,000 digits) is beyond the range of a number (at most 1e+18 tokens)",
        ),
        (
            "1e17",
            "--tokens 1e17 is 97,656,250,000,000 steps of 16 x 64 tokens: more than the 2,147,483,647 steps a run "
            "may have",
        ),
    ],
)
def test_a_bad_budget_is_one_line_and_nothing_is_written(value, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_cli("gen-config", *CPU2, "--tokens", value, "--out", "run") == 2
    assert capsys.readouterr().err == f"dspipe: error: {message}\n"
    assert list(tmp_path.iterdir()) == []


def test_a_preset_schedule_that_contradicts_the_budget_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.json").write_text(
        json.dumps(
            {
                "train_batch_size": 16,
                "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 500, "warmup_num_steps": 10}},
            }
        )
    )
    assert run_cli("plan", *CPU2, "--preset", "p.json", "--tokens", "1M") == 2
    assert capsys.readouterr().err == (
        "dspipe: error: --tokens 1M is 977 steps of 16 x 64 tokens, but the "
        "--preset's scheduler total_num_steps is 500: drop --tokens or edit the "
        "preset\n"
    )
    assert run_cli("plan", *CPU2, "--preset", "p.json", "--tokens", "512K") == 0  # 512,000 / 1,024 = 500
    assert "steps 500 = ceil(512K tokens / (16 x 64 tokens per step))" in capsys.readouterr().out
    (tmp_path / "auto.json").write_text(
        json.dumps(
            {
                "train_batch_size": 16,
                "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 10}},
            }
        )
    )
    assert run_cli("plan", *CPU2, "--preset", "auto.json", "--tokens", "1M") == 0
    assert 'preset: scheduler.params.total_num_steps "auto" -> 977 (--tokens)\n' in capsys.readouterr().out


# ---- TrainSpec.tokens --------------------------------------------------------------------------------------------


def test_train_spec_tokens_defaults_to_none_and_is_checked():
    assert TrainSpec(global_batch=8, micro_batch=1, steps=10).tokens is None
    assert TrainSpec(global_batch=8, micro_batch=1, steps=10, tokens="300B").tokens == "300B"
    for bad, message in [
        ("lots", "train.tokens 'lots' is not a token count like 300B, 1.5T or 2e9 (allowed: finite, (0, 1e+18])"),
        ("2e18", "train.tokens '2e18' is too large (allowed: finite, (0, 1e+18])"),
        (3e11, "train.tokens must be a non-empty one-line string, got 300000000000.0"),
        ("1B\n", "train.tokens must be a non-empty one-line string, got '1B\\n'"),
    ]:
        with pytest.raises(SpecError) as e:
            TrainSpec(global_batch=8, micro_batch=1, steps=10, tokens=bad)
        assert str(e.value) == message


def test_run_directories_from_before_the_field_load_and_a_bad_one_is_named(tmp_path, capsys, monkeypatch):
    from dspipe.rundir import load_run

    monkeypatch.chdir(tmp_path)
    assert run_cli("gen-config", *CPU2, "--tokens", "20K", "--out", "run") == 0
    capsys.readouterr()
    spec_file = tmp_path / "run/dspipe.json"
    spec = json.loads(spec_file.read_text())
    del spec["train"]["tokens"]  # written before train.tokens existed
    spec_file.write_text(json.dumps(spec))
    assert load_run(tmp_path / "run").train.tokens is None
    spec["train"]["tokens"] = "lots"
    spec_file.write_text(json.dumps(spec))
    with pytest.raises(SpecError, match=r"dspipe.json: train.tokens 'lots' is not a token count"):
        load_run(tmp_path / "run")


def test_extend_records_the_new_length_as_given_and_config_yaml_still_reproduces_the_run(tmp_path, capsys, monkeypatch):
    """extend --steps: the run length is now steps (train.tokens null); extend --tokens: the new budget, steps
    derived. dspipe.json and config.yaml both say so, and gen-config --config config.yaml renders the same DeepSpeed
    config as the extended run (the warmup the run had is kept, no longer derived from the length)."""
    from dspipe.rundir import load_run

    monkeypatch.chdir(tmp_path)
    assert run_cli("gen-config", *CPU2, "--tokens", "20K", "--out", "run") == 0  # 20 steps of 1,024
    assert run_cli("extend", "run", "--steps", "30") == 0
    run = load_run(tmp_path / "run")
    assert (run.train.steps, run.train.tokens, run.train.warmup_steps) == (30, None, 2)
    assert run_cli("extend", "run", "--tokens", "40K") == 0
    run = load_run(tmp_path / "run")
    assert (run.train.steps, run.train.tokens, run.train.warmup_steps) == (40, "40K", 2)
    capsys.readouterr()
    assert run_cli("gen-config", "--config", "run/config.yaml", "--out", "again") == 0
    assert "steps 40 = ceil(40K tokens" in capsys.readouterr().out
    a, b = (json.loads((tmp_path / d / "ds_config.json").read_text()) for d in ("run", "again"))
    for cfg in (a, b):
        for monitor in ("tensorboard", "csv_monitor"):
            cfg[monitor].pop("output_path")  # names the run directory
    assert a == b


def test_a_length_that_ends_at_or_before_the_newest_checkpoint_is_refused(tmp_path, capsys, monkeypatch):
    """The launch resumes from the newest checkpoint: extend to a length at or before it would train nothing (it
    exited 0): one line with the step, nothing changes. gen-config --force notes it (a --restart launch starts over)."""
    monkeypatch.chdir(tmp_path)
    assert run_cli("gen-config", *CPU2, "--steps", "20", "--out", "run") == 0
    (tmp_path / "run" / "checkpoints" / "global_step30").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "global_step30" / "dspipe.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()}
    capsys.readouterr()
    assert run_cli("extend", "run", "--steps", "25") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has a checkpoint at step 30: the run's new length 25 must be more" in err, err
    assert before == {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()}
    assert run_cli("extend", "run", "--steps", "31") == 0
    capsys.readouterr()
    # gen-config --force may rewrite it (a launch with --restart trains afresh, as the demo's does), with a note
    assert run_cli("gen-config", *CPU2, "--steps", "30", "--out", "run", "--force") == 0
    assert (
        "newest checkpoint (step 30, at or past this run's 30 steps: it would train nothing)" in capsys.readouterr().err
    )
