"""Named model shapes: one table. Shapes from the GPT-2 release and the GPT-3 paper (Brown et al. 2020, Table 2.1)."""
from __future__ import annotations

from dataclasses import replace

from dspipe.errors import SpecError
from dspipe.planner.spec import ModelSpec

GPT2_VOCAB = 50257


def _gpt2(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, GPT2_VOCAB, 1024, 4 * hidden)


def _gpt3(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, GPT2_VOCAB, 2048, 4 * hidden)


MODEL_PRESETS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("tiny", 2, 64, 4, 4096, 64, 256),
    _gpt2("gpt2-124m", 12, 768, 12),
    _gpt2("gpt2-355m", 24, 1024, 16),
    _gpt2("gpt2-774m", 36, 1280, 20),
    _gpt2("gpt2-1.5b", 48, 1600, 25),
    _gpt3("gpt3-125m", 12, 768, 12),
    _gpt3("gpt3-350m", 24, 1024, 16),
    _gpt3("gpt3-760m", 24, 1536, 16),
    # The paper lists 24 heads of 128 for 1.3B, which does not divide d_model 2048; 16 x 128 is the usual reading.
    _gpt3("gpt3-1.3b", 24, 2048, 16),
    _gpt3("gpt3-2.7b", 32, 2560, 32),
    _gpt3("gpt3-6.7b", 32, 4096, 32),
    # The paper lists d_model 5140 with 40 heads of 128; 5120 = 40 x 128 is the usual reading.
    _gpt3("gpt3-13b", 40, 5120, 40),
    _gpt3("gpt3-175b", 96, 12288, 96),
)}


def model_preset(name: str, **overrides) -> ModelSpec:
    """The preset called `name`, with any non-None field replaced (name becomes 'NAME+custom' then)."""
    try:
        base = MODEL_PRESETS[name]
    except KeyError:
        raise SpecError(f"unknown model preset {name!r}; valid: {', '.join(MODEL_PRESETS)}") from None
    changes = {k: v for k, v in overrides.items() if v is not None and getattr(base, k) != v}
    if not changes:
        return base
    if "hidden" in changes and "ffn" not in changes:
        changes["ffn"] = 4 * changes["hidden"]
    return replace(base, name=f"{name}+custom", **changes)
