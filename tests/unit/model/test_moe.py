"""The mixture-of-experts model (dspipe.model.gpt.SparseMLP) against transformers, fp32 on the CPU: one sparse
block equals MixtralSparseMoeBlock and Qwen3MoeSparseMoeBlock (top-1, 2, 8; renormalised or not) with the same
weights, and with sigmoid scores DeepseekV3MoE (one group, no expert bias, scaled or not); its load-balancing loss
equals load_balancing_loss_func, a whole tiny MixtralForCausalLM / Qwen3MoeForCausalLM written by save_pretrained
computes dspipe's logits (and loss + aux) after import and the export reads back exactly; the router gets the aux
loss's gradient with and without full recomputation; shared experts, moe_every and moe_first_dense build the blocks
the spec declares; step-0 values: every expert its own draws, the dense blocks' values those of the dense model;
what neither class computes is one line."""

import json
from dataclasses import replace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from dspipe.errors import SpecError
from dspipe.model.gpt import GPT, MLP, Block, SparseMLP, lm_loss
from dspipe.model.initial import INIT_STD
from dspipe.spec.model import ModelSpec
from tests.helpers import perturb

TOL = 1e-5
V, S, H = 96, 32, 32
MOE = ModelSpec(
    "moe",
    3,
    H,
    4,
    V,
    S,
    48,
    dropout=0.0,
    tied_embeddings=False,
    norm="rmsnorm",
    mlp="swiglu",
    positions="rope",
    kv_heads=2,
    bias=False,
    norm_eps=1e-5,
    experts=4,
    experts_per_token=2,
)


def _tokens(n=2, seq=S):
    return torch.randint(0, V, (n, seq), generator=torch.Generator().manual_seed(5))


def _refusal(fn, *args, **kwargs) -> str:
    with pytest.raises(SpecError) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


# ---- one sparse block against transformers' ------------------------------------------------------------------------


def _sparse_pair(family: str, *, experts: int, k: int, norm: bool):
    """(dspipe SparseMLP, transformers' sparse block) holding the same random weights (every expert distinct)."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    spec = replace(
        MOE, hidden=16, heads=2, kv_heads=2, experts=experts, experts_per_token=k, expert_ffn=24, router_norm_topk=norm
    )
    torch.manual_seed(1)
    ours = perturb(SparseMLP(spec), seed=2)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(
            hidden_size=16, intermediate_size=24, num_local_experts=experts, num_experts_per_tok=k
        )
        theirs = MixtralSparseMoeBlock(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(
            hidden_size=16, moe_intermediate_size=24, num_experts=experts, num_experts_per_tok=k, norm_topk_prob=norm
        )
        theirs = Qwen3MoeSparseMoeBlock(cfg)
    _copy_routed(ours, theirs)
    return ours.eval(), theirs.float().eval()


def _copy_routed(ours, theirs) -> None:
    """The router and the routed experts of SparseMLP `ours` into transformers' block `theirs` (fused experts)."""
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.weight)
        theirs.experts.gate_up_proj.copy_(torch.stack([e.c_fc.weight for e in ours.experts]))
        theirs.experts.down_proj.copy_(torch.stack([e.c_proj.weight for e in ours.experts]))


@pytest.mark.parametrize(
    "family,experts,k,norm",
    [
        ("mixtral", 4, 1, True),
        ("mixtral", 4, 2, True),
        ("mixtral", 8, 8, True),
        ("qwen3_moe", 16, 1, False),
        ("qwen3_moe", 16, 2, False),
        ("qwen3_moe", 16, 8, False),
        ("qwen3_moe", 16, 1, True),
        ("qwen3_moe", 16, 8, True),
    ],
)
def test_sparse_mlp_equals_transformers_block(family, experts, k, norm):
    ours, theirs = _sparse_pair(family, experts=experts, k=k, norm=norm)
    x = torch.randn(4, 64, 16, generator=torch.Generator().manual_seed(3)) * 3
    with torch.no_grad():
        a, b = ours(x), theirs(x)
    assert a.abs().max() > 0.1  # outputs of order 1: the bound below is rounding
    assert (a - b).abs().max().item() < 1e-6
    # every expert takes part (distinct weights: routing matters) and each token goes to k of them
    counts = torch.zeros(experts)
    _, chosen = torch.softmax(torch.nn.functional.linear(x.reshape(-1, 16), ours.router.weight), -1).topk(k)
    counts.index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel()))
    assert counts.sum() == k * 256 and (counts > 0).sum() >= min(experts, 4)


@pytest.mark.parametrize("k", [1, 2, 8])
def test_aux_loss_equals_transformers_load_balancing_loss(k):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    ours, _ = _sparse_pair("qwen3_moe", experts=16, k=k, norm=True)
    x = torch.randn(3, 40, 16, generator=torch.Generator().manual_seed(4))
    ours(x)
    logits = torch.nn.functional.linear(x.reshape(-1, 16), ours.router.weight)
    want = load_balancing_loss_func((logits,), 16, k)
    assert abs(ours.aux.item() - want.item()) < 1e-6 and ours.aux.requires_grad
    assert ours.aux.item() >= k - 1e-5  # E sum f P >= k, equal only when perfectly balanced


# ---- sigmoid scores (DeepSeek-V3) -----------------------------------------------------------------------------------


def _deepseek_pair(
    *, experts: int, k: int, norm: bool, scale: float, groups: int = 1, limit: int | None = None, biased: bool = False
):
    """(dspipe SparseMLP with sigmoid scores and one shared expert, transformers' DeepseekV3MoE) holding the same
    random weights, the same expert groups and, when `biased`, the same random selection bias."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    spec = replace(
        MOE,
        hidden=16,
        heads=2,
        kv_heads=2,
        experts=experts,
        experts_per_token=k,
        expert_ffn=24,
        shared_experts=1,
        router_norm_topk=norm,
        router_score="sigmoid",
        router_scale=scale,
        router_groups=groups,
        router_group_limit=limit,
        router_bias_rate=0.001 if biased else 0.0,
    )
    torch.manual_seed(1)
    ours = perturb(SparseMLP(spec), seed=2)
    cfg = transformers.DeepseekV3Config(
        hidden_size=16,
        moe_intermediate_size=24,
        n_routed_experts=experts,
        num_experts_per_tok=k,
        n_group=groups,
        topk_group=limit or groups,
        n_shared_experts=1,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
    )
    theirs = DeepseekV3MoE(cfg)
    _copy_routed(ours, theirs)
    with torch.no_grad():
        gate, up = ours.shared.c_fc.weight.chunk(2)
        theirs.shared_experts.gate_proj.weight.copy_(gate)
        theirs.shared_experts.up_proj.weight.copy_(up)
        theirs.shared_experts.down_proj.weight.copy_(ours.shared.c_proj.weight)
        if biased:
            ours.router_bias.copy_(torch.randn(experts, generator=torch.Generator().manual_seed(7)) * 0.3)
            theirs.gate.e_score_correction_bias.copy_(ours.router_bias)
    assert ours.router_bias is None or ours.router_bias.dtype == torch.float32
    return ours.eval(), theirs.float().eval()


@pytest.mark.parametrize(
    "experts,k,norm,scale,groups,limit,biased",
    [
        (8, 1, True, 1.0, 1, None, False),
        (8, 2, True, 2.5, 1, None, False),
        (16, 6, True, 2.5, 1, None, False),
        (16, 4, False, 1.0, 1, None, False),
        (16, 1, False, 2.5, 1, None, False),
        (16, 4, True, 2.5, 4, 2, False),
        (16, 4, True, 2.5, 1, None, True),
        (32, 8, True, 2.5, 8, 4, True),
        (16, 3, False, 1.0, 4, 1, True),
    ],
)
def test_sigmoid_sparse_mlp_equals_deepseek_v3_block(experts, k, norm, scale, groups, limit, biased):
    """DeepSeek-V3's routing: sigmoid scores, then (as the parameters say) group-limited selection and a selection
    bias; dspipe's block computes transformers' DeepseekV3MoE."""
    ours, theirs = _deepseek_pair(
        experts=experts, k=k, norm=norm, scale=scale, groups=groups, limit=limit, biased=biased
    )
    x = torch.randn(4, 64, 16, generator=torch.Generator().manual_seed(3)) * 3
    with torch.no_grad():
        a, b = ours(x), theirs(x)
    assert a.abs().max() > 0.1
    assert (a - b).abs().max().item() < 1e-5 * b.abs().max().item()
    if k == 1 and norm or groups > 1 or biased:  # one expert renormalised weighs `scale` under either score
        return
    with torch.no_grad():  # otherwise softmax scores give another output: the score function is in use
        softmax = SparseMLP(
            replace(
                MOE,
                hidden=16,
                heads=2,
                kv_heads=2,
                experts=experts,
                experts_per_token=k,
                expert_ffn=24,
                shared_experts=1,
                router_norm_topk=norm,
                router_scale=scale,
            )
        )
        softmax.load_state_dict(ours.state_dict())
        assert (softmax(x) - a).abs().max() > 1e-3


def test_selection_bias_and_groups_change_the_choice_not_the_weights():
    """The selection bias and the group limit pick other experts (what they are for), and a chosen expert still weighs
    its own score: without them the same block gives another output."""
    from dspipe.model.gpt import route

    logits = torch.randn(256, 16, generator=torch.Generator().manual_seed(9))
    plain = route(logits, k=4, norm_topk=False, score="sigmoid")
    bias = torch.zeros(16).index_fill(0, torch.tensor([0, 1]), 10.0)  # experts 0 and 1 always win the selection
    _, weights, chosen = route(logits, k=4, norm_topk=False, score="sigmoid", bias=bias)
    assert (chosen[:, :2].sort(dim=1).values == torch.tensor([0, 1])).all()
    assert torch.equal(weights, torch.sigmoid(logits).gather(1, chosen))  # weighed by the score, not score + bias
    assert not torch.equal(chosen, plain[2])
    _, _, grouped = route(logits, k=4, norm_topk=False, score="sigmoid", groups=4, group_limit=1)
    assert (grouped // 4 == grouped[:, :1] // 4).all()  # all four experts from one group of four
    assert not torch.equal(grouped.sort(dim=1).values, plain[2].sort(dim=1).values)


def test_route_sigmoid_formula():
    from dspipe.model.gpt import balance_loss, route

    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0], [3.0, 4.0, -5.0, 3.5]])
    probs, weights, chosen = route(logits, k=2, norm_topk=False, score="sigmoid", scale=2.5)
    assert chosen.tolist() == [[1, 3], [1, 3]]
    s = torch.sigmoid(logits)
    assert torch.allclose(weights, 2.5 * s.gather(1, chosen), rtol=0, atol=1e-7)
    assert torch.allclose(probs, s / s.sum(-1, keepdim=True), rtol=0, atol=1e-7)
    _, normed, _ = route(logits, k=2, norm_topk=True, score="sigmoid", scale=1.0)
    assert torch.allclose(normed[0], s[0, [1, 3]] / s[0, [1, 3]].sum(), rtol=0, atol=1e-7)
    assert torch.isfinite(route(torch.full((1, 4), -200.0), k=2, norm_topk=True, score="sigmoid")[1]).all()
    # the balance loss reads the normalised scores: E x sum_e f_e P_e by hand
    f = torch.tensor([0.0, 2.0, 0.0, 2.0]) / 2
    assert abs(balance_loss(probs, chosen).item() - 4 * (f * probs.mean(0)).sum().item()) < 1e-6


# ---- whole models: import, export ------------------------------------------------------------------------------------

BASE = dict(
    vocab_size=V,
    hidden_size=H,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=S,
    rms_norm_eps=1e-5,
)
FAMILIES = {  # name: (config class, arguments, the ModelSpec fields it reads as, besides MOE's)
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2), dict(rope_theta=1e6)),
    "mixtral-window-top1": (
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=1, sliding_window=7, router_aux_loss_coef=0.02),
        dict(rope_theta=1e6, experts_per_token=1, sliding_window=7, aux_loss_coef=0.02),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, head_dim=16, norm_topk_prob=False),
        dict(
            experts=8,
            experts_per_token=3,
            expert_ffn=24,
            head_width=16,
            qk_norm=True,
            router_norm_topk=False,
            rope_theta=10000.0,
        ),
    ),
    "qwen3-moe-dense-first": (
        "Qwen3MoeConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            mlp_only_layers=[0],
            norm_topk_prob=True,
            attention_bias=True,
        ),
        dict(
            experts=8, expert_ffn=24, qk_norm=True, moe_first_dense=1, qkv_bias=True, out_bias=True, rope_theta=10000.0
        ),
    ),
    "qwen3-moe-every2-window": (
        "Qwen3MoeConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=1,
            moe_intermediate_size=24,
            decoder_sparse_step=2,
            use_sliding_window=True,
            sliding_window=5,
            norm_topk_prob=True,
        ),
        dict(
            experts=8,
            experts_per_token=1,
            expert_ffn=24,
            qk_norm=True,
            moe_every=2,
            sliding_window=5,
            rope_theta=10000.0,
        ),
    ),
}
ARCH = {"MixtralConfig": "MixtralForCausalLM", "Qwen3MoeConfig": "Qwen3MoeForCausalLM"}


def _family_dir(tmp_path, family: str):
    """(directory, model) of a tiny random checkpoint written by save_pretrained and loaded back from it."""
    import transformers

    cls, kwargs, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = perturb(getattr(transformers, ARCH[cls])(getattr(transformers, cls)(**{**BASE, **kwargs})).float())
    d = tmp_path / family
    model.save_pretrained(d)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(d).float().eval()
    assert type(loaded).__name__ == ARCH[cls]
    return d, loaded


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_of_a_saved_checkpoint_computes_transformers_logits(tmp_path, family):
    from safetensors import safe_open

    from dspipe.model.hf import function_of, spec_from_hf_dir
    from dspipe.model.hf_arch import architecture_of
    from dspipe.model.hf_state import from_hf_state
    from dspipe.model.hf_weights import HFWeights, check_weights, load_into_module

    d, hf = _family_dir(tmp_path, family)
    spec = spec_from_hf_dir(d)
    assert function_of(spec) == function_of(replace(MOE, name=spec.name, **FAMILIES[family][2]))
    assert architecture_of(spec) == ARCH[FAMILIES[family][0]]
    names = list(safe_open(str(d / "model.safetensors"), "pt").keys())  # the files hold one tensor per expert
    assert any(".experts.3." in n for n in names) and not any("gate_up_proj" in n for n in names)
    assert check_weights(d, spec) == 4 * spec.num_params
    gpt = GPT(spec, seed=None).eval()
    assert load_into_module(gpt, HFWeights(d, spec), spec=spec) == len(spec.model_tensors())
    x = _tokens()
    with torch.no_grad():
        diff = (gpt(x) - hf(x).logits).abs().max().item()
    assert diff < TOL, diff
    in_memory = from_hf_state(hf.state_dict(), spec)  # transformers' fused experts read as well
    assert all(torch.equal(in_memory[n], p) for n, p in gpt.state_dict().items())


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe-dense-first"])
def test_loss_with_router_logits_is_transformers_for_one_sparse_layer(tmp_path, family):
    """transformers' loss with output_router_logits: lm + router_aux_loss_coef x aux over all layers' routes pooled;
    with one sparse layer that is dspipe's lm + aux_loss_coef x the block's aux."""
    import transformers

    from dspipe.model.hf_state import from_hf_state

    cls, kwargs, fields = FAMILIES[family]
    layers = 2 if "dense-first" in family else 1
    config = getattr(transformers, cls)(
        **{**BASE, **kwargs, "num_hidden_layers": layers, "output_router_logits": True, "router_aux_loss_coef": 0.3}
    )
    torch.manual_seed(0)
    hf = perturb(getattr(transformers, ARCH[cls])(config).float()).eval()
    spec = replace(MOE, **fields, layers=layers, aux_loss_coef=0.3)
    assert len(spec.sparse_layers) == 1
    gpt = GPT(spec, seed=None).eval()
    gpt.load_state_dict(from_hf_state(hf.state_dict(), spec))
    x = _tokens()
    labels = torch.cat([x[:, 1:], torch.full((2, 1), -100)], dim=1)  # transformers shifts its labels itself
    with torch.no_grad():
        out = hf(x, labels=x)
        ours = gpt(x, labels)
    assert abs(ours.item() - out.loss.item()) < TOL
    assert abs(gpt.last_aux_loss.item() - out.aux_loss.item()) < 1e-6
    assert ours.item() == (gpt.last_lm_loss + 0.3 * gpt.last_aux_loss).item()


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe", "qwen3-moe-dense-first", "qwen3-moe-every2-window"])
def test_export_reads_back_with_from_pretrained(tmp_path, family):
    import transformers

    from dspipe.model.hf import function_of, spec_from_hf_dir
    from dspipe.model.hf_arch import architecture_of
    from dspipe.model.hf_state import from_hf_state, hf_model

    spec = replace(MOE, **FAMILIES[family][2], capacity_factor=1.25)  # training-only: the export is dropless
    gpt = perturb(GPT(spec, seed=3), seed=4).eval()
    hf_model(dict(gpt.state_dict()), spec, eos_id=0, source="test").save_pretrained(tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert type(back).__name__ == architecture_of(spec) == ARCH[FAMILIES[family][0]]
    x = _tokens()
    with torch.no_grad():
        diff = (back(x).logits - gpt(x)).abs().max().item()
    assert diff < TOL, diff
    state = from_hf_state(back.state_dict(), spec)
    assert all(torch.equal(state[n], p) for n, p in gpt.state_dict().items())
    read = spec_from_hf_dir(tmp_path / "out", name=spec.name)
    assert function_of(read) == function_of(replace(spec, capacity_factor=None))


def test_configs_dspipe_cannot_compute_are_refused(tmp_path):
    from dspipe.model.hf import spec_from_hf_dir

    d, _ = _family_dir(tmp_path, "qwen3-moe")
    config = json.loads((d / "config.json").read_text())

    def edited(**edit):
        (d / "config.json").write_text(json.dumps({**config, **edit}))
        return _refusal(spec_from_hf_dir, d)

    assert "mlp_only_layers [1] is not supported" in edited(mlp_only_layers=[1])
    assert "mlp_only_layers must be a list of layer numbers, got 'x'" in edited(mlp_only_layers="x")
    assert "num_experts 6 and num_local_experts 8 differ" in edited(num_experts=6)
    assert "experts_per_token 9 exceeds experts 8" in edited(num_experts_per_tok=9)
    (d / "config.json").write_text(json.dumps({**config, "mlp_only_layers": [0, 1], "num_experts": 8}))
    spec = spec_from_hf_dir(d)  # the first k layers dense: moe_first_dense
    assert (spec.moe_first_dense, spec.sparse_layers, spec.experts) == (2, (2,), 8)
    (d / "config.json").write_text(json.dumps({**config, "mlp_only_layers": [0, 1, 2], "num_experts": 8}))
    assert spec_from_hf_dir(d).experts == 0  # no sparse block: Qwen3's dense MLP everywhere
    m, _ = _family_dir(tmp_path, "mixtral")
    mixtral = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps({**mixtral, "router_jitter_noise": 0.1}))
    text = _refusal(spec_from_hf_dir, m)
    assert text.startswith(str(m)) and "router_jitter_noise 0.1 is not supported" in text
    (m / "config.json").write_text(json.dumps({**mixtral, "output_router_logits": True}))
    assert spec_from_hf_dir(m).experts == 4  # transformers' own aux switch: ignored (dspipe's is always on)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(shared_experts=1), "shared_experts 1: neither MixtralForCausalLM nor Qwen3MoeForCausalLM has shared"),
        (dict(router_norm_topk=False), "MixtralForCausalLM renormalises the top-k probabilities"),
        (dict(moe_every=2), "MixtralForCausalLM has every block sparse (sparse blocks here: 1 of 3"),
        (dict(expert_ffn=24), "expert_ffn 24 must equal ffn 48"),
        (dict(mlp_bias=True), "neither MixtralForCausalLM nor Qwen3MoeForCausalLM has MLP (expert) biases"),
        (dict(qk_norm=True, qkv_bias=True), "q/k norm is Qwen3MoeForCausalLM's, whose q/k/v/o biases are all or none"),
        (dict(mlp="gelu", norm="layernorm", positions="learned"), "are rmsnorm, swiglu, rope"),
        (
            dict(router_score="sigmoid"),
            "router_score sigmoid: MixtralForCausalLM and Qwen3MoeForCausalLM route by softmax",
        ),
        (dict(router_scale=2.5, qk_norm=True), "router_scale 2.5: MixtralForCausalLM and Qwen3MoeForCausalLM do not"),
        (
            dict(router_groups=2, router_group_limit=1),
            "router_group_limit 1: MixtralForCausalLM and Qwen3MoeForCausalLM route over every expert",
        ),
        (dict(router_bias_rate=0.001), "router_bias_rate 0.001: MixtralForCausalLM and Qwen3MoeForCausalLM have no"),
    ],
)
def test_specs_no_class_computes_are_refused_on_export(fields, message):
    from dspipe.model.hf_arch import architecture_of

    text = _refusal(architecture_of, replace(MOE, **fields))
    assert message in text and "matches no Hugging Face architecture dspipe writes" in text


# ---- training: the aux loss, its gradient, recomputation -----------------------------------------------------------


def _router_grads(model, x, labels):
    model.zero_grad()
    model(x, labels).backward()
    return [b.mlp.router.weight.grad.clone() for b in model.h if b.sparse]


@pytest.mark.parametrize("reentrant", [None, False, True])
def test_the_router_gets_the_aux_gradient_with_and_without_recomputation(reentrant):
    """The aux loss's share of the router's gradient (coefficient 0.5 minus coefficient 0) equals d(0.5 x mean aux)
    / d(router), and full recomputation (the aux a checkpointed block's output) changes no gradient."""
    spec = replace(MOE, layers=2)
    x, labels = _tokens(), _tokens().roll(1, dims=1)
    plain = GPT(replace(spec, aux_loss_coef=0.5), seed=1).train()
    routers = [b.mlp.router.weight for b in plain.h]
    loss = plain(x, labels)
    aux_grads = torch.autograd.grad(torch.stack([b.aux for b in plain.h]).mean() * 0.5, routers, retain_graph=True)
    loss.backward()
    with_aux = [r.grad.clone() for r in routers]
    without = GPT(replace(spec, aux_loss_coef=0.0), seed=1).train()
    lm_only = _router_grads(without, x, labels)
    for a, b, g in zip(with_aux, lm_only, aux_grads, strict=True):
        assert (a - b - g).abs().max() < 1e-7 and g.abs().max() > 1e-4
    if reentrant is None:
        return
    plain.block_checkpoint = lambda fn, *args: checkpoint(fn, *args, use_reentrant=reentrant)
    again = _router_grads(plain, x, labels)
    assert all((a - b).abs().max() < 1e-7 for a, b in zip(again, with_aux, strict=True))
    assert plain.last_aux_loss.item() == pytest.approx(torch.stack([b.aux for b in plain.h]).mean().item())


def test_forward_records_lm_and_aux_and_a_dense_model_returns_the_lm_loss_alone():
    x, labels = _tokens(), _tokens().roll(1, dims=1)
    moe = GPT(MOE, seed=2).eval()
    with torch.no_grad():
        loss = moe(x, labels)
        logits = moe(x)
    assert torch.equal(moe.last_lm_loss, lm_loss(logits, labels))
    assert loss.item() == (moe.last_lm_loss + MOE.aux_loss_coef * moe.last_aux_loss).item()
    assert not moe.last_lm_loss.requires_grad and not moe.last_aux_loss.requires_grad
    dense_spec = replace(MOE, experts=0)
    dense = GPT(dense_spec, seed=2).eval()
    with torch.no_grad():
        assert torch.equal(dense(x, labels), lm_loss(dense(x), labels))
    assert dense.last_aux_loss is None and all(b.aux is None for b in dense.h)


# ---- structure and step-0 values ----------------------------------------------------------------------------------


def test_shared_experts_and_the_sparse_pattern_build_the_declared_blocks():
    spec = replace(MOE, layers=6, moe_every=2, moe_first_dense=2, shared_experts=2, expert_ffn=8)
    model = GPT(spec, seed=0)
    assert [b.sparse for b in model.h] == [i in (3, 5) for i in range(6)] and spec.sparse_layers == (3, 5)
    assert [type(b.mlp) for b in model.h] == [MLP, MLP, MLP, SparseMLP, MLP, SparseMLP]
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == dict(spec.model_tensors())
    block = model.h[3].mlp
    assert block.shared.c_fc.weight.shape == (2 * 16, H) and block.experts[0].c_fc.weight.shape == (16, H)
    x = torch.randn(2, 5, H)
    with torch.no_grad():  # the shared MLP is added to the routed experts' weighted sum, ungated
        shared = block.shared
        block.shared = None
        routed = block(x)
        block.shared = shared
        assert torch.allclose(block(x), routed + shared(x), atol=1e-7)


def test_step0_values_every_expert_its_own_and_dense_blocks_unchanged():
    spec = replace(MOE, layers=4, moe_every=2)
    moe, dense = GPT(spec, seed=7), GPT(replace(spec, experts=0, moe_every=1), seed=7)
    dense_state, moe_state = dense.state_dict(), moe.state_dict()
    for name, value in moe_state.items():  # the embedding, head, dense blocks and every attention: as dense
        if ".mlp." not in name or not moe.h[int(name.split(".")[1])].sparse:
            assert torch.equal(value, dense_state[name]), name
    for i in spec.sparse_layers:
        mlp = moe.h[i].mlp
        fcs = [e.c_fc.weight for e in mlp.experts]
        assert all(not torch.equal(fcs[a], fcs[b]) for a in range(4) for b in range(a + 1, 4))
        projs = torch.cat([e.c_proj.weight.reshape(-1) for e in mlp.experts])
        assert projs.std().item() == pytest.approx(INIT_STD / (2 * spec.layers) ** 0.5, rel=0.1)
        assert mlp.router.weight.std().item() == pytest.approx(INIT_STD, rel=0.15)
    again = GPT(spec, seed=7)
    assert all(torch.equal(p, moe_state[n]) for n, p in again.state_dict().items())
    block = Block(spec, index=1, seed=7)  # built alone (a pipeline stage, a partitioned build): the same draws
    assert all(torch.equal(p, moe_state[f"h.1.{n}"]) for n, p in block.state_dict().items())


def test_a_pipeline_of_a_mixture_of_experts_has_its_sparse_blocks_as_layers():
    """The pipeline's layers are the model's own: each sparse block a Block holding its SparseMLP (the runtime's
    wire_stage gives a stage's blocks their load-balancing loss's gradient)."""
    from dspipe.model.gpt import Block, SparseMLP
    from dspipe.model.pipeline import layer_specs

    specs = layer_specs(model=MOE, seed=0)
    blocks = [spec.build() for spec in specs if spec.typename is Block]
    assert len(blocks) == MOE.layers
    assert [i for i, b in enumerate(blocks) if isinstance(b.mlp, SparseMLP)] == list(MOE.sparse_layers)


def test_bf16_sparse_block_routes_in_fp32():
    """In bf16 the router computes in fp32 (as DeepSpeed's gate: routes equal the fp32 block's on the same bf16
    values; transformers' router, in the model's dtype, may route differently) and the top-k weights are cast to
    bf16 before weighing the experts' outputs; the aux loss stays fp32."""
    import copy

    ours, _ = _sparse_pair("qwen3_moe", experts=16, k=2, norm=True)
    low = copy.deepcopy(ours).to(torch.bfloat16)
    high = copy.deepcopy(low).float()  # the same (bf16-representable) weights in fp32
    x = (torch.randn(4, 64, 16, generator=torch.Generator().manual_seed(3)) * 3).to(torch.bfloat16)
    with torch.no_grad():
        a, b = low(x), high(x.float())
    assert a.dtype == torch.bfloat16 and low.aux.dtype == torch.float32
    assert low.aux.item() == high.aux.item()  # the same routes and probabilities
    assert (a.float() - b).abs().max().item() <= 0.02 * b.abs().max().item()


def test_init_from_takes_the_training_only_settings_and_refuses_architecture_ones(tmp_path, capsys):
    """--aux-loss-coef and --capacity-factor change how a mixture of experts trains, not what it computes: with
    --init-from they replace the config's (as --dropout does); --experts-per-token is the architecture's."""
    from dspipe.rundir import load_run
    from tests.helpers import run_cli

    d, _ = _family_dir(tmp_path, "mixtral")
    cpu2 = ["--nodes", "1", "--gpus-per-node", "2", "--gpu", "cpu"]
    out = tmp_path / "run"
    code = run_cli(
        "gen-config",
        *cpu2,
        "--init-from",
        d,
        "--aux-loss-coef",
        "0.01",
        "--capacity-factor",
        "1.5",
        "--zero",
        "2",
        "--ep",
        "2",
        "--data",
        tmp_path / "nodata",
        "--out",
        out,
    )
    assert code == 0, capsys.readouterr().err
    model = load_run(out).model
    assert (model.aux_loss_coef, model.capacity_factor, model.experts, model.experts_per_token) == (0.01, 1.5, 4, 2)
    capsys.readouterr()
    assert run_cli("plan", *cpu2, "--init-from", d, "--experts-per-token", "1") == 2
    err = capsys.readouterr().err
    assert f"--experts-per-token 1 contradicts --init-from {d} (experts_per_token 2 from its config.json)" in err
    assert len(err.strip().splitlines()) == 1
    assert run_cli("plan", *cpu2, "--init-from", d, "--router-score", "sigmoid") == 2
    err = capsys.readouterr().err
    assert f"--router-score sigmoid contradicts --init-from {d}" in err and len(err.strip().splitlines()) == 1


def test_each_expert_draws_from_its_own_stream():
    """A rank that holds experts 2-3 only (ep 2) builds them without drawing experts 0-1: each expert's values come
    from expert_generator(seed, block, expert), the same whether the others are drawn or not, and all differ."""
    from dspipe.model.initial import expert_generator

    gpt = GPT(MOE, seed=7)
    resid_std = INIT_STD / (2 * MOE.layers) ** 0.5
    for block in MOE.sparse_layers:
        experts = gpt.h[block].mlp.experts
        for e, mlp in enumerate(experts):
            gen = expert_generator(7, block=block, expert=e)
            fc = torch.randn(mlp.c_fc.weight.shape, generator=gen) * INIT_STD
            proj = torch.randn(mlp.c_proj.weight.shape, generator=gen) * resid_std
            assert torch.equal(mlp.c_fc.weight, fc) and torch.equal(mlp.c_proj.weight, proj)
        assert not torch.equal(experts[0].c_fc.weight, experts[1].c_fc.weight)
    assert not torch.equal(gpt.h[0].mlp.experts[0].c_fc.weight, gpt.h[1].mlp.experts[0].c_fc.weight)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif("not torch.cuda.is_available()"))]
)
def test_expert_counts_are_bincounts_without_a_host_wait(device):
    from dspipe.model.gpt import expert_counts

    chosen = torch.tensor([[0, 3], [3, 5], [0, 3], [5, 0]], device=device)  # experts 1, 2 and 4: no route
    want = torch.bincount(chosen.reshape(-1).cpu(), minlength=6)
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")  # a read back to the host raises
    try:
        got = expert_counts(chosen, num_experts=6)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    assert got.dtype == torch.long and got.device.type == device
    assert got.tolist() == want.tolist() == [3, 0, 0, 3, 0, 2]
