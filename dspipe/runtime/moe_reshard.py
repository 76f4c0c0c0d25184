"""Resuming a mixture of experts (DeepSpeed's native MoE layer, ZeRO-1/2) at another dp, ep or pipeline depth.

DeepSpeed 0.19.8's ds_to_universal merges each parameter's ZeRO fragments by name over the data-parallel ranks. A
native MoE layer names a rank's experts by their local index: at 4 experts and ep 2, `deepspeed_experts.0` is
expert 0 on ep rank 0 and expert 2 on ep rank 1, so the converter would concatenate two experts into one tensor.
dspipe writes the universal checkpoint of a mixture of experts itself (to_universal):

  every parameter whole   its fp32 master weights, exp_avg and exp_avg_sq put together from the fragments
                          (param_slice_mappings) of the ranks that partition it, in their order: a dense group's
                          over the dp ranks, an expert group's over its expert-data-parallel ranks (the dp ranks
                          with the same ep rank: dp index mod ep, deepspeed.utils.groups' layout); each
                          pipeline stage's from its own files (a tied embedding from the first stage)
  experts                 under their global index (ep rank x experts / ep + local index)
  zero/optimizer_state.pt the optimizer's global state and hyper-parameters (ds_to_universal's), the expert groups
                          named for the ep of the run that loads it
  mp_rank_SS_model_states the engine's own state (step, scheduler), copied

and the load (global_expert_names) lets each rank's optimizer look its local experts up under their global names,
so that DeepSpeed's load_universal cuts every rank its own experts' weights and moments for the new dp and ep (at
another pipeline depth dspipe.runtime.reshard renames the parameters first, as for a dense model). A universal load
restores parameters only: the selection biases of auxiliary-loss-free routing (buffers) are put back from the saved
module (restore_buffers). Measured: docs/howto/moe.md, dspipe.runtime.reshard.layout_change_refusal."""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path

from dspipe.errors import SpecError
from dspipe.runtime.experts import ep_rank_of, ep_span

EXPERT_INDEX = re.compile(r"(\.deepspeed_experts\.|\.mlp\.experts\.)(\d+)(\.)")
"""A local expert index in a parameter name: DeepSpeed's MoE layer's, or the model's own experts' at ep > 1 under
ZeRO-3 (dspipe.runtime.moe.spread_experts)."""
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_SHARDED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def global_expert_name(name: str, *, ep_rank: int, local: int) -> str:
    """A rank's parameter name with its local expert index (deepspeed_experts.I., or mlp.experts.I. at ep > 1)
    made global: ep_rank x local + I; any other name as it is."""
    return EXPERT_INDEX.sub(lambda m: f"{m[1]}{ep_rank * local + int(m[2])}{m[3]}", name, count=1)


def _optim_files(src: Path) -> list[list[Path]]:
    """The checkpoint's ZeRO-1/2 optimizer files: per model-parallel rank (a pipeline stage x tp + tp rank), its dp
    ranks' in dp order."""
    found = {}
    for f in Path(src).iterdir():
        m = _OPTIM_FILE.match(f.name)
        if m:
            found.setdefault(int(m[2]), {})[int(m[1])] = f
    stages = sorted(found)
    if not stages or stages != list(range(len(stages))):
        raise SpecError(f"{src}: optimizer files for model-parallel ranks {stages}, expected 0..{len(stages) - 1}")
    dp = len(found[0])
    for stage in stages:
        if sorted(found[stage]) != list(range(dp)):
            raise SpecError(
                f"{src}: optimizer files for dp ranks {sorted(found[stage])} of model-parallel rank {stage}, "
                f"expected 0..{dp - 1}"
            )
    return [[found[stage][d] for d in range(dp)] for stage in stages]


def to_universal(
    src: Path, out: Path, *, experts: int, ep: int, ep_now: int, tp: int = 1, info: dict | None = None
) -> None:
    """Write the universal checkpoint of the native-MoE ZeRO-1/2 checkpoint `src` (saved at `ep`) to `out`: see the
    module's docstring; `ep_now`, the ep of the run that will load it. Each pipeline stage's parameters from its own
    files (names are unique over the stages; a tied embedding is taken from the first stage that holds it). Reads
    each rank's file memory-mapped and holds one parameter's states at a time. At tp > 1 (ep = tp x k: the
    experts over k whole tp groups, dspipe.runtime.experts.beyond_tp) each expert is whole on its holder, written
    as at tp 1; each other parameter is put together over dp on every tp rank, then its tp shards merged by
    DeepSpeed's merge_tp_slices with `info` (reshard.universal_checkpoint_info's patterns for the dense parts, the
    router and shared experts replicated), which a universal load cuts again for each tp rank."""
    import torch

    from dspipe.runtime.safeload import load

    src, out = Path(src), Path(out)
    zero = out / "zero"
    written: set[str] = set()
    by_mp = _optim_files(src)
    if len(by_mp) % tp:
        raise SpecError(f"{src}: {len(by_mp)} model-parallel ranks (its optimizer files) do not divide by tp {tp}")
    spread = ep_span(tp=tp, ep=ep)
    for stage in range(len(by_mp) // tp):
        held = []  # per tp rank: its dp ranks' optimizer states (memory-mapped), their fragments, its shapes
        for r in range(tp):
            mp, files = stage * tp + r, by_mp[stage * tp + r]
            if len(files) % spread:
                over = f"ep {ep}" if tp == 1 else f"ep {ep} / tp {tp} = {spread}"
                raise SpecError(f"{src}: dp {len(files)} (its optimizer files) is not divisible by {over}")
            shapes = {}
            for group in load(src / f"mp_rank_{mp:02d}_model_states.pt", mmap=True)["param_shapes"]:
                shapes.update(group)
            ranks = [load(f, mmap=True)["optimizer_state_dict"] for f in files]
            where = _fragments(ranks, files=files, ep=ep, tp=tp, tp_rank=r, local=experts // ep)
            held.append((ranks, where, shapes))
            if mp == 0:
                first = ranks[0]
                saved = {k: v for k, v in first.items() if k not in _SHARDED}
                saved["param_groups"] = [
                    {**group, "name": f"ep_size_{ep_now}"} if group.get("moe") else dict(group)
                    for group in first["base_optimizer_state"]["param_groups"]
                ]
                zero.mkdir(parents=True, exist_ok=True)
                torch.save(saved, zero / "optimizer_state.pt")
        for r, (ranks, where, shapes) in enumerate(held):
            for key, (moe, pieces) in where.items():
                if key in written or not (tp == 1 or moe or r == 0):
                    continue
                if tp == 1 or moe:  # whole on its holder
                    _write_parameter(zero / key, pieces=pieces, ranks=ranks, shape=shapes.get(pieces[0][2]), src=src)
                else:  # a tp shard on every tp rank of the stage: merged one parameter at a time
                    _merge_tp(
                        zero,
                        key=key,
                        per_rank=_tp_shards(key, held=held, src=src, stage=stage),
                        info=info or {},
                        scratch=out / ".slices",
                    )
                written.add(key)
        unmerged = sorted({key for _, where, _ in held for key in where} - written)
        if unmerged:  # a tp shard of a tp rank > 0 that tp rank 0 does not hold
            raise SpecError(f"{src}: {unmerged[0]} is held by some of the {tp} tp ranks of stage {stage}, not all")
    shutil.rmtree(out / ".slices", ignore_errors=True)
    for f in src.glob("mp_rank_*_model_states.pt"):  # what the engine reads besides zero/: step, scheduler, ...
        shutil.copy2(f, out / f.name)


def _fragments(ranks: list[dict], *, files: list[Path], ep: int, tp: int, tp_rank: int, local: int) -> dict:
    """{global name: (an expert's, [(dp rank, group, the rank's name, fragment address)] in dp order)} over one
    model-parallel rank's dp ranks (dp rank d's ep rank: dspipe.runtime.experts.ep_rank_of)."""
    dp, spread = len(ranks), ep_span(tp=tp, ep=ep)
    where: dict[str, tuple] = {}
    for d, osd in enumerate(ranks):
        groups = osd["base_optimizer_state"]["param_groups"]
        ep_rank = ep_rank_of(dp_rank=d, tp_rank=tp_rank, tp=tp, ep=ep)
        for g, mapping in enumerate(osd["param_slice_mappings"]):
            moe = bool(groups[g].get("moe"))
            if moe and osd["partition_count"][g] != dp // spread:
                over = f"ep {spread}" if tp == 1 else f"(ep / tp) {spread}"
                raise SpecError(
                    f"{files[d]}: expert group {g} is partitioned over {osd['partition_count'][g]} ranks, "
                    f"expected dp {dp} / {over} = {dp // spread}"
                )
            for name, fragment in mapping.items():
                key = global_expert_name(name, ep_rank=ep_rank, local=local) if moe else name
                where.setdefault(key, (moe, []))[1].append((d, g, name, fragment))
    return where


def _tp_shards(key: str, *, held: list, src: Path, stage: int) -> list:
    """One dense parameter's (shape, whole-over-dp states) on each tp rank of a stage (held: to_universal's)."""
    out = []
    for ranks, where, shapes in held:
        if key not in where:
            raise SpecError(f"{src}: {key} is held by some of the {len(held)} tp ranks of stage {stage}, not all")
        _, pieces = where[key]
        shape = shapes.get(pieces[0][2])
        _check_numel(key, pieces=pieces, shape=shape, src=src)
        states = {st: _gathered(ranks, pieces, st) for st in STATES}
        states["step"] = _step(ranks, pieces)
        out.append((shape, states))
    return out


def _check_numel(key: str, *, pieces: list, shape, src: Path) -> None:
    import torch

    numel = sum(f.numel for *_, f in pieces)
    if shape is None or numel != torch.Size(shape).numel():
        raise SpecError(
            f"{src}: the fragments of {key} hold {numel} values, its shape {tuple(shape or ())} has "
            f"{torch.Size(shape or ()).numel()}"
        )


def _gathered(ranks: list[dict], pieces: list, state: str):
    """One parameter's `state` put together from its fragments, flat."""
    import torch

    return torch.cat([_flat(ranks[d], g, state).narrow(0, f.start, f.numel) for d, g, _, f in pieces]).clone()


def _step(ranks: list[dict], pieces: list):
    d, g, *_ = pieces[0]
    return ranks[d]["base_optimizer_state"]["state"][g].get("step")


def _merge_tp(zero: Path, *, key: str, per_rank: list, info: dict, scratch: Path) -> None:
    """One parameter's tp shards (per tp rank: its shape and whole-over-dp states) merged into zero/KEY by
    DeepSpeed's merge_tp_slices (its slice layout: KEY/RANK/STATE.DP), with the layout's universal info."""
    import torch
    from deepspeed.checkpoint.ds_to_universal import merge_tp_slices

    for r, (_, states) in enumerate(per_rank):
        folder = scratch / key / str(r)
        folder.mkdir(parents=True, exist_ok=True)
        for state, value in states.items():
            if value is not None:
                torch.save(value, folder / f"{state}.00")
    (zero / key).mkdir(parents=True, exist_ok=True)
    merge_tp_slices(info, str(zero), str(scratch), len(per_rank), (key, [shape for shape, _ in per_rank]))
    shutil.rmtree(scratch / key, ignore_errors=True)


def _write_parameter(folder: Path, *, pieces: list, ranks: list[dict], shape, src: Path) -> None:
    """One parameter's fp32 weights, exp_avg, exp_avg_sq (whole, in its shape) and step into `folder`."""
    import torch
    from deepspeed.checkpoint.constants import PARAM

    _check_numel(folder.name, pieces=pieces, shape=shape, src=src)
    folder.mkdir(parents=True, exist_ok=True)
    for state in STATES:
        torch.save({PARAM: _gathered(ranks, pieces, state).view(shape)}, folder / f"{state}.pt")
    step = _step(ranks, pieces)
    if step is not None:
        torch.save(step, folder / "step.pt")


def _flat(osd: dict, group: int, state: str):
    """One rank's flat partition of `state` (fp32 master, exp_avg, exp_avg_sq) in optimizer group `group`."""
    if state == "fp32":
        return osd["single_partition_of_fp32_groups"][group]
    return osd["base_optimizer_state"]["state"][group][state]


def engine_ep(engine) -> int:
    """The live engine's expert-parallel size (1 without sparse blocks): dspipe.runtime.moe.live_ep."""
    from dspipe.runtime.moe import live_ep

    return live_ep(engine.module)


@contextlib.contextmanager
def global_expert_names(engine, *, experts: int):
    """While loading a universal checkpoint: this rank's optimizer knows its experts' parameters by their global
    names (the universal checkpoint's folders), every other parameter by its own."""
    from deepspeed.utils import groups

    optimizer = engine.optimizer
    before = optimizer.param_names
    ep = engine_ep(engine)
    ep_rank = groups._get_expert_parallel_rank(f"ep_size_{ep}") if ep > 1 else 0
    renamed = dict(before)
    for param, name in before.items():
        renamed[param] = global_expert_name(name, ep_rank=ep_rank, local=experts // ep)
    optimizer.param_names = renamed
    try:
        yield
    finally:
        optimizer.param_names = before


def restore_buffers(engine, path: Path, *, rename=None) -> list[str]:
    """Copy the module's persistent buffers (routers' selection biases) from checkpoint `path`'s model states (every
    stage's mp_rank_SS_model_states.pt, ZeRO-3's zero_pp_rank_0_mp_rank_00_model_states.pt; `rename`: saved name ->
    this run's, at another pipeline depth) into the live module; returns their names. A universal load restores
    parameters only."""
    import torch

    from dspipe.runtime.safeload import load

    saved = {}
    files = [
        *Path(path).glob("mp_rank_*_model_states.pt"),
        *Path(path).glob("zero_pp_rank_0_mp_rank_*_model_states.pt"),
    ]
    for f in sorted(files):
        for name, value in (load(f, mmap=True).get("module") or {}).items():
            saved[rename(name) if rename else name] = value
    names = []
    with torch.no_grad():
        for name, buffer in engine.module.named_buffers():
            if name in saved:
                buffer.copy_(saved[name].to(buffer.device, buffer.dtype))
                names.append(name)
    return names
