"""Plan reports: the JSON object scripts rely on, and the human tables. No torch."""
from __future__ import annotations

from dspipe.planner.estimate import GIB
from dspipe.planner.search import Candidate, SearchResult

SECONDS_PER_DAY = 86400


def estimate_summary(c: Candidate, *, tokens: float | None = None) -> dict:
    """The keys `dspipe plan --json` promises (and gen-config writes into dspipe.json under 'estimate')."""
    p, e, m = c.plan, c.est, c.est.memory
    days = None if tokens is None else tokens / c.tokens_per_s / SECONDS_PER_DAY
    return {
        "num_params": p.num_params, "zero_stage": p.zero_stage, "offload": p.offload,
        "offload_params": p.offload_params, "precision": p.precision, "pp": p.pp, "dp": p.dp,
        "micro_batch": p.micro_batch, "grad_accum": p.grad_accum, "checkpointing": p.checkpointing,
        "memory_per_gpu_bytes": {"params": m.params, "grads": m.grads, "optimizer": m.optimizer,
                                 "activations": m.activations, "buffers": m.buffers, "total": m.total},
        "model_states_bytes": m.model_states,
        "gpu_memory_bytes": e.gpu_memory_bytes, "host_memory_bytes": e.host_memory_bytes,
        "host_memory_capacity_bytes": e.host_memory_capacity,
        "step_time_s": e.step_time_s,
        "step_time_breakdown_s": {"compute": e.compute_s, "dp_comm": e.dp_comm_s, "bubble": e.bubble_s,
                                  "pp_comm": e.pp_comm_s, "offload": e.offload_s},
        "tokens_per_s": c.tokens_per_s, "mfu": c.mfu, "train_days": days,
        "gpu_hours": None if days is None else days * 24 * p.world_size,
        "fits": e.fits,
    }


def _gib(n: int) -> str:
    return f"{n / GIB:8.2f}"


def human_report(result: SearchResult, *, tokens: float | None) -> str:
    best = result.best
    s = estimate_summary(best, tokens=tokens)
    mem, p = s["memory_per_gpu_bytes"], best.plan
    lines = [f"plan: {best.describe()}",
             f"      {p.num_params / 1e6:,.1f}M params, world {p.world_size}, global batch {p.global_batch} "
             f"= {p.micro_batch} x {p.grad_accum} x {p.dp}, {p.tokens_per_step:,} tokens/step",
             "", "memory per GPU (GiB)"]
    for key in ("params", "grads", "optimizer", "activations", "buffers"):
        lines.append(f"  {key:<12}{_gib(mem[key])}")
    lines.append(f"  {'total':<12}{_gib(mem['total'])}  of {s['gpu_memory_bytes'] / GIB:.2f} "
                 f"({mem['total'] / s['gpu_memory_bytes'] * 100:.0f}%)")
    if p.offload != "none":
        lines.append(f"  host RAM per node {s['host_memory_bytes'] / GIB:.1f} GiB of "
                     f"{s['host_memory_capacity_bytes'] / GIB:.0f}")
    b = s["step_time_breakdown_s"]
    lines += ["", f"step time {s['step_time_s']:.3g} s = compute {b['compute']:.3g} + dp comm {b['dp_comm']:.3g} "
                  f"+ bubble {b['bubble']:.3g} + pp comm {b['pp_comm']:.3g} + offload {b['offload']:.3g}",
              f"throughput {s['tokens_per_s']:,.0f} tokens/s, MFU {s['mfu'] * 100:.1f}%"]
    if tokens is not None:
        lines.append(f"training {tokens:.3g} tokens: {s['train_days']:.1f} days, {s['gpu_hours']:,.0f} GPU-hours")
    if len(result.ranked) > 1:
        lines += ["", "runner-up plans"]
        for c in result.ranked[1:6]:
            lines.append(f"  {c.est.step_time_s:8.3g} s/step  {c.est.memory.total / GIB:6.1f} GiB  {c.describe()}")
    if result.rejected:
        lines += ["", "not chosen"]
        for family, why in sorted(result.rejected.items()):
            lines.append(f"  {family}: {why}")
    lines.append(f"\n({result.evaluated} candidates evaluated)")
    return "\n".join(lines)
