"""Fuzz every subcommand: hundreds of generated bad inputs (flag values of every kind, damaged files) thrown at the
real command line, in-process. Each must end in exit 0 (the value happened to be valid) or exit 2 with exactly one
`dspipe: error:` line; never a traceback, never another exit code, never a change to anything that existed before
the call, and never a non-finite number in a JSON it wrote. Processes that would train or benchmark are not
started: the functions that start them are replaced by a stand-in that records the call."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import click
import pytest

from dspipe.cli import app

# One family of bad values per parameter type; every option of every command gets all of its family's values.
BAD = {
    "int": [
        "nan",
        "inf",
        "-1",
        "0",
        "99999999999999999999999",
        "1e3",
        "1.5",
        "\u0663",
        "\uff18",
        "",
        " ",
        "0x10",
        "-0",
        "9" * 400,
        "1" * 5000,
        "1_000",
    ],
    "float": [
        "nan",
        "inf",
        "-inf",
        "-1",
        "0",
        "1e309",
        "-1e309",
        "",
        "1e-320",
        "\u0663",
        "abc",
        "NaN",
        "1e999",
        "-0",
        "0x10",
        "1_000",
        "\uff11",
        "1" * 5000,
    ],
    "choice": ["bogus", "", "AUTO", "\n"],
    "text": ["", " ", "a\nb", "x;rm -rf /", "$(touch pwned)", "\x00", "../../..", "\u202e", "%s%n", "-"],
    "path": ["", "/nonexistent/dir/x", "@FILE", "@DIR", "/proc/version", "a\nb", "@RUN/dspipe.json", "@READONLY/x"],
}
MAX_PER_COMMAND = 140  # a deterministic sample when a command's cross product is larger


class WouldLaunch(Exception):
    """Raised by the stand-in for anything that would start ranks: the input got through every check."""


def _kind(param: click.Parameter) -> str:
    t = param.type
    if isinstance(t, click.Choice):
        return "choice"
    if isinstance(t, click.types.IntParamType) or getattr(t, "name", "") in ("integer", "auto|N"):
        return "int"
    if isinstance(t, click.types.FloatParamType):
        return "float"
    if (
        isinstance(t, click.Path)
        or "out" in param.name
        or "path" in param.name
        or "file" in param.name
        or param.name in ("data", "run", "checkpoint", "source", "inputs", "hostfile", "tokenizer", "preset")
    ):
        return "path"
    return "text"


def _snapshot(root: Path) -> dict:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p)] = ("link", os.readlink(p))
        elif p.is_file():
            out[str(p)] = ("file", hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mode)
        elif p.is_dir():
            out[str(p)] = ("dir", p.stat().st_mode)
    return out


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory, corpus):
    """Existing things the fuzz must never damage: a run directory, a data directory, a user directory, a file,
    a read-only directory, a hostfile. Outputs of valid calls go under scratch/ (not protected)."""
    root = tmp_path_factory.mktemp("fuzz")
    keep = root / "keep"
    keep.mkdir()
    data = keep / "data"
    shutil.copytree(corpus, data)
    run = keep / "run"
    r = _call(
        [
            "gen-config",
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
            "--data",
            str(data),
            "--out",
            str(run),
        ]
    )
    assert r[0] == 0, r
    (run / "metrics.csv").write_text("step,tokens,loss\n1,2048,8.3\n")
    (keep / "mydata").mkdir()
    (keep / "mydata" / "precious.txt").write_text("user data\n")
    (keep / "file.txt").write_text("a file\n")
    (keep / "hosts").write_text("localhost slots=2\n")
    ro = keep / "readonly"
    ro.mkdir()
    ro.chmod(0o555)
    scratch = root / "scratch"
    scratch.mkdir()
    return {"root": root, "keep": keep, "run": run, "data": data, "scratch": scratch}


def _call(argv: list[str]) -> tuple[int, str, str]:
    """Run `dspipe ARGV` in-process: (exit code, stdout, stderr). An exception other than SystemExit/WouldLaunch
    propagates (a traceback is a failure)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            app.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except WouldLaunch:
            code = 0
    return code, out.getvalue(), err.getvalue()


def _base_commands(s: dict) -> dict[str, list[str]]:
    run, data, scratch = str(s["run"]), str(s["data"]), s["scratch"]
    cpu = [
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
    ]
    return {
        "plan": ["plan", *cpu],
        "gen-config": ["gen-config", *cpu, "--data", data, "--out", str(scratch / "OUT")],
        "presets": ["presets"],
        "report": ["report", run, "--out", str(scratch / "OUT")],
        "slurm-script": ["slurm-script", run, "--out", str(scratch / "OUT.sbatch")],
        "launch": ["launch", run, "--dry-run"],
        "export-hf": ["export-hf", str(s["run"] / "checkpoints" / "global_step6"), "--out", str(scratch / "OUT")],
        "generate": ["generate", run, "--prompt", "def"],
        "prepare-data": [
            "prepare-data",
            str(s["keep"] / "file.txt"),
            "--out",
            str(scratch / "OUT"),
            "--train-tokenizer",
            "260",
            "--workers",
            "1",
        ],
        "bench": [
            "bench",
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
            "--precision",
            "fp32",
        ],
        "doctor": ["doctor", "--skip-allreduce"],
        "build-ops": ["build-ops", "--offload", "none"],
    }


def _resolve(value: str, s: dict) -> str:
    return (
        value.replace("@FILE", str(s["keep"] / "file.txt"))
        .replace("@DIR", str(s["keep"] / "mydata"))
        .replace("@RUN", str(s["run"]))
        .replace("@READONLY", str(s["keep"] / "readonly"))
    )


def _cases(s: dict) -> list[tuple[str, list[str]]]:
    rng = random.Random(20261123)
    cases = []
    for name, base in _base_commands(s).items():
        cmd = app.cli.commands[name]
        mine = []
        for param in cmd.params:
            if param.name == "help":
                continue
            for bad in BAD[_kind(param)]:
                bad = _resolve(bad, s)
                if isinstance(param, click.Argument):
                    argv = [base[0], bad, *base[2:]] if len(base) > 1 and not base[1].startswith("-") else [*base, bad]
                elif param.is_flag:
                    continue
                else:
                    flag = max(param.opts, key=len)
                    argv = list(base)
                    if flag in argv:
                        argv[argv.index(flag) + 1] = bad
                    else:
                        argv += [flag, bad]
                mine.append((f"{name} {param.name}={bad!r}", argv))
        # damaged files that the command reads
        rng.shuffle(mine)
        cases += mine[:MAX_PER_COMMAND]
    return cases


DAMAGES = {
    "dspipe.json: not JSON": ("run/dspipe.json", b"{not json"),
    "dspipe.json: empty": ("run/dspipe.json", b""),
    "dspipe.json: a list": ("run/dspipe.json", b"[1, 2]"),
    "dspipe.json: NaN lr": ("run/dspipe.json", None),
    "dspipe.json: cluster 2 x 1, command 1 x 2": ("run/dspipe.json", "contradict"),
    "ds_config.json: truncated": ("run/ds_config.json", "truncate"),
    "ds_config.json: binary": ("run/ds_config.json", b"\xff\xfe\x00\x01"),
    "metrics.csv: torn": ("run/metrics.csv", b"step,tokens,loss\n1,2048,8.3\n2,40"),
    "metrics.csv: binary": ("run/metrics.csv", b"\x00\x01\x02"),
    "meta.json: not JSON": ("data/meta.json", b"{"),
    "meta.json: wrong types": ("data/meta.json", b'{"vocab_size": "many"}'),
}


def _damage(s: dict, target: str, how) -> None:
    path = s["keep"] / target
    if how == "truncate":
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    elif how == "contradict":  # same world size: only the restated layout (command, estimate) can tell
        d = json.loads(path.read_text())
        d["cluster"].update(nodes=2, gpus_per_node=1)
        path.write_text(json.dumps(d))
    elif how is None:  # a NaN where a number belongs
        d = json.loads(path.read_text())
        d["train"]["lr"] = float("nan")
        path.write_text(json.dumps(d))
    else:
        path.write_bytes(how)


@pytest.fixture()
def no_launch(monkeypatch):
    """Anything that would start ranks raises WouldLaunch instead."""
    from dspipe.cluster import doctor, launch
    from dspipe.tools import bench

    def stop(*a, **k):
        raise WouldLaunch()

    monkeypatch.setattr(bench, "run_side", stop)
    monkeypatch.setattr(launch, "execute", stop)
    for name in ("allreduce_check", "run_allreduce"):
        if hasattr(doctor, name):
            monkeypatch.setattr(doctor, name, stop)


def _check(code: int, out: str, err: str, *, label: str) -> None:
    assert "Traceback" not in err + out, f"{label}: traceback\n{err[-2000:]}"
    assert code in (0, 2), f"{label}: exit {code}\n{err[-2000:]}"
    if code == 2:
        errors = [line for line in err.splitlines() if line.startswith("dspipe: error:")]
        assert len(errors) == 1 and len(err.strip().splitlines()) >= 1, f"{label}: stderr\n{err[-2000:]}"


def _finite_json(root: Path, *, label: str) -> None:
    for p in root.rglob("*.json"):
        text = p.read_text(errors="replace")
        assert not any(t in text for t in ("NaN", "Infinity")), f"{label}: non-finite number in {p}"


def _wipe(path: Path) -> None:
    """Empty `path`, keeping the directory itself (it may be the working directory)."""
    path.mkdir(exist_ok=True)
    for p in path.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def test_every_subcommand_survives_generated_bad_flags(sandbox, no_launch, monkeypatch):
    cwd = sandbox["root"] / "cwd"  # relative outputs land here, never in the repository
    _wipe(cwd)
    monkeypatch.chdir(cwd)
    cases = _cases(sandbox)
    assert len(cases) >= 300, len(cases)
    before = _snapshot(sandbox["keep"])
    outcomes, failures = {0: 0, 2: 0}, []
    for label, argv in cases:
        try:
            code, out, err = _call(argv)
            _check(code, out, err, label=label)
            outcomes[code] += 1
            assert _snapshot(sandbox["keep"]) == before, f"{label}: an existing file or directory changed"
            _finite_json(sandbox["scratch"], label=label)
        except Exception as e:  # noqa: BLE001 - every failure is collected, then reported together
            failures.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
        _wipe(sandbox["scratch"])
        _wipe(cwd)
    print(f"fuzz: {len(cases)} inputs, {outcomes[2]} refused (exit 2), {outcomes[0]} accepted, {len(failures)} failed")
    assert failures == [], f"{len(failures)} of {len(cases)} inputs failed:\n" + "\n".join(failures)
    assert outcomes[2] > len(cases) // 2


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_every_reader_survives_damaged_files(sandbox, no_launch, damage, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    keep = tmp_path / "keep"
    shutil.copytree(sandbox["keep"], keep, symlinks=True)
    s = {**sandbox, "keep": keep, "run": keep / "run", "data": keep / "data", "scratch": tmp_path / "scratch"}
    s["scratch"].mkdir()
    target, how = DAMAGES[damage]
    _damage(s, target, how)
    before = _snapshot(keep)
    for name, argv in _base_commands(s).items():
        if name in ("presets", "doctor", "bench", "plan", "prepare-data", "build-ops"):
            continue  # they read none of the damaged files
        code, out, err = _call(argv)
        _check(code, out, err, label=f"{damage}: {name}")
        if how == "contradict" and name in ("report", "slurm-script", "launch", "generate"):  # readers of the run
            assert code == 2 and "command launches 1 node(s) x 2 rank(s)" in err, f"{damage}: {name}: {err}"
        assert _snapshot(keep) == before, f"{damage}: {name} changed an existing file"
        _finite_json(s["scratch"], label=f"{damage}: {name}")


# ---- checkpoint files and generate's numbers (issue 26) -----------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt_sandbox(tmp_path_factory, corpus):
    """A ZeRO-0 run directory with a hand-built checkpoint (DeepSpeed's file formats, no launch) and its export."""
    from tests.helpers import hand_checkpoint

    root = tmp_path_factory.mktemp("fuzzckpt")
    run = root / "run"
    r = _call(
        [
            "gen-config",
            "--model",
            "tiny",
            "--vocab",
            "1024",
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
            "--tp",
            "1",
            "--sp",
            "1",
            "--offload",
            "none",
            "--checkpointing",
            "none",
            "--data",
            str(corpus),
            "--out",
            str(run),
        ]
    )
    assert r[0] == 0, r
    tag = hand_checkpoint(run)
    assert _call(["export-hf", str(run), "--out", str(root / "hf")])[0] == 0
    return {"root": root, "run": run, "tag": tag, "hf": root / "hf"}


def _pickled(obj) -> bytes:
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _flip(raw: bytes, at: float) -> bytes:
    i = int(len(raw) * at)
    return raw[:i] + bytes([raw[i] ^ 0xFF]) + raw[i + 1 :]


FILE_DAMAGES = {
    "empty": lambda raw: b"",
    "garbage": lambda raw: bytes(random.Random(7).randrange(256) for _ in range(777)),
    "first 10 bytes": lambda raw: raw[:10],
    "first half": lambda raw: raw[: len(raw) // 2],
    "no end": lambda raw: raw[:-22],
    "a byte flipped at 1%": lambda raw: _flip(raw, 0.01),
    "a byte flipped at 50%": lambda raw: _flip(raw, 0.5),
    "a byte flipped at 99%": lambda raw: _flip(raw, 0.99),
    "a list": lambda raw: _pickled([1, 2, 3]),
    "a string": lambda raw: _pickled("module"),
    "an empty dict": lambda raw: _pickled({}),
    "a tensor": lambda raw: _pickled(__import__("torch").zeros(3)),
    "a legacy pickle": lambda raw: __import__("pickle").dumps({"module": {"x": 1}}),
    "an unsafe global": lambda raw: _pickled({"module": os.getcwd}),  # a callable: refused, never called
}
CHECKPOINT_FILES = ("mp_rank_00_model_states.pt", "rng-rank0.pt", "rng-rank1.pt")


def _resume_reader(run: Path) -> tuple[int, str, str]:
    """The ranks' reader of a checkpoint (before DeepSpeed loads anything), as the CLI reports errors."""
    from dspipe.errors import SpecError
    from dspipe.rundir import load_run
    from dspipe.runtime.checkpoint import resume_point

    try:
        resume_point(load_run(run))
    except SpecError as e:
        return 2, "", f"dspipe: error: {e}\n"
    return 0, "", ""


@pytest.mark.parametrize("damage", list(FILE_DAMAGES))
def test_every_checkpoint_reader_survives_damaged_checkpoint_files(
    ckpt_sandbox, no_launch, damage, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    for name in CHECKPOINT_FILES:
        run = tmp_path / name / "run"
        shutil.copytree(ckpt_sandbox["run"], run)
        target = run / "checkpoints" / ckpt_sandbox["tag"].name / name
        target.write_bytes(FILE_DAMAGES[damage](target.read_bytes()))
        before = _snapshot(tmp_path / name)
        outcomes = {
            "resume": _resume_reader(run),
            "export-hf": _call(["export-hf", str(run), "--out", str(tmp_path / name / "hf")]),
            "generate": _call(["generate", str(run), "--prompt", "def", "--max-tokens", "3"]),
        }
        for reader, (code, out, err) in outcomes.items():
            label = f"{damage} in {name}: {reader}"
            _check(code, out, err, label=label)
            if code == 2:
                assert str(target) in err or "checkpoint" in err, f"{label}: {err}"
            if damage in ("empty", "garbage", "a list", "a string", "an unsafe global", "first half", "no end"):
                assert code == 2, f"{label}: accepted"
        (tmp_path / name / "hf").exists() and shutil.rmtree(tmp_path / name / "hf")  # a valid export may be written
        assert _snapshot(tmp_path / name) == before, f"{damage} in {name}: a reader changed the run"


GENERATE_NUMBERS = {
    "--temperature": [*BAD["float"], "1e-45", "5e-324", "1e-300", "0.0", "100", "100.0000001", "1e2", "-0.0"],
    "--top-k": [*BAD["int"], "1", "1023", "1024", "1025", "4096", "2147483647", "2147483648"],
    "--max-tokens": [*BAD["int"], "1", "100001"],
    "--seed": [*BAD["int"], "9223372036854775807", "9223372036854775808"],
}


@pytest.mark.parametrize("source", ["run", "hf"])
def test_generate_survives_every_number(ckpt_sandbox, no_launch, source):
    base = ["generate", str(ckpt_sandbox[source]), "--prompt", "def ", "--max-tokens", "3"]
    before = _snapshot(ckpt_sandbox["root"])
    outcomes, failures = {0: 0, 2: 0}, []
    for flag, values in GENERATE_NUMBERS.items():
        for value in values:
            argv = list(base)
            if flag in argv:
                argv[argv.index(flag) + 1] = value
            else:
                argv += [flag, value]
            label = f"generate {source} {flag}={value!r}"
            try:
                code, out, err = _call(argv)
                _check(code, out, err, label=label)
                outcomes[code] += 1
                if code == 0:
                    assert out.startswith("def "), f"{label}: {out!r}"
            except Exception as e:  # noqa: BLE001 - collected, then reported together
                failures.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
    assert failures == [], "\n".join(failures)
    assert outcomes[0] >= 15 and outcomes[2] >= 30, outcomes
    assert _snapshot(ckpt_sandbox["root"]) == before
