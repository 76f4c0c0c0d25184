"""The Llama family in Hugging Face form (LlamaForCausalLM with head_dim, biases and llama3/linear/yarn rope scaling,
Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM): tiny random checkpoints written by transformers'
save_pretrained are read as the ModelSpec they compute (exactly), dspipe's GPT built from their weights gives
transformers' logits, the weights map back exactly, a dspipe model exports to the class that computes it (and
loads with AutoModelForCausalLM with that config), `--init-from` checks their headers and flags, `generate` runs on
an exported directory, and what no class computes is one line."""

import json
import math
from dataclasses import replace

import pytest
import torch

from dspipe.spec.model import ModelSpec
from tests.helpers import edit_hf_config, perturb, run_cli
from tests.unit.model.test_hf import CPU2, _refusal

TOL = 1e-5
V, S = 96, 32
BASE = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=S,
    rms_norm_eps=1e-5,
)
SPEC = dict(
    layers=3,
    hidden=32,
    heads=4,
    vocab=V,
    seq_len=S,
    ffn=48,
    norm="rmsnorm",
    mlp="swiglu",
    positions="rope",
    kv_heads=2,
    bias=False,
    norm_eps=1e-5,
    tied_embeddings=False,
    dropout=0.0,
)
YARN4 = 0.1 * math.log(4.0) + 1.0

# family: (config class, its arguments, config.json edits after saving, the ModelSpec fields it reads as)
FAMILIES = {
    "llama3-biases-hd12": (
        "LlamaConfig",
        dict(
            head_dim=12,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8,
            ),
        ),
        {},
        dict(
            head_width=12,
            qkv_bias=True,
            out_bias=True,
            mlp_bias=True,
            rope_theta=10000.0,
            rope_scaling="llama3",
            rope_factor=4.0,
            rope_original_context=8,
            rope_low_freq_factor=1.0,
            rope_high_freq_factor=4.0,
        ),
    ),
    "llama-linear-transformers4": (  # transformers 4's layout: rope_theta and rope_scaling {type: linear}
        "LlamaConfig",
        dict(num_key_value_heads=4, tie_word_embeddings=True, mlp_bias=True),
        dict(rope_parameters=..., rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 2.0}),
        dict(
            kv_heads=4, tied_embeddings=True, mlp_bias=True, rope_theta=5000.0, rope_scaling="linear", rope_factor=2.0
        ),
    ),
    "llama-yarn": (
        "LlamaConfig",
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                beta_fast=8.0,
                beta_slow=2.0,
                original_max_position_embeddings=8,
                attention_factor=YARN4,
            )
        ),
        {},
        dict(
            rope_theta=10000.0,
            rope_scaling="yarn",
            rope_factor=4.0,
            rope_original_context=8,
            rope_beta_fast=8.0,
            rope_beta_slow=2.0,
        ),
    ),
    "qwen2-window-yarn-tied": (
        "Qwen2Config",
        dict(
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=8),
        ),
        {},
        dict(
            qkv_bias=True,
            tied_embeddings=True,
            sliding_window=5,
            window_start_layer=1,
            rope_theta=1e6,
            rope_scaling="yarn",
            rope_factor=4.0,
            rope_original_context=8,
        ),
    ),
    "qwen2.5-no-window": (  # Qwen2.5's published configs: use_sliding_window false (sliding_window is then ignored)
        "Qwen2Config",
        dict(rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        dict(use_sliding_window=False, sliding_window=4096, max_window_layers=28, layer_types=...),
        dict(qkv_bias=True, rope_theta=1e6),
    ),
    "qwen3-hd16-window": (
        "Qwen3Config",
        dict(
            head_dim=16,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=0,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        ),
        {},
        dict(head_width=16, qk_norm=True, sliding_window=6, window_start_layer=0, rope_theta=1e6),
    ),
    "qwen3-biases": (
        "Qwen3Config",
        dict(head_dim=8, attention_bias=True),
        {},
        dict(qk_norm=True, qkv_bias=True, out_bias=True),
    ),
    "mistral-window-hd16": (
        "MistralConfig",
        dict(sliding_window=7, head_dim=16, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        {},
        dict(head_width=16, sliding_window=7, rope_theta=1e6),
    ),
}
ARCH = {
    "LlamaConfig": "LlamaForCausalLM",
    "Qwen2Config": "Qwen2ForCausalLM",
    "Qwen3Config": "Qwen3ForCausalLM",
    "MistralConfig": "MistralForCausalLM",
}


def family_dir(tmp_path, family: str, *, seed=0, **save):
    """(directory, transformers model) of a tiny random checkpoint of `family`: saved by save_pretrained, its
    config.json edited as the family says, and the model loaded back from it (so it computes what the file says)."""
    import transformers

    cls, kwargs, edits, _ = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, cls)(**{**BASE, **kwargs})
    model = perturb(getattr(transformers, ARCH[cls])(config).float().eval(), seed)
    d = tmp_path / family
    model.save_pretrained(d, **save)
    edit_hf_config(d, **edits)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(d).float().eval()
    assert type(loaded).__name__ == ARCH[cls]
    return d, loaded


def expected_spec(family: str, name: str) -> ModelSpec:
    return ModelSpec(name=name, **{**SPEC, **FAMILIES[family][3]})


def ids(seq=S, n=2):
    return torch.randint(0, V, (n, seq), generator=torch.Generator().manual_seed(5))


def hf_logits(model, x):
    with torch.no_grad():
        return model(x).logits


# ---- import: config, weights, logits ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_checkpoint_reads_as_its_spec_and_computes_transformers_logits(family, tmp_path):
    from dspipe.model.gpt import GPT
    from dspipe.model.hf import spec_from_hf_dir
    from dspipe.model.hf_state import from_hf_state, to_hf_state
    from dspipe.model.hf_weights import HFWeights, check_weights, load_into_module

    d, hf = family_dir(tmp_path, family)
    spec = spec_from_hf_dir(d)
    assert spec == expected_spec(family, family)  # every field, exactly
    assert spec.num_params == sum(p.numel() for p in hf.parameters())  # a tied head counted once on both sides

    hf_sd = dict(hf.state_dict())
    ours = from_hf_state(hf_sd, spec)
    assert sorted(ours) == sorted(n for n, _ in spec.model_tensors())
    back = to_hf_state(ours, spec)
    assert sorted(back) == sorted(hf_sd)
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)  # exact inverse, both ways
    assert all(torch.equal(from_hf_state(back, spec)[k], ours[k]) for k in ours)

    assert check_weights(d, spec) == 4 * sum(math.prod(s) for _, s in spec.model_tensors())  # fp32 headers
    gpt = GPT(spec, seed=1).eval()
    assert load_into_module(gpt, HFWeights(d, spec), spec=spec) == len(spec.model_tensors())
    x = ids()
    with torch.no_grad():
        diff = (gpt(x) - hf_logits(hf, x)).abs().max().item()
    assert diff < TOL, diff


FACTORS = ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow")  # each scaling's own: defaults without
NO_SCALING = dict(
    rope_scaling="none",
    rope_factor=1.0,
    rope_original_context=None,
    **{f"rope_{name}": getattr(ModelSpec, f"rope_{name}") for name in FACTORS},
)


def test_sliding_window_and_rope_scaling_change_the_logits(tmp_path):
    """The checkpoints above test something: without its window or its rope scaling a model computes other logits
    (so matching transformers' is not a coincidence of short sequences)."""
    from dspipe.model.gpt import GPT
    from dspipe.model.hf import spec_from_hf_dir
    from dspipe.model.hf_state import from_hf_state

    x = ids()
    for family, plain in (
        ("mistral-window-hd16", dict(sliding_window=None)),
        ("qwen2-window-yarn-tied", dict(sliding_window=None, window_start_layer=0)),
        ("llama3-biases-hd12", dict(NO_SCALING)),
        ("llama-yarn", dict(NO_SCALING)),
    ):
        d, hf = family_dir(tmp_path, family)
        spec = replace(spec_from_hf_dir(d), **plain)
        gpt = GPT(spec, seed=1).eval()
        gpt.load_state_dict(from_hf_state(hf.state_dict(), spec), strict=True)
        with torch.no_grad():
            assert (gpt(x) - hf_logits(hf, x)).abs().max().item() > 1e-3, family


def test_qwen3_without_head_dim_has_qwen3s_default_and_defaults_are_read_as_transformers_reads_them(tmp_path):
    from transformers import AutoConfig

    from dspipe.model.hf import spec_from_hf_dir

    d, _ = family_dir(tmp_path, "qwen3-biases")
    edit_hf_config(d, head_dim=...)
    assert spec_from_hf_dir(d).head_dim == AutoConfig.from_pretrained(d).head_dim == 128  # not hidden / heads
    d, _ = family_dir(tmp_path, "mistral-window-hd16")
    edit_hf_config(d, sliding_window=None, head_dim=..., rope_parameters=..., rope_theta=...)
    spec = spec_from_hf_dir(d)
    assert (spec.sliding_window, spec.head_width, spec.rope_theta) == (None, None, 10000.0)
    d, _ = family_dir(tmp_path, "qwen2-window-yarn-tied")
    edit_hf_config(d, use_sliding_window=False, layer_types=...)  # the window is off: no window anywhere
    assert spec_from_hf_dir(d).sliding_window is None
    edit_hf_config(d, use_sliding_window=True, max_window_layers=3)  # from layer 3 of 3: no window either
    assert spec_from_hf_dir(d).sliding_window is None
    edit_hf_config(d, max_window_layers=..., sliding_window=...)  # absent: Qwen2Config's defaults, 28 and 4096
    assert spec_from_hf_dir(d).sliding_window is None
    edit_hf_config(d, max_window_layers=2)
    assert (spec_from_hf_dir(d).sliding_window, spec_from_hf_dir(d).window_start_layer) == (4096, 2)
    assert AutoConfig.from_pretrained(d).layer_types == ["full_attention"] * 2 + ["sliding_attention"]
    d, _ = family_dir(tmp_path, "mistral-window-hd16")
    edit_hf_config(d, sliding_window=...)  # absent: MistralConfig's default 4096 (null: none, above)
    assert spec_from_hf_dir(d).sliding_window == AutoConfig.from_pretrained(d).sliding_window == 4096


@pytest.mark.parametrize("family", ["qwen2-window-yarn-tied", "qwen3-biases", "llama3-biases-hd12"])
def test_lazy_reads_of_biases_and_qk_norms_equal_the_whole_tensor(family, tmp_path):
    """HFWeights (a pipeline stage's and a ZeRO-3 partition's reads) over a sharded checkpoint: the fused q/k/v and
    gate/up biases are slices of the stacked HF biases, the q/k norms read as they are."""
    from dspipe.model.hf import spec_from_hf_dir
    from dspipe.model.hf_state import from_hf_state
    from dspipe.model.hf_weights import HFWeights

    d, hf = family_dir(tmp_path, family, max_shard_size="20KB")
    assert (d / "model.safetensors.index.json").is_file()
    spec = spec_from_hf_dir(d)
    weights, full = HFWeights(d, spec), from_hf_state(hf.state_dict(), spec)
    assert any(n.endswith("c_attn.bias") for n in full)
    g = torch.Generator().manual_seed(0)
    for name, t in full.items():
        assert torch.equal(weights.full(name), t), name
        flat = t.reshape(-1)
        for _ in range(3):
            a, b = sorted(torch.randint(0, flat.numel() + 1, (2,), generator=g).tolist())
            assert torch.equal(weights.flat(name, a, b), flat[a:b]), (name, a, b)
        if t.shape[0] > 3:
            assert torch.equal(weights.rows(name, 1, 3), t[1:3]), name


# ---- export: the class that computes the spec ---------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dspipe_model_exports_to_the_class_that_computes_it(family, tmp_path):
    from transformers import AutoModelForCausalLM

    from dspipe.model.gpt import GPT
    from dspipe.model.hf import spec_from_hf_dir
    from dspipe.model.hf_arch import architecture_of, rope_parameters
    from dspipe.model.hf_state import hf_model

    spec = expected_spec(family, "m")
    arch = ARCH[FAMILIES[family][0]]
    assert architecture_of(spec) == arch
    gpt = perturb(GPT(spec, seed=3).eval(), seed=3)
    model = hf_model(dict(gpt.state_dict()), spec, eos_id=0, source="test")
    model.save_pretrained(tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    c = loaded.config
    assert type(loaded).__name__ == arch and c.architectures == [arch]
    assert (
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
        c.max_position_embeddings,
        c.vocab_size,
        c.tie_word_embeddings,
        c.hidden_act,
    ) == (
        spec.layers,
        spec.hidden,
        spec.heads,
        spec.kv_groups,
        spec.ffn,
        spec.seq_len,
        spec.vocab,
        spec.tied_embeddings,
        "silu",
    )
    assert c.head_dim == spec.head_dim and c.rms_norm_eps == spec.norm_eps
    assert {k: v for k, v in c.rope_parameters.items()} == rope_parameters(spec)
    qkv, out, mlp = spec.biases
    if arch == "LlamaForCausalLM":
        assert (c.attention_bias, c.mlp_bias) == (qkv, mlp)
    if arch == "Qwen3ForCausalLM":
        assert c.attention_bias == qkv
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert c.layer_types == [
            "sliding_attention" if spec.window_of(i) else "full_attention" for i in range(spec.layers)
        ]
        assert c.sliding_window == spec.sliding_window and c.use_sliding_window == (spec.sliding_window is not None)
    if arch == "MistralForCausalLM":
        assert c.sliding_window == spec.sliding_window
    attn = loaded.model.layers[0].self_attn
    assert (attn.q_proj.bias is not None, attn.o_proj.bias is not None) == (qkv, out)
    assert spec_from_hf_dir(tmp_path / "out", name="m") == spec  # the export reads back as the same spec
    x = ids()
    with torch.no_grad():
        diff = (hf_logits(loaded, x) - gpt(x)).abs().max().item()
    assert diff < TOL, diff


def _spec(**fields) -> ModelSpec:
    return ModelSpec(name="m", **{**SPEC, **fields})


@pytest.mark.parametrize(
    "fields,expected",
    [
        (dict(), "LlamaForCausalLM"),
        (dict(bias=True), "LlamaForCausalLM"),  # q/k/v/o and MLP biases: attention_bias and mlp_bias
        (dict(mlp_bias=True), "LlamaForCausalLM"),
        (dict(qkv_bias=True, out_bias=True), "LlamaForCausalLM"),
        (dict(qkv_bias=True), "Qwen2ForCausalLM"),
        (dict(bias=True, out_bias=False, mlp_bias=False), "Qwen2ForCausalLM"),
        (dict(qkv_bias=True, sliding_window=4, window_start_layer=2), "Qwen2ForCausalLM"),
        (dict(qk_norm=True), "Qwen3ForCausalLM"),
        (dict(qk_norm=True, qkv_bias=True, out_bias=True, sliding_window=4, window_start_layer=1), "Qwen3ForCausalLM"),
        (dict(sliding_window=4), "MistralForCausalLM"),
        (
            dict(hidden=30, head_width=8),
            "MistralForCausalLM",
        ),  # LlamaConfig refuses hidden % heads; Mistral computes it
        (dict(norm="layernorm", mlp="gelu", positions="learned", bias=True, kv_heads=None), "GPT2LMHeadModel"),
        (
            dict(qkv_bias=True, mlp_bias=True),
            "q, k, v and o biases together; q/k/v biases alone are Qwen2ForCausalLM's",
        ),
        (dict(out_bias=True), "q, k, v and o biases together"),
        (dict(qk_norm=True, qkv_bias=True), "q/k norm is Qwen3ForCausalLM's"),
        (dict(qk_norm=True, mlp_bias=True), "q/k norm is Qwen3ForCausalLM's"),
        (
            dict(sliding_window=4, window_start_layer=1),
            "a sliding window is MistralForCausalLM's (every layer, no biases)",
        ),
        (dict(sliding_window=4, mlp_bias=True), "a sliding window is MistralForCausalLM's"),
        (dict(hidden=30, head_width=8, bias=True), "LlamaForCausalLM's config needs hidden divisible by heads"),
        (
            dict(norm="layernorm", mlp="gelu", positions="learned", bias=True, kv_heads=None, head_width=16),
            "GPT2LMHeadModel has biases everywhere, no grouped-query attention, head_dim hidden / heads",
        ),
        (dict(mlp="gelu"), "GPT2LMHeadModel is layernorm, gelu, learned positions"),
    ],
)
def test_the_architecture_that_computes_a_spec(fields, expected):
    from dspipe.model.hf_arch import architecture_of, hf_config

    spec = _spec(**fields)
    if expected.endswith(("CausalLM", "LMHeadModel")):
        assert architecture_of(spec) == expected
        assert type(hf_config(spec, eos_id=0)).__name__ == expected.replace("ForCausalLM", "Config").replace(
            "LMHeadModel", "Config"
        )
    else:
        text = _refusal(hf_config, spec, eos_id=0)
        assert text.startswith("model m (rmsnorm") or text.startswith("model m (layernorm"), text
        assert "matches no Hugging Face architecture dspipe writes" in text and expected in text, text


# ---- refusals: one line naming the file and the key ---------------------------------------------------------------

YARN = dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=8)


@pytest.mark.parametrize(
    "family,edit,expected",
    [
        (
            "llama-yarn",
            dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)),
            "config.json: rope_parameters: rope_type dynamic is not supported "
            "(supported: default, linear, llama3, yarn)",
        ),
        (
            "llama-linear-transformers4",
            dict(rope_scaling={"type": "longrope", "factor": 2.0}),
            "config.json: rope_scaling: rope_type longrope is not supported (supported: default, linear, llama3, yarn)",
        ),
        ("qwen2.5-no-window", dict(hidden_act="gelu"), "config.json: hidden_act 'gelu' is not supported"),
        (
            "qwen2-window-yarn-tied",
            dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
            "config.json: layer_types [sliding_attention x1, full_attention x1, sliding_attention x1] is not supported "
            "(dspipe builds [full_attention x1, sliding_attention x2]: use_sliding_window, sliding_window and "
            "max_window_layers give the window to layers 1 and up)",
        ),
        (
            "qwen2-window-yarn-tied",
            dict(max_window_layers=2),  # its layer_types say from layer 1
            "config.json: layer_types [full_attention x1, sliding_attention x2] is not supported (dspipe builds "
            "[full_attention x2, sliding_attention x1]",
        ),
        (
            "mistral-window-hd16",
            dict(layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
            "(dspipe builds [sliding_attention x3]: sliding_window applies to every layer of MistralForCausalLM)",
        ),
        (
            "llama-yarn",
            dict(rope_parameters={**YARN, "attention_factor": 2.0}),
            "config.json: rope_parameters: attention_factor 2 is not supported (dspipe's yarn scales attention by 0.1 "
            "ln(factor) + 1 = 1.13863)",
        ),
        (
            "llama-yarn",
            dict(rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 1.0}),
            "config.json: rope_parameters: mscale 0.707 with mscale_all_dim 1 is not supported",
        ),
        (
            "llama-yarn",
            dict(rope_parameters={**YARN, "truncate": False}),
            "config.json: rope_parameters: truncate False is not supported",
        ),
        (
            "llama-yarn",
            dict(rope_parameters={**YARN, "partial_rotary_factor": 0.5}),
            "config.json: rope_parameters: partial_rotary_factor 0.5 is not supported",
        ),
        (
            "llama-yarn",
            dict(rope_parameters={"full_attention": YARN}),
            "config.json: rope_parameters per layer type (full_attention) is not supported",
        ),
        (
            "llama3-biases-hd12",
            dict(
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 1e4,
                    "factor": 4.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "beta_fast": 3,
                }
            ),
            "config.json: rope_parameters: beta_fast 3 is not supported with rope_type llama3",
        ),
        ("llama3-biases-hd12", dict(mlp_bias="yes"), "config.json: mlp_bias must be true or false, got 'yes'"),
        (
            "qwen3-biases",
            dict(sliding_window=0, use_sliding_window=True, layer_types=...),
            "config.json: sliding_window must be a positive integer, got 0",
        ),
    ],
)
def test_configs_no_class_dspipe_computes_are_refused(family, edit, expected, tmp_path):
    from dspipe.model.hf import spec_from_hf_dir

    d, _ = family_dir(tmp_path, family)
    edit_hf_config(d, **edit)
    text = _refusal(spec_from_hf_dir, d)
    assert text.startswith(str(d)) and expected in text, text


def test_yarn_values_that_change_nothing_are_accepted(tmp_path):
    from dspipe.model.hf import spec_from_hf_dir

    d, _ = family_dir(tmp_path, "llama-yarn")
    want = spec_from_hf_dir(d)
    for extra in (
        dict(truncate=True),
        dict(mscale=1.0),
        dict(mscale_all_dim=1.0),
        dict(mscale=1.0, mscale_all_dim=0),
        dict(attention_factor=YARN4, mscale=3.0, mscale_all_dim=1.0),
        dict(beta_fast=None, beta_slow=0),
    ):
        edit_hf_config(d, rope_parameters={**YARN, "beta_fast": 8.0, "beta_slow": 2.0, **extra})
        got = spec_from_hf_dir(d)
        if "beta_fast" in extra:  # null and 0 mean transformers' defaults, 32 and 1
            assert (got.rope_beta_fast, got.rope_beta_slow) == (32.0, 1.0)
        else:
            assert got == want, extra


# ---- the command line: --init-from and generate --------------------------------------------------------------------


def test_init_from_reads_each_family_and_refuses_contradicting_architecture_flags(tmp_path, capsys):
    from dspipe.rundir import load_run

    dirs = {
        f: family_dir(tmp_path, f)[0]
        for f in ("qwen2-window-yarn-tied", "qwen3-hd16-window", "llama3-biases-hd12", "mistral-window-hd16")
    }
    capsys.readouterr()
    for family, d in dirs.items():
        out = tmp_path / f"run-{family}"
        code = run_cli(
            "gen-config",
            *CPU2,
            "--init-from",
            d,
            "--seq-len",
            "16",
            "--zero",
            "1",
            "--pp",
            "1",
            "--data",
            tmp_path / "nodata",
            "--out",
            out,
        )
        err = capsys.readouterr().err
        assert code == 0, err
        assert load_run(out).model == replace(expected_spec(family, family), seq_len=16)
    q2, q3, llama = dirs["qwen2-window-yarn-tied"], dirs["qwen3-hd16-window"], dirs["llama3-biases-hd12"]
    cases = [
        (q3, ["--head-dim", "8"], f"--head-dim 8 contradicts --init-from {q3} (head_dim 16 from its config.json)"),
        (llama, ["--qk-norm"], f"--qk-norm contradicts --init-from {llama} (qk_norm false from its "),
        (
            q3,
            ["--no-qk-norm"],
            f"--no-qk-norm contradicts --init-from {q3} (qk_norm true from its config.json); "
            f"the architecture comes from the Hugging Face model: drop --no-qk-norm",
        ),
        (q2, ["--no-qkv-bias"], f"--no-qkv-bias contradicts --init-from {q2} (qkv_bias true from its "),
        (q2, ["--rope-scaling", "none"], "--rope-scaling none contradicts"),
        (q2, ["--sliding-window", "6"], "--sliding-window 6 contradicts"),
        (llama, ["--norm", "layernorm"], "--norm layernorm contradicts"),
        (
            q2,
            [
                "--qkv-bias",
                "--no-out-bias",
                "--sliding-window",
                "5",
                "--window-start-layer",
                "1",
                "--rope-factor",
                "4",
                "--rope-beta-fast",
                "32",
            ],
            None,
        ),  # flags that agree are fine
        (llama, ["--bias"], None),
    ]  # Llama's attention_bias and mlp_bias: every projection has one
    for d, flags, expected in cases:
        code = run_cli("plan", *CPU2, "--init-from", d, *flags)
        err = capsys.readouterr().err
        if expected is None:
            assert code == 0, err
        else:
            assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{f"w{i}": i for i in range(1, V - 8)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<eos>", unk_token="<eos>")


@pytest.mark.parametrize(
    "family", ["llama3-biases-hd12", "qwen2-window-yarn-tied", "qwen3-hd16-window", "mistral-window-hd16"]
)
def test_generate_on_an_exported_directory(family, tmp_path, capsys):
    """`dspipe generate` loads an exported directory of each family with AutoModelForCausalLM and samples what
    dspipe's own model samples (greedy; a prompt longer than the window, a continuation past the context)."""
    from dspipe.model.gpt import GPT
    from dspipe.model.hf_state import hf_model
    from dspipe.tools.generate import Model, Sampling, sample

    spec = expected_spec(family, "m")
    gpt = perturb(GPT(spec, seed=4).eval(), seed=4)
    tokenizer = _tokenizer()
    d = tmp_path / "export"
    hf_model(dict(gpt.state_dict()), spec, eos_id=0, source="test").save_pretrained(d)
    tokenizer.save_pretrained(d)
    prompt = " ".join(f"w{i}" for i in (5, 17, 3, 40, 22, 9, 11, 30))
    capsys.readouterr()
    assert run_cli("generate", d, "--prompt", prompt, "--temperature", "0", "--max-tokens", "40") == 0
    text = capsys.readouterr().out.strip()
    new = sample(
        Model(logits=gpt, context=spec.seq_len, tokenizer=tokenizer),
        tokenizer.encode(prompt, add_special_tokens=False),
        sampling=Sampling(max_tokens=40, temperature=0),
    )
    assert new and text == prompt + tokenizer.decode(new), (text, new)


def test_a_qwen2_export_notes_that_auto_tokenizer_substitutes_qwen2s_tokenizer(tmp_path):
    """transformers 5 loads Qwen2Tokenizer for model_type qwen2 whatever tokenizer the directory saved; with a run's
    own byte-level BPE that splits text differently (digits one by one): export-hf says so, and dspipe's
    load_tokenizer (generate) reads the tokenizer as saved. Other model types keep the saved tokenizer."""
    from dspipe.data.tokenizer import train_bpe
    from dspipe.model.gpt import GPT
    from dspipe.model.hf_state import hf_model
    from dspipe.tools.export import PROBE_TEXT, auto_tokenizer_note, load_tokenizer

    docs = ["hello world, this is a tiny corpus of text with numbers 123 and 4567"] * 40
    bpe = train_bpe(docs, vocab_size=300)
    for family, noted in (("qwen2-window-yarn-tied", True), ("qwen3-hd16-window", False)):
        spec = replace(expected_spec(family, "m"), vocab=320)
        d = tmp_path / family
        hf_model(dict(GPT(spec, seed=0).state_dict()), spec, eos_id=0, source="test").save_pretrained(d)
        bpe.save_pretrained(d)
        note = auto_tokenizer_note(d, bpe)
        if noted:
            assert note.startswith(f"note: transformers' AutoTokenizer loads {d}'s tokenizer as Qwen2Tokenizer"), note
        else:
            assert note is None
        assert load_tokenizer(d).encode(PROBE_TEXT) == bpe.encode(PROBE_TEXT)


FAMILY_FLAGS = {  # gen-config flags of a custom model of each family (3 blocks, 32 wide, 4 heads, 2 kv heads)
    "LlamaForCausalLM": [
        "--head-dim",
        "12",
        "--bias",
        "--rope-scaling",
        "llama3",
        "--rope-factor",
        "4",
        "--rope-original-context",
        "8",
    ],
    "Qwen2ForCausalLM": [
        "--qkv-bias",
        "--sliding-window",
        "5",
        "--window-start-layer",
        "1",
        "--rope-scaling",
        "yarn",
        "--rope-factor",
        "4",
        "--rope-original-context",
        "8",
    ],
    "Qwen3ForCausalLM": ["--qk-norm", "--head-dim", "16", "--sliding-window", "6", "--untied"],
    "MistralForCausalLM": ["--sliding-window", "7", "--head-dim", "16", "--untied"],
}


@pytest.mark.parametrize("arch", list(FAMILY_FLAGS))
def test_export_hf_and_generate_from_a_dspipe_checkpoint(arch, tmp_path, corpus, capsys):
    """`dspipe export-hf` of a run of each family (a checkpoint in DeepSpeed's formats, built without a launch)
    writes the class that computes it, and `dspipe generate` continues a prompt the same from the checkpoint and
    from the export."""
    from transformers import AutoModelForCausalLM

    from dspipe.runtime import ckpt_meta
    from dspipe.tools.consolidate import load_gpt
    from tests.helpers import hand_checkpoint

    run, out = tmp_path / "run", tmp_path / "hf"
    assert (
        run_cli(
            "gen-config",
            "--layers",
            "3",
            "--hidden",
            "32",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--ffn",
            "48",
            "--vocab",
            "1024",
            "--seq-len",
            "32",
            "--norm",
            "rmsnorm",
            "--mlp",
            "swiglu",
            "--positions",
            "rope",
            "--no-bias",
            *FAMILY_FLAGS[arch],
            "--gpu",
            "cpu",
            "--gpus-per-node",
            "2",
            "--global-batch",
            "16",
            "--micro-batch",
            "4",
            "--steps",
            "6",
            "--warmup",
            "1",
            "--precision",
            "fp32",
            "--zero",
            "0",
            "--pp",
            "1",
            "--tp",
            "1",
            "--sp",
            "1",
            "--offload",
            "none",
            "--checkpointing",
            "none",
            "--data",
            corpus,
            "--out",
            run,
        )
        == 0
    ), capsys.readouterr().err
    tag = hand_checkpoint(run, seed=3)
    capsys.readouterr()
    assert run_cli("export-hf", run, "--out", out) == 0
    err = capsys.readouterr().err
    assert ("AutoTokenizer loads" in err) == (arch == "Qwen2ForCausalLM"), err  # the run's BPE, not Qwen2's
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == arch
    gpt = load_gpt(tag, meta=ckpt_meta.read_meta(tag))
    x = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (gpt(x) - hf(x).logits).abs().max().item() < TOL
    texts = []
    for source in (run, out):
        capsys.readouterr()
        assert (
            run_cli(
                "generate",
                source,
                "--prompt",
                "def main(argv):\n    return 12345",
                "--temperature",
                "0",
                "--max-tokens",
                "40",
            )
            == 0
        )
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > len("def main(argv):\n    return 12345") + 5, texts


def test_weight_headers_of_biases_and_qk_norms_are_checked(tmp_path):
    """check_weights (gen-config --init-from) knows the new tensors: a missing q bias, a k norm of the wrong width."""
    from safetensors.torch import load_file, save_file

    from dspipe.model.hf import spec_from_hf_dir
    from dspipe.model.hf_weights import check_weights

    for family, key, value, expected in (
        (
            "qwen2-window-yarn-tied",
            "model.layers.1.self_attn.q_proj.bias",
            None,
            "missing tensor model.layers.1.self_attn.q_proj.bias",
        ),
        (
            "qwen3-biases",
            "model.layers.2.self_attn.k_norm.weight",
            torch.ones(16),
            "tensor model.layers.2.self_attn.k_norm.weight has shape [16], the model needs [8]",
        ),
        (
            "llama3-biases-hd12",
            "model.layers.0.mlp.down_proj.bias",
            torch.ones(32, dtype=torch.int64),
            "tensor model.layers.0.mlp.down_proj.bias has dtype I64, not a floating-point type",
        ),
    ):
        d, _ = family_dir(tmp_path, family)
        weights = d / "model.safetensors"
        state = load_file(str(weights))
        state.pop(key) if value is None else state.update({key: value})
        save_file(state, str(weights), metadata={"format": "pt"})
        assert _refusal(check_weights, d, spec_from_hf_dir(d)) == f"{weights}: {expected}"


PUBLISHED = {  # config.json as released (transformers 4 layouts), the keys that matter
    "llama3.1-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        hidden_size=4096,
        intermediate_size=14336,
        max_position_embeddings=131072,
        num_attention_heads=32,
        num_hidden_layers=32,
        num_key_value_heads=8,
        pretraining_tp=1,
        rms_norm_eps=1e-05,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        vocab_size=128256,
        rope_scaling=dict(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
            rope_type="llama3",
        ),
    ),
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_act="silu",
        hidden_size=3584,
        intermediate_size=18944,
        max_position_embeddings=131072,
        max_window_layers=28,
        num_attention_heads=28,
        num_hidden_layers=28,
        num_key_value_heads=4,
        rms_norm_eps=1e-06,
        rope_theta=1000000.0,
        sliding_window=131072,
        tie_word_embeddings=False,
        use_sliding_window=False,
        vocab_size=152064,
    ),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        attention_bias=False,
        head_dim=128,
        hidden_act="silu",
        hidden_size=1024,
        intermediate_size=3072,
        max_position_embeddings=40960,
        max_window_layers=28,
        num_attention_heads=16,
        num_hidden_layers=28,
        num_key_value_heads=8,
        rms_norm_eps=1e-06,
        rope_scaling=None,
        rope_theta=1000000,
        sliding_window=None,
        tie_word_embeddings=True,
        use_sliding_window=False,
        vocab_size=151936,
    ),
    "mistral-7b-v0.1": dict(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        hidden_act="silu",
        hidden_size=4096,
        intermediate_size=14336,
        max_position_embeddings=32768,
        num_attention_heads=32,
        num_hidden_layers=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-05,
        rope_theta=10000.0,
        sliding_window=4096,
        tie_word_embeddings=False,
        vocab_size=32000,
    ),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_read_as_the_presets_of_the_same_name(name, tmp_path):
    """A released config.json is the preset of that name (up to the context the preset trains), and the preset
    exports to the released class."""
    from transformers import AutoConfig

    from dspipe.model.hf import function_of, spec_from_hf_dir
    from dspipe.model.hf_arch import architecture_of
    from dspipe.spec.presets import model_preset

    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED[name]))
    spec, preset = spec_from_hf_dir(tmp_path), model_preset(name)
    assert function_of(spec) == function_of(preset) and spec.num_params == preset.num_params
    assert (
        architecture_of(preset)
        == PUBLISHED[name]["architectures"][0]
        == type(AutoConfig.from_pretrained(tmp_path)).__name__.replace("Config", "ForCausalLM")
    )
