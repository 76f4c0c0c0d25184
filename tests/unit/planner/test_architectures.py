"""The planner on issue 28's architectures: FLOPs over heads x head_dim and bounded by a sliding window, AutoTP's
split widths from head_dim, a window's mask counted per windowed block on each stage where the masked kernel runs
(the CPU's; flex_attention's tiles on the GPU), and the largest new presets
planned on their clusters (no launch)."""

import math
from dataclasses import replace

import pytest

from dspipe.model.tp_split import fused_parts, split_of
from dspipe.planner.enumerate import tp_choices
from dspipe.planner.memory import activation_bytes_per_layer, micro_batch_activations, window_mask_bytes
from dspipe.planner.search import search
from dspipe.planner.summary import estimate_summary
from dspipe.planner.throughput import (
    attention_flops_per_token,
    attention_keys_per_query,
    flex_window_tiles,
    model_flops_per_token,
)
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.core import StrategyRequest
from dspipe.spec.presets import MODEL_PRESETS
from dspipe.spec.train import TrainSpec


def test_attention_flops_use_heads_times_head_dim():
    """Qwen3-32B's 64 heads of 128 are 8192 wide against a 5120 model: the attention term is 12 x 8192 x L x s/2,
    not 6Lhs with h = 5120."""
    m = MODEL_PRESETS["qwen3-32b"]
    assert m.q_width == 8192 != m.hidden
    assert attention_flops_per_token(m) == 12 * 8192 * m.layers * m.seq_len / 2
    assert model_flops_per_token(m) == 6 * 32_762_123_264 + 6 * m.layers * 8192 * m.seq_len
    gpt = MODEL_PRESETS["gpt3-175b"]  # heads x head_dim = h: the formula before head_dim existed
    assert model_flops_per_token(gpt) == 6 * gpt.num_params + 6 * gpt.layers * gpt.hidden * gpt.seq_len


def test_a_sliding_window_bounds_the_keys_per_query():
    """Mistral 7B v0.1, s 8192, window 4096: position i sees min(i, 4096) keys, 4096 - 4096^2 / (2 x 8192) = 3072 on
    average instead of causal 4096; on the GPU flex_attention computes the 128 x 128 tiles the window touches, 1584
    of them (query tile i meets min(i, 32) + 1 key tiles): 1584 x 128^2 / 8192 = 3168 keys per query; the CPU's
    dense-mask kernel (and the GPU's with attention dropout) computes all 8192; v0.3 has no window."""
    v1, v3 = MODEL_PRESETS["mistral-7b-v0.1"], MODEL_PRESETS["mistral-7b-v0.3"]
    assert attention_keys_per_query(v1, 0) == 3072
    assert flex_window_tiles(seq=8192, window=4096) == 33 * 34 // 2 + 31 * 33 == 1584
    assert attention_keys_per_query(v1, 0, kernels="cuda") == 3168
    assert attention_keys_per_query(v1, 0, kernels="cpu") == 8192
    assert attention_keys_per_query(replace(v1, dropout=0.1), 0, kernels="cuda") == 8192
    for kernels in (None, "cuda", "cpu"):
        assert attention_keys_per_query(v3, 0, kernels=kernels) == 4096
    assert attention_flops_per_token(v1) == 12 * 4096 * 32 * 3072
    exact = sum(min(i, 4096) for i in range(1, 8193)) / 8192  # the discrete mean: within 0.02%
    assert math.isclose(attention_keys_per_query(v1, 0), exact, rel_tol=2e-4)
    # a window at least the sequence is causal attention; only blocks from window_start_layer on are windowed
    assert attention_keys_per_query(replace(v1, sliding_window=8192), 0) == 4096
    later = replace(v1, window_start_layer=24)
    assert attention_flops_per_token(later) == 12 * 4096 * (24 * 4096 + 8 * 3072)


@pytest.mark.parametrize(
    "seq,window",
    [
        (8192, 4096),
        (8192, 4095),
        (8192, 4097),
        (8192, 1),
        (8192, 128),
        (8192, 129),
        (4096, 4095),
        (1000, 200),
        (64, 16),
        (131072, 4096),
    ],
)
def test_flex_tiles_are_the_tiles_the_window_touches(seq, window):
    """The closed form against a count tile by tile: query tile i (rows i x 128 ..) meets key tile j iff j <= i and
    its nearest pair, first row of i and last column of j, is inside the window."""
    t, tiles = 128, -(-seq // 128)
    touched = sum(1 for i in range(tiles) for j in range(i + 1) if i * t - (j * t + t - 1) < window)
    assert flex_window_tiles(seq=seq, window=window) == touched


def test_the_gpu_runs_fewer_window_scores_than_causal_ones():
    """Flex's tiles approach the window's own keys as the window shrinks against the sequence (w + 128 at most, the
    band's partial edge tiles computed whole): Mistral's window at s 32768 costs ~0.24 of causal attention."""
    v1 = replace(MODEL_PRESETS["mistral-7b-v0.1"], seq_len=32768)
    need, run = attention_keys_per_query(v1, 0), attention_keys_per_query(v1, 0, kernels="cuda")
    assert need < run <= need + 128 and 0.23 < run / (32768 / 2) < 0.26


def test_step_time_counts_the_kernels_work_and_mfu_the_models():
    from dspipe.planner.cost import estimate
    from dspipe.planner.plan import make_plan
    from dspipe.spec.strategy import StrategySpec

    cluster = ClusterSpec(1, 8, "h100-80g")
    train = TrainSpec(global_batch=64, micro_batch=1, steps=10, warmup_steps=1)
    est = {}
    for name in ("mistral-7b-v0.1", "mistral-7b-v0.3"):
        m = replace(MODEL_PRESETS[name], vocab=32000, rope_theta=10000.0)  # differ only by the window
        plan = make_plan(model=m, cluster=cluster, train=train, strategy=StrategySpec(zero=3, checkpointing="full"))
        est[name] = estimate(model=m, cluster=cluster, plan=plan)
    v1, v3 = est["mistral-7b-v0.1"], est["mistral-7b-v0.3"]
    assert v1.flops_per_token < v3.flops_per_token  # the window needs fewer scores
    attn = 12 * 4096 * 32
    assert math.isclose(v3.flops_per_token - v1.flops_per_token, attn * (4096 - 3072))
    # what runs on the GPU: flex_attention's 3168 keys per query against causal's 4096; full recomputation 4/3 of it
    assert math.isclose(v1.hardware_flops_per_token - v3.hardware_flops_per_token, 4 / 3 * attn * (3168 - 4096))
    assert v1.compute_s < v3.compute_s
    # the CPU's kernels (the gloo runner) run the windowed blocks' dense (s, s) mask, twice the causal scores
    cpu = ClusterSpec(1, 2, "cpu")
    for name in ("mistral-7b-v0.1", "mistral-7b-v0.3"):
        m = replace(MODEL_PRESETS[name], vocab=32000, rope_theta=10000.0, layers=2)
        small = TrainSpec(global_batch=2, micro_batch=1, steps=2, warmup_steps=1)
        plan = make_plan(model=m, cluster=cpu, train=small, strategy=StrategySpec(zero=0, checkpointing="none"))
        est[name] = estimate(model=m, cluster=cpu, plan=plan)
    v1, v3 = est["mistral-7b-v0.1"], est["mistral-7b-v0.3"]
    assert math.isclose(v1.hardware_flops_per_token - v3.hardware_flops_per_token, 12 * 4096 * 2 * (8192 - 4096))


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen3-32b", "llama3.2-3b"])
def test_autotp_splits_whole_heads_of_head_dim(name):
    """The fused q/k/v splits into heads x head_dim and 2 x kv_heads x head_dim rows (with Qwen2's biases), the
    out-projection along its heads x head_dim input features; Qwen3's q/k norm weights stay whole."""
    m = MODEL_PRESETS[name]
    hd, kv = m.head_dim, m.kv_groups
    qkv = (0, [m.heads * hd, kv * hd, kv * hd])
    assert fused_parts(m)[next(iter(fused_parts(m)))] == qkv[1] and sum(qkv[1]) == m.qkv_width
    assert split_of("h.3.attn.c_attn.weight", m) == qkv
    assert split_of("h.3.attn.c_attn.bias", m) == qkv  # a q/k/v bias, where there is one, splits with its rows
    assert split_of("h.3.attn.c_proj.weight", m) == (1, [m.q_width])
    assert split_of("h.3.attn.q_norm.weight", m) is None and split_of("h.3.attn.k_norm.weight", m) is None
    assert ("h.3.attn.c_attn.bias" in dict(m.model_tensors())) == (name == "qwen2.5-0.5b")


def test_tp_choices_divide_the_kv_heads_too():
    """Qwen2.5-0.5B: 14 heads, 2 kv heads: only tp 2 keeps whole kv heads (plan.check_rules refuses the rest)."""
    assert tp_choices(MODEL_PRESETS["qwen2.5-0.5b"], ClusterSpec(1, 8, "h100-80g")) == [1, 2]
    assert tp_choices(MODEL_PRESETS["qwen2.5-72b"], ClusterSpec(1, 8, "h100-80g")) == [1, 2, 4, 8]


def test_a_window_mask_is_counted_once_per_windowed_block_on_its_stage():
    """The CPU's masked kernel: the (s, s) mask in the activation dtype, per windowed block and micro-batch, only
    without recomputation (selective rebuilds it inside the core); blocks before window_start_layer keep none."""
    m = replace(MODEL_PRESETS["tiny-llama"], sliding_window=16, window_start_layer=1)  # 2 blocks, s 64
    kw = dict(model=m, micro_batch=2, act_bytes=2, kernels="cpu")
    plain = activation_bytes_per_layer(checkpointing="none", windowed=False, **kw)
    masked = activation_bytes_per_layer(checkpointing="none", windowed=True, **kw)
    assert masked - plain == window_mask_bytes(m, act_bytes=2) == 2 * 64 * 64
    assert activation_bytes_per_layer(checkpointing="selective", windowed=True, **kw) == activation_bytes_per_layer(
        checkpointing="selective", windowed=False, **kw
    )
    both, _ = micro_batch_activations(checkpointing="none", blocks=2, first=True, last=False, **kw)
    assert both == plain + masked + 8 * 64 * 2  # block 0 unmasked, block 1 masked, the token ids
    first, _ = micro_batch_activations(checkpointing="none", blocks=1, first=True, last=False, windowed=0, **kw)
    assert first == plain + 8 * 64 * 2
    long_window = replace(m, sliding_window=64)  # as long as the sequence: plain causal attention, no mask
    assert activation_bytes_per_layer(checkpointing="none", **{**kw, "model": long_window}) == plain


def test_flex_attention_keeps_no_window_mask_on_the_gpu():
    """kernels 'cuda': a windowed block runs flex_attention, which saves what the causal kernel saves (no (s, s)
    mask); with attention dropout it runs the masked SDPA again (flex_attention has no dropout) and keeps the mask."""
    m = replace(MODEL_PRESETS["tiny-llama"], sliding_window=16)  # s 64
    kw = dict(model=m, micro_batch=2, act_bytes=2, kernels="cuda", checkpointing="none")
    assert activation_bytes_per_layer(windowed=True, **kw) == activation_bytes_per_layer(windowed=False, **kw)
    held, _ = micro_batch_activations(blocks=2, first=False, last=False, **{**kw, "windowed": 2})
    assert held == 2 * activation_bytes_per_layer(windowed=False, **kw)
    dropout = {**kw, "model": replace(m, dropout=0.1)}
    kept = activation_bytes_per_layer(windowed=True, **dropout) - activation_bytes_per_layer(windowed=False, **dropout)
    assert kept == window_mask_bytes(m, act_bytes=2)


def _best(name, nodes, gbs):
    cluster = ClusterSpec(nodes, 8, "h100-80g")
    result = search(
        model=MODEL_PRESETS[name],
        cluster=cluster,
        request=StrategyRequest(),
        train=TrainSpec(global_batch=gbs, micro_batch=1, steps=1000, warmup_steps=10),
    )
    return result.best, estimate_summary(result.best, tokens=1e12)


def test_qwen2_5_72b_plans_on_64_h100():
    """dspipe plan --model qwen2.5-72b --nodes 8 --gpus-per-node 8 --gpu h100-80g --global-batch 512: ZeRO-1, tp 4 x
    pp 4 x dp 4 without recomputation, 84% of GPU memory (the 16-bit gradients freed as produced; keeping them,
    --no-immediate-grad-update, the plan is pp 8 at 215 days), ~206 days for 1T tokens at ~40% MFU."""
    best, s = _best("qwen2.5-72b", 8, 512)
    assert best.est.fits and best.plan.world_size == 64 and best.plan.num_params == 72_706_203_648
    assert (best.plan.zero_stage, best.plan.tp, best.plan.pp) == (1, 4, 4) and best.plan.checkpointing == "none"
    assert best.est.memory.total < 0.9 * best.est.gpu_memory_bytes
    assert 0.3 < s["mfu"] < 0.5 and 150 < s["train_days"] < 350, s


def test_llama3_1_405b_plans_on_256_h100():
    """dspipe plan --model llama3.1-405b --nodes 32 --gpus-per-node 8 --gpu h100-80g --global-batch 512: 405.9B
    parameters' states split by tp 8 inside the node x pp 16 across nodes, ZeRO-1, full recomputation of the first 5
    of each stage's 8 blocks (--recompute-blocks); ~363 days for 1T tokens (pp 32 recomputing 3 of 4 blocks, 378
    days, with the 16-bit gradients kept: --no-immediate-grad-update). ZeRO-3 over the 256 GPUs gathers the whole
    model per pass, half of it hidden (timing.ZERO3_OVERLAP), and loses."""
    best, s = _best("llama3.1-405b", 32, 512)
    assert best.est.fits and best.plan.world_size == 256 and best.plan.num_params == 405_853_388_800
    assert (best.plan.zero_stage, best.plan.tp, best.plan.pp) == (1, 8, 16) and best.plan.checkpointing == "full"
    assert best.plan.recompute_blocks == 5
    assert best.est.host_memory_bytes <= best.est.host_memory_capacity
    assert 0.25 < s["mfu"] < 0.5 and 200 < s["train_days"] < 600, s
