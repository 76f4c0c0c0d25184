"""Plan reports: the JSON object scripts rely on, and the human tables. No torch."""

from __future__ import annotations

import math
from typing import Any

from dspipe.planner.checkpoint_size import disk_text
from dspipe.planner.cost import STEP_TERMS, Estimate
from dspipe.planner.enumerate import Candidate
from dspipe.planner.memory import Memory
from dspipe.planner.search import SearchResult
from dspipe.planner.startup import MODE_TEXT, size_text
from dspipe.spec.hardware import GIB
from dspipe.spec.kinds import Axis, Offload

SECONDS_PER_DAY = 86400


def estimate_summary(c: Candidate, *, tokens: float | None = None) -> dict[str, Any]:  # JSON: numbers, text, objects
    """The keys `dspipe plan --json` promises (and gen-config writes into dspipe.json under 'estimate')."""
    p, e, m = c.plan, c.est, c.est.memory
    days = None if tokens is None else tokens / c.tokens_per_s / SECONDS_PER_DAY
    summary = {
        "num_params": p.num_params,
        "zero_stage": p.zero_stage,
        "offload": p.offload,
        "offload_params": p.offload_params,
        "precision": p.precision,
        "pp": p.pp,
        "tp": p.tp,
        "tp_sp": p.tp_sp,
        "sp": p.sp,
        "dp": p.dp,
        "micro_batch": p.micro_batch,
        "grad_accum": p.grad_accum,
        "checkpointing": p.checkpointing,
        "recompute_blocks": p.recompute_blocks,
        "loss_chunk": p.loss_chunk,
        "memory_per_gpu_bytes": _memory_summary(m),
        "model_states_bytes": m.model_states,
        "gpu_memory_bytes": e.gpu_memory_bytes,
        "memory_headroom": e.headroom,
        "usable_gpu_memory_bytes": e.usable_gpu_memory_bytes,
        "host_memory_bytes": e.host_memory_bytes,
        "host_memory_capacity_bytes": e.host_memory_capacity,
        "step_time_s": e.step_time_s,
        "step_time_breakdown_s": _step_time_breakdown(e),
        "dp_comm_after_step_s": e.dp_after_step_s,
        "matmul_efficiency": e.matmul_efficiency,
        "tokens_per_s": c.tokens_per_s,
        "mfu": c.mfu,
        "train_days": days,
        "gpu_hours": None if days is None else days * 24 * p.world_size,
        "startup": None if e.startup is None else e.startup.to_dict(),
        "first_step": None if e.first_step is None else e.first_step.to_dict(),
        "rank_resident_bytes": e.resident_bytes,
        "checkpoint": None if e.checkpoint is None else e.checkpoint.to_dict(),
        "fits": e.fits,
    }
    if p.experts:  # a mixture of experts: its expert parallelism and the parameters a token passes through
        summary = _with_expert_keys(summary, c)
    return summary


def _memory_summary(m: Memory) -> dict[str, int]:
    """estimate_summary's memory_per_gpu_bytes: the peak's bytes by kind and their total."""
    return {
        "params": m.params,
        "grads": m.grads,
        "optimizer": m.optimizer,
        "activations": m.activations,
        "buffers": m.buffers,
        "total": m.total,
    }


def _step_time_breakdown(e: Estimate) -> dict[str, float]:
    """estimate_summary's step_time_breakdown_s: the step's seconds by cause (a dense model's)."""
    return {
        "compute": e.compute_s,
        "dp_comm": e.dp_comm_s,
        "tp_comm": e.tp_comm_s,
        "sp_comm": e.sp_comm_s,
        "bubble": e.bubble_s,
        "pp_comm": e.pp_comm_s,
        "offload": e.offload_s,
        "optimizer": e.optimizer_s,
    }


def _with_expert_keys(summary: dict[str, Any], c: Candidate) -> dict[str, Any]:
    """`summary` with a mixture of experts' keys: active_params after num_params, ep, expert_dp and experts after
    sp, and the expert all-to-alls' seconds in the step time's breakdown."""
    p, e = c.plan, c.est
    out: dict[str, Any] = {}
    for key, value in summary.items():
        out[key] = value
        if key == "num_params":
            out["active_params"] = e.active_params
        if key == Axis.SP:
            out.update(ep=p.ep, expert_dp=p.expert_dp, experts=p.experts)
    out["step_time_breakdown_s"]["ep_comm"] = e.ep_comm_s
    return out


def _gib(n: int) -> str:
    return f"{n / GIB:8.2f}"


def startup_lines(e: Estimate, *, indent: str = "") -> list[str]:
    """`plan`'s start-up lines: the build mode, the host RAM per node (ranks x per rank: what it holds), the device
    transient while building, and the time to the first step with its basis."""
    s = e.startup
    if s is None:
        return []
    over = f", over the node's {size_text(e.host_memory_capacity)}" if e.startup_host_shortfall_bytes else ""
    return [
        f"{indent}start-up: {MODE_TEXT.get(s.mode, s.mode)}, host RAM {size_text(s.host_per_node_bytes)} per "
        f"node{over} ({s.ranks_per_node} ranks x {size_text(s.host_per_rank_bytes)}: {s.holds()}), "
        f"{size_text(s.device_bytes)} per GPU while building",
        f"{indent}          build {s.first_step_text()}",
        *(
            [f"{indent}          first step ends {e.first_step.text()} after a rank's process start"]
            if e.first_step is not None
            else []
        ),
    ]


def checkpoint_line(e: Estimate, *, keep: int | None = None, kept_for_good: int = 0) -> list[str]:
    """The checkpoint's size (every rank's files, the largest rank's share) and, given the run's retention, the
    most its directory holds."""
    c = e.checkpoint
    if c is None:
        return []
    disk = f"; on disk at most {disk_text(size=c, keep=keep, kept_for_good=kept_for_good)}" if keep else ""
    return [
        f"checkpoint: {size_text(c.bytes)} per save, the largest rank writes {size_text(c.rank_max_bytes)}, "
        f"~{c.write_s:.3g} s at {c.disk_gbps:g} GB/s per node{disk}"
    ]


def save_interval_note(e: Estimate, *, save_interval: int, async_save: bool) -> str | None:
    """A note when a checkpoint's write outlasts the steps between saves (the next save, or with --sync-save each
    save's step, waits for the disk), None otherwise."""
    c = e.checkpoint
    if c is None or not save_interval or c.write_s <= save_interval * e.step_time_s:
        return None
    between = save_interval * e.step_time_s
    waits = "the next save waits for the last one" if async_save else "every save stops training while it writes"
    return (
        f"note: a checkpoint takes ~{c.write_s:.3g} s to write ({size_text(c.node_max_bytes)} from the busiest "
        f"node at {c.disk_gbps:g} GB/s), more than --save-interval {save_interval} x {e.step_time_s:.3g} s/step "
        f"= {between:.3g} s: {waits}; --save-interval {math.ceil(c.write_s / e.step_time_s)} or more keeps up"
    )


def top_table(result: SearchResult, *, top: int) -> list[str]:
    """The `top` fastest fitting plans, the chosen one first (ties reordered by the tie-break), one row each, with
    the start-up's host RAM per node and seconds to the first step."""
    rows = [
        f"  {'#':>2}  {'s/step':>8}  {'tokens/s':>11}  {'MFU':>6}  {'GiB/GPU':>7}  {'of GPU':>6}  "
        f"{'start GiB/node':>14}  {'start s':>7}  plan"
    ]
    for i, c in enumerate(result.ranked[:top], start=1):
        e = c.est
        st = e.startup
        start = f"{st.host_per_node_bytes / GIB:14,.1f}  {st.seconds:7,.0f}" if st else f"{'n/a':>14}  {'n/a':>7}"
        rows.append(
            f"  {i:>2}  {e.step_time_s:8.3g}  {c.tokens_per_s:11,.0f}  {c.mfu * 100:5.1f}%  "
            f"{e.memory.total / GIB:7.1f}  {e.memory.total / e.gpu_memory_bytes * 100:5.0f}%  "
            f"{start}  {c.describe(every_axis=True)}"
        )
    return rows


def _ep_span(*, tp: int, ep: int) -> str:
    """Where the expert-parallel ranks lie: data-parallel ranks (tp 1), the tp group, or k whole tp groups."""
    if tp == 1:
        return "inside dp"
    if ep > tp:
        return f"over {ep // tp} tp groups"
    return "over the tp group" if ep == tp else "whole on every tp rank"


def _plan_lines(best: Candidate, s: dict[str, Any]) -> list[str]:
    """human_report's opening: the plan, its world and parameters, its global batch."""
    p = best.plan
    params = f"{p.num_params / 1e6:,.1f}M params"
    if p.experts:
        params = (
            f"ep {p.ep} {_ep_span(tp=p.tp, ep=p.ep)} (experts {p.experts} / ep {p.ep} = "
            f"{p.experts // p.ep} per rank and sparse "
            f"block, expert dp {p.expert_dp}), {p.num_params / 1e6:,.1f}M params, "
            f"{s['active_params'] / 1e6:,.1f}M active"
        )
    return [
        f"plan: {best.describe(every_axis=True)}",
        f"      world {p.world_size} = dp {p.dp} x pp {p.pp} x tp {p.tp} x sp {p.sp}, {params}",
        f"      global batch {p.global_batch} = micro_batch {p.micro_batch} x grad_accum {p.grad_accum} "
        f"x dp {p.dp}, {p.tokens_per_step:,} tokens/step",
    ]


def _memory_lines(s: dict[str, Any], *, offload: str, host_memory_source: str | None) -> list[str]:
    """human_report's memory per GPU by kind, its total against the GPU's, and the host RAM per node."""
    mem = s["memory_per_gpu_bytes"]
    lines = ["memory per GPU (GiB)"]
    for key in ("params", "grads", "optimizer", "activations", "buffers"):
        lines.append(f"  {key:<12}{_gib(mem[key])}")
    lines.append(
        f"  {'total':<12}{_gib(mem['total'])}  of {s['gpu_memory_bytes'] / GIB:.2f} "
        f"({mem['total'] / s['gpu_memory_bytes'] * 100:.0f}%; plans may use "
        f"{(1 - s['memory_headroom']) * 100:.0f}%, {s['usable_gpu_memory_bytes'] / GIB:.2f})"
    )
    if s.get("rank_resident_bytes") is not None:  # CPU ranks: what `report` measures is the process's RSS
        lines.append(
            f"  a rank's peak RSS ~{s['rank_resident_bytes'] / GIB:.2f} GiB (the process before its build, "
            f"deepspeed.initialize's own buffers, the total above at the allocator's factor: GpuType.resident_bytes)"
        )
    source = f" ({host_memory_source})" if host_memory_source else ""
    if offload != Offload.NONE:
        lines.append(
            f"  host RAM per node {s['host_memory_bytes'] / GIB:.1f} GiB of "
            f"{s['host_memory_capacity_bytes'] / GIB:.0f}{source}"
        )
    else:
        lines.append(
            f"  host RAM per node {s['host_memory_capacity_bytes'] / GIB:.0f} GiB assumed{source}; "
            f"no offload (the start-up's use is below)"
        )
    return lines


def _step_time_lines(
    s: dict[str, Any], *, precision: str, figure_sources: list[tuple[str, str, str]] | None
) -> list[str]:
    """human_report's step time by term, the throughput and MFU, and the time model's figures when any is not the
    catalog's."""
    b = s["step_time_breakdown_s"]
    shown = tuple((name, attr.removesuffix("_s")) for name, attr in STEP_TERMS)
    terms = " + ".join(
        f"{name} {b[key]:.3g}"
        for name, key in shown  # zero tp / sp / ep / optimizer terms left out
        if key in ("compute", "dp_comm", "bubble", "pp_comm", "offload") or b.get(key)
    )
    compute_source = dict((f, src) for f, _, src in figure_sources or ()).get(
        "compute", "the GPU type's catalog figure"
    )
    lines = [
        f"step time {s['step_time_s']:.3g} s = {terms}",
        f"throughput {s['tokens_per_s']:,.0f} tokens/s, MFU {s['mfu'] * 100:.1f}% (compute assumed at "
        f"{s['matmul_efficiency'] * 100:.3g}% of the {precision} peak, {compute_source})",
    ]
    if figure_sources and any(not src.startswith("catalog") for _, _, src in figure_sources):
        lines.append("time-model figures: " + "; ".join(f"{f} {v} ({src})" for f, v, src in figure_sources))
    return lines


def _ranking_lines(result: SearchResult, *, top: int) -> list[str]:
    """human_report's closing: the tie, the top plans, why every other family and tp/sp size lost, and how many
    candidates were evaluated."""
    lines: list[str] = []
    if result.tie:
        lines += ["", f"tie: {result.tie}"]
    if top > 1 and len(result.ranked) > 1:
        lines += ["", f"top {min(top, len(result.ranked))} of {len(result.ranked)} plans that fit"]
        lines += top_table(result, top=top)
    if result.rejected:
        lines += ["", "not chosen"]
        for family, why in sorted(result.rejected.items()):
            lines.append(f"  {family}: {why}")
    lines.append(f"\n({result.evaluated} candidates evaluated)")
    return lines


def human_report(
    result: SearchResult,
    *,
    tokens: float | None,
    tokens_text: str | None = None,
    top: int = 5,
    host_memory_source: str | None = None,
    figure_sources: list[tuple[str, str, str]] | None = None,
) -> str:
    """`dspipe plan`'s text: the chosen plan, its memory and step time, the tie, the top plans, and why every other
    family and tp/sp size lost. `tokens_text`: the budget as the user wrote it (300B); `host_memory_source`: where the
    host RAM per node came from (ClusterSpec.host_memory_source); `figure_sources`: (figure, value, source) of the
    time model's inputs (dspipe.spec.profile.figure_sources), listed when any is not the catalog's."""
    best = result.best
    assert best is not None  # a report of the plan chosen
    s = estimate_summary(best, tokens=tokens)
    p = best.plan
    lines = [*_plan_lines(best, s), "", *_memory_lines(s, offload=p.offload, host_memory_source=host_memory_source)]
    lines += ["", *startup_lines(best.est), *checkpoint_line(best.est)]
    lines += ["", *_step_time_lines(s, precision=best.plan.precision, figure_sources=figure_sources)]
    if tokens is not None:
        budget = tokens_text or f"{tokens:.3g}"
        lines.append(f"training {budget} tokens: {s['train_days']:.1f} days, {s['gpu_hours']:,.0f} GPU-hours")
    lines += _ranking_lines(result, top=top)
    return "\n".join(lines)
