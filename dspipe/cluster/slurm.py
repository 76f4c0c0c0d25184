"""A run directory -> an sbatch script (templates/slurm.sbatch.j2) that launches it on the job's nodes. No torch."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from dspipe.errors import SpecError
from dspipe.cluster.launch import DEFAULT_PORT
from dspipe.planner.render import render_template
from dspipe.rundir import Run

TIME = re.compile(r"^(\d+-)?\d+(:\d{2}){0,2}$")  # Slurm's [D-]HH[:MM[:SS]] / MM forms


def render_slurm_script(*, run: Run, script_path: Path, workdir: Path, time: str, partition: str | None,
                        account: str | None, extra_sbatch: tuple[str, ...], master_port: int | None,
                        launch_args: list[str]) -> str:
    """The sbatch script: hostfile from $SLURM_JOB_NODELIST, then one `dspipe launch --no-ssh` per node via srun."""
    cluster = run.cluster
    if not TIME.match(time):
        raise SpecError(f"--time {time!r} is not a Slurm time limit such as 24:00:00 or 2-00:00:00")
    for option in extra_sbatch:
        if not option.startswith("--") or any(c in option for c in "\n\r"):
            raise SpecError(f"--sbatch {option!r} must be one '--name=value' option line")
    gpus = [f"--gpus-per-node={cluster.gpus_per_node}"] if cluster.gpu_type.backend == "nccl" else []
    sbatch = [f"--job-name=dspipe-{run.path.name}", f"--nodes={cluster.nodes}", "--ntasks-per-node=1", *gpus,
              f"--time={time}", f"--output={run.path}/slurm-%j.out"]
    sbatch += [f"--partition={partition}"] if partition else []
    sbatch += [f"--account={account}"] if account else []
    sbatch += list(extra_sbatch)
    srun = [f"--nodes={cluster.nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1", *gpus]
    values = dict(
        run_dir=shlex.quote(str(run.path)), nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node,
        world_size=run.plan.world_size, script_path=shlex.quote(str(script_path)),
        sbatch_options=sbatch, workdir=shlex.quote(str(workdir)),
        hostfile_prefix=shlex.quote(str(run.path / "hostfile.slurm")),
        srun_options=shlex.join(srun),
        launch_args=shlex.join(["--master-port", str(master_port or DEFAULT_PORT), *launch_args]),
    )
    return render_template("slurm.sbatch.j2", values)
