"""The sbatch script of `dspipe slurm-script` run for real by bash against stand-ins for srun, scontrol and dspipe
(no Slurm here): resume choices reach `dspipe launch`, USR1/TERM stop the run with SIGTERM and requeue the job unless
the run had finished, and hostile values (newlines, ';', '$()') never become commands. Also `dspipe launch`'s
--resume/--restart pass-through and the world-size advice."""

import contextlib
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dspipe.cluster.slurm import time_limit_seconds
from dspipe.errors import SpecError
from tests.helpers import dspipe

TINY = [
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
    "--precision",
    "fp32",
    "--zero",
    "1",
]
HOSTILE = "r $(touch PWNED1); `touch PWNED2` 'q %j"  # a legal directory name full of shell syntax

FAKE_SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done   # srun's options, then the task's command
export SLURM_NODEID=0
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
if [ "$1" = show ]; then echo node-a; else echo "$*" >> "$FAKE_LOG/scontrol"; fi
"""
FAKE_DSPIPE = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_LOG/args.tmp" && mv "$FAKE_LOG/args.tmp" "$FAKE_LOG/args"
if [ -n "${FAKE_DONE:-}" ]; then exit 0; fi
trap 'echo TERM >> "$FAKE_LOG/signals"; exit 0' TERM
while :; do sleep 0.05; done
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory, corpus):
    """A run directory with a hostile name on a prepared corpus, fake Slurm tools on PATH, and a place for their
    logs."""
    root = tmp_path_factory.mktemp("slurm")
    r = dspipe(*TINY, "--data", str(corpus), "--out", f"runs/{HOSTILE}", cwd=root)
    assert r.returncode == 0, r.stderr
    fake = root / "bin"
    fake.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("dspipe", FAKE_DSPIPE)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    return root


@contextlib.contextmanager
def complete_checkpoints(job: Path, *tags: str):
    """Complete checkpoints (their dspipe.json) of the run for the test's duration: what --resume TAG must name."""
    made = [job / "runs" / HOSTILE / "checkpoints" / tag for tag in tags]
    for tag in made:
        tag.mkdir(parents=True)
        (tag / "dspipe.json").write_text("{}")
    try:
        yield
    finally:
        for tag in made:
            subprocess.run(["rm", "-rf", str(tag)], check=True)


def script(job: Path, name: str, *flags) -> Path:
    r = dspipe(
        "slurm-script",
        f"runs/{HOSTILE}",
        "--out",
        name,
        "--force",
        "--ifname",
        "eth0",
        "--env",
        "FOO=a;b",
        *flags,
        cwd=job,
    )
    assert r.returncode == 0, r.stderr
    path = job / name
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    return path


def run_job(job: Path, path: Path, *, signal_to_send=None, env=None) -> tuple[int, dict]:
    logs = job / "logs"
    subprocess.run(["rm", "-rf", str(logs)], check=True)
    logs.mkdir()
    environ = {
        **os.environ,
        "PATH": f"{job / 'bin'}:{os.environ['PATH']}",
        "FAKE_LOG": str(logs),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node-a",
    }
    environ.pop("SLURM_RESTART_COUNT", None)
    environ.update(env or {})
    proc = subprocess.Popen(["bash", str(path)], cwd=job / "bin", env=environ, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not (logs / "args").exists() and time.time() < deadline:
        assert proc.poll() is None or (env or {}).get("FAKE_DONE"), proc.stderr.read()
        time.sleep(0.05)
    if signal_to_send is not None:
        time.sleep(0.3)  # the fake is in its loop, the script in `wait`
        proc.send_signal(signal_to_send)
    proc.wait(timeout=30)
    result = {p.name: p.read_text() for p in logs.iterdir()}
    result["stderr"] = proc.stderr.read()
    return proc.returncode, result


def test_usr1_stops_the_run_and_requeues_the_job(job):
    rc, logs = run_job(job, script(job, "a.sbatch"), signal_to_send=signal.SIGUSR1)
    assert rc == 0, logs
    assert logs["signals"] == "TERM\n"  # the run got SIGTERM (it saves and exits)
    assert logs["scontrol"] == "requeue 42\n"
    args = logs["args"].splitlines()
    assert args[:2] == ["launch", f"runs/{HOSTILE}"]  # the hostile name arrives literally
    assert args[2:] == [
        "--hostfile",
        f"runs/{HOSTILE}/hostfile.slurm-42",
        "--no-ssh",
        "--node-rank",
        "0",
        "--master-addr",
        "node-a",
        "--master-port",
        "29500",
        "--ifname",
        "eth0",
        "--timeout-min",
        "30",
        "--env",
        "FOO=a;b",
    ]  # resumes by default: no flag
    assert not list(job.rglob("PWNED*"))


def test_pre_emption_term_requeues_too(job):
    rc, logs = run_job(job, script(job, "b.sbatch"), signal_to_send=signal.SIGTERM)
    assert rc == 0 and logs["signals"] == "TERM\n" and logs["scontrol"] == "requeue 42\n", logs


def test_a_finished_run_is_not_requeued(job):
    tag = job / "runs" / HOSTILE / "checkpoints" / "global_step6"
    tag.mkdir(parents=True)
    (tag / "dspipe.json").write_text("{}")
    (tag.parent / "latest").write_text("global_step6")
    try:
        rc, logs = run_job(job, script(job, "c.sbatch"), signal_to_send=signal.SIGUSR1)
    finally:
        subprocess.run(["rm", "-rf", str(tag.parent)], check=True)
    assert rc == 0 and "scontrol" not in logs and "not requeued" in logs["stderr"], logs


def test_a_run_that_ends_by_itself_is_not_requeued(job):
    rc, logs = run_job(job, script(job, "d.sbatch"), env={"FAKE_DONE": "1"})
    assert rc == 0 and "scontrol" not in logs and "signals" not in logs, logs


@pytest.mark.parametrize(
    "flags,restarts,expected",
    [
        (["--restart"], "0", ["--restart"]),
        (["--restart"], "1", []),  # a requeued start resumes, never restarts again
        (["--resume", "global_step2"], "0", ["--resume", "global_step2"]),
        (["--resume", "global_step2"], "3", []),
        ([], "0", []),
    ],
)
def test_resume_choice_applies_to_the_first_start_only(job, flags, restarts, expected):
    with complete_checkpoints(job, "global_step2"):
        path = script(job, "e.sbatch", *flags)
    rc, logs = run_job(job, path, env={"FAKE_DONE": "1", "SLURM_RESTART_COUNT": restarts})
    assert rc == 0, logs
    args = logs["args"].splitlines()
    assert args[args.index("FOO=a;b") + 1 :] == expected


def test_script_header(job):
    text = script(job, "f.sbatch", "--time", "1:00:00", "--stop-before", "600").read_text()
    for line in (
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@600",
        "#SBATCH --open-mode=append",
        f'#SBATCH --output="runs/{HOSTILE.replace("%", "%%")}/slurm-%j.out"',
    ):
        assert line + "\n" in text
    assert text.splitlines()[2].startswith("# dspipe-output: slurm-script")


def test_script_without_blanks_in_the_path_is_unquoted(tmp_path):
    r = dspipe(*TINY, "--out", "runs/plain", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = dspipe("slurm-script", "runs/plain", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --output=runs/plain/slurm-%j.out\n" in (tmp_path / "runs/plain/slurm.sbatch").read_text()


HOSTILE_VALUES = [
    (["--partition", "gpu\n#SBATCH --wrap=reboot"], "--partition 'gpu\\n#SBATCH --wrap=reboot' is not a Slurm name"),
    (["--partition", "gpu;reboot"], "is not a Slurm name"),
    (["--account", "$(reboot)"], "--account '$(reboot)' is not a Slurm name"),
    (["--sbatch", "--comment=x\nreboot"], "contains a control character"),
    (["--sbatch", "--signal=B:TERM@60"], "the script sets --signal itself (use --stop-before SECONDS)"),
    (["--sbatch", "exclusive"], "must be one '--name=value' option line"),
    (["--sbatch=--time=5"], "the script sets --time from slurm-script's --time; use it"),
    (["--sbatch=--partition=gpu"], "the script sets --partition from slurm-script's --partition; use it"),
    (["--sbatch=--account=a"], "the script sets --account from slurm-script's --account"),
    (["--sbatch=--job-name=x"], "the script sets --job-name itself"),
    (["--sbatch=--output=/tmp/x"], "the script sets --output itself"),
    (["--ifname", "eth0\nreboot"], "is not a device list"),
    (["--ifname", "eth0;reboot"], "is not a device list"),
    (["--ib-hca", "$(reboot)"], "is not a device list"),
    (["--env", "A=b\nreboot"], "control characters"),
    (["--env", "A=$(reboot)"], "quotes, '$', '\\' and newlines"),
    (["--env", "A=b "], "DeepSpeed's launcher strips leading and trailing spaces from an exported value; give A='b'"),
    (["--time", "1:00:00\nreboot"], "is not a Slurm time limit"),
    (["--time", "60\n"], "--time '60\\n' is not a Slurm time limit"),  # a regex $ matched before the newline
    (["--time", "\u0661\u0662"], "is not a Slurm time limit"),  # Arabic-Indic digits: Slurm reads ASCII ones
    (["--partition", "gpu\n"], "is not a Slurm name"),
    (["--sbatch=--ntasks=7"], "the script sets --ntasks itself"),
    (["--sbatch=--array=1-3"], "the script sets --array itself"),
    (
        ["--time", "99999999999"],
        "--time '99999999999' is 99,999,999,999 minutes, beyond the 4,294,967,294 Slurm can hold",
    ),
    (["--resume", "x\nreboot"], "is not auto, a checkpoint tag"),
    (["--resume", "auto", "--restart"], "contradict each other"),
    (["--stop-before", "5"], "--stop-before 5 must be in 10..65535"),
    (["--time", "10", "--stop-before", "600"], "--stop-before 600 s must be shorter than the time limit --time 10"),
    (["--out", "x\n.sbatch"], "contains a control character"),
]


@pytest.mark.parametrize("flags,message", HOSTILE_VALUES, ids=[m[:40] for _, m in HOSTILE_VALUES])
def test_hostile_values_are_refused_and_nothing_is_written(tmp_path, job, flags, message):
    before = sorted(p.name for p in (job / "runs" / HOSTILE).iterdir())
    r = dspipe("slurm-script", f"runs/{HOSTILE}", "--out", tmp_path / "s.sbatch", *flags, cwd=job)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("dspipe: error: ") and message in lines[0], lines
    assert list(tmp_path.iterdir()) == [] and sorted(p.name for p in (job / "runs" / HOSTILE).iterdir()) == before


def test_a_run_path_with_a_newline_is_refused(tmp_path, job):
    bad = tmp_path / "a\nreboot"
    subprocess.run(["cp", "-r", str(job / "runs" / HOSTILE), str(bad)], check=True)
    r = dspipe("slurm-script", bad, "--out", tmp_path / "s.sbatch", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "contains a control character" in r.stderr, r.stderr
    assert not (tmp_path / "s.sbatch").exists()


def test_time_limits():
    assert [time_limit_seconds(t) for t in ("30", "30:15", "2:00:00", "1-0", "1-2:30", "1-00:00:01", "0")] == [
        1800,
        1815,
        7200,
        86400,
        95400,
        86401,
        None,
    ]
    with pytest.raises(SpecError, match="is not a Slurm time limit"):
        time_limit_seconds("1:2:3:4")


# ---- dspipe launch ------------------------------------------------------------------------------------------------


def launch_argv(job: Path, *flags) -> list[str]:
    r = dspipe("launch", f"runs/{HOSTILE}", "--dry-run", *flags, cwd=job)
    assert r.returncode == 0, r.stderr
    return shlex.split([ln for ln in r.stdout.splitlines() if ln and not ln.startswith(("#", "export "))][-1])


def test_launch_passes_resume_choices_through(job):
    assert launch_argv(job)[-2:] == ["--run", f"runs/{HOSTILE}"]  # nothing given: the runner's default (auto)
    assert launch_argv(job, "--restart")[-3:] == ["--run", f"runs/{HOSTILE}", "--restart"]
    with complete_checkpoints(job, "global_step4"):
        assert launch_argv(job, "--resume", "global_step4")[-2:] == ["--resume", "global_step4"]
    assert launch_argv(job, "--resume", "auto")[-2:] == ["--resume", "auto"]
    r = dspipe("launch", f"runs/{HOSTILE}", "--dry-run", "--resume", "auto", "--restart", cwd=job)
    assert r.returncode == 2 and r.stderr.strip() == (
        "dspipe: error: --resume auto and --restart contradict each other: give one"
    )


def test_world_size_advice_keeps_checkpoints(job):
    r = dspipe("launch", f"runs/{HOSTILE}", "--dry-run", "--num-gpus", "1", cwd=job)
    assert r.returncode == 2
    assert "--force' (same model flags: it rewrites only the config and keeps the checkpoints and metrics)" in r.stderr
