"""`dspipe calibrate`: measure this machine at a model's shapes and write the profile `plan` and `gen-config` take
with --profile. torch is imported only when the command runs."""

from __future__ import annotations

from pathlib import Path

import click

from dspipe.cli.options import FLOAT, INT, Text, _model_from_options, model_options
from dspipe.errors import SpecError
from dspipe.log import get_logger
from dspipe.spec.profile import MAX_RANKS, MAX_THREADS
from dspipe.spec.values import PRECISIONS

CALIBRATE_RANGES = (  # flag, lowest, highest: refused before any rank starts or any buffer is allocated
    ("micro_batch", 1, 4096),
    ("repeats", 1, 1000),
    ("allreduce_mib", 1, 4096),  # 4 GiB per rank: NCCL's all_reduce_perf sweeps end there too
    ("ranks", 1, MAX_RANKS),  # and at most the GPUs here (dspipe.tools.calibrate)
    ("threads", 1, MAX_THREADS),
)


def _is_profile(path: Path) -> bool:
    """Whether `path` is a profile dspipe wrote (what --out may overwrite)."""
    from dspipe.spec.profile import read_profile

    try:
        read_profile(path)
    except SpecError:
        return False
    return True


@click.command("calibrate")
@model_options
@click.option(
    "--precision",
    type=click.Choice(PRECISIONS),
    default=None,
    help="dtype of the compute measurement [bf16 on GPUs, fp32 on a CPU]",
)
@click.option("--micro-batch", type=INT, default=8, show_default=True, help="sequences per forward, as the plan's")
@click.option("--ranks", type=INT, default=None, help="ranks measuring at once [every GPU; 2 CPU ranks]")
@click.option("--threads", type=INT, default=None, help="torch threads per rank [CPU: the cores shared out]")
@click.option("--repeats", type=INT, default=5, show_default=True, help="timed repetitions per figure (median)")
@click.option(
    "--min-seconds",
    type=FLOAT,
    default=5.0,
    show_default=True,
    help="time the forward + backward at least this long (its mean: a training run's view)",
)
@click.option("--allreduce-mib", type=INT, default=16, show_default=True, help="all-reduce size for bus bandwidth")
@click.option(
    "--cpu-adam/--no-cpu-adam",
    default=True,
    show_default=True,
    help="measure DeepSpeedCPUAdam (builds the op if needed)",
)
@click.option(
    "--from-run",
    metavar="RUN_DIR",
    default=None,
    type=Text(),
    help="measure nothing: fold this run's measured step, start-up and memory into the profile it was planned with",
)
@click.option("--out", metavar="FILE", default=None, help="write the profile here [print it]")
def calibrate(**o) -> None:
    """Measure compute (the model's forward + backward and its GEMMs), all-reduce bandwidth and latency, host copy,
    CPU-Adam and optimizer-step rates on this machine and write a profile for --profile (or, with --from-run, fold a
    run's measurements into its profile)."""
    from dspipe.spec.profile import profile_text
    from dspipe.tools.calibrate import calibrate as measure

    out = _checked_out(o)
    if o["from_run"] is not None:
        _from_run(o["from_run"], out=out, given=_measuring_flags(o))
        return
    if o["init_from"]:
        from dspipe.cli.init_from import init_from_spec

        model = init_from_spec(o["init_from"], o)
    else:
        model = _model_from_options(o)
    precision = o["precision"]
    if precision is None:
        import torch

        precision = "bf16" if torch.cuda.is_available() else "fp32"
    profile = measure(
        model=model,
        precision=precision,
        micro_batch=o["micro_batch"],
        ranks=o["ranks"],
        threads=o["threads"],
        repeats=o["repeats"],
        min_seconds=o["min_seconds"],
        allreduce_mib=o["allreduce_mib"],
        cpu_adam=o["cpu_adam"],
        say=get_logger(__name__).info,
    )
    text = profile_text(profile)
    if out is None:
        click.echo(text, nl=False)
        return
    from dspipe.atomic import write_file
    from dspipe.outputs import writing

    with writing(out):
        write_file(out, text)
    _echo_profile(profile)
    click.echo(f"wrote {out} (use: dspipe plan|gen-config ... --profile {out})")


def _echo_profile(profile) -> None:
    """calibrate's summary of the profile it wrote."""
    click.echo(
        f"device {profile.device} ({profile.gpu}), {profile.ranks} rank(s) x {profile.threads_per_rank} "
        f"thread(s), {profile.dtype}, {profile.model}"
    )
    click.echo(f"compute {profile.compute_tflops:.4g} TFLOP/s per rank (GEMMs alone {profile.matmul_tflops:.4g})")
    if profile.allreduce_busbw_gbps is not None:
        click.echo(
            f"all-reduce busbw {profile.allreduce_busbw_gbps:.3g} GB/s, latency "
            f"{profile.allreduce_latency_s * 1e6:.0f} us"
        )
    copy = (
        f"host<->device {profile.host_copy_gbps:.3g} GB/s"
        if profile.host_copy_gbps is not None
        else "host<->device n/a (no GPU)"
    )
    click.echo(f"{copy}, host memcpy {profile.host_memcpy_gbps:.3g} GB/s")
    adam = "n/a" if profile.cpu_adam_params_per_s is None else f"{profile.cpu_adam_params_per_s:.3g} params/s per node"
    click.echo(f"CPU-Adam {adam}, optimizer step {profile.optimizer_params_per_s:.3g} params/s per rank")


def _checked_out(o: dict) -> Path | None:
    """The options checked, and --out: refused before minutes of measuring, not after (an earlier profile is
    rewritten, nothing else)."""
    for name, low, high in CALIBRATE_RANGES:
        if o[name] is None:
            continue
        flag = f"--{name.replace('_', '-')}"
        if o[name] < low:
            raise SpecError(f"{flag} must be at least {low}, got {o[name]} (allowed range {low}..{high:,})")
        if o[name] > high:
            raise SpecError(f"{flag} {o[name]} is over the allowed range {low}..{high:,}")
    if not 0 <= o["min_seconds"] <= 3600:
        raise SpecError(f"--min-seconds must be in [0, 3600], got {o['min_seconds']:g}")
    if o["out"] is None:
        return None
    from dspipe.outputs import target

    out = target(o["out"], flag="--out", expect="file")
    if out.exists() and not _is_profile(out):
        raise SpecError(f"--out {out} exists and is not a dspipe profile; choose another --out")
    return out


def _measuring_flags(o: dict) -> list[str]:
    """The flags of a measurement given beside --from-run (which measures nothing)."""
    ctx = click.get_current_context()
    return [
        f"--{name.replace('_', '-')}"
        for name in o
        if name not in ("from_run", "out") and ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
    ]


def _from_run(run_dir: str, *, out: Path | None, given: list[str]) -> None:
    """--from-run: the run folded into its profile (dspipe.tools.fold), the error left after the correction, the
    profile written to --out or printed."""
    from dspipe.rundir import engine_disagreement, load_engine, load_run
    from dspipe.spec.profile import profile_text
    from dspipe.tools.fold import fold, remaining
    from dspipe.tools.report import read_metrics

    if given:
        raise SpecError(f"--from-run measures nothing: drop {' '.join(given)}")
    run = load_run(run_dir)
    engine = load_engine(run)
    why = engine_disagreement(run, engine)
    if why:
        raise SpecError(why)
    steps, _ = read_metrics(run)
    folded = fold(run, engine=engine, steps=steps)
    say = get_logger(__name__).info
    say(
        f"folded {run.path} into its profile ({folded.profile.basis}): this run's measured / planned "
        + ", ".join(f"{k} {v:.3g}" for k, v in folded.ratios.items())
    )
    for note in folded.notes:
        say(f"  {note}")
    say(
        "  corrections now: "
        + (", ".join(f"{k} x{v:.3g}" for k, v in folded.profile.corrections) or "none")
        + "; after them, this run's plan vs. measured: "
        + ", ".join(
            f"{t.name} {t.predicted:.4g} vs {t.measured:.4g} ({t.ratio:.2f})"
            for t in remaining(run, folded.profile, engine=engine, steps=steps)
            if t.ratio is not None
            and t.name.split(" (")[0] in ("step time", "time to first step", "peak RSS per rank", "peak memory per GPU")
        )
    )
    text = profile_text(folded.profile)
    if out is None:
        click.echo(text, nl=False)
        return
    from dspipe.atomic import write_file
    from dspipe.outputs import writing

    with writing(out):
        write_file(out, text)
    click.echo(f"wrote {out} (use: dspipe plan|gen-config ... --profile {out})")
