"""A path dspipe reads that is no regular file: the one line says what it is (a directory, a symlink loop, a broken
link), not that it is missing or unknown (dspipe.errors.file_problem)."""

import os

import pytest

from dspipe.errors import SpecError, file_problem
from tests.helpers import run_cli

PLAN = ["plan", "--model", "tiny", "--gpu", "cpu", "--gpus-per-node", "2", "--measure", "never"]


@pytest.fixture
def paths(tmp_path):
    (tmp_path / "dir.json").mkdir()
    os.symlink(tmp_path / "loop2.json", tmp_path / "loop1.json")
    os.symlink(tmp_path / "loop1.json", tmp_path / "loop2.json")
    os.symlink(tmp_path / "gone.json", tmp_path / "broken.json")
    (tmp_path / "file.json").write_text("{}")
    (tmp_path / "presets").mkdir()
    (tmp_path / "preset.txt").write_text("{}")
    return tmp_path


def test_file_problem_names_each_kind(paths):
    assert file_problem(paths / "file.json") is None
    assert file_problem(paths / "missing.json") == "does not exist"
    assert file_problem(paths / "file.json" / "below") == "does not exist"
    assert file_problem(paths / "dir.json") == "is a directory, not a file"
    assert file_problem(paths / "loop1.json") == "is a symlink loop"
    assert file_problem(paths / "broken.json") == f"is a broken symlink (to {paths / 'gone.json'})"


@pytest.mark.parametrize(
    "flag, name, message",
    [
        (
            "--hostfile",
            "dir.json",
            "hostfile {p}/dir.json is a directory, not a file (one 'HOST slots=N' line per node)",
        ),
        ("--hostfile", "loop1.json", "hostfile {p}/loop1.json is a symlink loop"),
        ("--preset", "dir.json", "DeepSpeed preset {p}/dir.json is a directory, not a file (--preset: a name or a"),
        ("--preset", "loop1.json", "DeepSpeed preset {p}/loop1.json is a symlink loop"),
        ("--preset", "broken.json", "DeepSpeed preset {p}/broken.json is a broken symlink (to {p}/gone.json)"),
        ("--config", "loop1.json", "{p}/loop1.json: is a symlink loop (--config)"),
        ("--preset", "presets", "DeepSpeed preset {p}/presets is a directory, not a file (--preset: a name or a"),
        ("--preset", "preset.txt", "DeepSpeed preset {p}/preset.txt is not a .json file (--preset: a name or a"),
    ],
)
def test_a_path_that_is_no_file_says_what_it_is(paths, capsys, flag, name, message):
    code = run_cli(*PLAN, flag, str(paths / name))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message.format(p=paths) in err, err


def test_a_hostfile_line_with_slots_twice_is_refused(tmp_path):
    from dspipe.cluster.hostfile import parse_hostfile

    with pytest.raises(SpecError, match=r"^h:1: 'node1 slots=8 slots=4': slots= given twice"):
        parse_hostfile("node1 slots=8 slots=4\n", source="h")


def test_a_latest_that_is_a_directory_is_refused_not_skipped(tmp_path):
    """The runner's --resume auto: checkpoints/latest must name the newest checkpoint; a directory there is damage,
    named, not a cue to pick the newest by itself."""
    from dspipe.runtime.ckpt_tags import find_checkpoint

    (tmp_path / "latest").mkdir()
    with pytest.raises(SpecError, match=r"latest is a directory, not a file: it should name the newest checkpoint; "):
        find_checkpoint(tmp_path, "auto")
