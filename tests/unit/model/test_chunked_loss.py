"""The chunked cross-entropy (strategy.loss_chunk) gives lm_loss's losses and gradients without the full logits."""

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dspipe.model.gpt import GPT, lm_loss
from dspipe.model.loss import IGNORE_INDEX, HeadLoss, chunked_cross_entropy, liger_chunk, liger_mem_const
from dspipe.spec.presets import model_preset

GPT2 = model_preset("tiny")  # tied head, learned positions, LayerNorm, GELU
LLAMA = model_preset("tiny-llama")  # untied head, RMSNorm, SwiGLU, rotary, grouped-query attention
TOL = 1e-5  # fp32, relative to the largest magnitude


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def _batch(spec, *, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, spec.vocab, (b, spec.seq_len + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _head_inputs(spec, *, seed=0, b=2):
    """The final norm's output of the real model (b, s, h) and its head weight, as leaves."""
    model = GPT(spec, seed=seed)
    idx, labels = _batch(spec, b=b, seed=seed)
    with torch.no_grad():
        x = model.embed(idx)
        for block in model.h:
            x = block(x)
        x = model.final(x)
    return x.clone().requires_grad_(), model.head_weight.detach().clone().requires_grad_(), labels


def _both(hidden, weight, labels, *, chunk, grad_scale=1.0):
    plain = lm_loss(F.linear(hidden, weight), labels)
    plain_grads = torch.autograd.grad(plain * grad_scale, (hidden, weight))
    chunked = chunked_cross_entropy(hidden, weight, labels, chunk=chunk)
    chunked_grads = torch.autograd.grad(chunked * grad_scale, (hidden, weight))
    return (plain, *plain_grads), (chunked, *chunked_grads)


@pytest.mark.parametrize("spec", [GPT2, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("chunk", [32, 37, 100, 128, 5000])  # divides 128 tokens, does not, one chunk, > tokens
def test_chunked_loss_and_gradients_equal_the_plain_path(spec, chunk):
    hidden, weight, labels = _head_inputs(spec)
    assert hidden.shape[:2].numel() == 128
    want, got = _both(hidden, weight, labels, chunk=chunk, grad_scale=3.0)  # a grad_output other than 1
    for name, a, b in zip(("loss", "d hidden", "d weight"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert _rel(a, b) <= TOL, (name, _rel(a, b))


def test_ignored_labels_count_neither_in_the_loss_nor_in_its_mean():
    hidden, weight, labels = _head_inputs(LLAMA)
    labels = labels.clone()
    labels[0, :10] = IGNORE_INDEX
    labels[1, -3:] = IGNORE_INDEX
    want, got = _both(hidden, weight, labels, chunk=24)
    assert all(_rel(a, b) <= TOL for a, b in zip(got, want, strict=True))
    assert got[1][0, :10].abs().max() == 0  # no gradient from an ignored position


def test_bf16_activations_match_the_plain_path_to_bf16_rounding():
    hidden, weight, labels = _head_inputs(LLAMA)
    hidden = hidden.detach().bfloat16().requires_grad_()
    weight = weight.detach().bfloat16().requires_grad_()
    want, got = _both(hidden, weight, labels, chunk=48)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    assert _rel(got[0], want[0]) <= 1e-5  # both softmaxes in fp32 of the same bf16 logits
    assert _rel(got[1], want[1]) < 2e-2 and _rel(got[2], want[2]) < 2e-2  # bf16 ulps: 2^-8 = 0.4%


@pytest.mark.parametrize("spec", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_whole_gpt_with_loss_chunk_gives_the_same_loss_and_parameter_gradients(spec):
    idx, labels = _batch(spec, b=3)
    plain, chunked = GPT(spec, seed=3), GPT(spec, seed=3)
    chunked.head_loss = HeadLoss(chunk=40, use_liger=False)
    a, b = plain(idx, labels), chunked(idx, labels)
    a.backward()
    b.backward()
    assert chunked.head_loss.last_kernel == "chunked"
    assert _rel(b.detach(), a.detach()) <= TOL
    assert torch.equal(chunked.last_lm_loss, b.detach())
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters(), strict=True):
        assert _rel(q.grad, p.grad) <= TOL, name
    assert torch.equal(chunked(idx), plain(idx))  # without labels: the logits, as before


def _saved_bytes(fn, *, inputs) -> int:
    """Bytes of the tensors the autograd graph of fn() saves for backward beyond `inputs` (measured by saved-tensor
    hooks; a storage saved twice counted once)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs}
    total = 0

    def pack(t):
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


class _PeakBytes(TorchDispatchMode):
    """Measures the bytes of tensor storages allocated while it is on: each op's outputs whose storage is not one of
    its inputs' (a view is no allocation) count from their creation until their storage is freed (a weakref
    finalizer on the storage); `now` and `peak` in bytes."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in inputs and key not in self.live:
                self.live[key] = storage.nbytes()
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self._freed, key)
        return out

    def _freed(self, key):
        self.now -= self.live.pop(key, 0)


def _peak_of_step(loss_fn, hidden, weight) -> tuple[int, int]:
    """(peak, held after the forward) bytes allocated by loss_fn()'s forward and backward, measured."""
    with _PeakBytes() as mem:
        loss = loss_fn()
        held = mem.now
        loss.backward()
        peak = mem.peak
    hidden.grad = weight.grad = None
    return peak, held


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peak_memory_holds_one_chunk_of_logits_measured(dtype):
    """Measured by tracking every storage the loss allocates: the plain loss peaks at three fp32 (N, V)
    tensors (the upcast logits, log_softmax's output, their gradient); the chunked one at the gradients of hidden
    and weight (which the plain path makes too) and one chunk: c x V x (4 + b) bytes (fp32 logits, the 16-bit
    matmul output or gradient beside them), within 5%."""
    tokens, h, v = 512, 64, 4096
    b = torch.finfo(dtype).bits // 8
    hidden = torch.randn(tokens, h).to(dtype).requires_grad_()
    weight = torch.randn(v, h).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (tokens,))
    grads = hidden.nbytes + weight.nbytes
    plain, plain_held = _peak_of_step(lambda: lm_loss(F.linear(hidden, weight), labels), hidden, weight)
    assert plain >= 3 * tokens * v * 4 and plain_held >= tokens * v * 4
    for chunk in (32, 128):
        peak, held = _peak_of_step(
            lambda chunk=chunk: chunked_cross_entropy(hidden, weight, labels, chunk=chunk), hidden, weight
        )
        one_chunk = chunk * v * (4 + (b if b != 4 else 0))
        assert held < 4 * tokens + 64  # the fp32 log-sum-exp (and scalars): no logits kept
        assert abs(peak - grads - one_chunk) <= 0.05 * one_chunk, (chunk, peak, grads, one_chunk)
        assert peak < plain / 5


def test_the_graph_keeps_no_logits_measured_by_saved_tensor_hooks():
    """Measured: what the autograd graph saves for backward. The plain loss keeps log_softmax's fp32 (N, V) output;
    the chunked one only the fp32 log-sum-exp per token (besides the head's input, weight and labels, which both
    keep), whatever the chunk."""
    tokens, h, v = 512, 64, 4096
    hidden = torch.randn(tokens, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (tokens,))
    inputs = (hidden, weight, labels)
    plain = _saved_bytes(lambda: lm_loss(F.linear(hidden, weight), labels), inputs=inputs)
    assert tokens * v * 4 <= plain <= tokens * v * 4 + 64
    for chunk in (64, 500):
        chunked = _saved_bytes(
            lambda chunk=chunk: chunked_cross_entropy(hidden, weight, labels, chunk=chunk), inputs=inputs
        )
        assert chunked == tokens * 4 + 8  # the fp32 log-sum-exp per token and the label count


def test_liger_chunk_rule_and_the_mem_const_that_honours_loss_chunk():
    # liger 0.8.5's own example: 16,384 tokens, V 32,000, h 4,096 -> 8 parts of 2,048 tokens
    assert liger_chunk(tokens=4096 * 4, vocab=32000, hidden=4096) == 2048
    assert liger_chunk(tokens=100, vocab=10, hidden=64) == 100  # never more than the tokens
    const = liger_mem_const(tokens=8192, vocab=128256, hidden=4096, chunk=1024)
    assert liger_chunk(tokens=8192, vocab=128256, hidden=4096, mem_const=const) <= 1024
    assert liger_chunk(tokens=8192, vocab=128256, hidden=4096, mem_const=const + 1) > 1024
    assert liger_mem_const(tokens=8192, vocab=128256, hidden=4096, chunk=8) == 1  # liger's smallest chunk


def test_head_loss_runs_the_chunked_path_off_cuda_and_says_so():
    loss = HeadLoss(chunk=16, use_liger=True)
    assert loss.kernel("cpu") == "chunked" and loss.kernel("cuda") == "liger"
    assert "16 tokens per chunk" in loss.describe("cpu") and "liger" in loss.describe("cuda")
    hidden, weight, labels = _head_inputs(GPT2)
    assert _rel(loss(hidden, weight, labels).detach(), lm_loss(F.linear(hidden, weight), labels).detach()) <= TOL
    assert loss.last_kernel == "chunked"
    with pytest.raises(ValueError, match="got 0"):
        HeadLoss(chunk=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="liger-kernel's fused loss runs on CUDA only")
@pytest.mark.parametrize("kernel", ["chunked", "liger"])
def test_on_cuda_each_kernel_gives_the_plain_loss_and_gradients(kernel):
    """GPU only (skipped here): HeadLoss on CUDA tensors, the chunked path and liger's (pip install .[gpu]), against
    the plain path in fp32 (<= 1e-5) and bf16 (bf16 rounding), a Llama-3-like head (V 32,000 x 512, 1,000 tokens:
    neither the chunk nor liger's divides them)."""
    from dspipe.model.loss import liger_available

    if kernel == "liger" and not liger_available():
        pytest.skip("liger-kernel is not installed (pip install .[gpu])")
    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, TOL), (torch.bfloat16, 2e-2)):
        hidden = torch.randn(1000, 512, generator=gen).cuda().to(dtype).requires_grad_()
        weight = (torch.randn(32000, 512, generator=gen) * 0.02).cuda().to(dtype).requires_grad_()
        labels = torch.randint(0, 32000, (1000,), generator=gen).cuda()
        labels[:7] = IGNORE_INDEX
        loss_fn = HeadLoss(chunk=300, use_liger=kernel == "liger")
        got = loss_fn(hidden, weight, labels)
        assert loss_fn.last_kernel == kernel and got.dtype == torch.float32
        got_grads = torch.autograd.grad(got * 2.0, (hidden, weight))
        want = lm_loss(F.linear(hidden, weight), labels)
        want_grads = torch.autograd.grad(want * 2.0, (hidden, weight))
        assert _rel(got.detach(), want.detach()) <= (TOL if dtype == torch.float32 else 1e-3), dtype
        for a, b in zip(got_grads, want_grads, strict=True):
            assert a.dtype == b.dtype and _rel(a, b) <= tol, (dtype, _rel(a, b))
