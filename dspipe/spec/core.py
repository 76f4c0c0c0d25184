"""What the user asked for: model shape, cluster, training and parallel strategy.

Plain frozen dataclasses, validated on construction. No torch, no deepspeed.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields, make_dataclass, replace
from typing import TYPE_CHECKING, TypeGuard, TypeVar

from dspipe.errors import SpecError
from dspipe.spec.hardware import GPU_CATALOG, GPU_MTBF_HOURS, GpuType, gpu_type
from dspipe.spec.kinds import Checkpointing, Offload, Precision
from dspipe.spec.profile import Profile, apply_profile, check_profile_gpu, profile_from_dict
from dspipe.spec.settings import FIELD_DEFAULT, declared, setting

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

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
MOE_ONLY = (
    "expert_ffn",
    "shared_experts",
    "router_score",
    "router_scale",
    "router_groups",
    "router_group_limit",
    "router_bias_rate",
    "moe_every",
    "moe_first_dense",
    "capacity_factor",
)
"""ModelSpec fields that do nothing without experts: a dense model must leave them at their defaults."""


INT32_MAX = 2**31 - 1


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


def _show(value: object) -> str:
    """repr, cut short (a 400-digit number or a long string stays one readable line)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        _int_range(owner, name, value, low=1)


def _int_range(owner: str, name: str, value: object, *, low: int) -> None:
    """An int (not bool) in [low, LIMITS[name]]; the message names the field and the allowed range."""
    high = LIMITS[name]
    allowed = f"allowed range {low}..{high:,}"
    if not _is_int(value) or value < low:
        rule = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise SpecError(f"{owner}.{name} must be {rule}, got {_show(value)} ({allowed})")
    if value > high:
        raise SpecError(f"{owner}.{name} {_show(value)} is too large ({allowed})")


def _number(
    owner: str, name: str, value: object, *, low: float, high: float, low_open: bool = False, rule: str | None = None
) -> None:
    """A finite int or float in [low, high] (or (low, high] when low_open); NaN and +-inf are refused."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
    ok = _is_number(value) and math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        raise SpecError(
            f"{owner}.{name} {rule or f'must be a finite number in {interval}'}, "
            f"got {_show(value)} (allowed: finite, {interval})"
        )


def _one_of(owner: str, name: str, value: object, allowed: Sequence[object]) -> None:
    if type(value) is not type(allowed[0]) or value not in allowed:
        raise SpecError(f"{owner}.{name} {_show(value)} is not one of: {', '.join(map(str, allowed))}")


def _flag(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise SpecError(f"{owner}.{name} must be true or false, got {_show(value)}")


def _text(owner: str, name: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or not value or "\0" in value or "\n" in value:
        raise SpecError(
            f"{owner}.{name} must be a non-empty one-line string{' or null' if optional else ''}, got {_show(value)}"
        )


def _absolute_dir(owner: str, name: str, value: str) -> None:
    """A directory every rank reaches by the same name: not blank, no space at either end, absolute (a relative
    one resolves against each rank's own working directory, wherever the launcher started it)."""
    if not value.strip():
        raise SpecError(f"{owner}.{name} is blank ({value!r}): give an absolute directory, e.g. /local_nvme")
    if value != value.strip():
        raise SpecError(
            f"{owner}.{name} {_show(value)} starts or ends with white space: give the directory's exact absolute path"
        )
    if not value.startswith("/"):
        absolute = os.path.abspath(value)
        here = f" (from here: {absolute})" if len(absolute) <= 200 else ""
        raise SpecError(
            f"{owner}.{name} {_show(value)} is relative: each rank would resolve it against its own "
            f"working directory; give an absolute path{here}"
        )


@dataclass(frozen=True)
class ModelSpec:
    """Shape and architecture of a pre-norm decoder: GPT-2/3 (LayerNorm, learned positions, GELU MLP, biases) or
    Llama-family (RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no biases, untied head)."""

    name: str = setting(key="model", help="model preset: {presets}")
    """Preset name, or 'custom'."""
    layers: int = setting(kind="int", limit=4096, help="transformer blocks (overrides the preset)")
    """Number of transformer blocks (L)."""
    hidden: int = setting(kind="int", limit=2**17, help="model width")
    """Model width (h)."""
    heads: int = setting(kind="int", limit=2**17, help="attention heads")
    """Attention heads (a); hidden must be divisible by it."""
    vocab: int = setting(kind="int", limit=2**24, help="vocabulary size")
    """Vocabulary size (V), embedding rows."""
    seq_len: int = setting(
        kind="int", limit=2**20, fallback=1024, help="context length [the preset's; custom {fallback}]"
    )
    """Context length in tokens (s); also the number of learned positions."""
    ffn: int = setting(kind="int", limit=2**20, help="MLP width (default 4 x hidden)")
    """MLP inner width, 4·hidden for GPT-2/3."""
    dropout: float = setting(0.0, kind="float", help="dropout probability [the preset's; custom {default:g}]")
    """Dropout on embeddings, attention output and MLP output (0 for pretraining)."""
    tied_embeddings: bool = setting(True, key="untied", kind="flag", help="separate output head (default: tied)")
    """Share the token embedding with the output head."""
    norm: str = setting("layernorm", kind="choice", choices=NORMS, help="layernorm (GPT) or rmsnorm (Llama)")
    """Normalisation: layernorm (GPT) or rmsnorm (Llama)."""
    mlp: str = setting(
        "gelu", kind="choice", choices=MLPS, help="gelu (GPT) or swiglu (Llama; --ffn is the gate/up width)"
    )
    """MLP: gelu (fc -> GELU -> proj) or swiglu (silu(gate) x up -> down; ffn is the gate/up width)."""
    positions: str = setting("learned", kind="choice", choices=POSITIONS, help="learned (GPT) or rope (rotary, Llama)")
    """Position encoding: learned (a table of seq_len rows) or rope (rotary, no parameters)."""
    rope_theta: float = setting(10000.0, kind="float", help="rotary base [{default:g}; Llama-3 500000]")
    """Rotary base frequency (rope only): 10000 for Llama-2, 500000 for Llama-3."""
    kv_heads: int | None = setting(
        None, kind="int", limit=2**17, help="key/value heads for grouped-query attention [= heads; 1: multi-query]"
    )
    """Key/value heads for grouped-query attention (None: = heads, multi-head; 1: multi-query)."""
    bias: bool = setting(
        True, kind="bool", flag="--bias/--no-bias", help="biases in projections and LayerNorm [GPT: yes]"
    )
    """Biases in the attention and MLP projections (and in LayerNorm)."""
    norm_eps: float = setting(1e-5, kind="float", help="normalisation epsilon [{default:g}]")
    """Epsilon of the normalisation layers."""
    head_width: int | None = setting(
        None,
        key="head_dim",
        kind="int",
        limit=2**14,
        help="attention head width [hidden / heads; Qwen3, Mistral-Nemo: 128]",
    )
    """Width of one attention head (None: hidden / heads); q is heads x head_dim wide, k and v kv_heads x head_dim."""
    qkv_bias: bool | None = setting(
        None,
        kind="bool",
        flag="--qkv-bias/--no-qkv-bias",
        help="biases on the q/k/v projections [= --bias; Qwen2: yes]",
    )
    """Biases on the q, k and v projections (None: as `bias`)."""
    out_bias: bool | None = setting(
        None, kind="bool", flag="--out-bias/--no-out-bias", help="bias on the attention output projection [= --bias]"
    )
    """Bias on the attention output projection (None: as `bias`)."""
    mlp_bias: bool | None = setting(
        None, kind="bool", flag="--mlp-bias/--no-mlp-bias", help="biases in the MLP projections [= --bias]"
    )
    """Biases in the MLP projections (None: as `bias`)."""
    qk_norm: bool = setting(
        False,
        kind="bool",
        flag="--qk-norm/--no-qk-norm",
        help="RMSNorm over each head of q and k before rotary [Qwen3: yes]",
    )
    """RMSNorm (weight of head_dim, the model's epsilon) on every query and key head, before rotary (Qwen3)."""
    rope_scaling: str = setting(
        "none",
        kind="choice",
        choices=ROPE_SCALINGS,
        help="rotary frequency scaling: none, linear, llama3 (Llama 3.1+), yarn",
    )
    """Rotary frequency scaling: none; linear (positions / factor); llama3 (low frequencies / factor, a smooth band
    between low_freq_factor and high_freq_factor); yarn (NTK-by-parts with beta_fast/beta_slow, attention factor
    0.1 ln(factor) + 1)."""
    rope_factor: float = setting(1.0, kind="float", help="rotary scaling factor [{default:g}; Llama 3.1: 8]")
    """Scaling factor of rope_scaling (1: none)."""
    rope_original_context: int | None = setting(
        None, kind="int", limit=2**20, help="context the rotary scaling extends from [Llama 3.1: 8192]"
    )
    """Pre-training context that llama3/yarn scaling extends from (original_max_position_embeddings)."""
    rope_low_freq_factor: float = setting(1.0, kind="float", help="llama3 scaling: low-frequency factor [{default:g}]")
    """llama3 scaling: wavelengths above original_context / low_freq_factor are divided by the factor."""
    rope_high_freq_factor: float = setting(
        4.0, kind="float", help="llama3 scaling: high-frequency factor [{default:g}]"
    )
    """llama3 scaling: wavelengths below original_context / high_freq_factor are kept."""
    rope_beta_fast: float = setting(32.0, kind="float", help="yarn scaling: beta_fast [{default:g}]")
    """yarn scaling: rotations per context above which a dimension is extrapolated (kept)."""
    rope_beta_slow: float = setting(1.0, kind="float", help="yarn scaling: beta_slow [{default:g}]")
    """yarn scaling: rotations per context below which a dimension is interpolated (divided by the factor)."""
    sliding_window: int | None = setting(
        None, kind="int", limit=2**20, help="attention window in tokens [none; Mistral v0.1: 4096]"
    )
    """Sliding-window attention: query i sees keys i - window + 1 .. i (None: the whole causal prefix)."""
    window_start_layer: int = setting(
        0, kind="int", limit=4096, help="first block with the sliding window [{default}; Qwen2 max_window_layers]"
    )
    """Blocks window_start_layer .. layers - 1 use the sliding window, earlier blocks full causal attention."""
    experts: int = setting(0, kind="int", limit=4096, help="routed experts per MoE block [{default}: dense; Mixtral 8]")
    """Routed experts in each sparse (mixture-of-experts) block; 0: every block is dense."""
    experts_per_token: int = setting(
        2, kind="int", limit=4096, help="experts each token is routed to (top-k) [{default}; Qwen3-MoE 8]"
    )
    """Experts each token is sent to (top-k of the router's scores)."""
    expert_ffn: int | None = setting(
        None, kind="int", limit=2**20, help="width of one expert's MLP [= --ffn; Qwen3-MoE moe_intermediate_size]"
    )
    """Inner width of one expert's MLP (None: ffn); ffn stays the width of the dense blocks' MLP."""
    shared_experts: int = setting(
        0, kind="int", limit=64, help="always-on shared experts per MoE block, each expert_ffn wide [{default}]"
    )
    """Shared experts every token passes through besides its routed ones (one MLP shared_experts x expert_ffn wide)."""
    router_norm_topk: bool = setting(
        True,
        kind="bool",
        flag="--router-norm-topk/--no-router-norm-topk",
        help="renormalise the top-k router probabilities to sum to 1 [Mixtral: yes]",
    )
    """Divide the chosen experts' scores by their sum (Mixtral; Qwen3-MoE norm_topk_prob; DeepSeek-V3)."""
    router_score: str = setting(
        "softmax",
        kind="choice",
        choices=ROUTER_SCORES,
        help="router score: softmax over the experts, or sigmoid of each expert's logit "
        "[{default}; DeepSeek-V3: sigmoid]",
    )
    """Score of expert e for a token: softmax over all experts' logits (Mixtral, Qwen3-MoE) or sigmoid of e's own
    logit (DeepSeek-V3); without a selection bias or expert groups a token's top-k experts are its k largest logits
    either way."""
    router_scale: float = setting(
        1.0, kind="float", help="factor on the routed experts' combine weights [{default:g}; DeepSeek-V3: 2.5]"
    )
    """Multiplies each token's top-k combine weights, after any renormalisation (DeepSeek routed_scaling_factor)."""
    router_groups: int = setting(
        1, kind="int", limit=4096, help="expert groups for group-limited routing [{default}; DeepSeek-V3: 8]"
    )
    """The experts form this many equal groups, in order (DeepSeek-V3 n_group); see router_group_limit."""
    router_group_limit: int | None = setting(
        None,
        kind="int",
        limit=4096,
        help="groups a token may route into, those whose two best selection scores sum highest [all; DeepSeek-V3: 4]",
    )
    """A token's experts come from its router_group_limit groups with the highest sum of their two best selection
    scores (DeepSeek-V3 topk_group; None: every group)."""
    router_bias_rate: float = setting(
        0.0,
        kind="float",
        help="aux-loss-free balancing: each expert's selection bias moves this much "
        "towards balance after every step [{default:g}: off; DeepSeek-V3: 0.001]",
    )
    """DeepSeek-V3's auxiliary-loss-free balancing: experts are chosen by score + a per-expert bias (weighted by the
    score alone), and after each optimizer step the bias of an expert that got fewer tokens than the mean over the
    step (all ranks) rises by this rate, of one that got more falls by it (0: no bias)."""
    moe_every: int = setting(
        1, kind="int", limit=4096, help="every k-th block is sparse [{default}; HF decoder_sparse_step]"
    )
    """Block i (from 0) is sparse when (i + 1) is a multiple of moe_every and i >= moe_first_dense."""
    moe_first_dense: int = setting(0, kind="int", limit=4096, help="the first k blocks stay dense [{default}]")
    """The first moe_first_dense blocks are dense whatever moe_every says (DeepSeek's first_k_dense_replace)."""
    aux_loss_coef: float = setting(
        0.001, kind="float", help="load-balancing loss coefficient [{default:g}; Mixtral, Qwen3-MoE]"
    )
    """Weight of each sparse block's load-balancing loss E x sum_e f_e P_e added to the training loss."""
    capacity_factor: float | None = setting(
        None, kind="float", limit=64.0, help="expert capacity factor, tokens over it dropped [none: dropless]"
    )
    """Expert capacity = factor x k x tokens / experts, routes beyond it dropped (None: dropless, every route kept)."""

    def __post_init__(self) -> None:
        _text("model", "name", self.name)
        _positive(
            "model",
            layers=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            vocab=self.vocab,
            seq_len=self.seq_len,
            ffn=self.ffn,
        )
        if self.head_width is not None:
            _positive("model", head_width=self.head_width)
        elif self.hidden % self.heads:
            raise SpecError(
                f"hidden {self.hidden} is not divisible by heads {self.heads} "
                f"({self.hidden} / {self.heads} = {self.hidden / self.heads:g}; or give head_dim)"
            )
        if not (_is_number(self.dropout) and 0.0 <= self.dropout < 1.0):
            raise SpecError(f"model.dropout must be in [0, 1), got {_show(self.dropout)} (allowed: finite, [0, 1))")
        _flag("model", "tied_embeddings", self.tied_embeddings)
        _one_of("model", "norm", self.norm, NORMS)
        _one_of("model", "mlp", self.mlp, MLPS)
        _one_of("model", "positions", self.positions, POSITIONS)
        _flag("model", "bias", self.bias)
        if not (_is_number(self.rope_theta) and 1.0 <= self.rope_theta <= 1e9):
            raise SpecError(f"model.rope_theta must be in [1, 1e9], got {_show(self.rope_theta)}")
        if not (_is_number(self.norm_eps) and 0.0 < self.norm_eps < 1.0):
            raise SpecError(f"model.norm_eps must be in (0, 1), got {_show(self.norm_eps)}")
        if self.kv_heads is not None:
            _positive("model", kv_heads=self.kv_heads)
            if self.heads % self.kv_heads:
                raise SpecError(
                    f"heads {self.heads} is not divisible by kv_heads {self.kv_heads} "
                    f"({self.heads} / {self.kv_heads} = {self.heads / self.kv_heads:g})"
                )
        if self.positions == "rope" and self.head_dim % 2:
            raise SpecError(f"rotary positions need an even head_dim, got {self.head_dim}")
        for name in ("qkv_bias", "out_bias", "mlp_bias"):
            if getattr(self, name) is not None:
                _flag("model", name, getattr(self, name))
        _flag("model", "qk_norm", self.qk_norm)
        self._check_rope_scaling()
        if self.sliding_window is not None:
            _positive("model", sliding_window=self.sliding_window)
        _int_range("model", "window_start_layer", self.window_start_layer, low=0)
        if self.sliding_window is None and self.window_start_layer:
            raise SpecError(
                f"model.window_start_layer {self.window_start_layer} has no effect without sliding_window "
                f"(give the window in tokens, or leave window_start_layer at 0)"
            )
        if self.sliding_window is not None and self.window_start_layer >= self.layers:
            raise SpecError(
                f"model.window_start_layer {self.window_start_layer} leaves no block with the sliding "
                f"window (layers {self.layers}: it must be < {self.layers})"
            )
        self._check_moe()

    def _check_moe(self) -> None:
        _int_range("model", "experts", self.experts, low=0)
        _positive("model", experts_per_token=self.experts_per_token, moe_every=self.moe_every)
        _int_range("model", "shared_experts", self.shared_experts, low=0)
        _int_range("model", "moe_first_dense", self.moe_first_dense, low=0)
        _flag("model", "router_norm_topk", self.router_norm_topk)
        _one_of("model", "router_score", self.router_score, ROUTER_SCORES)
        _number("model", "router_scale", self.router_scale, low=0.0, high=1e3, low_open=True)
        _positive("model", router_groups=self.router_groups)
        if self.router_group_limit is not None:
            _positive("model", router_group_limit=self.router_group_limit)
        _number("model", "router_bias_rate", self.router_bias_rate, low=0.0, high=1.0)
        _number("model", "aux_loss_coef", self.aux_loss_coef, low=0.0, high=1e3)
        if self.expert_ffn is not None:
            _positive("model", expert_ffn=self.expert_ffn)
        if self.capacity_factor is not None:
            _number("model", "capacity_factor", self.capacity_factor, low=0.0, high=64.0, low_open=True)
        if not self.experts:
            set_ = [
                f"{f.name} {getattr(self, f.name)}"
                for f in fields(self)
                if f.name in MOE_ONLY and getattr(self, f.name) != f.default
            ]
            if set_:
                raise SpecError(f"model.{', '.join(set_)} has no effect without experts (give experts, e.g. 8)")
            return
        if self.experts_per_token > self.experts:
            raise SpecError(
                f"model.experts_per_token {self.experts_per_token} exceeds experts {self.experts} "
                f"(top-k picks k of the experts: k <= {self.experts})"
            )
        self._check_router_groups()
        if not self.sparse_layers:
            raise SpecError(
                f"model: no block is sparse (layers {self.layers}, moe_every {self.moe_every}, "
                f"moe_first_dense {self.moe_first_dense}): block i is sparse when (i + 1) % moe_every == 0 "
                f"and i >= moe_first_dense"
            )

    def _check_router_groups(self) -> None:
        groups, limit, k = self.router_groups, self.router_group_limit, self.experts_per_token
        if self.experts % groups:
            raise SpecError(
                f"model.experts {self.experts} is not divisible by router_groups {groups} "
                f"({self.experts} / {groups} = {self.experts / groups:g})"
            )
        if limit is None:
            if groups > 1:
                raise SpecError(
                    f"model.router_groups {groups} has no effect without router_group_limit (the groups "
                    f"a token may route into, e.g. {max(1, groups // 2)})"
                )
            return
        if groups == 1:
            raise SpecError(
                f"model.router_group_limit {limit} has no effect without router_groups > 1 (give the "
                f"expert groups, e.g. 8, or leave the limit out)"
            )
        if limit > groups:
            raise SpecError(f"model.router_group_limit {limit} exceeds router_groups {groups}")
        if self.experts // groups < 2:
            raise SpecError(
                f"model.router_groups {groups} leaves {self.experts // groups} expert per group: a group's "
                f"score is the sum of its two best experts' (experts {self.experts} / router_groups must "
                f"be >= 2)"
            )
        if k > limit * (self.experts // groups):
            raise SpecError(
                f"model.experts_per_token {k} exceeds the experts of router_group_limit {limit} groups "
                f"({limit} x {self.experts} / {groups} = {limit * (self.experts // groups)})"
            )

    def _check_rope_scaling(self) -> None:
        _one_of("model", "rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        if self.rope_scaling != "none" and self.positions != "rope":
            raise SpecError(
                f"model.rope_scaling {self.rope_scaling} needs rotary positions (positions rope, got {self.positions})"
            )
        _number("model", "rope_factor", self.rope_factor, low=1.0, high=1e6)
        for name in ("rope_low_freq_factor", "rope_high_freq_factor", "rope_beta_fast", "rope_beta_slow"):
            _number("model", name, getattr(self, name), low=0.0, high=1e6, low_open=True)
        if self.rope_original_context is not None:
            _positive("model", rope_original_context=self.rope_original_context)
        if self.rope_scaling == "none" and self.rope_factor != 1:
            raise SpecError(
                f"model.rope_factor {self.rope_factor:g} has no effect without rope_scaling (give "
                f"rope_scaling linear, llama3 or yarn, or leave the factor at 1)"
            )
        if self.rope_scaling in ("none", "linear") and self.rope_original_context is not None:
            raise SpecError(
                f"model.rope_original_context {self.rope_original_context} has no effect with rope_scaling "
                f"{self.rope_scaling} (only llama3 and yarn extend from an original context)"
            )
        if self.rope_scaling in ("llama3", "yarn") and self.rope_original_context is None:
            raise SpecError(
                f"model.rope_scaling {self.rope_scaling} needs rope_original_context (the context it "
                f"extends from, e.g. 8192 for Llama 3.1)"
            )
        if self.rope_scaling == "llama3" and not self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise SpecError(
                f"model.rope_low_freq_factor {self.rope_low_freq_factor:g} must be below "
                f"rope_high_freq_factor {self.rope_high_freq_factor:g}"
            )
        if self.rope_scaling == "yarn" and not self.rope_beta_slow < self.rope_beta_fast:
            raise SpecError(
                f"model.rope_beta_slow {self.rope_beta_slow:g} must be below rope_beta_fast {self.rope_beta_fast:g}"
            )

    @property
    def shape_text(self) -> str:
        """'L12 h768 a12 s1024 V50257', with kv heads and the architecture when it is not GPT-2's:
        'L32 h4096 a32 kv8 s8192 V128256 rmsnorm swiglu rope'."""
        kv = f" kv{self.kv_heads}" if self.kv_heads not in (None, self.heads) else ""
        arch = [v for v, gpt in ((self.norm, "layernorm"), (self.mlp, "gelu"), (self.positions, "learned")) if v != gpt]
        arch += [] if self.bias else ["no-bias"]
        biases = (
            ("qkv", self.qkv_bias, self.bias),
            ("out", self.out_bias, self.bias),
            ("mlp", self.mlp_bias, self.bias),
        )
        arch += [f"{name}-bias" for name, on, base in biases if on is not None and on != base]
        arch += [f"hd{self.head_width}"] if self.head_width not in (None, self.hidden // self.heads) else []
        arch += ["qk-norm"] if self.qk_norm else []
        arch += [f"rope-{self.rope_scaling}x{self.rope_factor:g}"] if self.rope_scaling != "none" else []
        arch += [f"window{self.sliding_window}"] if self.sliding_window else []
        if self.experts:
            moe = f"moe{self.experts}x{self.expert_width}-top{self.experts_per_token}"
            moe += f"+{self.shared_experts}shared" if self.shared_experts else ""
            moe += "" if self.router_norm_topk else "-unnorm"
            moe += "-sigmoid" if self.router_score == "sigmoid" else ""
            moe += f"-scale{self.router_scale:g}" if self.router_scale != 1 else ""
            moe += f"-groups{self.router_group_limit}of{self.router_groups}" if self.router_group_limit else ""
            moe += f"-bias{self.router_bias_rate:g}" if self.router_bias_rate else ""
            moe += f"-every{self.moe_every}" if self.moe_every > 1 else ""
            moe += f"-dense{self.moe_first_dense}" if self.moe_first_dense else ""
            moe += f"-cf{self.capacity_factor:g}" if self.capacity_factor is not None else ""
            arch.append(moe)
        return f"L{self.layers} h{self.hidden} a{self.heads}{kv} s{self.seq_len} V{self.vocab}" + "".join(
            f" {a}" for a in arch
        )

    @property
    def head_dim(self) -> int:
        """Width of one attention head: head_width, else hidden / heads."""
        return self.head_width or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        """Output features of the query projection (= input features of the attention output): heads x head_dim."""
        return self.heads * self.head_dim

    def _bias(self, name: str) -> bool:
        value = getattr(self, name)
        return self.bias if value is None else value

    @property
    def biases(self) -> tuple[bool, bool, bool]:
        """(q/k/v, attention output, MLP): whether each projection has a bias."""
        return self._bias("qkv_bias"), self._bias("out_bias"), self._bias("mlp_bias")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of block `layer` (None: full causal attention)."""
        return self.sliding_window if layer >= self.window_start_layer else None

    @property
    def kv_groups(self) -> int:
        """Key/value heads (= heads without grouped-query attention)."""
        return self.kv_heads or self.heads

    @property
    def qkv_width(self) -> int:
        """Output features of the fused q/k/v projection: (heads + 2 kv_heads) x head_dim."""
        return (self.heads + 2 * self.kv_groups) * self.head_dim

    def norm_tensors(self, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
        with_bias = self.norm == "layernorm" and self.bias
        weight: list[tuple[str, tuple[int, ...]]] = [(f"{prefix}.weight", (self.hidden,))]
        return weight + ([(f"{prefix}.bias", (self.hidden,))] if with_bias else [])

    @staticmethod
    def _linear(prefix: str, out: int, inp: int, bias: bool) -> list[tuple[str, tuple[int, ...]]]:
        weight: list[tuple[str, tuple[int, ...]]] = [(f"{prefix}.weight", (out, inp))]
        return weight + ([(f"{prefix}.bias", (out,))] if bias else [])

    @property
    def expert_width(self) -> int:
        """Inner width of one routed expert's MLP: expert_ffn, else ffn."""
        return self.expert_ffn or self.ffn

    def is_sparse(self, layer: int) -> bool:
        """Whether block `layer` (from 0) is a mixture-of-experts block."""
        return bool(self.experts) and layer >= self.moe_first_dense and (layer + 1) % self.moe_every == 0

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The mixture-of-experts blocks, in order."""
        return tuple(i for i in range(self.layers) if self.is_sparse(i))

    def mlp_tensors(self, prefix: str, width: int) -> list[tuple[str, tuple[int, ...]]]:
        """One MLP `width` wide: c_fc (gate and up fused for swiglu) and c_proj."""
        up = 2 * width if self.mlp == "swiglu" else width
        bias = self.biases[2]
        return [
            *self._linear(f"{prefix}.c_fc", up, self.hidden, bias),
            *self._linear(f"{prefix}.c_proj", self.hidden, width, bias),
        ]

    def expert_tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """One routed expert's parameters, relative to the expert (c_fc, c_proj)."""
        return self.mlp_tensors("", self.expert_width)

    def block_tensors(self, layer: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
        """Every parameter of block `layer` (None: a dense block), (name, shape), as dspipe.model.gpt builds it: the
        one declaration the planner's counts and the model share (a test ties them for every preset). A sparse block's
        MLP is mlp.router (experts x hidden), mlp.experts.E.{c_fc,c_proj} and, with shared experts, mlp.shared."""
        h = self.hidden
        qkv_bias, out_bias, _ = self.biases
        qk = (
            [("attn.q_norm.weight", (self.head_dim,)), ("attn.k_norm.weight", (self.head_dim,))] if self.qk_norm else []
        )
        if layer is not None and self.is_sparse(layer):
            mlp: list[tuple[str, tuple[int, ...]]] = [("mlp.router.weight", (self.experts, h))]
            for e in range(self.experts):
                mlp += [(f"mlp.experts.{e}{name}", shape) for name, shape in self.expert_tensors()]
            if self.shared_experts:
                mlp += self.mlp_tensors("mlp.shared", self.shared_experts * self.expert_width)
        else:
            mlp = self.mlp_tensors("mlp", self.ffn)
        return [
            *self.norm_tensors("ln_1"),
            *self._linear("attn.c_attn", self.qkv_width, h, qkv_bias),
            *qk,
            *self._linear("attn.c_proj", h, self.q_width, out_bias),
            *self.norm_tensors("ln_2"),
            *mlp,
        ]

    def model_tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every parameter of the model (a tied head counted once), (name, shape), as the model names them."""
        out: list[tuple[str, tuple[int, ...]]] = [("embed.wte.weight", (self.vocab, self.hidden))]
        if self.positions == "learned":
            out.append(("embed.wpe.weight", (self.seq_len, self.hidden)))
        for i in range(self.layers):
            out += [(f"h.{i}.{name}", shape) for name, shape in self.block_tensors(i)]
        out += self.norm_tensors("final.ln_f")
        if not self.tied_embeddings:
            out.append(("lm_head.weight", (self.vocab, self.hidden)))
        return out

    def model_buffers(self) -> list[tuple[str, tuple[int, ...]]]:
        """The model's state that is not a parameter, (name, shape): each sparse block's expert selection bias when
        router_bias_rate > 0."""
        if not self.router_bias_rate:
            return []
        return [(f"h.{i}.mlp.router_bias", (self.experts,)) for i in self.sparse_layers]

    @property
    def params_per_block(self) -> int:
        """Parameters of a dense block (see layer_params for a model with sparse blocks)."""
        return sum(math.prod(shape) for _, shape in self.block_tensors())

    def layer_params(self, layer: int) -> int:
        """Parameters of block `layer`, every expert counted."""
        if not self.is_sparse(layer):
            return self.params_per_block
        return self.params_per_block - self.moe_dense_mlp_params + self.sparse_mlp_params

    @property
    def moe_dense_mlp_params(self) -> int:
        """The dense MLP's parameters (what a sparse block replaces)."""
        return sum(math.prod(shape) for _, shape in self.mlp_tensors("", self.ffn))

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert."""
        return sum(math.prod(shape) for _, shape in self.expert_tensors())

    @property
    def sparse_mlp_params(self) -> int:
        """A sparse block's MLP: router + every routed expert + the shared experts."""
        shared = (
            sum(math.prod(s) for _, s in self.mlp_tensors("", self.shared_experts * self.expert_width))
            if self.shared_experts
            else 0
        )
        return self.experts * self.hidden + self.experts * self.expert_params + shared

    @property
    def routed_expert_params(self) -> int:
        """Every routed expert of every sparse block: the parameters expert parallelism divides over ep."""
        return len(self.sparse_layers) * self.experts * self.expert_params

    @property
    def blocks_params(self) -> int:
        """All blocks together."""
        return sum(self.layer_params(i) for i in range(self.layers))

    @property
    def embedding_params(self) -> int:
        """Token embedding (+ learned positions)."""
        return self.vocab * self.hidden + (self.seq_len * self.hidden if self.positions == "learned" else 0)

    @property
    def final_norm_params(self) -> int:
        return sum(math.prod(shape) for _, shape in self.norm_tensors("final.ln_f"))

    @property
    def num_params(self) -> int:
        """Total parameters, counting a tied embedding once."""
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.embedding_params + self.blocks_params + self.final_norm_params + head

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: every routed expert but its experts_per_token left out (the
        count MoE papers publish as 'active'; = num_params for a dense model)."""
        idle = (self.experts - self.experts_per_token) * self.expert_params if self.experts else 0
        return self.num_params - len(self.sparse_layers) * idle


@dataclass(frozen=True)
class ClusterSpec:
    """Where the job runs."""

    nodes: int = setting(kind="int", limit=2**16, cli_default=1, help="machines")
    """Number of machines."""
    gpus_per_node: int = setting(kind="int", limit=1024, cli_default=8, help="ranks per machine")
    """Ranks per machine (GPUs, or CPU processes on the 'cpu' type)."""
    gpu: str = setting(cli_default="h100-80g", help="GPU type: {gpus}")
    """GPU type, a key of the hardware catalog (dspipe.spec.hardware)."""
    host_memory_gib: float | None = setting(
        None,
        kind="float",
        limit=2.0**20,
        help="host RAM per node [default: --gpu's reference RAM per GPU x --gpus-per-node]",
    )
    """Host RAM per node for offloaded state; None: the GPU type's reference figure per GPU x gpus_per_node
    (hardware.GpuType.host_memory_per_gpu_bytes, e.g. DGX H100: 2 TiB / 8 GPUs)."""
    intra_node_gbps: float | None = setting(
        None, kind="float", limit=1e6, help="bandwidth per GPU inside a node, GB/s [the catalog's or the profile's]"
    )
    """Bandwidth per GPU to peers in the node, GB/s, overriding the catalog's and a profile's (--intra-node-gbps)."""
    inter_node_gbps: float | None = setting(
        None, kind="float", limit=1e6, help="per-GPU share of the network bandwidth across nodes, GB/s [the catalog's]"
    )
    """Per-GPU share of the network bandwidth, GB/s, overriding the catalog's (--inter-node-gbps)."""
    gpu_mtbf_hours: float = setting(
        GPU_MTBF_HOURS,
        kind="float",
        limit=1e9,
        cli_default=FIELD_DEFAULT,
        help="GPU-hours between job-interrupting failures per GPU, for --save-interval auto (Llama 3's rate: 50,700)",
    )
    """Mean time between job-interrupting failures of one GPU, in hours (the job's: this / world size): the failure
    rate --save-interval auto plans against, and the runner re-plans against from each save's measured time."""
    profile: Profile | None = setting(
        None,
        after="host_memory_gib",
        metavar="FILE",
        help="calibration profile from 'dspipe calibrate': its measured compute, bandwidth, latency, copy and "
        "optimizer rates replace the catalog's (gen-config keeps it in the run directory)",
    )
    """A `dspipe calibrate` profile whose figures replace the catalog's in the time model (--profile; a run directory
    keeps it here and in profile.json); from JSON, its profile_to_dict form."""

    def __post_init__(self) -> None:
        _positive("cluster", nodes=self.nodes, gpus_per_node=self.gpus_per_node)
        if not isinstance(self.gpu, str):
            raise SpecError(f"cluster.gpu must be a GPU type name, got {_show(self.gpu)}")
        gpu_type(self.gpu)
        for name in ("intra_node_gbps", "inter_node_gbps"):
            if getattr(self, name) is not None:
                _number(
                    "cluster",
                    name,
                    getattr(self, name),
                    low=0,
                    high=LIMITS[name],
                    low_open=True,
                    rule="must be a positive number of GB/s",
                )
        if self.profile is not None:
            if not isinstance(self.profile, Profile):  # read back from dspipe.json
                object.__setattr__(self, "profile", profile_from_dict(self.profile, where="cluster.profile"))
            check_profile_gpu(self.profile, gpu=self.gpu, where="cluster.profile")
        _number(
            "cluster",
            "gpu_mtbf_hours",
            self.gpu_mtbf_hours,
            low=0,
            high=LIMITS["gpu_mtbf_hours"],
            low_open=True,
            rule="must be a positive number of hours",
        )
        if self.host_memory_gib is not None:
            _number(
                "cluster",
                "host_memory_gib",
                self.host_memory_gib,
                low=0,
                high=LIMITS["host_memory_gib"],
                low_open=True,
                rule="must be positive",
            )

    @property
    def host_memory_bytes(self) -> int:
        """Host RAM per node: --host-memory-gib, else the GPU type's RAM per GPU x gpus_per_node."""
        if self.host_memory_gib is None:
            return self.gpu_type.host_memory_per_gpu_bytes * self.gpus_per_node
        return int(self.host_memory_gib * 1024**3)

    @property
    def host_memory_source(self) -> str:
        """Where host_memory_bytes comes from, for plan output: 'set by --host-memory-gib' or the catalog rule."""
        if self.host_memory_gib is not None:
            return "set by --host-memory-gib"
        per_gpu = self.gpu_type.host_memory_per_gpu_bytes / 1024**3
        return (
            f"{self.gpu} default: {per_gpu:g} GiB per GPU x {self.gpus_per_node} GPUs, docs/hardware.md; "
            f"--host-memory-gib overrides"
        )

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_type(self) -> GpuType:
        """The catalog's entry for `gpu`, with the profile's figures and the bandwidth overrides in place."""
        g = GPU_CATALOG[self.gpu]
        if self.profile is not None:
            g = apply_profile(g, self.profile)
        overrides = {k: v for k in ("intra_node_gbps", "inter_node_gbps") if (v := getattr(self, k)) is not None}
        return replace(g, **overrides) if overrides else g


@dataclass(frozen=True)
class TrainSpec:
    """How long and how hard to train."""

    global_batch: int = setting(kind="int", limit=2**24, cli_default=256, help="sequences per optimizer step")
    """Sequences per optimizer step, across all data-parallel ranks."""
    micro_batch: int = setting(
        kind="auto_int", limit=2**24, section="strategy", after="", help="sequences per rank per forward [auto]"
    )
    """Sequences per forward/backward on one rank."""
    steps: int = setting(
        kind="int", limit=INT32_MAX, fallback=1000, help="optimizer steps [default: {fallback}; or from --tokens]"
    )
    """Optimizer steps to run."""
    lr: float = setting(6e-4, kind="float", limit=1.0, cli_default=FIELD_DEFAULT, help="peak learning rate")
    """Peak learning rate reached after warmup."""
    min_lr_ratio: float = setting(0.1, kind="float", cli_default=FIELD_DEFAULT, help="final lr / peak lr")
    """Final learning rate of the cosine decay, as a fraction of lr."""
    warmup_steps: int = setting(
        100,
        key="warmup",
        kind="int",
        limit=INT32_MAX,
        help="lr warmup steps [default: steps/10, at least 1, at most 2000]",
    )
    """Linear warmup length in optimizer steps."""
    weight_decay: float = setting(
        0.1, kind="float", limit=1.0, cli_default=FIELD_DEFAULT, help="AdamW weight decay (not on biases and norms)"
    )
    """AdamW decoupled weight decay (not applied to biases and norms)."""
    grad_clip: float = setting(
        1.0, kind="float", limit=1e6, cli_default=FIELD_DEFAULT, help="global gradient-norm clipping"
    )
    """Global gradient-norm clipping threshold."""
    precision: str = setting(
        "bf16",
        kind="auto_choice",
        choices=PRECISIONS,
        section="strategy",
        after="nvme_path",
        help="[auto: bf16 on GPUs, fp32 on cpu]",
    )
    """bf16, fp16 or fp32 training."""
    seed: int = setting(1234, kind="int", limit=2**32 - 1, cli_default=FIELD_DEFAULT, help=None)
    """Seed for weights, data order and dropout."""
    log_interval: int = setting(
        10, kind="int", limit=INT32_MAX, cli_default=FIELD_DEFAULT, section="logging", help="steps between log lines"
    )
    """Print and record metrics every this many steps."""
    save_interval: int = setting(
        1000,
        kind="auto_int",
        limit=INT32_MAX,
        cli_default=FIELD_DEFAULT,
        help="steps between checkpoints (0: only at the end and on SIGTERM/SIGINT; auto: "
        "gen-config's Young interval from the write time and the failure rate)",
    )
    """Save a DeepSpeed checkpoint every this many steps (0: only at the end and on SIGTERM/SIGINT)."""
    keep_checkpoints: int = setting(
        3,
        kind="int",
        limit=10**6,
        cli_default=FIELD_DEFAULT,
        help="complete checkpoints to keep (older ones are deleted)",
    )
    """Keep the newest this many complete checkpoints; older ones are deleted."""
    keep_every: int = setting(
        0,
        kind="int",
        limit=INT32_MAX,
        cli_default=FIELD_DEFAULT,
        help="also keep, for good, every checkpoint at a multiple of this many steps (0: none)",
    )
    """Milestones: a checkpoint at a multiple of this many steps is never deleted by keep_checkpoints (0: none)."""
    async_save: bool = setting(
        True,
        kind="bool",
        flag="--async-save/--sync-save",
        cli_default=FIELD_DEFAULT,
        help="write checkpoints in the background: the step waits only for a copy of the rank's state in host memory",
    )
    """Checkpoint files written by a background process per rank (dspipe.runtime.async_save); False: in the step."""
    compile: bool = setting(
        False,
        kind="bool",
        flag="--compile/--no-compile",
        cli_default=FIELD_DEFAULT,
        help="torch.compile every transformer block (one compiled graph serves all the blocks "
        "of a kind; the first steps pay the compilation)",
    )
    """torch.compile each transformer block in place (dspipe.runtime.parallelize.compile_blocks), as torchtitan does:
    the norms, activations, residual adds and rotary fuse into few kernels; the attention and GEMMs stay the same."""
    eval_interval: int = setting(
        100, kind="int", limit=INT32_MAX, cli_default=FIELD_DEFAULT, help="steps between validation passes (0: none)"
    )
    """Validation loss and perplexity every this many steps and at the end (0: never)."""
    eval_batches: int = setting(
        10,
        kind="int",
        limit=INT32_MAX,
        cli_default=FIELD_DEFAULT,
        help="micro-batches per data-parallel rank in one validation pass",
    )
    """Micro-batches per data-parallel rank in one validation pass (capped by the validation split)."""
    max_skipped_steps: int = setting(
        10,
        kind="int",
        limit=INT32_MAX,
        cli_default=FIELD_DEFAULT,
        help="consecutive non-finite steps before the run saves and stops (0: never)",
    )
    """Save and stop after this many consecutive steps skipped for a non-finite loss or gradient norm (0: never)."""
    spike_window: int = setting(
        100, kind="int", limit=2**20, cli_default=FIELD_DEFAULT, help="steps of loss history for loss-spike detection"
    )
    """Steps of recent loss that a loss spike is measured against."""
    spike_sigma: float = setting(
        4.0,
        kind="float",
        limit=1e6,
        cli_default=FIELD_DEFAULT,
        help="log a loss spike above mean + this many std of the window",
    )
    """A loss above mean + this many standard deviations of the window is logged as a spike."""
    data_order: str = setting(
        "dspipe",
        kind="choice",
        choices=DATA_ORDERS,
        section="data",
        after="data",
        cli_default=FIELD_DEFAULT,
        help="dspipe: fixed windows per source, a seeded permutation every epoch; megatron: "
        "Megatron-LM's GPTDataset/BlendedDataset order for the same seed (Megatron "
        "prefixes only)",
    )
    """The training sample order: dspipe's (dspipe.data.loader) or Megatron-LM's (dspipe.data.megatron_order)."""
    tokens: str | None = setting(
        None,
        kind="tokens",
        limit=1e18,
        after="steps",
        help="the run's length as a token budget (300B, 1.5T, 2e9) instead of --steps",
    )
    """The token budget as the user gave it ('300B', '1.5T', '2e9'), from which gen-config derived steps =
    ceil(tokens / (global_batch x seq_len)); None: steps was given directly. Kept as written (shown in plan,
    gen-config and the runner's first line); `dspipe extend` may lengthen steps past it."""
    init_from: str | None = setting(
        None,
        section="model",
        after="model",
        metavar="HF_DIR",
        help="continue pretraining a Hugging Face directory (GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, "
        "Qwen3ForCausalLM, MistralForCausalLM): its config is the model, its weights step 0 (prepare the data "
        "with --tokenizer HF_DIR)",
    )
    """Hugging Face model directory whose weights initialise step 0 (None: dspipe's seeded initialisation)."""

    def __post_init__(self) -> None:
        _positive(
            "train",
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
            steps=self.steps,
            warmup_steps=self.warmup_steps,
            log_interval=self.log_interval,
            keep_checkpoints=self.keep_checkpoints,
        )
        for name in ("save_interval", "eval_interval", "max_skipped_steps", "keep_every"):
            _int_range("train", name, getattr(self, name), low=0)
        if self.keep_every and self.save_interval and self.keep_every % self.save_interval:
            raise SpecError(
                f"train.keep_every {self.keep_every} is not a multiple of save_interval "
                f"{self.save_interval} ({self.keep_every} % {self.save_interval} = "
                f"{self.keep_every % self.save_interval}): "
                "no checkpoint would be saved at a multiple of it"
            )
        _positive("train", eval_batches=self.eval_batches, spike_window=self.spike_window)
        _int_range("train", "seed", self.seed, low=0)
        _number(
            "train",
            "spike_sigma",
            self.spike_sigma,
            low=0,
            high=LIMITS["spike_sigma"],
            low_open=True,
            rule="must be positive",
        )
        if self.tokens is not None:
            _text("train", "tokens", self.tokens)
            count = token_count(self.tokens)
            if count is None:
                raise SpecError(
                    f"train.tokens {_show(self.tokens)} is not a token count like 300B, 1.5T or 2e9 "
                    f"(allowed: finite, (0, {LIMITS['tokens']:g}])"
                )
            if count > LIMITS["tokens"]:
                raise SpecError(
                    f"train.tokens {_show(self.tokens)} is too large (allowed: finite, (0, {LIMITS['tokens']:g}])"
                )
        _one_of("train", "precision", self.precision, PRECISIONS)
        _one_of("train", "data_order", self.data_order, DATA_ORDERS)
        _number("train", "lr", self.lr, low=0, high=LIMITS["lr"], low_open=True, rule="must be positive")
        _number("train", "min_lr_ratio", self.min_lr_ratio, low=0, high=1, rule="must be in [0, 1]")
        for name in ("weight_decay", "grad_clip"):
            _number("train", name, getattr(self, name), low=0, high=LIMITS[name], rule="must be >= 0")
        _text("train", "init_from", self.init_from, optional=True)
        _flag("train", "async_save", self.async_save)
        _flag("train", "compile", self.compile)


@dataclass(frozen=True)
class StrategySpec:
    """How the work is split and where state lives."""

    zero: int = setting(1, kind="auto_choice", choices=("0", "1", "2", "3"), help="ZeRO stage [auto]")
    """ZeRO stage 0-3 (0: plain data parallel)."""
    offload: str = setting("none", kind="auto_choice", choices=OFFLOADS, help="optimizer state offload [auto]")
    """Where optimizer states live: none (GPU), cpu or nvme."""
    offload_params: bool = setting(
        False, kind="bool", flag="--offload-params/--no-offload-params", help="offload parameters too (ZeRO-3) [auto]"
    )
    """Also offload parameters to the offload device (ZeRO-3 only)."""
    nvme_path: str | None = setting(None, help="NVMe directory for --offload nvme (enables it in auto)")
    """Directory on a local NVMe drive, required for nvme offload."""
    pp: int = setting(1, kind="auto_int", limit=4096, help="pipeline stages [auto]")
    """Pipeline stages; data parallel size is world / (pp x tp x sp)."""
    tp: int = setting(
        1,
        kind="auto_int",
        limit=4096,
        help="tensor-parallel ranks per replica (dspipe's Megatron-layout layers), inside a node [auto]",
    )
    """Tensor-parallel ranks per replica (dspipe's tensor-parallel layers, Megatron layout, inside a node)."""
    tp_sp: bool = setting(
        True,
        kind="bool",
        flag="--tp-sp/--no-tp-sp",
        help="Megatron sequence parallelism with tp > 1: activations between the tensor-parallel "
        "regions split along the sequence [on]",
    )
    """Megatron sequence parallelism with tp > 1 (all-gather / reduce-scatter instead of all-reduce; the activations
    outside the tensor-parallel regions divide by tp). Never worse: the same traffic, less memory and compute."""
    sp: int = setting(
        1, kind="auto_int", limit=4096, help="sequence-parallel ranks per replica, DeepSpeed-Ulysses [auto: 1]"
    )
    """Sequence-parallel ranks per replica (DeepSpeed-Ulysses)."""
    ep: int = setting(
        1,
        kind="auto_int",
        limit=4096,
        help="expert-parallel ranks: each holds experts / ep of every MoE block, inside the data-parallel ranks [auto]",
    )
    """Expert-parallel ranks (DeepSpeed MoE): the routed experts split over ep data-parallel ranks, which exchange
    tokens by all-to-all; ep divides dp and the experts."""
    checkpointing: str = setting(
        "none", kind="auto_choice", choices=CHECKPOINTING, help="activation recomputation [auto]"
    )
    """Activation recomputation: none, full (per block) or selective (attention core)."""
    loss_chunk: int = setting(
        0,
        kind="int",
        limit=2**24,
        help="tokens per chunk of the cross-entropy: the head's logits are made one chunk at a "
        "time, never whole (0: the full logits) [0]",
    )
    """Tokens per chunk of the loss (dspipe.model.loss): only one chunk's logits exist at a time, liger-kernel's
    fused linear cross-entropy on CUDA where installed; 0: the full logits and lm_loss. Plain GPT and the pipeline's
    last stage, tp 1 (tensor parallelism has its own vocab-parallel loss)."""
    partition_method: str = setting(
        "parameters", kind="auto_choice", choices=PARTITION_METHODS, help="pipeline partition [{default}]"
    )
    """How the pipeline splits layers into stages: parameters, uniform or type:Block."""
    reduce_bucket_size: int | None = setting(
        None, kind="int", limit=2**40, help="gradient reduce / all-gather bucket, elements [hidden^2, at least 2^20]"
    )
    """Elements per gradient reduce bucket; None: hidden^2 (at least 2^20)."""
    prefetch_bucket_size: int | None = setting(
        None, kind="int", limit=2**40, help="ZeRO-3 prefetch bucket, elements [0.9 hidden^2, at least 2^20]"
    )
    """ZeRO-3 parameter prefetch in elements; None: 0.9 hidden^2 (at least 2^20)."""
    param_persistence_threshold: int | None = setting(
        None, kind="int", limit=2**40, help="ZeRO-3: keep parameters smaller than this whole [10 hidden]"
    )
    """ZeRO-3 keeps parameters smaller than this whole on every rank; None: 10 hidden."""
    max_live_parameters: int | None = setting(
        None,
        kind="int",
        limit=2**40,
        help="ZeRO-3: prefetch only while fewer elements are gathered [prefetch bucket + largest tensor]",
    )
    """ZeRO-3 prefetches only while fewer elements are gathered; None: the prefetch bucket + the largest tensor."""
    max_reuse_distance: int | None = setting(
        None,
        kind="int",
        limit=2**40,
        help="ZeRO-3: keep a module gathered if reused within this many elements [prefetch bucket]",
    )
    """ZeRO-3 keeps a module gathered if the trace reuses it within this many elements; None: the prefetch bucket."""

    def __post_init__(self) -> None:
        _one_of("strategy", "zero", self.zero, ZERO_STAGES)
        _one_of("strategy", "offload", self.offload, OFFLOADS)
        _one_of("strategy", "checkpointing", self.checkpointing, CHECKPOINTING)
        _one_of("strategy", "partition_method", self.partition_method, PARTITION_METHODS)
        _flag("strategy", "offload_params", self.offload_params)
        _flag("strategy", "tp_sp", self.tp_sp)
        _text("strategy", "nvme_path", self.nvme_path, optional=True)
        if self.nvme_path is not None:
            _absolute_dir("strategy", "nvme_path", self.nvme_path)
        _positive("strategy", pp=self.pp, tp=self.tp, sp=self.sp, ep=self.ep)
        for name in ("reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold"):
            if getattr(self, name) is not None:
                _positive("strategy", **{name: getattr(self, name)})
        for name in ("max_live_parameters", "max_reuse_distance"):
            if getattr(self, name) is not None:
                _int_range("strategy", name, getattr(self, name), low=0)
        _int_range("strategy", "loss_chunk", self.loss_chunk, low=0)


SPECS = ((ModelSpec, "model"), (ClusterSpec, "cluster"), (TrainSpec, "train"), (StrategySpec, "strategy"))
"""Each spec and its --config section (a field may name another: precision and micro_batch are in strategy)."""
SPEC_SETTINGS = tuple(s for cls, section in SPECS for s in declared(cls, section=section))
"""Every setting declared on a spec field, in declaration order."""
LIMITS = {s.field: s.limit for s in SPEC_SETTINGS if s.limit is not None}
"""Largest accepted value per field, from its setting: beyond them a size is absurd (or overflows what DeepSpeed,
torch or numpy accept: seeds feed numpy's and torch's generators, which take 0..2**32-1 everywhere dspipe derives
streams)."""


def _requested(section: str) -> list[tuple[str, str, object]]:
    """(field, type or None, default None) for every spec field the `section` of the --config file holds."""
    types = {f.name: str(f.type) for cls, _ in SPECS for f in fields(cls)}  # str already: postponed annotations
    optional = {name: t if t.endswith("| None") else f"{t} | None" for name, t in types.items()}
    return [
        (s.field, optional[s.field], field(default=None))
        for s in SPEC_SETTINGS
        if s.section == section and s.field is not None
    ]  # every spec setting has a field


if TYPE_CHECKING:

    @dataclass(frozen=True, kw_only=True)
    class StrategyRequest:
        """What the type checker sees of the class make_dataclass builds below (a unit test keeps them equal)."""

        micro_batch: int | None = None
        precision: str | None = None
        zero: int | None = None
        offload: str | None = None
        offload_params: bool | None = None
        nvme_path: str | None = None
        pp: int | None = None
        tp: int | None = None
        tp_sp: bool | None = None
        sp: int | None = None
        ep: int | None = None
        checkpointing: str | None = None
        loss_chunk: int | None = None
        partition_method: str | None = None
        reduce_bucket_size: int | None = None
        prefetch_bucket_size: int | None = None
        param_persistence_threshold: int | None = None
        max_live_parameters: int | None = None
        max_reuse_distance: int | None = None
else:
    StrategyRequest = make_dataclass("StrategyRequest", _requested("strategy"), frozen=True, kw_only=True)
StrategyRequest.__doc__ = """The strategy as asked for: each field of the strategy section (StrategySpec's, and
TrainSpec's micro_batch and precision), a value, or None to let the search choose (or take the spec's default)."""


_Spec = TypeVar("_Spec", bound="DataclassInstance")


def from_dict(cls: type[_Spec], data: object) -> _Spec:
    """Rebuild a spec from its asdict() form, rejecting unknown and missing keys and anything that is not an object."""
    if not isinstance(data, dict):
        raise SpecError(f"{cls.__name__} must be a JSON object, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise SpecError(f"unknown {cls.__name__} keys: {', '.join(sorted(map(str, unknown)))}")
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        raise SpecError(f"missing {cls.__name__} keys: {', '.join(missing)}")
    return cls(**data)
