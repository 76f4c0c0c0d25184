"""dspipe.runtime.build under expert parallelism, in one process with a fake ep rank: a rank materialises the dense
parameters and its own experts only (the others stay on the meta device, never drawn nor read), with bitwise the
values of the whole build; DeepSpeed's MoE layer is then built from those local experts; what the rank holds is
the planner's count."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from dspipe.spec.model import ModelSpec  # noqa: E402

EXPERTS = 4


def spec(**fields) -> ModelSpec:
    base = dict(
        name="moe",
        layers=3,
        hidden=32,
        heads=4,
        vocab=64,
        seq_len=16,
        ffn=48,
        norm="rmsnorm",
        mlp="swiglu",
        positions="rope",
        bias=False,
        experts=EXPERTS,
        experts_per_token=2,
        expert_ffn=24,
        shared_experts=1,
        moe_every=1,
        moe_first_dense=1,
    )
    return ModelSpec(**{**base, **fields})


def fake_run(*, ep: int, precision: str = "fp32", **fields):
    plan = SimpleNamespace(zero_stage=2, pp=1, tp=1, sp=1, precision=precision, ep=ep, dp=2)
    return SimpleNamespace(
        model=spec(**fields), plan=plan, strategy=None, train=SimpleNamespace(init_from=None, seed=1234)
    )


def is_remote(name: str, local: range) -> bool:
    parts = name.split(".")
    return "experts" in parts and int(parts[parts.index("experts") + 1]) not in local


@pytest.mark.parametrize("shape", [(5,), (16,), (3, 7), (24, 32), (1 << 16,), (3, (1 << 16) + 5), (17, 1 << 14)])
def test_a_skipped_draw_moves_the_generator_as_the_draw(shape):
    from dspipe.model.initial import _generator, _normal

    drawn, skipped = _generator(7, 1), _generator(7, 1)
    _normal(drawn, shape, 0.02)()
    _normal(skipped, shape, 0.02).skip()
    assert torch.equal(drawn.get_state(), skipped.get_state())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_ep_rank_builds_dense_and_its_own_experts_only_with_the_whole_builds_values(precision):
    from dspipe.model.gpt import GPT
    from dspipe.planner.stages import stage_params
    from dspipe.runtime.build import build_module

    whole = dict(build_module(fake_run(ep=1, precision=precision), rank=1).named_parameters())
    reference = GPT(fake_run(ep=1).model, seed=1234).to(next(iter(whole.values())).dtype)  # the plain model's step 0
    assert all(torch.equal(p, whole[n]) for n, p in reference.named_parameters())
    for rank, local in ((0, range(0, 2)), (1, range(2, 4)), (3, range(2, 4))):
        run = fake_run(ep=2, precision=precision)
        model = build_module(run, rank=rank)
        params = dict(model.named_parameters())
        assert params.keys() == whole.keys()
        remote = [n for n in params if is_remote(n, local)]
        assert len(remote) == 2 * 2 * 2  # 2 sparse blocks x 2 other experts x (c_fc, c_proj)
        assert all(params[n].is_meta for n in remote)
        held = [n for n in params if n not in remote]
        assert not any(params[n].is_meta for n in held)
        assert all(torch.equal(params[n], whole[n]) for n in held), rank  # bitwise, dense and local experts
        built = sum(params[n].numel() for n in held)
        assert built == stage_params(model=run.model, pp=1, partition_method="parameters", tp=1, ep=2)[0]
        assert built < run.model.num_params


def test_an_import_reads_only_this_ranks_experts():
    from dspipe.runtime.build import _materialised

    run = fake_run(ep=2)
    source = dict(build_module_whole(run).named_parameters())

    class Weights:  # HFWeights' interface load_into_module uses: each tensor whole, by the model's name
        read = []

        def full(self, name):
            self.read.append(name)
            return source[name].float() + 1

    model = _materialised(run, weights=Weights(), local=range(0, 2))  # the CPU accelerator: the host
    remote = {n for n in source if is_remote(n, range(0, 2))}
    assert set(Weights.read) == source.keys() - remote and remote
    for n, p in model.named_parameters():
        assert p.is_meta if n in remote else torch.equal(p, source[n] + 1)


def build_module_whole(run):
    from dspipe.model.gpt import GPT

    return GPT(run.model, seed=5)


def test_native_moe_built_from_the_local_experts():
    import deepspeed.comm.comm as ds_comm

    from dspipe.runtime.build import build_module
    from dspipe.runtime.moe import install

    whole = build_module(fake_run(ep=1), rank=1)
    run = fake_run(ep=2)
    model = build_module(run, rank=1)
    try:
        install(model, spec=run.model, ep=2, ep_rank=1)  # builds no process group (that is forward's)
    finally:
        ds_comm.cdb = None
    assert not any(p.is_meta for p in model.parameters())
    for i in run.model.sparse_layers:
        experts = model.h[i].mlp.moe.deepspeed_moe.experts.deepspeed_experts
        assert len(experts) == 2
        for j, expert in enumerate(experts):
            want = whole.h[i].mlp.experts[2 + j]
            assert all(torch.equal(a, b) for a, b in zip(expert.parameters(), want.parameters(), strict=True))
        assert torch.equal(model.h[i].mlp.gate_weight, whole.h[i].mlp.router.weight)


def _stage_layers(maker, run):
    """Every pipeline layer made by `maker` as a LayerSpec makes it (dspipe.model.pipeline.layer_specs)."""
    from dspipe.model.pipeline import layer_specs

    return [spec.build() for spec in layer_specs(model=run.model, seed=run.train.seed, make=maker)]


@pytest.mark.parametrize("imported", [False, True])
def test_a_pipeline_stage_makes_each_layer_with_this_ranks_experts_only(imported):
    """The stage build under expert parallelism (pp > 1): each layer made on the meta device, its dense parameters
    and this rank's experts drawn (or read: only theirs) with the whole model's values bitwise, the other experts
    placeholders without parameters (PipelineModule moves every layer to the device; a meta tensor cannot move),
    and every layer read under its own GPT names (h.N., embed., final., lm_head.)."""
    from dspipe.model.gpt import GPT, Block
    from dspipe.runtime.build import _layer_maker
    from dspipe.runtime.moe import ExpertElsewhere

    run = fake_run(ep=2, tied_embeddings=False)
    whole = dict(GPT(run.model, seed=run.train.seed).named_parameters())
    read = []

    class Weights:  # HFWeights' interface load_into_module uses: each tensor whole, by the model's name
        def full(self, name):
            read.append(name)
            return whole[name].float() + 1

    local = range(2, 4)
    layers = _stage_layers(_layer_maker(weights=Weights() if imported else None, local=local), run)
    prefixes = ["embed.", *(f"h.{i}." for i in range(run.model.layers)), "final.", "lm_head."]
    held = {}
    for prefix, layer in zip(prefixes, layers, strict=True):
        held.update({prefix + n: p for n, p in layer.named_parameters()})
        if isinstance(layer, Block) and layer.sparse:
            kinds = [type(x) for x in layer.mlp.experts]
            assert [k is ExpertElsewhere for k in kinds] == [e not in local for e in range(EXPERTS)]
        layer.to("cpu")  # what PipelineModule does to every layer
    remote = {n for n in whole if is_remote(n, local)}
    assert remote and held.keys() == whole.keys() - remote
    assert not any(p.is_meta for p in held.values())
    shift = 1 if imported else 0
    assert all(torch.equal(p, whole[n] + shift) for n, p in held.items())  # bitwise: drawn, or read + 1
    assert set(read) == (held.keys() if imported else set())
