"""Rank script (launched by tests/distributed/test_startup.py): for each run directory given, build its engine the
way the runner does and save, from rank 0, the engine's step-0 weights gathered whole (ZeRO-3 partitions, then
the tensor-parallel shards put together by dspipe.model.tp_split) under the GPT's own parameter names, to OUT/<run
name>.pt, and every rank's start-up figures (dspipe.runtime.startup; meaningful for the first run only, the process
being fresh) and the weight decay the engine's optimizer applies to each parameter (read from its groups) to OUT/<run
name>.json."""

import json
import sys
from pathlib import Path

import torch


def main(out: str, runs: list[str]) -> None:
    import torch.distributed as dist

    from dspipe.planner.startup import build_mode
    from dspipe.rundir import load_run
    from dspipe.runtime.comm import process_group
    from dspipe.runtime.engine import build_engine
    from dspipe.runtime.startup import StartupClock

    with process_group(agreed=()):
        for path in runs:
            run = load_run(path)
            print(f"building {run.path.name}", flush=True)
            clock = StartupClock()
            eng = build_engine(run, clock=clock)
            clock.mark("ready")
            plan = run.plan
            figures = clock.gathered(
                mode=build_mode(zero_stage=plan.zero_stage, tp=plan.tp, pp=plan.pp, ep=plan.ep), host_is_device=True
            ).to_dict()  # engine.json's "startup" object, as the runner writes it
            engine = eng.engine
            figures["weight_decay"] = decays(engine)
            partitioned = engine.zero_optimization_partition_weights()
            if plan.tp > 1:  # every tp rank's own shards (ZeRO-3: gathered on every rank), then put together
                state = merged_tensor_parallel(own_state(engine, partitioned=partitioned), run=run)
            else:
                state = engine._consolidated_16bit_state_dict() if partitioned else engine.module.state_dict()
            if dist.get_rank() == 0:
                torch.save({k: v.detach().cpu().clone() for k, v in state.items()}, Path(out) / f"{run.path.name}.pt")
                (Path(out) / f"{run.path.name}.json").write_text(json.dumps(figures))
            del eng, engine, state
            dist.barrier()


def own_state(engine, *, partitioned: bool) -> dict:
    """This rank's module weights, ZeRO-3 partitions gathered (on every rank)."""
    import deepspeed

    if not partitioned:
        return engine.module.state_dict()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}


def merged_tensor_parallel(state: dict, *, run) -> dict:
    """The whole tensors from the tp ranks of data-parallel replica 0 (collective; the merge is rank 0's)."""
    import torch.distributed as dist

    from dspipe.model.tp_split import merge_shards

    layout = run.plan.layout
    mine = {k: v.detach().cpu().clone() for k, v in state.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    peers = [layout.rank_of(tensor=t) for t in range(layout.tp)]  # pipe 0, data 0, seq 0
    return {name: merge_shards(name, [every[r][name] for r in peers], run.model) for name in mine}


def decays(engine) -> dict[str, float]:
    """{parameter name: the weight decay of the optimizer group that holds it}, from the engine's own groups
    (ZeRO-3: fp16_groups, ZeRO-1/2: bit16_groups, BF16_Optimizer: bf16_groups, each beside the wrapped optimizer's
    param_groups)."""
    opt = engine.optimizer
    groups = next(getattr(opt, a) for a in ("fp16_groups", "bit16_groups", "bf16_groups") if getattr(opt, a, None))
    inner = opt.optimizer.param_groups
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return {names[id(p)]: g["weight_decay"] for params, g in zip(groups, inner, strict=True) for p in params}


if __name__ == "__main__":
    from dspipe.runtime.comm import exit_rank

    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(args[0], args[1:])
    exit_rank(0)  # past the gloo teardown abort (dspipe.runtime.comm), as every launched entry point
