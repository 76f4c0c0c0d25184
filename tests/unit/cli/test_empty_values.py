"""An empty string given to a string option is refused (not read as 'not given'); a MoE-only setting on a dense model
is refused like every other."""

import pytest

from tests.helpers import run_cli

PLAN = ["plan", "--model", "tiny", "--gpu", "cpu", "--gpus-per-node", "2", "--measure", "never"]


@pytest.mark.parametrize("flag", ["--hostfile", "--profile", "--preset", "--init-from", "--nvme-path"])
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_string_option_is_refused(flag, value, capsys):
    code = run_cli(*PLAN, flag, value)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"Invalid value for '{flag}': {value!r} is empty: give a value, or leave the option out" in err


def test_experts_per_token_on_a_dense_model_is_refused(capsys):
    code = run_cli(*PLAN, "--experts-per-token", "3")
    err = capsys.readouterr().err
    assert code == 2 and "model.experts_per_token 3 has no effect without experts (give experts, e.g. 8)" in err


@pytest.mark.parametrize("args, where", [(["--steps", "1"], ""), (["--tokens", "1.5"], " (--tokens 1.5)")])
def test_a_one_step_run_names_the_steps_not_a_warmup_never_given(args, where, capsys):
    code = run_cli(*PLAN, *args)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"steps 1{where} leaves no room for the lr warmup" in err and "steps >= 2" in err


@pytest.mark.parametrize("command", [["generate", "", "--prompt", "x"], ["export-hf", "", "--out", "o"]])
def test_an_empty_source_is_refused_not_read_as_the_current_directory(command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = run_cli(*command)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "'' is empty: give a value\n" in err, err
    assert list(tmp_path.iterdir()) == []
