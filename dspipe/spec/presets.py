"""Named model shapes: one table of frozen `Preset`s, each with its source and, where a checkpoint was released, its
published parameter count. Shapes from the GPT-2 release, the GPT-3 paper (Brown et al. 2020, Table 2.1), and the
config.json of each released checkpoint named as its source (Llama 2, Llama 3, 3.1, 3.2, Qwen2.5, Qwen3, Mistral 7B,
TinyLlama).

seq_len is the context a pre-training run of the shape trains at, not the longest context the checkpoint serves
(max_position_embeddings): Llama 3.x 8192 (its main pre-training stage; the 128K of 3.1/3.2 is a final long-context
stage, and their llama3 rope scaling is part of the checkpoint's frequencies at any length), Qwen2.5 and Qwen3 4096
(their first pre-training stages; 32K only in the last), Mistral 7B 8192 (v0.1's paper context, twice its 4096-token
window). Parameter counts do not depend on it under rotary positions; --seq-len overrides it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, TypedDict

from dspipe.errors import SpecError
from dspipe.spec.model import ModelSpec

GPT2_VOCAB = 50257


@dataclass(frozen=True)
class Preset:
    """A named model shape, where it comes from, and the parameter count of its released checkpoint."""

    spec: ModelSpec
    source: str
    """Where the shape comes from: the Hugging Face repository id of the released checkpoint whose config.json it
    copies, or the paper."""
    published_params: int | None = None
    """Sum of numel over the released checkpoint's tensors (a tied head counted once); None: no checkpoint."""
    published_active: int | None = None
    """Mixture of experts: the parameters one token passes through, as the model's release states them exactly
    (total minus the experts a token is not routed to); None: dense or not published."""


def _gpt2(name: str, layers: int, hidden: int, heads: int, repo: str, params: int) -> Preset:
    return Preset(ModelSpec(name, layers, hidden, heads, GPT2_VOCAB, 1024, 4 * hidden), repo, params)


def _gpt3(name: str, layers: int, hidden: int, heads: int) -> Preset:
    return Preset(
        ModelSpec(name, layers, hidden, heads, GPT2_VOCAB, 2048, 4 * hidden),
        "GPT-3 paper (Brown et al. 2020), Table 2.1",
    )


def _llama(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    *,
    vocab: int,
    seq_len: int,
    theta: float,
    source: str,
    params: int | None,
    eps: float = 1e-5,
    active: int | None = None,
    **arch: Any,
) -> Preset:  # ModelSpec's keywords (it checks them)
    """RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases, untied head unless `arch` says
    otherwise (tied_embeddings, qkv_bias, head_width, qk_norm, rope scaling, sliding window)."""
    arch.setdefault("tied_embeddings", False)
    spec = ModelSpec(
        name,
        layers,
        hidden,
        heads,
        vocab,
        seq_len,
        ffn,
        norm="rmsnorm",
        mlp="swiglu",
        positions="rope",
        rope_theta=theta,
        kv_heads=kv_heads,
        bias=False,
        norm_eps=eps,
        **arch,
    )
    return Preset(spec, source, params, active)


class Arch(TypedDict, total=False):
    """Architecture keywords a family of presets shares (ModelSpec fields, and _llama's eps)."""

    rope_scaling: str
    rope_factor: float
    rope_low_freq_factor: float
    rope_high_freq_factor: float
    rope_original_context: int
    qkv_bias: bool
    eps: float
    qk_norm: bool
    head_width: int
    experts: int
    experts_per_token: int


LLAMA31_ROPE: Arch = dict(
    rope_scaling="llama3",
    rope_factor=8.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_context=8192,
)
"""Llama 3.1's rope_scaling (config.json: rope_type llama3, factor 8, low/high_freq_factor 1/4,
original_max_position_embeddings 8192); Llama 3.2 has factor 32."""
LLAMA32_ROPE: Arch = {**LLAMA31_ROPE, "rope_factor": 32.0}
QWEN2: Arch = dict(qkv_bias=True, eps=1e-6)
"""Qwen2/2.5: biases on the q/k/v projections only (no attention-output or MLP bias); rms_norm_eps 1e-6 (1e-5 in the
14B, 32B and 72B base configs)."""
QWEN25_LARGE: Arch = {**QWEN2, "eps": 1e-5}
"""Qwen2.5 14B, 32B and 72B: rms_norm_eps 1e-5 in their base configs."""
QWEN3: Arch = dict(qk_norm=True, head_width=128, eps=1e-6)
"""Qwen3: per-head RMSNorm of q and k, head_dim 128 whatever the width, no biases."""
MIXTRAL: Arch = dict(experts=8, experts_per_token=2)
"""Mixtral: 8 SwiGLU experts as wide as the dense ffn, top-2 with the two probabilities renormalised, every block
sparse, no shared expert, router_aux_loss_coef 0.001."""
QWEN3_MOE: Arch = dict(**QWEN3, experts=128, experts_per_token=8)
"""Qwen3-MoE: 128 experts, top-8, norm_topk_prob true in the released configs, every block sparse
(decoder_sparse_step 1, no mlp_only_layers), no shared expert."""

PRESETS: dict[str, Preset] = {
    p.spec.name: p
    for p in (
        Preset(ModelSpec("tiny", 2, 64, 4, 4096, 64, 256), "dspipe's test shape"),
        _gpt2("gpt2-124m", 12, 768, 12, "openai-community/gpt2", 124_439_808),
        _gpt2("gpt2-355m", 24, 1024, 16, "openai-community/gpt2-medium", 354_823_168),
        _gpt2("gpt2-774m", 36, 1280, 20, "openai-community/gpt2-large", 774_030_080),
        _gpt2("gpt2-1.5b", 48, 1600, 25, "openai-community/gpt2-xl", 1_557_611_200),
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
        _llama(
            "tiny-llama",
            2,
            64,
            4,
            2,
            160,
            vocab=4096,
            seq_len=64,
            theta=10000.0,
            source="dspipe's test shape",
            params=None,
        ),
        _llama(
            "tinyllama-1.1b",
            22,
            2048,
            32,
            4,
            5632,
            vocab=32000,
            seq_len=2048,
            theta=10000.0,
            source="TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T",
            params=1_100_048_384,
        ),
        _llama(
            "llama2-7b",
            32,
            4096,
            32,
            32,
            11008,
            vocab=32000,
            seq_len=4096,
            theta=10000.0,
            source="meta-llama/Llama-2-7b-hf",
            params=6_738_415_616,
        ),
        _llama(
            "llama2-13b",
            40,
            5120,
            40,
            40,
            13824,
            vocab=32000,
            seq_len=4096,
            theta=10000.0,
            source="meta-llama/Llama-2-13b-hf",
            params=13_015_864_320,
        ),
        _llama(
            "llama2-70b",
            80,
            8192,
            64,
            8,
            28672,
            vocab=32000,
            seq_len=4096,
            theta=10000.0,
            source="meta-llama/Llama-2-70b-hf",
            params=68_976_648_192,
        ),
        _llama(
            "llama3-8b",
            32,
            4096,
            32,
            8,
            14336,
            vocab=128256,
            seq_len=8192,
            theta=500000.0,
            source="meta-llama/Meta-Llama-3-8B",
            params=8_030_261_248,
        ),
        _llama(
            "llama3-70b",
            80,
            8192,
            64,
            8,
            28672,
            vocab=128256,
            seq_len=8192,
            theta=500000.0,
            source="meta-llama/Meta-Llama-3-70B",
            params=70_553_706_496,
        ),
        _llama(
            "llama3.1-8b",
            32,
            4096,
            32,
            8,
            14336,
            vocab=128256,
            seq_len=8192,
            theta=500000.0,
            **LLAMA31_ROPE,
            source="meta-llama/Llama-3.1-8B",
            params=8_030_261_248,
        ),
        _llama(
            "llama3.1-70b",
            80,
            8192,
            64,
            8,
            28672,
            vocab=128256,
            seq_len=8192,
            theta=500000.0,
            **LLAMA31_ROPE,
            source="meta-llama/Llama-3.1-70B",
            params=70_553_706_496,
        ),
        _llama(
            "llama3.1-405b",
            126,
            16384,
            128,
            8,
            53248,
            vocab=128256,
            seq_len=8192,
            theta=500000.0,
            **LLAMA31_ROPE,
            source="meta-llama/Llama-3.1-405B",
            params=405_853_388_800,
        ),
        _llama(
            "llama3.2-1b",
            16,
            2048,
            32,
            8,
            8192,
            vocab=128256,
            seq_len=8192,
            theta=500000.0,
            **LLAMA32_ROPE,
            tied_embeddings=True,
            source="meta-llama/Llama-3.2-1B",
            params=1_235_814_400,
        ),
        _llama(
            "llama3.2-3b",
            28,
            3072,
            24,
            8,
            8192,
            vocab=128256,
            seq_len=8192,
            theta=500000.0,
            **LLAMA32_ROPE,
            tied_embeddings=True,
            source="meta-llama/Llama-3.2-3B",
            params=3_212_749_824,
        ),
        _llama(
            "qwen2.5-0.5b",
            24,
            896,
            14,
            2,
            4864,
            vocab=151936,
            seq_len=4096,
            theta=1e6,
            **QWEN2,
            tied_embeddings=True,
            source="Qwen/Qwen2.5-0.5B",
            params=494_032_768,
        ),
        _llama(
            "qwen2.5-1.5b",
            28,
            1536,
            12,
            2,
            8960,
            vocab=151936,
            seq_len=4096,
            theta=1e6,
            **QWEN2,
            tied_embeddings=True,
            source="Qwen/Qwen2.5-1.5B",
            params=1_543_714_304,
        ),
        _llama(
            "qwen2.5-7b",
            28,
            3584,
            28,
            4,
            18944,
            vocab=152064,
            seq_len=4096,
            theta=1e6,
            **QWEN2,
            source="Qwen/Qwen2.5-7B",
            params=7_615_616_512,
        ),
        _llama(
            "qwen2.5-14b",
            48,
            5120,
            40,
            8,
            13824,
            vocab=152064,
            seq_len=4096,
            theta=1e6,
            **QWEN25_LARGE,
            source="Qwen/Qwen2.5-14B",
            params=14_770_033_664,
        ),
        _llama(
            "qwen2.5-32b",
            64,
            5120,
            40,
            8,
            27648,
            vocab=152064,
            seq_len=4096,
            theta=1e6,
            **QWEN25_LARGE,
            source="Qwen/Qwen2.5-32B",
            params=32_763_876_352,
        ),
        _llama(
            "qwen2.5-72b",
            80,
            8192,
            64,
            8,
            29568,
            vocab=152064,
            seq_len=4096,
            theta=1e6,
            **QWEN25_LARGE,
            source="Qwen/Qwen2.5-72B",
            params=72_706_203_648,
        ),
        _llama(
            "qwen3-0.6b",
            28,
            1024,
            16,
            8,
            3072,
            vocab=151936,
            seq_len=4096,
            theta=1e6,
            **QWEN3,
            tied_embeddings=True,
            source="Qwen/Qwen3-0.6B-Base",
            params=596_049_920,
        ),
        _llama(
            "qwen3-1.7b",
            28,
            2048,
            16,
            8,
            6144,
            vocab=151936,
            seq_len=4096,
            theta=1e6,
            **QWEN3,
            tied_embeddings=True,
            source="Qwen/Qwen3-1.7B-Base",
            params=1_720_574_976,
        ),
        _llama(
            "qwen3-4b",
            36,
            2560,
            32,
            8,
            9728,
            vocab=151936,
            seq_len=4096,
            theta=1e6,
            **QWEN3,
            tied_embeddings=True,
            source="Qwen/Qwen3-4B-Base",
            params=4_022_468_096,
        ),
        _llama(
            "qwen3-8b",
            36,
            4096,
            32,
            8,
            12288,
            vocab=151936,
            seq_len=4096,
            theta=1e6,
            **QWEN3,
            source="Qwen/Qwen3-8B-Base",
            params=8_190_735_360,
        ),
        _llama(
            "qwen3-14b",
            40,
            5120,
            40,
            8,
            17408,
            vocab=151936,
            seq_len=4096,
            theta=1e6,
            **QWEN3,
            source="Qwen/Qwen3-14B-Base",
            params=14_768_307_200,
        ),
        # no base checkpoint of the 32B was released; the post-trained one has the same shape
        _llama(
            "qwen3-32b",
            64,
            5120,
            64,
            8,
            25600,
            vocab=151936,
            seq_len=4096,
            theta=1e6,
            **QWEN3,
            source="Qwen/Qwen3-32B",
            params=32_762_123_264,
        ),
        _llama(
            "mistral-7b-v0.1",
            32,
            4096,
            32,
            8,
            14336,
            vocab=32000,
            seq_len=8192,
            theta=10000.0,
            sliding_window=4096,
            source="mistralai/Mistral-7B-v0.1",
            params=7_241_732_096,
        ),
        _llama(
            "mistral-7b-v0.3",
            32,
            4096,
            32,
            8,
            14336,
            vocab=32768,
            seq_len=8192,
            theta=1e6,
            source="mistralai/Mistral-7B-v0.3",
            params=7_248_023_552,
        ),
        # mixtures of experts: published total and active counts (Mixtral 8x7B: 46.7B / 12.9B; 8x22B: 141B / 39B;
        # Qwen3-MoE: 30.5B / 3.3B and 235B / 22B), exact
        _llama(
            "mixtral-8x7b",
            32,
            4096,
            32,
            8,
            14336,
            vocab=32000,
            seq_len=32768,
            theta=1e6,
            **MIXTRAL,
            source="mistralai/Mixtral-8x7B-v0.1",
            params=46_702_792_704,
            active=12_879_925_248,
        ),
        _llama(
            "mixtral-8x22b",
            56,
            6144,
            48,
            8,
            16384,
            vocab=32768,
            seq_len=65536,
            theta=1e6,
            **MIXTRAL,
            source="mistralai/Mixtral-8x22B-v0.1",
            params=140_630_071_296,
            active=39_161_468_928,
        ),
        # ffn is the released config's intermediate_size (the width of a dense block, which these shapes do not have)
        _llama(
            "qwen3-30b-a3b",
            48,
            2048,
            32,
            4,
            6144,
            vocab=151936,
            seq_len=4096,
            theta=1e6,
            **QWEN3_MOE,
            expert_ffn=768,
            source="Qwen/Qwen3-30B-A3B-Base",
            params=30_532_122_624,
            active=3_353_032_704,
        ),
        # no base checkpoint of the 235B was released; the post-trained one has the same shape
        _llama(
            "qwen3-235b-a22b",
            94,
            4096,
            64,
            4,
            12288,
            vocab=151936,
            seq_len=4096,
            theta=1e6,
            **QWEN3_MOE,
            expert_ffn=1536,
            source="Qwen/Qwen3-235B-A22B",
            params=235_093_634_560,
            active=22_190_763_520,
        ),
    )
}

MODEL_PRESETS: dict[str, ModelSpec] = {name: p.spec for name, p in PRESETS.items()}
"""The shapes alone, by name (what --model accepts)."""


def preset_lines() -> list[str]:
    """`dspipe presets`' model lines: name, parameters, shape and source (with the published count where it differs
    from the shape's, which no shipped preset does: a unit test holds them equal)."""
    out = []
    for p in PRESETS.values():
        m = p.spec
        line = f"{m.name:<16} {m.num_params / 1e6:>10,.1f}M  {m.shape_text}  [{p.source}]"
        if p.published_params not in (None, m.num_params):
            line += f" (published {p.published_params:,})"
        if m.experts:
            line += f" (active {m.active_params / 1e6:,.1f}M)"
        out.append(line)
    return out


def model_preset(name: str, **overrides: Any) -> ModelSpec:  # ModelSpec field values (it checks them)
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
