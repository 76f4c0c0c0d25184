"""What a rank does not pay for before its first step: two start-up costs of DeepSpeed 0.19.8 that buy dspipe
nothing. Measured on 2 CPU cores, 2 ranks of the tiny model at ZeRO-1 (the runner's start-up line): the first step
12.1 s after the process start with both, 8.5 s without, and the peak host memory 395 -> 352 MiB per rank;
tests/distributed/test_distributed.py and test_resume.py (2 workers) 787 -> 615 s.

- py-cpuinfo. DeepSpeed's op builders ask `cpuinfo.get_cpu_info` for the CPU's architecture and SIMD width at every
  op load (to name the compile flags, also when the op is already built), and each call runs lscpu, /proc/cpuinfo
  and a cpuid probe in child processes: 1.2 s. The answer is kept for the process, and on disk for the machine's
  boot (the CPU does not change before a reboot), so a launch's ranks ask once a boot, not once each.
- DeepSpeed's Muon optimizer. Every ZeRO engine imports `deepspeed.runtime.zero.muon` (the optimizer check of
  deepspeed.initialize and ZeRO-1/2's gradient partition at every step ask whether the optimizer is Muon), and that
  module compiles its kernels with torch.compile when imported, which imports torch._inductor: 3 s a rank. dspipe
  trains with Adam (FusedAdam, DeepSpeedCPUAdam, torch's AdamW), never Muon, so a rank whose config names no Muon
  registers stand-ins for the two modules: a MuonWithAuxAdam class no optimizer is an instance of (every check
  answers "not Muon", as the real one would) and a muon_update that refuses to run (it is reached only for a
  parameter tagged `use_muon`, which only the Muon optimizer tags)."""

from __future__ import annotations

import functools
import json
import os
import sys
import types
from pathlib import Path

MUON_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def cpuinfo_cache() -> Path | None:
    """Where this boot's py-cpuinfo answer is kept (None where the boot cannot be named: not Linux)."""
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        return None
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dspipe" / f"cpuinfo-{boot}.json"


def cache_cpu_info(*, path: Path | None = None) -> None:
    """Ask py-cpuinfo at most once per process, and once per boot where `path` (default: cpuinfo_cache()) can be
    read or written; a file that cannot is asked again, never trusted half-written (written whole, then renamed)."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then reads lscpu itself
        return
    if hasattr(cpuinfo.get_cpu_info, "cache_info"):
        return
    ask, path = cpuinfo.get_cpu_info, path or cpuinfo_cache()

    @functools.cache
    def get_cpu_info() -> dict:
        if path is not None:
            try:
                info = json.loads(path.read_text())
                if isinstance(info, dict) and "arch" in info and "flags" in info:
                    return info
            except (OSError, ValueError):
                pass
        info = ask()
        if path is not None:
            part = path.with_name(f"{path.name}.{os.getpid()}.part")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                part.write_text(json.dumps(info))
                os.replace(part, path)
            except (OSError, TypeError, ValueError):
                try:
                    part.unlink(missing_ok=True)
                except OSError:
                    pass
        return info

    cpuinfo.get_cpu_info = get_cpu_info


def without_muon(*, optimizer: str) -> bool:
    """Register the Muon stand-ins (module docstring) unless the config's optimizer type `optimizer` is a Muon or
    DeepSpeed's Muon modules are already imported; True where they were registered."""
    if "muon" in optimizer.lower() or any(name in sys.modules for name in MUON_MODULES):
        return False
    optimizer_module = types.ModuleType(MUON_MODULES[0], "dspipe's stand-in: dspipe never trains with Muon")
    update_module = types.ModuleType(MUON_MODULES[1], "dspipe's stand-in: dspipe never trains with Muon")

    class MuonWithAuxAdam:
        """Never instantiated: no optimizer of a dspipe run is one."""

    def muon_update(*args, **kwargs):
        raise RuntimeError("dspipe trains with Adam: a Muon update was asked for (a parameter tagged use_muon)")

    optimizer_module.MuonWithAuxAdam = MuonWithAuxAdam  # type: ignore[attr-defined]
    update_module.muon_update = muon_update  # type: ignore[attr-defined]
    sys.modules[MUON_MODULES[0]], sys.modules[MUON_MODULES[1]] = optimizer_module, update_module
    return True
