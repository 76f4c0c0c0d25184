"""Plan -> render -> verify -> write run: the one sequence by which gen-config and bench turn the planner's choice
into a run directory. Imports no torch/deepspeed until the config is verified (deepspeed is optional there)."""

from __future__ import annotations

from pathlib import Path

import click

from dspipe.cli.options import AppliedPreset
from dspipe.errors import SpecError
from dspipe.log import get_logger
from dspipe.planner.render import render_ds_config
from dspipe.planner.summary import estimate_summary
from dspipe.run_estimate import RunEstimate
from dspipe.rundir import write_run
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.model import ModelSpec


def verify_with_deepspeed(ds_config: dict, *, dp: int, source: Path | None = None) -> None:
    """Parse the config with DeepSpeedConfig as rank 0 of `dp` would; a note (no error) without deepspeed. `source`:
    the run directory's ds_config.json it was read from (a launch's check), named in the error."""
    from dspipe.runtime.dscheck import import_deepspeed_quietly, parse_with_deepspeed

    try:
        import_deepspeed_quietly()  # optional here: planning works without it; its import-time lines not on stdout
    except ImportError:
        get_logger(__name__).info("note: deepspeed is not installed; the config was not parsed by DeepSpeedConfig")
        return

    try:
        parse_with_deepspeed(ds_config, dp=dp)
    except Exception as e:  # DeepSpeed raises assertion, value and pydantic errors alike
        said = " ".join(str(e).split())
        raise SpecError(
            f"{source}: DeepSpeed rejects it: {said}" if source else f"DeepSpeed rejects the rendered config: {said}"
        ) from None


def prepare_run(
    out: Path,
    *,
    model: ModelSpec,
    cluster: ClusterSpec,
    best,
    data: str,
    command: str,
    wall_clock_breakdown: bool = False,
    force: bool = False,
    monitors: dict | None = None,
    preset: AppliedPreset | None = None,
    auto_interval: bool = False,
) -> dict:
    """Render the DeepSpeed config of the search's `best` candidate (its plan, train and strategy), verify it with
    DeepSpeed, and write the run directory `out` (ds_config.json, dspipe.json); returns the config. `preset`: the
    --preset choose() applied (its keys rendered, then accounted for); `auto_interval`: train.save_interval came
    from --save-interval auto, marked by the estimate's save_interval_auto (the runner re-plans it)."""
    plan, train = best.plan, best.train
    ds_config = render_ds_config(
        plan=plan,
        model=model,
        train=train,
        monitor_dir=str(Path(out) / "monitor"),
        wall_clock_breakdown=wall_clock_breakdown,
        preset=preset.imp if preset else None,
        monitors=monitors,
    )
    report = preset.report(ds_config) if preset else []  # each --preset key's fate; SpecError if contradicted
    verify_with_deepspeed(ds_config, dp=plan.ds_batch_ranks)
    write_run(
        out,
        model=model,
        cluster=cluster,
        train=train,
        strategy=best.strategy,
        plan=plan,
        data=data,
        ds_config=ds_config,
        command=command,
        force=force,
        estimate=RunEstimate.written(estimate_summary(best), auto_interval=auto_interval),
    )
    for line in report:
        click.echo(line)
    return ds_config
