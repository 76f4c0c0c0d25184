"""`dspipe presets`, `dspipe export-hf` and `dspipe generate`: the named model shapes, a trained checkpoint as a
Hugging Face model, and text from it."""

from __future__ import annotations

from pathlib import Path

import click

from dspipe.cli.options import FLOAT, INT, Text


@click.command("presets")
def presets() -> None:
    """List model presets (parameters, shape, source: the released checkpoint or paper) and DeepSpeed presets."""
    from dspipe.planner.render import preset_names
    from dspipe.spec.presets import preset_lines

    for line in preset_lines():
        click.echo(line)
    click.echo("deepspeed presets: " + ", ".join(preset_names()))


@click.command("export-hf")
@click.argument("checkpoint", type=Text())
@click.option(
    "--out", required=True, metavar="DIR", help="directory to write (a transformers model directory, safetensors)"
)
@click.option(
    "--force",
    is_flag=True,
    default=False,
    help="replace an --out directory that an earlier export-hf wrote (nothing else)",
)
def export_hf(checkpoint: str, out: str, force: bool) -> None:
    """Export CHECKPOINT (runs/NAME/checkpoints/global_stepN, or runs/NAME for its newest complete checkpoint) of
    any ZeRO stage and pipeline layout as a transformers directory with the run's tokenizer, in the class that computes
    the run's model: GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM (q/k/v biases only), Qwen3ForCausalLM (q/k
    norm) or MistralForCausalLM (a window on every layer); a run started with --init-from HF_DIR exports as HF_DIR's."""
    from dspipe.outputs import target
    from dspipe.tools.export import export_hf as run_export

    out = target(out, flag="--out", expect="dir")

    used = run_export(source=Path(checkpoint), out=out, force=force)
    click.echo(f"exported {used} -> {out} (AutoModelForCausalLM.from_pretrained({str(out)!r}))")


@click.command("generate")
@click.argument("source", type=Text())
@click.option("--prompt", required=True, help="text to continue")
@click.option("--max-tokens", type=INT, default=50, show_default=True, help="new tokens at most (stops at EOS)")
@click.option("--temperature", type=FLOAT, default=1.0, show_default=True, help="0 = greedy")
@click.option(
    "--top-k",
    type=INT,
    default=50,
    show_default=True,
    help="sample from the k likeliest (0 or more than the vocabulary: all)",
)
@click.option("--seed", type=INT, default=0, show_default=True, help="sampling seed")
def generate(source: str, prompt: str, max_tokens: int, temperature: float, top_k: int, seed: int) -> None:
    """Continue --prompt with SOURCE: a checkpoint or run directory, or a directory written by export-hf. A prompt
    longer than the model's context is refused (nothing is truncated); past the context, each new token sees the
    last CONTEXT tokens (a note says so)."""
    from dspipe.tools.generate import Sampling
    from dspipe.tools.generate import generate as run_generate

    sampling = Sampling(max_tokens=max_tokens, temperature=temperature, top_k=top_k, seed=seed)  # checked first
    click.echo(run_generate(source=Path(source), prompt=prompt, sampling=sampling))
