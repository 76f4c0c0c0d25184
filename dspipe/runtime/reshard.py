"""Resuming under another data-parallel size.

ZeRO-0 state is not partitioned (DeepSpeed loads it as is); ZeRO-1/2/3 optimizer state is partitioned by dp, which
DeepSpeed's plain load refuses, so rank 0 converts the checkpoint to a universal checkpoint
(deepspeed.checkpoint.ds_to_universal) in .universal-TAG/ and every rank loads that with load_universal; the copy is
deleted afterwards. Under ZeRO-3 each optimizer group's hyper-parameters are then put back as
saved (restore_group_hyperparameters). NVMe-offloaded state and pipelines are refused at a changed dp
(dp_change_refusal)."""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from dspipe.errors import SpecError
from dspipe.runtime.writefail import WriteFailures

UNIVERSAL_PREFIX = ".universal-"  # a resharding copy of a checkpoint, deleted once loaded
MOE_RESHARD = ("DeepSpeed's native MoE checkpoint cannot be re-partitioned (its expert files are per expert-parallel "
               "rank and ds_to_universal cannot convert them)")


def dp_change_refusal(*, meta: dict, zero_stage: int, pp: int, dp: int, offload: str, path: Path) -> str | None:
    """Why this checkpoint cannot be resumed at data-parallel size `dp` (None: it can; same dp always can).
    ZeRO-0 state is whole; ZeRO-1/2/3 go through a universal checkpoint. The rest DeepSpeed 0.19 cannot do:
    NVMe-offloaded optimizer state is copied back per rank as it was saved, and dspipe has not verified the
    universal conversion of a PipelineModule (tied embedding on two stages). A mixture-of-experts checkpoint
    (DeepSpeed's native MoE) under ZeRO-1/2 is refused at any other dp; under ZeRO-0 (ep 1) its state is whole too."""
    if meta["dp"] == dp or zero_stage == 0:
        return None
    if (meta.get("model") or {}).get("experts"):
        return MOE_RESHARD
    if offload == "nvme" or (Path(path) / "offloaded_tensors").is_dir():
        return "DeepSpeed restores NVMe-offloaded optimizer state only onto the ranks that saved it"
    if pp > 1:
        return "re-partitioning a pipeline checkpoint to another dp is not supported by dspipe"
    if meta.get("tp", 1) > 1 or meta.get("sp", 1) > 1:
        return ("re-partitioning a tensor- or sequence-parallel ZeRO checkpoint to another dp is not verified by "
                "dspipe (each tp rank's shards are partitioned separately)")
    return None


def to_universal(src: Path, out: Path) -> None:
    """Convert the DeepSpeed checkpoint directory `src` into a universal checkpoint at `out` (DeepSpeed's
    ds_to_universal, in this process: no worker pool inside a rank, its progress output swallowed)."""
    import argparse
    import io

    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(src), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        ds_to_universal.main(args)


def load_resharded(engine, path: Path, *, saved_dp: int, dp: int):
    """Collective: rank 0 converts `path` to .universal-TAG/TAG next to it, every rank loads that with
    DeepSpeed's load_universal (its optimizer re-partitions the fp32 weights and Adam moments for this dp),
    then the copy is deleted. Returns DeepSpeed's load path."""
    import torch.distributed as dist

    path = Path(path)
    root = path.parent / (UNIVERSAL_PREFIX + path.name)
    failures = WriteFailures()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
        try:
            to_universal(path, root / path.name)
        except Exception as e:  # any failure: agreed on below, then one SpecError on every rank
            failures.record(e)
    if failures.agreed():
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
        raise SpecError(f"cannot re-partition checkpoint {path} from dp {saved_dp} to dp {dp}: converting it to "
                        f"a universal checkpoint in {root} failed ({failures.detail or 'on rank 0'}); "
                        f"resume with dp {saved_dp}")
    config = engine._config  # what engine.load_universal_checkpoint() reads; only for this load
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        load_path, _ = engine.load_checkpoint(str(root), tag=path.name)
    finally:
        config.load_universal_checkpoint = before
    if engine.zero_optimization_stage() == 3:
        restore_group_hyperparameters(engine.optimizer, saved_groups=saved_param_groups(root / path.name))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return load_path


def saved_param_groups(universal: Path) -> list[dict]:
    """The optimizer's parameter groups (hyper-parameters) as a universal checkpoint holds them."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

    from dspipe.runtime.safeload import load

    source = Path(universal) / "zero" / "optimizer_state.pt"
    groups = (load(source).get(OPTIMIZER_STATE_DICT) or {}).get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise SpecError(f"{source}: no optimizer param_groups (a list of dicts) in {OPTIMIZER_STATE_DICT}")
    return groups


def restore_group_hyperparameters(optimizer, *, saved_groups: list[dict]) -> None:
    """DeepSpeed 0.19's ZeRO-3 universal load copies the first saved group's hyper-parameters into every group
    (stage3.py, load_hp_checkpoint_state_from_checkpoint_dir_stage3), which puts weight decay on biases and
    LayerNorms; give each group back its own, as saved (`params` stays DeepSpeed's)."""
    if len(saved_groups) != len(optimizer.param_groups):
        raise SpecError(f"the checkpoint has {len(saved_groups)} optimizer parameter groups, this run has "
                        f"{len(optimizer.param_groups)}: resume with the dp it was saved with")
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
