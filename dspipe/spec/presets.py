"""Named model shapes: one table. Shapes from the GPT-2 release, the GPT-3 paper (Brown et al. 2020, Table 2.1), the
Llama 2 paper (Touvron et al. 2023, and its released configs), the Llama 3 release configs and TinyLlama's config."""
from __future__ import annotations

from dataclasses import replace

from dspipe.errors import SpecError
from dspipe.spec.core import ModelSpec

GPT2_VOCAB = 50257


def _gpt2(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, GPT2_VOCAB, 1024, 4 * hidden)


def _gpt3(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, GPT2_VOCAB, 2048, 4 * hidden)


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, *, vocab: int, seq_len: int,
           theta: float) -> ModelSpec:
    """RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases, untied head."""
    return ModelSpec(name, layers, hidden, heads, vocab, seq_len, ffn, tied_embeddings=False, norm="rmsnorm",
                     mlp="swiglu", positions="rope", rope_theta=theta, kv_heads=kv_heads, bias=False, norm_eps=1e-5)


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
    _llama("tiny-llama", 2, 64, 4, 2, 160, vocab=4096, seq_len=64, theta=10000.0),
    _llama("tinyllama-1.1b", 22, 2048, 32, 4, 5632, vocab=32000, seq_len=2048, theta=10000.0),
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, vocab=32000, seq_len=4096, theta=10000.0),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, vocab=32000, seq_len=4096, theta=10000.0),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, vocab=32000, seq_len=4096, theta=10000.0),
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, vocab=128256, seq_len=8192, theta=500000.0),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, vocab=128256, seq_len=8192, theta=500000.0),
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
