"""The plain GPT and the pipeline's layer list compute the same function from the same weights."""

import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from dspipe.model.gpt import GPT
from dspipe.model.pipeline import layer_specs
from dspipe.runtime.parallelize import recompute
from dspipe.spec.presets import MODEL_PRESETS, model_preset

SPEC = model_preset("tiny")


def batch(spec=SPEC, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, spec.vocab, (b, spec.seq_len + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_the_spec(tied):
    spec = model_preset("tiny", tied_embeddings=tied)
    assert sum(p.numel() for p in GPT(spec, seed=1).parameters()) == spec.num_params


def test_initial_loss_is_about_ln_vocab():
    x, y = batch()
    loss = GPT(SPEC, seed=1)(x, y).item()
    assert abs(loss - math.log(SPEC.vocab)) < 0.05


def test_same_seed_same_weights_different_seed_different():
    a, b, c = GPT(SPEC, seed=1), GPT(SPEC, seed=1), GPT(SPEC, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.h[0].attn.c_attn.weight, c.h[0].attn.c_attn.weight)


def test_hf_gpt2_names():
    names = set(dict(GPT(SPEC, seed=1).named_parameters()))
    for n in (
        "embed.wte.weight",
        "embed.wpe.weight",
        "h.0.ln_1.weight",
        "h.0.attn.c_attn.weight",
        "h.0.attn.c_proj.bias",
        "h.1.ln_2.bias",
        "h.1.mlp.c_fc.weight",
        "h.1.mlp.c_proj.weight",
        "final.ln_f.weight",
    ):
        assert n in names


@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_layers_in_sequence_equal_the_plain_model(tied):
    spec = model_preset("tiny", tied_embeddings=tied)
    x, y = batch(spec)
    expected = GPT(spec, seed=7)(x)
    h = x
    for layer_spec in layer_specs(model=spec, seed=7):
        module = layer_spec.build()
        forward_fn = getattr(layer_spec, "forward_fn", None)
        h = forward_fn(module, h) if forward_fn else module(h)
    assert torch.equal(h, expected)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_changes_no_gradient(mode):
    x, y = batch()
    ref, ckpt = GPT(SPEC, seed=3), GPT(SPEC, seed=3)
    recompute(ckpt, mode=mode, checkpoint_fn=lambda fn, *args: checkpoint(fn, *args, use_reentrant=False))
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def counting_sdpa(*a, **k):
        calls.append(1)
        return original(*a, **k)

    ref(x, y).backward()
    torch.nn.functional.scaled_dot_product_attention = counting_sdpa
    try:
        ckpt(x, y).backward()
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
    assert len(calls) == 2 * SPEC.layers  # attention ran again in backward: recomputation really happened
    for (n, p), q in zip(ref.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_every_parameter_of_every_preset_declares_its_initial_value(name):
    """Built on the meta device (no memory), every parameter has exactly one declared step-0 draw of its shape."""
    from dspipe.model.gpt import initial_values

    with torch.device("meta"):
        model = GPT(MODEL_PRESETS[name], seed=None)
    declared = [p for p, _ in initial_values(model, seed=0)]
    assert sorted(map(id, declared)) == sorted(id(p) for p in model.parameters())


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_meta_built_model_filled_in_its_dtype_equals_the_plain_build(name, dtype):
    """The runner's device/host build (meta device, materialised in the training dtype, filled tensor by tensor)
    gives the plain fp32 build's weights cast once, bitwise; a component left out of fill is an error."""
    from dspipe.model.gpt import fill

    spec = model_preset(name)
    plain = GPT(spec, seed=5).state_dict()
    with torch.device("meta"):
        model = GPT(spec, seed=None)
    model = model.to(dtype=dtype).to_empty(device="cpu")
    assert fill(model, seed=5) == len(plain)
    assert all(torch.equal(v, plain[k].to(dtype)) and v.dtype == dtype for k, v in model.state_dict().items())
    model.extra = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match=r"no initial value declared for \['extra.weight'"):
        fill(model, seed=5)
