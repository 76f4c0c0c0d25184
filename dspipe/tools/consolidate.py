"""A dspipe checkpoint -> one fp32 state dict in dspipe GPT names (consolidate), and dspipe's GPT holding it
(load_gpt): DeepSpeed's files of any layout merged back into the model's weights (dspipe.tools.export writes
them as a Hugging Face directory).

Where the weights come from, by layout:

    pp = 1, ZeRO 1-3    the fp32 master partitions in *_optim_states.pt, merged by DeepSpeed's own
                        deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint
    pp > 1, ZeRO 0-1    the module weights in layer_XX-model_states.pt (the tied embedding is stored once,
                        by layer 0), then per stage the fp32 master partitions of that stage's optimizer files
                        (DeepSpeed's zero_to_fp32 merge, applied to one stage's files at a time)
    bf16 ZeRO-1         DeepSpeed's BF16_Optimizer: fp32 partitions located by its saved param_slice_mappings
    pp = 1, ZeRO 0      bf16/fp16: FP16_Optimizer's flat fp32 groups; fp32: the module weights in
                        mp_rank_00_model_states.pt (they are the master weights)
    tp > 1              each tp rank's weights as above from its own files (pp 1: mp_rank_RR and the optimizer
                        files of mp rank RR; pp > 1: layer_LL-model_RR and the optimizer files of mp rank
                        stage x tp + RR), then the shards put back together by dspipe's tensor-parallel layout
                        (dspipe.model.tp_split.merge_shards: fused q/k/v and gate/up interleaved, row-parallel
                        along dim 1, vocabulary rows along dim 0; replicated tensors equal on every tp rank)
    experts (MoE)       the module weights in mp_rank_00_model_states.pt (under a pipeline every stage's
                        mp_rank_SS) and the expert files layer_L_expert_E_..., DeepSpeed's MoE names mapped back
                        to the model's (_consolidate_experts); ZeRO-3 at ep > 1: every rank's fp32 partitions,
                        each expert's over its expert-data-parallel ranks (dspipe.runtime.zero3_experts)"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from dspipe.errors import SpecError
from dspipe.log import get_logger
from dspipe.model.names import layer_prefix as _layer_prefix
from dspipe.model.names import pipeline_gpt_name as _pipeline_name
from dspipe.runtime.ckpt_meta import CheckpointMeta
from dspipe.runtime.ckptfiles import LAYER_FILE, OPTIM_FILE  # the checkpoint's file names, defined once
from dspipe.spec.model import ModelSpec


def model_spec(meta: CheckpointMeta) -> ModelSpec:
    """The model of a checkpoint meta that read_meta validated."""
    return meta.spec


# ---- consolidation ------------------------------------------------------------------------------------------------


def _quiet():
    """DeepSpeed's zero_to_fp32 prints its progress (and tqdm bars); keep the console for what dspipe prints."""
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    return stack


def _import_deepspeed() -> None:
    """DeepSpeed logs to stdout from import on (e.g. 'Setting accelerator to CPU'); `generate` prints only text."""
    from dspipe.runtime.dscheck import import_deepspeed_quietly

    import_deepspeed_quietly()
    with _quiet():
        import deepspeed.utils.zero_to_fp32  # noqa: F401


def _load(path: Path, *, mmap: bool = False) -> dict:
    """A checkpoint file, weights-only (dspipe.runtime.safeload): never runs code a file names."""
    from dspipe.runtime.safeload import load

    return load(path, mmap=mmap)


MERGE_ERRORS = (OSError, KeyError, ValueError, RuntimeError, TypeError, AttributeError, IndexError, EOFError)
"""What DeepSpeed's merge code raises on files whose content is not what it expects (one SpecError instead)."""


def _optim_files(checkpoint: Path) -> dict[int, list[Path]]:
    """Optimizer partition files per model-parallel (pipeline stage) rank, in data-parallel rank order."""
    stages: dict[int, list[tuple[int, Path]]] = {}
    for p in checkpoint.iterdir():
        if m := OPTIM_FILE.match(p.name):
            stages.setdefault(int(m.group(2)), []).append((int(m.group(1)), p))
    return {s: [p for _, p in sorted(files)] for s, files in sorted(stages.items())}


def _master_from_zero_files(*, model_file: Path, optim_files: list[Path], checkpoint: Path) -> dict:
    """DeepSpeed's zero_to_fp32 merge applied to one pipeline stage's files (its public entry point reads every
    file in the directory, and its parse_model_states expects the module weights in the file)."""
    from deepspeed.utils import zero_to_fp32 as z

    sd = _load(model_file)  # a pipeline stage's model states: no module (the layer files hold it), no buffers
    states = [
        z.zero_model_state(
            buffers={},
            param_shapes=sd["param_shapes"],
            shared_params=[[k, v] for k, v in sd["shared_params"].items()],
            ds_version=sd.get("ds_version"),
            frozen_param_shapes=sd.get("frozen_param_shapes"),
            frozen_param_fragments=sd.get("frozen_param_fragments"),
        )
    ]
    with _quiet():
        stage, world, groups, paddings = z.parse_optim_states([str(p) for p in optim_files], str(checkpoint))
        if stage <= 2:
            sd = z._get_fp32_state_dict_from_zero2_checkpoint(world, groups, states, False, paddings)
        else:
            sd = z._get_fp32_state_dict_from_zero3_checkpoint(world, groups, states, False)
    return z.to_torch_tensor(sd)


def _master_from_bf16_optimizer(optim_files: list[Path]) -> dict:
    """BF16_Optimizer (bf16 + ZeRO-1): each rank's fp32 partition per group, and where each parameter's fragment
    lies in it (param_slice_mappings: name -> (numel, start)); a parameter is its fragments in rank order."""
    import torch
    from deepspeed.checkpoint.constants import (
        OPTIMIZER_STATE_DICT,
        PARAM_SLICE_MAPPINGS,
        SINGLE_PARTITION_OF_FP32_GROUPS,
    )

    pieces: dict[str, list] = {}
    for f in optim_files:
        state = _load(f)[OPTIMIZER_STATE_DICT]
        for flat, mapping in zip(state[SINGLE_PARTITION_OF_FP32_GROUPS], state[PARAM_SLICE_MAPPINGS], strict=True):
            for name, frag in mapping.items():
                pieces.setdefault(name, []).append(flat.narrow(0, frag.start, frag.numel).float())
    return {name: torch.cat(parts) for name, parts in pieces.items()}  # flat; reshaped against the module weights


def _master_from_fp16_optimizer(checkpoint: Path, *, name: str = "mp_rank_00_model_states.pt") -> dict:
    """ZeRO-0 with bf16/fp16 (DeepSpeed's FP16_Optimizer): one flat fp32 copy per parameter group, in the model
    states file `name`. The groups are train.param_groups: matrices and embeddings, then 1-d tensors, in module
    order."""
    path = checkpoint / name
    if not path.is_file():
        return {}
    sd = _load(path)
    flats = (sd.get("optimizer") or {}).get("fp32_groups_flat")
    module = sd.get("module") or {}
    if not flats or not module:
        return {}
    groups = [[n for n, t in module.items() if t.dim() >= 2], [n for n, t in module.items() if t.dim() < 2]]
    out = {}
    for names, flat in zip(groups, flats, strict=False):  # an empty group may have no flat
        offset = 0
        for n in names:
            out[n] = flat.narrow(0, offset, module[n].numel()).view(module[n].shape)
            offset += module[n].numel()
        if offset != flat.numel():
            raise SpecError(
                f"checkpoint {checkpoint}: the fp32 copy holds {flat.numel()} values for parameters of {offset}"
            )
    return out


def _master(checkpoint: Path, *, pp: int, model_file_for_stage) -> dict:
    """fp32 master weights (names as the engine's module has them) from the optimizer files, or {} if none."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, ZERO_STAGE

    if pp == 1 and not _optim_files(checkpoint):
        return _master_from_fp16_optimizer(checkpoint)
    merged: dict = {}
    for stage, files in _optim_files(checkpoint).items():
        probe = _load(files[0], mmap=True)[OPTIMIZER_STATE_DICT]  # mapped: only its keys are read
        if ZERO_STAGE in probe and pp == 1:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            with _quiet():
                part = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
        elif ZERO_STAGE in probe:
            part = _master_from_zero_files(
                model_file=model_file_for_stage(stage), optim_files=files, checkpoint=checkpoint
            )
        else:
            part = _master_from_bf16_optimizer(files)
        for name, t in part.items():
            merged.setdefault(name, t)  # a tied embedding appears in the first and the last stage: equal copies
    return merged


def _module_weights(checkpoint: Path, *, pp: int, layers: int) -> dict:
    """The module's own weights (bf16 in bf16 runs; empty placeholders under ZeRO-3), GPT names."""
    if pp == 1:
        sd = (
            _load(checkpoint / "mp_rank_00_model_states.pt")
            if (checkpoint / "mp_rank_00_model_states.pt").is_file()
            else {}
        )
        return dict(sd.get("module") or {})
    out = {}
    for p in sorted(checkpoint.iterdir()):
        if m := LAYER_FILE.match(p.name):
            prefix = _layer_prefix(int(m.group(1)), layers=layers)
            out.update({prefix + k: v for k, v in _load(p).items()})
    return out


def consolidate(checkpoint: Path, *, meta: CheckpointMeta) -> dict:
    """One fp32 state dict with dspipe GPT names: the fp32 master weights where the checkpoint has them, else the
    module weights. Shapes and names are checked when the dict is loaded into a model (strict)."""
    from dspipe.runtime.ckptfiles import check_checkpoint
    from dspipe.runtime.safeload import weights_only_loads

    _import_deepspeed()
    check_checkpoint(checkpoint, meta=meta)  # every file: present, weights-only, keys, step, names and shapes
    with weights_only_loads():  # DeepSpeed's zero_to_fp32 passes weights_only=False: forced weights-only here
        return _consolidate(checkpoint, meta=meta)


def _consolidate(checkpoint: Path, *, meta: CheckpointMeta) -> dict:
    from dspipe.runtime.experts import native_layer

    spec, pp = model_spec(meta), meta.pp
    if meta.tp > 1:
        return _consolidate_tensor_parallel(checkpoint, meta=meta, spec=spec)
    if spec.experts and native_layer(zero_stage=meta.zero_stage):  # ZeRO-3's experts: the model's own tensors
        return _consolidate_experts(checkpoint, spec=spec, pp=pp)
    if spec.experts and meta.zero_stage == 3 and (meta.ep or 1) > 1:  # partitioned over expert groups
        from dspipe.runtime import zero3_experts

        try:
            master = zero3_experts.master(checkpoint, experts=spec.experts, ep=meta.ep)
        except MERGE_ERRORS as e:
            raise SpecError(
                f"checkpoint {checkpoint}: cannot merge the fp32 master weights: {' '.join(str(e).split())[:300]}"
            ) from None
        out = _prefer_master(module={}, master=master, checkpoint=checkpoint)
        if spec.tied_embeddings:
            out.pop("lm_head.weight", None)
        return out
    module = _module_weights(checkpoint, pp=pp, layers=spec.layers)

    def model_file(stage: int) -> Path:  # pipelines run ZeRO 0-1: one model-states file per stage
        return checkpoint / f"mp_rank_{stage:02d}_model_states.pt"

    try:
        raw = _master(checkpoint, pp=pp, model_file_for_stage=model_file)
    except MERGE_ERRORS as e:
        raise SpecError(
            f"checkpoint {checkpoint}: cannot merge the fp32 master weights: {' '.join(str(e).split())[:300]}"
        ) from None
    master = {(name if pp == 1 else _pipeline_name(name, layers=spec.layers)): t for name, t in raw.items()}
    out = _prefer_master(module=module, master=master, checkpoint=checkpoint)
    if spec.tied_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _consolidate_experts(checkpoint: Path, *, spec: ModelSpec, pp: int) -> dict:
    """A mixture-of-experts checkpoint (DeepSpeed's native MoE, ZeRO 0-2): the module weights of
    mp_rank_00_model_states.pt (a pipeline's: of every stage's mp_rank file, under its layer indices; the tied
    embedding in the first and the last, equal) with the router under DeepSpeed's gate name, and each expert's file
    (its global id), under the model's names (dspipe.runtime.experts.model_name). They are the module's weights:
    fp32 runs' are the master weights; bf16 runs' are bf16 (DeepSpeed's zero_to_fp32 cannot merge expert-parallel
    optimizer partitions: each rank's experts would be read as data-parallel shards of one tensor)."""
    from dspipe.runtime.experts import EXPERT_FILE, model_name

    def name(key: str) -> str:
        return model_name(key if pp == 1 else _pipeline_name(key, layers=spec.layers))

    if pp == 1:
        module = {name(k): v for k, v in _module_weights(checkpoint, pp=1, layers=spec.layers).items()}
    else:
        module = {}
        for stage in range(pp):
            stage_module = _load(checkpoint / f"mp_rank_{stage:02d}_model_states.pt").get("module") or {}
            module.update({name(k): v for k, v in stage_module.items()})
    for p in sorted(checkpoint.iterdir()):
        if EXPERT_FILE.match(p.name):
            module.update({name(k): v for k, v in _load(p).items()})
    out = _prefer_master(module=module, master={}, checkpoint=checkpoint)
    if spec.tied_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _prefer_master(*, module: dict, master: dict, checkpoint: Path) -> dict:
    """Every parameter in fp32: the master copy where there is one (reshaped like the module's tensor), else the
    module weight."""
    import torch

    if not master and not module:
        raise SpecError(
            f"checkpoint {checkpoint} holds no model weights (no mp_rank_00_model_states.pt, layer_*, "
            f"or *_optim_states.pt files)"
        )
    for where in (module, master):
        odd = next((n for n, t in where.items() if not t.is_floating_point()), None)
        if odd is not None:
            raise SpecError(
                f"checkpoint {checkpoint}: tensor {odd} is {where[odd].dtype}, not a floating-point weight (the "
                f"runner saves fp32, bf16 or fp16)"
            )
    other = sorted({str(t.dtype) for t in module.values() if t.dtype != torch.float32})
    if not master and other:
        get_logger(__name__).info(
            f"note: {checkpoint} has no fp32 master weights; using its {', '.join(other)} module weights"
        )
    out = {}
    for name in sorted(set(module) | set(master)):
        t = master.get(name)
        if t is None:
            t = module[name]
        elif name in module and module[name].numel() == t.numel() and module[name].dim() > 0:
            t = t.reshape(module[name].shape)  # BF16_Optimizer fragments are flat
        out[name] = t.detach().float().contiguous()
    return out


def _consolidate_tensor_parallel(checkpoint: Path, *, meta: CheckpointMeta, spec: ModelSpec) -> dict:
    """tp > 1 (dspipe's Megatron-layout layers, pp >= 1): every tp rank's fp32 weights read as the single-rank path
    reads them, from that rank's own files (its module weights: mp_rank_RR, or under a pipeline the layer files
    layer_LL-model_RR; its master weights: the optimizer files of model-parallel rank stage x tp + RR of every
    stage), then the shards put back together by the layout (dspipe.model.tp_split.merge_shards); replicated
    tensors must agree across the tp ranks. Experts spread over the tp group (ep = tp) are each held by one tp rank,
    under its local index: they come back under their global one. Experts over k tp groups (ep = tp x k:
    dspipe.runtime.experts.beyond_tp) on DeepSpeed's native layer are read as the tp 1 native layer's are
    (_consolidate_experts): the module weights and each expert's file, named by its global id; under ZeRO-3 each tp
    rank's partitions as dspipe.runtime.zero3_experts reads them, the experts under their global ids."""
    from dspipe.model.tp_split import merge_shards
    from dspipe.runtime.experts import beyond_tp, folded

    tp, pp, ep = meta.tp, meta.pp, meta.ep or 1
    over = bool(spec.experts) and beyond_tp(tp=tp, ep=ep)
    read = _tp_rank_weights
    if over:
        read = _tp_rank_spread if meta.zero_stage == 3 else _tp_rank_module
    ranks = [read(checkpoint, rank=r, tp=tp, pp=pp, spec=spec, ep=ep) for r in range(tp)]
    if over:  # each expert is one tp rank's, under its global id
        experts = {k: state.pop(k) for state in ranks for k in [k for k in state if ".mlp.experts." in k]}
    elif spec.experts and folded(tp=tp, ep=ep):  # spread over the tp group: rank r's experts.J is expert r x E/tp + J
        from dspipe.runtime.moe_reshard import global_expert_name

        per = spec.experts // tp
        ranks = [
            {global_expert_name(k, ep_rank=r, local=per): v for k, v in state.items()} for r, state in enumerate(ranks)
        ]
        experts = {k: state.pop(k) for state in ranks for k in [k for k in state if ".mlp.experts." in k]}
    else:
        experts = {}
    names = set(ranks[0])
    for r, state in enumerate(ranks[1:], start=1):
        if set(state) != names:
            raise SpecError(
                f"checkpoint {checkpoint}: tp rank {r} holds other parameters than tp rank 0: "
                f"{sorted(set(state) ^ names)[:3]}"
            )
    try:
        out = {name: merge_shards(name, [state[name] for state in ranks], spec) for name in sorted(names)}
    except (ValueError, RuntimeError) as e:
        raise SpecError(f"checkpoint {checkpoint}: {' '.join(str(e).split())[:300]}") from None
    out.update(experts)
    if spec.tied_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _tp_rank_spread(checkpoint: Path, *, rank: int, tp: int, pp: int, spec: ModelSpec, ep: int) -> dict:
    """Tp rank `rank`'s fp32 weights under ZeRO-3 with the experts over k tp groups (the model's own experts,
    dspipe.runtime.moe.spread_experts): its ZeRO-3 partitions put together by dspipe.runtime.zero3_experts."""
    from dspipe.runtime import zero3_experts

    try:
        master = zero3_experts.master(checkpoint, experts=spec.experts, ep=ep, tp=tp, tp_rank=rank)
    except MERGE_ERRORS as e:
        raise SpecError(
            f"checkpoint {checkpoint}: cannot merge tp rank {rank}'s fp32 master weights: "
            f"{' '.join(str(e).split())[:300]}"
        ) from None
    return _prefer_master(module={}, master=master, checkpoint=checkpoint)


def _tp_rank_module(checkpoint: Path, *, rank: int, tp: int, pp: int, spec: ModelSpec, ep: int = 1) -> dict:
    """Tp rank `rank`'s module weights in fp32 under the model's names, DeepSpeed's native MoE layer at tp > 1: its
    model-parallel ranks' module (stage x tp + rank under a pipeline, whose stages keep their modules there) and the
    expert files they wrote (their global ids). A bf16 run's are bf16 (as _consolidate_experts says)."""
    from dspipe.runtime.experts import EXPERT_FILE, model_name

    module = {}
    for stage in range(pp):
        mp = stage * tp + rank
        held = _load(checkpoint / f"mp_rank_{mp:02d}_model_states.pt").get("module") or {}
        module.update({k if pp == 1 else _pipeline_name(k, layers=spec.layers): v for k, v in held.items()})
        for p in sorted(checkpoint.iterdir()):
            if (m := EXPERT_FILE.match(p.name)) and int(m.group(3)) == mp:
                module.update({k if pp == 1 else _pipeline_name(k, layers=spec.layers): v for k, v in _load(p).items()})
    return _prefer_master(module={model_name(k): v for k, v in module.items()}, master={}, checkpoint=checkpoint)


def _tp_rank_weights(checkpoint: Path, *, rank: int, tp: int, pp: int, spec: ModelSpec, ep: int = 1) -> dict:
    """Tp rank `rank`'s shards in fp32, GPT names: the master copy where the checkpoint has one, else the module's."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, ZERO_STAGE

    optim = _optim_files(checkpoint)
    mp_ranks = [stage * tp + rank for stage in range(pp)]  # DeepSpeed's model-parallel ranks (pp 1: rank)

    def model_file(mp: int) -> Path:  # ZeRO-3 (pp 1): every partition's file holds the shapes, rank 0's is read
        plain = checkpoint / f"mp_rank_{mp:02d}_model_states.pt"
        return plain if plain.is_file() else checkpoint / f"zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt"

    if pp == 1:
        module = dict(_load(model_file(rank)).get("module") or {})
    else:
        module = {}
        for p in sorted(checkpoint.iterdir()):
            if (m := LAYER_FILE.match(p.name)) and m.group(2) is not None and int(m.group(2)) == rank:
                prefix = _layer_prefix(int(m.group(1)), layers=spec.layers)
                module.update({prefix + k: v for k, v in _load(p).items()})
    master: dict = {}
    try:
        if not optim and pp == 1:
            master = _master_from_fp16_optimizer(checkpoint, name=f"mp_rank_{rank:02d}_model_states.pt")
        for mp in mp_ranks:
            if mp not in optim:
                continue
            if ZERO_STAGE in _load(optim[mp][0], mmap=True)[OPTIMIZER_STATE_DICT]:
                part = _master_from_zero_files(model_file=model_file(mp), optim_files=optim[mp], checkpoint=checkpoint)
            else:
                part = _master_from_bf16_optimizer(optim[mp])
            for name, t in part.items():  # a tied embedding is on the first and the last stage: equal copies
                master.setdefault(name if pp == 1 else _pipeline_name(name, layers=spec.layers), t)
    except MERGE_ERRORS as e:
        raise SpecError(
            f"checkpoint {checkpoint}: cannot merge tp rank {rank}'s fp32 master weights: "
            f"{' '.join(str(e).split())[:300]}"
        ) from None
    return _prefer_master(module=module, master=master, checkpoint=checkpoint)


def load_gpt(checkpoint: Path, *, meta: CheckpointMeta):
    """dspipe's GPT holding the consolidated weights, in eval mode."""
    from dspipe.model.gpt import GPT

    spec = model_spec(meta)
    model = GPT(spec, seed=0)
    _load_strict(model, consolidate(checkpoint, meta=meta), checkpoint)
    return model.eval()


def _load_strict(model, state: dict, source) -> None:
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise SpecError(
            f"checkpoint {source} does not match its model shape: {' '.join(str(e).split())[:300]}"
        ) from None
