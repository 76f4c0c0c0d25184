"""The quick measurement `plan` and `gen-config` take of the machine they run on, when the plan is for this machine
(the 'cpu' type, or the GPU type this machine has) and no --profile is given: `dspipe calibrate`'s figures at the
plan's model shape, micro-batch and precision, timed briefly (QUICK), with the ranks the run will start here. A
measurement is cached per machine and shape (cache_path): the next plan of the same shape here reads it back.

--measure auto (the default) measures only then; never keeps the catalog's figures; always measures or fails in one
line where the plan is not for this machine. A --profile wins over all three. The tests plan with DSPIPE_MEASURE=never
(the catalog's figures, the same on every machine).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
from dataclasses import replace
from importlib import metadata
from pathlib import Path

from dspipe.errors import SpecError
from dspipe.spec.model import ModelSpec
from dspipe.spec.profile import PROFILE_VERSION, Profile, profile_from_dict, profile_text
from dspipe.tools.bench_worker import cpu_model

MEASURE_CHOICES = ("auto", "always", "never")
QUICK = {"repeats": 3, "min_seconds": 2.0, "allreduce_mib": 4, "cpu_adam": False}
"""calibrate's settings for the quick measurement: ~10 s for the demo's GPT on 2 CPU cores (CPU-Adam, which may need
a minutes-long compile, keeps the catalog's rate: `dspipe calibrate` measures it)."""
QUICK_MICRO_BATCH = 4
"""Micro-batch measured at when the plan's is left to the search."""
CPU_QUICK_FLOPS = 1e11
"""On CPU ranks the quick measurement runs only where one forward + backward of a micro-batch is at most this many
model FLOPs (~5 s at the 0.02 TFLOP/s a rank of the 2-core machine reaches; the demo's is 8e9): a larger model would
turn a plan into minutes of measuring, so it keeps the catalog's figures and says how to measure once instead."""


def too_big(*, gpu: str, model: ModelSpec, micro_batch: int | None) -> str | None:
    """Why the quick measurement is skipped for this model (None: it runs)."""
    from dspipe.planner.throughput import model_flops_per_token

    micro = micro_batch or QUICK_MICRO_BATCH
    flops = model_flops_per_token(model) * micro * model.seq_len
    if gpu != "cpu" or flops <= CPU_QUICK_FLOPS:
        return None
    return (
        f"machine: not measured: one forward + backward of {micro} x {model.seq_len} tokens is {flops:.2g} FLOPs, "
        f"over the {CPU_QUICK_FLOPS:.0e} a quick measurement on CPU ranks allows; the catalog's figures (measure once: "
        f"dspipe calibrate ... --out FILE, then --profile FILE)"
    )


def cache_dir(env: dict | None = None) -> Path:
    """$DSPIPE_CACHE, else $XDG_CACHE_HOME/dspipe or ~/.cache/dspipe; measurements under machine/."""
    env = os.environ if env is None else env
    if env.get("DSPIPE_CACHE"):
        return Path(env["DSPIPE_CACHE"]) / "machine"
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".cache")
    return Path(base) / "dspipe" / "machine"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def machine_key(*, gpu: str, model: ModelSpec, precision: str, micro_batch: int, ranks: int) -> str:
    """What a cached measurement must match: the host, its cores and software, the shape measured."""
    parts = [
        platform.node(),
        cpu_model(),
        str(os.cpu_count()),
        sys.version.split()[0],
        _version("torch"),
        _version("deepspeed"),
        str(PROFILE_VERSION),
        gpu,
        model.shape_text,
        precision,
        str(micro_batch),
        str(ranks),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def cache_path(**key) -> Path:
    return cache_dir() / f"{machine_key(**key)}.json"


def here(gpu: str) -> bool:
    """Whether a plan for `gpu` is a plan for this machine: 'cpu' always (CPU ranks run anywhere); a GPU type when
    a GPU is visible (a driver device node) and torch's device 0 is that type."""
    if gpu == "cpu":
        return True
    if not (Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi")):
        return False
    from dspipe.spec.hardware import detect

    found = detect()
    return found.gpu is not None and found.gpu.name == gpu


def _read_cached(path: Path, *, gpu: str, say) -> Profile | None:
    try:
        data = json.loads(path.read_text())
        profile = profile_from_dict(data, where=str(path))
    except (OSError, ValueError, SpecError) as e:
        if path.exists():
            say(f"machine: the cached measurement {path} is unreadable ({str(e).splitlines()[0]}); measuring again")
        return None
    return profile if profile.gpu == gpu else None


def machine_profile(*, gpu: str, model: ModelSpec, precision: str, micro_batch: int | None, ranks: int, say) -> Profile:
    """This machine measured at the plan's shapes (QUICK), from the cache when it holds this key; `say` gets one
    line saying which."""
    micro = micro_batch or QUICK_MICRO_BATCH
    if gpu != "cpu":
        import torch

        ranks = min(ranks, torch.cuda.device_count())
    path = cache_path(gpu=gpu, model=model, precision=precision, micro_batch=micro, ranks=ranks)
    profile = _read_cached(path, gpu=gpu, say=say)
    if profile is not None:
        say(f"machine: {_figures(profile)} (measured here before, cached in {path}; --measure never: the catalog's)")
        return profile
    from dspipe.tools.calibrate import calibrate

    profile = calibrate(
        model=model, precision=precision, micro_batch=micro, ranks=ranks, on_cpu=gpu == "cpu", say=_quiet, **QUICK
    )
    profile = replace(profile, measured_by="gen-config")
    try:
        from dspipe.atomic import write_file

        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, profile_text(profile))
        where = f"cached in {path}"
    except OSError as e:  # a read-only home still plans, measuring each time
        where = f"not cached: {e.strerror or e}"
    say(f"machine: {_figures(profile)} (measured now, {where}; --measure never: the catalog's)")
    return profile


def _quiet(line: str) -> None:
    """calibrate's notes (CPU-Adam skipped) are the quick measurement's design, not news."""


def _figures(p: Profile) -> str:
    busbw = "" if p.allreduce_busbw_gbps is None else f", all-reduce {p.allreduce_busbw_gbps:.3g} GB/s"
    return (
        f"{p.device}, {p.ranks} rank(s) x {p.threads_per_rank} thread(s), {p.model}, {p.dtype}: compute "
        f"{p.compute_tflops:.4g} TFLOP/s per rank{busbw}, optimizer {p.optimizer_params_per_s:.3g} params/s"
    )
