"""Every preset's parameter count equals its released checkpoint's, exactly.

The figures are the sums of numel over each released checkpoint's weights (a tied head counted once), i.e. the
config arithmetic of its config.json (Hugging Face repository named as the preset's source): token embedding +
layers x block (q/k/v, output and three SwiGLU projections, two RMSNorm weights, plus Qwen2's q/k/v biases and
Qwen3's two per-head norms of head_dim) + final norm + untied head. Each literal below was recomputed by hand-written
arithmetic independent of ModelSpec (e.g. Llama-3.1-8B: 128256 x 4096 x 2 + 32 x (4096 x (4096 + 2 x 1024) +
4096 x 4096 + 3 x 4096 x 14336 + 2 x 4096) + 4096 = 8,030,261,248), and agrees with the count the Hugging Face hub
reports for the checkpoint (Qwen3-0.6B: 596,049,920 with its tied head counted once)."""

import pytest

from dspipe.spec.presets import MODEL_PRESETS, PRESETS, preset_lines

PUBLISHED = {
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "qwen2.5-32b": 32_763_876_352,
    "qwen2.5-72b": 72_706_203_648,
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "qwen3-14b": 14_768_307_200,
    "qwen3-32b": 32_762_123_264,
    "mistral-7b-v0.1": 7_241_732_096,
    "mistral-7b-v0.3": 7_248_023_552,
    "mixtral-8x7b": 46_702_792_704,
    "mixtral-8x22b": 140_630_071_296,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,
    # the shapes shipped before issue 28
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "tinyllama-1.1b": 1_100_048_384,
    "gpt2-124m": 124_439_808,
    "gpt2-355m": 354_823_168,
    "gpt2-774m": 774_030_080,
    "gpt2-1.5b": 1_557_611_200,
}

ACTIVE = {  # the active parameters the releases publish (total minus the experts each token skips)
    "mixtral-8x7b": 12_879_925_248,
    "mixtral-8x22b": 39_161_468_928,
    "qwen3-30b-a3b": 3_353_032_704,
    "qwen3-235b-a22b": 22_190_763_520,
}
MOE_SHAPES = {  # vocab, hidden, layers, heads, kv heads, head_dim, expert width, experts, top-k, q/k norm (config.json)
    "mixtral-8x7b": (32000, 4096, 32, 32, 8, 128, 14336, 8, 2, False),
    "mixtral-8x22b": (32768, 6144, 56, 48, 8, 128, 16384, 8, 2, False),
    "qwen3-30b-a3b": (151936, 2048, 48, 32, 4, 128, 768, 128, 8, True),
    "qwen3-235b-a22b": (151936, 4096, 94, 64, 4, 128, 1536, 128, 8, True),
}


def _moe_counts(vocab, hidden, layers, heads, kv, hd, width, experts, k, qk_norm) -> tuple[int, int]:
    """(total, active) by hand: untied embedding and head, per layer q/k/v/o (+ two per-head norms), two RMSNorms,
    the router (experts x hidden) and the experts' three SwiGLU projections; active leaves out experts - k of them."""
    attn = hidden * (heads + 2 * kv) * hd + heads * hd * hidden + (2 * hd if qk_norm else 0)
    expert = 3 * hidden * width
    total = 2 * vocab * hidden + layers * (attn + 2 * hidden + experts * hidden + experts * expert) + hidden
    return total, total - layers * (experts - k) * expert


@pytest.mark.parametrize("name", list(ACTIVE))
def test_moe_total_and_active_counts_are_the_published_ones(name):
    assert _moe_counts(*MOE_SHAPES[name]) == (PUBLISHED[name], ACTIVE[name])
    spec = MODEL_PRESETS[name]
    assert (spec.num_params, spec.active_params) == (PUBLISHED[name], ACTIVE[name])
    assert PRESETS[name].published_active == ACTIVE[name]
    assert spec.sparse_layers == tuple(range(spec.layers)) and spec.router_norm_topk and not spec.shared_experts


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_count_is_the_released_checkpoints(name):
    assert MODEL_PRESETS[name].num_params == PUBLISHED[name]
    assert PRESETS[name].published_params == PUBLISHED[name]


def test_every_released_preset_has_its_count_and_a_source():
    released = {n for n, p in PRESETS.items() if p.published_params is not None}
    assert released == set(PUBLISHED)
    assert all(p.source and "\n" not in p.source for p in PRESETS.values())
    assert {n: PRESETS[n].source for n in ("llama3.1-405b", "qwen2.5-72b", "qwen3-0.6b", "mistral-7b-v0.1")} == {
        "llama3.1-405b": "meta-llama/Llama-3.1-405B",
        "qwen2.5-72b": "Qwen/Qwen2.5-72B",
        "qwen3-0.6b": "Qwen/Qwen3-0.6B-Base",
        "mistral-7b-v0.1": "mistralai/Mistral-7B-v0.1",
    }


def test_the_architecture_of_each_family_is_its_config_json():
    l31, l32 = MODEL_PRESETS["llama3.1-8b"], MODEL_PRESETS["llama3.2-1b"]
    assert (
        l31.rope_scaling,
        l31.rope_factor,
        l31.rope_low_freq_factor,
        l31.rope_high_freq_factor,
        l31.rope_original_context,
        l31.rope_theta,
    ) == ("llama3", 8.0, 1.0, 4.0, 8192, 500000.0)
    assert (l32.rope_factor, l32.tied_embeddings, l31.tied_embeddings) == (32.0, True, False)
    assert all(MODEL_PRESETS[n].seq_len == 8192 for n in PUBLISHED if n.startswith(("llama3.", "mistral")))
    q2, q3 = MODEL_PRESETS["qwen2.5-72b"], MODEL_PRESETS["qwen3-32b"]
    assert q2.biases == (True, False, False) and not q2.qk_norm and q2.rope_theta == 1e6
    assert q3.biases == (False, False, False) and q3.qk_norm and q3.head_dim == 128 and q3.q_width == 8192
    assert [n for n in PUBLISHED if n.startswith("qwen") and MODEL_PRESETS[n].tied_embeddings] == [
        "qwen2.5-0.5b",
        "qwen2.5-1.5b",
        "qwen3-0.6b",
        "qwen3-1.7b",
        "qwen3-4b",
    ]
    v1, v3 = MODEL_PRESETS["mistral-7b-v0.1"], MODEL_PRESETS["mistral-7b-v0.3"]
    assert (v1.sliding_window, v1.window_of(0), v1.vocab) == (4096, 4096, 32000)
    assert (v3.sliding_window, v3.vocab, v3.rope_theta) == (None, 32768, 1e6)


def test_presets_command_lists_each_preset_with_its_source():
    from click.testing import CliRunner

    from dspipe.cli.model import presets

    r = CliRunner().invoke(presets, [])
    assert r.exit_code == 0 and r.output.splitlines()[:-1] == preset_lines()
    line = next(x for x in preset_lines() if x.startswith("qwen3-0.6b "))
    assert "596.0M" in line and "hd128 qk-norm" in line and line.endswith("[Qwen/Qwen3-0.6B-Base]")
    assert r.output.splitlines()[-1].startswith("deepspeed presets: ")
