"""`dspipe launch | doctor | build-ops | slurm-script`: multi-node launches through DeepSpeed's own launcher. Registered
on the `dspipe` group by dspipe/cli/app.py; imports no torch until a command needs it."""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path

import click

from dspipe.cli.config_file import given
from dspipe.cli.options import FLOAT, INT, PathText, Text
from dspipe.cluster.hostfile import describe
from dspipe.cluster.launch import (
    LAUNCHERS,
    Elastic,
    LaunchSpec,
    build,
    build_elastic,
    check_resume,
    check_world,
    env_file_for,
    execute,
    preflight,
    resolve,
    resume_args,
    run_program,
)
from dspipe.cluster.netenv import (
    FLAG_ENV_KEYS,
    NCCL_DEBUG_LEVELS,
    NetworkSpec,
    parse_env_assignments,
    rank_environment,
    write_env_file,
)
from dspipe.cluster.store import parse_endpoint
from dspipe.errors import SpecError, file_problem
from dspipe.log import get_logger
from dspipe.rundir import load_run
from dspipe.runtime.elastic import check_min_nodes
from dspipe.runtime.watchdog import NO_EVENTS, check_hang_timeout, events_text, read_events, utc_now
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.hardware import gpu_type, names_text

NETWORK_FLAGS = ("ifname", "ib_hca", "no_ib", "nccl_debug", "timeout_min", "env")


def launch_options(f):
    for opt in reversed(
        [
            click.option("--hostfile", default=None, type=Text(), help="MPI-style hostfile ('HOST slots=N' per line)"),
            click.option("--include", default=None, type=Text(), help="hosts/slots to use: NAME[:SLOT,...][@NAME...]"),
            click.option("--exclude", default=None, type=Text(), help="hosts/slots to leave out, same format"),
            click.option("--num-nodes", type=INT, default=None, help="use the first N hosts of the hostfile"),
            click.option("--num-gpus", type=INT, default=None, help="ranks per node (slots 0..N-1)"),
            click.option(
                "--master-addr",
                default=None,
                help="address of node 0 [default: DeepSpeed's choice; with --no-ssh the first host]",
            ),
            click.option("--master-port", type=INT, default=None, help="rendezvous port on node 0 [default: 29500]"),
            click.option(
                "--launcher",
                type=click.Choice(LAUNCHERS),
                default="pdsh",
                show_default=True,
                help="how DeepSpeed reaches the other nodes",
            ),
            click.option("--no-ssh", is_flag=True, default=False, help="this node starts only its own ranks"),
            click.option("--node-rank", type=INT, default=None, help="this node's index in the hostfile (--no-ssh)"),
            click.option("--ssh-port", type=INT, default=None, help="ssh port for pdsh"),
        ]
    ):
        f = opt(f)
    return f


def network_options(f):
    for opt in reversed(
        [
            click.option(
                "--ifname", default=None, type=Text(), help="NCCL_SOCKET_IFNAME (GLOO_SOCKET_IFNAME on cpu), e.g. eth0"
            ),
            click.option("--ib-hca", default=None, type=Text(), help="NCCL_IB_HCA, e.g. mlx5_0,mlx5_1"),
            click.option("--no-ib", is_flag=True, default=False, help="NCCL_IB_DISABLE=1 (no InfiniBand)"),
            click.option("--nccl-debug", type=click.Choice(NCCL_DEBUG_LEVELS), default="WARN", show_default=True),
            click.option(
                "--timeout-min",
                type=INT,
                default=30,
                show_default=True,
                help="collective timeout in minutes (DEEPSPEED_TIMEOUT)",
            ),
            click.option("--env", "env", multiple=True, help="KEY=VALUE for every rank (repeatable)"),
        ]
    ):
        f = opt(f)
    return f


def _launch_spec(o: dict) -> LaunchSpec:
    return LaunchSpec(
        hostfile=o["hostfile"],
        include=o["include"] or "",
        exclude=o["exclude"] or "",
        num_nodes=o["num_nodes"],
        num_gpus=o["num_gpus"],
        master_addr=o["master_addr"],
        master_port=o["master_port"],
        launcher=o["launcher"],
        no_ssh=o["no_ssh"],
        node_rank=o["node_rank"],
        ssh_port=o["ssh_port"],
    )


def _env_once(items: tuple[str, ...]) -> None:
    """Refuse a --env KEY given twice (the later would silently replace the earlier)."""
    seen: dict[str, str] = {}
    for item in items:
        key, _, value = item.partition("=")
        if key in seen:
            raise SpecError(f"--env {key} is given twice ({key}={seen[key]} and {key}={value}): give each key once")
        seen[key] = value


def _env_sets(items: tuple[str, ...], name: str) -> bool:
    """Whether an --env item sets a variable of the network flag `name` (then the flag's default is not passed on)."""
    return any(item.partition("=")[0] in FLAG_ENV_KEYS[name] for item in items)


def _network(o: dict) -> NetworkSpec:
    _env_once(o["env"])
    flags = given(click.get_current_context(silent=True), o)
    return NetworkSpec(
        socket_ifname=o["ifname"],
        ib_hca=o["ib_hca"],
        infiniband=not o["no_ib"],
        nccl_debug=o["nccl_debug"],
        timeout_minutes=o["timeout_min"],
        extra=parse_env_assignments(o["env"]),
        given=tuple(name for name in FLAG_ENV_KEYS if name in flags),
    )


def _network_flags(o: dict) -> list[str]:
    """The network options as given, to pass on to `dspipe launch` (slurm-script)."""
    typed = given(click.get_current_context(silent=True), o)
    flags = [
        *(["--ifname", o["ifname"]] if o["ifname"] else []),
        *(["--ib-hca", o["ib_hca"]] if o["ib_hca"] else []),
        *(["--no-ib"] if o["no_ib"] else []),
        *(["--nccl-debug", o["nccl_debug"]] if "nccl_debug" in typed else []),  # launch's default is the same
        *([] if _env_sets(o["env"], "timeout_min") else ["--timeout-min", str(o["timeout_min"])]),
    ]
    for item in o["env"]:
        flags += ["--env", item]
    return flags


def resume_options(f):
    for opt in reversed(
        [
            click.option(
                "--resume",
                default=None,
                metavar="auto|TAG|PATH",
                help="checkpoint to start from [default: auto, the newest complete one, or a fresh start]",
            ),
            click.option(
                "--restart",
                is_flag=True,
                default=False,
                help="start from step 0 (the run moves its earlier checkpoints and metrics aside, deleting nothing)",
            ),
        ]
    ):
        f = opt(f)
    return f


def elastic_options(f):
    for opt in reversed(
        [
            click.option(
                "--max-restarts",
                type=INT,
                default=None,
                help="start the ranks under torch's elastic agent, which restarts the whole job from the newest "
                "complete checkpoint, up to N times, when a rank dies or hangs or a node is lost "
                "[default: DeepSpeed's launcher, no restart]",
            ),
            click.option(
                "--min-nodes",
                type=INT,
                default=None,
                help="with --max-restarts: continue on as few as M nodes after a node is lost, at the smaller dp "
                "with the same global batch [default: every node]",
            ),
            click.option(
                "--hang-timeout",
                type=FLOAT,
                default=None,
                metavar="SECONDS",
                help="end the job when a rank waits this long inside one collective during the steps, "
                "naming the rank and the operation (0: never) [default: 600 with --max-restarts, else 0]",
            ),
            click.option(
                "--rejoin-wait",
                type=INT,
                default=None,
                metavar="SECONDS",
                help="with --max-restarts on several nodes: how long a restart waits for lost nodes to come "
                "back once --min-nodes are there [default: 30]",
            ),
            click.option(
                "--rendezvous",
                default=None,
                metavar="HOST:PORT",
                help="with --max-restarts on several nodes: meet at the store 'dspipe rendezvous' serves on a host "
                "that trains nothing, so that losing any node, node 0 too, leaves the others running "
                "[default: node 0's agent holds it, at --master-addr:--master-port]",
            ),
        ]
    ):
        f = opt(f)
    return f


def _elastic(o: dict) -> Elastic | None:
    """The --max-restarts options as an Elastic, or None (DeepSpeed's launcher) when --max-restarts is not given."""
    if o["max_restarts"] is None:
        for flag in ("min_nodes", "rejoin_wait", "rendezvous"):
            if o[flag] is not None:
                raise SpecError(f"--{flag.replace('_', '-')} only applies with --max-restarts N")
        return None
    given = {
        k: v for k, v in (("hang_timeout_s", o["hang_timeout"]), ("rejoin_wait_s", o["rejoin_wait"])) if v is not None
    }
    store = None if o["rendezvous"] is None else parse_endpoint(o["rendezvous"])
    return Elastic(max_restarts=o["max_restarts"], min_nodes=o["min_nodes"], rendezvous=store, **given)


@click.command("launch")
@click.argument("run_dir", type=PathText())
@launch_options
@network_options
@resume_options
@elastic_options
@click.option("--dry-run", is_flag=True, default=False, help="print the command(s) and environment, run nothing")
@click.option("--test-faults", default=None, hidden=True)  # tests only: passed to the ranks (dspipe.runtime.faults)
def launch(run_dir: Path, dry_run: bool, resume: str | None, restart: bool, test_faults: str | None, **o) -> None:
    """Start the run through DeepSpeed's launcher (pdsh, OpenMPI, Slurm, or --no-ssh per node), or with
    --max-restarts under torch's elastic agent, which restarts it by itself. A run directory with checkpoints resumes
    from the newest complete one; --restart starts over, --resume picks one."""
    program_args = resume_args(resume=resume, restart=restart)  # checked before the run directory is read
    elastic = _elastic(o)
    hang = o.pop("hang_timeout")
    if elastic is None and hang:  # under DeepSpeed's launcher a hang ends the job (no restart)
        program_args += ["--hang-timeout", f"{check_hang_timeout(hang):g}"]
    run = load_run(run_dir)
    check_resume(resume, checkpoint_dir=run.checkpoint_dir)  # the ranks would refuse it only after the start-up
    _check_init_from(run.train.init_from)
    _check_data(data=run.data, model=run.model)
    if elastic is not None:
        check_min_nodes(run, min_nodes=elastic.min_nodes)
    _check_with_deepspeed(run)
    spec = _launch_spec(o)
    env = rank_environment(cluster=run.cluster, network=_network(o))
    program = [*run_program(run.path), *program_args, *(["--test-faults", test_faults] if test_faults else [])]
    if elastic is None:
        plan = build(
            spec, program=program, env=env, env_file=env_file_for(run.path), default_gpus=run.cluster.gpus_per_node
        )
    else:
        plan = build_elastic(
            spec,
            elastic,
            program=program,
            env=env,
            env_file=env_file_for(run.path),
            default_gpus=run.cluster.gpus_per_node,
            nodes=run.cluster.nodes,
            run_id=_run_id(run.path),
        )
    check_world(
        plan,
        expected=run.plan.world_size,
        nodes=run.cluster.nodes,
        gpus_per_node=run.cluster.gpus_per_node,
        run_path=run.path,
        spec=spec,
        tp=run.plan.tp,
    )
    if dry_run:
        click.echo(plan.shell_text(), nl=False)
        return
    preflight(plan, spec)
    write_env_file(run.path, env)
    via = "" if elastic is None else f" under torch's elastic agent (up to {elastic.max_restarts} restarts)"
    get_logger(__name__).info(
        f"dspipe: {run.path}: {plan.world_size} ranks on {plan.nodes} node(s) ({describe(plan.resources)}){via}"
    )
    if elastic is not None:  # a new job: an earlier job's refusal (dspipe.runtime.elastic) is not this one's
        from dspipe.runtime.elastic import REFUSED_FILE

        (run.path / REFUSED_FILE).unlink(missing_ok=True)
    started = utc_now()
    rc = execute(plan)
    told = events_text([e for e in read_events(run.path) if str(e.get("time", "")) >= started])
    if told != NO_EVENTS:
        get_logger(__name__).warning(f"dspipe: {run.path}: {told}")
    if rc:
        raise SystemExit(rc)


def _check_with_deepspeed(run) -> None:
    """ds_config.json through DeepSpeed's own config class, as gen-config checked what it rendered: a value that
    passed dspipe's checks but not DeepSpeed's would otherwise end every rank inside deepspeed.initialize."""
    from dspipe.cli.prepare_run import verify_with_deepspeed

    verify_with_deepspeed(run.ds_config, dp=run.plan.ds_batch_ranks, source=run.ds_config_path)


def _check_init_from(init_from: str | None) -> None:
    """train.init_from: every rank reads its weights at the build (a resumed run's too, its checkpoint loading over
    them), so the Hugging Face directory must be there before any rank starts."""
    if init_from is None:
        return
    config = Path(init_from) / "config.json"
    problem = file_problem(config)
    if problem:
        raise SpecError(
            f"train.init_from {init_from}: {config} {problem}; the ranks read the Hugging Face weights there at "
            f"every start (restore the directory, or regenerate the run)"
        )


def _check_data(*, data: str, model) -> None:
    """dspipe.json's data, every source of it: prepared (gen-config only notes an unprepared directory) and holding
    the model's tokens, checked as the ranks check it at every start, so a missing or unprepared directory is one line
    here instead of one per rank after the start-up. A Megatron prefix: its index header and file sizes (its token
    scan stays with the ranks: a whole corpus is not read before a launch)."""
    from dspipe.data import megatron
    from dspipe.data.blend import parse
    from dspipe.data.checks import check_data_for_model
    from dspipe.data.shards import is_prepared

    for path in parse(data).paths:
        try:
            if not is_prepared(path):
                problem = file_problem(path)  # a symlink loop or a broken link is named as such
                what = "is not prepared data" if problem in (None, "is a directory, not a file") else problem
                raise SpecError(
                    f"{what} (no meta.json, no Megatron .idx/.bin); the ranks read it at every start: run "
                    f"'dspipe prepare-data --out {path}' first"
                )
            if megatron.is_prefix(path):
                megatron.read_meta(path, deep=False)
            else:
                check_data_for_model(path, model_vocab=model.vocab, seq_len=model.seq_len)
        except SpecError as e:
            raise SpecError(f"data {path}: {e}") from None


def _run_id(path: Path) -> str:
    """The rendezvous id of a run's elastic agents: the same on every node (the run directory's name and a hash of
    its resolved path, which every node sees alike on a shared file system)."""
    import hashlib
    import re

    name = re.sub(r"[^A-Za-z0-9_-]", "_", path.resolve().name)[:40] or "run"
    return f"dspipe-{name}-{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]}"


@click.command("doctor")
@launch_options
@network_options
@click.option(
    "--gpu", default=None, type=Text(), help="GPU type whose assumed bandwidth to compare with [default: detected]"
)
@click.option("--size-mb", type=FLOAT, default=64.0, show_default=True, help="all-reduce message size")
@click.option("--iters", type=INT, default=10, show_default=True, help="timed all-reduces")
@click.option("--skip-allreduce", is_flag=True, default=False, help="report only; start no ranks")
@click.option("--timeout-s", type=INT, default=600, show_default=True, help="give up on the all-reduce after this")
def doctor(gpu: str | None, size_mb: float, iters: int, skip_allreduce: bool, timeout_s: int, **o) -> None:
    """Preflight: versions, GPUs, DeepSpeed ops, ssh to every host, and an all-reduce across the whole cluster."""
    from dspipe.cluster import doctor as d

    d.check_allreduce_options(size_mb=size_mb, iters=iters, timeout_s=timeout_s)  # skipped or not: never ignored
    if skip_allreduce:  # a typed all-reduce setting with no all-reduce to apply it to
        ctx = click.get_current_context()
        typed = [
            f"--{name.replace('_', '-')} {value:g}"
            for name, value in (("size_mb", size_mb), ("iters", iters), ("timeout_s", timeout_s))
            if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
        ]
        if typed:
            raise SpecError(f"{', '.join(typed)} would go unused: --skip-allreduce runs no all-reduce")
    spec = _launch_spec(o)
    network = _network(o)
    gpu = gpu or d.detect_gpu()
    if gpu is not None:  # a bad --gpu, --hostfile or --include is named before the report, not after it
        gpu_type(gpu)
        default_gpus = 2 if gpu == "cpu" else max(1, _cuda_count())
        hostfile, resources, _ = resolve(spec, default_gpus=default_gpus)
    for line in (d.environment(), *d.devices(), *d.op_report()):
        click.echo(line)
    if gpu is None:  # the report above shows the device the catalog lacks
        raise SpecError(f"GPU 0 is not in dspipe's catalog; pass --gpu ({names_text()})")
    via = "--no-ssh" if spec.no_ssh else spec.launcher if hostfile else "local"
    click.echo(f"ranks: {describe(resources)} via {via}")
    if hostfile and spec.launcher == "pdsh" and not spec.no_ssh:
        _check_ssh(hostfile, resources=resources, ssh_port=spec.ssh_port)
    if skip_allreduce:
        return
    cluster = ClusterSpec(nodes=len(resources), gpus_per_node=max(len(s) for s in resources.values()), gpu=gpu)
    env = rank_environment(cluster=cluster, network=network)
    result = _run_allreduce(spec, env=env, size_mb=size_mb, iters=iters, timeout_s=timeout_s, default_gpus=default_gpus)
    _report_allreduce(result, cluster=cluster, gpu=gpu, env=env)


def _check_ssh(hostfile, *, resources, ssh_port) -> None:
    """Refuse a host of `resources` that passwordless ssh does not reach (pdsh needs every one); say they do."""
    from dspipe.cluster import doctor as d

    hosts = [hostfile.host(n) for n in resources]
    bad = d.ssh_unreachable(hosts, source=hostfile.source, ssh_port=ssh_port)
    if bad:
        raise SpecError(
            f"not reachable over passwordless ssh (pdsh needs every host): {'; '.join(bad)}; "
            f"fix ssh or launch with --no-ssh --node-rank R on each node"
        )
    click.echo(f"ssh: {len(hosts)} host(s) reachable ({', '.join(h.name for h in hosts)})")


def _run_allreduce(spec, *, env: dict, size_mb: float, iters: int, timeout_s: int, default_gpus: int) -> dict:
    """doctor's all-reduce across the ranks of `spec` (launched as a run is, from a temp directory); its result."""
    from dspipe.cluster import doctor as d

    tmp = Path(tempfile.mkdtemp(prefix="dspipe-doctor-"))
    try:
        program = [
            "--module",
            "dspipe.cluster.allreduce",
            "--size-mb",
            str(size_mb),
            "--iters",
            str(iters),
            "--env-keys",
            ",".join(env),
        ]
        plan = build(spec, program=program, env=env, env_file=tmp / ".deepspeed_env", default_gpus=default_gpus)
        preflight(plan, spec)
        write_env_file(tmp, env)
        return d.run_allreduce(plan, timeout_s=timeout_s)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _report_allreduce(result: dict, *, cluster: ClusterSpec, gpu: str, env: dict) -> None:
    """doctor's line on the all-reduce against the planner's assumed bandwidth; refuses a wrong sum or an
    environment the ranks did not all see."""
    from dspipe.cluster import doctor as d

    kind, assumed = (
        ("inter-node", cluster.gpu_type.inter_node_gbps)
        if cluster.nodes > 1
        else ("intra-node", cluster.gpu_type.intra_node_gbps)
    )
    click.echo(
        f"all-reduce: {result['world_size']} ranks ({cluster.nodes} node(s)), {result['backend']}, "
        f"{result['bytes'] / 2**20:g} MiB fp32 x {result['iters']}: {result['seconds'] * 1e3:.1f} ms each, "
        f"bus bandwidth {result['busbw_gbps']:.2f} GB/s (algbw {result['algbw_gbps']:.2f}); planner assumes "
        f"{assumed:g} GB/s ({kind}, {gpu})"
    )
    problems = ([] if result["correct"] else ["all-reduce returned a wrong sum"]) + d.env_mismatches(result, env)
    if problems:
        raise SpecError("; ".join(problems))
    click.echo(f"environment on every rank: {', '.join(f'{k}={v}' for k, v in env.items())}")


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


@click.command("rendezvous")
@click.option("--port", type=INT, default=29400, show_default=True, help="the port to serve on (every interface)")
def rendezvous(port: int) -> None:
    """Serve the rendezvous store of elastic jobs ('dspipe launch --max-restarts N --rendezvous HOST:PORT' on every
    node) from a host that trains nothing, until SIGTERM or Ctrl-C: losing any node, node 0 too, then leaves the
    others' rendezvous up. One store serves any number of jobs."""
    from dspipe.cluster.store import serve

    if not 1 <= port <= 65535:
        raise SpecError(f"--port must be in 1..65535, got {port}")
    host = socket.gethostname()
    serve(
        port=port,
        ready=lambda: get_logger(__name__).info(
            f"dspipe: rendezvous store on port {port}: start each node with 'dspipe launch RUN --max-restarts N "
            f"--rendezvous {host}:{port} ...'; SIGTERM or Ctrl-C ends it"
        ),
    )


@click.command("build-ops")
@click.option(
    "--offload",
    type=click.Choice(["none", "cpu", "nvme"]),
    default=None,
    help="only the ops of runs with this optimizer offload (none: FusedAdam; cpu: DeepSpeedCPUAdam; nvme: "
    "that and async I/O) [default: every offload's]",
)
def build_ops(offload: str | None) -> None:
    """Compile DeepSpeed's ops a run loads on this machine (its AdamW; the shared-memory collectives on CPU) into
    torch's extension cache, once, so that the first launch starts without a build (scripts/setup.sh runs it)."""
    import logging

    # DeepSpeed's import logs its accelerator choice to stdout: this command's lines are the ops alone
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
    from dspipe.runtime.ops import build, runner_ops

    for op in runner_ops(offload=offload):
        if op.built:
            click.echo(f"{op.name}: built ({op.where})")
            continue
        click.echo(f"{op.name}: building ...")
        try:
            seconds = build(op)
        except Exception as e:  # a compiler missing, a build error: the launch builds it (JIT), as without this
            detail = " ".join(str(e).split())[-300:] or type(e).__name__
            raise click.ClickException(
                f"building DeepSpeed's {op.name} op failed ({detail}); a launch tries again before its first step"
            ) from None
        click.echo(f"{op.name}: built in {seconds:.0f} s ({op.where})")


@click.command("slurm-script")
@click.argument("run_dir", type=PathText())
@click.option(
    "--out", default=None, metavar="FILE", help="[default: RUN_DIR/slurm.sbatch]; an existing file only with --force"
)
@click.option("--force", is_flag=True, default=False, help="replace a script that slurm-script wrote (nothing else)")
@click.option(
    "--time",
    "time_limit",
    default="24:00:00",
    show_default=True,
    help="job time limit: MINUTES, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (0: none)",
)
@click.option("--partition", default=None)
@click.option("--account", default=None)
@click.option("--sbatch", "extra_sbatch", multiple=True, help="extra '#SBATCH' option, e.g. --sbatch=--exclusive")
@click.option("--master-port", type=INT, default=None, help="rendezvous port on the first node [default: 29500]")
@click.option(
    "--stop-before",
    type=INT,
    default=300,
    show_default=True,
    help="seconds before the time limit at which the run is told to save, and the job requeues",
)
@click.option(
    "--max-restarts",
    type=INT,
    default=0,
    show_default=True,
    help="each node's launch restarts the job by itself up to N times (torch's elastic agent: a dead or "
    "hung rank), and a run step that still fails (a node lost) is requeued, up to N times",
)
@click.option(
    "--min-nodes",
    type=INT,
    default=None,
    help="with --max-restarts: a node failure does not end the job (--no-kill); the other nodes continue "
    "on as few as M nodes at the smaller dp, same global batch [default: every node]",
)
@network_options
@resume_options
def slurm_script(
    run_dir: Path,
    out: str | None,
    force: bool,
    time_limit: str,
    partition: str | None,
    account: str | None,
    extra_sbatch: tuple[str, ...],
    master_port: int | None,
    stop_before: int,
    max_restarts: int,
    min_nodes: int | None,
    resume: str | None,
    restart: bool,
    **o,
) -> None:
    """Write an sbatch script that builds the hostfile from the job's nodes and launches the run on them. It resumes
    from the newest checkpoint, and on the time limit or pre-emption stops the run (which saves) and requeues the
    job; --resume/--restart apply to the job's first start only."""
    from dspipe.atomic import write_file
    from dspipe.cluster.slurm import is_slurm_script, render_slurm_script
    from dspipe.outputs import claim_file, target, writing

    first = resume_args(resume=resume, restart=restart)
    run = load_run(run_dir)  # read here: the run directory is on the file system the job's nodes share
    check_resume(resume, checkpoint_dir=run.checkpoint_dir)  # so is the checkpoint --resume names
    _check_with_deepspeed(run)
    if max_restarts:
        check_min_nodes(run, min_nodes=min_nodes)
    rank_environment(cluster=run.cluster, network=_network(o))  # reject bad network options now, not in the job
    LaunchSpec(master_port=master_port)
    out = target(run.path / "slurm.sbatch" if out is None else out, flag="--out", expect="file")
    text = render_slurm_script(
        run=run,
        script_path=out,
        workdir=Path.cwd(),
        time=time_limit,
        partition=partition,
        account=account,
        extra_sbatch=extra_sbatch,
        master_port=master_port,
        launch_args=_network_flags(o),
        first_resume_args=first,
        stop_before=stop_before,
        max_restarts=max_restarts,
        min_nodes=min_nodes,
    )
    claim_file(out, replace=force, owned=is_slurm_script, label="sbatch script")  # only its own earlier script
    with writing(out):
        write_file(out, text, mode=0o755)
    click.echo(f"wrote {out}: {run.cluster.nodes} nodes x {run.cluster.gpus_per_node}; submit with: sbatch {out}")
