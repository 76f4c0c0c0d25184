"""Two "nodes" on one machine through `dspipe launch`: DeepSpeed's launcher with --no-ssh per node, pdsh over a real
sshd on localhost, and the sbatch script (torch's elastic agent per node, a failed run step requeued) under a
stand-in for Slurm. Each trains the tiny GPT to the same per-step losses as the single-node 2-rank run of the same
config. Plus the doctor's all-reduce."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from dspipe.runtime.watchdog import read_events
from tests.helpers import ROOT, dspipe, free_port, gen_config, metrics, written_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.solo]  # 4+ ranks, or a time it measures
HOSTS = "localhost slots=1\n127.0.0.1 slots=1\n"  # two names for this machine: two "nodes", one CPU rank each
TIMEOUT = 900


def gen(tmp, corpus, name, *flags):
    r = gen_config(
        "--model",
        "tiny",
        "--gpu",
        "cpu",
        "--global-batch",
        "16",
        "--micro-batch",
        "4",
        "--steps",
        "6",
        "--warmup",
        "2",
        "--lr",
        "3e-3",
        "--precision",
        "fp32",
        "--data",
        corpus,
        "--out",
        f"runs/{name}",
        *flags,
        cwd=tmp,
    )
    assert r.returncode == 0, r.stderr
    return tmp / "runs" / name


def env_with(**extra):
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **extra,
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, corpus):
    """A hostfile of two local "nodes" and the single-node 2-rank reference run, trained once."""
    tmp = tmp_path_factory.mktemp("multinode")
    (tmp / "hosts").write_text(HOSTS)
    single = gen(tmp, corpus, "single", "--gpus-per-node", "2")
    r = dspipe("launch", "runs/single", "--master-port", free_port(), cwd=tmp)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    reference = metrics(single, "loss")
    assert len(reference) == 6 and len(set(reference)) > 1
    return tmp, corpus, reference


def test_two_nodes_no_ssh_train_like_one_node(cluster):
    tmp, corpus, reference = cluster
    run = gen(tmp, corpus, "nossh", "--hostfile", "hosts")
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dspipe",
                "launch",
                "runs/nossh",
                "--hostfile",
                "hosts",
                "--no-ssh",
                "--node-rank",
                str(rank),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
            ],
            cwd=tmp,
            env=env_with(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=TIMEOUT)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "--node_rank=1" in outputs[1] and "done: loss" in outputs[0]  # each node ran its own DeepSpeed launch
    assert (run / ".deepspeed_env").read_text() == "DEEPSPEED_TIMEOUT=30\n"
    assert metrics(run, "loss") == pytest.approx(reference, abs=1e-5)


def test_doctor_all_reduce_on_this_machine(tmp_path):
    r = dspipe(
        "doctor",
        "--master-port",
        free_port(),
        "--size-mb",
        "8",
        "--iters",
        "5",
        "--env",
        "DSPIPE_PROBE=7",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"^python 3\.\d+\.\d+ \| torch \S+ \| deepspeed \S+ \| CUDA \S+ \| NCCL \S+$", r.stdout, re.M)
    assert "deepspeed ops (cpu): fused_adam" in r.stdout
    m = re.search(
        r"all-reduce: 2 ranks \(1 node\(s\)\), gloo, 8 MiB fp32 x 5: [\d.]+ ms each, bus bandwidth "
        r"([\d.]+) GB/s \(algbw [\d.]+\); planner assumes 10 GB/s \(intra-node, cpu\)",
        r.stdout,
    )
    assert m and float(m.group(1)) > 0, r.stdout
    assert "environment on every rank: DEEPSPEED_TIMEOUT=30, DSPIPE_PROBE=7" in r.stdout


@pytest.fixture
def sshd(tmp_path):
    """sshd on a free localhost port with its own keys, and an `ssh` first on PATH that uses them (for pdsh and
    DeepSpeed's own ssh check). Nothing outside tmp_path changes except sshd's privilege-separation directory."""
    for tool in ("/usr/sbin/sshd", "pdsh", "ssh-keygen"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is not installed (apt-get install openssh-server pdsh)")
    if os.geteuid() != 0:
        pytest.skip("sshd needs root for its privilege separation")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    d = tmp_path / "ssh"
    (d / "bin").mkdir(parents=True)
    for key in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    shutil.copy(d / "id.pub", d / "authorized_keys")
    port = free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_key\nPidFile {d}/sshd.pid\n"
        f"AuthorizedKeysFile {d}/authorized_keys\nStrictModes no\nUsePAM no\nPermitRootLogin prohibit-password\n"
        f"PasswordAuthentication no\nKbdInteractiveAuthentication no\nLogLevel ERROR\n"
    )
    (d / "ssh_config").write_text(
        f"Host *\n  Port {port}\n  IdentityFile {d}/id\n  IdentitiesOnly yes\n  StrictHostKeyChecking no\n"
        f"  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
    )
    (d / "bin/ssh").write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {d}/ssh_config "$@"\n')
    (d / "bin/ssh").chmod(0o755)
    server = subprocess.Popen(
        ["/usr/sbin/sshd", "-D", "-e", "-f", str(d / "sshd_config")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    env = env_with(PATH=f"{d / 'bin'}{os.pathsep}{os.environ['PATH']}")
    for _ in range(50):
        if subprocess.run(["ssh", "-o", "BatchMode=yes", "127.0.0.1", "true"], env=env).returncode == 0:
            break
        if server.poll() is not None:
            pytest.fail(f"sshd exited: {server.stderr.read().decode()[-2000:]}")
        subprocess.run(["sleep", "0.2"])
    yield env
    server.terminate()
    server.wait(timeout=30)


def test_pdsh_over_ssh_on_localhost(cluster, sshd):
    tmp, corpus, reference = cluster
    port = str(free_port())
    doctor = subprocess.run(
        [
            sys.executable,
            "-m",
            "dspipe",
            "doctor",
            "--hostfile",
            "hosts",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
            "--size-mb",
            "8",
            "--iters",
            "5",
            "--env",
            "DSPIPE_PROBE=pdsh",
        ],
        cwd=tmp,
        env=sshd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert doctor.returncode == 0, doctor.stdout[-3000:] + doctor.stderr[-3000:]
    assert "ssh: 2 host(s) reachable (localhost, 127.0.0.1)" in doctor.stdout
    assert "planner assumes 10 GB/s (inter-node, cpu)" in doctor.stdout
    # both ranks, each started over ssh, saw the .deepspeed_env values DeepSpeed's runner exported through pdsh
    assert "environment on every rank: DEEPSPEED_TIMEOUT=30, DSPIPE_PROBE=pdsh" in doctor.stdout

    run = gen(tmp, corpus, "pdsh", "--hostfile", "hosts")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dspipe",
            "launch",
            "runs/pdsh",
            "--hostfile",
            "hosts",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
        ],
        cwd=tmp,
        env=sshd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "pdsh -S -f 1024 -w localhost,127.0.0.1" in r.stdout + r.stderr
    assert metrics(run, "loss") == pytest.approx(reference, abs=1e-5)


def test_slurm_script_on_a_stand_in_for_slurm(cluster):
    """The generated sbatch script (--max-restarts 1), run by bash with `scontrol` and `srun` stand-ins for a
    2-node allocation: it builds the hostfile from the node list and starts one `dspipe launch --no-ssh` per node
    under torch's elastic agent. Rank 1 is killed twice: the agents restart the job once, then the run step fails
    (srun's --kill-on-bad-exit ends the other node) and the script requeues the job; the requeued start
    (SLURM_RESTART_COUNT=1, as Slurm sets it) resumes from the newest checkpoint and finishes with the losses of the
    single-node run, each step once."""
    tmp, corpus, reference = cluster
    run = gen(tmp, corpus, "slurm", "--hostfile", "hosts", "--save-interval", "2", "--sync-save")
    r = dspipe("slurm-script", "runs/slurm", "--master-port", free_port(), "--max-restarts", "1", cwd=tmp)
    assert r.returncode == 0, r.stderr
    fake = tmp / "fake-slurm"
    fake.mkdir()
    (fake / "scontrol").write_text(  # the node list; a requeue is recorded (the test plays Slurm's second start)
        '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "localhost\\n127.0.0.1\\n" && exit 0\n'
        f'[ "$1" = requeue ] && echo "$@" >> {tmp}/requeued && exit 0\nexit 1\n'
    )
    (fake / "srun").write_text(  # one task per node, SLURM_NODEID set; --kill-on-bad-exit=1: a task failing ends all
        "#!/bin/bash\nkill_on_bad=0\n"
        'while [[ "$1" == --* ]]; do [ "$1" = --kill-on-bad-exit=1 ] && kill_on_bad=1; shift; done\n'
        'pids=()\nfor id in 0 1; do SLURM_NODEID=$id setsid "$@" & pids+=($!); done\n'
        "rc=0; left=${#pids[@]}\n"
        'while [ "$left" -gt 0 ]; do\n'
        "  wait -n; code=$?; left=$((left - 1))\n"
        '  if [ "$code" -ne 0 ]; then\n'
        "    rc=$code\n"
        '    if [ "$kill_on_bad" = 1 ]; then for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done; fi\n'
        "  fi\n"
        "done\nexit $rc\n"
    )
    faults = '[{"kill_at_step": 3, "kill_rank": 1}, {"kill_at_step": 5, "kill_rank": 1}]'
    (fake / "dspipe").write_text(  # the job's first start is the one whose rank 1 dies (twice)
        "#!/bin/bash\n"
        f'if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then set -- "$@" --test-faults \'{faults}\'; fi\n'
        f'exec {sys.executable} -m dspipe "$@"\n'
    )
    for f in fake.iterdir():
        f.chmod(0o755)
    env = env_with(
        PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="42", SLURM_JOB_NODELIST="localhost,127.0.0.1"
    )
    job = subprocess.run(
        ["bash", "runs/slurm/slurm.sbatch"], cwd=tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert (tmp / "requeued").read_text() == "requeue 42\n"
    assert "dspipe: the run step failed (exit code" in job.stderr and "job 42 requeued (requeue 1 of 1)" in job.stderr
    assert (run / "hostfile.slurm-42").read_text() == HOSTS
    latest = (run / "checkpoints" / "latest").read_text()
    assert latest == "global_step4"  # the agents' restart resumed from 2 and saved 4; then rank 1 died after 5
    restarts = [(e["attempt"], e["step"], e["world"]) for e in read_events(run) if e["event"] == "restart"]
    assert restarts == [(1, 2, 2)]  # inside the allocation, the agents restarted the job once, from step 2
    again = subprocess.run(
        ["bash", "runs/slurm/slurm.sbatch"],
        cwd=tmp,
        env={**env, "SLURM_RESTART_COUNT": "1"},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resumed from" in again.stdout + again.stderr and "at step 4" in again.stdout + again.stderr
    assert (tmp / "requeued").read_text() == "requeue 42\n"  # finished: not requeued again
    assert [int(s) for s, *_ in written_metrics(run)] == list(range(1, 7))  # each step once
    assert metrics(run, "loss") == pytest.approx(reference, abs=1e-5)
