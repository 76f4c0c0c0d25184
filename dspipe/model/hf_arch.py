"""ModelSpec -> the Hugging Face architecture that computes it exactly (architecture_of) and its config
(hf_config, rope_parameters). The architectures, what each computes, and config.json -> ModelSpec:
dspipe.model.hf."""

from __future__ import annotations

from dspipe.errors import SpecError
from dspipe.model.hf import GELU_TANH, GPT2, LLAMA, MISTRAL, MIXTRAL, QWEN2, QWEN3, QWEN3_MOE, SUPPORTED
from dspipe.spec.model import ModelSpec

# ---- ModelSpec -> Hugging Face config ------------------------------------------------------------------------------


def architecture_of(spec: ModelSpec) -> str:
    """The Hugging Face architecture that computes `spec`'s function exactly; one line when there is none.
    Qwen3 for q/k norm; Qwen2 for q/k/v biases without o and MLP biases; Mistral for a window on every layer (and a
    head width Llama's config refuses); Llama otherwise (q/k/v/o biases all or none, MLP biases either way).
    With experts: Qwen3-MoE for q/k norm, else Mixtral (_moe_architecture)."""
    if spec.experts:
        return _moe_architecture(spec)
    if spec.norm == "layernorm" and spec.mlp == "gelu" and spec.positions == "learned":
        if (
            spec.bias
            and spec.biases == (True, True, True)
            and spec.kv_groups == spec.heads
            and spec.head_dim * spec.heads == spec.hidden
            and not spec.qk_norm
            and spec.sliding_window is None
        ):
            return GPT2
        raise _no_architecture(
            spec,
            f"{GPT2} has biases everywhere, no grouped-query attention, head_dim hidden / "
            f"heads, no q/k norm and no sliding window",
        )
    if (spec.norm, spec.mlp, spec.positions) != ("rmsnorm", "swiglu", "rope"):
        raise _no_architecture(
            spec, f"{GPT2} is layernorm, gelu, learned positions; {', '.join(SUPPORTED[1:])} are rmsnorm, swiglu, rope"
        )
    qkv, out, mlp = spec.biases
    windowed = spec.sliding_window is not None
    if spec.qk_norm:
        if qkv == out and not mlp:
            return QWEN3
        raise _no_architecture(
            spec, f"q/k norm is {QWEN3}'s, whose q/k/v/o biases are all or none and whose MLP has none"
        )
    if qkv and not out and not mlp:
        return QWEN2
    if windowed:
        if spec.window_start_layer == 0 and not (qkv or out or mlp):
            return MISTRAL
        raise _no_architecture(
            spec,
            f"a sliding window is {MISTRAL}'s (every layer, no biases), {QWEN2}'s (q/k/v "
            f"biases only) or {QWEN3}'s (q/k norm)",
        )
    if qkv != out:
        raise _no_architecture(
            spec,
            f"{LLAMA}'s attention_bias gives q, k, v and o biases together; q/k/v biases "
            f"alone are {QWEN2}'s (no o or MLP bias)",
        )
    if spec.hidden % spec.heads:  # LlamaConfig refuses it; Mistral's config (window null) computes the same
        if not (qkv or mlp):
            return MISTRAL
        raise _no_architecture(spec, f"{LLAMA}'s config needs hidden divisible by heads, and {MISTRAL} has no biases")
    return LLAMA


def _moe_architecture(spec: ModelSpec) -> str:
    """Qwen3MoeForCausalLM (q/k norm; q/k/v/o biases all or none; any top-k normalisation, dense blocks, expert
    width) or MixtralForCausalLM (no q/k norm, no biases, top-k renormalised, every block sparse, experts ffn wide);
    both: rmsnorm, swiglu, rope, no MLP biases, no shared experts, softmax routing unscaled over every expert without
    a selection bias, a window on every layer or none. Training-only
    fields (capacity_factor) do not matter: the exported model is dropless, as dspipe's plain model."""
    qkv, out, mlp = spec.biases
    if (spec.norm, spec.mlp, spec.positions) != ("rmsnorm", "swiglu", "rope"):
        why = f"{MIXTRAL} and {QWEN3_MOE} are rmsnorm, swiglu, rope"
    elif spec.shared_experts:
        why = f"shared_experts {spec.shared_experts}: neither {MIXTRAL} nor {QWEN3_MOE} has shared experts"
    elif spec.router_score != "softmax":
        why = f"router_score {spec.router_score}: {MIXTRAL} and {QWEN3_MOE} route by softmax (sigmoid is DeepSeek-V3's)"
    elif spec.router_scale != 1:
        why = f"router_scale {spec.router_scale:g}: {MIXTRAL} and {QWEN3_MOE} do not scale the combine weights"
    elif spec.router_group_limit is not None:
        why = f"router_group_limit {spec.router_group_limit}: {MIXTRAL} and {QWEN3_MOE} route over every expert"
    elif spec.router_bias_rate:
        why = f"router_bias_rate {spec.router_bias_rate:g}: {MIXTRAL} and {QWEN3_MOE} have no expert selection bias"
    elif mlp:
        why = f"neither {MIXTRAL} nor {QWEN3_MOE} has MLP (expert) biases"
    elif spec.sliding_window is not None and spec.window_start_layer:
        why = f"{MIXTRAL}'s and {QWEN3_MOE}'s sliding window is on every layer (window_start_layer 0)"
    elif spec.qk_norm:
        if qkv == out:
            return QWEN3_MOE
        why = f"q/k norm is {QWEN3_MOE}'s, whose q/k/v/o biases are all or none"
    elif qkv or out:
        why = f"{MIXTRAL} has no attention biases ({QWEN3_MOE}, with them, has q/k norm)"
    elif not spec.router_norm_topk:
        why = f"{MIXTRAL} renormalises the top-k probabilities ({QWEN3_MOE}, which may not, has q/k norm)"
    elif len(spec.sparse_layers) != spec.layers:
        why = (
            f"{MIXTRAL} has every block sparse (sparse blocks here: {len(spec.sparse_layers)} of {spec.layers}; "
            f"{QWEN3_MOE}, with dense blocks, has q/k norm)"
        )
    elif spec.expert_width != spec.ffn:
        why = (
            f"{MIXTRAL}'s experts are intermediate_size wide: expert_ffn {spec.expert_width} must equal ffn {spec.ffn}"
        )
    else:
        return MIXTRAL
    raise SpecError(
        f"model {spec.name} ({spec.experts} experts, top-{spec.experts_per_token}"
        f"{'' if spec.router_norm_topk else ' unnormalised'}, q/k norm {_yes(spec.qk_norm)}, biases q/k/v "
        f"{_yes(qkv)}, o {_yes(out)}, MLP {_yes(mlp)}) matches no Hugging Face architecture dspipe writes: "
        f"{why}"
    )


def _no_architecture(spec: ModelSpec, why: str) -> SpecError:
    qkv, out, mlp = spec.biases
    window = spec.sliding_window
    extras = (
        [f"head_dim {spec.head_dim}"]
        + (["q/k norm"] if spec.qk_norm else [])
        + ([f"sliding window {window} from block {spec.window_start_layer}"] if window is not None else [])
    )
    return SpecError(
        f"model {spec.name} ({spec.norm}, {spec.mlp} MLP, {spec.positions} positions, biases q/k/v "
        f"{_yes(qkv)}, o {_yes(out)}, MLP {_yes(mlp)}, kv_heads {spec.kv_groups} of {spec.heads} heads, "
        f"{', '.join(extras)}) matches no Hugging Face architecture dspipe writes: {why}"
    )


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def rope_parameters(spec: ModelSpec) -> dict:
    """`spec`'s rotary embedding as transformers 5 writes rope_parameters (rope_theta inside)."""
    kind = "default" if spec.rope_scaling == "none" else spec.rope_scaling
    out = {"rope_type": kind, "rope_theta": float(spec.rope_theta)}
    if kind != "default":
        out["factor"] = float(spec.rope_factor)
    if kind in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = spec.rope_original_context
    if kind == "llama3":
        out.update(low_freq_factor=float(spec.rope_low_freq_factor), high_freq_factor=float(spec.rope_high_freq_factor))
    if kind == "yarn":
        out.update(beta_fast=float(spec.rope_beta_fast), beta_slow=float(spec.rope_beta_slow))
    return out


def _gpt2_config(spec: ModelSpec, *, eos_id: int | None, bos_id: int | None):
    """The transformers GPT2Config of a GPT-2 `spec`."""
    import transformers

    return transformers.GPT2Config(
        vocab_size=spec.vocab,
        n_positions=spec.seq_len,
        n_embd=spec.hidden,
        n_layer=spec.layers,
        n_head=spec.heads,
        n_inner=spec.ffn,
        activation_function=GELU_TANH,
        resid_pdrop=spec.dropout,
        embd_pdrop=spec.dropout,
        attn_pdrop=spec.dropout,
        layer_norm_epsilon=spec.norm_eps,
        tie_word_embeddings=spec.tied_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        architectures=[GPT2],
    )


def _common_fields(spec: ModelSpec, *, arch: str, eos_id: int | None, bos_id: int | None) -> dict:
    """The config fields every Llama-style architecture takes from `spec`."""
    return dict(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_groups,
        head_dim=spec.head_dim,
        hidden_act="silu",
        max_position_embeddings=spec.seq_len,
        rms_norm_eps=spec.norm_eps,
        tie_word_embeddings=spec.tied_embeddings,
        rope_parameters=rope_parameters(spec),
        attention_dropout=0.0,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        architectures=[arch],
    )


def hf_config(spec: ModelSpec, *, eos_id: int | None, bos_id: int | None = None):
    """The transformers config of architecture_of(spec) for `spec` (bos defaults to eos)."""
    import transformers

    arch = architecture_of(spec)
    bos_id = eos_id if bos_id is None else bos_id
    if arch == GPT2:
        return _gpt2_config(spec, eos_id=eos_id, bos_id=bos_id)
    qkv, _, mlp = spec.biases
    common = _common_fields(spec, arch=arch, eos_id=eos_id, bos_id=bos_id)
    window = spec.sliding_window
    if arch == LLAMA:
        return transformers.LlamaConfig(**common, attention_bias=qkv, mlp_bias=mlp)
    if arch == MISTRAL:
        return transformers.MistralConfig(**common, sliding_window=window)
    moe = dict(
        num_experts_per_tok=spec.experts_per_token, router_aux_loss_coef=spec.aux_loss_coef, output_router_logits=False
    )
    if arch == MIXTRAL:
        common["intermediate_size"] = spec.expert_width
        return transformers.MixtralConfig(
            **common, **moe, sliding_window=window, num_local_experts=spec.experts, router_jitter_noise=0.0
        )
    if arch == QWEN3_MOE:
        return transformers.Qwen3MoeConfig(
            **common,
            **moe,
            attention_bias=qkv,
            use_sliding_window=window is not None,
            sliding_window=window,
            num_experts=spec.experts,
            moe_intermediate_size=spec.expert_width,
            norm_topk_prob=spec.router_norm_topk,
            decoder_sparse_step=spec.moe_every,
            mlp_only_layers=list(range(spec.moe_first_dense)),
        )
    qwen = dict(
        use_sliding_window=window is not None,
        sliding_window=window,
        max_window_layers=spec.window_start_layer if window is not None else spec.layers,
    )
    if arch == QWEN2:
        return transformers.Qwen2Config(**common, **qwen)
    return transformers.Qwen3Config(**common, **qwen, attention_bias=qkv)
