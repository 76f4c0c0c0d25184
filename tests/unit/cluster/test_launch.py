"""`dspipe launch --dry-run` checked against DeepSpeed's own runner, .deepspeed_env, slurm-script, and the launch
refusals (world size, hosts, ports, missing files) as one-line errors with exit code 2. Starts no ranks."""

import base64
import json
import shlex
import shutil
import socket
import subprocess
import types

import pytest

from dspipe.cluster.netenv import NetworkSpec, parse_env_assignments, rank_environment, write_env_file
from dspipe.errors import SpecError
from dspipe.spec.cluster import ClusterSpec
from tests.helpers import dspipe, free_port

TINY = ["gen-config", "--model", "tiny", "--global-batch", "16", "--micro-batch", "4", "--steps", "4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """Run directories on a prepared corpus (launch checks the data before any rank starts): 2 cpu "nodes" x 1,
    1 x 2 cpu, 2 x 8 H100."""
    d = tmp_path_factory.mktemp("launch")
    (d / "hosts").write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    (d / "hosts8").write_text("gpu-a slots=8\ngpu-b slots=8\n")
    (d / "hosts3").write_text("localhost slots=1\n127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    three = ["--global-batch", "9", "--micro-batch", "3", "--eval-interval", "0"]  # dp 3; 9 is not 3 x 2 x ga
    for name, flags in {
        "three": ["--gpu", "cpu", "--hostfile", "hosts3", *three],
        "two": ["--gpu", "cpu", "--hostfile", "hosts"],
        "single": ["--gpu", "cpu", "--gpus-per-node", "2"],
        "h100": ["--gpu", "h100-80g", "--hostfile", "hosts8", "--global-batch", "64"],
    }.items():
        r = dspipe(*TINY, *flags, "--data", str(corpus), "--out", f"runs/{name}", cwd=d)
        assert r.returncode == 0, r.stderr
    return d


def dry_run(runs, *args):
    r = dspipe("launch", *args, "--dry-run", cwd=runs)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    env = dict(ln[len("export ") :].split("=", 1) for ln in lines if ln.startswith("export "))
    commands = [shlex.split(ln) for ln in lines if ln and not ln.startswith(("#", "export "))]
    return {k: shlex.split(v)[0] for k, v in env.items()}, commands


def runner_args(argv):
    """The arguments after the launcher itself (`deepspeed` or `python -m deepspeed.launcher.runner`)."""
    return argv[1:] if argv[0] == "deepspeed" else argv[argv.index("deepspeed.launcher.runner") + 1 :]


def deepspeed_main(argv, env, monkeypatch, cwd):
    """DeepSpeed's runner.main() on our arguments, stopped where it would start a process: (cmd, its env).
    The .deepspeed_env is read by DeepSpeed itself, from the file $DS_ENV_FILE names."""
    from deepspeed.launcher import multinode_runner, runner

    started = {}

    class Proc:
        returncode = 0

        def wait(self):
            return 0

    def popen(cmd, env=None):
        started.update(cmd=cmd, env=env)
        return Proc()

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(
        runner,
        "subprocess",
        types.SimpleNamespace(
            Popen=popen,
            check_call=lambda *a, **k: 0,
            check_output=lambda *a, **k: b"10.9.8.7\n",
            CalledProcessError=subprocess.CalledProcessError,
            DEVNULL=subprocess.DEVNULL,
        ),
    )
    monkeypatch.setattr(runner, "signal", types.SimpleNamespace(signal=lambda *a: None, SIGINT=2, SIGTERM=15))
    monkeypatch.setattr(runner, "DEEPSPEED_ENVIRONMENT_NAME", env["DS_ENV_FILE"])  # what DS reads from $DS_ENV_FILE
    for cls in (multinode_runner.PDSHRunner, multinode_runner.OpenMPIRunner, multinode_runner.SlurmRunner):
        monkeypatch.setattr(cls, "backend_exists", lambda self: True)
    runner.main(runner_args(argv))
    return started["cmd"], started["env"]


def world_info(cmd):
    arg = next(a for a in cmd if "--world_info=" in a).split("--world_info=")[1].split()[0]
    return json.loads(base64.urlsafe_b64decode(arg))


def write_env(runs, name, env):
    write_env_file(runs / "runs" / name, {k: v for k, v in env.items() if k != "DS_ENV_FILE"})


def test_dry_run_pdsh_is_what_deepspeeds_runner_accepts(runs, monkeypatch):
    port = free_port()
    env, (argv,) = dry_run(
        runs,
        "runs/two",
        "--hostfile",
        "hosts",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "--env",
        "DSPIPE_PROBE=1",
    )
    assert env == {"DS_ENV_FILE": str(runs / "runs/two/.deepspeed_env"), "DEEPSPEED_TIMEOUT": "30", "DSPIPE_PROBE": "1"}
    from deepspeed.launcher.runner import parse_args

    a = parse_args(runner_args(argv))
    assert (a.hostfile, a.launcher, a.master_addr, a.master_port, a.no_ssh) == (
        "hosts",
        "pdsh",
        "127.0.0.1",
        port,
        False,
    )
    assert (a.module, a.user_script, a.user_args) == (True, "dspipe.runtime.entry", ["--run", "runs/two"])  # any cwd
    write_env(runs, "two", env)
    cmd, _ = deepspeed_main(argv, env, monkeypatch, runs)
    assert cmd[:6] == ["pdsh", "-S", "-f", "1024", "-w", "localhost,127.0.0.1"]
    line = " ".join(cmd)
    assert "export DEEPSPEED_TIMEOUT=30; export DSPIPE_PROBE=1;" in line  # our .deepspeed_env, exported by DS
    assert f"--master_addr=127.0.0.1 --master_port={port}" in line and "--node_rank=%n" in line
    assert world_info(cmd) == {"localhost": [0], "127.0.0.1": [0]}
    assert cmd[-2:] == ["--run", "runs/two"]


def test_dry_run_openmpi_is_what_deepspeeds_runner_accepts(runs, monkeypatch):
    env, (argv,) = dry_run(runs, "runs/two", "--hostfile", "hosts", "--launcher", "openmpi", "--env", "A_B=c:d")
    from deepspeed.launcher.runner import parse_args

    a = parse_args(runner_args(argv))
    assert (a.hostfile, a.launcher, a.include, a.num_gpus) == ("hosts", "openmpi", "", -1)
    write_env(runs, "two", env)
    cmd, _ = deepspeed_main(argv, env, monkeypatch, runs)
    assert cmd[:5] == ["mpirun", "-n", "2", "-hostfile", "hosts"]
    assert cmd[cmd.index("DEEPSPEED_TIMEOUT=30") - 1] == "-x"
    assert "A_B=c:d" in cmd and cmd[-2:] == ["--run", "runs/two"]


def test_dry_run_slurm_is_what_deepspeeds_runner_accepts(runs, monkeypatch):
    env, (argv,) = dry_run(
        runs, "runs/h100", "--hostfile", "hosts8", "--launcher", "slurm", "--ifname", "ib0", "--ib-hca", "mlx5_0,mlx5_1"
    )
    assert {k: env[k] for k in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_DEBUG")} == {
        "NCCL_SOCKET_IFNAME": "ib0",
        "NCCL_IB_HCA": "mlx5_0,mlx5_1",
        "NCCL_IB_DISABLE": "0",
        "NCCL_DEBUG": "WARN",
    }
    from deepspeed.launcher.runner import parse_args

    assert parse_args(runner_args(argv)).launcher == "slurm"
    write_env(runs, "h100", env)
    cmd, _ = deepspeed_main(argv, env, monkeypatch, runs)
    assert cmd[:3] == ["srun", "-n", "16"]
    export = next(a for a in cmd if a.startswith("--export=ALL"))
    assert "NCCL_IB_HCA=mlx5_0,mlx5_1" in export and "NCCL_SOCKET_IFNAME=ib0" in export
    assert cmd[-2:] == ["--run", "runs/h100"]


def test_dry_run_no_ssh_prints_one_command_per_node(runs, monkeypatch):
    env, commands = dry_run(runs, "runs/two", "--hostfile", "hosts", "--no-ssh", "--master-addr", "127.0.0.1")
    from deepspeed.launcher.runner import parse_args

    parsed = [parse_args(runner_args(c)) for c in commands]
    assert [(a.no_ssh, a.node_rank, a.master_addr) for a in parsed] == [(True, 0, "127.0.0.1"), (True, 1, "127.0.0.1")]
    cmd, child_env = deepspeed_main(commands[1], env, monkeypatch, runs)
    assert cmd[cmd.index("-m") + 1] == "deepspeed.launcher.launch" and "--node_rank=1" in cmd
    assert world_info(cmd) == {"localhost": [0], "127.0.0.1": [0]}


def test_dry_run_single_node(runs, monkeypatch):
    env, (argv,) = dry_run(runs, "runs/single")
    cmd, _ = deepspeed_main(argv, env, monkeypatch, runs)
    assert world_info(cmd) == {"localhost": [0, 1]}


def test_include_passes_through(runs):
    _, (argv,) = dry_run(runs, "runs/h100", "--hostfile", "hosts8", "--include", "gpu-a@gpu-b")
    from deepspeed.launcher.runner import parse_args

    assert parse_args(runner_args(argv)).include == "gpu-a@gpu-b"


def fails(runs, *args, message):
    r = dspipe(*args, cwd=runs)
    assert r.returncode == 2, (r.stdout, r.stderr)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("dspipe: error:")]
    assert len(errors) == 1 and message in errors[0], r.stderr
    assert "Traceback" not in r.stderr
    return errors[0]


BAD_LAUNCHES = [
    (["runs/two", "--hostfile", "hosts", "--include", "gpu-z"], "--include 'gpu-z': host 'gpu-z' is not in hostfile"),
    (["runs/two", "--hostfile", "nope"], "hostfile nope does not exist"),
    (
        ["runs/two", "--hostfile", "hosts", "--include", "localhost"],
        "runs/two was generated for world size 2 (2 nodes x 1), but hostfile hosts gives 1 (localhost:0); "
        "regenerate with 'dspipe gen-config ... --hostfile hosts --out runs/two --force'",
    ),
    (
        ["runs/single", "--num-gpus", "1"],
        "runs/single was generated for world size 2 (1 nodes x 2), but --num-gpus 1 "
        "gives 1 (localhost:0); regenerate with 'dspipe gen-config ... --nodes 1 "
        "--gpus-per-node 1",
    ),
    (
        ["runs/h100", "--hostfile", "hosts8", "--exclude", "gpu-b:6,7"],
        "world size 16 (2 nodes x 8), but hostfile hosts8 gives 14 (gpu-a:0-7 + gpu-b:0-5)",
    ),
    (["runs/two"], "runs/two was generated for 2 nodes x 1; pass --hostfile"),
    (["runs/two", "--hostfile", "hosts", "--no-ssh", "--node-rank", "2"], "--node-rank 2 is outside 0..1"),
    (["runs/two", "--hostfile", "hosts", "--node-rank", "1"], "--node-rank only applies with --no-ssh"),
    (
        ["runs/two", "--hostfile", "hosts", "--launcher", "openmpi", "--num-gpus", "1"],
        "DeepSpeed's OpenMPI backend takes no --include/--exclude/--num-nodes/--num-gpus",
    ),
    (
        ["runs/two", "--hostfile", "hosts", "--launcher", "slurm", "--master-port", "1234"],
        "--launcher slurm does not pass --master-addr/--master-port to the ranks",
    ),
    (
        ["runs/two", "--hostfile", "hosts", "--launcher", "openmpi", "--env", "X=a b"],
        "--launcher openmpi cannot export X=a b",
    ),
    (["runs/two", "--hostfile", "hosts", "--env", "RANK=3"], "RANK is set by DeepSpeed's launcher"),
    (["runs/two", "--hostfile", "hosts", "--env", "3X=1"], "--env '3X=1' is not KEY=VALUE"),
    (["runs/two", "--hostfile", "hosts", "--ib-hca", "mlx5_0"], "uses gloo, not NCCL"),
    (["runs/h100", "--hostfile", "hosts8", "--ib-hca", "mlx5_0", "--no-ib"], "contradict each other"),
    (["runs/nope"], "runs/nope is not a run directory"),
    (
        ["runs/h100", "--hostfile", "hosts8", "--nccl-debug", "INFO", "--env", "NCCL_DEBUG=TRACE"],
        "--env NCCL_DEBUG=TRACE and --nccl-debug both set NCCL_DEBUG (backend nccl): give one of them",
    ),
    (
        ["runs/two", "--hostfile", "hosts", "--timeout-min", "5", "--env", "DEEPSPEED_TIMEOUT=9"],
        "--env DEEPSPEED_TIMEOUT=9 and --timeout-min both set DEEPSPEED_TIMEOUT (backend gloo)",
    ),
    (
        ["runs/two", "--hostfile", "hosts", "--ifname", "lo", "--env", "GLOO_SOCKET_IFNAME=eth0"],
        "--env GLOO_SOCKET_IFNAME=eth0 and --ifname both set GLOO_SOCKET_IFNAME (backend gloo)",
    ),
    (
        ["runs/two", "--hostfile", "hosts", "--launcher", "openmpi", "--ssh-port", "22"],
        "--ssh-port 22 applies only to pdsh's ssh: --launcher openmpi starts the ranks through mpirun",
    ),
    (["runs/single", "--ssh-port", "22"], "--ssh-port 22 applies only to pdsh's ssh: a launch without --hostfile"),
    (
        ["runs/two", "--hostfile", "hosts", "--no-ssh", "--node-rank", "0", "--ssh-port", "22"],
        "--no-ssh starts no ssh",
    ),
    (["runs/h100", "--hostfile", "hosts8", "--include", "gpu-a:0,0"], "'gpu-a:0,0': gpu-a's slot 0 is given twice"),
    (["runs/h100", "--hostfile", "hosts8", "--exclude", "gpu-b:7,6,7"], "gpu-b's slot 7 is given twice"),
    (["runs/h100", "--hostfile", "hosts8", "--include", "gpu-a:0@gpu-a:1"], "host 'gpu-a' is named twice"),
]


@pytest.mark.parametrize("args,message", BAD_LAUNCHES)
def test_bad_launches_are_one_line_errors(runs, args, message):
    fails(runs, "launch", *args, "--dry-run", message=message)


def test_an_env_variable_replaces_a_network_flags_default(runs):
    env, _ = dry_run(runs, "runs/h100", "--hostfile", "hosts8", "--env", "NCCL_DEBUG=TRACE")
    assert env["NCCL_DEBUG"] == "TRACE"
    env, _ = dry_run(runs, "runs/h100", "--hostfile", "hosts8", "--nccl-debug", "INFO")
    assert env["NCCL_DEBUG"] == "INFO"
    r = dspipe("slurm-script", "runs/h100", "--out", "env.sbatch", "--env", "NCCL_DEBUG=TRACE", cwd=runs)
    assert r.returncode == 0, r.stderr
    text = (runs / "env.sbatch").read_text()
    assert "--env NCCL_DEBUG=TRACE" in text and "--nccl-debug" not in text and "--timeout-min 30" in text


def test_no_ssh_launch_needs_the_node_rank(runs):
    """--dry-run prints every node's command; a real launch starts one node and must know which."""
    fails(
        runs,
        "launch",
        "runs/two",
        "--hostfile",
        "hosts",
        "--no-ssh",
        message="run this with --node-rank R (0..1) on each node, or see them all with --dry-run",
    )


def test_slurm_needs_even_nodes(tmp_path):
    """srun starts the same number of tasks per node: 1 + 2 slots cannot be `srun -n 3` over two nodes."""
    from dspipe.cluster.launch import LaunchSpec, build

    (tmp_path / "hosts").write_text("a slots=2\nb slots=2\n")
    spec = LaunchSpec(hostfile=str(tmp_path / "hosts"), exclude="a:1", launcher="slurm")
    with pytest.raises(SpecError, match=r"same number of ranks on every node .* a:0 \+ b:0-1"):
        build(spec, program=["run.py"], env={}, env_file=tmp_path / "e", default_gpus=1)


def test_port_in_use_refuses_before_starting_anything(runs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        fails(runs, "launch", "runs/single", "--master-port", port, message=f"port {port} is in use on this machine")
    assert not (runs / "runs/single/.deepspeed_env").exists() and not (runs / "runs/single/metrics.csv").exists()


def test_missing_backend_is_named(runs):
    if shutil.which("ompi_info"):
        pytest.skip("OpenMPI is installed here")
    fails(
        runs,
        "launch",
        "runs/two",
        "--hostfile",
        "hosts",
        "--launcher",
        "openmpi",
        message="--launcher openmpi needs ompi_info, mpirun on this machine",
    )


def test_rank_environment_for_nccl_and_gloo(tmp_path):
    gpu2 = ClusterSpec(nodes=2, gpus_per_node=8, gpu="h100-80g")
    env = rank_environment(
        cluster=gpu2,
        network=NetworkSpec(
            socket_ifname="eth0",
            nccl_debug="INFO",
            timeout_minutes=45,
            extra=parse_env_assignments(["NCCL_IB_GID_INDEX=3", "NCCL_DEBUG=WARN"]),
        ),
    )
    assert env == {
        "DEEPSPEED_TIMEOUT": "45",
        "NCCL_DEBUG": "WARN",
        "NCCL_SOCKET_IFNAME": "eth0",
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_GID_INDEX": "3",
    }  # user additions win
    assert rank_environment(cluster=gpu2, network=NetworkSpec(infiniband=False))["NCCL_IB_DISABLE"] == "1"
    cpu = ClusterSpec(nodes=2, gpus_per_node=1, gpu="cpu")
    assert rank_environment(cluster=cpu, network=NetworkSpec(socket_ifname="lo")) == {
        "DEEPSPEED_TIMEOUT": "30",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    path = write_env_file(tmp_path, env)
    # the way DeepSpeed's runner reads it: every line KEY=VALUE, nothing else
    assert [tuple(ln.split("=", 1)) for ln in path.read_text().splitlines()] == list(env.items())
    for bad in (0, 10081, 99999999999999):  # DeepSpeed's timedelta(minutes=...) overflows at every rank's import
        with pytest.raises(SpecError, match=f"--timeout-min must be 1..10080 minutes \\(a week\\), got {bad}"):
            NetworkSpec(timeout_minutes=bad)
    with pytest.raises(SpecError, match="quotes, '\\$', '\\\\' and newlines"):
        NetworkSpec(extra=(("A", "$HOME"),))


def test_an_env_contradicts_only_the_flags_that_set_it_on_the_runs_backend():
    """--ifname sets NCCL_SOCKET_IFNAME under NCCL and GLOO_SOCKET_IFNAME under gloo: beside --ifname, an --env of
    the other backend's variable is passed on, and one of the variable the flag sets is refused."""
    gpu2, cpu = ClusterSpec(nodes=2, gpus_per_node=8, gpu="h100-80g"), ClusterSpec(nodes=2, gpus_per_node=1, gpu="cpu")

    def net(*items, given=("ifname",), **kw):
        return NetworkSpec(socket_ifname="eth0", extra=parse_env_assignments(list(items)), given=given, **kw)

    env = rank_environment(cluster=gpu2, network=net("GLOO_SOCKET_IFNAME=lo"))
    assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == ("eth0", "lo")
    env = rank_environment(cluster=cpu, network=net("NCCL_SOCKET_IFNAME=ib0"))
    assert (env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) == ("eth0", "ib0")
    with pytest.raises(
        SpecError, match="NCCL_SOCKET_IFNAME=ib0 and --ifname both set NCCL_SOCKET_IFNAME .backend nccl"
    ):
        rank_environment(cluster=gpu2, network=net("NCCL_SOCKET_IFNAME=ib0"))
    # --nccl-debug sets nothing under gloo: typed, it is refused (as --ib-hca and --no-ib are); an --env NCCL_DEBUG
    # is passed on as given
    with pytest.raises(SpecError, match=r"^--nccl-debug sets NCCL variables, but this run's cluster \(cpu\) uses gloo"):
        rank_environment(cluster=cpu, network=net("NCCL_DEBUG=INFO", given=("nccl_debug",), nccl_debug="TRACE"))
    assert rank_environment(cluster=cpu, network=net("NCCL_DEBUG=INFO", given=()))["NCCL_DEBUG"] == "INFO"
    # without the flag given, an --env replaces the flag's default on either backend
    assert (
        rank_environment(cluster=gpu2, network=net("NCCL_SOCKET_IFNAME=ib0", given=()))["NCCL_SOCKET_IFNAME"] == "ib0"
    )


def test_slurm_script(runs):
    r = dspipe(
        "slurm-script",
        "runs/h100",
        "--partition",
        "gpu",
        "--time",
        "2-00:00:00",
        "--ifname",
        "ib0",
        "--env",
        "FOO=1",
        "--master-port",
        "29600",
        cwd=runs,
    )
    assert r.returncode == 0, r.stderr
    text = (runs / "runs/h100/slurm.sbatch").read_text()
    for expected in [
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=2-00:00:00",
        'scontrol show hostnames "$SLURM_JOB_NODELIST"',
        "sed 's/$/ slots=8/'",
        '--no-ssh --node-rank "$SLURM_NODEID"',
        'runs/h100 "$HOSTFILE" "$MASTER_ADDR" --master-port 29600 --ifname ib0 --timeout-min 30 --env FOO=1',
        # --nccl-debug left out is launch's default (WARN) again
    ]:
        assert expected in text
    assert subprocess.run(["bash", "-n", str(runs / "runs/h100/slurm.sbatch")]).returncode == 0
    fails(runs, "slurm-script", "runs/h100", "--time", "soon", message="--time 'soon' is not a Slurm time limit")
    fails(runs, "slurm-script", "runs/two", "--no-ib", message="uses gloo, not NCCL")


def test_doctor_names_unreachable_hosts(tmp_path):
    if not shutil.which("ssh"):
        pytest.skip("no ssh client")
    (tmp_path / "hosts").write_text("no-such-host.invalid slots=1\nother-host.invalid slots=1\n")
    line = fails(
        tmp_path,
        "doctor",
        "--hostfile",
        "hosts",
        "--gpu",
        "cpu",
        message="not reachable over passwordless ssh (pdsh needs every host): no-such-host.invalid (hosts:1)",
    )
    assert "; other-host.invalid (hosts:2): " in line and "--no-ssh --node-rank R" in line


def test_max_restarts_starts_torchs_elastic_agent(runs):
    env, (argv,) = dry_run(runs, "runs/single", "--max-restarts", "3", "--hang-timeout", "120")
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(argv[argv.index("torch.distributed.run") + 1 :])
    assert (args.standalone, args.nproc_per_node, args.max_restarts, args.module) == (True, "2", 3, True)
    assert args.training_script == "dspipe.runtime.entry"
    assert args.training_script_args == ["--run-dir", "runs/single", "--hang-timeout", "120"]
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # a fresh store per start (no stale gloo addresses)
    _, (default,) = dry_run(runs, "runs/single", "--max-restarts", "1")
    assert default[-2:] == ["--hang-timeout", "600"]  # hangs are watched by default under restarts


def test_elastic_nodes_meet_at_the_master(runs):
    _, (argv,) = dry_run(
        runs,
        "runs/two",
        "--hostfile",
        "hosts",
        "--no-ssh",
        "--node-rank",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        "29611",
        "--max-restarts",
        "2",
        "--min-nodes",
        "1",
        "--rejoin-wait",
        "5",
        "--resume",
        "auto",
    )
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(argv[argv.index("torch.distributed.run") + 1 :])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend, args.rdzv_endpoint) == (
        "1:2",
        "1",
        "c10d",
        "127.0.0.1:29611",
    )
    assert args.rdzv_conf == "last_call_timeout=5" and args.rdzv_id.startswith("dspipe-two-")
    assert args.training_script_args[:4] == ["--run-dir", "runs/two", "--resume", "auto"]


ELASTIC_NODE1 = ["runs/two", "--hostfile", "hosts", "--no-ssh", "--node-rank", "1", "--max-restarts", "2"]


def test_elastic_nodes_meet_at_a_store_apart(runs):
    """--rendezvous HOST:PORT: every node's agent is a client of the store `dspipe rendezvous` serves (is_host=0, as
    torch's c10d backend reads it), so no node holds it."""
    _, (argv,) = dry_run(runs, *ELASTIC_NODE1, "--rendezvous", "login1:29612")
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(argv[argv.index("torch.distributed.run") + 1 :])
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_conf) == (
        "c10d",
        "login1:29612",
        "last_call_timeout=30,is_host=0",
    )
    conf = _parse_rendezvous_config(args.rdzv_conf)
    params = RendezvousParameters("c10d", args.rdzv_endpoint, args.rdzv_id, 2, 2, **conf)
    assert params.get_as_bool("is_host") is False and params.get_as_int("last_call_timeout") == 30
    _, (v6,) = dry_run(runs, *ELASTIC_NODE1, "--rendezvous", "[fd00::1]:29612")
    assert v6[v6.index("--rdzv-endpoint") + 1] == "[fd00::1]:29612"


def test_a_store_that_does_not_answer_is_one_line_before_any_rank_starts(runs):
    from tests.helpers import free_port

    port = free_port()
    fails(
        runs,
        "launch",
        *ELASTIC_NODE1,
        "--rendezvous",
        f"127.0.0.1:{port}",
        message=f"--rendezvous 127.0.0.1:{port}: nothing answers there (Connection refused); start 'dspipe "
        f"rendezvous --port {port}' on 127.0.0.1 first",
    )


def test_dspipe_rendezvous_refuses_a_bad_or_taken_port(runs):
    import socket

    fails(runs, "rendezvous", "--port", "70000", message="--port must be in 1..65535, got 70000")
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        fails(runs, "rendezvous", "--port", str(port), message=f"port {port} is in use on this machine")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--rendezvous", "login1"], "--rendezvous 'login1' is not HOST:PORT (e.g. login1:29400, [fd00::1]:29400)"),
        (["--rendezvous", "login1:99999"], "--rendezvous 'login1:99999': port 99999 is outside 1..65535"),
        (["--rendezvous", "fd00::1:29400"], "an IPv6 address, and only one, goes in brackets, [ADDRESS]:PORT"),
        (["--rendezvous", "[login1]:29400"], "an IPv6 address, and only one, goes in brackets, [ADDRESS]:PORT"),
        (["--rendezvous", "-oProxy:29400"], "--rendezvous host '-oProxy' is not a host name or address"),
        (
            ["--rendezvous", "login1:29400", "--master-port", "29611"],
            "--rendezvous login1:29400 replaces --master-port: the agents meet at the store, not on node 0",
        ),
    ],
)
def test_bad_rendezvous_stores_are_one_line_errors(runs, args, message):
    fails(runs, "launch", *ELASTIC_NODE1, *args, "--dry-run", message=message)


@pytest.mark.parametrize(
    "args,message",
    [
        (["runs/two", "--hostfile", "hosts", "--max-restarts", "2"], "--max-restarts with --hostfile needs --no-ssh"),
        (
            [
                "runs/two",
                "--hostfile",
                "hosts",
                "--no-ssh",
                "--node-rank",
                "0",
                "--max-restarts",
                "2",
                "--min-nodes",
                "3",
            ],
            "--min-nodes 3 is more than the run's 2 node(s)",
        ),
        (
            ["runs/two", "--hostfile", "hosts", "--launcher", "openmpi", "--max-restarts", "2"],
            "does not combine with --launcher openmpi",
        ),
        (
            ["runs/two", "--hostfile", "hosts", "--no-ssh", "--node-rank", "5", "--max-restarts", "2"],
            "--node-rank 5 is outside 0..1",
        ),
        (["runs/single", "--min-nodes", "1"], "--min-nodes only applies with --max-restarts N"),
        (["runs/single", "--rendezvous", "login1:29400"], "--rendezvous only applies with --max-restarts N"),
        (
            ["runs/single", "--max-restarts", "2", "--rendezvous", "login1:29400"],
            "--rendezvous is for runs on several nodes (one node's agent meets no one: it runs --standalone)",
        ),
        (["runs/single", "--max-restarts", "0"], "--max-restarts must be in 1..1000, got 0"),
        (
            ["runs/single", "--max-restarts", "2", "--hang-timeout", "-1"],
            "--hang-timeout -1 must be 0 (off) or in 1..604800 seconds",
        ),
        (["runs/single", "--hang-timeout", "1e9"], "--hang-timeout 1e+09 must be 0 (off) or in 1..604800"),
        (["runs/single", "--hang-timeout", "0.001"], "--hang-timeout 0.001 must be 0 (off) or in 1..604800"),
    ],
)
def test_bad_elastic_launches_are_one_line_errors(runs, args, message):
    fails(runs, "launch", *args, "--dry-run", message=message)


@pytest.mark.parametrize("command", ["launch", "slurm-script"])
def test_a_min_nodes_whose_restart_could_not_keep_the_batch_is_refused_before_the_job(runs, command):
    """3 nodes x 1 at global batch 9 = micro 3 x ga 1 x dp 3: on 2 nodes no accumulation keeps 9 (the runner's
    resize would refuse that restart), on 1 node ga 3 does."""
    where = (
        ["--hostfile", "hosts3", "--no-ssh", "--node-rank", "0", "--dry-run"] if command == "launch" else ["--force"]
    )
    for low in ("1", "2"):
        fails(
            runs,
            command,
            "runs/three",
            *where,
            "--max-restarts",
            "2",
            "--min-nodes",
            low,
            message=f"--min-nodes {low}: a restart on 2 node(s) would be refused: 2 ranks left give dp 2: global "
            "batch 9 is not divisible by micro_batch 3 x dp 2 = 6; the run cannot keep its batch; give --min-nodes 3 "
            "(restarts on all 3 only)",
        )
    r = dspipe(command, "runs/three", *where, "--max-restarts", "2", "--min-nodes", "3", cwd=runs)
    assert r.returncode == 0, r.stderr


def test_slurm_script_requeues_a_failed_step(runs):
    r = dspipe(
        "slurm-script", "runs/h100", "--max-restarts", "3", "--min-nodes", "1", "--out", "elastic.sbatch", cwd=runs
    )
    assert r.returncode == 0, r.stderr
    text = (runs / "elastic.sbatch").read_text()
    for expected in [
        "#SBATCH --no-kill",
        "--kill-on-bad-exit=0",
        "--master-port 29500 --max-restarts 3 --min-nodes 1",
        '[ "$RC" -ne 0 ] && [ "${SLURM_RESTART_COUNT:-0}" -lt 3 ] && ! run_finished',
    ]:
        assert expected in text
    assert subprocess.run(["bash", "-n", str(runs / "elastic.sbatch")]).returncode == 0
    plain = dspipe("slurm-script", "runs/h100", "--out", "plain.sbatch", cwd=runs)
    assert plain.returncode == 0 and "--no-kill" not in (runs / "plain.sbatch").read_text()
    assert "-lt 0 ]" in (runs / "plain.sbatch").read_text()  # no requeue after a failure unless asked
    fails(runs, "slurm-script", "runs/h100", "--min-nodes", "1", message="--min-nodes 1 needs --max-restarts N")
    fails(runs, "slurm-script", "runs/h100", "--sbatch=--no-kill", message="the script sets --no-kill itself")


def test_a_config_deepspeed_rejects_is_refused_before_any_rank_starts(runs, tmp_path):
    """A value dspipe's own checks let through (a bucket of 1e30 bytes, a float where DeepSpeed's pydantic field
    wants an integer) is refused by launch and slurm-script through DeepSpeed's config class, naming the file, rather
    than by every rank inside deepspeed.initialize."""
    shutil.copytree(runs / "runs" / "single", tmp_path / "runs" / "single")
    ds_file = tmp_path / "runs" / "single" / "ds_config.json"
    ds = json.loads(ds_file.read_text())
    ds["zero_optimization"]["allgather_bucket_size"] = 1e30
    ds_file.write_text(json.dumps(ds))
    words = "runs/single/ds_config.json: DeepSpeed rejects it: 1 validation error for DeepSpeedZeroConfig"
    fails(tmp_path, "launch", "runs/single", "--dry-run", message=words)
    fails(tmp_path, "slurm-script", "runs/single", "--out", "x.sbatch", message=words)
    assert not (tmp_path / "x.sbatch").exists()
