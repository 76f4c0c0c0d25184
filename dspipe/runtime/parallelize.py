"""The one step that makes a built module (the plain GPT or a PipelineModule stage) run as the plan says, before
deepspeed.initialize: recomputation wired to DeepSpeed's checkpoint function and, under sp > 1, Ulysses attention
(dspipe.runtime.sequence). Tensor parallelism is AutoTP's, inside deepspeed.initialize.

The model code stays generic: it exposes its blocks and attention modules and their slots (GPT.block_checkpoint,
Attention.core_checkpoint, Attention.core, the position offsets); this module fills them. A pipeline stage's
full recomputation is PipelineModule's own (activation_checkpoint_interval, given when the stage is built).
"""
from __future__ import annotations

from typing import Callable

from dspipe.planner.plan import Plan
from dspipe.rundir import Run


def checkpoint_function(run: Run):
    """DeepSpeed's activation checkpoint function configured from the run's JSON, or None without recomputation."""
    import deepspeed

    if run.plan.checkpointing == "none":
        return None
    # The JSON's activation_checkpointing block, passed as values: configure(deepspeed_config=...) would re-check
    # the batch equation against the whole world, which is wrong under a pipeline (dp = world / pp).
    ac = run.ds_config["activation_checkpointing"]  # as read and checked by rundir.load_run
    deepspeed.checkpointing.configure(None, partition_activations=ac["partition_activations"],
                                      contiguous_checkpointing=ac["contiguous_memory_optimization"],
                                      num_checkpoints=ac["number_checkpoints"],
                                      checkpoint_in_cpu=ac["cpu_checkpointing"],
                                      synchronize=ac["synchronize_checkpoint_boundary"], profile=ac["profile"])
    return deepspeed.checkpointing.checkpoint


def parallelize(module, *, plan: Plan, rank: int, checkpoint_fn: Callable | None) -> None:
    """Wire `module` for this rank: recomputation as plan.checkpointing says, and with sp > 1 its attention made
    sequence-parallel over the Ulysses group (sequence_groups must have been set up) on this rank's slice."""
    recompute(module, mode=plan.checkpointing, checkpoint_fn=checkpoint_fn)
    if plan.sp > 1:
        _sequence_parallel(module, plan=plan, rank=rank)


def recompute(module, *, mode: str, checkpoint_fn: Callable | None) -> None:
    """none; full: recompute each block of the plain GPT in backward; selective: recompute only the attention core
    of every block `module` holds (the plain GPT or a pipeline stage)."""
    from dspipe.model.gpt import GPT, Attention

    if isinstance(module, GPT):
        module.block_checkpoint = checkpoint_fn if mode == "full" else None
    for part in module.modules():
        if isinstance(part, Attention):
            part.core_checkpoint = checkpoint_fn if mode == "selective" else None


def _sequence_parallel(module, *, plan: Plan, rank: int) -> None:
    """The model's attention made sequence-parallel over the Ulysses group."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    from dspipe.runtime.sequence import shard_sequence

    spec, layout = module.spec, plan.layout
    if spec.heads % layout.sp:
        raise RuntimeError(f"heads {spec.heads} are not divisible by sp {layout.sp}")
    shard_sequence(module, group=parallel_state_sp.get_sequence_parallel_group(),
                   start=layout.sequence_slice(spec.seq_len, rank)[0])
