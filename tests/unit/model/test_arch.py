"""The model computes what transformers computes for the architectures issue 28 adds: explicit head_dim, split
biases, rotary scaling (linear, llama3, yarn), q/k RMSNorm per head (Qwen3) and the sliding window (Mistral, Qwen2's
max_window_layers). Tiny random models, fp32, weights copied by hand from the Hugging Face module (a mapping of its
own, independent of dspipe.model.hf), logits compared within 1e-5. Also: the window under Ulysses (the all-to-all
emulated in one process) and a tensor-parallel split by whole heads (emulated) equal the plain attention, and the
built parameters are the spec's declaration."""

import dataclasses
import math

import pytest
import torch

from dspipe.model.gpt import GPT, Attention, rope_frequencies, window_mask
from dspipe.spec.model import ModelSpec

transformers = pytest.importorskip("transformers")

TOL = 1e-5
VOCAB, HIDDEN, HEADS, KV, FFN, EPS = 96, 32, 4, 2, 48, 1e-5


def model_spec(**kw) -> ModelSpec:
    """A tiny Llama-family spec (RMSNorm, SwiGLU, rotary, grouped-query attention, no biases, untied head)."""
    base = dict(
        name="custom",
        layers=2,
        hidden=HIDDEN,
        heads=HEADS,
        vocab=VOCAB,
        seq_len=32,
        ffn=FFN,
        norm="rmsnorm",
        mlp="swiglu",
        positions="rope",
        rope_theta=10000.0,
        kv_heads=KV,
        bias=False,
        norm_eps=EPS,
        tied_embeddings=False,
    )
    return ModelSpec(**{**base, **kw})


def hf_model(family: str, **kw):
    """A tiny transformers model of `family`, every weight random (biases and norm weights too), fp32, eval."""
    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }[family]
    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
    }[family]
    base = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        intermediate_size=FFN,
        num_hidden_layers=2,
        rms_norm_eps=EPS,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**base, **kw})).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
    return model


def load_by_hand(gpt: GPT, hf) -> None:
    """Hugging Face Llama-family weights into dspipe's names: q/k/v fused as [q; k; v] rows, gate/up as [gate; up]."""
    src = dict(hf.state_dict())
    dst = dict(gpt.named_parameters())
    used, written = set(), set()

    def take(*names):
        used.update(names)
        return torch.cat([src[n] for n in names]) if len(names) > 1 else src[names[0]]

    def put(name, value):
        assert dst[name].shape == value.shape, name
        with torch.no_grad():
            dst[name].copy_(value)
        written.add(name)

    put("embed.wte.weight", take("model.embed_tokens.weight"))
    for i in range(len(gpt.h)):
        hf_p, p = f"model.layers.{i}.", f"h.{i}."
        attn, mlp = hf_p + "self_attn.", hf_p + "mlp."
        put(p + "ln_1.weight", take(hf_p + "input_layernorm.weight"))
        put(p + "ln_2.weight", take(hf_p + "post_attention_layernorm.weight"))
        for kind in ("weight", "bias"):
            if attn + f"q_proj.{kind}" in src:
                put(p + f"attn.c_attn.{kind}", take(*(attn + f"{x}_proj.{kind}" for x in "qkv")))
            if attn + f"o_proj.{kind}" in src:
                put(p + f"attn.c_proj.{kind}", take(attn + f"o_proj.{kind}"))
            if mlp + f"gate_proj.{kind}" in src:
                put(p + f"mlp.c_fc.{kind}", take(mlp + f"gate_proj.{kind}", mlp + f"up_proj.{kind}"))
                put(p + f"mlp.c_proj.{kind}", take(mlp + f"down_proj.{kind}"))
        for norm in ("q_norm", "k_norm"):
            if attn + f"{norm}.weight" in src:
                put(p + f"attn.{norm}.weight", take(attn + f"{norm}.weight"))
    put("final.ln_f.weight", take("model.norm.weight"))
    if gpt.lm_head is not None:
        put("lm_head.weight", take("lm_head.weight"))
    else:
        used.add("lm_head.weight")  # tied: the embedding
    assert written == set(dst), set(dst) - written
    assert used == set(src), set(src) - used


def tokens(seq=32, b=2):
    return torch.randint(0, VOCAB, (b, seq), generator=torch.Generator().manual_seed(2))


def logits_of(spec: ModelSpec, hf) -> tuple[torch.Tensor, torch.Tensor]:
    """(dspipe's logits, transformers' logits) on the same tokens, dspipe's model holding hf's weights."""
    gpt = GPT(spec, seed=1).eval()
    load_by_hand(gpt, hf)
    x = tokens(spec.seq_len)
    with torch.no_grad():
        return gpt(x), hf(x).logits


def assert_close(ours, theirs):
    diff = (ours - theirs).abs().max().item()
    assert diff < TOL, diff


LLAMA_ROPE = {  # (dspipe's fields, transformers' rope_parameters)
    "linear": (dict(rope_scaling="linear", rope_factor=4.0), dict(rope_type="linear", factor=4.0)),
    "llama3": (
        dict(
            rope_scaling="llama3",
            rope_factor=8.0,
            rope_original_context=16,
            rope_low_freq_factor=1.0,
            rope_high_freq_factor=4.0,
        ),
        dict(
            rope_type="llama3",
            factor=8.0,
            original_max_position_embeddings=16,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
        ),
    ),
    "yarn": (
        dict(rope_scaling="yarn", rope_factor=4.0, rope_original_context=16, rope_beta_fast=16.0, rope_beta_slow=2.0),
        dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=16.0, beta_slow=2.0),
    ),
}


@pytest.mark.parametrize("head_dim", [8, 12, 16])
@pytest.mark.parametrize("scaling", ["none", *LLAMA_ROPE])
def test_rope_frequencies_are_transformers(scaling, head_dim):
    """Inverse frequencies and the cos/sin factor equal transformers' rope init functions bit for bit."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ours, params = LLAMA_ROPE.get(scaling, ({}, dict(rope_type="default")))
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        head_dim=head_dim,
        max_position_embeddings=64,
        rope_parameters={**params, "rope_theta": 10000.0},
    )
    if scaling == "none":
        theirs = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        theirs = ROPE_INIT_FUNCTIONS[scaling](config)
    inv_freq, scale = rope_frequencies(model_spec(head_width=head_dim, **ours))
    assert inv_freq.dtype == torch.float32 and torch.equal(inv_freq, theirs[0])
    assert scale == theirs[1]
    if scaling == "yarn":
        assert scale == pytest.approx(0.1 * math.log(4.0) + 1)
    if scaling != "none":  # the scaling moves some frequencies and keeps the highest
        plain, _ = rope_frequencies(model_spec(head_width=head_dim))
        assert not torch.equal(inv_freq, plain)


@pytest.mark.parametrize("scaling", list(LLAMA_ROPE))
def test_llama_with_rope_scaling_head_dim_and_biases_is_transformers(scaling):
    """Llama 3.1-style scaling at a context longer than the original one, head_dim 12 (hidden / heads is 8),
    attention_bias (q, k, v and o) and mlp_bias."""
    ours, params = LLAMA_ROPE[scaling]
    hf = hf_model(
        "llama", head_dim=12, attention_bias=True, mlp_bias=True, rope_parameters={**params, "rope_theta": 10000.0}
    )
    spec = model_spec(head_width=12, bias=True, norm="rmsnorm", **ours)
    assert spec.biases == (True, True, True)
    mine, theirs = logits_of(spec, hf)
    assert_close(mine, theirs)
    unscaled, _ = logits_of(model_spec(head_width=12, bias=True), hf)  # the scaling is seen in the logits
    assert (unscaled - theirs).abs().max() > 100 * TOL


def test_qwen2_has_qkv_biases_only():
    hf = hf_model("qwen2")
    spec = model_spec(qkv_bias=True)
    assert spec.biases == (True, False, False)
    mine, theirs = logits_of(spec, hf)
    assert_close(mine, theirs)


def test_qwen3_normalises_every_q_and_k_head_before_rotary():
    """q_norm/k_norm per head, head_dim 16 = 2 x hidden / heads, tied embeddings (Qwen3-0.6B's shape)."""
    hf = hf_model("qwen3", head_dim=16, tie_word_embeddings=True)
    spec = model_spec(head_width=16, qk_norm=True, tied_embeddings=True)
    mine, theirs = logits_of(spec, hf)
    assert_close(mine, theirs)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_mistral_sliding_window_is_transformers(implementation):
    """Window 8 at sequence 32: query q sees keys q - 8 < k <= q, as transformers' Mistral masks them."""
    hf = hf_model("mistral", sliding_window=8, attn_implementation=implementation)
    mine, theirs = logits_of(model_spec(sliding_window=8), hf)
    assert_close(mine, theirs)
    for other in (7, 9, None):  # one token more or less of window is seen in the logits
        wrong, _ = logits_of(model_spec(sliding_window=other), hf)
        assert (wrong - theirs).abs().max() > 100 * TOL, other


def test_qwen2_window_starts_at_max_window_layers():
    """use_sliding_window with max_window_layers 2 of 4: blocks 0, 1 full causal, blocks 2, 3 windowed."""
    hf = hf_model("qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert hf.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    spec = model_spec(layers=4, qkv_bias=True, sliding_window=8, window_start_layer=2)
    assert [spec.window_of(i) for i in range(4)] == [None, None, 8, 8]
    mine, theirs = logits_of(spec, hf)
    assert_close(mine, theirs)
    everywhere, _ = logits_of(model_spec(layers=4, qkv_bias=True, sliding_window=8), hf)
    assert (everywhere - theirs).abs().max() > 100 * TOL


def test_window_mask_boundary():
    mask = window_mask(6, 3)
    assert mask.tolist()[4] == [False, False, True, True, True, False]  # query 4 sees keys 2, 3, 4
    assert torch.equal(window_mask(6, 6), torch.ones(6, 6, dtype=torch.bool).tril())


def test_a_window_as_long_as_the_sequence_is_causal_attention():
    x = torch.randn(2, 32, HIDDEN, generator=torch.Generator().manual_seed(3))
    plain = GPT(model_spec(), seed=4).h[0].attn
    for window in (32, 1000):
        windowed = GPT(model_spec(sliding_window=window), seed=4).h[0].attn
        assert torch.equal(windowed(x), plain(x))


SPECS = {
    "llama-yarn-hd12-biases": model_spec(head_width=12, bias=True, **LLAMA_ROPE["yarn"][0]),
    "qwen2": model_spec(qkv_bias=True),
    "qwen3": model_spec(head_width=16, qk_norm=True, tied_embeddings=True),
    "mistral": model_spec(sliding_window=8),
    "qwen2-window": model_spec(layers=4, qkv_bias=True, sliding_window=8, window_start_layer=2),
    "out-bias-only": model_spec(out_bias=True, mlp_bias=False, head_width=4),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_built_parameters_are_the_declared_tensors(name):
    spec = SPECS[name]
    with torch.device("meta"):
        model = GPT(spec, seed=None)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == spec.model_tensors()


@pytest.mark.parametrize(
    "field", [dict(qk_norm=True), dict(qkv_bias=True), dict(out_bias=True), dict(mlp_bias=True), dict(sliding_window=4)]
)
def test_new_features_leave_the_other_step0_weights_alone(field):
    """q/k norms start at 1 and biases at 0, declared so that every other weight is the one drawn without them."""
    plain, other = GPT(model_spec(), seed=5), GPT(model_spec(**field), seed=5)
    theirs = dict(other.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.equal(p, theirs.pop(name)), name
    for name, p in theirs.items():
        assert torch.equal(p, torch.ones_like(p) if "norm" in name else torch.zeros_like(p)), name


def ulysses_emulated(attn: Attention, x: torch.Tensor, sp: int) -> torch.Tensor:
    """What dspipe.runtime.sequence does with sp ranks, in one process: every rank projects its sequence slice at
    its position offset; the all-to-all gathers the sequence and scatters the heads; every rank runs the core on
    its heads over the whole sequence; the reverse all-to-all; every rank projects its slice."""
    seq = x.shape[1]
    step = seq // sp
    parts = []
    for r in range(sp):
        attn.position_offset = r * step
        parts.append(attn.heads(x[:, r * step : (r + 1) * step]))
    attn.position_offset = 0
    q, k, v = (torch.cat([p[i] for p in parts], dim=1) for i in range(3))  # whole sequence, all heads
    width = q.shape[2] // sp
    y = torch.cat(
        [attn.local_core(*(t[:, :, g * width : (g + 1) * width] for t in (q, k, v))) for g in range(sp)], dim=2
    )
    b = x.shape[0]
    return torch.cat([attn.c_proj(y[:, r * step : (r + 1) * step].reshape(b, step, -1)) for r in range(sp)], dim=1)


@pytest.mark.parametrize("sp", [2, 4])
def test_window_under_ulysses_counts_whole_sequence_positions(sp):
    """sp ranks hold 32 / sp tokens each (16 or 8, the window is 8): the core runs on the whole sequence after the
    all-to-all and counts the window in whole-sequence positions, so the result is the local attention's (with
    qk_norm, head_dim 12, biases and yarn rotary at each slice's offset)."""
    spec = model_spec(sliding_window=8, head_width=12, qk_norm=True, bias=True, **LLAMA_ROPE["yarn"][0])
    attn = GPT(spec, seed=6).h[0].attn
    x = torch.randn(2, 32, HIDDEN, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(ulysses_emulated(attn, x, sp), attn(x), rtol=0, atol=TOL)


def test_ulysses_core_wraps_the_window_aware_local_core():
    pytest.importorskip("deepspeed")
    from dspipe.runtime.sequence import _UlyssesCore

    attn = GPT(model_spec(sliding_window=8), seed=6).h[1].attn
    core = _UlyssesCore(attn, group=None)
    assert core.spread.local_attn == attn.local_core and attn.window == 8


@pytest.mark.parametrize("tp, kv_heads", [(2, 2), (4, 4)])
def test_tensor_parallel_shards_by_whole_heads(tp, kv_heads):
    """AutoTP's split (dspipe.planner.autotp): c_attn's q, k, v parts each cut in tp row blocks, c_proj's input
    columns in tp blocks (q_width = heads x head_dim, not hidden), the q/k norms replicated. Every shard is an
    Attention of its own (local heads from the shard width); the row-parallel sum plus the bias once is the
    whole attention."""
    from dspipe.model.tp_split import QKV, fused_parts

    spec = model_spec(
        head_width=12, qk_norm=True, bias=True, kv_heads=kv_heads, sliding_window=8, **LLAMA_ROPE["llama3"][0]
    )
    full = GPT(spec, seed=8).h[0].attn
    with torch.no_grad():
        for p in full.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    parts = fused_parts(spec)[QKV]
    x = torch.randn(2, 32, HIDDEN, generator=torch.Generator().manual_seed(9))
    total = 0
    with torch.no_grad():
        for r in range(tp):
            shard = Attention(spec, window=8)
            shard.q_norm, shard.k_norm = full.q_norm, full.k_norm
            rows = [t.chunk(tp)[r] for t in full.c_attn.weight.split(parts)]
            biases = [t.chunk(tp)[r] for t in full.c_attn.bias.split(parts)]
            shard.c_attn = torch.nn.Linear(HIDDEN, sum(len(b) for b in biases))
            shard.c_attn.weight.copy_(torch.cat(rows))
            shard.c_attn.bias.copy_(torch.cat(biases))
            shard.c_proj = torch.nn.Linear(spec.q_width // tp, HIDDEN, bias=False)
            shard.c_proj.weight.copy_(full.c_proj.weight.chunk(tp, dim=1)[r])
            total = total + shard(x)
        torch.testing.assert_close(total + full.c_proj.bias, full(x), rtol=0, atol=TOL)


def test_pipeline_blocks_keep_their_window_and_norms():
    """The pipeline's LayerSpecs build each Block with its index: the same window per block, the same function."""
    from dspipe.model.pipeline import layer_specs

    spec = dataclasses.replace(SPECS["qwen2-window"], qk_norm=True, head_width=12)
    x = tokens(spec.seq_len)
    expected = GPT(spec, seed=7)(x)
    h = x
    windows = []
    for layer_spec in layer_specs(model=spec, seed=7):
        module = layer_spec.build()
        windows += [module.attn.window] if hasattr(module, "attn") else []
        forward_fn = getattr(layer_spec, "forward_fn", None)
        h = forward_fn(module, h) if forward_fn else module(h)
    assert windows == [None, None, 8, 8]
    assert torch.equal(h, expected)


def test_the_engine_check_names_q_k_norms_whose_gradient_tp_does_not_sum():
    """Every tp rank normalises its own heads with the whole q/k norm weight: unless the norm sums its weight's
    gradient over the tp group (ReducedRMSNorm, which shard_tensor_parallel puts in) the ranks step it with
    different gradients (measured on gloo: 0.1 apart after 6 steps), and the engine check names it."""
    pytest.importorskip("deepspeed")
    from dspipe.runtime.engine import tp_unreduced_params
    from dspipe.runtime.parallelize import shard_tensor_parallel
    from dspipe.runtime.tensor_parallel import TensorGroup

    spec = model_spec(qk_norm=True)
    with torch.device("meta"):
        model = GPT(spec, seed=None)
    shard_tensor_parallel(model, spec=spec, tp=TensorGroup(rank=0, size=2))
    assert tp_unreduced_params(model) == []
    for i in range(2):  # a plain norm: its gradient would be this rank's heads' share only
        model.h[i].attn.k_norm = torch.nn.RMSNorm(spec.head_dim, device="meta")
    assert tp_unreduced_params(model) == [f"h.{i}.attn.k_norm.weight" for i in range(2)]
    assert tp_unreduced_params(GPT(spec, seed=1)) == []  # no tensor-parallel shards: nothing to sum
