"""The files of one checkpoint directory, checked before anything (DeepSpeed's load_checkpoint, export, generate)
reads them: each file the checkpoint's layout needs is there, loads weights-only (dspipe.runtime.safeload), holds
the object of its kind with the keys readers use, was saved at the step its dspipe.json names, and holds the model's
parameters by name and shape. Anything else is one SpecError naming the file and what is wrong.

Which files a layout writes (DeepSpeed 0.19; mp, the model-parallel ranks: tp at pp 1, pp x tp under a pipeline,
whose rank m is stage m // tp, tp rank m % tp; z = dp x sp, the ranks ZeRO partitions over):

    mp_rank_MM_model_states.pt                       ZeRO 0-2: module weights, lr schedule, counters (m < mp)
    zero_pp_rank_D_mp_rank_MM_model_states.pt        ZeRO-3: the same per partition (d < z, m < mp)
    [bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt ZeRO 1-3, and bf16 pipelines at ZeRO-0 (d < z, m < mp)
    layer_LL-model_states.pt                         pp > 1: each pipeline layer's weights (L = 0 .. layers + 1,
                                                     and the untied head layers + 2)
    layer_LL-model_RR-model_states.pt                pp > 1, tp > 1: the same, tp rank RR's shards
    layer_L_expert_E_mp_rank_MM_model_states.pt      experts: routed expert E of sparse block L (from 0 among the
                                                     sparse blocks of the model at pp 1, of its stage under a
                                                     pipeline), by the expert-parallel rank that holds it (MM:
                                                     its model-parallel rank, the stage's x tp + its tp rank
                                                     when ep = tp x k spans tp groups); a
                                                     pipeline's stages then keep their modules in their mp_rank
                                                     files (DeepSpeed's MoE save), not in layer files
    rng-rankR.pt                                     dspipe: every rank's RNG streams (r < world size)
"""

from __future__ import annotations

import re
from pathlib import Path

from dspipe.errors import SpecError
from dspipe.runtime import safeload
from dspipe.runtime.ckpt_meta import CheckpointMeta
from dspipe.runtime.experts import EXPERT_FILE, expert_files, folded, holder_tp_rank, model_name, native_layer

MODEL_FILE = re.compile(r"^(?:zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt$")
OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
LAYER_FILE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
MP_RANK = re.compile(r"mp_rank_(\d+)_model_states\.pt$")
RNG_FILE = re.compile(r"^rng-rank(\d+)\.pt$")
OPTIMIZER_KEY = "optimizer_state_dict"  # deepspeed.checkpoint.constants.OPTIMIZER_STATE_DICT


def expected_files(meta: CheckpointMeta) -> list[str]:
    """The model-states and RNG files a checkpoint of this layout must hold (optimizer files: optimizer_ranks)."""
    mp, zero = _mp(meta), meta.dp * meta.sp
    if meta.zero_stage == 3:
        names = [f"zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt" for d in range(zero) for m in range(mp)]
    else:
        names = [f"mp_rank_{m:02d}_model_states.pt" for m in range(mp)]
    # ZeRO-3's and tp's experts: model tensors
    ep = getattr(meta, "ep", 1) or 1
    experts = bool(meta.model.get("experts")) and native_layer(zero_stage=meta.zero_stage, tp=meta.tp, ep=ep)
    if meta.pp > 1 and not experts:  # a pipeline of experts: DeepSpeed's MoE save writes each stage's module to
        names += layer_files(meta)  # its mp_rank file instead, and its experts' files (stage_expert_files)
    if experts and meta.pp == 1:
        names += expert_files(meta.model, ep=ep, tp=meta.tp)
    return names + [f"rng-rank{r}.pt" for r in range(meta.world_size)]


def stage_expert_files(module: dict, *, mp_rank: int, experts: int, ep: int = 1, tp: int = 1) -> list[str]:
    """The expert files a pipeline stage of a mixture of experts writes, from its model-states module (pipeline
    names): DeepSpeed numbers the stage's sparse blocks from 0 in layer order (their routers, under the gate's
    name) and names the files with the model-parallel rank of each expert's holder (at tp > 1, the stage's tp rank
    mp_rank % tp writes the experts it holds: holder_tp_rank)."""
    from dspipe.runtime.experts import GATE

    routers = [str(k).split(".", 1)[0] for k in module if str(k).endswith("mlp." + GATE)]
    blocks = sorted({int(r) for r in routers if r.isdigit()})  # another name: refused as not the model's, later
    return [
        f"layer_{j}_expert_{e}_mp_rank_{mp_rank:02d}_model_states.pt"
        for j in range(len(blocks))
        for e in range(experts)
        if holder_tp_rank(e, experts=experts, ep=ep, tp=tp) == mp_rank % tp
    ]


def layer_files(meta: CheckpointMeta) -> list[str]:
    """A pipeline checkpoint's layer files: every layer (embedding, blocks, final norm, an untied head; a tied head is
    the embedding, saved once) per tp rank."""
    model = meta.model
    count = model["layers"] + (2 if model.get("tied_embeddings", True) else 3)
    ranks = [""] if meta.tp == 1 else [f"-model_{r:02d}" for r in range(meta.tp)]
    return [f"layer_{i:02d}{rank}-model_states.pt" for i in range(count) for rank in ranks]


def _model_name(name: str, *, meta: CheckpointMeta) -> str:
    """The model's name of a tensor name in a model-states or expert file: a pipeline's layer index mapped to the
    GPT module, DeepSpeed's MoE names to the model's."""
    if meta.pp > 1:
        from dspipe.model.names import pipeline_gpt_name

        try:
            name = pipeline_gpt_name(name, layers=meta.model["layers"])
        except (ValueError, SpecError):
            pass  # not a pipeline name: reported as not a parameter of the model
    return model_name(name)


def _held_name(name: str, *, meta: CheckpointMeta, tp_rank: int | None) -> str:
    """The model's name of tp rank `tp_rank`'s tensor: with the experts spread over the tp group (ep = tp), its
    local expert J is expert tp_rank x E/tp + J (dspipe.runtime.experts.folded); any other name as it is."""
    experts = meta.model.get("experts") or 0
    if tp_rank is None or not experts or not folded(tp=meta.tp, ep=getattr(meta, "ep", 1) or 1):
        return name
    from dspipe.runtime.moe_reshard import global_expert_name

    return global_expert_name(name, ep_rank=tp_rank, local=experts // meta.tp)


def _mp(meta: CheckpointMeta) -> int:
    """Model-parallel ranks: DeepSpeed's mp_rank files (pipeline stages x tp ranks, or tp ranks at pp 1)."""
    return meta.pp * meta.tp


def _tp_rank_of(name: str, meta: CheckpointMeta) -> int | None:
    """The tp rank whose shards file `name` holds (None: not a per-rank file, or tp 1)."""
    if meta.tp == 1:
        return None
    if m := LAYER_FILE.match(name):
        return None if m.group(2) is None else int(m.group(2))
    if m := MP_RANK.search(name):
        return int(m.group(1)) % meta.tp
    return None


def check_checkpoint(path: Path, *, meta: CheckpointMeta) -> None:
    """Every file of checkpoint `path` (whose dspipe.json read_meta validated), as the module docstring says."""
    from dspipe.spec.core import from_dict
    from dspipe.spec.model import ModelSpec

    path = Path(path)
    present = {p.name for p in path.iterdir() if p.is_file()}
    missing = [name for name in expected_files(meta) if name not in present]
    missing += _missing_optimizer_files(present, meta)
    if missing:
        raise SpecError(
            f"checkpoint {path} is missing {', '.join(missing[:3])}"
            f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''} (dp {meta.dp}, pp "
            f"{meta.pp}, tp {meta.tp}, sp {meta.sp}, ZeRO-{meta.zero_stage} writes them)"
        )
    spec = from_dict(ModelSpec, meta.model)
    expected = dict(spec.model_tensors()) | dict(spec.model_buffers())
    seen: dict[str, tuple] = {}
    stage_experts: list[str] = []  # a pipeline of experts: the expert files its stages' modules say they wrote
    for name in sorted(present):
        file = path / name
        if MODEL_FILE.match(name):
            sd = _model_states(file, meta=meta)
            if isinstance(sd.get("module"), dict):
                if meta.pp > 1 and spec.experts and (m := MP_RANK.search(name)):
                    stage_experts += stage_expert_files(
                        sd["module"], mp_rank=int(m.group(1)), experts=spec.experts, ep=meta.ep or 1, tp=meta.tp
                    )
                module = {_model_name(str(k), meta=meta): v for k, v in sd["module"].items()}  # a router: the gate's
                tp_rank = _tp_rank_of(name, meta)
                _check_tensors(
                    file,
                    module,
                    expected=expected,
                    meta=meta,
                    prefix="",
                    extra=set(sd.get("buffer_names") or ()),
                    spec=spec,
                    tp_rank=tp_rank,
                )
                seen.update({_held_name(k, meta=meta, tp_rank=tp_rank): tuple(v.shape) for k, v in module.items()})
        elif m := EXPERT_FILE.match(name):
            seen.update(_expert_file(file, expert=int(m.group(2)), meta=meta, expected=expected))
        elif OPTIM_FILE.match(name):
            sd = safeload.load(file, mmap=True)
            if not isinstance(sd.get(OPTIMIZER_KEY), dict):
                raise SpecError(
                    f"{file}: {OPTIMIZER_KEY} must be a dict (the optimizer's partition), got "
                    f"{type(sd.get(OPTIMIZER_KEY)).__name__}"
                )
        elif m := LAYER_FILE.match(name):
            layers = _layer_file(file, index=int(m.group(1)), meta=meta, expected=expected, spec=spec)
            seen.update(layers)
        elif RNG_FILE.match(name):
            check_rng_state(safeload.load(file), source=file)
    missing = [f for f in stage_experts if f not in present]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise SpecError(
            f"checkpoint {path} is missing {', '.join(missing[:3])}{more} (the expert files of the sparse blocks "
            f"its stages' model states hold)"
        )
    if meta.zero_stage != 3 or meta.pp > 1:
        absent = [n for n in expected if n not in seen and n != "lm_head.weight"]
        if absent:
            raise SpecError(
                f"checkpoint {path} holds no weights for {', '.join(absent[:3])}"
                f"{' ...' if len(absent) > 3 else ''} of its model (dspipe.json model)"
            )


def _missing_optimizer_files(present: set[str], meta: CheckpointMeta) -> list[str]:
    """ZeRO 1-3: every (partition, model-parallel rank) file; ZeRO-0 (a bf16 pipeline's BF16_Optimizer writes
    them, fp32 and plain runs do not): all of them when there are any."""
    ranks = {(int(m.group(1)), int(m.group(2))) for name in present if (m := OPTIM_FILE.match(name))}
    if meta.zero_stage == 0 and not ranks:
        return []
    partitions = meta.dp * meta.sp
    return [
        f"zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt"
        for d in range(partitions)
        for m in range(_mp(meta))
        if (d, m) not in ranks
    ]


def _model_states(file: Path, *, meta: CheckpointMeta) -> dict:
    """A model-states file: its module (None under a pipeline, whose layer files hold it) and, when it holds one,
    the step dspipe saved with it."""
    sd = safeload.load(file, mmap=True)
    if "module" not in sd:
        raise SpecError(
            f"{file}: no 'module' key (keys: {', '.join(map(str, list(sd)[:6]))}): not DeepSpeed's model states"
        )
    if sd["module"] is not None and not isinstance(sd["module"], dict):
        raise SpecError(f"{file}: module must be a dict of tensors, got {type(sd['module']).__name__}")
    for key in ("optimizer", "lr_scheduler"):
        if sd.get(key) is not None and not isinstance(sd[key], dict):
            raise SpecError(f"{file}: {key} must be a dict, got {type(sd[key]).__name__}")
    step = sd.get("step")
    if isinstance(step, int) and not isinstance(step, bool) and step != meta.step:
        raise SpecError(
            f"{file} was saved at step {step}, but the checkpoint's dspipe.json is at step "
            f"{meta.step}: files of two checkpoints are mixed"
        )
    return sd


def _expert_file(file: Path, *, expert: int, meta: CheckpointMeta, expected: dict) -> dict[str, tuple]:
    """An expert file: expert `expert`'s tensors of one sparse block, under DeepSpeed's names with the global id."""
    state = safeload.load(file, mmap=True)
    if not isinstance(state, dict):
        raise SpecError(f"{file}: not a dict of tensors (DeepSpeed's expert file), got {type(state).__name__}")
    named = {_model_name(str(k), meta=meta): v for k, v in state.items()}
    other = [k for k in named if f".mlp.experts.{expert}." not in k]
    if other:
        raise SpecError(f"{file}: holds {other[0][:80]!r}, not expert {expert}'s tensors")
    _check_tensors(file, named, expected=expected, meta=meta, prefix="", extra=set())
    return {k: tuple(v.shape) for k, v in named.items()}


def _layer_file(file: Path, *, index: int, meta: CheckpointMeta, expected: dict, spec) -> dict[str, tuple]:
    from dspipe.model.names import layer_prefix

    layers, tp_rank = meta.model["layers"], _tp_rank_of(file.name, meta)
    if meta.pp == 1 or index > layers + 2:
        raise SpecError(
            f"{file}: pipeline layer {index} does not belong to this checkpoint (pp {meta.pp}, {layers} layers)"
        )
    if (meta.tp > 1) != (tp_rank is not None) or (tp_rank is not None and tp_rank >= meta.tp):
        writes = "layer_LL-model_RR-model_states.pt, RR < tp" if meta.tp > 1 else "layer_LL-model_states.pt"
        raise SpecError(
            f"{file}: a layer file of {'no tp rank' if tp_rank is None else f'tp rank {tp_rank}'} "
            f"does not belong to this checkpoint (tp {meta.tp} writes {writes})"
        )
    prefix = layer_prefix(index, layers=layers)
    state = safeload.load(file, mmap=True)
    _check_tensors(file, state, expected=expected, meta=meta, prefix=prefix, extra=set(), spec=spec, tp_rank=tp_rank)
    return {_held_name(prefix + k, meta=meta, tp_rank=tp_rank): tuple(v.shape) for k, v in state.items()}


def _check_tensors(
    file: Path,
    state: dict,
    *,
    expected: dict,
    meta: CheckpointMeta,
    prefix: str,
    extra: set,
    spec=None,
    tp_rank: int | None = None,
) -> None:
    """Names and shapes of a module's tensors against the model: every tensor a parameter of the model (or a
    buffer the file declares), of the model's shape; at tp > 1 the shape tp rank `tp_rank` holds
    (dspipe.model.tp_split: a sharded dimension cut by the layout, vocabulary rows possibly uneven); ZeRO-3 keeps
    empty placeholders, so there only the names."""
    import torch

    from dspipe.model.tp_split import shard_shape

    tp, zero3 = meta.tp, meta.zero_stage == 3
    for key, t in state.items():
        name = prefix + str(key)
        if not isinstance(key, str) or not isinstance(t, torch.Tensor):
            raise SpecError(f"{file}: {str(key)[:60]!r} holds a {type(t).__name__}, not a tensor")
        if name not in expected:
            if key in extra or name == "lm_head.weight":
                continue
            raise SpecError(
                f"{file}: {name[:80]!r} is not a parameter of the checkpoint's model (dspipe.json "
                f"model: {meta.model.get('layers')} layers, hidden {meta.model.get('hidden')})"
            )
        whole, have = tuple(expected[name]), tuple(t.shape)
        want = whole
        if tp > 1 and tp_rank is not None and spec is not None:
            try:
                want = shard_shape(name, whole, spec, rank=tp_rank, size=tp)
            except ValueError as e:
                raise SpecError(f"{file}: {e}") from None
        if zero3 or have == want:
            continue
        held = f", tp rank {tp_rank} of {tp} holds {list(want)} of it" if want != whole else ""
        raise SpecError(f"{file}: {name} has shape {list(have)}, the checkpoint's model has {list(whole)}{held}")


def check_rng_state(state: dict, *, source: Path) -> None:
    """An rng-rankR.pt state as dspipe.runtime.rng.rng_state writes it, tried on throwaway generators (so
    that restoring it cannot fail halfway)."""
    import random

    import numpy as np
    import torch

    for key in ("python", "numpy", "torch"):
        if key not in state:
            raise SpecError(f"{source}: missing {key!r} (the RNG streams dspipe saves per rank)")
    try:
        random.Random().setstate(state["python"])
        np.random.RandomState().set_state(state["numpy"])
        torch.Generator().set_state(state["torch"])
        for t in state.get("cuda") or []:
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
                raise TypeError("a CUDA generator state is a uint8 tensor")
    except (TypeError, ValueError, OverflowError, RuntimeError, IndexError, KeyError) as e:
        raise SpecError(f"{source}: not a valid RNG state: {' '.join(str(e).split())[:160]}") from None
