"""The one module of helpers shared by the tests (unit and distributed): paths, the CLI, DeepSpeed launches, run
directories. Test modules import from here (`from tests.helpers import ...`), never from each other; fixtures live in
tests/conftest.py."""
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dspipe(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspipe", *map(str, args)], cwd=cwd, capture_output=True, text=True)


def error_lines(r):
    return [line for line in r.stderr.splitlines() if line.strip()]


def launch(run_dir, *extra, env=None, num_gpus=2, port=None):
    """`deepspeed --num_gpus N run.py --run RUN_DIR [extra...]` from the repository root (2 CPU ranks by default)."""
    launcher = [shutil.which("deepspeed")] if shutil.which("deepspeed") else [sys.executable, "-m",
                                                                              "deepspeed.launcher.runner"]
    port = port or free_port()
    cmd = [*launcher, "--num_gpus", str(num_gpus), "--master_port", str(port), "run.py", "--run", str(run_dir), *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})


def make_run(tmp_path, corpus, *flags, steps=20, name="run"):
    run_dir = tmp_path / name
    r = dspipe("gen-config", "--model", "tiny", "--gpus-per-node", "2", "--gpu", "cpu", "--global-batch", "16",
               "--micro-batch", "4", "--steps", steps, "--warmup", "2", "--lr", "3e-3", "--log-interval", "5",
               "--data", corpus, "--out", run_dir, "--precision", "bf16", "--offload", "none", "--no-offload-params",
               "--pp", "1", "--checkpointing", "none", *flags)  # explicit strategy; later flags override
    assert r.returncode == 0, r.stderr
    return run_dir


def mount_tmpfs(path, size_bytes):
    """A tmpfs of `size_bytes` at `path` (we run as root in CI) whose size is enforced (a write one MiB past its
    free space fails with ENOSPC); False where mounting is not permitted or the size is not enforced."""
    import errno

    path.mkdir(exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        return False
    probe = path / "probe"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * (shutil.disk_usage(path).free + 2**20))
            f.flush()
            os.fsync(f.fileno())
        enforced = False
    except OSError as e:
        enforced = e.errno == errno.ENOSPC
    probe.unlink(missing_ok=True)
    if not enforced:
        subprocess.run(["umount", str(path)], check=True)
    return enforced


def run_cli(*args) -> int:
    """`dspipe ARGS` in this process (fast; capture output with capsys): the exit code, 0 when it returned."""
    from dspipe.cli.app import main

    try:
        main([str(a) for a in args])
    except SystemExit as e:
        return e.code
    return 0
