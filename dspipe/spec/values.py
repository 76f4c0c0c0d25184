"""The allowed values of the specs' choice fields, and token budgets as written ('300B').

Plain tuples (the kinds enums' values where dspipe.spec.kinds has one). No torch, no deepspeed.
"""

from __future__ import annotations

import re
from fractions import Fraction

from dspipe.spec.kinds import Checkpointing, Offload, Precision

PRECISIONS = tuple(k.value for k in Precision)  # ("bf16", "fp16", "fp32")
DATA_ORDERS = ("dspipe", "megatron")
ZERO_STAGES = (0, 1, 2, 3)
OFFLOADS = tuple(k.value for k in Offload)  # ("none", "cpu", "nvme")
CHECKPOINTING = tuple(k.value for k in Checkpointing)  # ("none", "full", "selective")
PARTITION_METHODS = ("parameters", "uniform", "type:Block")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
POSITIONS = ("learned", "rope")
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
ROUTER_SCORES = ("softmax", "sigmoid")


TOKEN_SCALE = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_TOKEN_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def token_count(text: object) -> float | None:
    """A token budget as written ('300B', '1.5T', '2e9', '500M', '4096'; K/M/B(=G)/T suffixes, ASCII digits) ->
    its count (finite, > 0); None when `text` is not such a string."""
    if not isinstance(text, str):
        return None
    t = text.strip().upper()
    number = t[:-1] if t and t[-1] in TOKEN_SCALE else t
    if not _TOKEN_NUMBER.fullmatch(number):
        return None
    value = float(number) * TOKEN_SCALE.get(t[-1:], 1.0)
    return value if 0 < value < float("inf") else None


def steps_of_tokens(text: str, *, tokens_per_step: int) -> int:
    """ceil(tokens / tokens_per_step) for a token budget `token_count` reads, computed exactly from its digits (a
    float would round 1e30 tokens to 1000000000000000019884624838656); ValueError when it is no such budget."""
    if token_count(text) is None:
        raise ValueError(f"not a token count: {text!r}")
    t = text.strip().upper()
    scale = t[-1:] if t[-1:] in TOKEN_SCALE else ""
    exact = Fraction(t[: len(t) - len(scale)]) * int(TOKEN_SCALE.get(scale, 1))
    return -(-exact.numerator // (exact.denominator * tokens_per_step))
