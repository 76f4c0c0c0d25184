"""The two Hugging Face architectures dspipe reads and writes, both ways: GPT2LMHeadModel and LlamaForCausalLM.

One place per architecture for everything that crosses the boundary:

    config.json -> ModelSpec      spec_from_hf_dir (reads JSON only: no torch, no transformers)
    ModelSpec -> config           hf_config (GPT2Config or LlamaConfig)
    weights, dspipe <-> HF names  to_hf_state / from_hf_state, exact inverses (a rename, GPT-2's Conv1D transpose,
                                  Llama's q/k/v and gate/up split out of dspipe's fused projections)
    a model directory -> weights  load_hf_weights (safetensors or PyTorch files, sharded or not, fp32), and
                                  load_into_module for the runner (`gen-config --init-from HF_DIR`)

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
from dataclasses import replace
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
hub) lack it, and transformers adds it when loading: so does load_hf_weights."""
WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                "pytorch_model.bin")
_MISSING = object()
SAFETENSORS_FLOAT_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}
"""The floating dtypes of a safetensors header that load as model weights, with their bytes per element."""


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


# ---- reading a model directory ------------------------------------------------------------------------------------

class CheckpointTensors(Mapping):
    """The tensors of a Hugging Face model directory, read lazily one by one (safetensors memory-maps, .bin files
    load once each, memory-mapped): model.safetensors(.index.json) or pytorch_model.bin(.index.json). Names
    without the base model's prefix (a checkpoint saved from GPT2Model) answer to the prefixed name too."""

    def __init__(self, path: Path, *, prefix: str = ""):
        from dspipe.jsonio import read_object

        self.path, self.prefix = Path(path), prefix
        self._open: dict[str, object] = {}
        found = next((f for f in WEIGHT_FILES if (self.path / f).is_file()), None)
        if found is None:
            raise SpecError(f"{self.path}: no weights ({', '.join(WEIGHT_FILES)})")
        self.source = self.path / found
        if found.endswith(".index.json"):
            index = read_object(self.source).get("weight_map")
            if not isinstance(index, dict) or not all(isinstance(v, str) for v in index.values()):
                raise SpecError(f"{self.source}: weight_map must map tensor names to file names")
            self.files = dict(index)
        else:
            self.files = {key: found for key in self._keys(found)}

    def _handle(self, file: str):
        if file not in self._open:
            path = self.path / file
            if os.path.basename(file) != file or not path.is_file():
                raise SpecError(f"{self.source}: names {file!r}, which is not a file in {self.path}")
            try:
                if file.endswith(".safetensors"):
                    from safetensors import safe_open

                    self._open[file] = safe_open(str(path), framework="pt")
                else:
                    import torch

                    try:
                        self._open[file] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                    except RuntimeError:  # a file in the legacy (non-zip) format cannot be memory-mapped
                        self._open[file] = torch.load(path, map_location="cpu", weights_only=True)
            except SpecError:
                raise
            except Exception as e:  # safetensors' and torch's errors on damaged files
                raise SpecError(f"{path}: cannot read the weights: {' '.join(str(e).split())[:200]}") from None
        return self._open[file]

    def _keys(self, file: str) -> list[str]:
        handle = self._handle(file)
        return list(handle.keys())

    def _resolve(self, key: str) -> str | None:
        if key in self.files:
            return key
        if self.prefix and key.startswith(self.prefix) and key[len(self.prefix):] in self.files:
            return key[len(self.prefix):]
        return None

    def __contains__(self, key) -> bool:
        return isinstance(key, str) and self._resolve(key) is not None

    def __getitem__(self, key: str):
        if self._resolve(key) is None:
            raise KeyError(key)
        return self.read(key)

    def read(self, key: str, *, rows: slice | None = None, cols: slice | None = None):
        """Tensor `key`, or only its rows/columns: safetensors reads just those bytes (get_slice), a .bin file is
        memory-mapped, so only the pages of the slice are touched."""
        stored = self._resolve(key)
        handle = self._handle(self.files[stored])
        index = (rows or slice(None),) if cols is None else (rows or slice(None), cols)
        try:
            if hasattr(handle, "get_slice"):
                return handle.get_slice(stored)[index] if rows or cols else handle.get_tensor(stored)
            return handle[stored][index] if rows or cols else handle[stored]
        except Exception as e:
            raise SpecError(f"{self.path / self.files[stored]}: cannot read tensor {stored}: "
                            f"{' '.join(str(e).split())[:200]}") from None

    def shape(self, key: str) -> tuple:
        return self.header(key)[0]

    def header(self, key: str) -> tuple[tuple, str, int]:
        """(shape, dtype name, bytes per element) of tensor `key`, from the file's header only."""
        stored = self._resolve(key)
        handle = self._handle(self.files[stored])
        if hasattr(handle, "get_slice"):
            view = handle.get_slice(stored)
            dtype = view.get_dtype()
            return tuple(view.get_shape()), dtype, SAFETENSORS_FLOAT_BYTES.get(dtype, 0)
        t = handle[stored]
        return tuple(t.shape), str(t.dtype).replace("torch.", ""), t.element_size() if t.is_floating_point() else 0

    def __iter__(self):
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def check_matches(path: str | Path, spec: ModelSpec) -> None:
    """HF_DIR's config describes `spec` (up to its name, dropout and a shorter context); one line otherwise."""
    hf = spec_from_hf_dir(path, name=spec.name, dropout=spec.dropout)
    if spec.seq_len > hf.seq_len:
        raise SpecError(f"{path}: the model has {hf.seq_len} positions, the run's seq_len is {spec.seq_len}")
    diff = [f"{k} {getattr(hf, k)!r} (run: {getattr(spec, k)!r})" for k in ModelSpec.__dataclass_fields__
            if k not in ("name", "dropout", "seq_len") and getattr(hf, k) != getattr(spec, k)]
    if diff:
        raise SpecError(f"{path}: its config.json describes another model than the run's: {', '.join(diff[:3])}")


def _checked_tensors(path: Path, spec: ModelSpec) -> tuple[CheckpointTensors, int]:
    """HF_DIR's tensors after checking, from the config and the files' headers only (no tensor data is read), that
    they are the model `spec`: every tensor it needs present, with its shape and a floating dtype. Returns them and
    the bytes those tensors take in the files."""
    check_matches(path, spec)
    tensors = CheckpointTensors(path, prefix=BASE_PREFIX[architecture_of(spec)])
    total = 0
    for key, shape in hf_tensors(spec):
        if key not in tensors:
            raise SpecError(f"{tensors.source}: missing tensor {key}")
        have, dtype, size = tensors.header(key)
        rows_ok = key.endswith("wpe.weight") and len(have) == 2 and have[0] >= shape[0] and have[1] == shape[1]
        if have != tuple(shape) and not rows_ok:
            raise SpecError(f"{tensors.source}: tensor {key} has shape {list(have)}, the model needs {list(shape)}")
        if not size:
            raise SpecError(f"{tensors.source}: tensor {key} has dtype {dtype}, not a floating-point type")
        total += math.prod(shape) * size
    return tensors, total


def check_weights(path: str | Path, spec: ModelSpec) -> int:
    """`gen-config --init-from` before it writes the run: the weights of HF_DIR are the model `spec`'s (files
    present and readable, every tensor name, shape and dtype; headers only). Returns the bytes of those tensors."""
    return _checked_tensors(Path(path), spec)[1]


def load_hf_weights(path: str | Path, spec: ModelSpec, *, names=None) -> dict:
    """The weights of Hugging Face directory `path` under dspipe names, fp32: all of spec.model_tensors(), or the
    subset `names` (checked first as check_weights does); one line otherwise."""
    tensors, _ = _checked_tensors(Path(path), spec)
    return from_hf_state(tensors, spec, names=names, source=tensors.source)


class HFWeights:
    """A Hugging Face model directory as the source of dspipe's parameters, read lazily: a whole tensor, some of
    its rows, or a flat range of its elements (a ZeRO-3 partition), each read from the files' bytes for just that
    part (safetensors get_slice) and converted to fp32. Checked like check_weights when opened."""

    def __init__(self, path: str | Path, spec: ModelSpec):
        self.path, self.spec = Path(path), spec
        self.tensors, self.bytes = _checked_tensors(self.path, spec)
        self.map = weight_map(spec)
        self.shapes = dict(spec.model_tensors())

    def rows(self, name: str, start: int, stop: int):
        """Rows start..stop-1 (dim 0) of dspipe parameter `name`, fp32."""
        import torch

        parts, how = self.map[name]
        if how == "t":  # dspipe's rows are the HF tensor's columns
            t = self.tensors.read(parts[0][0], cols=slice(start, stop)).t()
        elif how == "rows":  # stacked HF tensors: take each one's share of the range
            pieces, offset = [], 0
            for key, shape in parts:
                lo, hi = max(start, offset), min(stop, offset + shape[0])
                if lo < hi:
                    pieces.append(self.tensors.read(key, rows=slice(lo - offset, hi - offset)))
                offset += shape[0]
            t = torch.cat(pieces, dim=0)
        else:
            t = self.tensors.read(parts[0][0], rows=slice(start, stop))
        return t.to(torch.float32).contiguous()

    def full(self, name: str):
        return self.rows(name, 0, self.shapes[name][0])

    def flat(self, name: str, start: int, stop: int):
        """Elements start..stop-1 of parameter `name` flattened (row-major), reading only the rows they lie in."""
        shape = self.shapes[name]
        width = math.prod(shape[1:])
        first, last = start // width, -(-stop // width)
        return self.rows(name, first, last).reshape(-1)[start - first * width:stop - first * width]


TIED_PREFIX = "tied_modules.embed."
"""DeepSpeed's name for the tied embedding/head module of dspipe's PipelineModule (dspipe.model.pipeline)."""


def pipeline_gpt_name(name: str, *, layers: int) -> str:
    """PipelineModule parameter name ('3.ln_1.weight', 'tied_modules.embed.wte.weight') -> GPT name (the runner's
    loader here, and export's consolidation of pipeline checkpoints)."""
    if name.startswith(TIED_PREFIX):
        return "embed." + name[len(TIED_PREFIX):]
    index, rest = name.split(".", 1)
    return layer_prefix(int(index), layers=layers) + rest


def layer_prefix(index: int, *, layers: int) -> str:
    """Pipeline layer index -> GPT module prefix: embedding, blocks 1..L, final norm, untied head."""
    if index == 0:
        return "embed."
    if 1 <= index <= layers:
        return f"h.{index - 1}."
    if index == layers + 1:
        return "final."
    if index == layers + 2:
        return "lm_head."
    raise SpecError(f"pipeline layer {index} does not exist in a {layers}-layer model")


def gpt_parameters(module, spec: ModelSpec):
    """(GPT name, parameter) of every parameter `module` holds: the plain GPT's own names, a PipelineModule stage's
    translated from pipeline names ('3.attn.c_attn.weight', 'tied_modules.embed.wte.weight')."""
    from dspipe.model.gpt import GPT

    for name, param in module.named_parameters():
        yield (name if isinstance(module, GPT) else pipeline_gpt_name(name, layers=spec.layers)), param


def load_into_module(module, weights: HFWeights, *, spec: ModelSpec, write=None) -> int:
    """Overwrite `module`'s parameters with HF weights, one tensor at a time (the runner's step 0 under
    `--init-from`): the plain GPT all of them, a PipelineModule stage only its own. `write(param, name)` puts
    parameter `name`'s value into `param` (default: read it whole and copy). Returns the number of tensors."""
    import torch

    count = 0
    with torch.no_grad():
        for name, param in gpt_parameters(module, spec):
            if write is None:
                param.copy_(weights.full(name))
            else:
                write(param, name)
            count += 1
    return count


# ---- gen-config --init-from ---------------------------------------------------------------------------------------

SHAPE_FLAGS = ("layers", "hidden", "heads", "vocab", "ffn")


def init_from_spec(path: str, o: dict) -> ModelSpec:
    """The model of `gen-config --init-from HF_DIR` (and plan/bench): HF_DIR's config; a shape flag must agree with
    it, --seq-len may shorten the context (never beyond the model's positions), --dropout replaces the config's;
    its weights are checked (check_weights). Prints a note comparing HF_DIR's tokenizer with the data's where both are known."""
    flag = f"--init-from {path}"
    if o.get("model"):
        raise SpecError(f"--model {o['model']} and {flag} both name the model; give one of them")
    if o.get("pad_vocab"):
        raise SpecError(f"--pad-vocab contradicts {flag}: the vocabulary is the Hugging Face model's")
    spec = spec_from_hf_dir(path, dropout=o.get("dropout"))
    for key in SHAPE_FLAGS:
        if o.get(key) is not None and o[key] != getattr(spec, key):
            raise SpecError(f"--{key} {o[key]} contradicts {flag} ({key} {getattr(spec, key)} in its "
                            f"{CONFIG_FILE}); the shape comes from the Hugging Face model: drop --{key}")
    if o.get("untied") and spec.tied_embeddings:
        raise SpecError(f"--untied contradicts {flag} (tie_word_embeddings true in its {CONFIG_FILE})")
    seq_len = o.get("seq_len")
    if seq_len is not None and seq_len != spec.seq_len:
        if isinstance(seq_len, int) and seq_len > spec.seq_len:
            why = ("learned positions: there are no weights for more" if spec.positions == "learned" else
                   "a longer context needs rope scaling, which dspipe does not implement")
            raise SpecError(f"--seq-len {seq_len} exceeds the {spec.seq_len} positions of {flag} ({why})")
        spec = replace(spec, seq_len=seq_len)
    check_weights(path, spec)  # before anything is written or launched: files, names, shapes, dtypes (headers)
    note = tokenizer_note(path, o.get("data"))
    if note:
        import click

        click.echo(note, err=True)
    return spec


def tokenizer_vocab(tokenizer_json: Path) -> tuple[int, dict] | None:
    """(size, vocabulary) of a tokenizer.json: its model's vocab and its added tokens; None if unreadable."""
    import json

    try:
        tok = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
        vocab = dict(tok["model"]["vocab"]) if isinstance(tok["model"].get("vocab"), dict) else {}
        vocab.update({t["content"]: t["id"] for t in tok.get("added_tokens") or []})
        return len(set(vocab.values())), vocab
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def tokenizer_note(hf_dir: str, data: str | None) -> str | None:
    """Whether the prepared data's tokenizer is HF_DIR's (its vocabulary size, and whether the vocabulary is
    the same), as one note line; None when either side is unknown."""
    from dspipe.data.shards import META_FILE, TOKENIZER_DIR
    from dspipe.jsonio import read_object

    if not data or not (Path(data) / META_FILE).is_file():
        return None
    hint = f"prepare the data with the model's tokenizer: 'dspipe prepare-data --tokenizer {hf_dir} --out {data}'"
    data_vocab = read_object(Path(data) / META_FILE).get("vocab_size")
    if not (Path(hf_dir) / "tokenizer.json").is_file():
        return (f"note: {hf_dir} has no tokenizer.json, so its tokenizer was not compared with {data}'s "
                f"({data_vocab} tokens); {hint}")
    theirs = tokenizer_vocab(Path(hf_dir) / "tokenizer.json")
    ours = tokenizer_vocab(Path(data) / TOKENIZER_DIR / "tokenizer.json")
    if theirs is None:
        return f"note: cannot read {Path(hf_dir) / 'tokenizer.json'}; {hint}"
    if theirs[0] != data_vocab:
        return (f"note: {data} was tokenized with a {data_vocab}-token tokenizer, {hf_dir}'s has {theirs[0]} "
                f"tokens: token ids would not mean what the model learned; {hint}")
    if ours is not None and ours[1] != theirs[1]:
        return (f"note: {data}'s tokenizer has the same vocab size as {hf_dir}'s ({data_vocab}) but another "
                f"vocabulary; {hint}")
    return f"note: {data}'s tokenizer has the same vocab size as {hf_dir}'s ({data_vocab} tokens)"
