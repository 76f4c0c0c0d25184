"""DeepSpeed's compiled ops a run loads (dspipe.runtime.ops) and `dspipe build-ops`, which scripts/setup.sh runs so
that a launch's first step waits for no compile."""

from dspipe.runtime import ops
from tests.helpers import dspipe


def test_an_empty_cache_means_the_launch_builds_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    found = ops.runner_ops(offload="none")
    assert [op.name for op in found] == ["fused_adam", "deepspeed_shm_comm"]  # on the CPU accelerator
    assert not any(op.built for op in found) and all(op.where.startswith(str(tmp_path)) for op in found)
    assert [op.name for op in ops.runner_ops(offload="cpu")] == ["cpu_adam", "deepspeed_shm_comm"]
    assert ops.notice(offload="none") == (
        f"building DeepSpeed's fused_adam, deepspeed_shm_comm ops for this machine before the first step (once: "
        f"cached in {tmp_path}; a minute or two each; 'dspipe build-ops' builds them ahead of time)"
    )


def test_a_failed_build_is_one_line(tmp_path):
    """DeepSpeed's own builder with a compiler that fails (CXX=/bin/false) into an empty cache."""
    r = dspipe("build-ops", "--offload", "none", env={"CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stdout.splitlines() == ["fused_adam: building ..."]
    assert r.stderr.strip().splitlines() == [
        "dspipe: error: building DeepSpeed's fused_adam op failed (Command '['/bin/false', '--version']' returned "
        "non-zero exit status 1.); a launch tries again before its first step"
    ]
    assert not (tmp_path / "fused_adam" / "fused_adam.so").exists()


def test_build_ops_builds_what_a_launch_loads_once():
    """After `dspipe build-ops` (scripts/setup.sh ran it before the tests: then nothing is left to build) every op
    any run loads here is in the cache, and a second call builds nothing."""
    first = dspipe("build-ops")
    assert first.returncode == 0, first.stderr
    again = dspipe("build-ops")
    assert again.returncode == 0, again.stderr
    lines = again.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["fused_adam", "cpu_adam", "deepspeed_shm_comm"]
    assert all(": built (" in line for line in lines)
    assert all(op.built for op in ops.runner_ops(offload=None)) and ops.notice(offload="cpu") is None
