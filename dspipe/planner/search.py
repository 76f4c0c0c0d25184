"""Choose a strategy: enumerate the candidates a request leaves open (planner.enumerate), rank them (planner.rank),
say why the others lost (planner.explain); when nothing fits, search again with what would make it fit. No torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dspipe.errors import SpecError
from dspipe.planner.enumerate import Candidate, enumerate_candidates, rule_of
from dspipe.planner.explain import over, rejected, shortfall_text
from dspipe.planner.memory import MEMORY_HEADROOM
from dspipe.planner.rank import rank
from dspipe.planner.startup import StartupEstimate
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.core import StrategyRequest
from dspipe.spec.hardware import GIB
from dspipe.spec.kinds import Axis, Offload
from dspipe.spec.model import ModelSpec
from dspipe.spec.settings import is_auto
from dspipe.spec.train import TrainSpec


@dataclass(frozen=True)
class SearchResult:
    best: Candidate | None
    ranked: list[Candidate]
    """Fitting candidates, fastest first."""
    closest: Candidate | None
    """When nothing fits: the candidate with the smallest memory shortfall."""
    rejected: dict[str, str]
    """One line per strategy family (and per tp / sp size) that was not chosen, saying why."""
    evaluated: int
    tie: str = ""
    """When several plans tied (within 2% of the fastest): how many, and why the tie-break chose this one."""


def search(
    *,
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    request: StrategyRequest,
    headroom: float | None = None,
    import_bytes: int | None = None,
) -> SearchResult:
    """The best strategy for `request` (each field a value, or None to let the search choose). A plan fits when its
    peak is at most (1 - headroom) of the GPU's memory (default memory.MEMORY_HEADROOM) and its start-up fits the
    node's host RAM (Estimate.fits). `import_bytes`: bytes of the --init-from checkpoint's tensors (the start-up
    reads them instead of drawing). Nothing valid: the refusal that got furthest through the rules."""
    headroom = MEMORY_HEADROOM if headroom is None else headroom
    found = enumerate_candidates(
        model=model, cluster=cluster, train=train, request=request, headroom=headroom, import_bytes=import_bytes
    )
    if not found.candidates:
        raise max(found.errors, key=rule_of)  # the one that got furthest through the rules
    ranking = rank(found.candidates)
    why = rejected(found=found, best=ranking.best, model=model, cluster=cluster, train=train, request=request)
    closest = None if ranking.best else min(found.candidates, key=over)
    return SearchResult(
        best=ranking.best,
        ranked=ranking.ranked,
        closest=closest,
        rejected=why,
        evaluated=len(found.candidates),
        tie=ranking.tie,
    )


def _startup_tries(
    *, startup: StartupEstimate, cluster: ClusterSpec, request: StrategyRequest
) -> list[tuple[str, ClusterSpec, StrategyRequest]]:
    """What nothing_fits_message re-searches when the start-up's host RAM is short: each pinned tp / pp / ZeRO stage
    left to the planner, all of them, and nodes with the RAM the start-up needs."""
    pinned = [k for k in (Axis.TP, Axis.PP, "zero") if not is_auto(getattr(request, k))]
    relaxed = [(f"--{k} auto", cluster, replace(request, **{k: None})) for k in pinned]
    if len(pinned) > 1:
        relaxed.append(
            (" ".join(f"--{k} auto" for k in pinned), cluster, replace(request, **{k: None for k in pinned}))
        )
    needed = math.ceil(startup.host_per_node_bytes / GIB)
    try:
        relaxed.append(
            (
                f"{needed:,} GiB host RAM per node (--host-memory-gib)",
                replace(cluster, host_memory_gib=float(needed)),
                request,
            )
        )
    except SpecError:  # beyond any --host-memory-gib
        pass
    return relaxed


def nothing_fits_message(
    *,
    result: SearchResult,
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    request: StrategyRequest,
    headroom: float | None = None,
    import_bytes: int | None = None,
) -> str:
    """One line: the smallest shortfall and what would make it fit (more GPUs, offload, NVMe; when the start-up's
    host RAM is short, a pinned tp / pp / ZeRO stage left to the planner, or nodes with the RAM the start-up needs),
    each re-searched."""
    c = result.closest
    assert c is not None  # nothing fits: the closest candidate is set
    tries = [
        (f"{cluster.nodes * k} nodes x {cluster.gpus_per_node}", replace(cluster, nodes=cluster.nodes * k), request)
        for k in (2, 4, 8, 16, 32, 64)
    ]
    if request.offload == Offload.NONE:
        tries.insert(0, ("--offload cpu", cluster, replace(request, offload="cpu", offload_params=None)))
    if not request.nvme_path:
        tries.insert(
            1,
            (
                "--offload nvme --nvme-path DIR",
                cluster,
                replace(request, offload="nvme", offload_params=None, nvme_path="/nvme"),
            ),
        )
    if model.experts and not is_auto(request.ep):  # a pinned ep fixes the experts a rank holds
        tries.insert(0, ("--ep auto", cluster, replace(request, ep=None)))
    pinned = [k for k in ("checkpointing", "recompute_blocks") if not is_auto(getattr(request, k))]
    if pinned:  # pinned recomputation: the search's own (none, every block, or the fewest blocks that fit)
        label = " ".join(f"--{k.replace('_', '-')} auto" for k in pinned)
        tries.insert(0, (label, cluster, replace(request, checkpointing=None, recompute_blocks=None)))
    # the build holds more than the node's RAM (so there is a start-up estimate): another build mode may not
    if c.est.startup is not None and c.est.startup_host_shortfall_bytes:
        tries[:0] = _startup_tries(startup=c.est.startup, cluster=cluster, request=request)
    fixes = []
    for label, bigger, asked in tries:
        try:
            r = search(
                model=model, cluster=bigger, train=train, request=asked, headroom=headroom, import_bytes=import_bytes
            )
        except SpecError:
            continue
        if r.best:
            fixes.append(f"{label} ({r.best.family})")
            if bigger.nodes != cluster.nodes:
                break
    if not fixes:  # name what was tried
        others = [label for label, bigger, _ in tries if bigger.nodes == cluster.nodes]
        more = f"up to {cluster.nodes * 64} nodes x {cluster.gpus_per_node}"
        fixes = [f"none of what dspipe tried ({', '.join([*others, more])})"]
    return (
        f"nothing fits {model.name} on {cluster.world_size} x {cluster.gpu}: closest is {c.describe()}, which "
        f"{shortfall_text(c)}; would fit with: {', or '.join(fixes)}"
    )
