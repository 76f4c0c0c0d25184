"""What one DeepSpeed checkpoint of a plan takes on disk: every rank's files together, and the most one rank writes
(its save time is the checkpoint's: every rank waits for the slowest). No torch.

DeepSpeed 0.19.8's files (dspipe.runtime.ckptfiles names them), per tensor-parallel x pipeline position (mp rank),
each of its ranks holding P parameters (planner.stages.stage_params), weights of w bytes (2 in bf16/fp16, 4 in fp32),
Z ranks in its ZeRO group (dp x sp; planner.stages.param_groups: the experts' own, smaller group under MoE):
  ZeRO 0     one model-states file, written by the group's first rank: the weights and the optimizer's whole
             state, w P + 8 P in fp32 (Adam's two moments) or w P + 12 P in 16-bit (the fp32 master copy too)
  ZeRO 1-2   the model-states file (w P, the group's first rank) and one optimizer file per rank: the rank's
             fp32 partition of the master copy and both moments, 12 P / Z
  MoE        DeepSpeed's native layer at ep > 1 (ZeRO 1-2, tp 1): each expert-parallel rank also writes its own
             E / ep experts' weights (layer_L_expert_E_*), w x its routed-expert parameters
  ZeRO 3     the optimizer files alone (12 P / Z each; the model-states files hold no weights: ~18 KB)
  bf16 ZeRO 0 in a pipeline (DeepSpeed's BF16_Optimizer, partitioned like ZeRO-1): ZeRO-1's files, and the
             group's first rank writes its own partition's state a second time into the model-states file
             (the engine saves the optimizer's state_dict there whenever ZeRO is off)
A pipeline saves its weights as one file per layer, a tied embedding once, but the optimizer of both stages that
hold the tie (first and last) keeps its state: stage_params counts it on both, as the files do. Measured
(2026-11-27, 2 CPU ranks, a 2.64M-parameter GPT, every layout above: ZeRO 0-3 in fp32 and bf16, pp 2, tp 2): each
file within 12 KB of these sizes (pickle headers and the lr schedule's counters); the per-rank RNG state (~14 KB)
and dspipe.json (~7 KB) are left out. The write time assumes startup.DISK_GBPS per node (a local NVMe drive or a
node's share of a parallel file system), as the start-up's read of an imported checkpoint does.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dspipe.planner.plan import Plan
from dspipe.planner.stages import param_groups, stage_experts, stage_params, vocab_table_per_rank, zero_group_size
from dspipe.planner.startup import DISK_GBPS
from dspipe.runtime.experts import native_layer
from dspipe.runtime.progress import duration
from dspipe.spec.dtypes import dtype_bytes
from dspipe.spec.hardware import GPU_MTBF_HOURS
from dspipe.spec.kinds import Precision
from dspipe.spec.model import ModelSpec

OPTIMIZER_BYTES = 12
"""Adam in mixed precision, per parameter: the fp32 master copy and the two fp32 moments."""


@dataclass(frozen=True)
class CheckpointSize:
    bytes: int
    """One checkpoint: every rank's files."""
    rank_max_bytes: int
    """The most one rank writes (the group's first rank: the weights and its optimizer partition)."""
    files_per_rank_max: int
    """Files that rank writes (model states, optimizer partition), without its RNG state."""
    node_max_bytes: int = 0
    """The most one node writes, bounded by its ranks x rank_max_bytes (and by the whole checkpoint)."""
    write_s: float = 0.0
    """node_max_bytes at DISK_GBPS: the seconds a save's files take to reach the disk (the step waits for them
    with --sync-save; with background writes the next save does, if it comes sooner)."""
    disk_gbps: float = DISK_GBPS

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def checkpoint_size(*, model: ModelSpec, plan: Plan, ranks_per_node: int) -> CheckpointSize:
    """The plan's checkpoint on disk (module docstring: DeepSpeed 0.19.8's files), and its write time on a node of
    `ranks_per_node` ranks."""
    weight = dtype_bytes(plan.precision)
    groups = zero_group_size(plan)
    total = rank_max = 0
    files = 0
    held_by_stage = stage_params(
        model=model, pp=plan.pp, partition_method=plan.partition_method, tp=plan.tp, ep=plan.ep
    )
    # DeepSpeed's native MoE layer at ep > 1: every expert-parallel rank writes its own experts' weight files
    # (layer_L_expert_E_*), not only the group's first rank
    expert_writers = (
        plan.ep - 1 if model.experts and native_layer(zero_stage=plan.zero_stage, tp=plan.tp, ep=plan.ep) else 0
    )
    experts_by_stage = stage_experts(
        model=model, pp=plan.pp, partition_method=plan.partition_method, tp=plan.tp, ep=plan.ep
    )
    for stage, held in enumerate(held_by_stage):
        # a pipeline's tied embedding: its weights saved once (the first stage's layer file), its state on both
        stored = held - (
            vocab_table_per_rank(model, plan.tp)
            if plan.pp > 1 and model.tied_embeddings and stage == len(held_by_stage) - 1
            else 0
        )
        if plan.zero_stage == 0 and not plan.bf16_optimizer:  # the group's first rank: weights, whole optimizer
            first = stored * weight + held * (8 if plan.precision == Precision.FP32 else OPTIMIZER_BYTES)
            per_rank, count = 0, 1
        else:
            first = 0 if plan.zero_stage == 3 else stored * weight
            parts = param_groups(model=model, plan=plan, phi=held)  # (parameters, ranks they are split over)
            per_rank = sum(-(-p * OPTIMIZER_BYTES // n) for p, n in parts)
            count = 1 if plan.zero_stage == 3 else 2
            if plan.zero_stage == 0:  # BF16_Optimizer without ZeRO: its partition's state again in model states
                first += per_rank
        total += plan.tp * (first + groups * per_rank) + expert_writers * experts_by_stage[stage] * weight
        if first + per_rank > rank_max:
            rank_max, files = first + per_rank, count
    node = min(total, rank_max * min(ranks_per_node, plan.world_size))
    return CheckpointSize(
        bytes=total,
        rank_max_bytes=rank_max,
        files_per_rank_max=files,
        node_max_bytes=node,
        write_s=node / (DISK_GBPS * 1e9),
    )


def milestones(*, steps: int, keep_every: int) -> int:
    """Checkpoints --keep-every keeps for good over `steps` (every multiple of keep_every; 0 without)."""
    return steps // keep_every if keep_every else 0


def disk_bytes(*, size: CheckpointSize, keep: int, kept_for_good: int) -> int:
    """The most the checkpoint directory holds: the newest `keep`, the one being written, and the milestones (an
    upper bound: a milestone among the newest counts twice)."""
    return (keep + 1 + kept_for_good) * size.bytes


def disk_text(*, size: CheckpointSize, keep: int, kept_for_good: int) -> str:
    """'(keep 3 + 1 being written + 2 milestones) x 2.4 GiB = 14.6 GiB'."""
    from dspipe.planner.startup import size_text

    more = f" + {kept_for_good} milestones" if kept_for_good else ""
    return (
        f"(keep {keep} + 1 being written{more}) x {size_text(size.bytes)} = "
        f"{size_text(disk_bytes(size=size, keep=keep, kept_for_good=kept_for_good))}"
    )


def check_disk(*, size: CheckpointSize, keep: int, kept_for_good: int, free: int, held: int, where: str) -> None:
    """Refuse (SpecError, one line) when the checkpoints still to come cannot fit: `free` bytes on the directory's
    filesystem plus the `held` bytes of the checkpoints already there (they rotate out)."""
    from dspipe.errors import SpecError
    from dspipe.planner.startup import size_text

    need = disk_bytes(size=size, keep=keep, kept_for_good=kept_for_good)
    if need > free + held:
        raise SpecError(
            f"checkpoints need {disk_text(size=size, keep=keep, kept_for_good=kept_for_good)} in "
            f"{where}, which has {size_text(free)} free + {size_text(held)} of checkpoints already = "
            f"{size_text(free + held)}: lower --keep-checkpoints / --keep-every, or free space"
        )


ASYNC_DRAG = 0.15
"""The share of a background write's duration that the steps it overlaps lose (the writer process competes for the
host's memory bandwidth and cores): an assumption of the order benchmarks/async_checkpoint.py measured on CPU ranks
(a step during a save 1.09-1.19x a clean one, README)."""


@dataclass(frozen=True)
class SaveInterval:
    """Young's optimal checkpoint interval for one save's cost (the training time it costs: save_cost_s) and the
    job's failure rate, in steps."""

    steps: int
    young_s: float
    """sqrt(2 x cost_s x mtbf_s)."""
    mtbf_s: float
    """The job's mean time between failures: gpu_mtbf_hours x 3600 / world."""
    floor: int
    """The fewest steps between saves: with background writes a write's length in steps (the next save would wait
    for it), else 1."""


def save_interval(
    *, cost_s: float, write_s: float, step_time_s: float, world: int, steps: int, async_save: bool, mtbf_hours: float
) -> SaveInterval:
    """Young's interval sqrt(2 x C x M) (C: `cost_s`, the training time one save costs; M: `mtbf_hours` x 3600 /
    `world`) in steps of `step_time_s`: with background writes never shorter than a write (`write_s`), always in
    1..`steps`. The planner calls it with the planned figures, the runner with each save's measured ones."""
    mtbf_s = mtbf_hours * 3600 / max(1, world)
    young_s = math.sqrt(2 * max(cost_s, 1e-6) * mtbf_s)
    step_s = max(step_time_s, 1e-9)
    floor = max(1, math.ceil(write_s / step_s)) if async_save else 1
    n = min(max(1, steps), max(floor, round(young_s / step_s)))
    return SaveInterval(steps=n, young_s=young_s, mtbf_s=mtbf_s, floor=floor)


def save_cost_s(*, blocking_s: float, write_s: float, async_save: bool) -> float:
    """The training time one save costs: the time the step waited for it (the whole write with --sync-save; the
    copy to host memory with background writes) plus, with background writes, ASYNC_DRAG of the write."""
    return blocking_s + (ASYNC_DRAG * write_s if async_save else 0.0)


def auto_save_interval(
    *,
    checkpoint: CheckpointSize,
    step_time_s: float,
    world: int,
    steps: int,
    async_save: bool,
    host_copy_gbps: float,
    mtbf_hours: float = GPU_MTBF_HOURS,
) -> tuple[int, str]:
    """(--save-interval auto's steps, the line that explains them): save_interval on the plan's figures (the
    planned write at DISK_GBPS; with background writes the copy of the largest rank's state at `host_copy_gbps`)."""
    blocking = checkpoint.rank_max_bytes / (host_copy_gbps * 1e9) if async_save else checkpoint.write_s
    cost_s = save_cost_s(blocking_s=blocking, write_s=checkpoint.write_s, async_save=async_save)
    got = save_interval(
        cost_s=cost_s,
        write_s=checkpoint.write_s,
        step_time_s=step_time_s,
        world=world,
        steps=steps,
        async_save=async_save,
        mtbf_hours=mtbf_hours,
    )
    n = got.steps
    what = "the write" if not async_save else f"the copy to host memory + {ASYNC_DRAG:g} x the background write"
    line = (
        f"--save-interval auto: {n:,} steps ({span(n * step_time_s)}): Young's sqrt(2 x {cost_s:.3g} s per "
        f"save ({what}) x {span(got.mtbf_s)} between failures) = {span(got.young_s)}; failures at "
        f"{mtbf_hours:,g} GPU-hours per GPU{RATE_SOURCE if mtbf_hours == GPU_MTBF_HOURS else ''} over "
        f"{world:,} GPUs"
    )
    if n == got.floor and got.floor > 1:
        line += f"; no shorter than a write ({checkpoint.write_s:.3g} s)"
    if n == steps:
        line += "; the run is shorter: checkpoints at the end (and on SIGTERM) only"
    return n, line + ("; the run re-plans it from each save's measured time" if n < steps else "")


def span(seconds: float) -> str:
    """'0.0461 s', '42.4 s', '28m09s', '2d01h': a time for the interval lines (seconds to 3 digits below a
    minute, where progress.duration would round a small one to 0s)."""
    return f"{seconds:.3g} s" if seconds < 60 else duration(seconds)


RATE_SOURCE = " (Llama 3's rate; --gpu-mtbf-hours sets yours)"
