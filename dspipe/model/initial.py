"""How the model's parameters get their step-0 values: as draws. Every component of dspipe.model.gpt declares
its step-0 values as draws from (seed, its index) (`initial_values`; gpt.fill gives them), so the plain
model, any pipeline layout and a model whose parameters were created elsewhere (on the meta device, or partitioned
by ZeRO-3 as they were constructed) start from identical weights: whoever builds the model decides how a value
reaches its parameter (`fill`'s `write`), one tensor at a time.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
from torch import nn

INIT_STD = 0.02
EMBED_INDEX = 0  # block i uses index i + 1; an untied head uses layers + 1


def _generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 100_003 + index)


Draw = Callable[[], torch.Tensor]
"""A parameter's step-0 value, whole, fp32, on the CPU; called in declaration order (draws share a generator).
Each also has `skip()`: what a parameter this rank does not hold calls instead, so the draws after it are unchanged
(a normal draw advances its generator exactly as the whole draw would, in bounded chunks, allocating no tensor of
the parameter's size), and `blocks()`: the same values as the whole draw, as consecutive blocks of rows
(start row, block), so a writer keeps only what its parameter holds and no whole tensor is ever made."""

SKIP_CHUNK = 1 << 16
"""Elements per chunk of a skipped normal draw (a multiple of 16: torch's CPU normal fills 16-element blocks and
redraws a last partial block, so chunks of 16k elements and a whole tail consume the generator as one draw)."""
BLOCK = 1 << 22
"""Elements per block of rows a writer gets from `blocks()` (16 MiB in fp32): the most a build holds beyond its
parameters while it gives them their step-0 values."""


class _Normal:
    def __init__(self, gen: torch.Generator, shape: tuple, std: float):
        self.gen, self.shape, self.std = gen, shape, std

    def __call__(self) -> torch.Tensor:
        return torch.randn(self.shape, generator=self.gen, device="cpu", dtype=torch.float32) * self.std

    def blocks(self) -> Iterator[tuple[int, torch.Tensor]]:
        """The whole draw as blocks of rows of about BLOCK elements, each a multiple of 16 elements, and a last
        block of at least 16 (or the whole tensor): the generator is consumed exactly as by one draw."""
        if len(self.shape) < 2:
            yield 0, self()
            return
        rows, cols = self.shape[0], math.prod(self.shape[1:])
        step = 16 // math.gcd(cols, 16)  # rows whose elements are a multiple of 16
        per = max(step, BLOCK // cols // step * step)
        row = 0
        while rows - row > per and (rows - row - per) * cols >= 16:
            yield row, torch.randn((per, *self.shape[1:]), generator=self.gen, dtype=torch.float32) * self.std
            row += per
        yield row, torch.randn((rows - row, *self.shape[1:]), generator=self.gen, dtype=torch.float32) * self.std

    def skip(self) -> None:
        left = math.prod(self.shape)
        chunk = torch.empty(SKIP_CHUNK, dtype=torch.float32) if left > SKIP_CHUNK + 16 else None
        while left > SKIP_CHUNK + 16:  # the tail (over 16 elements whenever a chunk was drawn) is drawn whole
            torch.randn(SKIP_CHUNK, generator=self.gen, out=chunk)
            left -= SKIP_CHUNK
        torch.randn(left, generator=self.gen, dtype=torch.float32)


class _Constant:
    def __init__(self, shape: tuple, value: float):
        self.shape, self.value = shape, value

    def __call__(self) -> torch.Tensor:
        return torch.full(self.shape, self.value, device="cpu", dtype=torch.float32)

    def blocks(self) -> Iterator[tuple[int, torch.Tensor]]:
        yield 0, self()

    def skip(self) -> None:
        pass


class _OwnNormal(_Normal):
    """A normal draw from a generator of its own: skipping it leaves every other draw unchanged at no cost."""

    def skip(self) -> None:
        pass


def _normal(gen: torch.Generator, shape: tuple, std: float) -> Draw:
    return _Normal(gen, shape, std)


def expert_generator(seed: int, *, block: int, expert: int) -> torch.Generator:
    """Routed expert `expert` of block `block`'s own stream (distinct from every block's and from each other for
    experts < 8191): a rank that does not hold an expert (expert parallelism) neither draws nor skips its values."""
    return torch.Generator().manual_seed((seed * 100_003 + block + 1) * 8_191 + 1 + expert)


def _constant(shape: tuple, value: float) -> Draw:
    return _Constant(shape, value)


def _linear_values(linear: nn.Linear, gen: torch.Generator, std: float):
    yield linear.weight, _normal(gen, (linear.out_features, linear.in_features), std)
    if linear.bias is not None:
        yield linear.bias, _constant((linear.out_features,), 0.0)


def _norm_values(norm: nn.Module):
    """LayerNorm/RMSNorm: weight 1, bias 0 (shapes from the module, not its tensors, which may be partitioned)."""
    shape = tuple(norm.normalized_shape)
    yield norm.weight, _constant(shape, 1.0)
    if getattr(norm, "bias", None) is not None:
        yield norm.bias, _constant(shape, 0.0)


def write_blocks(param: torch.Tensor, draw, *, cut=None, rows: list[tuple[int, int]] | None = None) -> None:
    """Give `param` its step-0 value block by block (draw.blocks()), never making the whole tensor: all of it; with
    `rows`, only those row ranges of the whole (a dim-0 shard, in that order); else with `cut`, cut(block) of each
    block of rows (a shard along a later dimension). A 1-D parameter (a bias, a norm: small) is drawn whole and
    `cut` (the shard's own cut of the whole tensor) gives its slice."""
    if param.dim() < 2:
        whole = draw()
        param.copy_(whole if cut is None else cut(whole))
        return
    for start, block in draw.blocks():
        stop = start + block.shape[0]
        if rows is not None:
            at = 0
            for a, b in rows:
                lo, hi = max(a, start), min(b, stop)
                if lo < hi:
                    param[at + lo - a : at + hi - a].copy_(block[lo - start : hi - start])
                at += b - a
        else:
            param[start:stop].copy_(block if cut is None else cut(block))
