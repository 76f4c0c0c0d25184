"""`dspipe` command line. Planning commands import no torch/deepspeed; errors are one line with exit code 2."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from dspipe.errors import SpecError
from dspipe.plan import make_plan
from dspipe.presets import MODEL_PRESETS, model_preset
from dspipe.render import load_ds_preset, preset_names, render_ds_config, strategy_from_ds_config
from dspipe.rundir import write_run
from dspipe.spec import (CHECKPOINTING, OFFLOADS, PARTITION_METHODS, PRECISIONS, ClusterSpec, ModelSpec,
                         StrategySpec, TrainSpec)

DEFAULT_DATA = "data/stdlib"
STRATEGY_DEFAULTS = StrategySpec()
TRAIN_DEFAULTS = dict(precision="bf16")


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


def _resolve(flag, preset: dict, key: str, default):
    """A flag given on the command line wins, then the --preset, then the default."""
    if flag is not None:
        return flag
    return preset.get(key, default)


def _deepspeed_command(*, cluster: ClusterSpec, out: Path, hostfile: str | None) -> str:
    launcher = ["deepspeed"]
    if hostfile or cluster.nodes > 1:
        launcher += ["--hostfile", hostfile or "HOSTFILE", "--num_nodes", str(cluster.nodes)]
    launcher += ["--num_gpus", str(cluster.gpus_per_node), "run.py", "--run", str(out)]
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


@cli.command("gen-config")
@model_options
@click.option("--nodes", type=int, default=1, show_default=True, help="machines")
@click.option("--gpus-per-node", type=int, default=8, show_default=True, help="ranks per machine")
@click.option("--gpu", default="h100-80g", show_default=True, help="GPU type: cpu, a100-40g, a100-80g, h100-80g, h200")
@click.option("--global-batch", type=int, default=256, show_default=True, help="sequences per optimizer step")
@click.option("--micro-batch", type=int, default=4, show_default=True, help="sequences per rank per forward")
@click.option("--steps", type=int, default=1000, show_default=True, help="optimizer steps")
@click.option("--lr", type=float, default=6e-4, show_default=True, help="peak learning rate")
@click.option("--min-lr-ratio", type=float, default=0.1, show_default=True, help="final lr / peak lr (cosine)")
@click.option("--warmup", type=int, default=None, help="warmup steps [default: steps/10, at most 2000]")
@click.option("--weight-decay", type=float, default=0.1, show_default=True)
@click.option("--grad-clip", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option("--log-interval", type=int, default=10, show_default=True, help="steps between log lines")
@click.option("--zero", type=int, default=None, help="ZeRO stage 0-3 [default: 1]")
@click.option("--offload", default=None, help=f"optimizer offload: {'|'.join(OFFLOADS)} [default: none]")
@click.option("--offload-params", is_flag=True, default=None, help="offload parameters too (ZeRO-3)")
@click.option("--nvme-path", default=None, help="NVMe directory for --offload nvme")
@click.option("--precision", default=None, help=f"{'|'.join(PRECISIONS)} [default: bf16]")
@click.option("--pp", type=int, default=None, help="pipeline stages [default: 1]")
@click.option("--checkpointing", default=None, help=f"activation recomputation: {'|'.join(CHECKPOINTING)} [default: none]")
@click.option("--partition-method", default=None, help=f"pipeline partition: {'|'.join(PARTITION_METHODS)}")
@click.option("--preset", default=None, help="DeepSpeed preset from ds_configs/ (or a .json path) to start from")
@click.option("--data", default=DEFAULT_DATA, show_default=True, help="prepared token directory")
@click.option("--wall-clock-breakdown", is_flag=True, default=False, help="DeepSpeed per-phase timers")
@click.option("--hostfile", default=None, help="hostfile for the printed multi-node command")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="run directory to write, e.g. runs/NAME")
@click.option("--force", is_flag=True, default=False, help="replace an existing run directory")
def gen_config(**o) -> None:
    """Write runs/NAME/ds_config.json and dspipe.json and print the deepspeed command."""
    preset = strategy_from_ds_config(load_ds_preset(o["preset"]), source=o["preset"]) if o["preset"] else {}
    model = _model_from_options(o)
    cluster = ClusterSpec(nodes=o["nodes"], gpus_per_node=o["gpus_per_node"], gpu=o["gpu"])
    steps = o["steps"]
    train = TrainSpec(global_batch=o["global_batch"], micro_batch=o["micro_batch"], steps=steps, lr=o["lr"],
                      min_lr_ratio=o["min_lr_ratio"],
                      warmup_steps=o["warmup"] if o["warmup"] is not None else max(1, min(2000, steps // 10)),
                      weight_decay=o["weight_decay"], grad_clip=o["grad_clip"],
                      precision=_resolve(o["precision"], preset, "precision", "bf16"), seed=o["seed"],
                      log_interval=o["log_interval"])
    d = STRATEGY_DEFAULTS
    strategy = StrategySpec(
        zero=_resolve(o["zero"], preset, "zero", d.zero),
        offload=_resolve(o["offload"], preset, "offload", d.offload),
        offload_params=_resolve(o["offload_params"], preset, "offload_params", d.offload_params),
        nvme_path=_resolve(o["nvme_path"], preset, "nvme_path", d.nvme_path),
        pp=_resolve(o["pp"], preset, "pp", d.pp),
        checkpointing=_resolve(o["checkpointing"], preset, "checkpointing", d.checkpointing),
        partition_method=_resolve(o["partition_method"], preset, "partition_method", d.partition_method))
    plan = make_plan(model=model, cluster=cluster, train=train, strategy=strategy)
    _check_data(o["data"], model)
    out: Path = o["out"]
    ds_config = render_ds_config(plan=plan, train=train, monitor_dir=str(out / "monitor"),
                                 wall_clock_breakdown=o["wall_clock_breakdown"])
    _verify_with_deepspeed(ds_config, dp=plan.dp)
    command = _deepspeed_command(cluster=cluster, out=out, hostfile=o["hostfile"])
    write_run(out, model=model, cluster=cluster, train=train, strategy=strategy, plan=plan, data=o["data"],
              ds_config=ds_config, command=command, force=o["force"])
    click.echo(f"model {model.name}: {model.num_params / 1e6:,.2f}M params, L{model.layers} h{model.hidden} "
               f"a{model.heads} s{model.seq_len} V{model.vocab}")
    click.echo(f"world {plan.world_size} = dp {plan.dp} x pp {plan.pp} | ZeRO-{plan.zero_stage} offload {plan.offload}"
               f"{' +params' if plan.offload_params else ''} | {plan.precision} (grad accum {plan.grad_accum_dtype}) | "
               f"recompute {plan.checkpointing}")
    click.echo(f"batch: global {plan.global_batch} = micro {plan.micro_batch} x grad_accum {plan.grad_accum} "
               f"x dp {plan.dp}  ({plan.tokens_per_step:,} tokens/step)")
    click.echo(f"wrote {out / 'ds_config.json'} and {out / 'dspipe.json'}")
    click.echo(f"run:  {command}")


def _check_data(data: str, model: ModelSpec) -> None:
    from dspipe.data import META_FILE, read_meta

    if not (Path(data) / META_FILE).is_file():
        click.echo(f"note: {data} is not prepared yet; run 'dspipe prepare-data --out {data}' before training", err=True)
        return
    vocab = read_meta(data)["vocab_size"]
    if vocab > model.vocab:
        raise SpecError(f"tokenizer vocab {vocab} in {data} > model vocab {model.vocab}; pass --vocab {vocab} or more")


def _verify_with_deepspeed(ds_config: dict, *, dp: int) -> None:
    try:
        import deepspeed  # noqa: F401  (optional here: planning works without it)
    except ImportError:
        click.echo("note: deepspeed is not installed; the config was not parsed by DeepSpeedConfig", err=True)
        return
    from dspipe.dscheck import parse_with_deepspeed
    try:
        parse_with_deepspeed(ds_config, dp=dp)
    except Exception as e:  # DeepSpeed raises assertion, value and pydantic errors alike
        raise SpecError(f"DeepSpeed rejects the rendered config: {' '.join(str(e).split())}") from None


@cli.command("prepare-data")
@click.option("--out", default=DEFAULT_DATA, show_default=True, type=click.Path(path_type=Path))
@click.option("--source", "sources", multiple=True, type=click.Path(path_type=Path),
              help="text files or directories (default: the Python standard library's source)")
@click.option("--vocab-size", type=int, default=4096, show_default=True, help="byte-level BPE vocabulary to train")
@click.option("--max-mb", type=float, default=8.0, show_default=True, help="stop reading after this much text")
@click.option("--force", is_flag=True, default=False, help="rebuild even if --out exists")
def prepare_data(out: Path, sources, vocab_size: int, max_mb: float, force: bool) -> None:
    """Train a byte-level BPE tokenizer and write memory-mapped token ids (offline, deterministic)."""
    from dspipe.data import META_FILE, prepare_corpus, read_meta, stdlib_sources

    if (out / META_FILE).is_file() and not force:
        meta = read_meta(out)
        click.echo(f"{out} already prepared: {meta['num_tokens']:,} tokens, vocab {meta['vocab_size']} (--force rebuilds)")
        return
    files = stdlib_sources() if not sources else sorted(
        f for s in sources for f in ([s] if s.is_file() else s.rglob("*")) if f.is_file())
    if not files:
        raise SpecError(f"no input files under {', '.join(map(str, sources))}")
    meta = prepare_corpus(out=out, sources=files, vocab_size=vocab_size, max_bytes=int(max_mb * 1024 * 1024))
    click.echo(f"wrote {out}: {meta['num_documents']:,} documents, {meta['num_bytes'] / 2**20:.1f} MiB text -> "
               f"{meta['num_tokens']:,} tokens, vocab {meta['vocab_size']}")


@cli.command("presets")
def presets() -> None:
    """List model presets and DeepSpeed presets."""
    for m in MODEL_PRESETS.values():
        click.echo(f"{m.name:<11} {m.num_params / 1e6:>10,.1f}M  L{m.layers:<3} h{m.hidden:<6} a{m.heads:<3} "
                   f"s{m.seq_len:<5} V{m.vocab}")
    click.echo("deepspeed presets: " + ", ".join(preset_names()))


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
