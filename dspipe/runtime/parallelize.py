"""The one step that makes a built module (the plain GPT or a PipelineModule stage) run as the plan says, before
deepspeed.initialize: tensor parallelism (dspipe.runtime.tensor_parallel's Megatron-layout layers swapped in while
the module is still on the meta device, so each rank materialises only its shard: `shard_tensor_parallel`),
recomputation wired to DeepSpeed's checkpoint function and, under sp > 1, Ulysses attention
(dspipe.runtime.sequence).

The model code stays generic: it exposes its blocks and attention modules and their slots (GPT.block_checkpoint,
GPT.head_loss, Attention.core_checkpoint, Attention.core, the position offsets); this module fills them. A pipeline
stage's full recomputation is PipelineModule's own (activation_checkpoint_interval, given when the stage is built).
"""

from __future__ import annotations

import functools
from typing import Callable

from dspipe.planner.plan import Plan
from dspipe.rundir import Run
from dspipe.spec.kinds import Checkpointing


def checkpoint_function(run: Run):
    """DeepSpeed's activation checkpoint function configured from the run's JSON, or None without recomputation."""
    import deepspeed

    if run.plan.checkpointing == Checkpointing.NONE:
        return None
    # The JSON's activation_checkpointing block, passed as values: configure(deepspeed_config=...) would re-check
    # the batch equation against the whole world, which is wrong under a pipeline (dp = world / pp).
    ac = run.ds_config["activation_checkpointing"]  # as read and checked by rundir.load_run
    deepspeed.checkpointing.configure(
        None,
        partition_activations=ac["partition_activations"],
        contiguous_checkpointing=ac["contiguous_memory_optimization"],
        num_checkpoints=ac["number_checkpoints"],
        checkpoint_in_cpu=ac["cpu_checkpointing"],
        synchronize=ac["synchronize_checkpoint_boundary"],
        profile=ac["profile"],
    )
    return deepspeed.checkpointing.checkpoint


def parallelize(
    module, *, plan: Plan, rank: int, checkpoint_fn: Callable | None, mpu=None, compile_: bool = False
) -> None:
    """Wire `module` for this rank: recomputation as plan.checkpointing says, the loss in chunks as plan.loss_chunk
    says (chunked_loss), and with sp > 1 its attention made sequence-parallel over the Ulysses group of `mpu`
    (dspipe.runtime.mesh.Mesh) on this rank's slice; then, with `compile_`, every block compiled
    (compile_blocks: last, so the compiled graphs hold the wired attention). (Its tensor-parallel shards were
    swapped in when it was built: shard_tensor_parallel.)"""
    recompute(module, mode=plan.checkpointing, checkpoint_fn=checkpoint_fn, blocks=plan.recompute_blocks)
    if plan.loss_chunk:
        chunked_loss(module, chunk=plan.loss_chunk)
    if plan.sp > 1:
        _sequence_parallel(module, plan=plan, rank=rank, group=mpu.get_sequence_parallel_group())
    if compile_:
        compile_blocks(module)


def compile_blocks(module) -> int:
    """torch.compile every transformer block `module` holds (the plain GPT's or a pipeline stage's), in place
    (nn.Module.compile: the module stays itself, its parameters and hooks DeepSpeed's to manage), and return how
    many. As torchtitan does, per block rather than the whole model: the blocks share one code object, so the graph
    compiled for the first serves the others (one more per kind: a windowed or sparse block, a different shard),
    and the embedding, head and loss stay outside, where DeepSpeed's pipeline and tied-weight code run. Full
    recomputation checkpoints the compiled block; selective recomputation's checkpoint of the attention core runs
    inside it."""
    from dspipe.model.gpt import Block

    blocks = [part for part in module.modules() if isinstance(part, Block)]
    for block in blocks:
        block.compile()
    return len(blocks)


def recompute(module, *, mode: str, checkpoint_fn: Callable | None, blocks: int = 0) -> None:
    """none; full: recompute each block of the plain GPT in backward (a pipeline stage's are PipelineModule's own:
    activation_checkpoint_interval 1), with `blocks` > 0 only the first `blocks` blocks of the GPT or of the stage
    (Megatron's --recompute-method block: the others keep their activations); selective: recompute only the
    attention core of every block `module` holds (the plain GPT or a pipeline stage)."""
    from dspipe.model.gpt import GPT, Attention

    full = checkpoint_fn if mode == Checkpointing.FULL else None
    if isinstance(module, GPT):
        module.block_checkpoint = _first_blocks(full, chosen=list(module.h)[:blocks]) if full and blocks else full
    elif full and blocks:
        _stage_first_blocks(module, blocks=blocks)
    for part in module.modules():
        if isinstance(part, Attention):
            part.core_checkpoint = checkpoint_fn if mode == Checkpointing.SELECTIVE else None


def _first_blocks(checkpoint_fn: Callable, *, chosen: list) -> Callable:
    """GPT.block_checkpoint that recomputes only the `chosen` blocks and runs every other one plainly (it is called
    with the block, or a sparse block's bound forward_aux, and the block's input)."""
    ids = {id(block) for block in chosen}

    def checkpoint(run: Callable, *args):
        owner = getattr(run, "__self__", run)
        return checkpoint_fn(run, *args) if id(owner) in ids else run(*args)

    checkpoint.blocks = len(ids)  # type: ignore[attr-defined]  # what recomputed_blocks reads back
    return checkpoint


def recomputed_blocks(module) -> int:
    """How many of the blocks `module` holds (the plain GPT, or a pipeline stage) its backward recomputes whole, as
    wired: the GPT's block_checkpoint, or the stage's per-layer checkpoint switches."""
    from dspipe.model.gpt import GPT, Block

    if isinstance(module, GPT):
        fn = module.block_checkpoint
        return 0 if fn is None else getattr(fn, "blocks", len(module.h))
    if not getattr(module, "activation_checkpoint_interval", 0):
        return 0
    module._precompute_checkpointable_values()  # as the first forward would (a no-op once computed or set)
    interval = module.activation_checkpoint_interval
    layers = module.forward_funcs
    return sum(
        sum(1 for layer in layers[start : start + interval] if isinstance(layer, Block))
        for start, on in zip(range(0, len(layers), interval), module.is_checkpointable_results, strict=True)
        if on
    )


def _stage_first_blocks(stage, *, blocks: int) -> None:
    """A pipeline stage built with activation_checkpoint_interval 1 (one checkpoint switch per layer:
    PipelineModule.is_checkpointable_results) made to recompute its first `blocks` blocks only."""
    from dspipe.model.gpt import Block

    if stage.activation_checkpoint_interval != 1:
        raise RuntimeError(
            f"recompute_blocks {blocks} needs the stage built with activation_checkpoint_interval 1, got "
            f"{stage.activation_checkpoint_interval}"
        )
    switches, seen = [], 0
    for layer in stage.forward_funcs:
        block = isinstance(layer, Block)
        switches.append(block and seen < blocks)
        seen += block
    stage.is_checkpointable_results = switches
    stage.is_checkpointable_results_interval = 1  # DeepSpeed's forward keeps these rather than deriving its own


def chunked_loss(module, *, chunk: int):
    """The loss computed without the full logits, `chunk` tokens at a time (strategy.loss_chunk;
    dspipe.model.loss.HeadLoss): the plain GPT's head_loss slot, or on a pipeline's last stage the head made a pass-
    through and the stage's loss_fn the chunked loss of its hidden states and the head's weight. Returns the HeadLoss
    (None on a stage without the head). A tensor-parallel head (the plan refuses tp > 1 with loss_chunk) is refused
    here too: its vocab-parallel loss is not chunked."""
    from dspipe.model.gpt import GPT, Embedding, LMHead
    from dspipe.model.loss import HeadLoss

    if any(getattr(m, "head_linear", None) is not None for m in module.modules() if isinstance(m, (Embedding, LMHead))):
        raise RuntimeError(f"loss_chunk {chunk} with a tensor-parallel head: its vocab-parallel loss is not chunked")
    loss = HeadLoss(chunk=chunk)
    if isinstance(module, GPT):
        module.head_loss = loss
        return loss
    if module._local_stop != len(module._layer_specs):  # not the last stage: no head, no loss
        return None
    head = module.forward_funcs[-1]
    owner = head.args[0] if isinstance(head, functools.partial) else head  # the tied Embedding, or the LMHead
    if not isinstance(owner, (Embedding, LMHead)):
        raise RuntimeError(f"the pipeline's last layer is {type(owner).__name__}, not the head: cannot chunk its loss")
    module.forward_funcs[-1] = _hidden  # the stage now returns the final norm's output
    module.loss_fn = _StageHeadLoss(loss, owner=owner, tied=isinstance(owner, Embedding))
    return loss


def _hidden(x):
    """A pipeline's head replaced by the chunked loss: its input goes to the loss unchanged."""
    return x


class _StageHeadLoss:
    """A pipeline's loss_fn(hidden, labels) -> HeadLoss(hidden, the head's weight, labels); the weight is read at
    each call (the tied embedding's wte.weight or the LMHead's weight)."""

    def __init__(self, loss, *, owner, tied: bool):
        self.loss, self.owner, self.tied = loss, owner, tied

    def __call__(self, hidden, labels):
        return self.loss(hidden, self.owner.wte.weight if self.tied else self.owner.weight, labels)


def _sequence_parallel(module, *, plan: Plan, rank: int, group) -> None:
    """The model's attention made sequence-parallel over the Ulysses group (each tp rank's heads / tp heads
    spread over the sp ranks)."""
    from dspipe.runtime.sequence import shard_sequence

    spec, layout = module.spec, plan.layout
    if (spec.heads // layout.tp) % layout.sp:
        raise RuntimeError(f"heads {spec.heads} / tp {layout.tp} are not divisible by sp {layout.sp}")
    shard_sequence(module, group=group, start=layout.sequence_slice(spec.seq_len, rank)[0])


def shard_tensor_parallel(module, *, spec, tp, ep: int = 1) -> None:
    """Swap `module`'s layers for this tp rank's shards (`tp`: a dspipe.runtime.tensor_parallel.TensorGroup), in
    Megatron's layout: q/k/v and the MLP's up (gate/up) projections column-parallel with whole heads per rank, the
    attention and MLP output projections row-parallel, the token embedding and an untied head vocabulary-parallel (a
    tied head uses the embedding's shard), q/k norms replicated with their gradients summed over the group;
    positions and the other norms replicated; a mixture of experts' sparse MLPs (router, routed and shared experts)
    whole on every rank, each running its own slice of the sequence through them (sequence parallelism only:
    tensor_parallel.sequence_parallel_experts); at `ep` = tp each rank holds E / tp of the routed experts. Call it
    on the meta device: the new parameters are empty, to be given their step-0 values through their `tp_shard`
    (dspipe.runtime.build). A GPT gets the vocabulary-parallel loss; a pipeline's loss is set by the caller
    (vocab_parallel_loss).
    With tp.sequence_parallel (Megatron's sequence parallelism) the activations between the tensor-parallel regions
    hold this rank's slice of the sequence: the regions are entered by an all-gather and left by a reduce-scatter,
    the embedding's rows are reduce-scattered, and the norms, learned positions and row-parallel biases, applied to
    a slice, have their gradients summed over the group."""
    from dspipe.model.gpt import GPT, MLP, Attention, Block, Embedding, FinalNorm, LMHead, SparseMLP
    from dspipe.runtime import tensor_parallel as T

    if spec.experts and not tp.sequence_parallel:
        raise RuntimeError(f"experts {spec.experts} with tp {tp.size}: sequence parallelism off (the rules refuse it)")
    hd = spec.head_dim
    qkv = [spec.heads * hd, spec.kv_groups * hd, spec.kv_groups * hd]
    head = functools.partial(T.column_linear, tp=tp)
    seq = tp.sequence_parallel
    sparse = [part for part in module.modules() if isinstance(part, SparseMLP)]
    in_sparse = {id(m) for part in sparse for m in part.modules()}  # experts are MLPs too: kept whole
    for part in sparse:
        T.sequence_parallel_experts(part, tp=tp, ep=ep)
    for part in list(module.modules()):
        if id(part) in in_sparse:
            continue
        if isinstance(part, Attention):
            part.c_attn = T.ColumnParallelLinear(part.c_attn, parts=qkv, tp=tp)
            part.c_proj = T.RowParallelLinear(part.c_proj, tp=tp)
            if part.q_norm is not None:
                part.q_norm, part.k_norm = (T.ReducedRMSNorm.like(n, tp=tp) for n in (part.q_norm, part.k_norm))
        elif isinstance(part, MLP):
            width = part.c_proj.in_features
            part.c_fc = T.ColumnParallelLinear(part.c_fc, parts=[width, width] if part.swiglu else [width], tp=tp)
            part.c_proj = T.RowParallelLinear(part.c_proj, tp=tp)
        elif isinstance(part, Embedding):
            part.wte = T.VocabParallelEmbedding(part.wte, tp=tp)
            part.head_linear = head
            if seq and part.wpe is not None:
                part.wpe = T.SlicedPositions.like(part.wpe, tp=tp)
        elif isinstance(part, Block) and seq:
            part.ln_1, part.ln_2 = (T.reduced_norm(n, tp=tp) for n in (part.ln_1, part.ln_2))
        elif isinstance(part, FinalNorm) and seq:
            part.ln_f = T.reduced_norm(part.ln_f, tp=tp)
        elif isinstance(part, LMHead):
            T.shard_vocab_rows(part, "weight", part.weight, vocab=spec.vocab, tp=tp)
            part.head_linear = head
    if isinstance(module, GPT):
        module.loss_fn = vocab_parallel_loss(spec=spec, tp=tp)


def vocab_parallel_loss(*, spec, tp):
    """The loss of a tensor-parallel model: cross-entropy from each rank's vocabulary slice of the logits."""
    from dspipe.runtime.tensor_parallel import VocabParallelLoss

    return VocabParallelLoss(tp=tp, vocab=spec.vocab)
