"""The allowed values of the specs' choice fields, and token budgets as written ('300B').

Plain tuples (the kinds enums' values where dspipe.spec.kinds has one). No torch, no deepspeed.
"""

from __future__ import annotations

import re

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
