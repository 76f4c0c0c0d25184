"""A calibration profile: what `dspipe calibrate` measured on one machine, and how the planner uses it instead of the
catalog's figures. Reading, validating and applying a profile is pure (no torch); only dspipe.tools.calibrate
measures.

A profile is a JSON object, PROFILE_FORMAT / PROFILE_VERSION, with the machine it describes (device name, catalog
type, dtype, ranks, threads per rank, the model shape and micro-batch it was measured at, date, versions) and its
figures (PROFILE_FIGURES). `apply_profile` turns a catalog GpuType into the calibrated one: the step's compute rate
at the profile's dtype, the all-reduce bus bandwidth inside a node, the collective latency, the host copy rate, the
CPU-Adam rate and the optimizer step rate. Figures a profile leaves null (no pinned host copy without a GPU,
DeepSpeedCPUAdam that did not build) keep the catalog's value; `figure_sources` says which came from where.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from dspipe.errors import SpecError
from dspipe.jsonio import read_object, show
from dspipe.spec.hardware import GpuType, gpu_names, names_text

PROFILE_FORMAT = "dspipe-profile"
PROFILE_VERSION = 2
READ_VERSIONS = (1, 2)
"""Versions this dspipe reads: 1 (no start-up, memory or run figures: those are null) and 2."""
PROFILE_FILE = "profile.json"
"""Name of the profile gen-config copies into a run directory (dspipe.json's cluster.profile holds it too)."""

PROFILE_FIGURES = {
    "compute_tflops": "achieved model TFLOP/s per rank of the model's forward + backward (6N + 6Lhs per token)",
    "matmul_tflops": "achieved TFLOP/s of the model's GEMMs alone (forward and both backward products)",
    "allreduce_busbw_gbps": "all-reduce bus bandwidth inside the node, GB/s: bytes x 2(n-1)/n / time",
    "allreduce_latency_s": "time of a small (4 KiB) all-reduce across the ranks, seconds",
    "host_copy_gbps": "pinned host <-> device copy, GB/s (null without a GPU)",
    "host_memcpy_gbps": "host memory copy, GB/s (what a CPU rank's 'offload' copies run at)",
    "cpu_adam_params_per_s": "DeepSpeedCPUAdam parameters per second, all ranks of the node together (null: not built)",
    "optimizer_params_per_s": "the engine's own (non-offloaded) Adam step, parameters per second per rank",
    "launch_s": "seconds from a rank's process start to its build, no op compiled (null: the catalog's)",
    "initialize_s": "seconds from the build's end to the first step, no op compiled (null: the catalog's)",
    "first_step_extra_s": "the first step's seconds beyond a steady one (null: the catalog's)",
    "jit_build_s": "seconds to compile each DeepSpeed op, by name (null: the catalog's)",
    "rank_base_rss_mib": "a CPU rank's RSS before its build, MiB (null: the catalog's)",
    "host_alloc_factor": "a CPU rank's resident bytes per byte the plan counts (null: the catalog's)",
}
"""Figure -> meaning. Every figure is a finite number > 0, or null where the profile says so."""
RUN_FIGURES = (
    "launch_s",
    "initialize_s",
    "first_step_extra_s",
    "jit_build_s",
    "rank_base_rss_mib",
    "host_alloc_factor",
)
"""Figures a run measures (`dspipe calibrate --from-run`), absent from version 1 files and from measurements."""
CORRECTION_TERMS = ("compute", "communication", "optimizer", "startup")
"""Terms a profile folded from runs corrects: measured / predicted, applied to the figures behind each (compute: the
compute rate; communication: bandwidth and latency; optimizer: the optimizer and CPU-Adam rates; startup: shown,
its figures replaced by the runs' own)."""
FIGURE_RANGE = (1e-9, 1e13)
"""Every figure (and correction) lies in this range: outside it a profile is damaged, not measured."""
ZERO_ALLOWED = ("launch_s", "initialize_s", "first_step_extra_s")
"""Run figures that may be 0 (a first step no slower than the others)."""
DTYPES = ("fp32", "bf16", "fp16")
CORRECTION_RANGE = (1e-3, 1e3)
"""A correction outside this is damage: each run's ratio is within 0.05-20 (dspipe.tools.fold), a total the product
of two of them."""
MAX_RANKS = 1024
"""The most ranks one machine's profile describes (`dspipe calibrate --ranks` has the same limit)."""
MAX_THREADS = 1024
"""The most torch threads a rank of a profile had (`dspipe calibrate --threads` has the same limit)."""
MAX_RUNS = 1_000_000
"""The most runs a profile may have folded in: beyond it the count is damage."""
NULLABLE = ("host_copy_gbps", "cpu_adam_params_per_s", "allreduce_busbw_gbps", "allreduce_latency_s", *RUN_FIGURES)
"""Figures a profile may leave null (not measurable here: no GPU, CPU-Adam not built, a single rank)."""


@dataclass(frozen=True)
class Profile:
    """What `dspipe calibrate` measured on one machine (PROFILE_FIGURES are its figures)."""

    device: str
    """The device name the driver (or /proc/cpuinfo) reports."""
    gpu: str
    """The catalog type it matched ('cpu' without CUDA): a plan for another --gpu refuses the profile."""
    dtype: str
    """Precision the compute was measured in (bf16, fp16, fp32): the compute figure applies to plans in it."""
    ranks: int
    """Ranks that ran at once (GPUs, or CPU processes), as the all-reduce was measured."""
    threads_per_rank: int
    """torch intra-op threads each rank had."""
    model: str
    """Shape the compute was measured at (ModelSpec.shape_text) and its micro-batch, e.g. 'L4 h128 ... micro 8'."""
    created: str
    """Date of the measurement, ISO 8601."""
    versions: str
    """python, torch and deepspeed versions, one line (dspipe.tools.bench.versions)."""
    compute_tflops: float
    """PROFILE_FIGURES['compute_tflops']."""
    matmul_tflops: float
    """PROFILE_FIGURES['matmul_tflops']."""
    allreduce_busbw_gbps: float | None
    """PROFILE_FIGURES['allreduce_busbw_gbps']."""
    allreduce_latency_s: float | None
    """PROFILE_FIGURES['allreduce_latency_s']."""
    host_copy_gbps: float | None
    """PROFILE_FIGURES['host_copy_gbps']."""
    host_memcpy_gbps: float
    """PROFILE_FIGURES['host_memcpy_gbps']."""
    cpu_adam_params_per_s: float | None
    """PROFILE_FIGURES['cpu_adam_params_per_s']."""
    optimizer_params_per_s: float
    """PROFILE_FIGURES['optimizer_params_per_s']."""
    launch_s: float | None = None
    initialize_s: float | None = None
    first_step_extra_s: float | None = None
    jit_build_s: tuple[tuple[str, float], ...] | None = None
    rank_base_rss_mib: float | None = None
    host_alloc_factor: float | None = None
    corrections: tuple[tuple[str, float], ...] = ()
    """(term, measured / predicted) per CORRECTION_TERMS term folded from runs (a term a run could not measure is
    absent)."""
    runs: int = 0
    """Runs folded in (`dspipe calibrate --from-run`)."""
    measured_by: str = "calibrate"
    """'calibrate' (the command) or 'gen-config' (the quick measurement plan and gen-config take of this machine)."""

    def correction(self, term: str) -> float:
        return dict(self.corrections).get(term, 1.0)

    @property
    def basis(self) -> str:
        """What the figures rest on, in words: 'measured by calibrate, corrected by 2 runs'."""
        runs = f", corrected by {self.runs} run{'s' if self.runs != 1 else ''}" if self.runs else ""
        return f"measured by {self.measured_by}{runs}"


TEXT_FIELDS = ("device", "gpu", "dtype", "model", "created", "versions")


def profile_from_dict(data: object, *, where: str) -> Profile:
    """A Profile from its JSON form (profile_to_dict's), every field checked; SpecError '<where>: <field> ...'."""
    if not isinstance(data, dict):
        raise SpecError(f"{where}: a profile must be a JSON object, got {type(data).__name__}")
    if data.get("format") != PROFILE_FORMAT:
        raise SpecError(
            f"{where}: not a dspipe profile (format {data.get('format')!r}, expected {PROFILE_FORMAT!r}); "
            f"write one with 'dspipe calibrate --out FILE'"
        )
    version = data.get("version")
    if isinstance(version, bool) or version not in READ_VERSIONS:
        raise SpecError(
            f"{where}: profile version {version!r} is not one this dspipe reads "
            f"({', '.join(map(str, READ_VERSIONS))}); re-run 'dspipe calibrate'"
        )
    known = {f.name for f in fields(Profile)} | {"format", "version", "figures"}
    unknown = sorted(set(data) - known)
    figures = data.get("figures")
    if unknown:
        raise SpecError(f"{where}: unknown profile key {', '.join(map(str, unknown))}")
    if not isinstance(figures, dict):
        raise SpecError(f"{where}: figures must be an object, got {type(figures).__name__}")
    extra = sorted(set(figures) - set(PROFILE_FIGURES))
    if extra:
        raise SpecError(f"{where}: unknown figure {', '.join(map(str, extra))} (known: {', '.join(PROFILE_FIGURES)})")
    values: dict[str, Any] = {}  # Profile's keywords, each checked below: str, int, float or None
    for name in TEXT_FIELDS:
        value = data.get(name)
        if not isinstance(value, str) or not value or "\n" in value:
            raise SpecError(f"{where}: {name} must be a one-line non-empty string, got {value!r}")
        values[name] = value
    for name, high in (("ranks", MAX_RANKS), ("threads_per_rank", MAX_THREADS)):
        value = data.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            raise SpecError(f"{where}: {name} must be an integer in 1..{high:,}, got {show(value)}")
        values[name] = value
    values.update(_run_fields(data, where=where))
    for name in PROFILE_FIGURES:
        if name not in figures and not (name in RUN_FIGURES and version == 1):
            raise SpecError(f"{where}: missing figure {name} ({PROFILE_FIGURES[name]})")
        value = figures.get(name)
        if value is None and name in NULLABLE:
            values[name] = None
            continue
        if name == "jit_build_s":
            values[name] = _jit_figure(value, where=where)
            continue
        if not _in_range(value, zero=name in ZERO_ALLOWED):
            low = "0" if name in ZERO_ALLOWED else f"{FIGURE_RANGE[0]:g}"
            allowed = f"a number in {low}..{FIGURE_RANGE[1]:g}" + (" or null" if name in NULLABLE else "")
            raise SpecError(f"{where}: figures.{name} must be {allowed}, got {value!r}")
        assert isinstance(value, (int, float))  # _in_range checked it
        values[name] = float(value)
    if values["gpu"] not in gpu_names():
        raise SpecError(f"{where}: gpu {values['gpu']!r} is not a catalog GPU type ({names_text()})")
    if values["dtype"] not in DTYPES:
        raise SpecError(f"{where}: dtype must be one of {', '.join(DTYPES)}, got {values['dtype']!r}")
    if values["ranks"] > 1 and (values["allreduce_busbw_gbps"] is None or values["allreduce_latency_s"] is None):
        raise SpecError(
            f"{where}: figures.allreduce_busbw_gbps and allreduce_latency_s may be null only for a "
            f"1-rank profile (ranks {values['ranks']})"
        )
    return Profile(**values)


def _in_range(value: object, *, zero: bool = False, bounds: tuple[float, float] = FIGURE_RANGE) -> bool:
    """A number in `bounds` (or 0, with `zero`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return (zero and value == 0) or bounds[0] <= value <= bounds[1]


def _jit_figure(value: object, *, where: str) -> tuple[tuple[str, float], ...]:
    """figures.jit_build_s: an object of op name -> seconds > 0."""
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and 0 < len(k) <= 60 and _in_range(v) for k, v in value.items()
    ):
        raise SpecError(f"{where}: figures.jit_build_s must be an object of op name -> seconds > 0, got {value!r}")
    return tuple((k, float(v)) for k, v in value.items())


def _correction(term: object, value: object) -> bool:
    return term in CORRECTION_TERMS and _in_range(value, bounds=CORRECTION_RANGE)


def _run_fields(data: dict[str, Any], *, where: str) -> dict[str, Any]:
    """corrections, runs and measured_by (absent in version 1 files: none, 0, 'calibrate')."""
    out: dict[str, Any] = {}
    corrections = data.get("corrections", {})
    bad = (
        [f"{show(k)}: {show(v)}" for k, v in corrections.items() if not _correction(k, v)]
        if isinstance(corrections, dict)
        else [show(corrections)]
    )
    if bad:
        raise SpecError(
            f"{where}: corrections must be an object of {', '.join(CORRECTION_TERMS)} -> a number in "
            f"{CORRECTION_RANGE[0]:g}..{CORRECTION_RANGE[1]:g}, got {bad[0]}"
        )
    out["corrections"] = tuple((k, float(v)) for k, v in corrections.items())
    runs = data.get("runs", 0)
    if isinstance(runs, bool) or not isinstance(runs, int) or not 0 <= runs <= MAX_RUNS:
        raise SpecError(f"{where}: runs must be an integer in 0..{MAX_RUNS:,}, got {show(runs)}")
    if corrections and not runs:
        raise SpecError(f"{where}: corrections {corrections!r} with runs 0: corrections come from runs folded in")
    out["runs"] = runs
    by = data.get("measured_by", "calibrate")
    if by not in ("calibrate", "gen-config"):
        raise SpecError(f"{where}: measured_by must be 'calibrate' or 'gen-config', got {by!r}")
    out["measured_by"] = by
    return out


def profile_to_dict(profile: Profile) -> dict[str, object]:
    """The JSON form: the machine's description at the top level, the measured numbers under 'figures', then the
    runs' corrections."""
    d = asdict(profile)
    head = {
        k: d.pop(k)
        for k in ("device", "gpu", "dtype", "ranks", "threads_per_rank", "model", "created", "versions", "measured_by")
    }
    tail = {"corrections": dict(d.pop("corrections")), "runs": d.pop("runs")}
    if d["jit_build_s"] is not None:
        d["jit_build_s"] = dict(d["jit_build_s"])
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **head, "figures": d, **tail}


def read_profile(path: str | Path, *, gpu: str | None = None) -> Profile:
    """The profile in `path`, validated; with `gpu`, it must have been measured on that catalog type. One-line
    SpecError naming the file otherwise."""
    path = Path(path)
    try:
        data = read_object(path)
    except SpecError as e:  # read_object's line begins with the path
        raise SpecError(f"--profile {e}") from None
    profile = profile_from_dict(data, where=f"--profile {path}")
    if gpu is not None:
        check_profile_gpu(profile, gpu=gpu, where=f"--profile {path}")
    return profile


def check_profile_gpu(profile: Profile, *, gpu: str, where: str) -> None:
    """A profile measured on one catalog type says nothing about another."""
    if profile.gpu != gpu:
        raise SpecError(
            f"{where}: profile measured on {profile.gpu!r} ({profile.device}), but the cluster's GPU type "
            f"is {gpu!r}; calibrate on a {gpu} machine or pass --gpu {profile.gpu}"
        )


def profile_text(profile: Profile) -> str:
    """The profile file's text (indented JSON, newline-terminated)."""
    return json.dumps(profile_to_dict(profile), indent=2) + "\n"


def apply_profile(gpu: GpuType, profile: Profile) -> GpuType:
    """The catalog type with the profile's figures in place of its own: the compute rate at the profile's dtype,
    the intra-node bandwidth (the all-reduce bus bandwidth, what a ring collective moves per rank per second: the
    same meaning as the catalog's figure), the collective latency (the small all-reduce's time less its 2(n-1)
    hops at the catalog's per-hop cost, never below 0), the host copy rate (pinned on a GPU; on the 'cpu' type the
    memcpy rate an offload copy runs at), the CPU-Adam and optimizer-step rates, each over its term's correction
    from runs (Profile.corrections); and the start-up and CPU memory figures runs measured."""
    comm, opt = profile.correction("communication"), profile.correction("optimizer")
    changes: dict[str, Any] = {
        "calibrated_precision": profile.dtype,
        "calibrated_tflops": profile.compute_tflops / profile.correction("compute"),
        "optimizer_params_per_s": profile.optimizer_params_per_s / opt,
    }
    if profile.allreduce_busbw_gbps is not None:
        changes["intra_node_gbps"] = profile.allreduce_busbw_gbps / comm
    if profile.allreduce_latency_s is not None:
        hops = 2 * (profile.ranks - 1) * gpu.ring_hop_latency_s
        changes["ring_base_latency_s"] = max(0.0, profile.allreduce_latency_s * comm - hops)
    copy = (
        profile.host_copy_gbps
        if profile.host_copy_gbps is not None
        else (profile.host_memcpy_gbps if gpu.backend == "gloo" else None)
    )
    if copy is not None:
        changes["host_copy_gbps"] = copy
    if profile.cpu_adam_params_per_s is not None:
        changes["cpu_adam_params_per_s"] = profile.cpu_adam_params_per_s / opt
    for name in ("launch_s", "initialize_s", "first_step_extra_s", "host_alloc_factor"):
        if getattr(profile, name) is not None:
            changes[name] = getattr(profile, name)
    if profile.jit_build_s is not None:
        changes["jit_build_s"] = tuple({**dict(gpu.jit_build_s), **dict(profile.jit_build_s)}.items())
    if profile.rank_base_rss_mib is not None:
        changes["rank_base_rss_bytes"] = int(profile.rank_base_rss_mib * 1024**2)
    return replace(gpu, **changes)


def figure_sources(
    *,
    catalog: GpuType,
    profile: Profile | None,
    profile_name: str | None,
    overrides: dict[str, float | None],
    precision: str,
) -> list[tuple[str, str, str]]:
    """(figure, value, source) for `plan`'s output: which time-model figures come from the profile, an override
    flag or the catalog."""
    calibrated = apply_profile(catalog, profile) if profile is not None else catalog
    src_profile = f"profile {profile_name}" if profile_name else "profile"
    rows = []
    compute_from_profile = profile is not None and profile.dtype == precision
    rows.append(
        (
            "compute",
            f"{calibrated.compute_tflops(precision):.4g} TFLOP/s per rank",
            src_profile
            if compute_from_profile
            else (
                f"catalog ({catalog.matmul_efficiency:g} x {precision} peak)"
                + (f"; the profile measured {profile.dtype}" if profile is not None else "")
            ),
        )
    )
    for name, label, flag, unit in (
        ("intra_node_gbps", "intra-node bandwidth", "--intra-node-gbps", "GB/s"),
        ("inter_node_gbps", "inter-node bandwidth", "--inter-node-gbps", "GB/s"),
    ):
        value = overrides.get(name)
        if value is not None:
            rows.append((label, f"{value:g} {unit}", flag))
        else:
            changed = getattr(calibrated, name) != getattr(catalog, name)
            rows.append((label, f"{getattr(calibrated, name):.4g} {unit}", src_profile if changed else "catalog"))
    for name, label, unit in (
        ("ring_base_latency_s", "collective latency", "s"),
        ("host_copy_gbps", "host copy", "GB/s"),
        ("cpu_adam_params_per_s", "CPU-Adam", "params/s"),
        ("optimizer_params_per_s", "optimizer step", "params/s per rank"),
    ):
        value = getattr(calibrated, name)
        changed = value != getattr(catalog, name)
        shown = "not modelled" if name == "optimizer_params_per_s" and not value else f"{value:.4g} {unit}"
        rows.append((label, shown, src_profile if changed else "catalog"))
    return rows
