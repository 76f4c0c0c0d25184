"""dspipe's parameter names: a PipelineModule stage's ('3.ln_1.weight', 'tied_modules.embed.wte.weight') and
the plain GPT's ('h.2.ln_1.weight', 'embed.wte.weight'), the runner's loader's and export's translation."""

from __future__ import annotations

from dspipe.errors import SpecError

TIED_PREFIX = "tied_modules.embed."
"""DeepSpeed's name for the tied embedding/head module of dspipe's PipelineModule (dspipe.model.pipeline)."""


def pipeline_gpt_name(name: str, *, layers: int) -> str:
    """PipelineModule parameter name ('3.ln_1.weight', 'tied_modules.embed.wte.weight') -> GPT name (the runner's
    loader here, and export's consolidation of pipeline checkpoints)."""
    if name.startswith(TIED_PREFIX):
        return "embed." + name[len(TIED_PREFIX) :]
    index, rest = name.split(".", 1)
    return layer_prefix(int(index), layers=layers) + rest


def layer_prefix(index: int, *, layers: int) -> str:
    """Pipeline layer index -> GPT module prefix: embedding, blocks 1..L, final norm, untied head."""
    if index == 0:
        return "embed."
    if 1 <= index <= layers:
        return f"h.{index - 1}."
    if index == layers + 1:
        return "final."
    if index == layers + 2:
        return "lm_head."
    raise SpecError(f"pipeline layer {index} does not exist in a {layers}-layer model")
