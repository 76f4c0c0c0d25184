"""`dspipe` command line. Planning commands import no torch/deepspeed; errors are one line with exit code 2."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import click

from dspipe.cli.bench import bench
from dspipe.cli.calibrate import calibrate
from dspipe.cli.config_file import resolved_text
from dspipe.cli.data import convert_data, prepare_data
from dspipe.cli.extend import extend
from dspipe.cli.launch import build_ops, doctor, launch, rendezvous, slurm_script
from dspipe.cli.model import export_hf, generate, presets
from dspipe.cli.options import (
    DEFAULT_DATA,
    INT,
    choose,
    data_options,
    measure_option,
    monitor_options,
    parse_tokens,
    spec_options,
    token_budget_line,
    tokens_option,
)
from dspipe.cli.prepare_run import prepare_run
from dspipe.cli.report import report
from dspipe.cluster.launch import run_program
from dspipe.errors import SpecError
from dspipe.log import get_logger, setup_logging
from dspipe.planner.checkpoint_size import milestones
from dspipe.planner.render import monitor_values
from dspipe.planner.summary import checkpoint_line, estimate_summary, save_interval_note, startup_lines
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.hardware import GIB
from dspipe.spec.model import ModelSpec


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def cli() -> None:
    """dspipe: from a model and cluster spec to a complete DeepSpeed config and a GPT training run."""


def _deepspeed_command(*, cluster: ClusterSpec, out: Path, hostfile: str | None) -> str:
    launcher = ["deepspeed"]
    if hostfile or cluster.nodes > 1:
        launcher += [
            "--hostfile",
            str(Path(hostfile).resolve()) if hostfile else "HOSTFILE",
            "--num_nodes",
            str(cluster.nodes),
        ]
    launcher += ["--num_gpus", str(cluster.gpus_per_node), *run_program(out.resolve())]
    return shlex.join(launcher)


@cli.command("gen-config")
@measure_option
@spec_options
@tokens_option(
    "training length as a token budget (300B, 1.5T, 2e9) instead of --steps: "
    "steps = ceil(tokens / (global batch x seq len))"
)
@click.option("--data", default=DEFAULT_DATA, show_default=True, help="prepared token directory")
@data_options
@click.option(
    "--pad-vocab",
    is_flag=True,
    default=False,
    help="model vocab = the data's tokenizer vocab rounded up to a multiple of 64 (a --vocab must equal it; a "
    "custom shape needs none)",
)
@click.option("--wall-clock-breakdown", is_flag=True, default=False, help="DeepSpeed per-phase timers")
@monitor_options
@click.option("--out", metavar="DIR", help="run directory to write, e.g. runs/NAME [required, but with --print-config]")
@click.option(
    "--force",
    is_flag=True,
    default=False,
    help="rewrite the config of an existing run directory (its checkpoints, metrics and logs are kept)",
)
def gen_config(**o) -> None:
    """Write runs/NAME/ds_config.json, dspipe.json and config.yaml (the options: --config reproduces the run) and
    print the deepspeed command."""
    from dspipe.outputs import claim_run_dir, target, training_outputs
    from dspipe.rundir import CONFIG_FILE

    if o["out"] is None:  # not required by click: --print-config needs none
        raise click.MissingParameter(ctx=click.get_current_context(), param_type="option", param_hint="'--out'")

    o["out"] = target(o["out"], flag="--out", expect="dir")  # before any planning: a bad --out is refused first
    if o["data_order"] == "megatron":  # before the data's own checks: what this order cannot read at all
        from dspipe.data.blend import parse as parse_data
        from dspipe.data.megatron_order import check_prefixes

        check_prefixes(parse_data(o["data"]))
    kept = training_outputs(o["out"]) if claim_run_dir(o["out"], force=o["force"]) else []
    notes: list[str] = []
    model, cluster, result, preset = choose(
        o, check_model=lambda m: _check_data(o["data"], m, notes, tokenizer=o["tokenizer"])
    )
    best = result.best
    auto_interval = o["save_interval"] == "auto"
    if auto_interval:  # --save-interval auto: from the chosen plan's checkpoint and step time
        best, auto_line = _auto_save_interval(best, cluster=cluster)
        notes.append(f"note: {auto_line}")
    plan, train = best.plan, best.train
    out: Path = o["out"]
    _check_chosen(data=o["data"], tokenizer=o["tokenizer"], model=model, plan=plan, train=train, notes=notes)
    command = _deepspeed_command(cluster=cluster, out=out, hostfile=o["hostfile"])
    _write_run(
        o=o,
        out=out,
        model=model,
        cluster=cluster,
        best=best,
        command=command,
        preset=preset,
        auto_interval=auto_interval,
    )
    _echo_summary(model=model, best=best, evaluated=result.evaluated, notes=notes)
    click.echo(f"wrote {out / 'ds_config.json'} and {out / 'dspipe.json'} (options: {out / CONFIG_FILE})")
    click.echo(f"run:  {command}")
    if kept:
        from dspipe.rundir import newest_checkpoint_step

        newest = newest_checkpoint_step(out / "checkpoints")
        past = (
            f" (step {newest:,}, at or past this run's {train.steps:,} steps: it would train nothing)"
            if newest is not None and newest >= train.steps
            else ""
        )
        notes.append(
            f"note: kept {', '.join(kept)} in {out}: 'dspipe launch {out}' resumes from its newest "
            f"checkpoint{past} ('--restart' starts over, moving the old outputs aside)"
        )
    for note in notes:
        get_logger(__name__).info(note)


def _check_chosen(*, data, tokenizer, model, plan, train, notes: list[str]) -> None:
    """gen-config's checks of the data and tokenizer against the chosen model and plan (notes gathers the notes)."""
    if tokenizer is not None:  # its vocab must fit the model (generate, export-hf), a blend's too
        from dspipe.data.blend import parse as parse_data
        from dspipe.data.checks import check_tokenizer

        check_tokenizer(parse_data(data).paths, tokenizer, model_vocab=model.vocab)
    if train.warmup_steps < 2:  # DeepSpeed's WarmupLR and WarmupCosineLR take max(2, warmup_num_steps)
        notes.append(
            f"note: --warmup {train.warmup_steps} runs as 2 warmup steps (DeepSpeed's WarmupLR and "
            f"WarmupCosineLR warm up over at least 2)"
        )
    from dspipe.data.shards import is_prepared

    if train.data_order == "megatron":  # every source a Megatron prefix, each long enough for one sample
        from dspipe.data.blend import parse as parse_data
        from dspipe.data.megatron_order import check_for_run

        check_for_run(parse_data(data), seq_len=model.seq_len, num_samples=train.steps * plan.global_batch)
    if train.eval_interval and is_prepared(data):
        from dspipe.data.checks import check_val_for_eval

        check_val_for_eval(data, seq_len=model.seq_len, dp=plan.dp, micro_batch=plan.micro_batch)


def _write_run(*, o, out: Path, model, cluster, best, command: str, preset, auto_interval: bool) -> None:
    """Write gen-config's run directory: its configs, the options, the cluster profile and the tokenizer."""
    from dspipe.rundir import CONFIG_FILE, also_writing

    extra = {CONFIG_FILE: resolved_text()}
    if cluster.profile is not None:  # the profile travels with the run (dspipe.json's cluster.profile holds it too)
        from dspipe.spec.profile import PROFILE_FILE, profile_text

        extra[PROFILE_FILE] = profile_text(cluster.profile)
    with also_writing(extra):
        prepare_run(
            out,
            model=model,
            cluster=cluster,
            best=best,
            data=o["data"],
            command=command,
            wall_clock_breakdown=o["wall_clock_breakdown"],
            force=o["force"],
            monitors=monitor_values(o),
            preset=preset,
            auto_interval=auto_interval,
        )
    keep_tokenizer(out, o["data"], tokenizer=o["tokenizer"])
    if cluster.profile is None:  # --force without --profile: an earlier run's profile.json no longer applies
        from dspipe.spec.profile import PROFILE_FILE

        (out / PROFILE_FILE).unlink(missing_ok=True)


def _echo_summary(*, model, best, evaluated: int, notes: list[str]) -> None:
    """gen-config's lines on the model, the plan, the batch and the estimate (a slow save's note joins notes)."""
    plan, train, est = best.plan, best.train, best.est
    active = f" ({model.active_params / 1e6:,.2f}M active)" if model.experts else ""
    click.echo(f"model {model.name}: {model.num_params / 1e6:,.2f}M params{active}, {model.shape_text}")
    experts = (
        f" | ep {plan.ep} (experts {plan.experts} / ep {plan.ep} = {plan.experts // plan.ep} per rank, expert "
        f"dp {plan.expert_dp})"
        if plan.experts
        else ""
    )
    click.echo(
        f"{plan.layout.describe()}{experts} | ZeRO-{plan.zero_stage} offload {plan.offload}"
        f"{' +params' if plan.offload_params else ''} | {plan.precision} (grad accum {plan.grad_accum_dtype}) | "
        f"recompute {plan.recomputation}"
        f"{f' | loss in chunks of {plan.loss_chunk:,} tokens' if plan.loss_chunk else ''}"
    )
    click.echo(
        f"batch: global {plan.global_batch} = micro {plan.micro_batch} x grad_accum {plan.grad_accum} "
        f"x dp {plan.dp}  ({plan.tokens_per_step:,} tokens/step)"
    )
    if train.tokens is not None:
        click.echo(token_budget_line(train, seq_len=model.seq_len))
    click.echo(
        f"estimate: {est.memory.total / GIB:.1f} of {est.gpu_memory_bytes / GIB:.1f} GiB per GPU, "
        f"{est.step_time_s:.3g} s/step, {best.tokens_per_s:,.0f} tokens/s, MFU {best.mfu * 100:.0f}% "
        f"(chosen from {evaluated} candidates; 'dspipe plan' explains)"
    )
    for line in startup_lines(est):
        click.echo(line)
    kept_for_good = milestones(steps=train.steps, keep_every=train.keep_every)
    for line in checkpoint_line(est, keep=train.keep_checkpoints, kept_for_good=kept_for_good):
        click.echo(line)
    slow_save = save_interval_note(est, save_interval=train.save_interval, async_save=train.async_save)
    if slow_save:
        notes.append(slow_save)


def _auto_save_interval(best, *, cluster):
    """(`best` with --save-interval auto resolved, the line that explains the interval)."""
    from dataclasses import replace

    from dspipe.planner.checkpoint_size import auto_save_interval

    est, train = best.est, best.train
    n, line = auto_save_interval(
        checkpoint=est.checkpoint,
        step_time_s=est.step_time_s,
        world=cluster.world_size,
        mtbf_hours=cluster.gpu_mtbf_hours,
        steps=train.steps,
        async_save=train.async_save,
        host_copy_gbps=cluster.gpu_type.host_copy_gbps,
    )
    return replace(best, train=replace(train, save_interval=n)), line


@cli.command("plan")
@measure_option
@spec_options
@tokens_option(
    "training budget in tokens (300B, 1.5T) for days and GPU-hours, and steps = ceil(tokens / "
    "(global batch x seq len)) instead of --steps"
)
@click.option("--json", "as_json", is_flag=True, default=False, help="print one JSON object")
@click.option(
    "--top", type=INT, default=5, show_default=True, help="show the N fastest plans that fit (1: only the chosen one)"
)
def plan_command(**o) -> None:
    """Estimate memory, communication and time; choose ZeRO stage, offload, precision, pp, micro-batch and
    recomputation for every option left at auto."""
    import json

    from dspipe.planner.summary import human_report

    tokens = parse_tokens(o["tokens"], flag="--tokens")
    if not 1 <= o["top"] <= 1000:
        raise SpecError(f"--top must be in [1, 1000], got {o['top']} (allowed: finite, [1, 1000])")
    model, cluster, result, preset = choose(o)
    for line in preset.report_for(result.best, model=model, monitor_dir="RUN/monitor") if preset else []:
        click.echo(line, err=o["as_json"])  # --json: stdout stays one JSON object
    budget = token_budget_line(result.best.train, seq_len=model.seq_len)
    if o["as_json"]:
        summary = estimate_summary(result.best, tokens=tokens)
        if budget is not None:
            train = result.best.train
            summary["token_budget"] = {
                "tokens": train.tokens,
                "steps": train.steps,
                "tokens_per_step": result.best.plan.tokens_per_step,
                "equation": budget,
            }
        summary["host_memory_source"] = cluster.host_memory_source
        summary["time_figures"] = [
            {"figure": f, "value": v, "source": src}
            for f, v, src in time_figure_sources(cluster, o, result.best.plan.precision)
        ]
        summary["top"] = [
            {**estimate_summary(c, tokens=tokens), "plan": c.describe(every_axis=True)}
            for c in result.ranked[: o["top"]]
        ]
        click.echo(json.dumps(summary, indent=2))
    else:
        click.echo(
            human_report(
                result,
                tokens=tokens,
                tokens_text=o["tokens"],
                top=o["top"],
                host_memory_source=cluster.host_memory_source,
                figure_sources=time_figure_sources(cluster, o, result.best.plan.precision),
            )
        )
        if budget is not None:
            click.echo(f"token budget: {budget}")
    if o["save_interval"] == "auto":  # what gen-config would write (--json: stdout stays one JSON object)
        get_logger(__name__).info(f"note: {_auto_save_interval(result.best, cluster=cluster)[1]}")


def time_figure_sources(cluster: ClusterSpec, o: dict, precision: str) -> list[tuple[str, str, str]]:
    """(figure, value, source) of the time model's inputs: the --profile, an override flag or the catalog."""
    from dspipe.spec.hardware import GPU_CATALOG
    from dspipe.spec.profile import figure_sources

    return figure_sources(
        catalog=GPU_CATALOG[cluster.gpu],
        profile=cluster.profile,
        profile_name=o.get("profile")
        or ("this machine's measurement" if cluster.profile and cluster.profile.measured_by == "gen-config" else None),
        overrides={k: getattr(cluster, k) for k in ("intra_node_gbps", "inter_node_gbps")},
        precision=precision,
    )


def keep_tokenizer(out: Path, data: str, *, tokenizer: str | None = None) -> None:
    """A Megatron prefix's tokenizer (--tokenizer, else the one beside it) is copied into the run directory,
    RUN/tokenizer, for generate and export-hf: a prepared directory carries its own, a Megatron corpus usually sits
    elsewhere than its tokenizer."""
    import shutil

    from dspipe.atomic import replace_dir
    from dspipe.data.blend import parse as parse_data
    from dspipe.data.blend import tokenizer_dir
    from dspipe.data.megatron import is_prefix
    from dspipe.outputs import write_errors

    source = Path(tokenizer) if tokenizer is not None else tokenizer_dir(data)
    if not is_prefix(parse_data(data).sources[0].path) or not (source / "tokenizer.json").is_file():
        return
    tmp = out / f".tokenizer.tmp-{os.getpid()}"
    with write_errors(out):
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp)
        replace_dir(tmp, out / "tokenizer")


def _megatron_index(path: Path) -> bool:
    """Whether `path` starts as a Megatron index does (its magic bytes)."""
    from dspipe.data.megatron import MAGIC

    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def _check_data(data: str, model: ModelSpec, notes: list[str], *, tokenizer: str | None = None) -> None:
    """Errors now (vocab, corpus length); notes are collected and printed once the run is written. tokenizer: the
    --tokenizer of Megatron prefixes, named in the note."""
    from dspipe.data import check_data_for_model, padded_vocab
    from dspipe.data.shards import is_prepared

    if not is_prepared(data) and Path(data).is_file():
        stem = str(Path(data).with_suffix("")) if Path(data).suffix in (".bin", ".idx") else None
        stem = stem if stem and _megatron_index(Path(stem + ".idx")) else None  # a Megatron prefix's .bin or .idx
        raise SpecError(
            f"--data {data} is a file: give the prepared data directory (the one holding meta.json)"
            + (f", or the Megatron prefix {stem}" if stem else "")
        )
    if not is_prepared(data):
        notes.append(f"note: {data} is not prepared yet; run 'dspipe prepare-data --out {data}' before training")
        return
    meta = check_data_for_model(data, model_vocab=model.vocab, seq_len=model.seq_len)
    vocab = meta["vocab_size"]
    if tokenizer is not None:  # checked against the data here, against the model after the search
        from dspipe.data.checks import check_tokenizer

        vocab = check_tokenizer([data], tokenizer)
        meta = {**meta, "tokenizer_dir": f"{tokenizer} (--tokenizer)"}
    what = (
        f"tokenizer vocab {vocab}"
        if meta.get("format") != "megatron-mmidx" or meta["tokenizer_dir"]
        else f"its largest token id + 1 = {vocab} (no tokenizer beside the Megatron prefix)"
    )
    if meta.get("format") == "megatron-mmidx":
        eod = (
            f"every document ends in EOD {meta['eos_id']}"
            if meta["eos_id"] is not None
            else "documents do not end in one EOD token (they run together in a window)"
        )
        tok = (
            f"tokenizer {meta['tokenizer_dir']}"
            if meta["tokenizer_dir"]
            else f"no tokenizer beside it (generate/export-hf need {Path(data).parent / 'tokenizer'})"
        )
        notes.append(
            f"note: Megatron dataset {data}: {meta['num_documents']:,} documents, {meta['num_tokens']:,} "
            f"{meta['dtype']} tokens, ids 0..{meta['max_id']:,}, {eod}; {tok}; validation: its last "
            f"{meta['splits']['val']['num_documents']:,} documents"
        )
    if model.vocab > padded_vocab(vocab):
        notes.append(
            f"note: model vocab {model.vocab} > {what} in {data}: {model.vocab - vocab} "
            f"embedding rows are never used (--pad-vocab gives {padded_vocab(vocab)})"
        )


cli.add_command(prepare_data)
cli.add_command(convert_data)
cli.add_command(presets)
cli.add_command(launch)
cli.add_command(doctor)
cli.add_command(build_ops)
cli.add_command(slurm_script)
cli.add_command(rendezvous)
cli.add_command(report)
cli.add_command(bench)
cli.add_command(export_hf)
cli.add_command(generate)
cli.add_command(extend)
cli.add_command(calibrate)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; every user error becomes one line on stderr and exit code 2."""
    setup_logging(rank=0)  # one process, not a rank: its diagnostics are never filtered out
    log = get_logger(__name__)
    try:
        cli.main(args=argv, prog_name="dspipe", standalone_mode=False)
    except SpecError as e:
        log.error(f"dspipe: error: {e}")
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as e:
        log.error(f"dspipe: error: {e.format_message()}")
        sys.exit(2)
    except OSError as e:  # a read or write that failed where no reader named it (each reader should): still one line
        where = f"{e.filename}: " if e.filename else ""
        log.error(f"dspipe: error: {where}{e.strerror or ' '.join(str(e).split())}")
        sys.exit(2)
