"""Files that exist but fail to read (an I/O error, EIO): every file of a run directory, a checkpoint and a prepared
data directory, replaced in turn by a link to /proc/self/mem (reading it fails with EIO, even as root), under every
command that reads it. Each is one `dspipe: error:` line and exit 2 (or exit 0 where the command does not read that
file), never a traceback, and nothing is written."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import hand_checkpoint, run_cli

EIO_TARGET = "/proc/self/mem"
CPU2 = [
    "--model",
    "tiny",
    "--gpu",
    "cpu",
    "--gpus-per-node",
    "2",
    "--global-batch",
    "16",
    "--micro-batch",
    "4",
    "--steps",
    "6",
    "--warmup",
    "1",
    "--precision",
    "fp32",
    "--zero",
    "0",
    "--pp",
    "1",
]


def test_the_link_fails_with_eio(tmp_path):
    link = tmp_path / "x"
    os.symlink(EIO_TARGET, link)
    with pytest.raises(OSError) as e:
        link.read_bytes()
    assert e.value.strerror == "Input/output error"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, corpus):
    """A prepared data directory and a gen-config run directory with metrics and a complete checkpoint."""
    root = tmp_path_factory.mktemp("eio")
    data = root / "data"
    shutil.copytree(corpus, data)
    shutil.copytree(corpus, root / "other")  # the first source of a blend with data
    run = root / "run"
    assert run_cli("gen-config", *CPU2, "--data", data, "--out", run) == 0
    (run / "metrics.csv").write_text("step,tokens,loss\n1,1024,8.3\n2,2048,8.1\n")
    (run / "val_metrics.csv").write_text("step,val_loss\n2,8.2\n")
    hand_checkpoint(run, step=6)
    return root


def _commands(run: Path, data: Path, out: Path) -> dict[str, list]:
    ckpt = run / "checkpoints" / "global_step6"
    return {
        "report": ["report", run, "--out", out / "report"],
        "launch": ["launch", run, "--dry-run"],
        "slurm-script": ["slurm-script", run, "--out", out / "job.sbatch"],
        "extend": ["extend", run, "--steps", "12"],
        "export-hf": ["export-hf", ckpt, "--out", out / "hf"],
        "generate": ["generate", ckpt, "--prompt", "def", "--max-tokens", "2"],
        "gen-config": ["gen-config", *CPU2, "--data", data, "--out", out / "run2"],
        "gen-config --config": ["gen-config", "--config", run / "config.yaml", "--data", data, "--out", out / "run3"],
        "gen-config blend": [
            "gen-config",
            *CPU2,
            "--data",
            f"{data.parent / 'other'}:1,{data}:1",
            "--out",
            out / "run4",
        ],
    }


READS = {  # (command, file) pairs that must be the one-line 'cannot read it' error
    ("report", "run/dspipe.json"),
    ("report", "run/ds_config.json"),
    ("report", "run/metrics.csv"),
    ("report", "run/val_metrics.csv"),
    ("launch", "run/dspipe.json"),
    ("launch", "run/ds_config.json"),
    ("slurm-script", "run/dspipe.json"),
    ("extend", "run/dspipe.json"),
    ("extend", "run/ds_config.json"),
    ("export-hf", "run/checkpoints/global_step6/mp_rank_00_model_states.pt"),
    ("export-hf", "run/checkpoints/global_step6/dspipe.json"),
    ("generate", "run/checkpoints/global_step6/mp_rank_00_model_states.pt"),
    ("gen-config", "data/meta.json"),
    ("gen-config --config", "run/config.yaml"),
    ("gen-config blend", "data/meta.json"),
    ("gen-config blend", "data/tokenizer/tokenizer.json"),
}


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def _snapshot(root: Path) -> dict:
    return {
        str(p.relative_to(root)): (p.is_symlink(), p.stat().st_size if p.is_file() and not p.is_symlink() else None)
        for p in sorted(root.rglob("*"))
    }


def _cases(root_files):
    return [
        (command, f)
        for command in (
            "report",
            "launch",
            "slurm-script",
            "extend",
            "export-hf",
            "generate",
            "gen-config",
            "gen-config --config",
            "gen-config blend",
        )
        for f in root_files
        if f.startswith("run/") or f.startswith("data/meta") or f.startswith("data/tok")
    ]


def test_every_file_under_every_command_is_one_line(pristine, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    files = _files(pristine)
    assert {f for _, f in READS} <= set(files), "a file the test expects is not written any more"
    failures, refused = [], set()
    for command, name in _cases(files):
        case = tmp_path / "case"
        shutil.rmtree(case, ignore_errors=True)
        shutil.copytree(pristine, case, symlinks=True)
        (case / name).unlink()
        os.symlink(EIO_TARGET, case / name)
        out = tmp_path / "out"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        before = _snapshot(case)
        code = run_cli(*_commands(case / "run", case / "data", out)[command])
        captured = capsys.readouterr()
        err = captured.err
        lines = [line for line in err.splitlines() if line.startswith("dspipe: error:")]
        if code not in (0, 2) or "Traceback" in err or (code == 2 and len(lines) != 1):
            failures.append(f"{command} / {name}: exit {code}: {err.strip()[-300:]}")
            continue
        if code == 2:
            refused.add((command, name))
            named = f"{Path(name).name}: cannot read it (Input/output error)" in err
            if (command, name) in READS and not named:
                failures.append(f"{command} / {name}: not the 'FILE: cannot read it' line: {err.strip()}")
            if list(out.iterdir()):
                failures.append(f"{command} / {name}: refused, but wrote {[p.name for p in out.iterdir()]}")
        if _snapshot(case) != before and command not in ("extend",):
            failures.append(f"{command} / {name}: changed the run or data directory")
    for pair in sorted(READS - refused):
        failures.append(f"{pair[0]} / {pair[1]}: not refused")
    assert not failures, "\n".join(failures)


FILE_FLAGS = {  # a file named by a flag: (the message's prefix, the file's name)
    "--preset": ("preset ", "mine.json"),
    "--profile": ("--profile ", "profile.json"),
    "--hostfile": ("hostfile ", "hosts"),
    "--config": ("", "config.yaml"),
}


@pytest.mark.parametrize("flag", sorted(FILE_FLAGS))
@pytest.mark.parametrize("command", ["plan", "gen-config"])
def test_a_file_named_by_a_flag(flag, command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prefix, name = FILE_FLAGS[flag]
    link = tmp_path / name
    os.symlink(EIO_TARGET, link)
    extra = ["--out", tmp_path / "run"] if command == "gen-config" else []
    code = run_cli(command, *CPU2, flag, link, *extra)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"dspipe: error: {prefix}{link}: cannot read it (Input/output error)" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_bench_append_is_checked_before_measuring(tmp_path, capsys, monkeypatch):
    from dspipe.tools import bench

    def no_launch(**kwargs):
        raise AssertionError("bench started ranks with an unreadable --append file")

    monkeypatch.setattr(bench, "run_side", no_launch)
    link = tmp_path / "BENCH.md"
    os.symlink(EIO_TARGET, link)
    code = run_cli("bench", *CPU2[:-4], "--append", link)
    err = capsys.readouterr().err
    assert code == 2 and f"--append {link}: cannot read it (Input/output error)" in err, err
