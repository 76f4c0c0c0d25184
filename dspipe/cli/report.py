"""`dspipe report runs/NAME`: plots and report.md from a run's metrics, set against its plan. Imports no torch;
matplotlib loads only when the command runs."""

from __future__ import annotations

from pathlib import Path

import click

from dspipe.cli.options import Text


@click.command("report")
@click.argument("run", type=Text())  # a str: '' must not become Path('.'), this directory
@click.option(
    "--out",
    default=None,
    metavar="DIR",
    help="directory to write (replaced only if it holds a previous report and nothing else) [default: RUN/report]",
)
def report(run: str, out: str | None) -> None:
    """Plot loss, throughput and learning rate of RUN (runs/NAME) and write report.md: the configuration, the
    planner's predicted memory, tokens/s, MFU, step time and start-up (host RAM per rank, time to the first step)
    against the measured ones, final and validation loss."""
    from dspipe.runtime.watchdog import NO_EVENTS
    from dspipe.tools.report import PLOTS, REPORT_FILE, write_report

    out, m = write_report(Path(run), out=out)
    click.echo(f"wrote {out / REPORT_FILE} and {', '.join(PLOTS.values())}")
    tps = "n/a" if m.tokens_per_s is None else f"{m.tokens_per_s:,.0f}"
    val = "" if m.final_val is None else f", val loss {m.final_val['val_loss']:.4f}"
    click.echo(
        f"steps {m.first_step}-{m.last_step}: train loss {m.final_loss:.4f}{val}, {tps} tokens/s (median), "
        f"{m.skipped} skipped"
    )
    if m.startup is not None:
        click.echo(m.startup.line())
    if m.events != NO_EVENTS:
        click.echo(f"events: {m.events}")
