"""Which of DeepSpeed's just-in-time built ops a run needs, and whether this machine's extension cache already holds
them: a launch that finds one missing compiles it first (minutes on a small CPU machine), and the plan's time to the
first step says so. Imports no torch: the cache is found the way torch.utils.cpp_extension finds it
(TORCH_EXTENSIONS_DIR/<op>/<op>.so, else $XDG_CACHE_HOME or ~/.cache, then
torch_extensions/py<major><minor>_<cpu|cuXXX>/<op>/<op>.so). An op installed prebuilt into DeepSpeed (DS_BUILD_OPS=1)
is not seen here: the plan then counts a compile the launch will not do.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SHM_COMM = "deepspeed_shm_comm"
"""DeepSpeed's shared-memory collectives for CPU ranks (built at deepspeed.init_distributed on the CPU accelerator)."""
FUSED_ADAM = "fused_adam"
"""The engine's own Adam (built at deepspeed.initialize when the optimizer is not offloaded)."""
CPU_ADAM = "cpu_adam"
"""DeepSpeedCPUAdam (built at deepspeed.initialize with an offloaded optimizer)."""


def ops_needed(*, backend: str, offload: bool, ranks: int) -> tuple[str, ...]:
    """The ops a rank of this run loads: the shared-memory collectives on gloo with more than one rank, then the
    optimizer's (CPU-Adam when offloaded, else the fused Adam)."""
    comm = (SHM_COMM,) if backend == "gloo" and ranks > 1 else ()
    return (*comm, CPU_ADAM if offload else FUSED_ADAM)


def build_dirs(env: dict | None = None) -> list[Path]:
    """Where torch builds extensions: TORCH_EXTENSIONS_DIR itself when set (torch adds no subdirectory then), else
    <cache>/torch_extensions/py<major><minor>_<cpu|cuXXX> for this Python (any torch build)."""
    env = os.environ if env is None else env
    if env.get("TORCH_EXTENSIONS_DIR"):
        return [Path(env["TORCH_EXTENSIONS_DIR"])]
    cache = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".cache")
    root = Path(cache) / "torch_extensions"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_"
    try:
        return sorted(d for d in root.iterdir() if d.name.startswith(tag))
    except OSError:
        return []


def cached(op: str, *, env: dict | None = None) -> bool:
    """Whether a built `op` library is in this machine's extension cache."""
    return any((d / op / f"{op}.so").is_file() for d in build_dirs(env))


def missing_ops(ops: tuple[str, ...], *, env: dict | None = None) -> tuple[str, ...]:
    """The ops of `ops` a launch would build first."""
    return tuple(op for op in ops if not cached(op, env=env))
