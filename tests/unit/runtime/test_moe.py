"""dspipe.runtime.moe in one process (ep 1, a one-rank gloo group): DeepSpeed's native MoE layer built from a
SparseMLP computes the same output, load-balancing loss and gradients as the SparseMLP, for k = 1, 2 and 3 with and
without router_norm_topk, with shared experts, with sigmoid scores (scaled or not) and with expert groups and a
selection bias (DeepSpeed's gate follows the model's choice); the expert loads count each micro-batch once, and
aux-loss-free balancing moves the bias by the rule; the whole GPT's loss too; the optimizer groups, the names and the
refusals."""

import copy
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from dspipe.errors import SpecError  # noqa: E402
from dspipe.spec.model import ModelSpec  # noqa: E402


def spec(**fields) -> ModelSpec:
    base = dict(
        name="moe",
        layers=2,
        hidden=32,
        heads=4,
        vocab=64,
        seq_len=16,
        ffn=48,
        norm="rmsnorm",
        mlp="swiglu",
        positions="rope",
        bias=False,
        experts=4,
        experts_per_token=2,
        expert_ffn=24,
    )
    return ModelSpec(**{**base, **fields})


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo process group, DeepSpeed's comm on it (its MoE layer builds expert-parallel groups)."""
    import os

    import deepspeed
    import deepspeed.comm.comm as ds_comm
    import torch.distributed as dist
    from deepspeed.utils import groups

    from tests.helpers import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    yield
    for table in (
        groups._EXPERT_PARALLEL_GROUP,
        groups._EXPERT_DATA_PARALLEL_GROUP,
        groups._EXPERT_PARALLEL_GROUP_RANKS,
        groups._EXPERT_DATA_PARALLEL_GROUP_RANKS,
    ):
        table.clear()
    dist.destroy_process_group()
    ds_comm.cdb = None


def native_gpt(s, *, reentrant=None):
    """GPT(s) with every sparse block on DeepSpeed's MoE layer (ep 1, the one-rank group), recomputing each block
    in its backward (reentrant or not) unless `reentrant` is None."""
    from torch.utils.checkpoint import checkpoint

    from dspipe.model.gpt import GPT
    from dspipe.runtime.moe import install

    model = GPT(s, seed=3)
    install(model, spec=s, ep=1, ep_rank=0)
    for b in model.h:
        if b.sparse:
            b.mlp.moe.set_deepspeed_parallelism()
    if reentrant is not None:
        model.block_checkpoint = lambda fn, *args: checkpoint(fn, *args, use_reentrant=reentrant)
    return model


def native(sparse, s):
    from dspipe.runtime.moe import NativeMoE

    layer = NativeMoE(sparse, spec=s, ep=1, ep_rank=0)
    layer.moe.set_deepspeed_parallelism()
    return layer


def sparse_mlp(s):
    from dspipe.model.gpt import SparseMLP

    torch.manual_seed(0)
    mlp = SparseMLP(s)
    with torch.no_grad():
        for p in mlp.parameters():  # every expert distinct (DeepSpeed's own experts are copies of one)
            p.normal_(0, 0.5)
    return mlp


CASES = [dict(experts_per_token=k, router_norm_topk=norm) for k in (1, 2, 3) for norm in (True, False)]
CASES += [dict(experts_per_token=2, shared_experts=1, router_norm_topk=False)]
CASES += [
    dict(experts_per_token=k, router_norm_topk=norm, router_score="sigmoid", router_scale=scale)
    for k, norm, scale in ((1, True, 1.0), (1, False, 2.5), (2, True, 2.5), (3, False, 1.0))
]
CASES += [
    dict(
        experts=8,
        experts_per_token=k,
        router_score=score,
        router_groups=4,
        router_group_limit=limit,
        router_bias_rate=0.01,
        router_norm_topk=k > 1,
    )  # (top-1 renormalised weighs 1: no router gradient
    for k, score, limit in ((1, "sigmoid", 1), (2, "softmax", 2), (3, "sigmoid", 2))
]  # but the aux loss's)


@pytest.mark.parametrize("fields", CASES, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_native_layer_equals_sparse_mlp(group, fields):
    s = spec(**fields)
    plain = sparse_mlp(s)
    if plain.router_bias is not None:  # a selection bias that changes the choice (DeepSpeed must follow it)
        with torch.no_grad():
            plain.router_bias.copy_(torch.randn(s.experts, generator=torch.Generator().manual_seed(4)) * 0.5)
    layer = native(copy.deepcopy(plain), s)
    x = torch.randn(2, 16, s.hidden, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = plain(xa), layer(xb)
    assert got.shape == want.shape
    assert relative(got, want) < 1e-6
    assert abs(layer.aux.item() - plain.aux.item()) < 1e-6
    assert layer.aux.item() > 0
    ((want**2).sum() + plain.aux).backward()
    ((got**2).sum() + layer.aux).backward()
    assert relative(xb.grad, xa.grad) < 1e-5
    assert relative(layer.gate_weight.grad, plain.router.weight.grad) < 1e-5  # the routing weights' gradient
    for e, expert in enumerate(layer.moe.deepspeed_moe.experts.deepspeed_experts):
        for a, b in zip(expert.parameters(), plain.experts[e].parameters(), strict=True):
            if b.grad is None or not b.grad.any():  # an expert no token chose (the bias or the groups kept it out)
                assert a.grad is None or not a.grad.any()
            else:
                assert relative(a.grad, b.grad) < 1e-5


def relative(got, want) -> float:
    """Largest difference over the largest magnitude (fp32 rounding: ~1e-7)."""
    return ((got - want).abs().max() / want.abs().max()).item()


def test_gpt_loss_and_aux_unchanged(group):
    """The whole GPT: installed on DeepSpeed's layer, the same loss, LM loss and aux loss (sparse blocks 1 and 3)."""
    from dspipe.model.gpt import GPT
    from dspipe.runtime.moe import NativeMoE, install

    s = spec(layers=4, moe_every=2, experts_per_token=2, router_norm_topk=False)
    plain = GPT(s, seed=3)
    moe = copy.deepcopy(plain)
    assert install(moe, spec=s, ep=1, ep_rank=0) == 2
    assert [type(b.mlp) is NativeMoE for b in moe.h] == [False, True, False, True]
    for b in moe.h:
        if isinstance(b.mlp, NativeMoE):
            b.mlp.moe.set_deepspeed_parallelism()
    idx = torch.randint(0, s.vocab, (2, 16), generator=torch.Generator().manual_seed(2))
    labels = torch.randint(0, s.vocab, (2, 16), generator=torch.Generator().manual_seed(3))
    want, got = plain(idx, labels), moe(idx, labels)
    assert abs(got.item() - want.item()) < 1e-5
    assert abs(moe.last_lm_loss.item() - plain.last_lm_loss.item()) < 1e-5
    assert abs(moe.last_aux_loss.item() - plain.last_aux_loss.item()) < 1e-6
    assert got.item() > moe.last_lm_loss.item()  # aux_loss_coef x aux is in the loss


def test_param_groups_split_experts(group):
    from dspipe.runtime.engine import param_groups
    from dspipe.runtime.moe import param_groups as moe_groups

    s = spec(shared_experts=1)
    layer = native(sparse_mlp(s), s)
    groups = moe_groups(param_groups(layer, 0.1))
    experts = {id(p) for p in layer.moe.deepspeed_moe.experts.parameters()}
    moe = [g for g in groups if g.get("moe")]
    assert [g["name"] for g in moe] == ["ep_size_1"] and moe[0]["weight_decay"] == 0.1
    assert {id(p) for p in moe[0]["params"]} == experts
    dense = [g for g in groups if not g.get("moe")]
    assert [g["weight_decay"] for g in dense] == [0.1]  # the gate and the shared MLP (no biases, no 1-d tensors)
    assert {id(p) for g in dense for p in g["params"]} == {id(p) for p in layer.parameters()} - experts


def test_model_names():
    from dspipe.runtime.experts import model_name

    assert model_name("h.1.mlp.moe.deepspeed_moe.gate.wg.weight") == "h.1.mlp.router.weight"
    name = "h.1.mlp.moe.deepspeed_moe.experts.deepspeed_experts.1.c_fc.weight"
    assert model_name(name) == "h.1.mlp.experts.1.c_fc.weight"
    assert model_name(name, local=2, ep_rank=1) == "h.1.mlp.experts.3.c_fc.weight"
    assert model_name("h.1.mlp.shared.c_proj.weight") == "h.1.mlp.shared.c_proj.weight"


def plan(**fields):
    return SimpleNamespace(**{**dict(zero_stage=1, pp=1, tp=1, tp_sp=False, sp=1, precision="fp32", dp=4), **fields})


@pytest.mark.parametrize(
    "fields,ep,says",
    [
        (dict(sp=2, dp=2), 1, "sp 2 > 1"),
        (dict(tp=2, dp=2, tp_sp=True), 3, "tp 2 at ep 3: ep % tp = 1 (at tp > 1 the experts spread over whole tp"),
        (dict(tp=2, dp=1, tp_sp=True, zero_stage=2), 4, "dp 1 % (ep 4 / tp 2) = 1"),
        (dict(tp=2, dp=2, tp_sp=False), 1, "tp 2 without sequence parallelism (each tp rank would run every token"),
        (dict(precision="fp16"), 1, "fp16"),
        (dict(zero_stage=2), 3, "experts 4 % ep 3 = 1; dp 4 % ep 3 = 1"),
        (dict(zero_stage=2, dp=2), 4, "dp 2 % ep 4 = 2"),
        (dict(zero_stage=1), 2, "ep 2 > 1 under ZeRO-1 with contiguous_gradients false in ds_config.json (measured"),
        (dict(zero_stage=0), 2, "ep 2 > 1 under ZeRO-0 (measured with DeepSpeed 0.19.8"),
    ],
)
def test_refusals(fields, ep, says):
    from dspipe.runtime.experts import refusal

    assert says in refusal(spec=spec(), plan=plan(**fields), ep=ep, contiguous_gradients=False)


def test_refusal_dense_and_supported():
    from dspipe.runtime.moe import install_for_run, refusal

    assert refusal(spec=spec(), plan=plan(zero_stage=2, precision="bf16"), ep=2) is None
    assert refusal(spec=spec(), plan=plan(zero_stage=1), ep=2, contiguous_gradients=True) is None
    assert refusal(spec=spec(), plan=plan(zero_stage=0), ep=1, contiguous_gradients=False) is None
    assert refusal(spec=spec(), plan=plan(zero_stage=3), ep=1) is None  # the model's own SparseMLP under ZeRO-3
    assert refusal(spec=spec(), plan=plan(zero_stage=3), ep=2) is None  # its experts spread over 2 ranks
    assert refusal(spec=spec(), plan=plan(tp=2, tp_sp=True, dp=2), ep=1) is None  # and at tp > 1
    assert refusal(spec=spec(), plan=plan(tp=2, tp_sp=True, dp=1), ep=2) is None  # spread over the tp group
    assert refusal(spec=spec(), plan=plan(tp=2, tp_sp=True, dp=2), ep=4) is None  # over 2 tp groups (native layer)
    assert refusal(spec=spec(), plan=plan(tp=2, tp_sp=True, dp=2, zero_stage=3), ep=4) is None  # the model's own
    dropping = spec(capacity_factor=1.25)  # every layout dispatches through dspipe.runtime.dispatch: a capacity too
    assert refusal(spec=dropping, plan=plan(tp=2, tp_sp=True, dp=2), ep=1) is None
    assert refusal(spec=dropping, plan=plan(zero_stage=3), ep=1) is None
    assert refusal(spec=spec(experts=0, expert_ffn=None), plan=plan(), ep=1) is None
    assert refusal(spec=spec(), plan=plan(pp=2, dp=2), ep=2, contiguous_gradients=True) is None  # each stage its own
    run = SimpleNamespace(model=spec(experts=0, expert_ffn=None), plan=plan(ep=2), strategy=None, ds_config={})
    with pytest.raises(SpecError, match="ep 2 > 1 needs a mixture-of-experts model"):
        install_for_run(None, run=run, rank=0)


@pytest.mark.parametrize("reentrant", [None, True, False])
def test_expert_loads_count_each_micro_batch_once_and_the_bias_moves_by_the_rule(group, reentrant):
    """Two training micro-batches, with full recomputation (reentrant or not) or without: each sparse block counts
    every token's k routes once (no recomputation counted twice), eval forwards count nothing, the imbalance is the
    busiest expert over the mean, and the update moves each expert's bias by rate x sign(mean load - its load)."""
    from dspipe.runtime.moe import load_ratio, step_counts, update_router_bias

    s = spec(layers=2, experts_per_token=2, router_score="sigmoid", router_bias_rate=0.1)
    model = native_gpt(s, reentrant=reentrant)
    gen = torch.Generator().manual_seed(5)
    batches = [
        (torch.randint(0, s.vocab, (2, 16), generator=gen), torch.randint(0, s.vocab, (2, 16), generator=gen))
        for _ in range(2)
    ]
    model.eval()
    with torch.no_grad():
        model(*batches[0])
    model.train()
    for idx, labels in batches:
        model(idx, labels).backward()
    loads, dropped = step_counts(model, spec=s, device="cpu")
    assert (
        dropped == 0 and loads.shape == (2, s.experts) and loads.sum(dim=1).tolist() == [2 * 2 * 16 * 2] * 2
    )  # micro x tokens x k
    assert load_ratio(loads) == max(float(r.max()) / float(r.double().mean()) for r in loads) and load_ratio(loads) > 1
    assert load_ratio(torch.full((2, 4), 8)) == 1.0
    update_router_bias(model, loads=loads, rate=0.1)
    for b, r in zip(model.h, loads, strict=True):
        want = 0.1 * torch.sign(r.double().mean() - r.double()).float()
        assert torch.equal(b.mlp.router_bias, want) and want.abs().sum() > 0
        assert b.mlp.router_bias.dtype == torch.float32
    assert int(step_counts(model, spec=s, device="cpu")[0].sum()) == 0  # restarted


def test_router_bias_stays_fp32_and_is_in_the_state():
    from dspipe.model.gpt import GPT, fill

    s = spec(layers=2, router_bias_rate=0.001)
    model = GPT(s, seed=1).to(torch.bfloat16)
    assert all(b.mlp.router_bias.dtype == torch.float32 for b in model.h)
    assert [k for k in model.state_dict() if "router_bias" in k] == ["h.0.mlp.router_bias", "h.1.mlp.router_bias"]
    assert not any("router_bias" in k for k in GPT(spec(layers=2), seed=1).state_dict())  # off: no buffer at all
    with torch.device("meta"):
        meta = GPT(s, seed=None)
    meta = meta.to_empty(device="cpu")
    meta.h[0].mlp.router_bias.fill_(float("nan"))
    fill(meta, seed=1)
    assert all(torch.equal(b.mlp.router_bias, torch.zeros(s.experts)) for b in meta.h)  # step 0: unbiased


@pytest.mark.parametrize("reentrant", [None, True, False])
def test_a_pipeline_stage_gives_its_aux_losses_the_plain_models_gradient(group, reentrant):
    """The plain GPT's blocks run as a pipeline stage would run them (no GPT.forward: the loss is the LM loss alone,
    over 2 micro-batches each scaled by 1 / 2 as DeepSpeed's engine scales it): with wire_stage's hooks every
    parameter gets the plain model's gradient of LM + aux_loss_coef x mean aux (the router's included), with full
    recomputation (reentrant or not) or without; each micro-batch's loads and aux loss are counted once."""
    from torch.utils.checkpoint import checkpoint

    from dspipe.runtime.moe import set_aux_scale, step_counts, take_aux_total, wire_stage

    s = spec(layers=3, experts_per_token=2, aux_loss_coef=0.5)
    gen = torch.Generator().manual_seed(5)
    batches = [
        (torch.randint(0, s.vocab, (2, 16), generator=gen), torch.randint(0, s.vocab, (2, 16), generator=gen))
        for _ in range(2)
    ]

    plain = native_gpt(s)
    auxes = []
    for idx, labels in batches:
        (plain(idx, labels) / 2).backward()
        auxes.append(float(plain.last_aux_loss))
    stage = native_gpt(s)
    blocks = [b for b in stage.h if b.sparse]
    wire_stage(blocks)
    set_aux_scale(stage, spec=s, grad_accum=2)
    assert all(b.aux_scale == 0.5 / (len(s.sparse_layers) * 2) for b in blocks)
    for idx, labels in batches:
        x = stage.embed(idx)
        for block in stage.h:
            x = block(x) if reentrant is None else checkpoint(block, x, use_reentrant=reentrant)
        (stage.loss_fn(stage.embed.logits(stage.final(x)), labels) / 2).backward()
    for (name, a), b in zip(plain.named_parameters(), stage.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name
    router = stage.h[s.sparse_layers[0]].mlp.gate_weight.grad
    assert router is not None and router.abs().max() > 0
    loads, _ = step_counts(stage, spec=s, device="cpu")
    assert loads.sum(dim=1).tolist() == [2 * 2 * 16 * 2] * len(s.sparse_layers)  # micro x tokens x k, once each
    total = float(take_aux_total(stage, device="cpu"))
    assert total == pytest.approx(sum(auxes) * len(s.sparse_layers), rel=1e-6)  # the sum over blocks and micro-batches
    assert float(take_aux_total(stage, device="cpu")) == 0.0  # restarted


@pytest.mark.parametrize("reentrant", [None, True, False])
def test_dropped_routes_are_counted_once_and_none_when_dropless(group, reentrant):
    """step_counts: the routes a capacity dropped in the step's training forwards (dspipe.runtime.dispatch), each
    micro-batch once whatever the recomputation, none in eval; dropless (no capacity_factor) drops none. The count
    restarts."""
    from dspipe.runtime.moe import step_counts

    gen = torch.Generator().manual_seed(5)
    batch = (torch.randint(0, 64, (2, 16), generator=gen), torch.randint(0, 64, (2, 16), generator=gen))
    dropped = {}
    for cf in (None, 0.5):
        s = spec(layers=2, experts_per_token=2, capacity_factor=cf)
        model = native_gpt(s, reentrant=reentrant)
        model.eval()
        with torch.no_grad():
            model(*batch)
        model.train()
        counts = []
        for _ in range(2):
            model(*batch).backward()
            counts.append(step_counts(model, spec=s, device="cpu")[1])
        dropped[cf] = counts
    # capacity 0.5 x 32 tokens x 2 routes / 4 experts = 8 slots per expert: at least half of the 64 routes of each
    # block are dropped, the same ones in each step's one micro-batch (the weights did not move)
    assert dropped[None] == [0, 0]
    assert dropped[0.5][0] == dropped[0.5][1] >= 2 * 32, dropped


def test_the_layer_benchmark_runs_the_three_layers_on_the_same_weights():
    """benchmarks/moe_layer.py (the CPU figures of docs/benchmarks.md) at a tiny size, in its own process: DeepSpeed's
    layer as shipped, as dspipe trains it and the plain loop time and compute the same output (fp32, top-2: dspipe's
    bitwise the loop's; DeepSpeed's gate and einsum within rounding)."""
    import re
    import subprocess
    import sys

    from tests.helpers import ROOT

    args = ["--hidden", "64", "--experts", "4", "--expert-ffn", "32", "--tokens", "64", "--repeats", "1"]
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "moe_layer.py"), *args], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(
        r"dspipe / deepspeed: (\d+\.\d+); dspipe / loop: (\d+\.\d+); largest output difference from the loop: "
        r"deepspeed (\S+), dspipe (\S+)",
        r.stdout,
    )
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, r.stdout
    assert float(m.group(3)) < 1e-5 and float(m.group(4)) == 0, r.stdout


@pytest.mark.parametrize(
    "world,pp,tp,ep",
    [(4, 1, 1, 2), (8, 2, 1, 2), (4, 1, 2, 2), (8, 1, 2, 4), (16, 2, 2, 4), (16, 1, 2, 8), (16, 1, 4, 8), (8, 1, 2, 1)],
)
def test_ep_ranks_follow_the_rank_layout(world, pp, tp, ep):
    """The ep rank the checkpoint readers give a file (its dp and tp rank) is the one the rank trained at: its global
    rank % ep (build, DeepSpeed's plain expert groups), and the expert's file is named by that rank's tp rank."""
    from dspipe.runtime.experts import ep_rank_of, ep_span, holder_tp_rank
    from dspipe.spec.layout import ParallelLayout

    layout, experts = ParallelLayout(world=world, pp=pp, tp=tp), 16
    assert layout.dp % ep_span(tp=tp, ep=ep) == 0
    for rank in range(world):
        c = layout.coords(rank)
        ep_rank = ep_rank_of(dp_rank=c["data"], tp_rank=c["tensor"], tp=tp, ep=ep)
        assert ep_rank == rank % ep
        for e in range(ep_rank * experts // ep, (ep_rank + 1) * experts // ep):
            assert holder_tp_rank(e, experts=experts, ep=ep, tp=tp) == (c["tensor"] if ep > 1 else 0)
    # the ranks of one ep rank and tp rank within a stage are an expert-data-parallel group: dp / ep_span of them
    stage0 = [layout.coords(r) | {"rank": r} for r in range(world) if layout.stage(r) == 0]
    for q in range(ep):
        for t in range(tp):
            holders = [c for c in stage0 if c["rank"] % ep == q and c["tensor"] == t]
            assert len(holders) in (
                (0,) if ep > 1 and tp > 1 and q % tp != t else (layout.dp // ep_span(tp=tp, ep=ep),)
            )
