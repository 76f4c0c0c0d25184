"""Mean next-token cross-entropy of a bias-free linear head without its full logits (strategy.loss_chunk).

A 128K-152K vocabulary makes the head's logits the largest activation: lm_loss keeps log_softmax's fp32 output,
4 x V bytes per token (8,192 tokens x 128,256 x 4 = 4 GiB per sequence). ChunkedLinearCrossEntropy computes
the same loss `chunk` tokens at a time so that only one chunk's logits exist at once, keeping per token only the
fp32 log-sum-exp (4 bytes); its backward recomputes each chunk's logits (one more head matmul: the price of not
keeping them) and gives exactly what lm_loss's gradients are, (softmax - one-hot) x grad / count.

Numerics match lm_loss: the head's matmul in the activation dtype (as F.linear), the softmax in fp32, the mean over
the labels that are not IGNORE_INDEX (F.cross_entropy's default; dspipe's own batches have none). The weight's
gradient accumulates over the chunks in the weight's dtype (fp32: exact to rounding; 16-bit: one rounding per
chunk, where the plain head rounds once).

On CUDA with liger-kernel installed (`pip install .[gpu]`) HeadLoss uses its fused linear cross-entropy instead
(Triton; it computes the gradients in the forward and keeps them for the backward), with its chunk at most
`chunk` tokens where its chunk rule allows (liger_chunk). Torch only: no deepspeed, no distributed code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Labels that count neither in the loss nor in its mean (F.cross_entropy's default)."""


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One chunk's logits as fp32 storage of its own (the matmul in the activation dtype, as F.linear)."""
    logits = F.linear(hidden, weight)
    return logits if logits.dtype == torch.float32 else logits.float()


def _log_sum_exp_(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise log-sum-exp of fp32 `logits`, overwriting them (no second chunk-sized tensor)."""
    top = logits.amax(dim=1, keepdim=True)
    sums = logits.sub_(top).exp_().sum(dim=1)
    return sums.log_().add_(top.squeeze(1))


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """apply(hidden (N, h), weight (V, h), labels (N,), chunk) -> mean cross-entropy of hidden @ weight.T, fp32.
    Saves hidden, weight, labels and the fp32 log-sum-exp of every row; no (N, V) tensor is ever made."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        rows = hidden.shape[0]
        valid = labels != IGNORE_INDEX
        lse = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, rows, chunk):
            part = slice(start, min(start + chunk, rows))
            logits = _chunk_logits(hidden[part], weight)
            target = logits.gather(1, labels[part].clamp(min=0).unsqueeze(1)).squeeze(1)
            lse[part] = _log_sum_exp_(logits)
            del logits
            total += ((lse[part] - target) * valid[part]).sum()
        count = valid.sum()
        ctx.save_for_backward(hidden, weight, labels, lse, count)
        ctx.chunk = chunk
        return total / count

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, labels, lse, count = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        if not (want_hidden or want_weight):
            return None, None, None, None
        scale = (labels != IGNORE_INDEX) * (grad.float() / count)  # per row: 0 for an ignored label
        rows, chunk = hidden.shape[0], ctx.chunk
        for start in range(0, rows, chunk):
            part = slice(start, min(start + chunk, rows))
            probs = _chunk_logits(hidden[part], weight).sub_(lse[part].unsqueeze(1)).exp_()  # the softmax
            probs.scatter_add_(
                1, labels[part].clamp(min=0).unsqueeze(1), torch.full((probs.shape[0], 1), -1.0, device=probs.device)
            )
            dlogits = probs.mul_(scale[part].unsqueeze(1)).to(hidden.dtype)
            del probs
            if want_hidden:
                torch.mm(dlogits, weight, out=grad_hidden[part])
            if want_weight:
                grad_weight.addmm_(dlogits.t(), hidden[part])
            del dlogits
        return grad_hidden, grad_weight, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk: int
) -> torch.Tensor:
    """Mean cross-entropy of F.linear(hidden, weight) against `labels` (hidden (..., h), labels (...)), computed
    `chunk` tokens at a time; equal to lm_loss(F.linear(hidden, weight), labels) in value and gradients."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    return ChunkedLinearCrossEntropy.apply(flat, weight, labels.reshape(-1), chunk)


def liger_chunk(*, tokens: int, vocab: int, hidden: int, mem_const: int = 1) -> int:
    """Tokens per chunk of liger-kernel's fused linear cross-entropy (0.8.5, as documented in its source): the
    transient logits bounded by about mem_const x tokens x hidden elements, i.e. tokens / ceil(V / (mem_const x h))
    rounded up to a power of two, at most the tokens."""
    parts = -(-vocab // (mem_const * hidden))
    per = -(-tokens // parts)
    return min(tokens, 1 << (per - 1).bit_length())


def liger_mem_const(*, tokens: int, vocab: int, hidden: int, chunk: int) -> int:
    """The largest chunk_mem_const whose liger chunk is at most `chunk` tokens (1, liger's smallest chunk, when
    even that is larger)."""
    best = 1
    for const in range(1, -(-vocab // hidden) + 1):  # beyond this every const gives one chunk of all the tokens
        if liger_chunk(tokens=tokens, vocab=vocab, hidden=hidden, mem_const=const) > chunk:
            break
        best = const
    return best


def liger_available() -> bool:
    """Whether liger-kernel's fused linear cross-entropy can be imported (it needs Triton, i.e. a GPU build)."""
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except Exception:  # ImportError, or Triton failing to load without a GPU
        return False
    return True


class HeadLoss:
    """(hidden, head weight, labels) -> mean loss, with at most `chunk` tokens of logits at a time: liger-kernel's
    fused linear cross-entropy for CUDA tensors when it is installed (`use_liger`), else ChunkedLinearCrossEntropy.
    `last_kernel` names what the last call ran; `kernel(device_type)` what a call on that device will run."""

    def __init__(self, *, chunk: int, use_liger: bool | None = None):
        if chunk < 1:
            raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
        self.chunk = chunk
        self.use_liger = liger_available() if use_liger is None else use_liger
        self.last_kernel: str | None = None

    def kernel(self, device_type: str) -> str:
        """'liger' or 'chunked': which implementation runs for tensors on `device_type`."""
        return "liger" if self.use_liger and device_type == "cuda" else "chunked"

    def describe(self, device_type: str) -> str:
        """One phrase for logs: 'chunked cross-entropy, 1024 tokens per chunk' or the liger equivalent."""
        if self.kernel(device_type) == "liger":
            return f"liger fused linear cross-entropy, chunks of at most {self.chunk} tokens where liger allows"
        return f"chunked cross-entropy, {self.chunk} tokens per chunk"

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.last_kernel = self.kernel(hidden.device.type)
        if self.last_kernel == "chunked":
            return chunked_cross_entropy(hidden, weight, labels, chunk=self.chunk)
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        const = liger_mem_const(tokens=flat.shape[0], vocab=weight.shape[0], hidden=flat.shape[1], chunk=self.chunk)
        # the weight's gradient summed in its own dtype, as the chunked path does (fp32 sums of a 16-bit gradient
        # would add 4 x V x h bytes at the forward's end, the step's activation peak)
        return liger_fused_linear_cross_entropy(
            flat, weight, labels.reshape(-1), ignore_index=IGNORE_INDEX, chunk_mem_const=const
        ).float()
