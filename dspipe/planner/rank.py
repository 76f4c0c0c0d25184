"""Ordering the fitting candidates: fastest first, plans within TIE of the fastest broken by the practitioners'
order (preference), and the sentence that says why the tie-break chose. No torch."""

from __future__ import annotations

from dataclasses import dataclass

from dspipe.planner.enumerate import TIE, Candidate
from dspipe.spec.hardware import GIB

ROOMY = 0.80
"""Fraction of the GPU's memory above which a plan loses every tie to one that stays under it: allocator
fragmentation and what the model does not count bite first near the edge."""
GEMM_TOKENS = 4096
"""Tokens per micro-batch (the M of every weight GEMM) below which a larger micro-batch is preferred among ties:
the time model does not charge small matrix multiplies their lower efficiency; beyond it the smaller memory wins."""
_PREC_ORDER = {"bf16": 0, "fp16": 1, "fp32": 2}
_OFFLOAD_ORDER = {"none": 0, "cpu": 1, "nvme": 2}
_PREFERENCE_WHY = (
    "the roomier plan",
    "bf16 before fp16 before fp32",
    "the lower ZeRO stage",
    "no offload",
    "optimizer-only offload",
    "less recomputation",
    "fewer pipeline stages",
    "less tensor parallelism",
    "less sequence parallelism",
    "the larger micro-batch (up to 4,096 tokens per micro-batch)",
    "the smaller memory footprint",
)


@dataclass(frozen=True)
class Ranking:
    best: Candidate | None
    ranked: list[Candidate]
    """Fitting candidates, the chosen one first, then fastest first."""
    tie: str
    """When several plans tied (within 2% of the fastest): how many, and why the tie-break chose this one."""


def preference(c: Candidate) -> tuple[bool, int, int, int, bool, int, int, int, int, int, int]:
    """The tie-break among plans within 2% of the fastest: the seed recipe (bf16, lowest ZeRO stage, no offload,
    less recomputation (full is the only kind it chooses), fewer pipeline stages, less tensor then sequence
    parallelism), then a larger micro-batch while it has fewer than GEMM_TOKENS tokens, then the smaller memory
    footprint (a roomier plan over one near the edge of the GPU's memory). Before all of these: a plan over ROOMY of
    the GPU's memory loses to one under it."""
    # full recomputation of fewer blocks per stage (Megatron's block method) is less recomputation than of all
    ckpt = {"none": 0, "selective": 1, "full": 2}[c.plan.checkpointing] - (c.plan.recompute_blocks > 0)
    seq_len = c.plan.tokens_per_step // c.plan.global_batch
    return (
        c.est.memory.total > ROOMY * c.est.gpu_memory_bytes,
        _PREC_ORDER[c.plan.precision],
        c.plan.zero_stage,
        _OFFLOAD_ORDER[c.plan.offload],
        c.plan.offload_params,
        ckpt,
        c.plan.pp,
        c.plan.tp,
        c.plan.sp,
        -min(c.plan.micro_batch * seq_len, GEMM_TOKENS),
        c.est.memory.total,
    )


def tie_reason(winner: Candidate, loser: Candidate) -> str:
    """Why the tie-break put `winner` before `loser`: the first preference they differ on."""
    for why, a, b in zip(_PREFERENCE_WHY, preference(winner), preference(loser), strict=True):
        if a != b:
            if why == "the roomier plan":
                return (
                    f"{why} ({winner.est.memory.total / winner.est.gpu_memory_bytes:.0%} vs "
                    f"{loser.est.memory.total / loser.est.gpu_memory_bytes:.0%} of GPU memory; over "
                    f"{ROOMY:.0%} loses ties)"
                )
            if why == "the smaller memory footprint":
                return f"{why} ({winner.est.memory.total / GIB:.1f} vs {loser.est.memory.total / GIB:.1f} GiB)"
            return why
    return "the search order"


def rank(candidates: list[Candidate]) -> Ranking:
    """The fitting candidates in order, the chosen one first (None when nothing fits)."""
    fitting = sorted((c for c in candidates if c.est.fits), key=lambda c: c.est.step_time_s)
    if not fitting:
        return Ranking(best=None, ranked=fitting, tie="")
    fastest = fitting[0]
    ties = [c for c in fitting if c.est.step_time_s <= fastest.est.step_time_s * TIE]
    best, tie = min(ties, key=preference), ""
    if len(ties) > 1:
        recipe = min(ties, key=lambda c: preference(c)[1:])  # what the order alone would pick
        other = recipe if recipe is not best else min((c for c in ties if c is not best), key=preference)
        behind = best.est.step_time_s / fastest.est.step_time_s - 1
        tie = (
            f"{len(ties)} plans within {(TIE - 1) * 100:.0f}% of the fastest ({fastest.est.step_time_s:.3g} "
            f"s/step){f', this one {behind * 100:.1f}% slower' if behind > 0 else ''}; the tie-break (under "
            f"{ROOMY:.0%} of GPU memory first, the recipe's order, the larger micro-batch up to "
            f"{GEMM_TOKENS:,} tokens, then the smaller memory) "
            f"preferred it for {tie_reason(best, other)} over "
            f"{other.describe()}"
        )
    fitting.remove(best)
    fitting.insert(0, best)
    return Ranking(best=best, ranked=fitting, tie=tie)
