"""Weights, dspipe names <-> Hugging Face names (to_hf_state / from_hf_state, exact inverses; weight_map,
hf_tensors, fused_source), and hf_model: the architecture_of(spec) CausalLM holding a dspipe state dict.

Weight mapping (dspipe name <- Hugging Face name; i is the block):

    GPT-2   embed.wte/wpe <- transformer.wte/wpe; h.i.* <- transformer.h.i.* (attn.c_attn, attn.c_proj, mlp.c_fc,
            mlp.c_proj weights transposed: HF's Conv1D stores (in, out)); final.ln_f <- transformer.ln_f;
            lm_head.weight <- lm_head.weight (untied only)
    Llama   embed.wte <- model.embed_tokens; h.i.ln_1 <- input_layernorm; h.i.attn.c_attn = [q_proj; k_proj; v_proj]
    family  (rows heads x hd, kv x hd, kv x hd; its bias likewise from the three biases); h.i.attn.q_norm/k_norm <-
            self_attn.q_norm/k_norm; h.i.attn.c_proj <- o_proj; h.i.ln_2 <- post_attention_layernorm;
            h.i.mlp.c_fc = [gate_proj; up_proj] (weight and bias); h.i.mlp.c_proj <- down_proj; final.ln_f <-
            model.norm; lm_head.weight <- lm_head.weight (untied only)
    MoE     h.i.mlp.router <- block_sparse_moe.gate (Mixtral) / mlp.gate (Qwen3-MoE); h.i.mlp.experts.e.c_fc =
            [w1; w3] / [gate_proj; up_proj] of block_sparse_moe.experts.e / mlp.experts.e; its c_proj <- w2 /
            down_proj: the files' per-expert tensors (what save_pretrained writes). In memory transformers 5 holds
            them fused, mlp.gate and mlp.experts.gate_up_proj (E, 2 x width, hidden) = the experts' c_fc stacked and
            mlp.experts.down_proj (E, hidden, width) = their c_proj stacked: to_hf_state gives that form,
            from_hf_state reads either."""

from __future__ import annotations

from typing import Mapping

from dspipe.errors import SpecError
from dspipe.model.hf import CONV1D, GPT2, MIXTRAL, MOE_ARCHITECTURES
from dspipe.model.hf_arch import architecture_of, hf_config
from dspipe.spec.model import ModelSpec

# ---- weights: dspipe names <-> Hugging Face names ------------------------------------------------------------------


def _parts(name: str, shape: tuple, spec: ModelSpec, arch: str) -> tuple[list[tuple[str, tuple]], str]:
    """The Hugging Face tensors (name, shape) that dspipe's `name` is made of, and how: 'same', 't' (transpose) or
    'rows' (the HF tensors stacked along dim 0)."""
    if arch == GPT2:
        if name.startswith("embed."):
            return [("transformer." + name[len("embed.") :], shape)], "same"
        if name.startswith("h."):
            if name.split(".", 2)[2] in CONV1D:
                return [("transformer." + name, tuple(reversed(shape)))], "t"
            return [("transformer." + name, shape)], "same"
        if name.startswith("final."):
            return [("transformer." + name[len("final.") :], shape)], "same"
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
    if module.startswith(("mlp.router", "mlp.experts.")) and arch in MOE_ARCHITECTURES:
        moe = f"{layer}{'block_sparse_moe' if arch == MIXTRAL else 'mlp'}."
        if module == "mlp.router":
            return [(f"{moe}gate.weight", shape)], "same"
        _, _, e, proj = module.split(".")
        gate, up, down = ("w1", "w3", "w2") if arch == MIXTRAL else ("gate_proj", "up_proj", "down_proj")
        if proj == "c_fc":
            return [(f"{moe}experts.{e}.{p}.weight", (spec.expert_width, h)) for p in (gate, up)], "rows"
        return [(f"{moe}experts.{e}.{down}.weight", shape)], "same"
    if module == "attn.c_attn":
        q, kv = spec.q_width, spec.kv_groups * spec.head_dim
        return [
            (f"{layer}self_attn.{p}_proj.{kind}", (rows, *cols)) for p, rows in (("q", q), ("k", kv), ("v", kv))
        ], "rows"
    if module == "mlp.c_fc":
        return [(f"{layer}mlp.{p}_proj.{kind}", (spec.ffn, *cols)) for p in ("gate", "up")], "rows"
    simple = {
        "ln_1": "input_layernorm",
        "ln_2": "post_attention_layernorm",
        "attn.c_proj": "self_attn.o_proj",
        "mlp.c_proj": "mlp.down_proj",
        "attn.q_norm": "self_attn.q_norm",
        "attn.k_norm": "self_attn.k_norm",
    }
    if module not in simple:
        raise SpecError(f"parameter {name} has no {arch} counterpart")
    return [(f"{layer}{simple[module]}.{kind}", shape)], "same"


def weight_map(spec: ModelSpec) -> dict[str, tuple[list[tuple[str, tuple]], str]]:
    """dspipe name -> (its Hugging Face tensors with their shapes, how they combine), for every parameter of
    spec.model_tensors() (a tied head is the embedding: no HF tensor of its own); a mixture of experts' as the files
    hold them (per expert)."""
    arch = architecture_of(spec)
    return {name: _parts(name, shape, spec, arch) for name, shape in spec.model_tensors()}


def hf_tensors(spec: ModelSpec) -> list[tuple[str, tuple]]:
    """Every tensor (name, shape) a Hugging Face checkpoint of `spec` stores (a tied lm_head is not stored)."""
    return [part for parts, _ in weight_map(spec).values() for part in parts]


def fused_source(name: str, spec: ModelSpec) -> tuple[str, int | None] | None:
    """Where a mixture of experts' parameter `name` lies in transformers 5's in-memory (fused) state dict: (key,
    expert index into its first dimension, or None: the whole tensor); None for any other parameter."""
    parts = name.split(".")
    if not spec.experts or len(parts) < 4 or parts[2] != "mlp" or parts[3] not in ("router", "experts"):
        return None
    layer = f"model.layers.{parts[1]}.mlp."
    if parts[3] == "router":
        return f"{layer}gate.weight", None
    return f"{layer}experts.{'gate_up_proj' if parts[5] == 'c_fc' else 'down_proj'}", int(parts[4])


def to_hf_state(state: Mapping, spec: ModelSpec) -> dict:
    """dspipe names (exactly spec.model_tensors(); a tied lm_head.weight may be present) -> Hugging Face names, as
    the model's state_dict() has them (a tied lm_head.weight is the embedding tensor; a mixture of experts' fused:
    fused_source)."""
    import torch

    mapping = weight_map(spec)
    extra = sorted(set(state) - set(mapping) - ({"lm_head.weight"} if spec.tied_embeddings else set()))
    if extra:
        raise SpecError(
            f"unexpected parameter {extra[0]} for model {spec.name}"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
        )
    out, stacks = {}, {}
    for name, (parts, how) in mapping.items():
        if name not in state:
            raise SpecError(f"missing parameter {name} for model {spec.name}")
        t = state[name]
        fused = fused_source(name, spec)
        if fused is not None:
            key, expert = fused
            if expert is None:
                out[key] = t.contiguous()
            else:
                stacks.setdefault(key, []).append(t)  # experts in order: weight_map lists them so
            continue
        if how == "t":
            out[parts[0][0]] = t.t().contiguous()
        elif how == "rows":
            for (key, _), piece in zip(parts, t.split([shape[0] for _, shape in parts], dim=0), strict=True):
                out[key] = piece.contiguous()
        else:
            out[parts[0][0]] = t.contiguous()
    out.update({key: torch.stack(pieces).contiguous() for key, pieces in stacks.items()})
    if spec.tied_embeddings:
        out["lm_head.weight"] = out[mapping["embed.wte.weight"][0][0][0]]
    return out


def from_hf_state(hf_state: Mapping, spec: ModelSpec, *, names=None, source="state dict") -> dict:
    """Hugging Face names -> dspipe names (all of spec.model_tensors(), or only `names`), the inverse of
    to_hf_state. Every needed tensor must be there with its shape (one line otherwise); other keys (buffers, a tied
    lm_head) are ignored. A learned position table with more rows than spec.seq_len gives its first rows (a run
    may train a shorter context). A mixture of experts' tensors are read per expert (the files' form) or fused (the
    in-memory form, fused_source)."""
    import torch

    out, shapes = {}, dict(spec.model_tensors())
    for name, (parts, how) in weight_map(spec).items():
        if names is not None and name not in names:
            continue
        fused = fused_source(name, spec)
        if fused is not None and parts[0][0] not in hf_state and fused[0] in hf_state:
            key, expert = fused
            t = hf_state[key] if expert is None else hf_state[key][expert]
            if tuple(t.shape) != tuple(shapes[name]):
                shown = list(hf_state[key].shape)
                raise SpecError(
                    f"{source}: tensor {key} has shape {shown}, model {spec.name} needs "
                    f"{list(shapes[name]) if expert is None else [spec.experts, *shapes[name]]}"
                )
            out[name] = t.detach().to(torch.float32).contiguous()
            continue
        pieces = []
        for key, shape in parts:
            if key not in hf_state:
                raise SpecError(f"{source}: missing tensor {key} (model {spec.name} needs it for {name})")
            t = hf_state[key]
            if name == "embed.wpe.weight" and t.dim() == 2 and t.shape[0] > shape[0] and t.shape[1] == shape[1]:
                t = t[: shape[0]]
            if tuple(t.shape) != tuple(shape):
                raise SpecError(
                    f"{source}: tensor {key} has shape {list(t.shape)}, model {spec.name} needs {list(shape)}"
                )
            pieces.append(t)
        t = pieces[0].t() if how == "t" else torch.cat(pieces, dim=0) if how == "rows" else pieces[0]
        out[name] = t.detach().to(torch.float32).contiguous()
    return out


# ---- the Hugging Face model holding dspipe's weights -----------------------------------------------------------------
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
        raise SpecError(
            f"checkpoint {source} does not map onto {cls.__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return model.eval()
