"""Launch options -> the `deepspeed` command(s) and environment for a run, checked before anything starts. No torch.

DeepSpeed's runner does all process start-up (pdsh, OpenMPI, Slurm, or one launcher per node with --no_ssh);
this module only decides its arguments and refuses launches that cannot work.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from dspipe.cluster.hostfile import Host, Hostfile, describe, read_hostfile, select
from dspipe.cluster.hostname import check_host
from dspipe.cluster.netenv import ENV_FILE
from dspipe.cluster.store import check_reachable, endpoint_text
from dspipe.errors import SpecError
from dspipe.runtime.elastic import NODE_RANK_ENV
from dspipe.runtime.watchdog import check_hang_timeout

LAUNCHERS = ("pdsh", "openmpi", "slurm")
LAUNCHER_PROGRAMS = {"pdsh": "pdsh and ssh", "openmpi": "mpirun", "slurm": "srun"}
DEFAULT_PORT = 29500  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT
MAX_NODES, MAX_SLOTS = 65536, 1024  # sanity bounds for --num-nodes / --num-gpus (ranks per node)
# What each multi-node backend needs on this machine (DeepSpeed checks the first; we check before it starts).
BACKEND_TOOLS = {"pdsh": ("pdsh",), "openmpi": ("ompi_info", "mpirun"), "slurm": ("sinfo", "srun")}
# DeepSpeed quotes exported values outside this set; mpirun -x and srun --export then pass the quotes literally.
PLAIN_VALUE = re.compile(r"^[\w@%+=:,./-]*$")


@dataclass(frozen=True)
class LaunchSpec:
    """The launch options, as the user gave them (None / '' = not given)."""

    hostfile: str | None = None
    include: str = ""
    exclude: str = ""
    num_nodes: int | None = None
    num_gpus: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = "pdsh"
    no_ssh: bool = False
    node_rank: int | None = None
    ssh_port: int | None = None

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise SpecError(f"--launcher {self.launcher!r} is not one of: {', '.join(LAUNCHERS)}")
        for flag, value, most in (("--num-nodes", self.num_nodes, MAX_NODES), ("--num-gpus", self.num_gpus, MAX_SLOTS)):
            if value is not None and not 1 <= value <= most:
                raise SpecError(f"{flag} must be in 1..{most}, got {value}")
        for flag, port in (("--master-port", self.master_port), ("--ssh-port", self.ssh_port)):
            if port is not None and not 0 < port < 65536:
                raise SpecError(f"{flag} {port} is not a TCP port (1-65535)")
        if self.master_addr is not None:  # it reaches the launcher's argv and every rank's MASTER_ADDR
            check_host(self.master_addr, what="--master-addr")
        if self.node_rank is not None and not self.no_ssh:
            raise SpecError("--node-rank only applies with --no-ssh (each node starts its own share)")
        if self.no_ssh and not self.hostfile:
            raise SpecError("--no-ssh needs --hostfile: every node must know the whole cluster and its own rank")
        if self.ssh_port is not None and (self.no_ssh or not self.hostfile or self.launcher != "pdsh"):
            how = (
                "--no-ssh starts no ssh"
                if self.no_ssh
                else "a launch without --hostfile starts no ssh"
                if not self.hostfile
                else f"--launcher {self.launcher} starts the ranks through {LAUNCHER_PROGRAMS[self.launcher]}, "
                "not through DeepSpeed's ssh (set the port in ~/.ssh/config)"
            )
            raise SpecError(f"--ssh-port {self.ssh_port} applies only to pdsh's ssh: {how}")
        if self.launcher != "pdsh":
            if not self.hostfile:
                raise SpecError(f"--launcher {self.launcher} needs --hostfile (the nodes to start ranks on)")
            if self.no_ssh:
                raise SpecError(
                    f"--no-ssh starts DeepSpeed's own launcher on each node; it does not combine with "
                    f"--launcher {self.launcher}"
                )
            if self.master_addr or self.master_port:
                raise SpecError(
                    f"--launcher {self.launcher} does not pass --master-addr/--master-port to the ranks: "
                    f"DeepSpeed finds rank 0 through mpi4py (hostname -I of rank 0, port {DEFAULT_PORT})"
                )
        if self.launcher == "openmpi" and (self.include or self.exclude or self.num_nodes or self.num_gpus):
            raise SpecError(
                "--launcher openmpi runs every slot of the hostfile: DeepSpeed's OpenMPI backend takes no "
                "--include/--exclude/--num-nodes/--num-gpus (edit the hostfile instead)"
            )


@dataclass(frozen=True)
class Command:
    node_rank: int | None
    """The node this command is for (--no-ssh), or None: one command for the whole cluster."""
    host: str
    """The host it runs on (the first host when one command starts every node)."""
    argv: tuple[str, ...]


@dataclass(frozen=True)
class Launch:
    """What runs where: resolved hosts and slots, the command(s) and the rank environment."""

    hostfile: Hostfile | None
    resources: dict[str, list[int]]
    commands: tuple[Command, ...]
    env: dict[str, str]
    env_file: Path
    multi_node_exec: bool
    """True when DeepSpeed's runner itself reaches the other nodes (pdsh / mpirun / srun)."""
    rendezvous_port: int | None = DEFAULT_PORT
    """The port rank 0's node must have free (None: the launcher picks its own, torch's --standalone, or the store
    is elsewhere)."""
    rendezvous_store: tuple[str, int] | None = None
    """(host, port) of the `dspipe rendezvous` store every node's agent must reach (None: none)."""

    @property
    def world_size(self) -> int:
        return sum(len(s) for s in self.resources.values())

    @property
    def nodes(self) -> int:
        return len(self.resources)

    def child_env(self) -> dict[str, str]:
        """Our environment plus the rank environment: on the local and --no-ssh paths DeepSpeed's runner does not
        read .deepspeed_env, so the variables reach the ranks through the launcher's own environment."""
        return {**os.environ, **self.env, "DS_ENV_FILE": str(self.env_file.resolve())}

    def shell_text(self) -> str:
        """The --dry-run output: the environment as exports, then the command(s), runnable as a shell script."""
        lines = [
            f"# rank environment ({self.env_file}; DeepSpeed's launcher exports it on every node)",
            f"export DS_ENV_FILE={shlex.quote(str(self.env_file.resolve()))}",
        ]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in self.env.items()]
        for c in self.commands:
            where = (
                f"node {c.node_rank} of {self.nodes}: run on {c.host}"
                if c.node_rank is not None
                else f"{self.nodes} node(s), {self.world_size} rank(s): {describe(self.resources)}"
            )
            lines += [f"# {where}", shlex.join(c.argv)]
        return "\n".join(lines) + "\n"


def deepspeed_prefix() -> list[str]:
    """The `deepspeed` launcher of this Python environment."""
    exe = shutil.which("deepspeed")
    return (
        ["deepspeed"]
        if exe and Path(exe).parent == Path(sys.executable).parent
        else [sys.executable, "-m", "deepspeed.launcher.runner"]
    )


def _local_pool(spec: LaunchSpec, *, default_gpus: int) -> tuple[dict[str, list[int]], list[str]]:
    """Resources and flags on one machine without a hostfile (DeepSpeed's 'localhost' pool)."""
    if spec.include or spec.exclude:
        from deepspeed.accelerator import get_accelerator  # the pool DeepSpeed filters: every local device

        pool = Hostfile(source="this machine", hosts=(Host("localhost", get_accelerator().device_count(), 0),))
        flags = ["--include", spec.include] if spec.include else ["--exclude", spec.exclude]
        return select(pool, include=spec.include, exclude=spec.exclude), flags
    if spec.num_nodes and spec.num_nodes > 1:
        raise SpecError(f"--num-nodes {spec.num_nodes} needs --hostfile listing the nodes")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if visible and not spec.num_gpus:  # DeepSpeed turns it into --include localhost:<ids>
        return {"localhost": [int(i) for i in visible.split(",") if i.strip().isdigit()]}, []
    gpus = spec.num_gpus or default_gpus
    return {"localhost": list(range(gpus))}, ["--num_gpus", str(gpus)]


def resolve(spec: LaunchSpec, *, default_gpus: int) -> tuple[Hostfile | None, dict[str, list[int]], list[str]]:
    """(hostfile, {host: slot ids}, deepspeed resource flags)."""
    if not spec.hostfile:
        return None, *_local_pool(spec, default_gpus=default_gpus)
    hostfile = read_hostfile(spec.hostfile)
    resources = select(
        hostfile, include=spec.include, exclude=spec.exclude, num_nodes=spec.num_nodes, num_gpus=spec.num_gpus
    )
    if spec.launcher == "slurm":
        counts = {len(s) for s in resources.values()}
        if len(counts) > 1 or any(s != list(range(len(s))) for s in resources.values()):
            raise SpecError(
                f"--launcher slurm starts the same number of ranks on every node (srun -n), from slot 0; "
                f"the selection is {describe(resources)}"
            )
    flags = ["--hostfile", spec.hostfile]
    for flag, value in (
        ("--include", spec.include),
        ("--exclude", spec.exclude),
        ("--num_nodes", spec.num_nodes),
        ("--num_gpus", spec.num_gpus),
    ):
        if value:
            flags += [flag, str(value)]
    return hostfile, resources, flags


def build(
    spec: LaunchSpec,
    *,
    program: list[str],
    env: dict[str, str],
    env_file: Path,
    default_gpus: int,
    prefix: list[str] | None = None,
) -> Launch:
    """Resolve the hosts and build the deepspeed command(s) that start `program` (script and its arguments)."""
    hostfile, resources, flags = resolve(spec, default_gpus=default_gpus)
    nodes = len(resources)
    prefix = prefix or deepspeed_prefix()
    multi = hostfile is not None and nodes > 1 and not spec.no_ssh
    if spec.launcher != "pdsh":
        flags += ["--launcher", spec.launcher]
        bad = {k: v for k, v in env.items() if not PLAIN_VALUE.match(v)}
        if bad and multi:
            raise SpecError(
                f"--launcher {spec.launcher} cannot export {', '.join(f'{k}={v}' for k, v in bad.items())}:"
                f" DeepSpeed quotes such values and {spec.launcher} passes the quotes on literally"
            )
    if spec.ssh_port:
        flags += ["--ssh_port", str(spec.ssh_port)]
    master_addr = spec.master_addr or (next(iter(resources)) if spec.no_ssh else None)
    if master_addr:
        flags += ["--master_addr", master_addr]
    if spec.launcher == "pdsh":
        flags += ["--master_port", str(spec.master_port or DEFAULT_PORT)]
    if spec.no_ssh:
        if spec.node_rank is not None and not 0 <= spec.node_rank < nodes:
            raise SpecError(
                f"--node-rank {spec.node_rank} is outside 0..{nodes - 1} ({nodes} nodes: {describe(resources)})"
            )
        ranks = [spec.node_rank] if spec.node_rank is not None else list(range(nodes))
        hosts = list(resources)
        commands = tuple(
            Command(r, hosts[r], (*prefix, *flags, "--no_ssh", "--node_rank", str(r), *program)) for r in ranks
        )
    else:
        commands = (Command(None, next(iter(resources)), (*prefix, *flags, *program)),)
    return Launch(
        hostfile=hostfile, resources=resources, commands=commands, env=env, env_file=env_file, multi_node_exec=multi
    )


def check_world(
    launch: Launch, *, expected: int, nodes: int, gpus_per_node: int, run_path: Path, spec: LaunchSpec, tp: int = 1
) -> None:
    """Refuse a launch whose world size differs from the one the config was generated for, or (tp > 1) whose nodes
    would split a tensor-parallel group: ranks go to the nodes in order, tp consecutive ranks to a group, so every
    node's slots must be a multiple of tp."""
    if nodes > 1 and not spec.hostfile:
        raise SpecError(f"{run_path} was generated for {nodes} nodes x {gpus_per_node}; pass --hostfile listing them")
    if launch.world_size == expected:
        split = [f"{host} {len(slots)}" for host, slots in launch.resources.items() if len(slots) % tp]
        if split:
            raise SpecError(
                f"{run_path} runs tp {tp}: each node's slots must be a multiple of {tp}, or a tensor-parallel "
                f"group spans two nodes (slots {', '.join(split)} of {describe(launch.resources)}; the plan has "
                f"{nodes} x {gpus_per_node}); select whole groups with --include/--exclude or regenerate"
            )
        return
    source = (
        f"hostfile {spec.hostfile}"
        if spec.hostfile
        else (f"--num-gpus {spec.num_gpus}" if spec.num_gpus else "this machine")
    )
    regen = f"--hostfile {spec.hostfile}" if spec.hostfile else f"--nodes 1 --gpus-per-node {launch.world_size}"
    raise SpecError(
        f"{run_path} was generated for world size {expected} ({nodes} nodes x {gpus_per_node}), but "
        f"{source} gives {launch.world_size} ({describe(launch.resources)}); regenerate with "
        f"'dspipe gen-config ... {regen} --out {run_path} --force' (same model flags: it rewrites only "
        f"the config and keeps the checkpoints and metrics) or select {expected} slots "
        f"with --include/--exclude/--num-gpus"
    )


@dataclass(frozen=True)
class Elastic:
    """`dspipe launch --max-restarts N`: torch's elastic agent (torch.distributed.run) starts the ranks instead of
    DeepSpeed's launcher, and restarts all of them, up to N times, when one fails or hangs (the rank's watchdog ends
    it) or a node is lost; a restart on fewer nodes (down to min_nodes) continues at the smaller dp."""

    max_restarts: int
    min_nodes: int | None = None
    """The fewest nodes a restart continues on (None: every node of the run)."""
    hang_timeout_s: float = 600.0
    """Seconds a rank may wait inside one collective during the steps before the job is restarted (0: no limit)."""
    rejoin_wait_s: int = 30
    """After a failure, how long the agents wait for more nodes once min_nodes are back (the rendezvous' last call)."""
    rendezvous: tuple[str, int] | None = None
    """(host, port) of a store `dspipe rendezvous` serves off the training nodes (None: node 0's agent holds it)."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_restarts <= 1000:
            raise SpecError(f"--max-restarts must be in 1..1000, got {self.max_restarts}")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= MAX_NODES:
            raise SpecError(f"--min-nodes must be in 1..{MAX_NODES}, got {self.min_nodes}")
        check_hang_timeout(self.hang_timeout_s)
        if not 1 <= self.rejoin_wait_s <= 86400:
            raise SpecError(f"--rejoin-wait must be in 1..86400 seconds, got {self.rejoin_wait_s}")


def build_elastic(
    spec: LaunchSpec,
    elastic: Elastic,
    *,
    program: list[str],
    env: dict[str, str],
    env_file: Path,
    default_gpus: int,
    nodes: int,
    run_id: str,
) -> Launch:
    """The torch elastic agent's command for this node: --standalone on one machine; on several, one agent per node
    (--no-ssh --node-rank R, as slurm-script launches), meeting through a c10d rendezvous on the master's port."""
    hostfile, resources, _ = resolve(spec, default_gpus=default_gpus)
    min_nodes = nodes if elastic.min_nodes is None else elastic.min_nodes
    hosts = list(resources)
    node = _elastic_node(spec, hostfile=hostfile, resources=resources, min_nodes=min_nodes, nodes=nodes)
    slots = resources[hosts[node]]
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(len(slots)),
        "--max-restarts",
        str(elastic.max_restarts),
        "--monitor-interval",
        "1",
    ]
    _check_store(spec, elastic, several=hostfile is not None)
    if hostfile is None:
        argv += ["--standalone"]
        port = None
    else:
        port = None if elastic.rendezvous else spec.master_port or DEFAULT_PORT
        argv += _rendezvous_args(
            endpoint=elastic.rendezvous or (spec.master_addr or hosts[0], port),
            external=elastic.rendezvous is not None,
            min_nodes=min_nodes,
            nodes=nodes,
            run_id=run_id,
            rejoin_wait_s=elastic.rejoin_wait_s,
        )
    env = _elastic_env(env, node_rank=spec.node_rank, slots=slots)
    module = program[program.index("--module") + 1 :] if "--module" in program else program
    module = ["--run-dir" if a == "--run" else a for a in module]  # torch.distributed.run reads --run as --run-path
    argv += ["-m", *module, "--hang-timeout", f"{elastic.hang_timeout_s:g}"]
    command = Command(spec.node_rank if spec.no_ssh else None, hosts[node], tuple(argv))
    return Launch(
        hostfile=hostfile,
        resources=resources,
        commands=(command,),
        env=env,
        env_file=env_file,
        multi_node_exec=False,
        rendezvous_port=port,
        rendezvous_store=elastic.rendezvous,
    )


def _check_store(spec: LaunchSpec, elastic: Elastic, *, several: bool) -> None:
    """--rendezvous HOST:PORT: for several nodes only, instead of --master-addr / --master-port."""
    if elastic.rendezvous is None:
        return
    if not several:
        raise SpecError(
            "--rendezvous is for runs on several nodes (one node's agent meets no one: it runs --standalone)"
        )
    given = [f for f, v in (("--master-addr", spec.master_addr), ("--master-port", spec.master_port)) if v]
    if given:
        raise SpecError(
            f"--rendezvous {endpoint_text(*elastic.rendezvous)} replaces {' and '.join(given)}: the agents meet at "
            f"the store, not on node 0"
        )


def _elastic_node(spec: LaunchSpec, *, hostfile, resources, min_nodes: int, nodes: int) -> int:
    """This node's rank among the hosts of `resources`; refuses what the elastic agent cannot launch."""
    if min_nodes > nodes:
        raise SpecError(f"--min-nodes {min_nodes} is more than the run's {nodes} node(s)")
    if spec.launcher != "pdsh":
        raise SpecError(
            f"--max-restarts starts torch's elastic agent on each node itself; it does not combine with "
            f"--launcher {spec.launcher} (use --no-ssh --node-rank R on every node, as slurm-script does)"
        )
    if hostfile is not None and not spec.no_ssh:
        raise SpecError(
            "--max-restarts with --hostfile needs --no-ssh --node-rank R on every node (one elastic agent "
            "per node, as slurm-script launches): pdsh would not restart a lost node's ranks"
        )
    hosts = list(resources)
    if spec.no_ssh and spec.node_rank is None and len(hosts) > 1:
        raise SpecError(
            f"--no-ssh starts one node per command: run this with --node-rank R (0..{len(hosts) - 1}) on each node"
        )
    node = spec.node_rank or 0
    if not 0 <= node < len(hosts):
        raise SpecError(
            f"--node-rank {node} is outside 0..{len(hosts) - 1} ({len(hosts)} nodes: {describe(resources)})"
        )
    return node


def _rendezvous_args(
    *, endpoint: tuple[str, int], external: bool, min_nodes: int, nodes: int, run_id: str, rejoin_wait_s
) -> list[str]:
    """The agent's c10d rendezvous options on several nodes: meeting at the master's port, whose agent hosts the store,
    or (`external`) at a store `dspipe rendezvous` serves, of which every agent is a client (is_host=0)."""
    return [
        "--nnodes",
        f"{min_nodes}:{nodes}",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint_text(*endpoint),
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        f"last_call_timeout={rejoin_wait_s}" + (",is_host=0" if external else ""),
    ]


def _elastic_env(env: dict[str, str], *, node_rank: int | None, slots: list[int]) -> dict[str, str]:
    """`env` with what the elastic agent's ranks need added (a new dict)."""
    # a fresh rendezvous store on a new port for every start: the agent's shared store keeps the keys of the start
    # before, and the new ranks' gloo mesh may read a dead peer's address from it (connection refused at init)
    env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if node_rank is not None:
        env[NODE_RANK_ENV] = str(node_rank)
    if slots != list(range(len(slots))):  # DeepSpeed's launcher would pass the slots: the agent does not
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    if "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in env:  # else the agent sets 1 per rank
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // len(slots)))
    return env


def _is_local(host: str) -> bool:
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return False
    if addr.startswith("127.") or host == socket.gethostname():
        return True
    try:
        return addr in {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False


def check_port_free(port: int) -> None:
    """The rendezvous port must be free where rank 0 starts (torch's TCPStore listens on all interfaces)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT leftover is not "in use"
        try:
            s.bind(("", port))
            s.listen(1)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise SpecError(f"port {port} is in use on this machine; pass --master-port with a free port") from None
            raise SpecError(f"cannot listen on port {port}: {e.strerror}") from None


def preflight(launch: Launch, spec: LaunchSpec) -> None:
    """Checks for a real launch (not --dry-run): one command to run here, its tools, a free rendezvous port."""
    if len(launch.commands) > 1:
        raise SpecError(
            f"--no-ssh starts one node per command: run this with --node-rank R (0..{launch.nodes - 1})"
            f" on each node, or see them all with --dry-run"
        )
    if launch.multi_node_exec:
        missing = [t for t in BACKEND_TOOLS[spec.launcher] if not shutil.which(t)]
        if missing:
            raise SpecError(f"--launcher {spec.launcher} needs {', '.join(missing)} on this machine (not on PATH)")
        if spec.launcher != "pdsh" and importlib.util.find_spec("mpi4py") is None:
            raise SpecError(
                f"--launcher {spec.launcher} starts run.py under {BACKEND_TOOLS[spec.launcher][1]}; "
                f"DeepSpeed finds each rank through mpi4py, which is not installed (pip install mpi4py)"
            )
    if spec.launcher != "pdsh":
        return
    if launch.rendezvous_store is not None:
        check_reachable(*launch.rendezvous_store)
    command = launch.commands[0]
    master = spec.master_addr or command.host
    rank0_here = launch.hostfile is None or (command.node_rank in (None, 0) and _is_local(master))
    if rank0_here and launch.rendezvous_port is not None:
        check_port_free(spec.master_port or DEFAULT_PORT)


def execute(launch: Launch) -> int:
    """Run the one command (DeepSpeed's runner takes it from here); its exit code is ours. A SIGTERM (Slurm's
    pre-emption, the sbatch script's stop) is passed on to the runner, and we wait for it: the ranks save and exit."""
    proc = subprocess.Popen(list(launch.commands[0].argv), env=launch.child_env())

    def forward(signum, frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    if threading.current_thread() is not threading.main_thread():  # only the main thread may take signals
        return _wait(proc)
    previous = signal.signal(signal.SIGTERM, forward)
    try:
        return _wait(proc)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _wait(proc: subprocess.Popen) -> int:
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # The runner got the same Ctrl-C (same process group) and stops its ranks, with pdsh on every node: let it.
        try:
            return proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.terminate()
            return proc.wait()


def env_file_for(run_path: Path) -> Path:
    return Path(run_path) / ENV_FILE


ENTRY_MODULE = "dspipe.runtime.entry"  # the rank entry point, shipped inside the package


def resume_args(*, resume: str | None = None, restart: bool = False) -> list[str]:
    """The rank entry point's start choice, as given (nothing: it resumes from the newest complete checkpoint):
    --resume auto|TAG|PATH, or --restart (from step 0; the runner moves the old outputs aside, deleting nothing)."""
    if resume is not None and restart:
        raise SpecError(f"--resume {resume} and --restart contradict each other: give one")
    if resume is None:
        return ["--restart"] if restart else []
    if resume.strip() == "" or re.search(r"[\x00-\x1f\x7f]", resume):
        raise SpecError(f"--resume {ascii(resume)} is not auto, a checkpoint tag (global_stepN) or a checkpoint path")
    return ["--resume", resume]


def check_resume(resume: str | None, *, checkpoint_dir: Path) -> None:
    """Refuse a --resume TAG|PATH that names no complete checkpoint, as the rank entry point would refuse it after
    the launch (dspipe.runtime.ckpt_tags.find_checkpoint: a directory, else a tag under the run's checkpoints/);
    'auto' and no --resume are the runner's choice."""
    from dspipe.runtime.ckpt_tags import find_checkpoint

    if resume is None or resume == "auto":
        return
    try:
        find_checkpoint(checkpoint_dir, resume)
    except SpecError as e:
        raise SpecError(f"--resume {resume}: {e}") from None


def run_program(run_path: Path, *, resume: str | None = None, restart: bool = False) -> list[str]:
    """The launcher's program for training: the packaged rank entry point, run by module from any directory."""
    return ["--module", ENTRY_MODULE, "--run", str(run_path), *resume_args(resume=resume, restart=restart)]
