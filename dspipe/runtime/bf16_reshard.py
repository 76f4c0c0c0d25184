"""A bf16 pipeline without ZeRO resumed at another data-parallel size.

There DeepSpeed 0.19.8 trains with its BF16_Optimizer (dspipe.planner.plan.Plan.bf16_optimizer), which partitions
the fp32 master weights and Adam's moments over the dp ranks like ZeRO-1 and saves each rank's partition in
bf16_zero_pp_rank_D_mp_rank_S_optim_states.pt. DeepSpeed loads those files only at the dp they were saved with, and
its universal converter (ds_to_universal) refuses them: the model-states files carry no param_shapes outside ZeRO.

So dspipe converts them itself, stage by stage: the first data-parallel rank of each pipeline stage puts its
stage's parameters back together (each rank's fragment of a parameter, in rank order: param_slice_mappings) into a
universal checkpoint of its own (.universal-TAG/stage-S/zero/NAME/{fp32,exp_avg,exp_avg_sq,step}.pt and
zero/optimizer_state.pt), shaped as its module's parameters, and every rank of the stage loads its new partition
from it through the optimizer's own universal reader. The weights, the lr schedule and the counters come from the
checkpoint's model-states files, which do not depend on dp. Only dp may change (reshard.layout_change_refusal).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dspipe.errors import SpecError
from dspipe.runtime.reshard import UNIVERSAL_PREFIX
from dspipe.runtime.writefail import WriteFailures

STATES = ("exp_avg", "exp_avg_sq")


def partition_file(path: Path, *, dp_rank: int, stage: int) -> Path:
    return Path(path) / f"bf16_zero_pp_rank_{dp_rank}_mp_rank_{stage:02d}_optim_states.pt"


def stage_to_universal(path: Path, out: Path, *, stage: int, saved_dp: int, shapes: dict) -> None:
    """Write the universal checkpoint of pipeline stage `stage` of checkpoint `path` (saved by `saved_dp` ranks) to
    `out`: every parameter of `shapes` ({name: shape}, the stage module's) whole, its fp32 weights and Adam moments,
    the optimizer's step and parameter groups."""
    import torch
    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE,
        OPTIMIZER_STATE_DICT,
        PARAM,
        PARAM_SLICE_MAPPINGS,
        SINGLE_PARTITION_OF_FP32_GROUPS,
    )

    from dspipe.runtime.safeload import load

    pieces: dict[str, dict[str, list]] = {}
    steps, groups = set(), None
    for d in range(saved_dp):
        source = partition_file(path, dp_rank=d, stage=stage)
        sd = load(source, mmap=True)[OPTIMIZER_STATE_DICT]
        base = sd[BASE_OPTIMIZER_STATE]
        groups = groups or base["param_groups"]
        flats = sd[SINGLE_PARTITION_OF_FP32_GROUPS]
        for i, (flat, mapping) in enumerate(zip(flats, sd[PARAM_SLICE_MAPPINGS], strict=True)):
            state = base["state"].get(i, {})
            if "step" in state:
                steps.add(int(state["step"]))
            for name, frag in mapping.items():
                cut = {"fp32": flat.narrow(0, frag.start, frag.numel)}
                for key in STATES:
                    if key not in state:
                        raise SpecError(f"{source}: no Adam {key} for optimizer group {i}")
                    cut[key] = state[key].narrow(0, frag.start, frag.numel)
                for key, t in cut.items():
                    pieces.setdefault(name, {}).setdefault(key, []).append(t.float())
    if set(pieces) != set(shapes):
        missing, extra = sorted(set(shapes) - set(pieces)), sorted(set(pieces) - set(shapes))
        raise SpecError(
            f"{path}: stage {stage}'s optimizer partitions hold parameters {extra[:3]} the run's stage does not "
            f"and lack {missing[:3]}"
        )
    if len(steps) > 1:
        raise SpecError(f"{path}: stage {stage}'s optimizer partitions were saved at different steps {sorted(steps)}")
    zero = Path(out) / "zero"
    for name, by_key in pieces.items():
        folder = zero / name
        folder.mkdir(parents=True, exist_ok=True)
        numel = 1
        for n in shapes[name]:
            numel *= n
        for key, parts in by_key.items():
            whole = torch.cat(parts)
            if whole.numel() != numel:
                raise SpecError(
                    f"{path}: {name} has {whole.numel()} values in its optimizer partitions, the run's "
                    f"parameter {tuple(shapes[name])} has {numel}"
                )
            torch.save({PARAM: whole.view(shapes[name]).clone()}, folder / f"{key}.pt")
        if steps:
            torch.save(next(iter(steps)), folder / "step.pt")
    torch.save({"param_groups": groups}, zero / "optimizer_state.pt")


def load(engine, path: Path, *, saved_dp: int):
    """Collective: the checkpoint `path` (saved at `saved_dp`) into this BF16_Optimizer engine at its own dp: the
    weights, lr schedule and counters through DeepSpeed's load without the optimizer, then each stage's universal
    copy (made by the stage's first data-parallel rank) through the optimizer's universal reader; the copy is
    deleted. Returns DeepSpeed's load path."""
    import torch.distributed as dist

    path = Path(path)
    load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=False)
    if load_path is None:
        return None
    stage = engine.stage_id if hasattr(engine, "stage_id") else 0
    root = path.parent / (UNIVERSAL_PREFIX + path.name)
    folder = root / f"stage-{stage}"
    failures = WriteFailures()
    if engine.mpu.get_data_parallel_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
        try:
            shapes = {name: tuple(p.shape) for name, p in engine.module.named_parameters()}
            stage_to_universal(path, folder, stage=stage, saved_dp=saved_dp, shapes=shapes)
        except Exception as e:  # any failure: agreed on below, then one SpecError on every rank
            failures.record(e)
    if failures.agreed():
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
        dp = engine.mpu.get_data_parallel_world_size()
        raise SpecError(
            f"cannot re-partition checkpoint {path} from dp {saved_dp} to dp {dp}: converting its BF16_Optimizer "
            f"partitions in {root} failed ({failures.detail or 'on one rank'}); resume with dp {saved_dp}"
        )
    engine.optimizer.load_state_dict(
        state_dict_list=None, checkpoint_folder=str(folder), load_optimizer_states=True, load_from_fp32_weights=True
    )
    engine.optimizer.update_lp_params()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return load_path
