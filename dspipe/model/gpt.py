"""The decoder in plain PyTorch, GPT-2/3 or Llama-family as the ModelSpec declares it (norm, MLP, positions and
rotary scaling, grouped-query attention, head width, q/k norm, sliding window, biases, tied head). No distributed
code here: the pipeline wrapper reuses these blocks, and recomputation, tensor and sequence parallelism set its slots
or swap pieces from outside (dspipe.runtime.parallelize).

Parameter names follow Hugging Face GPT-2 (wte, wpe, h.N.ln_1, attn.c_attn, [attn.q_norm, attn.k_norm,]
attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj, ln_f) whatever the architecture: q/k/v are one fused projection
([q; k; v] rows) and a SwiGLU's gate and up projections one fused c_fc ([gate; up] rows), so an export is a rename,
a split and (GPT-2's Conv1D) a transpose. A mixture-of-experts block's MLP is a SparseMLP: mlp.router,
mlp.experts.E.{c_fc,c_proj} (each an MLP expert_width wide) and, with shared experts, mlp.shared. Every
parameter is listed by ModelSpec.model_tensors(), which the planner counts from.
Step-0 values: dspipe.model.initial (each component's `initial_values`, `fill`).
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from dspipe.model.initial import (
    EMBED_INDEX,
    INIT_STD,
    Draw,
    _constant,
    _generator,
    _linear_values,
    _norm_values,
    _normal,
    _OwnNormal,
    expert_generator,
    write_blocks,
)
from dspipe.model.window import choose_kernel, flex_window_attention
from dspipe.spec.model import ModelSpec


def initial_values(module: nn.Module, *, seed: int) -> Iterator[tuple[nn.Parameter, Draw]]:
    """Every parameter of `module`'s components (Embedding, Block, FinalNorm, LMHead) with its step-0 draw, in
    the order the draws must be made."""
    for m in module.modules():
        if isinstance(m, (Embedding, Block, FinalNorm, LMHead)):
            yield from m.initial_values(seed=seed)


def _copy(param: nn.Parameter, draw: Draw) -> None:
    write_blocks(param, draw)


def fill(module: nn.Module, *, seed: int, write: Callable[[nn.Parameter, Draw], None] = _copy) -> int:
    """Give every parameter of `module` its step-0 value through `write(param, draw)` (default: copy in place);
    a parameter that no component declares is an error. Returns the number of tensors written."""
    done = set()
    with torch.no_grad():
        for param, draw in initial_values(module, seed=seed):
            write(param, draw)
            done.add(id(param))
    missed = [name for name, p in module.named_parameters() if id(p) not in done]
    if missed:
        raise RuntimeError(f"no initial value declared for {missed[:3]}")
    return len(done)


def norm_layer(spec: ModelSpec) -> nn.Module:
    """LayerNorm (with a bias when the spec has biases) or RMSNorm, at the spec's epsilon."""
    if spec.norm == "rmsnorm":
        return nn.RMSNorm(spec.hidden, eps=spec.norm_eps)
    return nn.LayerNorm(spec.hidden, eps=spec.norm_eps, bias=spec.bias)


def rope_frequencies(spec: ModelSpec, *, device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies (head_dim / 2 of them, fp32) and the factor on cos and sin, with the spec's
    scaling, as transformers computes them:
    none: theta^(-2i/d); linear: divided by the factor;
    llama3: wavelengths 2 pi / f above original_context / low_freq_factor divided by the factor, below
    original_context / high_freq_factor kept, in between (1 - t) f / factor + t f with
    t = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor);
    yarn: a linear ramp between the dimensions that make beta_fast and beta_slow rotations over original_context
    (floor / ceil, clamped to [0, d - 1]) blends kept (fast) and divided (slow) frequencies; cos and sin are
    multiplied by 0.1 ln(factor) + 1."""
    dim, base, factor = spec.head_dim, spec.rope_theta, spec.rope_factor
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (base**exponents)
    if spec.rope_scaling == "none":
        return inv_freq, 1.0
    if spec.rope_scaling == "linear":
        return inv_freq / factor, 1.0
    context = spec.rope_original_context
    if spec.rope_scaling == "llama3":
        low, high = spec.rope_low_freq_factor, spec.rope_high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        long = wavelength > context / low  # low frequencies: interpolated
        short = wavelength < context / high  # high frequencies: kept
        base_freq = torch.where(long, inv_freq / factor, inv_freq)
        t = (context / wavelength - low) / (high - low)
        blended = (1 - t) * base_freq / factor + t * base_freq
        return torch.where(~short & ~long, blended, base_freq), 1.0
    if spec.rope_scaling == "yarn":

        def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
            return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

        first = max(math.floor(dim_of(spec.rope_beta_fast)), 0)
        last = min(math.ceil(dim_of(spec.rope_beta_slow)), dim - 1)
        span = (last if last != first else last + 0.001) - first  # equal ends: a step instead of a ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - first) / span).clamp(0, 1).to(device)
        kept = 1 - ramp  # share of the unscaled frequency
        slow = 1.0 / (factor * base**exponents)
        scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        return slow * (1 - kept) + inv_freq * kept, scale
    raise ValueError(f"unknown rope_scaling {spec.rope_scaling!r}")


def rotary(x: torch.Tensor, *, offset: int, inv_freq: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Rotary position embedding of (batch, seq, heads, head_dim) at positions offset .. offset + seq - 1, in the
    half-split layout (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) that Hugging Face's Llama uses, with
    `inv_freq` and `scale` from rope_frequencies; the angles are computed in fp32."""
    seq = x.shape[1]
    pos = torch.arange(offset, offset + seq, device=x.device, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq.to(x.device))
    both = torch.cat([angles, angles], dim=-1)
    cos, sin = both.cos(), both.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos, sin = cos.to(x.dtype)[None, :, None, :], sin.to(x.dtype)[None, :, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def window_mask(seq: int, window: int, *, device=None) -> torch.Tensor:
    """Sliding-window causal mask (seq, seq), True where query q may see key k: q - window < k <= q."""
    pos = torch.arange(seq, device=device)
    back = pos[:, None] - pos[None, :]
    return (back >= 0) & (back < window)


class Embedding(nn.Module):
    """Token (+ learned position) embeddings; `logits` reuses wte as the tied output head."""

    def __init__(self, spec: ModelSpec, *, seed: int | None):
        super().__init__()
        self.wte = nn.Embedding(spec.vocab, spec.hidden)
        self.wpe = nn.Embedding(spec.seq_len, spec.hidden) if spec.positions == "learned" else None
        self.drop = nn.Dropout(spec.dropout)
        self.position_offset = 0
        """Position of the input's first token (non-zero when the input is a later slice of a sequence)."""
        self.head_linear: Callable | None = None
        """Set to replace F.linear(x, wte.weight) as the tied head (tensor parallelism: a column-parallel product)."""
        if seed is not None:
            fill(self, seed=seed)

    def initial_values(self, *, seed: int):
        gen = _generator(seed, EMBED_INDEX)
        for table in (self.wte, self.wpe):
            if table is not None:
                yield table.weight, _normal(gen, (table.num_embeddings, table.embedding_dim), INIT_STD)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(self.position_offset, self.position_offset + idx.shape[1], device=idx.device))
        return self.drop(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return (self.head_linear or F.linear)(x, self.wte.weight)


class Attention(nn.Module):
    """Causal self-attention through scaled_dot_product_attention (flash/memory-efficient kernels); grouped-query
    when kv_heads < heads (each key/value head serves heads / kv_heads query heads); heads head_dim wide (not
    necessarily hidden / heads); optional RMSNorm of every q and k head (qk_norm); rotary (scaled or not) or none;
    a sliding window (`window` tokens: query q sees keys q - window < k <= q) or the whole causal prefix; a
    window shorter than the sequence runs flex_attention with a block mask on CUDA, SDPA with the (s, s) window_mask
    elsewhere and under attention dropout (dspipe.model.window)."""

    def __init__(self, spec: ModelSpec, *, window: int | None = None):
        super().__init__()
        self.head_dim, self.dropout, self.window = spec.head_dim, spec.dropout, window
        self.group = spec.heads // spec.kv_groups
        self.rope = spec if spec.positions == "rope" else None
        self._frequencies: dict[str, tuple[torch.Tensor, float]] = {}  # rope_frequencies per device
        self.position_offset = 0
        """Position of the input's first token (rotary positions of a later sequence slice)."""
        qkv_bias, out_bias, _ = spec.biases
        self.c_attn = nn.Linear(spec.hidden, spec.qkv_width, bias=qkv_bias)
        self.q_norm = nn.RMSNorm(spec.head_dim, eps=spec.norm_eps) if spec.qk_norm else None
        self.k_norm = nn.RMSNorm(spec.head_dim, eps=spec.norm_eps) if spec.qk_norm else None
        self.c_proj = nn.Linear(spec.q_width, spec.hidden, bias=out_bias)
        self.resid_drop = nn.Dropout(spec.dropout)
        self.core: Callable | None = None
        """Set to replace local_core (same signature), e.g. by an attention that spans a split sequence."""
        self.core_checkpoint: Callable | None = None
        """Set to a checkpoint function to recompute the attention core in backward (selective recomputation)."""
        self.window_kernel: str | None = None
        """Set to 'mask' or 'flex' to force a windowed core's kernel (tests, benchmarks); None: by device."""

    def local_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over (batch, seq, heads, head_dim) tensors, returned in the same layout. q, k and v
        hold the same positions (under Ulysses the whole sequence: this runs after the all-to-all), so the window
        counts whole-sequence positions. A window at least the sequence long is plain causal attention; a shorter
        one runs the kernel choose_kernel picks (flex_attention on CUDA without dropout, else the masked SDPA)."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        dropout = self.dropout if self.training else 0.0
        seq = q.shape[2]
        kernel = choose_kernel(
            device_type=q.device.type, seq=seq, window=self.window, dropout=dropout, override=self.window_kernel
        )
        if kernel == "causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        elif kernel == "flex":
            y = flex_window_attention(q, k, v, window=self.window)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=window_mask(seq, self.window, device=q.device), dropout_p=dropout
            )
        return y.transpose(1, 2)

    def frequencies(self, device: torch.device) -> tuple[torch.Tensor, float]:
        """rope_frequencies of the spec on `device`, computed once per device."""
        key = str(device)
        if key not in self._frequencies:
            self._frequencies[key] = rope_frequencies(self.rope, device=device)
        return self._frequencies[key]

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of (batch, seq, hidden) input as (batch, seq, local heads, head_dim), normalised (qk_norm) and
        rotated at this module's positions, k and v repeated to one per query head."""
        qkv = self.c_attn(x)
        b, s, _ = qkv.shape  # under Megatron's sequence parallelism x holds a slice, qkv the whole sequence
        # the heads this module holds: a tensor-parallel shard holds heads / tp query and kv_heads / tp key/value heads
        kv = qkv.shape[-1] // (self.head_dim * (self.group + 2))
        q, k, v = (
            t.view(b, s, -1, self.head_dim)
            for t in qkv.split([self.group * kv * self.head_dim, kv * self.head_dim, kv * self.head_dim], dim=2)
        )
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            inv_freq, scale = self.frequencies(x.device)
            q, k = (rotary(t, offset=self.position_offset, inv_freq=inv_freq, scale=scale) for t in (q, k))
        if self.group > 1:  # every query head gets its key/value head (heads i*group .. share kv head i)
            k, v = (t.repeat_interleave(self.group, dim=2) for t in (k, v))
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        b, s = q.shape[:2]
        core = self.core or self.local_core
        y = self.core_checkpoint(core, q, k, v) if self.core_checkpoint else core(q, k, v)
        return self.resid_drop(self.c_proj(y.reshape(b, s, -1)))


class MLP(nn.Module):
    """fc -> GELU (tanh) -> proj, or SwiGLU: silu(gate) x up -> proj with gate and up fused in c_fc; `width` wide
    inside (None: the spec's ffn; an expert: expert_width)."""

    def __init__(self, spec: ModelSpec, *, width: int | None = None):
        super().__init__()
        self.swiglu = spec.mlp == "swiglu"
        bias, width = spec.biases[2], width or spec.ffn
        self.c_fc = nn.Linear(spec.hidden, 2 * width if self.swiglu else width, bias=bias)
        self.c_proj = nn.Linear(width, spec.hidden, bias=bias)
        self.drop = nn.Dropout(spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.c_fc(x).chunk(2, dim=-1)  # a tensor-parallel shard holds [gate_r; up_r]
            return self.drop(self.c_proj(F.silu(gate) * up))
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


def route(
    logits: torch.Tensor,
    *,
    k: int,
    norm_topk: bool,
    score: str = "softmax",
    scale: float = 1.0,
    bias: torch.Tensor | None = None,
    groups: int = 1,
    group_limit: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits (tokens, E) -> (each token's expert probabilities for the balance loss (tokens, E), its top-k
    combine weights, its chosen experts (tokens, k), best first), in fp32.

    softmax (Mixtral, Qwen3-MoE): the scores are the softmax over all experts, and also the probabilities.
    sigmoid (DeepSeek-V3): the scores are each expert's own sigmoid; the probabilities are the scores divided by
    their sum over the experts (DeepSeek-V3's normalised affinities).
    The chosen experts are the k highest selection scores: the scores + `bias` (aux-loss-free balancing), among the
    `group_limit` of the `groups` expert groups whose two best selection scores sum highest (DeepSeek-V3's
    group-limited routing). Their weights are their scores (never the bias), divided by their sum when `norm_topk`
    (+ 1e-20 for sigmoid, as DeepSeek-V3), then times `scale` (its routed_scaling_factor)."""
    logits = logits.float()
    scores = logits.softmax(dim=-1) if score == "softmax" else logits.sigmoid()
    probs = scores if score == "softmax" else scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    choice = scores.detach() if bias is None else scores.detach() + bias.float()
    if group_limit is not None and group_limit < groups:
        grouped = choice.view(choice.shape[0], groups, -1)
        best = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (tokens, groups)
        keep = torch.zeros_like(best, dtype=torch.bool).scatter(1, best.topk(group_limit, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
    chosen = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if norm_topk:  # sigmoid scores of very negative logits may all be ~0: DeepSeek-V3's 1e-20 keeps the sum finite
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if score == "sigmoid" else 0.0))
    return probs, weights * scale if scale != 1 else weights, chosen


class RouterState(nn.Module):
    """What a sparse block keeps across forwards: `routing` (route's keywords but the bias), `router_bias`, the
    experts' selection bias for aux-loss-free balancing (router_bias_rate > 0; an fp32 buffer in the module's state:
    checkpoints hold it, a cast of the model leaves it fp32), and the tokens each expert was sent by the training
    forwards (the step's expert loads). A micro-batch counts once however often its block runs: a recomputation
    (reentrant or not; it runs inside the backward) counts nothing, and GPT.forward adds the last count to the total
    before the next micro-batch (commit_routed; a pipeline stage's blocks after their forward)."""

    def _init_router_state(self, spec: ModelSpec) -> None:
        self.routing = dict(
            k=spec.experts_per_token,
            norm_topk=spec.router_norm_topk,
            score=spec.router_score,
            scale=spec.router_scale,
            groups=spec.router_groups,
            group_limit=spec.router_group_limit,
        )
        self.register_buffer("router_bias", torch.zeros(spec.experts) if spec.router_bias_rate else None)
        self.num_experts = spec.experts
        self._routed_last: torch.Tensor | None = None  # the last training forward's tokens per expert
        self._routed: torch.Tensor | None = None  # the committed micro-batches' since take_routed

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        bias = self._buffers.get("router_bias")
        if bias is not None and bias.dtype != torch.float32:  # set up at zero: nothing is lost
            self._buffers["router_bias"] = bias.float()
        return self

    def _count(self, chosen: torch.Tensor) -> None:
        if self.training and torch._C._current_graph_task_id() == -1:  # not a recomputation (one runs in a backward)
            self._routed_last = expert_counts(chosen, num_experts=self.num_experts)

    def commit_routed(self) -> None:
        """The last micro-batch's count into the total (GPT.forward, before the next micro-batch's blocks run)."""
        if self._routed_last is not None:
            last, self._routed_last = self._routed_last, None
            self._routed = last if self._routed is None else self._routed + last

    def take_routed(self, *, device) -> torch.Tensor:
        """Tokens per expert of the training micro-batches since the last call (int64; zeros on `device` if none);
        the count restarts."""
        self.commit_routed()
        routed, self._routed = self._routed, None
        return routed if routed is not None else torch.zeros(self.num_experts, dtype=torch.int64, device=device)


def balance_loss(probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Load-balancing loss of one sparse block, E x sum_e f_e P_e: f_e the top-k routes to expert e per token
    (sum_e f_e = k), P_e the mean router probability of e (route's probabilities: transformers'
    load_balancing_loss_func for one layer under softmax; DeepSeek-V3's normalised affinities under sigmoid)."""
    return probs.shape[-1] * (routes_per_expert(probs, chosen) / probs.shape[0] * probs.mean(dim=0)).sum()


def expert_counts(chosen: torch.Tensor, *, num_experts: int) -> torch.Tensor:
    """The routes to each expert (int64): `chosen`'s counts, on its device and without a host synchronisation
    (torch.bincount on CUDA reads the ids' minimum and maximum back to the host first: 2 waits per call)."""
    flat = chosen.reshape(-1)
    return torch.zeros(num_experts, device=flat.device, dtype=torch.long).index_add_(0, flat, torch.ones_like(flat))


def routes_per_expert(probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The top-k routes to each expert (`chosen`'s counts, in `probs`' dtype)."""
    routes = torch.zeros(probs.shape[-1], device=probs.device, dtype=probs.dtype)
    routes.index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device, dtype=probs.dtype))
    return routes


class SparseMLP(RouterState):
    """Mixture of experts, dropless, as transformers' Mixtral / Qwen3-MoE / DeepSeek-V3 compute it: the router's
    logits (fp32) -> softmax (or sigmoid) scores -> top-k (route: selection bias and expert groups; renormalised when
    router_norm_topk, times router_scale) -> each token's output is the weighted sum of its k experts (each an MLP
    expert_width wide) plus the shared experts' MLP (no gate). The block's load-balancing loss (balance_loss, with
    its graph) is left in `self.aux` by every forward."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self._init_router_state(spec)
        self.router = nn.Linear(spec.hidden, spec.experts, bias=False)
        self.experts = nn.ModuleList(MLP(spec, width=spec.expert_width) for _ in range(spec.experts))
        self.shared = MLP(spec, width=spec.shared_experts * spec.expert_width) if spec.shared_experts else None
        self.aux: torch.Tensor | None = None

    def router_weight(self) -> torch.Tensor:
        """The router's weight as the forward uses it."""
        return self.router.weight

    def balance(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The block's load-balancing loss over the tokens it routed (balance_loss)."""
        return balance_loss(probs, chosen)

    def routed(self, flat: torch.Tensor, *, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' output for tokens `flat` (T, h): each token's k chosen experts (T, k) weighed by
        `weights` (T, k) and summed, expert after expert (each expert once, on the tokens that chose it)."""
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, token, expert(flat.index_select(0, token)) * weights[token, slot, None])
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = F.linear(flat.float(), self.router_weight().float())
        probs, weights, chosen = route(logits, bias=self.router_bias, **self.routing)
        self.aux = self.balance(probs, chosen)
        self._count(chosen)
        weights = weights.to(flat.dtype)  # the activations' dtype, as transformers and DeepSpeed weigh the outputs
        out = self.routed(flat, chosen=chosen, weights=weights)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view_as(x)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)); the MLP a SparseMLP in the spec's
    sparse blocks (`sparse`), whose load-balancing loss the block keeps in `aux` after each forward (read from
    mlp.aux: a module that replaces the SparseMLP leaves its loss there too)."""

    def __init__(self, spec: ModelSpec, *, index: int, seed: int | None):
        super().__init__()
        self.index, self.layers = index, spec.layers
        self.sparse = spec.is_sparse(index)
        self.ln_1 = norm_layer(spec)
        self.attn = Attention(spec, window=spec.window_of(index))
        self.ln_2 = norm_layer(spec)
        self.mlp = SparseMLP(spec) if self.sparse else MLP(spec)
        self.aux: torch.Tensor | None = None
        """A sparse block's load-balancing loss of its last forward (with its graph); None for a dense block."""
        if seed is not None:
            fill(self, seed=seed)

    def _mlp_linears(self, std: float, resid_std: float):
        if not self.sparse:
            yield from ((self.mlp.c_fc, std), (self.mlp.c_proj, resid_std))
            return
        yield self.mlp.router, std
        if self.mlp.shared is not None:
            yield from ((self.mlp.shared.c_fc, std), (self.mlp.shared.c_proj, resid_std))

    def _expert_values(self, *, seed: int, std: float, resid_std: float):
        """Each routed expert from its own generator (expert_generator)."""
        for e, mlp in enumerate(self.mlp.experts if self.sparse else ()):
            gen = expert_generator(seed, block=self.index, expert=e)
            yield mlp.c_fc.weight, _OwnNormal(gen, (mlp.c_fc.out_features, mlp.c_fc.in_features), std)
            yield mlp.c_proj.weight, _OwnNormal(gen, (mlp.c_proj.out_features, mlp.c_proj.in_features), resid_std)
            for linear in (mlp.c_fc, mlp.c_proj):
                if linear.bias is not None:
                    yield linear.bias, _constant((linear.out_features,), 0.0)

    def initial_values(self, *, seed: int):
        gen = _generator(seed, self.index + 1)
        resid_std = INIT_STD / math.sqrt(2 * self.layers)  # GPT-2: scale residual projections by 1/sqrt(2L)
        for linear, std in (
            (self.attn.c_attn, INIT_STD),
            (self.attn.c_proj, resid_std),
            *self._mlp_linears(INIT_STD, resid_std),
        ):
            yield from _linear_values(linear, gen, std)
        yield from self._expert_values(seed=seed, std=INIT_STD, resid_std=resid_std)
        if self.sparse and self.mlp.router_bias is not None:  # aux-loss-free balancing starts unbiased
            yield self.mlp.router_bias, _constant(tuple(self.mlp.router_bias.shape), 0.0)
        yield from _norm_values(self.ln_1)
        yield from _norm_values(self.ln_2)
        for norm in (self.attn.q_norm, self.attn.k_norm):  # after the draws: other models' values do not move
            if norm is not None:
                yield from _norm_values(norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        if self.sparse:
            self.aux = self.mlp.aux
        return x

    def forward_aux(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, load-balancing loss) of a sparse block: what a checkpoint function recomputes, so the aux loss
        leaves it as an output and the router gets its gradient."""
        x = self(x)
        return x, self.aux


class FinalNorm(nn.Module):
    def __init__(self, spec: ModelSpec, *, seed: int | None = None):
        super().__init__()
        self.ln_f = norm_layer(spec)
        if seed is not None:
            fill(self, seed=seed)

    def initial_values(self, *, seed: int):
        return _norm_values(self.ln_f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)


class LMHead(nn.Module):
    """Untied output projection (only when tied_embeddings is off)."""

    def __init__(self, spec: ModelSpec, *, seed: int | None):
        super().__init__()
        self.index, self.shape = spec.layers + 1, (spec.vocab, spec.hidden)
        self.weight = nn.Parameter(torch.empty(self.shape))
        self.head_linear: Callable | None = None
        """Set to replace F.linear(x, weight) (tensor parallelism: a column-parallel product)."""
        if seed is not None:
            fill(self, seed=seed)

    def initial_values(self, *, seed: int):
        yield self.weight, _normal(_generator(seed, self.index), self.shape, INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.head_linear or F.linear)(x, self.weight)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the activation dtype."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


class GPT(nn.Module):
    def __init__(self, spec: ModelSpec, *, seed: int | None):
        """`seed` None: the parameters are created but not given values (a builder fills them: `fill`)."""
        super().__init__()
        self.spec = spec
        self.embed = Embedding(spec, seed=None)
        self.h = nn.ModuleList(Block(spec, index=i, seed=None) for i in range(spec.layers))
        self.final = FinalNorm(spec)
        self.lm_head = None if spec.tied_embeddings else LMHead(spec, seed=None)
        if seed is not None:
            fill(self, seed=seed)
        self.block_checkpoint: Callable | None = None
        """Set to a checkpoint function to recompute each block in backward (full recomputation)."""
        self.loss_fn: Callable = lm_loss
        """(logits, labels) -> mean loss; tensor parallelism sets one that takes a vocabulary slice of the logits."""
        self.head_loss: Callable | None = None
        """Set to (hidden, head weight, labels) -> mean loss to compute the loss without the full logits
        (strategy.loss_chunk: dspipe.model.loss.HeadLoss); replaces the head and loss_fn when labels are given."""
        self.last_lm_loss: torch.Tensor | None = None
        """The language-model loss of the last forward with labels (detached)."""
        self.last_aux_loss: torch.Tensor | None = None
        """The mean load-balancing loss over the sparse blocks of the last forward with labels (detached; None for
        a dense model)."""

    @property
    def head_weight(self) -> nn.Parameter:
        """The output head's (V, h) weight: the token embedding's when tied, else the untied head's."""
        return self.embed.wte.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, idx: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (b, s, V), or the mean loss when labels are given: the LM loss, plus aux_loss_coef x the mean of
        the sparse blocks' load-balancing losses for a mixture-of-experts model."""
        x = self.embed(idx)
        aux = []
        for block in self.h:
            if block.sparse and self.training:
                block.mlp.commit_routed()  # the previous micro-batch's expert loads, counted once
            if self.block_checkpoint and self.training:
                if block.sparse:  # the aux loss leaves the checkpoint as an output: it keeps its gradient
                    x, block.aux = self.block_checkpoint(block.forward_aux, x)
                else:
                    x = self.block_checkpoint(block, x)
            else:
                x = block(x)
            if block.sparse:
                aux.append(block.aux)
        x = self.final(x)
        if labels is not None and self.head_loss is not None:
            loss = self.head_loss(x, self.head_weight, labels)
        else:
            logits = self.embed.logits(x) if self.lm_head is None else self.lm_head(x)
            if labels is None:
                return logits
            loss = self.loss_fn(logits, labels)
        self.last_lm_loss = loss.detach()
        if not aux:
            return loss
        aux_loss = torch.stack(aux).mean()
        self.last_aux_loss = aux_loss.detach()
        return loss + self.spec.aux_loss_coef * aux_loss
