"""A run directory -> an sbatch script (templates/slurm.sbatch.j2) that launches it on the job's nodes. No torch.

The script resumes by default (a requeued start always resumes from the newest complete checkpoint), asks Slurm for
USR1 `stop_before` seconds before the time limit, and on USR1 or TERM (pre-emption) stops the run through SIGTERM
(the runner saves and exits) and requeues the job unless the run had saved its final step. Every value that reaches
the script is validated (names, times, numbers) or shell-quoted (paths, launch arguments), and nothing with a control
character gets in: a newline never becomes a command, on a `#SBATCH` line or anywhere else."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from dspipe.cluster.launch import DEFAULT_PORT
from dspipe.errors import SpecError
from dspipe.planner.render import render_template
from dspipe.rundir import Run

# Slurm's [D-]HH[:MM[:SS]] / MM[:SS] forms, ASCII digits only; \Z: no newline after the value
TIME = re.compile(r"^(?:([0-9]+)-)?([0-9]+)(?::([0-9]{2}))?(?::([0-9]{2}))?\Z")
SLURM_NAME = re.compile(r"^[A-Za-z0-9_.+-]+\Z")
SLURM_NAMES = re.compile(r"^[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*\Z")  # --partition takes a list
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
SCRIPT_MARKER = "# dspipe-output: slurm-script (written by 'dspipe slurm-script'; --force replaces it, edits are lost)"
MAX_STOP_BEFORE = 65535  # Slurm's --signal time limit, seconds
# Options the script sets itself and depends on: given again through --sbatch they would break it.
OWN_OPTIONS = (
    "--nodes",
    "-N",
    "--ntasks-per-node",
    "--ntasks",  # the script runs one launcher task per node (srun --ntasks-per-node=1)
    "--ntasks-per-core",
    "--ntasks-per-socket",
    "--ntasks-per-gpu",
    "--array",  # one job of the run's nodes, requeued as itself: an array would start copies of the run
    "--gpus-per-node",
    "--signal",
    "--no-requeue",
    "--open-mode",
    "--no-kill",
    "-k",
    "--requeue",
    "--job-name",
    "-J",
    "--output",
    "-o",
)
FLAG_OPTIONS = {  # sbatch options the script sets from a slurm-script flag: a second line would contradict it
    "--time": "--time",
    "-t": "--time",
    "--partition": "--partition",
    "-p": "--partition",
    "--account": "--account",
    "-A": "--account",
}


def time_limit_seconds(time: str) -> int | None:
    """Slurm's --time forms in seconds (None: 0, no limit); a SpecError for anything else."""
    m = TIME.match(time)
    if not m:
        raise SpecError(f"--time {time!r} is not a Slurm time limit such as 24:00:00 or 2-00:00:00")
    days, first, second, third = m.groups()
    if days is not None:  # D-H, D-H:M, D-H:M:S
        d, h, mi, se = int(days), int(first), int(second or 0), int(third or 0)
        form, bounded = "D-HH[:MM[:SS]]", (("hours", h, 24), ("minutes", mi, 60), ("seconds", se, 60))
    elif third is not None:  # H:M:S
        d, h, mi, se = 0, int(first), int(second), int(third)
        form, bounded = "HH:MM:SS", (("minutes", mi, 60), ("seconds", se, 60))
    else:  # M, M:S
        d, h, mi, se = 0, 0, int(first), int(second or 0)
        form, bounded = "MM:SS", (("seconds", se, 60),)
    for unit, value, limit in bounded:
        if value >= limit:
            raise SpecError(
                f"--time {time!r} ({form}): {unit} {value} must be below {limit}; Slurm's forms are MINUTES, "
                f"MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS"
            )
    seconds = ((d * 24 + h) * 60 + mi) * 60 + se
    if seconds > SLURM_MAX_MINUTES * 60:
        raise SpecError(
            f"--time {time!r} is {seconds // 60:,} minutes, beyond the {SLURM_MAX_MINUTES:,} Slurm can hold (a "
            f"32-bit count of minutes); give 0 for no limit"
        )
    return seconds or None


SLURM_MAX_MINUTES = 2**32 - 2
"""The longest time limit Slurm stores (minutes in a uint32; 2**32 - 1 is its INFINITE)."""


def _plain(value: str, what: str) -> str:
    """A value that goes into the script as is (quoted or not): no control characters."""
    if CONTROL.search(value):
        raise SpecError(
            f"{what} {ascii(value)} contains a control character (newline, tab...); it cannot go into an sbatch script"
        )
    return value


def _sbatch_path(path: str, what: str) -> str:
    """A path on a '#SBATCH' line: sbatch splits at blanks unless double-quoted and knows no escape for '"'; '%'
    starts a file-name pattern ('%%' is one '%'), and a backslash turns the patterns off."""
    _plain(path, what)
    if '"' in path or "\\" in path:
        raise SpecError(f"{what} {path} contains '\"' or '\\', which an #SBATCH line cannot hold; rename it")
    return f'"{path}"' if any(c.isspace() for c in path) else path


def _check_stop_before(stop_before: int, *, time: str) -> None:
    """Refuse a --stop-before outside 10..MAX_STOP_BEFORE seconds or not shorter than the time limit."""
    limit = time_limit_seconds(time)
    if not 10 <= stop_before <= MAX_STOP_BEFORE:
        raise SpecError(f"--stop-before {stop_before} must be in 10..{MAX_STOP_BEFORE} seconds")
    if limit is not None and stop_before >= limit:
        raise SpecError(f"--stop-before {stop_before} s must be shorter than the time limit --time {time} ({limit} s)")


def _check_sbatch_names(*, partition: str | None, account: str | None, extra_sbatch: tuple[str, ...]) -> None:
    """Refuse a --partition or --account that is not a Slurm name, and an --sbatch line the script cannot take."""
    for flag, value, pattern in (("--partition", partition, SLURM_NAMES), ("--account", account, SLURM_NAME)):
        if value is not None and not pattern.match(value):
            raise SpecError(
                f"{flag} {ascii(value)} is not a Slurm name (letters, digits, '_', '.', '+', '-'"
                f"{', comma-separated' if pattern is SLURM_NAMES else ''})"
            )
    for option in extra_sbatch:
        _plain(option, "--sbatch")
        if not option.startswith("--") or option.strip() != option:
            raise SpecError(f"--sbatch {option!r} must be one '--name=value' option line")
        name = option.split("=", 1)[0].split()[0]
        if name in FLAG_OPTIONS:
            raise SpecError(
                f"--sbatch {option!r}: the script sets {name} from slurm-script's {FLAG_OPTIONS[name]}; use it"
            )
        if name in OWN_OPTIONS:
            raise SpecError(
                f"--sbatch {option!r}: the script sets {name} itself"
                + (" (use --stop-before SECONDS)" if name == "--signal" else "")
            )


def _check_restarts(*, max_restarts: int, min_nodes: int | None, nodes: int) -> None:
    """Refuse a --max-restarts outside 0..1000, and a --min-nodes without it or outside the run's nodes."""
    if not 0 <= max_restarts <= 1000:
        raise SpecError(f"--max-restarts must be in 0..1000, got {max_restarts}")
    if min_nodes is not None and (not max_restarts or not 1 <= min_nodes <= nodes):
        raise SpecError(f"--min-nodes {min_nodes} needs --max-restarts N and must be in 1..{nodes} (the run's nodes)")


def _job_options(
    *,
    run: Run,
    run_path: str,
    time: str,
    stop_before: int,
    partition: str | None,
    account: str | None,
    extra_sbatch: tuple[str, ...],
    shrinks: bool,
) -> tuple[list[str], list[str]]:
    """(sbatch, srun): the script's #SBATCH options and its srun options."""
    cluster = run.cluster
    job_name = re.sub(r"[^A-Za-z0-9_.+-]", "_", run.path.name) or "run"
    gpus = [f"--gpus-per-node={cluster.gpus_per_node}"] if cluster.gpu_type.backend == "nccl" else []
    sbatch = [
        f"--job-name=dspipe-{job_name}",
        f"--nodes={cluster.nodes}",
        "--ntasks-per-node=1",
        *gpus,
        f"--time={time}",
        "--output=" + _sbatch_path(f"{run_path.replace('%', '%%')}/slurm-%j.out", "run directory"),
        "--open-mode=append",
        "--requeue",
        f"--signal=B:USR1@{stop_before}",
    ]
    sbatch += [f"--partition={partition}"] if partition else []
    sbatch += [f"--account={account}"] if account else []
    sbatch += ["--no-kill"] if shrinks else []  # a failed node does not end the job: the others continue
    sbatch += list(extra_sbatch)
    srun = [f"--nodes={cluster.nodes}", "--ntasks-per-node=1", f"--kill-on-bad-exit={0 if shrinks else 1}", *gpus]
    return sbatch, srun


def _template_values(
    *,
    run: Run,
    run_path: str,
    script: str,
    cwd: str,
    sbatch: list[str],
    srun: list[str],
    launch: list[str],
    max_restarts: int,
    first_resume_args: list[str],
    stop_before: int,
) -> dict[str, Any]:
    """What slurm.sbatch.j2 renders: the paths shell-quoted, the options, the launch and resume arguments."""
    cluster = run.cluster
    return dict(
        run_dir=shlex.quote(run_path),
        nodes=cluster.nodes,
        gpus_per_node=cluster.gpus_per_node,
        world_size=run.plan.world_size,
        script_path=shlex.quote(script),
        marker=SCRIPT_MARKER,
        sbatch_options=sbatch,
        workdir=shlex.quote(cwd),
        hostfile_prefix=shlex.quote(str(run.path / "hostfile.slurm")),
        srun_options=shlex.join(srun),
        launch_args=shlex.join(launch),
        max_requeues=max_restarts,
        first_resume_args=shlex.join(first_resume_args),
        stop_before=stop_before,
        steps=int(run.train.steps),
        latest_file=shlex.quote(str(run.checkpoint_dir / "latest")),
        checkpoint_dir=shlex.quote(str(run.checkpoint_dir)),
    )


def render_slurm_script(
    *,
    run: Run,
    script_path: Path,
    workdir: Path,
    time: str,
    partition: str | None,
    account: str | None,
    extra_sbatch: tuple[str, ...],
    master_port: int | None,
    launch_args: list[str],
    first_resume_args: list[str] = (),
    stop_before: int = 300,
    max_restarts: int = 0,
    min_nodes: int | None = None,
) -> str:
    """The sbatch script: hostfile from $SLURM_JOB_NODELIST, then one `dspipe launch --no-ssh` per node via srun
    (in the background, so that the script can take Slurm's signals), then a requeue if the run was stopped.
    `max_restarts` > 0: each node's launch runs under torch's elastic agent with --max-restarts (a dead or hung rank
    restarts the job inside the allocation), and a run step that still fails (a node lost, the restarts used up) is
    requeued, up to `max_restarts` requeues; `min_nodes` below the run's nodes keeps the job alive when a node fails
    (--no-kill) so that the other nodes continue at the smaller dp."""
    cluster = run.cluster
    _check_stop_before(stop_before, time=time)
    _check_sbatch_names(partition=partition, account=account, extra_sbatch=extra_sbatch)
    _check_restarts(max_restarts=max_restarts, min_nodes=min_nodes, nodes=cluster.nodes)
    elastic = ["--max-restarts", str(max_restarts)] if max_restarts else []
    elastic += ["--min-nodes", str(min_nodes)] if min_nodes is not None else []
    shrinks = min_nodes is not None and min_nodes < cluster.nodes
    for arg in [*launch_args, *first_resume_args]:
        _plain(arg, "launch argument")
    run_path, script, cwd = (
        _plain(str(p), what)
        for p, what in ((run.path, "run directory"), (script_path, "--out"), (workdir, "working directory"))
    )
    sbatch, srun = _job_options(
        run=run,
        run_path=run_path,
        time=time,
        stop_before=stop_before,
        partition=partition,
        account=account,
        extra_sbatch=extra_sbatch,
        shrinks=shrinks,
    )
    values = _template_values(
        run=run,
        run_path=run_path,
        script=script,
        cwd=cwd,
        sbatch=sbatch,
        srun=srun,
        launch=["--master-port", str(master_port or DEFAULT_PORT), *elastic, *launch_args],
        max_restarts=max_restarts,
        first_resume_args=first_resume_args,
        stop_before=stop_before,
    )
    return render_template("slurm.sbatch.j2", values)


def is_slurm_script(path: Path) -> bool:
    """Whether `path` is a script slurm-script wrote (its marker line, or the first lines of an older one)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", errors="replace").splitlines()[:3]
    except OSError:
        return False
    if len(head) < 2 or head[0] != "#!/bin/bash" or not head[1].startswith("# dspipe run "):
        return False
    return len(head) > 2 and head[2].startswith((SCRIPT_MARKER.split(" (")[0], "#SBATCH --job-name=dspipe-"))
