"""A run restarted by torch's elastic agent on fewer ranks than it was planned for (a node lost for good): the same
model layout (pp, tp, sp, ep) and the same global batch, at the smaller data-parallel size with more gradient
accumulation. The run directory is not rewritten: the resized plan and ds_config live for this start only, and a
restart with every node back runs the planned layout again. Resuming from a checkpoint saved at the other dp goes
through the existing dp-change path (dspipe.runtime.reshard). No torch."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

from dspipe.errors import SpecError
from dspipe.rundir import Run

NODE_RANK_ENV = "DSPIPE_NODE_RANK"
"""Set by `dspipe launch --max-restarts --no-ssh --node-rank R` for its ranks: the node they run on, as the hostfile
numbers it (torch's agent numbers nodes by the order of the rendezvous instead: GROUP_RANK)."""


def elastic_restart(env: dict) -> int | None:
    """The restart count of a rank started by torch's elastic agent (0: its first start), None without the agent."""
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    count = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(count) if count.isdigit() else 0


def resized(run: Run, *, world: int, ranks_per_node: int) -> tuple[Run, str | None]:
    """(`run` at `world` ranks on `nodes` nodes, a one-line account of what changed), or (`run`, None) at its planned
    world. Refused in one line when the world cannot hold the layout or the global batch."""
    plan = run.plan
    nodes = max(1, divmod(world, max(1, ranks_per_node))[0])
    if world == plan.world_size:
        return run, None
    if world > plan.world_size:
        raise SpecError(
            f"{run.path} was planned for {plan.world_size} ranks but {world} started; an elastic restart "
            f"only continues on fewer ranks"
        )
    try:
        dp = replace(plan.layout, world=world).dp  # the layout divides the world (dspipe.spec.layout)
    except SpecError as e:
        raise SpecError(f"{world} ranks left cannot hold the run's model layout: {e}") from None
    if dp % plan.ep:
        raise SpecError(f"{world} ranks left give dp {dp}, which is not divisible by the experts' ep {plan.ep}")
    per_step = plan.micro_batch * dp
    if plan.global_batch % per_step:
        raise SpecError(
            f"{world} ranks left give dp {dp}: global batch {plan.global_batch} is not divisible by "
            f"micro_batch {plan.micro_batch} x dp {dp} = {per_step}; the run cannot keep its batch"
        )
    grad_accum = plan.global_batch // per_step
    new_plan = replace(plan, world_size=world, dp=dp, grad_accum=grad_accum)
    ds = copy.deepcopy(run.ds_config)
    ds["gradient_accumulation_steps"] = grad_accum  # train_batch_size and the micro batch stay
    cluster = replace(run.cluster, nodes=nodes, gpus_per_node=ranks_per_node)
    line = (
        f"continuing on {world} of {plan.world_size} ranks ({nodes} of {run.cluster.nodes} node(s)): dp "
        f"{plan.dp} -> {dp}, gradient accumulation {plan.grad_accum} -> {grad_accum}, global batch "
        f"{plan.global_batch} = {plan.micro_batch} x {grad_accum} x {dp} unchanged"
    )
    return replace(run, plan=new_plan, ds_config=ds, cluster=cluster), line


def check_min_nodes(run: Run, *, min_nodes: int | None) -> None:
    """--min-nodes M: a restart on any whole number of nodes from M to the run's keeps its layout and global batch
    (what `resized` will check at that restart); refused before the job starts, naming the largest node count that
    cannot, and the --min-nodes that holds."""
    nodes, per_node = run.cluster.nodes, run.cluster.gpus_per_node
    for n in range(nodes - 1, (min_nodes or nodes) - 1, -1):
        try:
            resized(run, world=n * per_node, ranks_per_node=per_node)
        except SpecError as e:
            keep = "" if n + 1 < nodes else f" (restarts on all {nodes} only)"
            raise SpecError(
                f"--min-nodes {min_nodes}: a restart on {n} node(s) would be refused: {e}; give --min-nodes "
                f"{n + 1}{keep}"
            ) from None


REFUSED_FILE = "refused.json"
"""In the run directory: the one-line error with which a start under torch's elastic agent was refused (bad input
or a check that fails the same way every time), with the agent's run id and the world size it was refused at."""


def record_refusal(run_path, *, env: dict, error: str) -> None:
    """Keep the error of a refused start under the agent, so that its restarts say it again at once instead of
    building the model again to fail the same way (the agent has no exit code that stops its restarts)."""
    from dspipe.atomic import write_file

    record = {"run_id": env.get("TORCHELASTIC_RUN_ID"), "world": env.get("WORLD_SIZE"), "error": error}
    try:
        write_file(Path(run_path) / REFUSED_FILE, json.dumps(record) + "\n")
    except OSError:
        pass  # an unwritable run directory: the restarts fail the long way


def earlier_refusal(run_path, *, env: dict) -> str | None:
    """The error an earlier start of this job (the agent's run id) was refused with at this world size, or None: a
    restart at another world size (a node lost or back) tries again, as does a new job (`dspipe launch` removes the
    file before it starts the agent)."""
    try:
        record = json.loads((Path(run_path) / REFUSED_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("error"), str):
        return None
    same = record.get("run_id") == env.get("TORCHELASTIC_RUN_ID") and record.get("world") == env.get("WORLD_SIZE")
    return record["error"] if same else None
