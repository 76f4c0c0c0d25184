"""Sliding-window attention's two kernels (dspipe.model.window): the choice by device and dropout, flex_attention's
mask_mod and block mask against window_mask, and flex_attention's outputs, losses and gradients against the masked
SDPA path (the reference) in fp32, on a GPT-2 shape and a Llama shape (grouped-query, rotary).

torch's flex_attention runs on the CPU for inference only (its entry refuses inputs that require grad there): the
forward checks call it as dspipe does; the gradient checks lift that entry check (`cpu_flex_backward`) so that its
eager implementation, torch's dense reference of the same kernel, differentiates on the CPU. The compiled CUDA
kernel itself runs only on a GPU (benchmarks/window_attention.py --check).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspipe.model import window as win
from dspipe.model.gpt import GPT, window_mask
from dspipe.planner.throughput import flex_window_tiles
from dspipe.spec.model import ModelSpec

REL = 1e-5
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

flex = pytest.importorskip("torch.nn.attention.flex_attention")


def gpt2_spec(**kw) -> ModelSpec:
    """GPT-2's block: LayerNorm, GELU MLP, learned positions, biases, tied head; heads as wide as hidden / heads."""
    base = dict(name="custom", layers=2, hidden=64, heads=4, vocab=96, seq_len=48, ffn=128, sliding_window=12)
    return ModelSpec(**{**base, **kw})


def llama_spec(**kw) -> ModelSpec:
    """Llama's block: RMSNorm, SwiGLU, rotary, grouped-query (8 heads over 2 key/value heads), no biases; the window
    from block 1 on (block 0 stays causal)."""
    base = dict(
        name="custom",
        layers=3,
        hidden=64,
        heads=8,
        kv_heads=2,
        vocab=96,
        seq_len=40,
        ffn=96,
        norm="rmsnorm",
        mlp="swiglu",
        positions="rope",
        rope_theta=10000.0,
        bias=False,
        tied_embeddings=False,
        sliding_window=9,
        window_start_layer=1,
    )
    return ModelSpec(**{**base, **kw})


SPECS = {"gpt2": gpt2_spec, "llama": llama_spec}


def assert_rel(got: torch.Tensor, want: torch.Tensor, *, what: str) -> None:
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= REL * scale, f"{what}: max |diff| {err:.3e} > {REL} x max |want| {scale:.3e}"


@pytest.fixture
def cpu_flex_backward(monkeypatch):
    """Let flex_attention's eager (dense reference) implementation take inputs that require grad on the CPU."""
    if not hasattr(flex, "_validate_device"):
        pytest.skip("torch's flex_attention has no _validate_device to lift")
    real = flex._validate_device

    def allow_cpu_grad(query, key, value):
        if query.device.type != "cpu":
            real(query, key, value)

    monkeypatch.setattr(flex, "_validate_device", allow_cpu_grad)


def set_kernel(model: GPT, kernel: str | None) -> None:
    for block in model.h:
        block.attn.window_kernel = kernel


def batch(spec: ModelSpec, *, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab, (2, spec.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


# --- the choice ---------------------------------------------------------------------------------------------------


def test_kernel_by_device_window_and_dropout():
    pick = win.choose_kernel
    assert pick(device_type="cuda", seq=64, window=16, dropout=0.0) == "flex"
    assert pick(device_type="cpu", seq=64, window=16, dropout=0.0) == "mask"
    assert pick(device_type="cuda", seq=64, window=16, dropout=0.1) == "mask"  # flex_attention has no dropout
    for device in ("cuda", "cpu"):
        assert pick(device_type=device, seq=64, window=None, dropout=0.0) == "causal"
        assert pick(device_type=device, seq=64, window=64, dropout=0.1) == "causal"
        assert pick(device_type=device, seq=64, window=16, dropout=0.0, override="flex") == "flex"
        assert pick(device_type=device, seq=64, window=16, dropout=0.1, override="mask") == "mask"
        assert pick(device_type=device, seq=64, window=80, dropout=0.0, override="flex") == "causal"


def test_kernel_overrides_refused():
    with pytest.raises(ValueError, match="'flex' has no attention dropout .dropout 0.1."):
        win.choose_kernel(device_type="cuda", seq=64, window=16, dropout=0.1, override="flex")
    with pytest.raises(ValueError, match="window kernel 'dense': expected 'mask', 'flex' or None"):
        win.choose_kernel(device_type="cpu", seq=64, window=16, dropout=0.0, override="dense")


def test_forcing_flex_with_dropout_while_training_is_refused():
    model = GPT(gpt2_spec(dropout=0.1), seed=1)
    set_kernel(model, "flex")
    idx, labels = batch(model.spec)
    with pytest.raises(ValueError, match="has no attention dropout"):
        model(idx, labels)


# --- the mask ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq,window", [(6, 3), (40, 9), (48, 1), (300, 129)])
def test_mask_mod_is_window_mask_element_by_element(seq, window):
    pos = torch.arange(seq)
    rule = win.window_rule(window)(0, 0, pos[:, None], pos[None, :])
    assert torch.equal(rule, window_mask(seq, window))


@pytest.mark.parametrize("seq,window", [(1024, 200), (1000, 128), (300, 129), (256, 1)])
def test_block_mask_keeps_exactly_the_tiles_the_window_touches(seq, window):
    """A tile is computed iff some (q, k) in it is inside the window, and computed without mask_mod (full) iff
    every one is: the block sparsity the GPU kernel skips by."""
    block = win.window_block_mask(seq, window, "cpu")
    size = block.BLOCK_SIZE[0]
    tiles = -(-seq // size)
    padded = torch.zeros(tiles * size, tiles * size, dtype=torch.bool)
    padded[:seq, :seq] = window_mask(seq, window)
    inside = padded.view(tiles, size, tiles, size).transpose(1, 2)
    some = inside.flatten(2).any(-1)
    valid = torch.zeros_like(padded)
    valid[:seq, :seq] = True
    every = (inside | ~valid.view(tiles, size, tiles, size).transpose(1, 2)).flatten(2).all(-1) & some
    assert torch.equal(block.to_dense()[0, 0].bool(), some)
    assert int(block.full_kv_num_blocks.sum()) == int(every.sum())
    assert (
        int(block.kv_num_blocks.sum() + block.full_kv_num_blocks.sum())
        == int(some.sum())
        == flex_window_tiles(seq=seq, window=window)
    )  # the planner's count of the GPU's work


def test_block_mask_is_built_once_per_seq_window_device():
    assert win.window_block_mask(96, 10, "cpu") is win.window_block_mask(96, 10, "cpu")
    assert win.window_block_mask(96, 11, "cpu") is not win.window_block_mask(96, 10, "cpu")


def test_flex_needs_as_many_keys_as_queries():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="as many keys as queries: 6 keys, 8 queries"):
        win.flex_window_attention(q, torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16), window=4)


# --- flex against the masked path --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SPECS))
def test_flex_core_is_the_masked_core(name, cpu_flex_backward):
    """One block's core (its own heads: GQA repeated, rotary applied) on the flex and the masked kernel: outputs
    and the gradients of q, k, v."""
    spec = SPECS[name]()
    attn = GPT(spec, seed=2).h[-1].attn
    x = torch.randn(2, spec.seq_len, spec.hidden, generator=torch.Generator().manual_seed(3))
    grads, outs = {}, {}
    for kernel in ("mask", "flex"):
        attn.window_kernel = kernel
        q, k, v = (t.detach().requires_grad_() for t in attn.heads(x))
        y = attn.local_core(q, k, v)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs[kernel], grads[kernel] = y.detach(), [t.grad for t in (q, k, v)]
    assert_rel(outs["flex"], outs["mask"], what=f"{name} output")
    for which, got, want in zip("qkv", grads["flex"], grads["mask"], strict=True):
        assert_rel(got, want, what=f"{name} d{which}")


@pytest.mark.parametrize("name", list(SPECS))
def test_flex_loss_is_the_masked_loss_without_grad(name):
    """flex_attention as dspipe calls it on the CPU (no lifted check: inference), whole model, under no_grad."""
    spec = SPECS[name]()
    model = GPT(spec, seed=3).eval()
    idx, labels = batch(spec)
    losses = {}
    with torch.no_grad():
        for kernel in ("mask", "flex"):
            set_kernel(model, kernel)
            losses[kernel] = model(idx, labels)
    assert_rel(losses["flex"], losses["mask"], what=f"{name} loss")


@pytest.mark.parametrize("name", list(SPECS))
def test_flex_loss_and_parameter_grads_are_the_masked_ones(name, cpu_flex_backward):
    """A whole tiny GPT trained one step's worth (train mode, dropout 0): loss and every parameter's gradient."""
    spec = SPECS[name]()
    idx, labels = batch(spec)
    runs = {}
    for kernel in ("mask", "flex"):
        model = GPT(spec, seed=3).train()
        set_kernel(model, kernel)
        loss = model(idx, labels)
        loss.backward()
        runs[kernel] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    assert_rel(runs["flex"][0], runs["mask"][0], what=f"{name} loss")
    assert runs["flex"][1].keys() == runs["mask"][1].keys()
    for n, want in runs["mask"][1].items():
        assert_rel(runs["flex"][1][n], want, what=f"{name} grad {n}")


def test_default_kernel_on_cpu_is_the_mask():
    """Unforced, a CPU model runs the masked SDPA (the reference): same loss as forcing 'mask', bit for bit."""
    spec = llama_spec()
    idx, labels = batch(spec)
    plain = GPT(spec, seed=3)(idx, labels)
    forced = GPT(spec, seed=3)
    set_kernel(forced, "mask")
    assert torch.equal(plain, forced(idx, labels))


def test_flex_differs_from_a_wrong_window():
    """The comparison can fail: one token of window more changes the flex output far beyond the tolerance."""
    spec = gpt2_spec()
    q, k, v = (
        torch.randn(1, spec.heads, spec.seq_len, spec.head_dim, generator=torch.Generator().manual_seed(i))
        for i in range(3)
    )
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(spec.seq_len, spec.sliding_window + 1))
    flexed = win.flex_window_attention(q, k, v, window=spec.sliding_window)
    assert (flexed - masked).abs().max() > 1000 * REL * masked.abs().max()


def test_a_compiled_block_runs_flex_in_one_graph_with_the_cached_mask(cpu_flex_backward):
    """A block compiled whole (fullgraph: no graph break, as --compile's blocks want) reads the cached block mask as
    a constant instead of rebuilding it in the graph, and gives the eager block's output and input gradient
    (aot_eager: dynamo and autograd's tracing, no code generation)."""
    spec = llama_spec()
    block = GPT(spec, seed=3).h[1]
    block.attn.window_kernel = "flex"
    x = torch.randn(2, spec.seq_len, spec.hidden, generator=torch.Generator().manual_seed(4))
    eager_in = x.clone().requires_grad_()
    want = block(eager_in)
    want.sum().backward()
    assert len([key for key in win._BLOCK_MASKS if key[:2] == (spec.seq_len, spec.sliding_window)]) == 1
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    compiled_in = x.clone().requires_grad_()
    got = compiled(compiled_in)
    got.sum().backward()
    assert_rel(got, want, what="compiled block output")
    assert_rel(compiled_in.grad, eager_in.grad, what="compiled block input grad")
