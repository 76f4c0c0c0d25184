"""The Hugging Face architectures dspipe reads and writes, GPT2LMHeadModel and the Llama family (LlamaForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, and the mixtures of experts MixtralForCausalLM and
Qwen3MoeForCausalLM): their configs and their weights' names, both ways (reading a model directory's files:
dspipe.model.hf_weights).

    config.json -> ModelSpec      spec_from_hf_dir (reads JSON only: no torch, no transformers)
    ModelSpec -> config           dspipe.model.hf_arch.hf_config (the config class of architecture_of(spec), the
                                  one that computes it)
    weights, dspipe <-> HF names  dspipe.model.hf_state.to_hf_state / from_hf_state, exact inverses (a rename,
                                  GPT-2's Conv1D transpose, the Llama family's q/k/v and gate/up split out of
                                  dspipe's fused projections), and hf_model, the CausalLM holding dspipe's weights

What each Llama-family class computes (all: RMSNorm, SwiGLU with silu, rotary positions with rope_parameters of
type default, linear, llama3 or yarn, grouped-query attention, an explicit head_dim):

    LlamaForCausalLM     attention_bias: q, k, v and o biases (all or none); mlp_bias: gate, up, down biases
    Qwen2ForCausalLM     q, k, v biases (always), no o or MLP bias; sliding window from max_window_layers on
    Qwen3ForCausalLM     q/k RMSNorm per head; attention_bias as Llama's, no MLP bias; sliding window as Qwen2's
    MistralForCausalLM   no biases; sliding_window on every layer (null: none)
    MixtralForCausalLM   Mistral's attention; every block sparse: num_local_experts experts intermediate_size wide,
                         top num_experts_per_tok renormalised; router_jitter_noise 0 only
    Qwen3MoeForCausalLM  Qwen3's attention (q/k norm, attention_bias), sliding_window on every layer with
                         use_sliding_window; num_experts experts moe_intermediate_size wide, top num_experts_per_tok
                         (renormalised with norm_topk_prob), block i sparse when (i + 1) % decoder_sparse_step == 0
                         and i not in mlp_only_layers (the first k layers only: moe_first_dense), the other blocks'
                         MLP intermediate_size wide

Every refusal is one SpecError line naming the directory (or file) and the field."""

from __future__ import annotations

import math
import os
from pathlib import Path

from dspipe.errors import SpecError
from dspipe.spec.checks import limit
from dspipe.spec.model import MOE_ONLY, ModelSpec

GPT2, LLAMA, QWEN2, QWEN3, MISTRAL = (
    "GPT2LMHeadModel",
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)
MIXTRAL, QWEN3_MOE = "MixtralForCausalLM", "Qwen3MoeForCausalLM"
SUPPORTED = (GPT2, LLAMA, QWEN2, QWEN3, MISTRAL, MIXTRAL, QWEN3_MOE)
MOE_ARCHITECTURES = (MIXTRAL, QWEN3_MOE)
MODEL_TYPES = {
    "gpt2": GPT2,
    "llama": LLAMA,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "mistral": MISTRAL,
    "mixtral": MIXTRAL,
    "qwen3_moe": QWEN3_MOE,
}
CONFIG_FILE = "config.json"
GELU_TANH = "gelu_new"  # HF's name for 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))) = F.gelu(approximate="tanh")
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
BASE_PREFIX = {
    GPT2: "transformer.",
    LLAMA: "model.",
    QWEN2: "model.",
    QWEN3: "model.",
    MISTRAL: "model.",
    MIXTRAL: "model.",
    QWEN3_MOE: "model.",
}
"""The base model's prefix in the CausalLM's names; checkpoints saved from the base model (the original GPT-2 on the
hub) lack it, and transformers adds it when loading: so does CheckpointTensors."""
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""The rope_type values dspipe computes (rope_scaling none, linear, llama3, yarn)."""
ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
}
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
    if model_type is not None and (not isinstance(model_type, str) or MODEL_TYPES.get(model_type) != arch):
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
        drops = {
            k: get.number("resid_pdrop" if k == "resid" else f"{k}_pdrop", default=0.1)
            for k in ("resid", "embd", "attn")
        }
        if len(set(drops.values())) > 1:
            raise SpecError(
                f"{source}: resid_pdrop {drops['resid']:g}, embd_pdrop {drops['embd']:g} and attn_pdrop "
                f"{drops['attn']:g} differ: dspipe has one dropout (pass --dropout)"
            )
        dropout = drops["resid"]
    return ModelSpec(
        name,
        get.int("n_layer", field="layers"),
        hidden,
        get.int("n_head"),
        get.int("vocab_size"),
        get.int("n_positions"),
        inner or 4 * hidden,
        dropout=dropout,
        tied_embeddings=get.flag("tie_word_embeddings", default=True),
        norm_eps=get.number("layer_norm_epsilon", default=1e-5),
    )


def _decoder_spec(cfg: dict, arch: str, *, source, name: str, dropout) -> ModelSpec:
    """A Llama-family config (Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE) as the ModelSpec that computes what
    its class does: the biases, q/k norm, windows and experts the class builds from the config (as transformers 5
    reads it)."""
    get = _Reader(cfg, source)
    hidden, heads, layers = (
        get.int("hidden_size"),
        get.int("num_attention_heads"),
        get.int("num_hidden_layers", field="layers"),
    )
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
    elif arch in (QWEN3, QWEN3_MOE):
        qkv = out = get.flag("attention_bias", default=False)
    window, start = _windows(cfg, arch, layers=layers, source=source)
    moe = _moe(cfg, arch, layers=layers, source=source)
    if dropout is None:
        dropout = get.number("attention_dropout", default=0.0)
        if dropout:
            raise SpecError(
                f"{source}: attention_dropout {dropout:g} is not supported (dspipe's dropout also drops "
                f"embeddings and residuals: pass --dropout to choose one)"
            )
    return ModelSpec(
        name,
        layers,
        hidden,
        heads,
        get.int("vocab_size"),
        seq_len,
        get.int("intermediate_size"),
        dropout=dropout,
        tied_embeddings=get.flag("tie_word_embeddings", default=False),
        norm="rmsnorm",
        mlp="swiglu",
        positions="rope",
        kv_heads=get.int("num_key_value_heads", default=heads),
        bias=False,
        norm_eps=get.number("rms_norm_eps", default=1e-6),
        head_width=head_dim,
        qkv_bias=qkv or None,
        out_bias=out or None,
        mlp_bias=mlp or None,
        qk_norm=arch in (QWEN3, QWEN3_MOE),
        sliding_window=window,
        window_start_layer=start,
        **moe,
        **_rope(cfg, source=source, positions=seq_len),
    )


def _moe(cfg: dict, arch: str, *, layers: int, source) -> dict:
    """The mixture-of-experts fields of ModelSpec from a Mixtral or Qwen3-MoE config (empty for the others);
    output_router_logits only switches transformers' own aux loss on (dspipe's is always on): ignored."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    get = _Reader(cfg, source)
    k = get.int("num_experts_per_tok", default=2 if arch == MIXTRAL else 8)
    # both classes map num_experts onto num_local_experts (transformers 5 writes the latter, the hub's Qwen3-MoE the
    # former)
    given = [key for key in ("num_local_experts", "num_experts") if cfg.get(key) is not None]
    if len(given) == 2 and cfg["num_experts"] != cfg["num_local_experts"]:
        raise SpecError(
            f"{source}: num_experts {_show(cfg['num_experts'])} and num_local_experts "
            f"{_show(cfg['num_local_experts'])} differ (they are one setting)"
        )
    experts = get.count(given[0]) if given else 8 if arch == MIXTRAL else 128
    coef = get.number("router_aux_loss_coef", default=0.001)
    if arch == MIXTRAL:
        jitter = get.number("router_jitter_noise", default=0.0)
        if jitter:
            raise SpecError(
                f"{source}: router_jitter_noise {jitter:g} is not supported (dspipe's router scales no "
                f"input by random noise: 0 only)"
            )
        if not experts:
            raise SpecError(f"{source}: {given[0]} 0 is not supported ({MIXTRAL} needs experts: at least 1)")
        return dict(experts=experts, experts_per_token=k, aux_loss_coef=coef)
    step = get.int("decoder_sparse_step", default=1)
    only = cfg.get("mlp_only_layers")
    only = [] if only is None else only
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise SpecError(f"{source}: mlp_only_layers must be a list of layer numbers, got {_show(only)}")
    sparse = [i for i in range(layers) if i not in only and (i + 1) % step == 0]
    if not experts or not sparse:
        return {}  # every block dense: Qwen3's MLP, intermediate_size wide
    first = 0 if sparse == [i for i in range(layers) if (i + 1) % step == 0] else sparse[0]
    if sparse != [i for i in range(first, layers) if (i + 1) % step == 0]:
        raise SpecError(
            f"{source}: mlp_only_layers {_show(only)} is not supported (dspipe keeps dense only the first "
            f"k blocks besides decoder_sparse_step {step}'s: mlp_only_layers [0, ..., k - 1])"
        )
    return dict(
        experts=experts,
        experts_per_token=k,
        expert_ffn=get.int("moe_intermediate_size", default=768),
        router_norm_topk=get.flag("norm_topk_prob", default=False),
        moe_every=step,
        moe_first_dense=first,
        aux_loss_coef=coef,
    )


FULL, SLIDING = "full_attention", "sliding_attention"


def _windows(cfg: dict, arch: str, *, layers: int, source) -> tuple[int | None, int]:
    """(sliding_window, window_start_layer) of the class's attention. Mistral: sliding_window on every layer (null:
    none). Qwen2/Qwen3: sliding_window only with use_sliding_window true, on layers max_window_layers and up (the
    layer_types transformers builds; a config's own layer_types must be that pattern). Llama: none."""
    get = _Reader(cfg, source)
    if arch == LLAMA:
        return None, 0
    # sliding_window: absent means the config class's default (4096, Mixtral's none); null means none
    window = get.int("sliding_window", default=None) if "sliding_window" in cfg else None if arch == MIXTRAL else 4096
    if arch == QWEN3_MOE and not get.flag("use_sliding_window", default=False):
        window = None
    if arch in (MISTRAL, MIXTRAL, QWEN3_MOE):
        start = 0
        types = [SLIDING if window is not None else FULL] * layers
        rule = f"sliding_window applies to every layer of {arch}"
    else:
        use = get.flag("use_sliding_window", default=False)
        window = window if use else None
        start = get.count("max_window_layers", default=28)  # Qwen2Config's and Qwen3Config's default
        types = [SLIDING if window is not None and i >= start else FULL for i in range(layers)]
        rule = "use_sliding_window, sliding_window and max_window_layers give " + (
            f"the window to layers {start} and up" if SLIDING in types else "full attention on every layer"
        )
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


def _rope_params(cfg: dict, *, source) -> tuple[str, dict, str]:
    """(key, parameters, rope_type) of a config's rotary scaling, refusing what dspipe does not compute."""
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
        raise SpecError(
            f"{source}: {key} per layer type ({nested[0]}) is not supported (dspipe has one rotary "
            f"embedding for every layer)"
        )
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise SpecError(
            f"{source}: {key}: rope_type {kind if isinstance(kind, str) else _show(kind)} is not "
            f"supported (supported: {', '.join(ROPE_TYPES)})"
        )
    extra = sorted(set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"} - set(ROPE_KEYS[kind]))
    if extra:
        raise SpecError(
            f"{source}: {key}: {extra[0]} {_show(params[extra[0]])} is not supported with rope_type "
            f"{kind} (it takes: {', '.join(ROPE_KEYS[kind]) or 'rope_theta only'})"
        )
    for where, holder in (("", cfg), (f"{key}: ", params)):
        prf = holder.get("partial_rotary_factor")
        if prf is not None and (isinstance(prf, bool) or not isinstance(prf, (int, float)) or prf != 1):
            raise SpecError(
                f"{source}: {where}partial_rotary_factor {_show(prf)} is not supported (dspipe rotates "
                f"the whole head: 1.0 only)"
            )
    return key, params, kind


def _check_yarn_scale(params: dict, *, get: _Reader, source, key: str, factor: float) -> None:
    """Refuse a yarn attention factor (given, or from mscale and mscale_all_dim) or truncate dspipe does not use."""

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    wanted = mscale()
    if params.get("attention_factor") is not None:
        given = get.number("attention_factor")
        if not math.isclose(given, wanted, rel_tol=1e-9):
            raise SpecError(
                f"{source}: {key}: attention_factor {given:g} is not supported (dspipe's yarn scales "
                f"attention by 0.1 ln(factor) + 1 = {wanted:.6g})"
            )
    else:
        m, m_all = get.number("mscale", default=0.0), get.number("mscale_all_dim", default=0.0)
        if m and m_all and not math.isclose(mscale(m) / mscale(m_all), wanted, rel_tol=1e-9):
            raise SpecError(
                f"{source}: {key}: mscale {m:g} with mscale_all_dim {m_all:g} is not supported (they "
                f"make the attention factor {mscale(m) / mscale(m_all):.6g}; dspipe's yarn scales "
                f"attention by 0.1 ln(factor) + 1 = {wanted:.6g})"
            )
    if "truncate" in params and params["truncate"] is not True:
        raise SpecError(
            f"{source}: {key}: truncate {_show(params['truncate'])} is not supported (dspipe's yarn "
            f"rounds the correction range outward: truncate true only)"
        )


def _rope(cfg: dict, *, source, positions: int) -> dict:
    """The rotary fields of ModelSpec from a config, read as transformers 5 does: rope_scaling (transformers 4) or
    rope_parameters (transformers 5; rope_scaling wins when both are given), rope_theta inside it or at the top
    level; rope_type default, linear, llama3 or yarn; original_max_position_embeddings at the top level, else in
    the parameters, else max_position_embeddings. Anything that would change what dspipe computes is refused."""
    key, params, kind = _rope_params(cfg, source=source)
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
        out.update(
            rope_low_freq_factor=get.number("low_freq_factor"), rope_high_freq_factor=get.number("high_freq_factor")
        )
        return out
    # yarn: transformers takes beta_fast or 32, beta_slow or 1 (0 and null mean the default)
    out.update(
        rope_beta_fast=get.number("beta_fast", default=0.0) or 32.0,
        rope_beta_slow=get.number("beta_slow", default=0.0) or 1.0,
    )
    _check_yarn_scale(params, get=get, source=source, key=key, factor=out["rope_factor"])
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

    def int(self, key: str, default=_MISSING, *, field: str | None = None):
        """A positive integer; `field`: the ModelSpec field it becomes, whose limit it must keep (checked before
        anything is built per layer: a list of 10**12 layer types would exhaust the memory)."""
        value, given = self._get(key, default)
        if given and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SpecError(f"{self.source}: {key} must be a positive integer, got {_show(value)}")
        if given and field is not None and value > (most := limit(field)):
            raise SpecError(f"{self.source}: {key} {_show(value)} is over dspipe's limit of {most:,} ({field})")
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
            raise SpecError(
                f"{self.source}: {key} {_show(value)} is not supported (dspipe implements {key} {_show(wanted)} only)"
            )


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


TRAINING_ONLY = ("aux_loss_coef", "capacity_factor")
"""MoE settings that change how a model trains, not what it computes (inference is dropless and has no aux loss):
--init-from takes them from the flags like --dropout."""


def function_of(spec: ModelSpec) -> dict:
    """What `spec` computes, field by field, without its name, dropout, context and training-only MoE settings
    (TRAINING_ONLY): two specs with equal
    function_of are the same model however their fields spell it (bias with qkv_bias None or qkv_bias given,
    head_dim default or explicit, the parameters of a rope scaling not chosen, a window's start without a window)."""
    skip = {
        "name",
        "dropout",
        "seq_len",
        "bias",
        "qkv_bias",
        "out_bias",
        "mlp_bias",
        "head_width",
        "sliding_window",
        "window_start_layer",
        *TRAINING_ONLY,
    } | {k for k in ModelSpec.__dataclass_fields__ if k.startswith("rope_")}
    out = {k: getattr(spec, k) for k in ModelSpec.__dataclass_fields__ if k not in skip}
    qkv, o, mlp = spec.biases
    out.update(kv_heads=spec.kv_groups, head_dim=spec.head_dim, qkv_bias=qkv, out_bias=o, mlp_bias=mlp)
    if spec.norm == "layernorm":
        out["bias"] = spec.bias  # LayerNorm's bias
    if spec.positions == "rope":
        out.update(rope_theta=spec.rope_theta, rope_scaling=spec.rope_scaling)
        wanted = {
            "linear": ("rope_factor",),
            "llama3": ("rope_factor", "rope_original_context", "rope_low_freq_factor", "rope_high_freq_factor"),
            "yarn": ("rope_factor", "rope_original_context", "rope_beta_fast", "rope_beta_slow"),
        }
        out.update({k: getattr(spec, k) for k in wanted.get(spec.rope_scaling, ())})
    if spec.sliding_window is not None:
        out.update(sliding_window=spec.sliding_window, window_start_layer=spec.window_start_layer)
    moe = ("experts", *MOE_ONLY)  # MOE_ONLY's capacity_factor: skipped above
    if not spec.experts:
        return {k: v for k, v in out.items() if k not in moe}
    out.update(expert_ffn=spec.expert_width, sparse_layers=spec.sparse_layers)
    del out["moe_every"], out["moe_first_dense"]
    if len(spec.sparse_layers) == spec.layers:
        out["ffn"] = None  # no dense block: the dense MLP's width computes nothing
    return out
