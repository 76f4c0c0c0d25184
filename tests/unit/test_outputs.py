"""Output paths of every writing command (gen-config, export-hf, prepare-data, report, slurm-script): each class of
bad --out is one line, exit code 2, no traceback, and everything on disk byte-for-byte (and mode-for-mode) as it
was; --force replaces only what dspipe itself wrote, and never a run's checkpoints, metrics or logs."""

import contextlib
import csv
import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dspipe import outputs
from dspipe.cli import app
from dspipe.errors import SpecError
from dspipe.planner.throughput import STEP_COLUMNS
from tests.helpers import dspipe

CPU = [
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
    "--precision",
    "fp32",
    "--zero",
    "1",
]


def snapshot(root: Path) -> dict:
    """Every entry under root: kind, mode and bytes (files) or target (links)."""
    out = {}
    for dirpath, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", st.st_mode)
            else:
                out[rel] = ("file", st.st_mode, p.read_bytes())
    return out


def call(argv: list[str]) -> tuple[int, list[str]]:
    """`dspipe ARGV` in this process: (exit code, stderr lines); any exception but SystemExit fails the test."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            app.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    return code, [ln for ln in err.getvalue().splitlines() if ln.strip() and not ln.startswith("[20")]  # DS logs


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    d = tmp_path_factory.mktemp("tpl")
    r = dspipe("gen-config", *CPU, "--out", d / "run")
    assert r.returncode == 0, r.stderr
    return d / "run"


@pytest.fixture
def world(tmp_path, template, corpus):
    """User data and dspipe outputs side by side, everything a careless --out could hit."""
    w = tmp_path / "w"
    w.mkdir()
    run = w / "run"
    shutil.copytree(template, run)
    with open(run / "metrics.csv", "w", newline="") as f:
        rows = csv.writer(f)
        rows.writerow(STEP_COLUMNS)
        for step in range(1, 7):
            rows.writerow(
                [step, step * 1024, 6 - step / 10, 1e-3, 1.0, 1000, 16, 1.0, 0.1, 0.5, 0.6, 0.1, 0, 0.03, 0.06, 0.01]
            )
    (run / "checkpoints" / "global_step6").mkdir(parents=True)
    (run / "checkpoints" / "global_step6" / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    (run / "checkpoints" / "latest").write_text("global_step6")
    (run / "report").mkdir()
    for name in ("report.md", "loss.png", "lr.png", "throughput.png"):
        (run / "report" / name).write_text(name)
    outputs.write_marker(run / "report", kind="report")
    (run / "report" / "my-notes.txt").write_text("mine")  # a user file inside the previous report
    (w / "mydata").mkdir()
    (w / "mydata" / "notes.txt").write_text("precious")
    (w / "file.txt").write_text("precious file")
    (w / "file.txt").chmod(0o600)
    (w / "link_dir").symlink_to(w / "mydata")
    (w / "link_file").symlink_to(w / "file.txt")
    (w / "dangling").symlink_to(w / "nowhere")
    shutil.copytree(corpus, w / "data")
    (w / "data" / "raw.txt").write_text("the user's input, kept beside the shards")
    (w / "export").mkdir()
    (w / "export" / "config.json").write_text("{}")
    outputs.write_marker(w / "export", kind="export-hf")
    (w / "export" / "notes.txt").write_text("mine")
    (w / "script.sbatch").write_text(f"#!/bin/bash\n# dspipe run x: 1 nodes\n{'# dspipe-output: slurm-script'}\n")
    (w / "input.txt").write_text("def f(x):\n    return x\n" * 50)
    (w / "locked").mkdir()
    (w / "locked").chmod(0o555)  # read-only by its mode (root could write there anyway: dspipe does not)
    shutil.copy(w / "script.sbatch", w / "locked.sbatch")
    (w / "locked.sbatch").chmod(0o444)
    return w


@pytest.fixture
def read_only(tmp_path):
    """A read-only file system (a tmpfs mounted ro; we run as root in CI), or skip."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    yield ro
    subprocess.run(["umount", str(ro)], check=True)


def command(name: str, w: Path, out: str, *, force: bool = True) -> list[str]:
    run = str(w / "run")
    force_flag = ["--force"] if force else []
    return {
        "gen-config": ["gen-config", *CPU, "--data", str(w / "data"), "--out", out, *force_flag],
        "export-hf": ["export-hf", run, "--out", out, *force_flag],
        "prepare-data": [
            "prepare-data",
            str(w / "input.txt"),
            "--out",
            out,
            "--train-tokenizer",
            "260",
            "--workers",
            "1",
            *force_flag,
        ],
        "report": ["report", run, "--out", out],
        "slurm-script": ["slurm-script", run, "--out", out, *force_flag],
    }[name]


DIR_COMMANDS = ("gen-config", "export-hf", "prepare-data", "report")
# (case, --out relative to the world (None: as is), message, commands it applies to)
DIR_CASES = [
    ("empty", "", "--out is empty: give a path", DIR_COMMANDS),
    ("blank", "  ", "--out is empty: give a path", DIR_COMMANDS),
    ("newline", "@a\nb", "contains a control character", DIR_COMMANDS),
    ("nul", "@a\0b", "contains a control character", DIR_COMMANDS),
    ("root", "/", "is the file system root", DIR_COMMANDS),
    ("file", "@file.txt", "is a file, not a directory", DIR_COMMANDS),
    ("symlink", "@link_dir", "is a symbolic link", DIR_COMMANDS),
    ("dangling symlink", "@dangling", "is a symbolic link", DIR_COMMANDS),
    ("parent is a file", "@file.txt/sub", "file.txt is not a directory", DIR_COMMANDS),
    ("too long", "@" + "x" * 240, "--out is too long", DIR_COMMANDS),
    ("mode 555 parent", "@locked/out", "locked is not writable (mode 555)", DIR_COMMANDS),
    ("mode 555 directory itself", "@locked", "is read-only (mode 555)", DIR_COMMANDS),
    ("user directory", "@mydata", "exists and is not a", DIR_COMMANDS),
    ("run's checkpoints", "@run/checkpoints", "which run directory", DIR_COMMANDS),
    ("inside checkpoints", "@run/checkpoints/global_step6/hf", "is inside", DIR_COMMANDS),
    ("run's monitor", "@run/monitor", "which run directory", DIR_COMMANDS),
    ("a run directory", "@run", "is a run directory written by dspipe, not a", ("export-hf", "prepare-data", "report")),
    (
        "a data directory",
        "@data",
        "is a prepared data directory written by dspipe, not a",
        ("gen-config", "export-hf", "report"),
    ),
    ("an export", "@export", "export-hf model directory written by dspipe, not a", ("gen-config", "prepare-data")),
    ("own kind, foreign file", "@export", "holds files dspipe did not write there (notes.txt)", ("export-hf",)),
    ("own kind, foreign file", "@data", "holds files dspipe did not write there (raw.txt)", ("prepare-data",)),
    ("own kind, foreign file", "@run/report", "holds files dspipe did not write there (my-notes.txt)", ("report",)),
]
FILE_CASES = [
    ("empty", "", "--out is empty: give a path"),
    ("newline", "@x\n.sbatch", "contains a control character"),
    ("root", "/", "is the file system root"),
    ("directory", "@mydata", "is a directory; give a file path"),
    ("symlink", "@link_file", "is a symbolic link"),
    ("parent is a file", "@file.txt/x.sbatch", "file.txt is not a directory"),
    ("user file, --force", "@file.txt", "exists and is not a sbatch script written by dspipe"),
    ("run's dspipe.json, --force", "@run/dspipe.json", "which run directory"),
    ("run's metrics, --force", "@run/metrics.csv", "which run directory"),
    ("inside checkpoints", "@run/checkpoints/x.sbatch", "is inside"),
    ("mode 555 parent", "@locked/x.sbatch", "locked is not writable (mode 555)"),
    ("own script, mode 444, --force", "@locked.sbatch", "is read-only (mode 444)"),
]
CASES = [(c, case, out, msg) for case, out, msg, cmds in DIR_CASES for c in cmds] + [
    ("slurm-script", case, out, msg) for case, out, msg in FILE_CASES
]


def refused(w: Path, argv: list[str], message: str) -> None:
    before = snapshot(w.parent)
    code, lines = call(argv)
    assert code == 2, (argv, lines)
    assert len(lines) == 1 and lines[0].startswith("dspipe: error: ") and message in lines[0], lines
    assert snapshot(w.parent) == before  # nothing created, renamed, replaced or deleted


@pytest.mark.parametrize("name,case,out,message", CASES, ids=[f"{c}:{case}" for c, case, _, _ in CASES])
def test_bad_output_path_is_one_line_and_changes_nothing(world, name, case, out, message):
    out = str(world) + "/" + out[1:] if out.startswith("@") else out
    refused(world, command(name, world, out), message)


@pytest.mark.parametrize("name", [*DIR_COMMANDS, "slurm-script"])
def test_read_only_parent(world, read_only, name):
    refused(world, command(name, world, str(read_only / "out")), "is on a read-only file system")


@pytest.mark.parametrize(
    "name,out", [("export-hf", "export"), ("slurm-script", "script.sbatch"), ("gen-config", "run")]
)
def test_an_existing_output_needs_force(world, name, out):
    (world / "export" / "notes.txt").unlink()  # a clean earlier export
    refused(world, command(name, world, str(world / out), force=False), "already exists (pass --force")


def test_the_issues_three_cases(world):
    """gen-config --out mydata --force, export-hf RUN --out RUN --force, slurm-script --out RUN/dspipe.json."""
    refused(world, command("gen-config", world, str(world / "mydata")), "is not a run directory")
    refused(
        world,
        ["export-hf", str(world / "run"), "--out", str(world / "run"), "--force"],
        f"--out {world / 'run'} is a run directory written by dspipe, not an export-hf model directory",
    )
    refused(world, ["slurm-script", str(world / "run"), "--out", str(world / "run/dspipe.json")], "which run directory")


def test_gen_config_force_keeps_training_outputs(world):
    run = world / "run"
    kept = {k: v for k, v in snapshot(run).items() if k.startswith(("checkpoints", "metrics.csv", "report"))}
    code, lines = call(command("gen-config", world, str(run)) + ["--zero", "2"])
    assert code == 0, lines
    assert json.loads((run / "ds_config.json").read_text())["zero_optimization"]["stage"] == 2
    assert {k: v for k, v in snapshot(run).items() if k in kept} == kept  # byte for byte
    assert any(ln.startswith("note: kept checkpoints/, metrics.csv") for ln in lines), lines
    assert sorted(p.name for p in world.iterdir() if p.name.startswith(".")) == []  # no temp files beside it
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []


def test_gen_config_force_refuses_another_model_over_training_outputs(world):
    cpu = [("gpt2-124m" if a == "tiny" else a) for a in CPU]
    refused(
        world,
        ["gen-config", *cpu, "--eval-interval", "0", "--out", str(world / "run"), "--force"],
        "holds training outputs (checkpoints/, metrics.csv) of another model (",
    )


def test_bad_path_before_planning(world):
    """An impossible plan and a missing parent: the plan's error, and no parent directory created."""
    refused(
        world,
        ["gen-config", *CPU, "--micro-batch", "3", "--out", str(world / "new/deep/run")],
        "is not divisible by micro_batch 3",
    )


def test_slurm_script_force_replaces_its_own_script(world):
    out = world / "script.sbatch"
    code, lines = call(command("slurm-script", world, str(out)))
    assert code == 0, lines
    assert out.read_text().startswith("#!/bin/bash\n# dspipe run ") and os.access(out, os.X_OK)
    assert sorted(p.name for p in world.iterdir() if p.name.startswith(".")) == []


def test_report_replaces_its_own_report(world):
    (world / "run/report/my-notes.txt").unlink()
    code, lines = call(["report", str(world / "run")])
    assert code == 0, lines
    marker = outputs.read_marker(world / "run/report")
    assert marker["dspipe"] == "report" and sorted(marker["files"]) == [
        "loss.png",
        "lr.png",
        "report.md",
        "throughput.png",
    ]


def test_real_process_exit_code(world):
    """The same through a real `python -m dspipe` process: exit code 2, one stderr line, no traceback."""
    before = snapshot(world.parent)
    r = dspipe(*command("export-hf", world, str(world / "mydata")))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "exists and is not a" in r.stderr
    assert snapshot(world.parent) == before


# ---- the module itself ----------------------------------------------------------------------------------------------


def test_owner_recognises_outputs_by_their_marker_and_legacy_names(tmp_path, corpus):
    legacy = tmp_path / "legacy"
    shutil.copytree(corpus, legacy)
    (legacy / outputs.MARKER).unlink()
    assert outputs.owner(corpus) == "data" and outputs.owner(legacy) == "data"
    assert outputs.foreign_files(legacy, kind="data") == []
    (legacy / "x.txt").write_text("")
    assert outputs.owner(legacy) is None  # not recognisable any more: refused, never replaced
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "meta.json").write_text('{"format": "something else"}')
    assert outputs.owner(fake) is None
    (fake / outputs.MARKER).write_text('{"dspipe": "nonsense", "files": []}')
    assert outputs.owner(fake) is None


def test_parents_are_removed_when_the_write_fails(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(SpecError, match="cannot write --out .*No space left"):
        with outputs.writing(out):
            assert (tmp_path / "a" / "b").is_dir()
            raise OSError(28, "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_replace_dir_puts_the_old_directory_back_when_the_new_one_cannot_go_in(tmp_path, monkeypatch):
    from dspipe import atomic

    out, tmp = tmp_path / "out", tmp_path / ".new"
    out.mkdir()
    (out / "f").write_text("old")
    tmp.mkdir()
    real = os.rename

    def fail_second(src, dst):
        if Path(src) == tmp:
            raise OSError(5, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(atomic.os, "rename", fail_second)
    with pytest.raises(OSError):
        atomic.replace_dir(tmp, out)
    assert (out / "f").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == [".new", "out"]


def test_staged_dir_puts_a_filled_directory_in_place_or_leaves_the_old_one(tmp_path):
    from dspipe.atomic import staged_dir

    out = tmp_path / "out"
    out.mkdir()
    (out / "f").write_text("old")
    with pytest.raises(RuntimeError):
        with staged_dir(out, tag="tmp-") as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".out.tmp-")
            (tmp / "f").write_text("half")
            raise RuntimeError("killed while filling")
    assert (out / "f").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out"]
    with staged_dir(out) as tmp:
        (tmp / "f").write_text("new")
    assert (out / "f").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["out"]
    assert out.stat().st_mode & 0o777 == 0o755


def test_staged_dir_errors_wrap_its_own_filesystem_steps_not_the_block(tmp_path):
    from dspipe.atomic import staged_dir

    out = tmp_path / "out"
    with pytest.raises(OSError):  # the block's own OSError is not turned into the --out line
        with staged_dir(out, errors=lambda: outputs.write_errors(out)):
            raise OSError(5, "Input/output error")
    with pytest.raises(SpecError, match=f"cannot write --out {tmp_path / 'absent' / 'out'}"):
        with staged_dir(tmp_path / "absent" / "out", errors=lambda: outputs.write_errors(tmp_path / "absent" / "out")):
            pass
    assert [p.name for p in tmp_path.iterdir()] == []
