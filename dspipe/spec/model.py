"""ModelSpec: the model's shape and architecture, and the tensors and counts it implies.

A plain frozen dataclass, validated on construction. No torch, no deepspeed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import cached_property

from dspipe.errors import SpecError
from dspipe.spec.checks import add_limits, flag, int_range, is_number, number, one_of, positive, show, text
from dspipe.spec.settings import setting
from dspipe.spec.values import MLPS, NORMS, POSITIONS, ROPE_SCALINGS, ROUTER_SCORES

MOE_ONLY = (
    "experts_per_token",
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
    "router_norm_topk",
    "aux_loss_coef",
)
"""ModelSpec fields that do nothing without experts: a dense model must leave them at their defaults."""


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
    """Expert capacity = ceil(factor x k x tokens / experts) routes per expert on each rank, the later routes (in token
    order) dropped (dspipe.runtime.dispatch; None: dropless, every route kept)."""

    def __hash__(self) -> int:
        """The fields' hash, as the dataclass's, computed once per spec: the planner's caches key on the model
        hundreds of thousands of times in one search. Kept out of copies and pickles (__getstate__): a string's hash
        differs between processes."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __post_init__(self) -> None:
        text("model", "name", self.name)
        positive(
            "model",
            layers=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            vocab=self.vocab,
            seq_len=self.seq_len,
            ffn=self.ffn,
        )
        if self.head_width is not None:
            positive("model", head_width=self.head_width)
        elif self.hidden % self.heads:
            raise SpecError(
                f"hidden {self.hidden} is not divisible by heads {self.heads} "
                f"({self.hidden} / {self.heads} = {self.hidden / self.heads:g}; or give head_dim)"
            )
        if not (is_number(self.dropout) and 0.0 <= self.dropout < 1.0):
            raise SpecError(f"model.dropout must be in [0, 1), got {show(self.dropout)} (allowed: finite, [0, 1))")
        flag("model", "tied_embeddings", self.tied_embeddings)
        one_of("model", "norm", self.norm, NORMS)
        one_of("model", "mlp", self.mlp, MLPS)
        one_of("model", "positions", self.positions, POSITIONS)
        flag("model", "bias", self.bias)
        if not (is_number(self.rope_theta) and 1.0 <= self.rope_theta <= 1e9):
            raise SpecError(f"model.rope_theta must be in [1, 1e9], got {show(self.rope_theta)}")
        if not (is_number(self.norm_eps) and 0.0 < self.norm_eps < 1.0):
            raise SpecError(f"model.norm_eps must be in (0, 1), got {show(self.norm_eps)}")
        if self.kv_heads is not None:
            positive("model", kv_heads=self.kv_heads)
            if self.heads % self.kv_heads:
                raise SpecError(
                    f"heads {self.heads} is not divisible by kv_heads {self.kv_heads} "
                    f"({self.heads} / {self.kv_heads} = {self.heads / self.kv_heads:g})"
                )
        if self.positions == "rope" and self.head_dim % 2:
            raise SpecError(f"rotary positions need an even head_dim, got {self.head_dim}")
        for name in ("qkv_bias", "out_bias", "mlp_bias"):
            if getattr(self, name) is not None:
                flag("model", name, getattr(self, name))
        flag("model", "qk_norm", self.qk_norm)
        self._check_rope_scaling()
        if self.sliding_window is not None:
            positive("model", sliding_window=self.sliding_window)
        int_range("model", "window_start_layer", self.window_start_layer, low=0)
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
        int_range("model", "experts", self.experts, low=0)
        positive("model", experts_per_token=self.experts_per_token, moe_every=self.moe_every)
        int_range("model", "shared_experts", self.shared_experts, low=0)
        int_range("model", "moe_first_dense", self.moe_first_dense, low=0)
        flag("model", "router_norm_topk", self.router_norm_topk)
        one_of("model", "router_score", self.router_score, ROUTER_SCORES)
        number("model", "router_scale", self.router_scale, low=0.0, high=1e3, low_open=True)
        positive("model", router_groups=self.router_groups)
        if self.router_group_limit is not None:
            positive("model", router_group_limit=self.router_group_limit)
        number("model", "router_bias_rate", self.router_bias_rate, low=0.0, high=1.0)
        number("model", "aux_loss_coef", self.aux_loss_coef, low=0.0, high=1e3)
        if self.expert_ffn is not None:
            positive("model", expert_ffn=self.expert_ffn)
        if self.capacity_factor is not None:
            number("model", "capacity_factor", self.capacity_factor, low=0.0, high=64.0, low_open=True)
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
        one_of("model", "rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        if self.rope_scaling != "none" and self.positions != "rope":
            raise SpecError(
                f"model.rope_scaling {self.rope_scaling} needs rotary positions (positions rope, got {self.positions})"
            )
        number("model", "rope_factor", self.rope_factor, low=1.0, high=1e6)
        for name in ("rope_low_freq_factor", "rope_high_freq_factor", "rope_beta_fast", "rope_beta_slow"):
            number("model", name, getattr(self, name), low=0.0, high=1e6, low_open=True)
        if self.positions != "rope" and self.rope_theta != ModelSpec.rope_theta:
            raise SpecError(
                f"model.rope_theta {self.rope_theta:g} has no effect with positions {self.positions} (it is the "
                f"rotary base: give positions rope, or leave it at {ModelSpec.rope_theta:g})"
            )
        for scaling, names in (
            ("llama3", ("rope_low_freq_factor", "rope_high_freq_factor")),
            ("yarn", ("rope_beta_fast", "rope_beta_slow")),
        ):
            changed = [n for n in names if getattr(self, n) != getattr(ModelSpec, n)]
            if changed and self.rope_scaling != scaling:
                raise SpecError(
                    f"model.{changed[0]} {getattr(self, changed[0]):g} has no effect with rope_scaling "
                    f"{self.rope_scaling} (only {scaling} reads it; leave it at {getattr(ModelSpec, changed[0]):g})"
                )
        if self.rope_original_context is not None:
            positive("model", rope_original_context=self.rope_original_context)
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

    @cached_property
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
            expert = self.expert_tensors()
            for e in range(self.experts):
                mlp += [(f"mlp.experts.{e}{name}", shape) for name, shape in expert]
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

    @cached_property
    def params_per_block(self) -> int:
        """Parameters of a dense block (see layer_params for a model with sparse blocks)."""
        return sum(math.prod(shape) for _, shape in self.block_tensors())

    def layer_params(self, layer: int) -> int:
        """Parameters of block `layer`, every expert counted."""
        if not self.is_sparse(layer):
            return self.params_per_block
        return self.params_per_block - self.moe_dense_mlp_params + self.sparse_mlp_params

    @cached_property
    def moe_dense_mlp_params(self) -> int:
        """The dense MLP's parameters (what a sparse block replaces)."""
        return sum(math.prod(shape) for _, shape in self.mlp_tensors("", self.ffn))

    @cached_property
    def expert_params(self) -> int:
        """Parameters of one routed expert."""
        return sum(math.prod(shape) for _, shape in self.expert_tensors())

    @cached_property
    def sparse_mlp_params(self) -> int:
        """A sparse block's MLP: router + every routed expert + the shared experts."""
        shared = (
            sum(math.prod(s) for _, s in self.mlp_tensors("", self.shared_experts * self.expert_width))
            if self.shared_experts
            else 0
        )
        return self.experts * self.hidden + self.experts * self.expert_params + shared

    @cached_property
    def routed_expert_params(self) -> int:
        """Every routed expert of every sparse block: the parameters expert parallelism divides over ep."""
        return len(self.sparse_layers) * self.experts * self.expert_params

    @cached_property
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

    @cached_property
    def num_params(self) -> int:
        """Total parameters, counting a tied embedding once."""
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.embedding_params + self.blocks_params + self.final_norm_params + head

    @cached_property
    def active_params(self) -> int:
        """Parameters one token passes through: every routed expert but its experts_per_token left out (the
        count MoE papers publish as 'active'; = num_params for a dense model)."""
        idle = (self.experts - self.experts_per_token) * self.expert_params if self.experts else 0
        return self.num_params - len(self.sparse_layers) * idle


add_limits(ModelSpec)
