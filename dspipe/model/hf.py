"""The two Hugging Face architectures dspipe reads and writes, GPT2LMHeadModel and LlamaForCausalLM: their
configs and their weights' names, both ways (reading a model directory's files: dspipe.model.hf_weights).

    config.json -> ModelSpec      spec_from_hf_dir (reads JSON only: no torch, no transformers)
    ModelSpec -> config           hf_config (GPT2Config or LlamaConfig)
    weights, dspipe <-> HF names  to_hf_state / from_hf_state, exact inverses (a rename, GPT-2's Conv1D transpose,
                                  Llama's q/k/v and gate/up split out of dspipe's fused projections)

Weight mapping (dspipe name <- Hugging Face name; i is the block):

    GPT-2   embed.wte/wpe <- transformer.wte/wpe; h.i.* <- transformer.h.i.* (attn.c_attn, attn.c_proj, mlp.c_fc,
            mlp.c_proj weights transposed: HF's Conv1D stores (in, out)); final.ln_f <- transformer.ln_f;
            lm_head.weight <- lm_head.weight (untied only)
    Llama   embed.wte <- model.embed_tokens; h.i.ln_1 <- input_layernorm; h.i.attn.c_attn = [q_proj; k_proj; v_proj]
            (rows heads x hd, kv x hd, kv x hd); h.i.attn.c_proj <- o_proj; h.i.ln_2 <- post_attention_layernorm;
            h.i.mlp.c_fc = [gate_proj; up_proj]; h.i.mlp.c_proj <- down_proj; final.ln_f <- model.norm;
            lm_head.weight <- lm_head.weight (untied only)

Every refusal is one SpecError line naming the directory (or file) and the field."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Mapping

from dspipe.errors import SpecError
from dspipe.spec.core import ModelSpec

GPT2, LLAMA = "GPT2LMHeadModel", "LlamaForCausalLM"
SUPPORTED = (GPT2, LLAMA)
MODEL_TYPES = {"gpt2": GPT2, "llama": LLAMA}
CONFIG_FILE = "config.json"
GELU_TANH = "gelu_new"  # HF's name for 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))) = F.gelu(approximate="tanh")
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
BASE_PREFIX = {GPT2: "transformer.", LLAMA: "model."}
"""The base model's prefix in the CausalLM's names; checkpoints saved from the base model (the original GPT-2 on the
hub) lack it, and transformers adds it when loading: so does CheckpointTensors."""
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
    """GPT2LMHeadModel or LlamaForCausalLM, from `architectures` (else `model_type`); anything else is refused."""
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
    """The ModelSpec of a Hugging Face GPT-2 or Llama directory (its config.json only). `dropout` given: used
    instead of the config's (which then need not be one value dspipe can represent)."""
    path = Path(path)
    cfg = read_hf_config(path)
    source = path / CONFIG_FILE
    arch = hf_architecture(cfg, source=source)
    name = name or os.path.basename(os.path.abspath(path)) or "hf"
    try:
        if arch == GPT2:
            return _gpt2_spec(cfg, source=source, name=name, dropout=dropout)
        return _llama_spec(cfg, source=source, name=name, dropout=dropout)
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


def _llama_spec(cfg: dict, *, source, name: str, dropout) -> ModelSpec:
    get = _Reader(cfg, source)
    hidden, heads = get.int("hidden_size"), get.int("num_attention_heads")
    get.must("hidden_act", "silu", default="silu")
    get.must("attention_bias", False, default=False)
    get.must("mlp_bias", False, default=False)
    head_dim = get.int("head_dim", default=None)
    if head_dim is not None and head_dim * heads != hidden:
        raise SpecError(f"{source}: head_dim {head_dim} is not supported: dspipe's head_dim is hidden_size / "
                        f"num_attention_heads = {hidden} / {heads}")
    if dropout is None:
        dropout = get.number("attention_dropout", default=0.0)
        if dropout:
            raise SpecError(f"{source}: attention_dropout {dropout:g} is not supported (dspipe's dropout also drops "
                            f"embeddings and residuals: pass --dropout to choose one)")
    return ModelSpec(name, get.int("num_hidden_layers"), hidden, heads, get.int("vocab_size"),
                     get.int("max_position_embeddings"), get.int("intermediate_size"), dropout=dropout,
                     tied_embeddings=get.flag("tie_word_embeddings", default=False), norm="rmsnorm", mlp="swiglu",
                     positions="rope", rope_theta=_rope_theta(cfg, source=source),
                     kv_heads=get.int("num_key_value_heads", default=heads), bias=False,
                     norm_eps=get.number("rms_norm_eps", default=1e-6))


def _rope_theta(cfg: dict, *, source) -> float:
    """Plain rotary positions only: transformers 4 writes rope_theta and rope_scaling (null), transformers 5
    rope_parameters {rope_type: default, rope_theta}. Any scaling (linear, dynamic, yarn, llama3, ...) is refused."""
    theta = cfg.get("rope_theta", 10000.0)
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise SpecError(f"{source}: {key} must be an object or null, got {_show(value)}")
        kind = value.get("rope_type", value.get("type", "default"))
        extra = sorted(set(value) - {"rope_type", "type", "rope_theta"})
        if kind != "default" or extra:
            what = f"rope_type {kind}" if kind != "default" else f"{extra[0]} {_show(value[extra[0]])}"
            raise SpecError(f"{source}: {key} with {what} is not supported (dspipe implements plain rotary "
                            f"positions: {key} must be null)")
        theta = value.get("rope_theta", theta)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise SpecError(f"{source}: rope_theta must be a number, got {_show(theta)}")
    return float(theta)


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


# ---- ModelSpec -> Hugging Face config ------------------------------------------------------------------------------

def architecture_of(spec: ModelSpec) -> str:
    """The Hugging Face architecture that computes `spec`'s function exactly; one line when there is none."""
    if (spec.norm, spec.mlp, spec.positions, spec.bias) == ("layernorm", "gelu", "learned", True) \
            and spec.kv_groups == spec.heads:
        return GPT2
    if (spec.norm, spec.mlp, spec.positions, spec.bias) == ("rmsnorm", "swiglu", "rope", False):
        return LLAMA
    raise SpecError(f"model {spec.name} ({spec.norm}, {spec.mlp} MLP, {spec.positions} positions, "
                    f"bias {str(spec.bias).lower()}, kv_heads {spec.kv_groups} of {spec.heads} heads) matches no "
                    f"Hugging Face architecture dspipe writes: {GPT2} (layernorm, gelu, learned positions, biases, "
                    f"no grouped-query attention) or {LLAMA} (rmsnorm, swiglu, rope, no biases)")


def hf_config(spec: ModelSpec, *, eos_id: int | None, bos_id: int | None = None):
    """GPT2Config or LlamaConfig for `spec` (bos defaults to eos)."""
    arch = architecture_of(spec)
    bos_id = eos_id if bos_id is None else bos_id
    if arch == GPT2:
        from transformers import GPT2Config

        return GPT2Config(vocab_size=spec.vocab, n_positions=spec.seq_len, n_embd=spec.hidden, n_layer=spec.layers,
                          n_head=spec.heads, n_inner=spec.ffn, activation_function=GELU_TANH,
                          resid_pdrop=spec.dropout, embd_pdrop=spec.dropout, attn_pdrop=spec.dropout,
                          layer_norm_epsilon=spec.norm_eps, tie_word_embeddings=spec.tied_embeddings,
                          bos_token_id=bos_id, eos_token_id=eos_id, architectures=[GPT2])
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
                       num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                       num_key_value_heads=spec.kv_groups, head_dim=spec.head_dim, hidden_act="silu",
                       max_position_embeddings=spec.seq_len, rms_norm_eps=spec.norm_eps,
                       tie_word_embeddings=spec.tied_embeddings, rope_theta=spec.rope_theta, attention_bias=False,
                       mlp_bias=False, attention_dropout=0.0, bos_token_id=bos_id, eos_token_id=eos_id,
                       architectures=[LLAMA])


def hf_model(state: dict, spec: ModelSpec, *, eos_id: int | None, bos_id: int | None = None, source):
    """GPT2LMHeadModel or LlamaForCausalLM holding `state` (dspipe names), fp32, every weight checked."""
    import torch
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    config = hf_config(spec, eos_id=eos_id, bos_id=bos_id)
    cls = GPT2LMHeadModel if architecture_of(spec) == GPT2 else LlamaForCausalLM
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
    if rest == "attn.c_attn.weight":
        q, kv = spec.heads * spec.head_dim, spec.kv_groups * spec.head_dim
        return [(layer + "self_attn.q_proj.weight", (q, h)), (layer + "self_attn.k_proj.weight", (kv, h)),
                (layer + "self_attn.v_proj.weight", (kv, h))], "rows"
    if rest == "mlp.c_fc.weight":
        return [(layer + "mlp.gate_proj.weight", (spec.ffn, h)), (layer + "mlp.up_proj.weight", (spec.ffn, h))], "rows"
    simple = {"ln_1.weight": "input_layernorm.weight", "ln_2.weight": "post_attention_layernorm.weight",
              "attn.c_proj.weight": "self_attn.o_proj.weight", "mlp.c_proj.weight": "mlp.down_proj.weight"}
    if rest not in simple:
        raise SpecError(f"parameter {name} has no {LLAMA} counterpart")
    return [(layer + simple[rest], shape)], "same"


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
