"""Planner, mixture of experts: active-parameter FLOPs, expert parameters split over ep and their ZeRO states over
dp / ep, the MoE layer's activations and all-to-alls, the ep axis of the search, the refusals before launch."""

import json
import re
import time

import pytest

from dspipe.errors import SpecError
from dspipe.planner.cost import estimate
from dspipe.planner.memory import (
    activation_bytes_per_layer,
    expert_grads_kept,
    micro_batch_activations,
    moe_mlp_activation_bytes,
    routed_rows,
)
from dspipe.planner.plan import make_plan
from dspipe.planner.search import search
from dspipe.planner.stages import stage_layer_weights, stage_params
from dspipe.planner.throughput import attention_flops_per_token, model_flops_per_token
from dspipe.planner.timing import EXPERT_CALL_S, expert_calls_s, zero3_gathers_per_pass
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.core import StrategyRequest
from dspipe.spec.presets import MODEL_PRESETS, PRESETS, model_preset
from dspipe.spec.strategy import StrategySpec
from dspipe.spec.train import TrainSpec
from tests.helpers import dspipe, error_lines

MOE = [name for name, m in MODEL_PRESETS.items() if m.experts]


def _plan(model, *, nodes=1, gpus=8, gbs=64, mb=1, precision="bf16", **strategy):
    cluster = ClusterSpec(nodes, gpus, "h100-80g")
    train = TrainSpec(global_batch=gbs, micro_batch=mb, steps=100, warmup_steps=10, precision=precision)
    plan = make_plan(model=model, cluster=cluster, train=train, strategy=StrategySpec(**strategy))
    return plan, estimate(model=model, cluster=cluster, plan=plan)


def test_the_four_moe_presets_are_planned():
    assert sorted(MOE) == ["mixtral-8x22b", "mixtral-8x7b", "qwen3-235b-a22b", "qwen3-30b-a3b"]


@pytest.mark.parametrize("name", MOE)
def test_flops_count_the_active_parameters(name):
    m = MODEL_PRESETS[name]
    published = PRESETS[name].published_active
    assert m.active_params == published < m.num_params
    assert model_flops_per_token(m) == 6 * published + attention_flops_per_token(m)
    plan, est = _plan(m, gpus=8, zero=1, ep=8)
    assert est.flops_per_token == 6 * published + attention_flops_per_token(m)  # the MFU numerator
    assert est.active_params == published and plan.num_params == m.num_params
    # dspipe.runtime.dispatch executes the routed rows' FLOPs and no more: no dispatch matmuls, no padding
    assert est.hardware_flops_per_token == pytest.approx(est.flops_per_token)


def test_dense_flops_and_dispatch_unchanged():
    m = MODEL_PRESETS["llama2-7b"]
    assert m.active_params == m.num_params
    assert model_flops_per_token(m) == 6 * m.num_params + attention_flops_per_token(m)


def test_pipeline_layer_weights_count_each_blocks_own_parameters():
    m = MODEL_PRESETS["mixtral-8x7b"]
    weights = stage_layer_weights(m)
    assert weights[1:-2] == [m.layer_params(i) for i in range(m.layers)]
    assert sum(weights) == m.num_params  # untied head
    assert stage_params(model=m, pp=1, partition_method="parameters") == (m.num_params,)


@pytest.mark.parametrize("pp, ep", [(2, 1), (2, 2), (4, 8), (8, 4)])
def test_a_pipeline_stage_holds_its_own_blocks_experts_over_ep(pp, ep):
    """Each stage's rank holds the dense parameters of its layers and experts / ep of its own sparse blocks: the
    stages add up to the pp 1 rank's count (an untied head: nothing is held twice); the ZeRO groups of a stage's
    parameters split them the same way, and its start-up draws only those experts."""
    from dspipe.planner.stages import param_groups, stage_elements, stage_experts, stage_sparse_blocks

    m = MODEL_PRESETS["mixtral-8x7b"]
    whole = stage_params(model=m, pp=1, partition_method="parameters", ep=ep)[0]
    stages = stage_params(model=m, pp=pp, partition_method="parameters", ep=ep)
    experts = stage_experts(model=m, pp=pp, partition_method="parameters", ep=ep)
    blocks = stage_sparse_blocks(model=m, pp=pp, partition_method="parameters")
    assert sum(stages) == whole and sum(experts) == m.routed_expert_params // ep and sum(blocks) == m.layers
    assert experts == tuple(b * m.experts // ep * m.expert_params for b in blocks)
    assert stage_elements(m, pp, "parameters", 1, ep) == stages  # tp 1: a stage's rank draws what it holds
    plan, _ = _plan(m, nodes=pp, gpus=8, zero=1, pp=pp, ep=ep)
    for phi, held in zip(stages, experts, strict=True):
        assert param_groups(model=m, plan=plan, phi=phi) == [(phi - held, plan.dp), (held, plan.dp // ep)]


def test_the_busiest_stage_is_weighed_by_its_active_parameters():
    """A sparse block's FLOPs per token are its active parameters' (k of its experts), not every expert's: Mixtral's
    32 identical blocks over 4 stages leave the busiest stage (8 blocks and the head) far less than 1 / 4 + the
    expert share a count of every expert would give."""
    from dspipe.planner.stages import slowest_stage_share

    m = MODEL_PRESETS["mixtral-8x7b"]
    share = slowest_stage_share(model=m, pp=4, partition_method="type:Block")
    block = 6 * (m.layer_params(0) - (m.experts - m.experts_per_token) * m.expert_params)
    head = 6 * m.vocab * m.hidden
    assert share == pytest.approx((8 * block + head) / (32 * block + head + 6 * m.final_norm_params), rel=1e-2)


@pytest.mark.parametrize("zero", [1, 2])
def test_memory_falls_with_ep_as_the_formula_says(zero):
    # Phi_d = dense parameters (over dp), Phi_e = routed experts / ep (over dp / ep): params b(Phi_d + Phi_e),
    # optimizer 12 Phi_d / dp + 12 Phi_e / (dp / ep)
    m = model_preset("mixtral-8x7b", seq_len=4096)
    dp, routed = 8, m.routed_expert_params
    dense = m.num_params - routed
    totals = []
    for ep in (1, 2, 4, 8):
        plan, est = _plan(m, gpus=dp, zero=zero, ep=ep, checkpointing="full")
        mine = routed // ep
        assert plan.ep == ep and plan.expert_dp == dp // ep
        assert est.memory.params == 2 * (dense + mine)
        assert est.memory.optimizer == 12 * dense // dp + 12 * mine // (dp // ep)
        assert est.memory.model_states == (
            2 * (dense + mine) + (4 * (dense + mine) if zero == 1 else 0) + 12 * dense // dp + 12 * mine // (dp // ep)
        )
        totals.append(est.memory.total)
    assert totals == sorted(totals, reverse=True) and totals[0] > 1.5 * totals[-1]


@pytest.mark.parametrize("name, kept", [("qwen3-30b-a3b", False), ("mixtral-8x7b", True)])
def test_zero2_live_expert_gradients_only_for_tensors_past_the_bucket(name, kept):
    # bf16 (fp32 gradient accumulation): a bucketed expert gradient is reduced into the fp32 partition and not kept
    # in 16 bits (Qwen3-30B's 2048 x 1536 experts fit the h x h bucket, Mixtral's 4096 x 28672 do not); fp32 keeps
    # every gradient of the partition. The dense ones are charged as a dense model's.
    m = model_preset(name, seq_len=4096)
    dp, ep = 8, 8
    routed = m.routed_expert_params
    dense, mine = m.num_params - routed, routed // ep
    plan, est = _plan(m, gpus=dp, zero=2, ep=ep, checkpointing="full")
    grads_kept, whole = expert_grads_kept(model=m, reduce_bucket_size=plan.reduce_bucket_size)
    assert grads_kept == (whole if kept else 0)
    experts = 2 * mine // (dp // ep) if kept else 0
    assert est.memory.grads == (
        2 * dense // dp + experts + 2 * 2 * plan.reduce_bucket_size + 4 * dense // dp + 4 * mine // (dp // ep)
    )
    plan, est = _plan(m, gpus=dp, zero=2, ep=ep, checkpointing="full", precision="fp32")
    assert est.memory.grads == 4 * dense // dp + 4 * mine // (dp // ep) + 2 * 4 * plan.reduce_bucket_size


def test_moe_activations_follow_the_documented_formula():
    """Every layout's experts run through dspipe.runtime.dispatch: k T routed rows (no masks, no padding), each its
    input, hidden activations, output and weighted output, its index and weight; the router's top-k indices and
    weights; in 16-bit the router weight's fp32 copy, less the block's 16-bit norm output (not kept)."""
    m = model_preset("qwen3-30b-a3b", seq_len=1024)
    tokens, b, k = 1024, 2, m.experts_per_token
    routes, h, f = k * tokens, m.hidden, m.expert_width
    assert routed_rows(model=m, tokens=tokens) == routes
    router = 8 * tokens * m.experts + 4 * tokens * h + 4 * m.experts * h - b * tokens * h
    want = router + routes * (b * (3 * h + 4 * f) + 8 + b) + 12 * routes
    assert moe_mlp_activation_bytes(model=m, tokens=tokens, act_bytes=b) == want
    dense = activation_bytes_per_layer(model=m, micro_batch=1, checkpointing="none", act_bytes=b)
    sparse = activation_bytes_per_layer(model=m, micro_batch=1, checkpointing="none", act_bytes=b, sparse=True)
    assert sparse - dense == want - tokens * b * 4 * m.ffn  # the dense MLP's hidden activations replaced
    copy = 4 * m.experts * h  # the one term that does not grow with the tokens: linear in the tokens
    assert moe_mlp_activation_bytes(model=m, tokens=2 * tokens, act_bytes=b) - copy == 2 * (want - copy)
    # a capacity factor cf keeps at most C = ceil(T / E x cf x k) routes per expert: E x C rows at most
    for cf, rows in ((1.0, tokens * k), (0.5, tokens * k // 2), (2.0, tokens * k)):
        assert routed_rows(model=model_preset("qwen3-30b-a3b", seq_len=1024, capacity_factor=cf), tokens=tokens) == rows


def test_expert_parallel_backward_holds_the_exchange_buffers():
    """At ep > 1 a sparse block's backward holds the gradients of the rows its all-to-all-v sent and received
    (2 b x k T x h) at once; nothing at ep 1, nothing kept between forward and backward."""
    m = model_preset("qwen3-30b-a3b", seq_len=1024)
    for checkpointing in ("none", "full"):
        kw = dict(model=m, micro_batch=1, checkpointing=checkpointing, act_bytes=2, blocks=4, first=False, last=False)
        held1, work1 = micro_batch_activations(**kw, sparse=4, ep=1)
        held8, work8 = micro_batch_activations(**kw, sparse=4, ep=8)
        assert held1 == held8 and work8 - work1 == 2 * 2 * (8 * 1024) * m.hidden, checkpointing
        assert micro_batch_activations(**kw, sparse=0, ep=8) == micro_batch_activations(**kw, sparse=0, ep=1)


def test_zero3_runs_the_models_own_experts_no_dispatch_masks_no_padding():
    """Under ZeRO-3 the experts are the model's own SparseMLP (dspipe.runtime.experts.native_layer): each expert
    runs on the tokens routed to it, k T rows in all however unbalanced, no (tokens, E, C) masks, no padded slots,
    no all-to-alls, no dispatch FLOPs; ZeRO-3 gathers each expert's two projections as modules of their own."""
    m = model_preset("qwen3-30b-a3b", seq_len=1024)
    plan, est = _plan(m, gpus=8, zero=3, ep=1, checkpointing="none")
    assert est.hardware_flops_per_token == pytest.approx(est.flops_per_token)  # no einsum, no padding
    _, native = _plan(m, gpus=8, zero=2, ep=1, checkpointing="none")  # DeepSpeed's layer: the same dispatch
    assert est.memory.activations == native.memory.activations
    # ZeRO-3's module gathers per pass: a dense block's 4 linears; a sparse block's attention (2), 2 per expert and
    # the router when it is past the persistence threshold (128 x 2048 here), plus embeddings and head
    threshold = plan.param_persistence_threshold
    router = 1 if m.experts * m.hidden >= threshold else 0
    assert zero3_gathers_per_pass(m, threshold=threshold) == m.layers * (2 + 2 * m.experts + router) + 3
    dense = MODEL_PRESETS["llama2-7b"]
    assert zero3_gathers_per_pass(dense, threshold=10 * dense.hidden) == 4 * dense.layers + 3


def test_expert_calls_cost_their_launches_where_the_experts_are_small():
    """On a GPU each expert's pass takes at least EXPERT_CALL_S (fitted to the H200 bench of docs/benchmarks.md:
    the model's own loop over 32 experts of 1024, 699.8 ms per step measured; the same bench on DeepSpeed's layer,
    947.5 ms, within 25%); nothing where the experts' own GEMMs take longer (Mixtral's), or on CPU ranks."""
    bench = model_preset(
        "tiny-llama", layers=4, hidden=1024, heads=16, kv_heads=4, ffn=2816, vocab=32000, seq_len=2048, experts=32,
        experts_per_token=4, expert_ffn=1024,
    )  # fmt: skip
    cluster = ClusterSpec(1, 1, "h200")
    train = TrainSpec(global_batch=16, micro_batch=4, steps=100, warmup_steps=10, precision="bf16")
    strategy = dict(ep=1, checkpointing="none")
    plan = make_plan(model=bench, cluster=cluster, train=train, strategy=StrategySpec(zero=3, **strategy))
    step = estimate(model=bench, cluster=cluster, plan=plan).step_time_s
    assert abs(step - 0.6998) < 0.05 * 0.6998, step  # the measured step, which the constant was fitted to
    # DeepSpeed's layer runs the same dispatch (its einsum one, 947.5 ms on this bench, no longer runs): the same
    # rows and calls, the same step but for ZeRO-2's communication
    native = make_plan(model=bench, cluster=cluster, train=train, strategy=StrategySpec(zero=2, **strategy))
    achieved = cluster.gpu_type.compute_tflops("bf16") * 1e12
    step = estimate(model=bench, cluster=cluster, plan=native).step_time_s
    assert abs(step - 0.6998) < 0.05 * 0.6998, step
    cpu = ClusterSpec(1, 2, "cpu").gpu_type
    assert expert_calls_s(model=bench, plan=plan, gpu=cpu, tokens=8192, achieved=achieved) == 0
    calls = len(bench.sparse_layers) * bench.experts * 2  # forward and backward, no recomputation
    assert expert_calls_s(model=bench, plan=plan, gpu=cluster.gpu_type, tokens=8192, achieved=achieved) == (
        pytest.approx(calls * EXPERT_CALL_S, rel=0.05)
    )
    mixtral = model_preset("mixtral-8x7b", seq_len=32768)  # 8,192 rows per expert: its GEMMs outlast the launches
    h100 = ClusterSpec(1, 8, "h100-80g").gpu_type
    assert expert_calls_s(model=mixtral, plan=plan, gpu=h100, tokens=32768, achieved=achieved) == 0


def test_all_to_alls_cost_nothing_at_ep_1_and_leave_nvlink_beyond_a_node():
    m = model_preset("mixtral-8x7b", seq_len=4096)
    _, one = _plan(m, nodes=2, gpus=8, zero=2, ep=1, checkpointing="full")
    _, inside = _plan(m, nodes=2, gpus=8, zero=2, ep=8, checkpointing="full")
    _, dense = _plan(MODEL_PRESETS["llama2-7b"], nodes=2, gpus=8, zero=2)
    assert one.ep_comm_s == 0 == dense.ep_comm_s and inside.ep_comm_s > 0
    q = model_preset("qwen3-30b-a3b", seq_len=4096)
    _, near = _plan(q, nodes=4, gpus=8, zero=2, ep=8, checkpointing="full")
    _, far = _plan(q, nodes=4, gpus=8, zero=2, ep=16, checkpointing="full")
    assert far.ep_comm_s > 3 * near.ep_comm_s  # the ep 16 group spans two nodes: the network, not NVLink


@pytest.mark.parametrize(
    "strategy, precision, message",
    [
        (
            dict(zero=1, tp=2, ep=4, gpus=2),
            "bf16",
            "ep 4 = tp 2 x 2 does not divide into dp 1 = world 2 / (pp 1 x tp 2 x sp 1): an expert-parallel group is "
            "2 whole tp groups of neighbouring data-parallel ranks (dp % 2 = 1)",
        ),
        (
            dict(zero=1, tp=2, tp_sp=False),
            "bf16",
            "tp 2 with experts 8 and --no-tp-sp: each tp rank would run every token through the replicated experts",
        ),
        (dict(zero=1, sp=2), "bf16", "sp 2 with experts 8: dspipe trains mixture-of-experts models with sp 1 only"),
        (  # the layout's own refusal first, not that ep 4 / tp 2 does not divide dp 1
            dict(zero=1, tp=2, ep=4, sp=2, gpus=4),
            "bf16",
            "sp 2 with experts 8: dspipe trains mixture-of-experts models with sp 1 only",
        ),
        (dict(zero=1), "fp16", "fp16 with experts 8: dspipe trains mixture-of-experts models in bf16 or fp32 only"),
        (dict(zero=1, ep=3), "bf16", "ep 3 does not divide experts 8"),
        (dict(zero=1, ep=4), "bf16", "ep 4 does not divide dp 2 = world 2 / (pp 1 x tp 1 x sp 1)"),
        (
            dict(zero=0, ep=2),
            "bf16",
            "ep 2 under ZeRO-0 with experts 8: DeepSpeed 0.19.8 clips by a gradient norm that is not the model's",
        ),
    ],
)
def test_unsupported_moe_layouts_are_refused(strategy, precision, message):
    with pytest.raises(SpecError) as e:
        _plan(MODEL_PRESETS["mixtral-8x7b"], precision=precision, **{"gpus": 2, **strategy})
    assert message in str(e.value)


def test_ep_on_a_dense_model_is_refused():
    with pytest.raises(SpecError, match=r"ep 2 needs a mixture-of-experts model: gpt2-124m is dense \(experts 0\)"):
        _plan(MODEL_PRESETS["gpt2-124m"], gpus=2, zero=1, ep=2)


def test_refusals_are_one_line_exit_2_nothing_written(tmp_path):
    out = tmp_path / "run"
    for flags, message in (
        (("--ep", "3"), "ep 3 does not divide experts 8"),
        (("--zero", "0", "--ep", "2"), "ep 2 under ZeRO-0 with experts 8"),
    ):
        r = dspipe(
            "gen-config",
            "--model",
            "mixtral-8x7b",
            "--data",
            "none",
            "--nodes",
            "1",
            "--gpus-per-node",
            "2",
            "--global-batch",
            "64",
            "--out",
            out,
            *flags,
        )
        assert r.returncode == 2 and len(error_lines(r)) == 1 and message in error_lines(r)[0], r.stderr
        assert not out.exists()


def test_qwen3_235b_on_1024_gpus_answers_quickly_and_names_its_axes():
    m = MODEL_PRESETS["qwen3-235b-a22b"]
    start = time.perf_counter()
    r = search(
        model=m,
        cluster=ClusterSpec(128, 8, "h100-80g"),
        train=TrainSpec(global_batch=2048, micro_batch=1, steps=100, warmup_steps=10),
        request=StrategyRequest(),
    )
    seconds = time.perf_counter() - start
    assert seconds < 6, seconds  # ~0.5 s on the 2-core machine (benchmarks/plan_speed.py); loose for CI noise
    best = r.best
    # one expert per rank and block: on a GPU each expert's call costs at least EXPERT_CALL_S (Python launches),
    # which ep 8 (16 experts per rank) pays 16 times per block. With the experts over 32 whole tp groups of 4 (ep 128
    # = tp 4 x 32: DeepSpeed's layer at tp > 1) each rank routes a quarter of the sequence and holds a quarter of the
    # attention: no pipeline bubble, micro 8, ZeRO-2. ZeRO-1 with 8 stages at tp 1 (the plan before ep could span tp
    # groups) is within 2% but holds 87% of the GPU (ties go to the roomier plan)
    assert best is not None and (best.plan.tp, best.plan.pp, best.plan.ep, best.plan.dp) == (4, 1, 128, 256), (
        best.describe()
    )
    assert best.plan.sp == 1 and best.plan.zero_stage == 2 and best.plan.expert_dp == 8
    line = best.describe(every_axis=True)
    for axis in ("ep 128", "tp 4", "pp 1", "dp 256"):
        assert axis in line
    ep8 = r.rejected["ep 8"]  # slower, or within 2% and the tie-break's loser
    assert (ep8.startswith("slower by") or "a tie (within 2%)" in ep8) and "ep 8," in ep8, ep8
    # every ep not chosen and ZeRO-3 are explained: ZeRO-3 at tp 4 x ep 128 (each rank its expert of every block,
    # partitioned over its 8 expert-data-parallel ranks; the dense parts' tp shards over 256 ranks of 128 nodes, one
    # NIC per GPU beyond 32 nodes, half hidden by the prefetch) is slower by its gathers
    for ep in (1, 2, 4, 8, 16, 32, 64, 128):
        assert ep == best.plan.ep or f"ep {ep}" in r.rejected
    zero3 = r.rejected["ZeRO-3"]
    pattern = r"slower by \d+% at best \(ZeRO-3, bf16, pp 1, tp 4, ep 128, dp 256, .*: its dp comm "
    assert re.match(pattern, zero3), zero3
    for other in ("ZeRO-1", "tp 1", "tp 2"):
        assert "slower by" in r.rejected[other] or "a tie (within 2%)" in r.rejected[other], r.rejected[other]


@pytest.mark.parametrize(
    "name, nodes, seq_len",
    [("mixtral-8x7b", 2, None), ("mixtral-8x22b", 8, 4096), ("qwen3-30b-a3b", 1, None), ("qwen3-235b-a22b", 16, None)],
)
def test_each_moe_preset_plans_on_a_sensible_cluster(name, nodes, seq_len):
    # mixtral-8x22b at 4,096 tokens: at its 65,536-token context it plans only with CPU offload
    m = MODEL_PRESETS[name] if seq_len is None else model_preset(name, seq_len=seq_len)
    r = search(
        model=m,
        cluster=ClusterSpec(nodes, 8, "h100-80g"),
        train=TrainSpec(global_batch=64 * nodes * 8 // 8, micro_batch=1, steps=100, warmup_steps=10),
        request=StrategyRequest(),
    )
    p = r.best.plan
    assert r.best.est.fits and p.experts == m.experts and m.experts % p.ep == 0
    # ep over data-parallel ranks, or over k whole tp groups of neighbouring data-parallel ranks (k = 1: the tp group)
    assert p.dp % p.ep == 0 if p.tp == 1 else (p.ep == 1 or (p.ep % p.tp == 0 and p.dp % (p.ep // p.tp) == 0))
    # experts spread over ep ranks on DeepSpeed's layer, over pipeline stages (each its blocks'), or all of them on
    # every rank under ZeRO-3 (the model's own)
    assert p.ep > 1 or p.pp > 1 or p.zero_stage == 3, r.best.describe()
    assert 0 < r.best.mfu < 0.6


def test_ep_is_pinned_by_the_flag_and_carried_in_the_json(tmp_path):
    r = dspipe(
        "plan",
        "--model",
        "mixtral-8x7b",
        "--seq-len",
        "4096",
        "--nodes",
        "1",
        "--gpus-per-node",
        "8",
        "--global-batch",
        "64",
        "--ep",
        "4",
        "--pp",
        "1",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    m = model_preset("mixtral-8x7b", seq_len=4096)
    assert (s["ep"], s["expert_dp"], s["experts"], s["dp"]) == (4, 2, 8, 8)
    assert (s["num_params"], s["active_params"]) == (m.num_params, m.active_params)
    assert s["step_time_breakdown_s"]["ep_comm"] > 0
    out = tmp_path / "run"
    r = dspipe(
        "gen-config",
        "--model",
        "mixtral-8x7b",
        "--seq-len",
        "4096",
        "--data",
        "none",
        "--nodes",
        "1",
        "--gpus-per-node",
        "8",
        "--global-batch",
        "64",
        "--ep",
        "4",
        "--pp",
        "1",
        "--out",
        out,
    )
    assert r.returncode == 0, r.stderr
    assert "| ep 4 (experts 8 / ep 4 = 2 per rank, expert dp 2) |" in r.stdout
    spec = json.loads((out / "dspipe.json").read_text())
    assert spec["plan"]["ep"] == 4 and spec["plan"]["experts"] == 8 and spec["estimate"]["ep"] == 4
    from dspipe.rundir import load_run

    run = load_run(out)  # the plan's ep and experts check against the specs beside them
    assert run.plan.ep == 4 and run.plan.expert_dp == 2
    spec["plan"]["ep"] = 2
    (out / "dspipe.json").write_text(json.dumps(spec))
    with pytest.raises(SpecError, match="plan.ep 2 disagrees with strategy.ep 4"):
        load_run(out)


def test_dense_presets_search_only_ep_1():
    r = search(
        model=MODEL_PRESETS["gpt2-124m"],
        cluster=ClusterSpec(1, 8, "h100-80g"),
        train=TrainSpec(global_batch=64, micro_batch=1, steps=100, warmup_steps=10),
        request=StrategyRequest(),
    )
    assert r.best.plan.ep == 1 and r.best.plan.experts == 0 and not any(k.startswith("ep ") for k in r.rejected)
    assert "ep" not in r.best.describe(every_axis=True).replace("step", "")


def test_nothing_fits_at_a_pinned_ep_suggests_ep_auto():
    r = dspipe(
        "plan",
        "--model",
        "qwen3-235b-a22b",
        "--nodes",
        "128",
        "--global-batch",
        "2048",
        "--ep",
        "8",
        "--pp",
        "1",
        "--tp",
        "1",
        "--zero",
        "2",
    )
    assert r.returncode == 2 and len(error_lines(r)) == 1, r.stderr
    line = error_lines(r)[0]
    assert "closest is ZeRO-2, bf16, pp 1, ep 8, dp 1024" in line and "would fit with: --ep auto" in line


@pytest.mark.parametrize(
    "zero, ep, contiguous", [(0, 1, False), (1, 1, False), (1, 2, True), (2, 1, True), (2, 2, True)]
)
def test_zero1_with_ep_renders_contiguous_gradients(zero, ep, contiguous):
    """DeepSpeed 0.19.8's ZeRO-1 trains an expert-parallel model off ep 1 unless its gradients are contiguous
    (measured on 2 ranks; the runner refuses the other setting): the plan turns it on there and nowhere else new."""
    plan, _ = _plan(model_preset("tiny", experts=8), gpus=2, gbs=8, zero=zero, ep=ep)
    assert plan.contiguous_gradients is contiguous


def test_a_rejected_plan_names_the_term_it_loses_on():
    """explain.widest_gap: the step-time term by which a losing plan exceeds the chosen one most, in its line."""
    from dataclasses import replace

    from dspipe.planner.explain import widest_gap

    _, chosen = _plan(MODEL_PRESETS["mixtral-8x7b"], gpus=8, zero=2, ep=8, checkpointing="full")
    slower = replace(chosen, dp_comm_s=chosen.dp_comm_s + 5.0, bubble_s=chosen.bubble_s + 1.0)
    assert widest_gap(chosen, slower) == f": its dp comm {slower.dp_comm_s:.3g} s against {chosen.dp_comm_s:.3g} s"
    assert widest_gap(chosen, chosen) == ""  # nothing lost: nothing named


def test_tensor_parallel_experts_are_whole_on_every_tp_rank_and_their_gradients_all_reduced():
    """tp 2 (sequence parallel): the attention split, a sparse block's MLP whole on both ranks; each micro-batch's
    backward all-reduces the sparse MLPs' gradients over the pair, which the step time counts."""
    from dspipe.planner.stages import tp_split_params_per_block

    m = MODEL_PRESETS["mixtral-8x7b"]
    whole = stage_params(model=m, pp=1, partition_method="parameters", tp=1)[0]
    halved = stage_params(model=m, pp=1, partition_method="parameters", tp=2)[0]
    attention = tp_split_params_per_block(m, 0)
    assert attention == tp_split_params_per_block(m) - 3 * m.hidden * m.ffn  # a dense block's MLP is split too
    vocab = 2 * m.vocab * m.hidden // 2  # the embedding's and the untied head's halves
    assert whole - halved == m.layers * attention // 2 + vocab
    assert halved > m.routed_expert_params  # every expert on each tp rank
    plan, est = _plan(m, nodes=2, gpus=8, zero=3, tp=2, checkpointing="full")
    assert plan.tp_sp and plan.ep == 1
    nvlink = ClusterSpec(2, 8, "h100-80g").gpu_type.intra_node_gbps * 1e9
    grads = 2 * (2 - 1) / 2 * m.sparse_mlp_params * 2 / nvlink  # bf16 gradients, every block sparse
    assert plan.grad_accum * m.layers * grads < est.tp_comm_s < 1.5 * plan.grad_accum * m.layers * grads


def test_experts_spread_over_the_tp_group():
    """At tp > 1 the experts can be spread over the tp group itself (ep = tp: dspipe.runtime.experts.folded): each
    tp rank holds E / tp of them, its ZeRO partitions over dp (its replicas, as a tp shard's), the all-to-alls inside
    the tp group, and no per-tensor tp all-reduce of their gradients; the search tries ep 1 and ep = tp there."""
    from dspipe.planner.enumerate import ep_choices
    from dspipe.planner.stages import param_groups

    m = MODEL_PRESETS["mixtral-8x7b"]
    assert ep_choices(m, 4, tp=2) == [1, 2, 4, 8] and ep_choices(m, 3, tp=2) == [1, 2] and ep_choices(m, 4, tp=3) == [1]
    assert 8 in ep_choices(m, 8)
    whole, e1 = _plan(m, gpus=8, zero=1, tp=2, ep=1, tp_sp=True, checkpointing="full")
    spread, e2 = _plan(m, gpus=8, zero=1, tp=2, ep=2, tp_sp=True, checkpointing="full")
    held = stage_params(model=m, pp=1, partition_method=spread.partition_method, tp=2, ep=2)[0]
    assert held == stage_params(model=m, pp=1, partition_method=whole.partition_method, tp=2)[0] - (
        m.routed_expert_params // 2
    )
    assert [n for _, n in param_groups(model=m, plan=spread, phi=held)] == [4, 4]  # both over dp
    assert e2.memory.params < e1.memory.params and e2.tp_comm_s < e1.tp_comm_s and e2.ep_comm_s > 0 == e1.ep_comm_s
    with pytest.raises(SpecError, match="so ep must be 1 or a multiple of tp = 2; ep % tp = 1"):
        _plan(m, gpus=8, zero=1, tp=2, ep=3, tp_sp=True)


def test_experts_over_several_tp_groups():
    """At ep = tp x k (k > 1: dspipe.runtime.experts.beyond_tp) each rank holds E / ep experts, their ZeRO state
    partitioned over dp / k expert-data-parallel ranks, the all-to-alls over ep consecutive ranks (k tp groups), no
    tp all-reduce of their gradients; the report names the span."""
    from dspipe.planner.stages import param_groups
    from dspipe.planner.summary import _ep_span

    m = MODEL_PRESETS["mixtral-8x7b"]
    spread, e2 = _plan(m, gpus=8, zero=1, tp=2, ep=2, tp_sp=True, checkpointing="full")
    over, e4 = _plan(m, gpus=8, zero=1, tp=2, ep=4, tp_sp=True, checkpointing="full")
    assert (over.dp, over.expert_dp, spread.expert_dp) == (4, 2, 4)
    held = stage_params(model=m, pp=1, partition_method=over.partition_method, tp=2, ep=4)[0]
    assert held == stage_params(model=m, pp=1, partition_method=spread.partition_method, tp=2, ep=2)[0] - (
        m.routed_expert_params // 4
    )
    assert [n for _, n in param_groups(model=m, plan=over, phi=held)] == [4, 2]  # dense over dp, experts over dp / 2
    assert e4.memory.params < e2.memory.params and e4.tp_comm_s == e2.tp_comm_s and e4.ep_comm_s > e2.ep_comm_s
    assert [_ep_span(tp=t, ep=e) for t, e in ((1, 4), (2, 1), (2, 2), (2, 8))] == [
        "inside dp",
        "whole on every tp rank",
        "over the tp group",
        "over 4 tp groups",
    ]


def test_nothing_fits_anywhere_names_what_was_tried():
    r = dspipe("plan", "--model", "mixtral-8x7b", "--gpu", "cpu", "--pp", "1", "--measure", "never")
    assert r.returncode == 2 and len(error_lines(r)) == 1, r.stderr
    line = error_lines(r)[0]
    assert line.endswith(
        "would fit with: none of what dspipe tried (--offload nvme --nvme-path DIR, up to 64 nodes x 8)"
    )
