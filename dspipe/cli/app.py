"""`dspipe` command line. Planning commands import no torch/deepspeed; errors are one line with exit code 2."""
from __future__ import annotations

import shlex
import sys
from dataclasses import fields
from pathlib import Path

import click

from dspipe.cluster.launch import run_program
from dspipe.errors import SpecError
from dspipe.planner.hardware import names_text
from dspipe.planner.summary import estimate_summary
from dspipe.planner.search import AUTO
from dspipe.planner.presets import MODEL_PRESETS, model_preset
from dspipe.planner.render import load_ds_preset, preset_names, render_ds_config, strategy_from_ds_config
from dspipe.rundir import write_run
from dspipe.planner.spec import CHECKPOINTING, OFFLOADS, PARTITION_METHODS, PRECISIONS, ClusterSpec, ModelSpec, TrainSpec

TRAIN_DEFAULTS = {f.name: f.default for f in fields(TrainSpec)}  # one source for the options' defaults

DEFAULT_DATA = "data/stdlib"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def cli() -> None:
    """dspipe: from a model and cluster spec to a complete DeepSpeed config and a GPT training run."""


def _model_from_options(o: dict) -> ModelSpec:
    shape = dict(layers=o["layers"], hidden=o["hidden"], heads=o["heads"], vocab=o["vocab"], seq_len=o["seq_len"],
                 ffn=o["ffn"], dropout=o["dropout"], tied_embeddings=False if o["untied"] else None)
    if o["model"]:
        return model_preset(o["model"], **shape)
    missing = [f"--{k}" for k in ("layers", "hidden", "heads", "vocab") if shape[k] is None]
    if missing:
        raise SpecError(f"give --model NAME ({', '.join(MODEL_PRESETS)}) or all of --layers/--hidden/--heads/--vocab "
                        f"(missing {' '.join(missing)})")
    hidden = shape["hidden"]
    return ModelSpec("custom", shape["layers"], hidden, shape["heads"], shape["vocab"], shape["seq_len"] or 1024,
                     shape["ffn"] or 4 * hidden, shape["dropout"] or 0.0, shape["tied_embeddings"] is not False)


class AutoInt(click.ParamType):
    """An integer or 'auto' (None: let the planner choose)."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        if value is None or value == AUTO or isinstance(value, int):
            return None if value == AUTO else value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is not 'auto' or an integer", param, ctx)


class AutoChoice(click.ParamType):
    """One of `choices` or 'auto'."""

    def __init__(self, choices):
        self.choices = tuple(choices)
        self.name = "|".join(("auto", *self.choices))

    def convert(self, value, param, ctx):
        if value is None or value == AUTO:
            return None
        if value not in self.choices:
            self.fail(f"{value!r} is not one of: auto, {', '.join(self.choices)}", param, ctx)
        return value


STRATEGY_KEYS = ("zero", "offload", "offload_params", "nvme_path", "pp", "checkpointing", "partition_method",
                 "precision", "micro_batch", "reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold")


def request_from_options(o: dict) -> tuple[ModelSpec, ClusterSpec, TrainSpec, dict]:
    """(model, cluster, train, fixed strategy choices): a flag given wins, then the --preset, else auto (None)."""
    preset = strategy_from_ds_config(load_ds_preset(o["preset"]), source=o["preset"]) if o["preset"] else {}
    fixed = {k: o[k] if o[k] is not None else preset.get(k) for k in STRATEGY_KEYS}
    fixed["zero"] = None if fixed["zero"] is None else int(fixed["zero"])
    model = _model_from_options(o)
    if o.get("pad_vocab"):
        model = _with_padded_vocab(model, o["data"])
    cluster = cluster_from_options(o)  # --nodes/--gpus-per-node, or from --hostfile
    steps = o["steps"]
    train = TrainSpec(global_batch=o["global_batch"], micro_batch=fixed["micro_batch"] or 1, steps=steps, lr=o["lr"],
                      min_lr_ratio=o["min_lr_ratio"],
                      warmup_steps=o["warmup"] if o["warmup"] is not None else max(1, min(2000, steps // 10)),
                      weight_decay=o["weight_decay"], grad_clip=o["grad_clip"],
                      precision=fixed["precision"] or "bf16", seed=o["seed"], log_interval=o["log_interval"],
                      save_interval=o["save_interval"], keep_checkpoints=o["keep_checkpoints"],
                      eval_interval=o["eval_interval"], eval_batches=o["eval_batches"],
                      max_skipped_steps=o["max_skipped_steps"], spike_window=o["spike_window"],
                      spike_sigma=o["spike_sigma"])
    return model, cluster, train, fixed


def choose(o: dict, *, check_model=None):
    """Search the strategies the options leave open; one-line error when none is valid or none fits."""
    from dspipe.planner.search import nothing_fits_message, search

    model, cluster, train, fixed = request_from_options(o)
    if check_model:
        check_model(model)
    result = search(model=model, cluster=cluster, train=train, fixed=fixed)
    if result.best is None:
        raise SpecError(nothing_fits_message(result=result, model=model, cluster=cluster, train=train, fixed=fixed))
    return model, cluster, result


def _deepspeed_command(*, cluster: ClusterSpec, out: Path, hostfile: str | None) -> str:
    launcher = ["deepspeed"]
    if hostfile or cluster.nodes > 1:
        launcher += ["--hostfile", str(Path(hostfile).resolve()) if hostfile else "HOSTFILE", "--num_nodes", str(cluster.nodes)]
    launcher += ["--num_gpus", str(cluster.gpus_per_node), *run_program(out.resolve())]
    return shlex.join(launcher)


def model_options(f):
    for opt in reversed([
        click.option("--model", help=f"model preset: {', '.join(MODEL_PRESETS)}"),
        click.option("--layers", type=int, help="transformer blocks (overrides the preset)"),
        click.option("--hidden", type=int, help="model width"),
        click.option("--heads", type=int, help="attention heads"),
        click.option("--vocab", type=int, help="vocabulary size"),
        click.option("--seq-len", type=int, help="context length"),
        click.option("--ffn", type=int, help="MLP width (default 4 x hidden)"),
        click.option("--dropout", type=float, help="dropout probability (default 0)"),
        click.option("--untied", is_flag=True, default=False, help="separate output head (default: tied)"),
    ]):
        f = opt(f)
    return f


def spec_options(f):
    """Model, cluster, training and strategy options shared by plan and gen-config."""
    for opt in reversed([
        click.option("--nodes", type=int, default=1, show_default=True, help="machines"),
        click.option("--gpus-per-node", type=int, default=8, show_default=True, help="ranks per machine"),
        click.option("--gpu", default="h100-80g", show_default=True,
                     help=f"GPU type: {names_text()}"),
        click.option("--hostfile", default=None, help="hostfile: sets --nodes/--gpus-per-node (validated)"),
        click.option("--host-memory-gib", type=float, default=None,
                     help="host RAM per node [default: a typical node for --gpu]"),
        click.option("--global-batch", type=int, default=256, show_default=True, help="sequences per optimizer step"),
        click.option("--micro-batch", type=AutoInt(), default=None, help="sequences per rank per forward [auto]"),
        click.option("--steps", type=int, default=1000, show_default=True, help="optimizer steps"),
        click.option("--lr", type=float, default=6e-4, show_default=True, help="peak learning rate"),
        click.option("--min-lr-ratio", type=float, default=0.1, show_default=True, help="final lr / peak lr"),
        click.option("--warmup", type=int, default=None, help="warmup steps [default: steps/10, at most 2000]"),
        click.option("--weight-decay", type=float, default=0.1, show_default=True),
        click.option("--grad-clip", type=float, default=1.0, show_default=True),
        click.option("--seed", type=int, default=TRAIN_DEFAULTS["seed"], show_default=True),
        click.option("--log-interval", type=int, default=TRAIN_DEFAULTS["log_interval"], show_default=True, help="steps between log lines"),
        click.option("--save-interval", type=int, default=TRAIN_DEFAULTS["save_interval"], show_default=True,
                     help="steps between checkpoints (0: only at the end and on SIGTERM/SIGINT)"),
        click.option("--keep-checkpoints", type=int, default=TRAIN_DEFAULTS["keep_checkpoints"], show_default=True,
                     help="complete checkpoints to keep (older ones are deleted)"),
        click.option("--eval-interval", type=int, default=TRAIN_DEFAULTS["eval_interval"], show_default=True,
                     help="steps between validation passes (0: none)"),
        click.option("--eval-batches", type=int, default=TRAIN_DEFAULTS["eval_batches"], show_default=True,
                     help="micro-batches per data-parallel rank in one validation pass"),
        click.option("--max-skipped-steps", type=int, default=TRAIN_DEFAULTS["max_skipped_steps"], show_default=True,
                     help="consecutive non-finite steps before the run saves and stops (0: never)"),
        click.option("--spike-window", type=int, default=TRAIN_DEFAULTS["spike_window"], show_default=True,
                     help="steps of loss history for loss-spike detection"),
        click.option("--spike-sigma", type=float, default=TRAIN_DEFAULTS["spike_sigma"], show_default=True,
                     help="log a loss spike above mean + this many std of the window"),
        click.option("--zero", type=AutoChoice(["0", "1", "2", "3"]), default=None, help="ZeRO stage [auto]"),
        click.option("--offload", type=AutoChoice(OFFLOADS), default=None, help="optimizer state offload [auto]"),
        click.option("--offload-params/--no-offload-params", default=None,
                     help="offload parameters too (ZeRO-3) [auto]"),
        click.option("--nvme-path", default=None, help="NVMe directory for --offload nvme (enables it in auto)"),
        click.option("--precision", type=AutoChoice(PRECISIONS), default=None,
                     help="[auto: bf16 on GPUs, fp32 on cpu]"),
        click.option("--pp", type=AutoInt(), default=None, help="pipeline stages [auto]"),
        click.option("--checkpointing", type=AutoChoice(CHECKPOINTING), default=None,
                     help="activation recomputation [auto]"),
        click.option("--partition-method", type=AutoChoice(PARTITION_METHODS), default=None,
                     help="pipeline partition [parameters]"),
        click.option("--reduce-bucket-size", type=int, default=None,
                     help="gradient reduce / all-gather bucket, elements [hidden^2, at least 2^20]"),
        click.option("--prefetch-bucket-size", type=int, default=None,
                     help="ZeRO-3 prefetch bucket, elements [0.9 hidden^2, at least 2^20]"),
        click.option("--param-persistence-threshold", type=int, default=None,
                     help="ZeRO-3: keep parameters smaller than this whole [10 hidden]"),
        click.option("--preset", default=None, help="DeepSpeed preset from ds_configs/ (or a .json path) to start "
                                                   "from; flags given override it"),
    ]):
        f = opt(f)
    return model_options(f)


@cli.command("gen-config")
@spec_options
@click.option("--data", default=DEFAULT_DATA, show_default=True, help="prepared token directory")
@click.option("--pad-vocab", is_flag=True, default=False,
              help="model vocab = the data's tokenizer vocab rounded up to a multiple of 64")
@click.option("--wall-clock-breakdown", is_flag=True, default=False, help="DeepSpeed per-phase timers")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="run directory to write, e.g. runs/NAME")
@click.option("--force", is_flag=True, default=False, help="replace an existing run directory")
def gen_config(**o) -> None:
    """Write runs/NAME/ds_config.json and dspipe.json and print the deepspeed command."""
    notes: list[str] = []
    model, cluster, result = choose(o, check_model=lambda m: _check_data(o["data"], m, notes))
    best = result.best
    plan, train, strategy = best.plan, best.train, best.strategy
    out: Path = o["out"]
    if train.eval_interval and (Path(o["data"]) / "meta.json").is_file():
        from dspipe.data.checks import check_val_for_eval
        check_val_for_eval(o["data"], seq_len=model.seq_len, dp=plan.dp, micro_batch=plan.micro_batch)
    ds_config = render_ds_config(plan=plan, train=train, monitor_dir=str(out / "monitor"),
                                 wall_clock_breakdown=o["wall_clock_breakdown"])
    _verify_with_deepspeed(ds_config, dp=plan.dp)
    command = _deepspeed_command(cluster=cluster, out=out, hostfile=o["hostfile"])
    write_run(out, model=model, cluster=cluster, train=train, strategy=strategy, plan=plan, data=o["data"],
              ds_config=ds_config, command=command, estimate=estimate_summary(best), force=o["force"])
    click.echo(f"model {model.name}: {model.num_params / 1e6:,.2f}M params, L{model.layers} h{model.hidden} "
               f"a{model.heads} s{model.seq_len} V{model.vocab}")
    click.echo(f"world {plan.world_size} = dp {plan.dp} x pp {plan.pp} | ZeRO-{plan.zero_stage} offload {plan.offload}"
               f"{' +params' if plan.offload_params else ''} | {plan.precision} (grad accum {plan.grad_accum_dtype}) | "
               f"recompute {plan.checkpointing}")
    click.echo(f"batch: global {plan.global_batch} = micro {plan.micro_batch} x grad_accum {plan.grad_accum} "
               f"x dp {plan.dp}  ({plan.tokens_per_step:,} tokens/step)")
    est = best.est
    click.echo(f"estimate: {est.memory.total / 2**30:.1f} of {est.gpu_memory_bytes / 2**30:.1f} GiB per GPU, "
               f"{est.step_time_s:.3g} s/step, {best.tokens_per_s:,.0f} tokens/s, MFU {best.mfu * 100:.0f}% "
               f"(chosen from {result.evaluated} candidates; 'dspipe plan' explains)")
    click.echo(f"wrote {out / 'ds_config.json'} and {out / 'dspipe.json'}")
    click.echo(f"run:  {command}")
    for note in notes:
        click.echo(note, err=True)


def parse_tokens(text: str | None) -> float | None:
    """'300B', '1.5T', '2e9', '500M' -> a token count."""
    if text is None:
        return None
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    t = text.strip().upper()
    try:
        value = float(t[:-1]) * scale[t[-1]] if t and t[-1] in scale else float(t)
    except ValueError:
        value = -1
    if not value > 0:
        raise SpecError(f"token budget {text!r} does not parse: use a number like 300B, 1.5T or 2e9")
    return value


@cli.command("plan")
@spec_options
@click.option("--tokens", default=None, help="training budget in tokens (300B, 1.5T) for days and GPU-hours")
@click.option("--json", "as_json", is_flag=True, default=False, help="print one JSON object")
def plan_command(**o) -> None:
    """Estimate memory, communication and time; choose ZeRO stage, offload, precision, pp, micro-batch and
    recomputation for every option left at auto."""
    import json

    from dspipe.planner.summary import human_report

    tokens = parse_tokens(o["tokens"])
    model, cluster, result = choose(o)
    if o["as_json"]:
        click.echo(json.dumps(estimate_summary(result.best, tokens=tokens), indent=2))
    else:
        click.echo(human_report(result, tokens=tokens))


def _with_padded_vocab(model: ModelSpec, data: str) -> ModelSpec:
    from dataclasses import replace

    from dspipe.data import META_FILE, padded_vocab, read_meta

    vocab = read_meta(data)["vocab_size"] if (Path(data) / META_FILE).is_file() else model.vocab
    return replace(model, vocab=padded_vocab(vocab))


def _check_data(data: str, model: ModelSpec, notes: list[str]) -> None:
    """Errors now (vocab, corpus length); notes are collected and printed once the run is written."""
    from dspipe.data import META_FILE, check_data_for_model, padded_vocab

    if not (Path(data) / META_FILE).is_file():
        notes.append(f"note: {data} is not prepared yet; run 'dspipe prepare-data --out {data}' before training")
        return
    vocab = check_data_for_model(data, model_vocab=model.vocab, seq_len=model.seq_len)["vocab_size"]
    if model.vocab > padded_vocab(vocab):
        notes.append(f"note: model vocab {model.vocab} > tokenizer vocab {vocab} in {data}: {model.vocab - vocab} "
                     f"embedding rows are never used (--pad-vocab gives {padded_vocab(vocab)})")


def _verify_with_deepspeed(ds_config: dict, *, dp: int) -> None:
    try:
        import deepspeed  # noqa: F401  (optional here: planning works without it)
    except ImportError:
        click.echo("note: deepspeed is not installed; the config was not parsed by DeepSpeedConfig", err=True)
        return
    from dspipe.runtime.dscheck import parse_with_deepspeed
    try:
        parse_with_deepspeed(ds_config, dp=dp)
    except Exception as e:  # DeepSpeed raises assertion, value and pydantic errors alike
        raise SpecError(f"DeepSpeed rejects the rendered config: {' '.join(str(e).split())}") from None


@cli.command("presets")
def presets() -> None:
    """List model presets and DeepSpeed presets."""
    for m in MODEL_PRESETS.values():
        click.echo(f"{m.name:<11} {m.num_params / 1e6:>10,.1f}M  L{m.layers:<3} h{m.hidden:<6} a{m.heads:<3} "
                   f"s{m.seq_len:<5} V{m.vocab}")
    click.echo("deepspeed presets: " + ", ".join(preset_names()))


from dspipe.cli.launch import cluster_from_options, doctor, launch, slurm_script  # noqa: E402
from dspipe.cli.data import prepare_data  # noqa: E402
from dspipe.cli.report import report  # noqa: E402
from dspipe.cli.bench import bench  # noqa: E402
from dspipe.cli.model import export_hf, generate  # noqa: E402

cli.add_command(prepare_data)
cli.add_command(launch)
cli.add_command(doctor)
cli.add_command(slurm_script)
cli.add_command(report)
cli.add_command(bench)
cli.add_command(export_hf)
cli.add_command(generate)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; every user error becomes one line on stderr and exit code 2."""
    try:
        cli.main(args=argv, prog_name="dspipe", standalone_mode=False)
    except SpecError as e:
        click.echo(f"dspipe: error: {e}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as e:
        click.echo(f"dspipe: error: {e.format_message()}", err=True)
        sys.exit(2)
