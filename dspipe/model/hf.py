"""The Hugging Face architectures dspipe reads and writes, GPT2LMHeadModel and the Llama family (LlamaForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM): their configs and their weights' names, both ways (reading
a model directory's files: dspipe.model.hf_weights).

    config.json -> ModelSpec      spec_from_hf_dir (reads JSON only: no torch, no transformers)
    ModelSpec -> config           hf_config (the config class of architecture_of(spec), the one that computes it)
    weights, dspipe <-> HF names  to_hf_state / from_hf_state, exact inverses (a rename, GPT-2's Conv1D transpose,
                                  the Llama family's q/k/v and gate/up split out of dspipe's fused projections)

What each Llama-family class computes (all: RMSNorm, SwiGLU with silu, rotary positions with rope_parameters of
type default, linear, llama3 or yarn, grouped-query attention, an explicit head_dim):

    LlamaForCausalLM     attention_bias: q, k, v and o biases (all or none); mlp_bias: gate, up, down biases
    Qwen2ForCausalLM     q, k, v biases (always), no o or MLP bias; sliding window from max_window_layers on
    Qwen3ForCausalLM     q/k RMSNorm per head; attention_bias as Llama's, no MLP bias; sliding window as Qwen2's
    MistralForCausalLM   no biases; sliding_window on every layer (null: none)

Weight mapping (dspipe name <- Hugging Face name; i is the block):

    GPT-2   embed.wte/wpe <- transformer.wte/wpe; h.i.* <- transformer.h.i.* (attn.c_attn, attn.c_proj, mlp.c_fc,
            mlp.c_proj weights transposed: HF's Conv1D stores (in, out)); final.ln_f <- transformer.ln_f;
            lm_head.weight <- lm_head.weight (untied only)
    Llama   embed.wte <- model.embed_tokens; h.i.ln_1 <- input_layernorm; h.i.attn.c_attn = [q_proj; k_proj; v_proj]
    family  (rows heads x hd, kv x hd, kv x hd; its bias likewise from the three biases); h.i.attn.q_norm/k_norm <-
            self_attn.q_norm/k_norm; h.i.attn.c_proj <- o_proj; h.i.ln_2 <- post_attention_layernorm;
            h.i.mlp.c_fc = [gate_proj; up_proj] (weight and bias); h.i.mlp.c_proj <- down_proj; final.ln_f <-
            model.norm; lm_head.weight <- lm_head.weight (untied only)

Every refusal is one SpecError line naming the directory (or file) and the field."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Mapping

from dspipe.errors import SpecError
from dspipe.spec.core import ModelSpec

GPT2, LLAMA, QWEN2, QWEN3, MISTRAL = ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                      "MistralForCausalLM")
SUPPORTED = (GPT2, LLAMA, QWEN2, QWEN3, MISTRAL)
MODEL_TYPES = {"gpt2": GPT2, "llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "mistral": MISTRAL}
CONFIG_FILE = "config.json"
GELU_TANH = "gelu_new"  # HF's name for 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))) = F.gelu(approximate="tanh")
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
BASE_PREFIX = {GPT2: "transformer.", LLAMA: "model.", QWEN2: "model.", QWEN3: "model.", MISTRAL: "model."}
"""The base model's prefix in the CausalLM's names; checkpoints saved from the base model (the original GPT-2 on the
hub) lack it, and transformers adds it when loading: so does CheckpointTensors."""
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""The rope_type values dspipe computes (rope_scaling none, linear, llama3, yarn)."""
ROPE_KEYS = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
                      "mscale", "mscale_all_dim", "truncate")}
"""The keys each rope_type may hold besides rope_type (or type), rope_theta and partial_rotary_factor."""
_MISSING = object()


# ---- config.json -> ModelSpec (JSON only) -------------------------------------------------------------------------

def read_hf_config(path: str | Path) -> dict:
    """HF_DIR/config.json as a JSON object; a missing directory or file or a garbled file is one line."""
    from dspipe.jsonio import read_object

    path = Path(path)
    if not path.exists():
        raise SpecError(f"{path}: no such Hugging Face model directory")
    if not path.is_dir():
        raise SpecError(f"{path}: not a directory (give a Hugging Face model directory holding {CONFIG_FILE})")
    if not (path / CONFIG_FILE).is_file():
        raise SpecError(f"{path}: no {CONFIG_FILE} (not a Hugging Face model directory)")
    return read_object(path / CONFIG_FILE)


def hf_architecture(cfg: dict, *, source) -> str:
    """One of SUPPORTED, from `architectures` (else `model_type`); anything else is refused."""
    archs, model_type = cfg.get("architectures"), cfg.get("model_type")
    supported = f"(supported: {', '.join(SUPPORTED)})"
    if archs is not None:
        if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
            raise SpecError(f"{source}: architectures {_show(archs)} must name one architecture {supported}")
        arch = archs[0]
    elif isinstance(model_type, str) and model_type in MODEL_TYPES:
        arch = MODEL_TYPES[model_type]
    else:
        raise SpecError(f"{source}: model_type {_show(model_type)} is not supported {supported}")
    if arch not in SUPPORTED:
        raise SpecError(f"{source}: architecture {arch} is not supported {supported}")
    if model_type is not None and MODEL_TYPES.get(model_type) != arch:
        raise SpecError(f"{source}: model_type {_show(model_type)} does not match architecture {arch}")
    return arch


def spec_from_hf_dir(path: str | Path, *, name: str | None = None, dropout: float | None = None) -> ModelSpec:
    """The ModelSpec of a Hugging Face GPT-2 or Llama-family directory (its config.json only). `dropout` given: used
    instead of the config's (which then need not be one value dspipe can represent)."""
    path = Path(path)
    cfg = read_hf_config(path)
    source = path / CONFIG_FILE
    arch = hf_architecture(cfg, source=source)
    name = name or os.path.basename(os.path.abspath(path)) or "hf"
    try:
        if arch == GPT2:
            return _gpt2_spec(cfg, source=source, name=name, dropout=dropout)
        return _decoder_spec(cfg, arch, source=source, name=name, dropout=dropout)
    except SpecError as e:
        text = str(e)
        raise SpecError(text if text.startswith(str(source)) else f"{source}: {text}") from None


def _gpt2_spec(cfg: dict, *, source, name: str, dropout) -> ModelSpec:
    get = _Reader(cfg, source)
    hidden = get.int("n_embd")
    get.must("activation_function", GELU_TANH, default=GELU_TANH)
    get.must("scale_attn_weights", True, default=True)
    get.must("scale_attn_by_inverse_layer_idx", False, default=False)
    get.must("add_cross_attention", False, default=False)
    inner = get.int("n_inner", default=None)
    if dropout is None:
        drops = {k: get.number("resid_pdrop" if k == "resid" else f"{k}_pdrop", default=0.1)
                 for k in ("resid", "embd", "attn")}
        if len(set(drops.values())) > 1:
            raise SpecError(f"{source}: resid_pdrop {drops['resid']:g}, embd_pdrop {drops['embd']:g} and attn_pdrop "
                            f"{drops['attn']:g} differ: dspipe has one dropout (pass --dropout)")
        dropout = drops["resid"]
    return ModelSpec(name, get.int("n_layer"), hidden, get.int("n_head"), get.int("vocab_size"),
                     get.int("n_positions"), inner or 4 * hidden, dropout=dropout,
                     tied_embeddings=get.flag("tie_word_embeddings", default=True),
                     norm_eps=get.number("layer_norm_epsilon", default=1e-5))


def _decoder_spec(cfg: dict, arch: str, *, source, name: str, dropout) -> ModelSpec:
    """A Llama-family config (Llama, Qwen2, Qwen3, Mistral) as the ModelSpec that computes what its class does: the
    biases, q/k norm and windows the class builds from the config (as transformers 5 reads it)."""
    get = _Reader(cfg, source)
    hidden, heads, layers = get.int("hidden_size"), get.int("num_attention_heads"), get.int("num_hidden_layers")
    seq_len = get.int("max_position_embeddings")
    get.must("hidden_act", "silu", default="silu")
    head_dim = get.int("head_dim", default=128 if arch == QWEN3 else None)  # Qwen3Config's default head_dim is 128
    if head_dim is not None and hidden % heads == 0 and head_dim == hidden // heads:
        head_dim = None  # the default width, named the way the presets name it
    qkv = out = mlp = False
    if arch == LLAMA:
        qkv = out = get.flag("attention_bias", default=False)
        mlp = get.flag("mlp_bias", default=False)
    elif arch == QWEN2:
        qkv = True  # Qwen2Attention: q/k/v biases always, o_proj none, MLP none
    elif arch == QWEN3:
        qkv = out = get.flag("attention_bias", default=False)
    window, start = _windows(cfg, arch, layers=layers, source=source)
    if dropout is None:
        dropout = get.number("attention_dropout", default=0.0)
        if dropout:
            raise SpecError(f"{source}: attention_dropout {dropout:g} is not supported (dspipe's dropout also drops "
                            f"embeddings and residuals: pass --dropout to choose one)")
    return ModelSpec(name, layers, hidden, heads, get.int("vocab_size"), seq_len, get.int("intermediate_size"),
                     dropout=dropout, tied_embeddings=get.flag("tie_word_embeddings", default=False), norm="rmsnorm",
                     mlp="swiglu", positions="rope", kv_heads=get.int("num_key_value_heads", default=heads),
                     bias=False, norm_eps=get.number("rms_norm_eps", default=1e-6), head_width=head_dim,
                     qkv_bias=qkv or None, out_bias=out or None, mlp_bias=mlp or None, qk_norm=arch == QWEN3,
                     sliding_window=window, window_start_layer=start, **_rope(cfg, source=source, positions=seq_len))


FULL, SLIDING = "full_attention", "sliding_attention"


def _windows(cfg: dict, arch: str, *, layers: int, source) -> tuple[int | None, int]:
    """(sliding_window, window_start_layer) of the class's attention. Mistral: sliding_window on every layer (null:
    none). Qwen2/Qwen3: sliding_window only with use_sliding_window true, on layers max_window_layers and up (the
    layer_types transformers builds; a config's own layer_types must be that pattern). Llama: none."""
    get = _Reader(cfg, source)
    if arch == LLAMA:
        return None, 0
    # sliding_window: absent means the config class's default, 4096; null means none
    window = get.int("sliding_window", default=None) if "sliding_window" in cfg else 4096
    if arch == MISTRAL:
        start = 0
        types = [SLIDING if window is not None else FULL] * layers
        rule = "sliding_window applies to every layer of MistralForCausalLM"
    else:
        use = get.flag("use_sliding_window", default=False)
        window = window if use else None
        start = get.count("max_window_layers", default=28)  # Qwen2Config's and Qwen3Config's default
        types = [SLIDING if window is not None and i >= start else FULL for i in range(layers)]
        rule = ("use_sliding_window, sliding_window and max_window_layers give "
                + (f"the window to layers {start} and up" if SLIDING in types else "full attention on every layer"))
    given = cfg.get("layer_types")
    if given is not None and given != types:
        shown = _runs(given) if isinstance(given, list) and all(isinstance(t, str) for t in given) else _show(given)
        raise SpecError(f"{source}: layer_types {shown} is not supported (dspipe builds {_runs(types)}: {rule})")
    if SLIDING not in types:
        return None, 0
    return window, types.index(SLIDING)


def _runs(types: list[str]) -> str:
    """A layer_types list as its runs: [full_attention x1, sliding_attention x2]."""
    runs: list[list] = []
    for t in types:
        if runs and runs[-1][0] == t:
            runs[-1][1] += 1
        else:
            runs.append([t, 1])
    return "[" + ", ".join(f"{t[:40]} x{n}" for t, n in runs) + "]"


def _rope(cfg: dict, *, source, positions: int) -> dict:
    """The rotary fields of ModelSpec from a config, read as transformers 5 does: rope_scaling (transformers 4) or
    rope_parameters (transformers 5; rope_scaling wins when both are given), rope_theta inside it or at the top
    level; rope_type default, linear, llama3 or yarn; original_max_position_embeddings at the top level, else in
    the parameters, else max_position_embeddings. Anything that would change what dspipe computes is refused."""
    key, params = None, {}
    for k in ("rope_parameters", "rope_scaling"):
        value = cfg.get(k)
        if value is not None and not isinstance(value, dict):
            raise SpecError(f"{source}: {k} must be an object or null, got {_show(value)}")
    if cfg.get("rope_scaling"):
        key, params = "rope_scaling", cfg["rope_scaling"]
    elif cfg.get("rope_parameters"):
        key, params = "rope_parameters", cfg["rope_parameters"]
    key = key or "rope_parameters"
    nested = [k for k in params if isinstance(params[k], dict)]
    if nested:
        raise SpecError(f"{source}: {key} per layer type ({nested[0]}) is not supported (dspipe has one rotary "
                        f"embedding for every layer)")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise SpecError(f"{source}: {key}: rope_type {kind if isinstance(kind, str) else _show(kind)} is not "
                        f"supported (supported: {', '.join(ROPE_TYPES)})")
    extra = sorted(set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"} - set(ROPE_KEYS[kind]))
    if extra:
        raise SpecError(f"{source}: {key}: {extra[0]} {_show(params[extra[0]])} is not supported with rope_type "
                        f"{kind} (it takes: {', '.join(ROPE_KEYS[kind]) or 'rope_theta only'})")
    for where, holder in (("", cfg), (f"{key}: ", params)):
        prf = holder.get("partial_rotary_factor")
        if prf is not None and (isinstance(prf, bool) or not isinstance(prf, (int, float)) or prf != 1):
            raise SpecError(f"{source}: {where}partial_rotary_factor {_show(prf)} is not supported (dspipe rotates "
                            f"the whole head: 1.0 only)")
    get = _Reader(params, f"{source}: {key}")
    theta = params["rope_theta"] if params.get("rope_theta") is not None else cfg.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise SpecError(f"{source}: rope_theta must be a positive number, got {_show(theta)}")
    out = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    out.update(rope_scaling=kind, rope_factor=get.number("factor"))
    if kind == "linear":
        return out
    if cfg.get("original_max_position_embeddings") is not None:  # transformers prefers the top-level value (Phi-3)
        original = _Reader(cfg, source).int("original_max_position_embeddings")
    else:
        original = get.int("original_max_position_embeddings", default=positions)
    out["rope_original_context"] = original
    if kind == "llama3":
        out.update(rope_low_freq_factor=get.number("low_freq_factor"),
                   rope_high_freq_factor=get.number("high_freq_factor"))
        return out
    # yarn: transformers takes beta_fast or 32, beta_slow or 1 (0 and null mean the default)
    out.update(rope_beta_fast=get.number("beta_fast", default=0.0) or 32.0,
               rope_beta_slow=get.number("beta_slow", default=0.0) or 1.0)
    factor = out["rope_factor"]

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    wanted = mscale()
    if params.get("attention_factor") is not None:
        given = get.number("attention_factor")
        if not math.isclose(given, wanted, rel_tol=1e-9):
            raise SpecError(f"{source}: {key}: attention_factor {given:g} is not supported (dspipe's yarn scales "
                            f"attention by 0.1 ln(factor) + 1 = {wanted:.6g})")
    else:
        m, m_all = get.number("mscale", default=0.0), get.number("mscale_all_dim", default=0.0)
        if m and m_all and not math.isclose(mscale(m) / mscale(m_all), wanted, rel_tol=1e-9):
            raise SpecError(f"{source}: {key}: mscale {m:g} with mscale_all_dim {m_all:g} is not supported (they "
                            f"make the attention factor {mscale(m) / mscale(m_all):.6g}; dspipe's yarn scales "
                            f"attention by 0.1 ln(factor) + 1 = {wanted:.6g})")
    if "truncate" in params and params["truncate"] is not True:
        raise SpecError(f"{source}: {key}: truncate {_show(params['truncate'])} is not supported (dspipe's yarn "
                        f"rounds the correction range outward: truncate true only)")
    return out


class _Reader:
    """Typed reads of config.json keys; a missing required key or a wrong type is one line naming the key."""

    def __init__(self, cfg: dict, source):
        self.cfg, self.source = cfg, source

    def _get(self, key: str, default):
        """(value, given): the key's value, or `default` when the key is absent or null (required: an error)."""
        if key in self.cfg and self.cfg[key] is not None:
            return self.cfg[key], True
        if default is _MISSING:
            raise SpecError(f"{self.source}: missing {key}")
        return default, False

    def int(self, key: str, default=_MISSING):
        value, given = self._get(key, default)
        if given and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SpecError(f"{self.source}: {key} must be a positive integer, got {_show(value)}")
        return value

    def count(self, key: str, default=_MISSING):
        value, given = self._get(key, default)
        if given and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise SpecError(f"{self.source}: {key} must be a whole number >= 0, got {_show(value)}")
        return value

    def number(self, key: str, default=_MISSING) -> float:
        value, given = self._get(key, default)
        if given and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
            raise SpecError(f"{self.source}: {key} must be a number, got {_show(value)}")
        return float(value)

    def flag(self, key: str, default=_MISSING) -> bool:
        value, given = self._get(key, default)
        if given and not isinstance(value, bool):
            raise SpecError(f"{self.source}: {key} must be true or false, got {_show(value)}")
        return value

    def must(self, key: str, wanted, default) -> None:
        value = self.cfg.get(key, default)
        if type(value) is not type(wanted) or value != wanted:
            raise SpecError(f"{self.source}: {key} {_show(value)} is not supported (dspipe implements "
                            f"{key} {_show(wanted)} only)")


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def function_of(spec: ModelSpec) -> dict:
    """What `spec` computes, field by field, without its name, dropout and context: two specs with equal
    function_of are the same model however their fields spell it (bias with qkv_bias None or qkv_bias given,
    head_dim default or explicit, the parameters of a rope scaling not chosen, a window's start without a window)."""
    skip = {"name", "dropout", "seq_len", "bias", "qkv_bias", "out_bias", "mlp_bias", "head_width", "sliding_window",
            "window_start_layer"} | {k for k in ModelSpec.__dataclass_fields__ if k.startswith("rope_")}
    out = {k: getattr(spec, k) for k in ModelSpec.__dataclass_fields__ if k not in skip}
    qkv, o, mlp = spec.biases
    out.update(kv_heads=spec.kv_groups, head_dim=spec.head_dim, qkv_bias=qkv, out_bias=o, mlp_bias=mlp)
    if spec.norm == "layernorm":
        out["bias"] = spec.bias  # LayerNorm's bias
    if spec.positions == "rope":
        out.update(rope_theta=spec.rope_theta, rope_scaling=spec.rope_scaling)
        wanted = {"linear": ("rope_factor",),
                  "llama3": ("rope_factor", "rope_original_context", "rope_low_freq_factor", "rope_high_freq_factor"),
                  "yarn": ("rope_factor", "rope_original_context", "rope_beta_fast", "rope_beta_slow")}
        out.update({k: getattr(spec, k) for k in wanted.get(spec.rope_scaling, ())})
    if spec.sliding_window is not None:
        out.update(sliding_window=spec.sliding_window, window_start_layer=spec.window_start_layer)
    return out


# ---- ModelSpec -> Hugging Face config ------------------------------------------------------------------------------

def architecture_of(spec: ModelSpec) -> str:
    """The Hugging Face architecture that computes `spec`'s function exactly; one line when there is none.
    Qwen3 for q/k norm; Qwen2 for q/k/v biases without o and MLP biases; Mistral for a window on every layer (and a
    head width Llama's config refuses); Llama otherwise (q/k/v/o biases all or none, MLP biases either way)."""
    if spec.norm == "layernorm" and spec.mlp == "gelu" and spec.positions == "learned":
        if spec.bias and spec.biases == (True, True, True) and spec.kv_groups == spec.heads \
                and spec.head_dim * spec.heads == spec.hidden and not spec.qk_norm and spec.sliding_window is None:
            return GPT2
        raise _no_architecture(spec, f"{GPT2} has biases everywhere, no grouped-query attention, head_dim hidden / "
                                     f"heads, no q/k norm and no sliding window")
    if (spec.norm, spec.mlp, spec.positions) != ("rmsnorm", "swiglu", "rope"):
        raise _no_architecture(spec, f"{GPT2} is layernorm, gelu, learned positions; {', '.join(SUPPORTED[1:])} "
                                     f"are rmsnorm, swiglu, rope")
    qkv, out, mlp = spec.biases
    windowed = spec.sliding_window is not None
    if spec.qk_norm:
        if qkv == out and not mlp:
            return QWEN3
        raise _no_architecture(spec, f"q/k norm is {QWEN3}'s, whose q/k/v/o biases are all or none and whose MLP "
                                     f"has none")
    if qkv and not out and not mlp:
        return QWEN2
    if windowed:
        if spec.window_start_layer == 0 and not (qkv or out or mlp):
            return MISTRAL
        raise _no_architecture(spec, f"a sliding window is {MISTRAL}'s (every layer, no biases), {QWEN2}'s (q/k/v "
                                     f"biases only) or {QWEN3}'s (q/k norm)")
    if qkv != out:
        raise _no_architecture(spec, f"{LLAMA}'s attention_bias gives q, k, v and o biases together; q/k/v biases "
                                     f"alone are {QWEN2}'s (no o or MLP bias)")
    if spec.hidden % spec.heads:  # LlamaConfig refuses it; Mistral's config (window null) computes the same
        if not (qkv or mlp):
            return MISTRAL
        raise _no_architecture(spec, f"{LLAMA}'s config needs hidden divisible by heads, and {MISTRAL} has no "
                                     f"biases")
    return LLAMA


def _no_architecture(spec: ModelSpec, why: str) -> SpecError:
    qkv, out, mlp = spec.biases
    window = spec.sliding_window
    extras = [f"head_dim {spec.head_dim}"] + (["q/k norm"] if spec.qk_norm else []) \
        + ([f"sliding window {window} from block {spec.window_start_layer}"] if window is not None else [])
    return SpecError(f"model {spec.name} ({spec.norm}, {spec.mlp} MLP, {spec.positions} positions, biases q/k/v "
                     f"{_yes(qkv)}, o {_yes(out)}, MLP {_yes(mlp)}, kv_heads {spec.kv_groups} of {spec.heads} heads, "
                     f"{', '.join(extras)}) matches no Hugging Face architecture dspipe writes: {why}")


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


def hf_config(spec: ModelSpec, *, eos_id: int | None, bos_id: int | None = None):
    """The transformers config of architecture_of(spec) for `spec` (bos defaults to eos)."""
    import transformers

    arch = architecture_of(spec)
    bos_id = eos_id if bos_id is None else bos_id
    if arch == GPT2:
        return transformers.GPT2Config(
            vocab_size=spec.vocab, n_positions=spec.seq_len, n_embd=spec.hidden, n_layer=spec.layers,
            n_head=spec.heads, n_inner=spec.ffn, activation_function=GELU_TANH, resid_pdrop=spec.dropout,
            embd_pdrop=spec.dropout, attn_pdrop=spec.dropout, layer_norm_epsilon=spec.norm_eps,
            tie_word_embeddings=spec.tied_embeddings, bos_token_id=bos_id, eos_token_id=eos_id, architectures=[GPT2])
    qkv, _, mlp = spec.biases
    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
                  num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_groups,
                  head_dim=spec.head_dim, hidden_act="silu", max_position_embeddings=spec.seq_len,
                  rms_norm_eps=spec.norm_eps, tie_word_embeddings=spec.tied_embeddings,
                  rope_parameters=rope_parameters(spec), attention_dropout=0.0, bos_token_id=bos_id,
                  eos_token_id=eos_id, architectures=[arch])
    window = spec.sliding_window
    if arch == LLAMA:
        return transformers.LlamaConfig(**common, attention_bias=qkv, mlp_bias=mlp)
    if arch == MISTRAL:
        return transformers.MistralConfig(**common, sliding_window=window)
    qwen = dict(use_sliding_window=window is not None, sliding_window=window,
                max_window_layers=spec.window_start_layer if window is not None else spec.layers)
    if arch == QWEN2:
        return transformers.Qwen2Config(**common, **qwen)
    return transformers.Qwen3Config(**common, **qwen, attention_bias=qkv)


def hf_model(state: dict, spec: ModelSpec, *, eos_id: int | None, bos_id: int | None = None, source):
    """The architecture_of(spec) CausalLM holding `state` (dspipe names), fp32, every weight checked."""
    import torch
    import transformers

    config = hf_config(spec, eos_id=eos_id, bos_id=bos_id)
    cls = getattr(transformers, architecture_of(spec))
    model = cls(config).to(torch.float32)
    try:
        converted = to_hf_state(state, spec)
    except SpecError as e:
        raise SpecError(f"checkpoint {source}: {e}") from None
    missing, unexpected = model.load_state_dict(converted, strict=False)
    missing = [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]  # GPT-2's mask buffers
    if missing or unexpected:
        raise SpecError(f"checkpoint {source} does not map onto {cls.__name__}: missing {missing[:5]}, unexpected "
                        f"{unexpected[:5]}")
    return model.eval()


# ---- weights: dspipe names <-> Hugging Face names ------------------------------------------------------------------

def _parts(name: str, shape: tuple, spec: ModelSpec, arch: str) -> tuple[list[tuple[str, tuple]], str]:
    """The Hugging Face tensors (name, shape) that dspipe's `name` is made of, and how: 'same', 't' (transpose) or
    'rows' (the HF tensors stacked along dim 0)."""
    if arch == GPT2:
        if name.startswith("embed."):
            return [("transformer." + name[len("embed."):], shape)], "same"
        if name.startswith("h."):
            if name.split(".", 2)[2] in CONV1D:
                return [("transformer." + name, tuple(reversed(shape)))], "t"
            return [("transformer." + name, shape)], "same"
        if name.startswith("final."):
            return [("transformer." + name[len("final."):], shape)], "same"
        return [(name, shape)], "same"  # lm_head.weight
    if name == "embed.wte.weight":
        return [("model.embed_tokens.weight", shape)], "same"
    if name == "final.ln_f.weight":
        return [("model.norm.weight", shape)], "same"
    if name == "lm_head.weight":
        return [(name, shape)], "same"
    _, i, rest = name.split(".", 2)
    layer, h = f"model.layers.{i}.", spec.hidden
    module, _, kind = rest.rpartition(".")  # kind: weight or bias
    cols = (h,) if kind == "weight" else ()
    if module == "attn.c_attn":
        q, kv = spec.q_width, spec.kv_groups * spec.head_dim
        return [(f"{layer}self_attn.{p}_proj.{kind}", (rows, *cols)) for p, rows in (("q", q), ("k", kv), ("v", kv))
                ], "rows"
    if module == "mlp.c_fc":
        return [(f"{layer}mlp.{p}_proj.{kind}", (spec.ffn, *cols)) for p in ("gate", "up")], "rows"
    simple = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.c_proj": "self_attn.o_proj",
              "mlp.c_proj": "mlp.down_proj", "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}
    if module not in simple:
        raise SpecError(f"parameter {name} has no {arch} counterpart")
    return [(f"{layer}{simple[module]}.{kind}", shape)], "same"


def weight_map(spec: ModelSpec) -> dict[str, tuple[list[tuple[str, tuple]], str]]:
    """dspipe name -> (its Hugging Face tensors with their shapes, how they combine), for every parameter of
    spec.model_tensors() (a tied head is the embedding: no HF tensor of its own)."""
    arch = architecture_of(spec)
    return {name: _parts(name, shape, spec, arch) for name, shape in spec.model_tensors()}


def hf_tensors(spec: ModelSpec) -> list[tuple[str, tuple]]:
    """Every tensor (name, shape) a Hugging Face checkpoint of `spec` stores (a tied lm_head is not stored)."""
    return [part for parts, _ in weight_map(spec).values() for part in parts]


def to_hf_state(state: Mapping, spec: ModelSpec) -> dict:
    """dspipe names (exactly spec.model_tensors(); a tied lm_head.weight may be present) -> Hugging Face names, as
    the model's state_dict() has them (a tied lm_head.weight is the embedding tensor)."""
    mapping = weight_map(spec)
    extra = sorted(set(state) - set(mapping) - ({"lm_head.weight"} if spec.tied_embeddings else set()))
    if extra:
        raise SpecError(f"unexpected parameter {extra[0]} for model {spec.name}"
                        + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    out = {}
    for name, (parts, how) in mapping.items():
        if name not in state:
            raise SpecError(f"missing parameter {name} for model {spec.name}")
        t = state[name]
        if how == "t":
            out[parts[0][0]] = t.t().contiguous()
        elif how == "rows":
            for (key, _), piece in zip(parts, t.split([shape[0] for _, shape in parts], dim=0)):
                out[key] = piece.contiguous()
        else:
            out[parts[0][0]] = t.contiguous()
    if spec.tied_embeddings:
        out["lm_head.weight"] = out[mapping["embed.wte.weight"][0][0][0]]
    return out


def from_hf_state(hf_state: Mapping, spec: ModelSpec, *, names=None, source="state dict") -> dict:
    """Hugging Face names -> dspipe names (all of spec.model_tensors(), or only `names`), the inverse of
    to_hf_state. Every needed tensor must be there with its shape (one line otherwise); other keys (buffers, a tied
    lm_head) are ignored. A learned position table with more rows than spec.seq_len gives its first rows (a run
    may train a shorter context)."""
    import torch

    out = {}
    for name, (parts, how) in weight_map(spec).items():
        if names is not None and name not in names:
            continue
        pieces = []
        for key, shape in parts:
            if key not in hf_state:
                raise SpecError(f"{source}: missing tensor {key} (model {spec.name} needs it for {name})")
            t = hf_state[key]
            if name == "embed.wpe.weight" and t.dim() == 2 and t.shape[0] > shape[0] and t.shape[1] == shape[1]:
                t = t[:shape[0]]
            if tuple(t.shape) != tuple(shape):
                raise SpecError(f"{source}: tensor {key} has shape {list(t.shape)}, model {spec.name} needs "
                                f"{list(shape)}")
            pieces.append(t)
        t = pieces[0].t() if how == "t" else torch.cat(pieces, dim=0) if how == "rows" else pieces[0]
        out[name] = t.detach().to(torch.float32).contiguous()
    return out
