"""A GPT-2 style decoder in plain PyTorch. No distributed code here: the pipeline wrapper reuses these blocks.

Parameter names follow Hugging Face GPT-2 (wte, wpe, h.N.ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
mlp.c_proj, ln_f) so an export is a rename plus a transpose of the Linear weights (HF uses Conv1D).
Every component initialises itself from (seed, its index), so the plain model and any pipeline layout
start from identical weights.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dspipe.planner.spec import ModelSpec

INIT_STD = 0.02
EMBED_INDEX = 0  # block i uses index i + 1; an untied head uses layers + 1


def _generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 100_003 + index)


def _init_linear(linear: nn.Linear, gen: torch.Generator, std: float) -> None:
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * std)
        linear.bias.zero_()


class Embedding(nn.Module):
    """Token + learned position embeddings; `logits` reuses wte as the tied output head."""

    def __init__(self, spec: ModelSpec, *, seed: int):
        super().__init__()
        self.wte = nn.Embedding(spec.vocab, spec.hidden)
        self.wpe = nn.Embedding(spec.seq_len, spec.hidden)
        self.drop = nn.Dropout(spec.dropout)
        gen = _generator(seed, EMBED_INDEX)
        with torch.no_grad():
            self.wte.weight.copy_(torch.randn(self.wte.weight.shape, generator=gen) * INIT_STD)
            self.wpe.weight.copy_(torch.randn(self.wpe.weight.shape, generator=gen) * INIT_STD)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.wte.weight)


class Attention(nn.Module):
    """Causal multi-head self-attention through scaled_dot_product_attention (flash/memory-efficient kernels)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.heads, self.dropout = spec.heads, spec.dropout
        self.c_attn = nn.Linear(spec.hidden, 3 * spec.hidden)
        self.c_proj = nn.Linear(spec.hidden, spec.hidden)
        self.resid_drop = nn.Dropout(spec.dropout)
        self.core_checkpoint: Callable | None = None
        """Set to a checkpoint function to recompute the attention core in backward (selective recomputation)."""

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2)
                   for t in self.c_attn(x).split(h, dim=2))
        y = self.core_checkpoint(self._core, q, k, v) if self.core_checkpoint else self._core(q, k, v)
        return self.resid_drop(self.c_proj(y.transpose(1, 2).reshape(b, s, h)))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.c_fc = nn.Linear(spec.hidden, spec.ffn)
        self.c_proj = nn.Linear(spec.ffn, spec.hidden)
        self.drop = nn.Dropout(spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, spec: ModelSpec, *, index: int, seed: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(spec.hidden)
        self.attn = Attention(spec)
        self.ln_2 = nn.LayerNorm(spec.hidden)
        self.mlp = MLP(spec)
        gen = _generator(seed, index + 1)
        resid_std = INIT_STD / math.sqrt(2 * spec.layers)  # GPT-2: scale residual projections by 1/sqrt(2L)
        for linear, std in ((self.attn.c_attn, INIT_STD), (self.attn.c_proj, resid_std),
                            (self.mlp.c_fc, INIT_STD), (self.mlp.c_proj, resid_std)):
            _init_linear(linear, gen, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class FinalNorm(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.ln_f = nn.LayerNorm(spec.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)


class LMHead(nn.Module):
    """Untied output projection (only when tied_embeddings is off)."""

    def __init__(self, spec: ModelSpec, *, seed: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(spec.vocab, spec.hidden, generator=_generator(seed, spec.layers + 1))
                                   * INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the activation dtype."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


class GPT(nn.Module):
    def __init__(self, spec: ModelSpec, *, seed: int):
        super().__init__()
        self.spec = spec
        self.embed = Embedding(spec, seed=seed)
        self.h = nn.ModuleList(Block(spec, index=i, seed=seed) for i in range(spec.layers))
        self.final = FinalNorm(spec)
        self.lm_head = None if spec.tied_embeddings else LMHead(spec, seed=seed)
        self.block_checkpoint: Callable | None = None

    def set_recomputation(self, mode: str, checkpoint_fn: Callable | None) -> None:
        """none; full: recompute each block in backward; selective: recompute only the attention core."""
        self.block_checkpoint = checkpoint_fn if mode == "full" else None
        for block in self.h:
            block.attn.core_checkpoint = checkpoint_fn if mode == "selective" else None

    def forward(self, idx: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (b, s, V), or the mean loss when labels are given."""
        x = self.embed(idx)
        for block in self.h:
            x = self.block_checkpoint(block, x) if self.block_checkpoint and self.training else block(x)
        x = self.final(x)
        logits = self.embed.logits(x) if self.lm_head is None else self.lm_head(x)
        return logits if labels is None else lm_loss(logits, labels)
