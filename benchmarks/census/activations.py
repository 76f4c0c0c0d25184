"""Activation census: the bytes autograd keeps for backward, measured on the real model with saved-tensor hooks.

One training micro-batch runs forward and backward on one process (no engine, no communication) through the model
the runner builds: the plain GPT (dspipe.model.gpt) or one stage of the PipelineModule (dspipe.model.pipeline, with
DeepSpeed's own partition; a fake two-rank process group lets one process build any stage), recomputation through
DeepSpeed's checkpoint function as dspipe.runtime.parallelize wires it. What is counted:

- every tensor autograd saves (torch.autograd.graph.saved_tensors_hooks: the pack hook hands autograd a holder of
  the tensor, so the holder lives exactly as long as autograd keeps the tensor);
- the inputs DeepSpeed's checkpoint keeps on its ctx (ctx.deepspeed_saved_tensors, not seen by the hooks): held from
  the call until the tensor object dies after that block's backward;
- by storage (untyped_storage().data_ptr()): a storage saved several times (views, a recomputed block's detached
  input) counts once; parameters (model states, not activations) and empty storages are skipped.

`saved` is what is alive at the end of the forward (loss computed), attributed to the region that first saved it
(embedding, block i, head = final norm + output head + loss); `peak` is the most alive at any moment of forward and
backward, which with full recomputation is reached while one block is recomputed during backward (the head's saved
tensors are freed before that). Gradients and temporaries are not activations and are not counted.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass

import torch

HEAD = "head"
EMBED = "embed"


@dataclass(frozen=True)
class ActivationCensus:
    """Saved-for-backward bytes of one micro-batch on one rank, by region, and the peak alive."""

    blocks: tuple[int, ...]
    """Bytes first saved by each transformer block this module holds, in order."""
    embed: int
    """Bytes first saved by the embedding (token ids, 0 where the stage has none)."""
    head: int
    """Bytes first saved by the final norm, the output head and the loss (0 where the stage has none)."""
    peak: int
    """Most bytes alive at once during forward and backward."""

    @property
    def saved(self) -> int:
        """Bytes alive at the end of the forward."""
        return sum(self.blocks) + self.embed + self.head


class _Tracker:
    """Reference counts of activation storages (one per holder), their total alive and its peak."""

    def __init__(self, *, skip: set[int]):
        self.skip, self.refs, self.size, self.where = skip, {}, {}, {}
        self.region, self.live, self.peak = EMBED, 0, 0

    def hold(self, tensor: torch.Tensor, owner) -> None:
        """Count `tensor`'s storage alive until `owner` is garbage."""
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key in self.skip or nbytes == 0:
            return
        if self.refs.get(key, 0) == 0:
            self.refs[key], self.size[key] = 0, nbytes
            self.where.setdefault(key, self.region)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(owner, self._release, key)

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= self.size.pop(key)
            del self.refs[key], self.where[key]

    def by_region(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for key, region in self.where.items():
            out[region] = out.get(region, 0) + self.size[key]
        return out


class _Held:
    """What the pack hook gives autograd instead of the tensor."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _checkpoint_fn():
    """DeepSpeed's checkpoint, configured as the engine does from the rendered activation_checkpointing block."""
    import deepspeed

    deepspeed.checkpointing.configure(
        None,
        partition_activations=False,
        contiguous_checkpointing=False,
        num_checkpoints=None,
        checkpoint_in_cpu=False,
        synchronize=False,
        profile=False,
    )
    return deepspeed.checkpointing.checkpoint


def _dtype(precision: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def _run(module, *, blocks: list, embed, head_start, forward, checkpoint, whole_blocks: bool) -> ActivationCensus:
    """Hooks on, one forward (`forward(checkpoint_fn)` returns the output and its gradient: the loss and None, or a
    stage's output and the gradient the next stage would send), a snapshot, backward, hooks off."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()}
    tracker = _Tracker(skip=skip)
    handles = [
        b.register_forward_pre_hook(lambda _m, _a, i=i: setattr(tracker, "region", f"block{i}"))
        for i, b in enumerate(blocks)
    ]
    if embed is not None:
        handles.append(embed.register_forward_pre_hook(lambda *_: setattr(tracker, "region", EMBED)))
    if head_start is not None:
        handles.append(head_start.register_forward_pre_hook(lambda *_: setattr(tracker, "region", HEAD)))

    calls = [0]

    def counted(function, *args):
        if whole_blocks:  # the i-th checkpoint call of the forward holds block i's input
            tracker.region, calls[0] = f"block{calls[0]}", calls[0] + 1
        for a in args:
            if torch.is_tensor(a):
                tracker.hold(a, a)
        return checkpoint(function, *args)

    def pack(tensor):
        held = _Held(tensor)
        tracker.hold(tensor, held)
        return held

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.tensor):
            out, grad = forward(counted)
            regions = tracker.by_region()
            out.backward(grad)
    finally:
        for h in handles:
            h.remove()
    return ActivationCensus(
        blocks=tuple(regions.get(f"block{i}", 0) for i in range(len(blocks))),
        embed=regions.get(EMBED, 0),
        head=regions.get(HEAD, 0),
        peak=tracker.peak,
    )


def _batch(model, micro_batch: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.vocab, (micro_batch, model.seq_len + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def census_gpt(
    *,
    model,
    micro_batch: int,
    checkpointing: str,
    precision: str,
    seed: int = 0,
    moe_layer: str = "loop",
    recompute_blocks: int = 0,
) -> ActivationCensus:
    """One micro-batch through the plain GPT (pp = 1) as the runner builds it; a mixture of experts on the model's own
    SparseMLP (moe_layer "loop") or on DeepSpeed's layer at ep 1 ("native": dspipe.runtime.moe.NativeMoE, its tokens
    through dspipe.runtime.dispatch). `recompute_blocks`: full recomputation of the first that many blocks only."""
    from dspipe.model.gpt import GPT
    from dspipe.runtime.parallelize import recompute

    torch.manual_seed(seed)
    gpt = GPT(model, seed=seed).to(_dtype(precision)).train()
    inputs, labels = _batch(model, micro_batch, seed)
    if moe_layer == "native":
        from dspipe.runtime import moe

        moe.install(gpt, spec=model, ep=1, ep_rank=0)

    def forward(counted):
        recompute(
            gpt,
            mode=checkpointing,
            checkpoint_fn=counted if checkpointing != "none" else None,
            blocks=recompute_blocks,
        )
        return gpt(inputs, labels), None

    with _process_group(rank=0, world=1):  # DeepSpeed's checkpointing asks for the rank
        return _run(
            gpt,
            blocks=list(gpt.h),
            embed=gpt.embed,
            head_start=gpt.final,
            forward=forward,
            checkpoint=_checkpoint_fn() if checkpointing != "none" else None,
            whole_blocks=checkpointing == "full",
        )


@contextlib.contextmanager
def _process_group(*, rank: int, world: int):
    """A process group of `world` ranks in this one process, as rank `rank` (torch's fake backend: collectives do
    nothing), for DeepSpeed's PipelineModule and checkpointing; refused if one is already up (a real run's)."""
    import deepspeed
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the activation census builds its own process group: run it outside a distributed job")
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def census_stage(
    *,
    model,
    pp: int,
    stage: int,
    micro_batch: int,
    checkpointing: str,
    precision: str,
    partition_method: str = "parameters",
    seed: int = 0,
    recompute_blocks: int = 0,
) -> tuple[ActivationCensus, list[int]]:
    """One micro-batch through stage `stage` of the PipelineModule (DeepSpeed's partition of the runner's layer
    specs; full recomputation through its activation_checkpoint_interval 1, as the plan renders it). Returns the
    census and DeepSpeed's stage bounds (indices into embedding, blocks, final norm, head)."""
    from dspipe.model.gpt import Block, Embedding, FinalNorm
    from dspipe.model.pipeline import build_pipeline
    from dspipe.runtime.parallelize import recompute

    with _process_group(rank=stage, world=pp):
        checkpoint = _checkpoint_fn()
        holder = {}

        def counted_proxy(function, *args):
            return holder["fn"](function, *args)

        torch.manual_seed(seed)
        pipe = (
            build_pipeline(
                model=model,
                stages=pp,
                partition_method=partition_method,
                activation_checkpoint_interval=1 if checkpointing == "full" else 0,
                checkpoint_fn=counted_proxy,
                seed=seed,
            )
            .to(_dtype(precision))
            .train()
        )
        recompute(pipe, mode=checkpointing, checkpoint_fn=counted_proxy, blocks=recompute_blocks)
        # as PipelineEngine's __init__ does; forward checkpoints nothing without
        pipe._precompute_checkpointable_values()
        bounds = [int(x) for x in pipe.parts]
        layers = list(pipe.forward_funcs)
        blocks = [m for m in layers if isinstance(m, Block)]
        embed = layers[0] if stage == 0 else None
        head = next((m for m in layers if isinstance(m, FinalNorm)), None)
        assert embed is None or isinstance(embed, Embedding)
        inputs, labels = _batch(model, micro_batch, seed)
        if stage > 0:  # what the previous stage sends: a hidden state the engine keeps (and backpropagates into)
            gen = torch.Generator().manual_seed(seed + 1)
            inputs = torch.randn(micro_batch, model.seq_len, model.hidden, generator=gen).to(_dtype(precision))
            inputs.requires_grad_()

        def forward(counted):
            holder["fn"] = counted
            out = pipe(inputs)
            if stage == pp - 1:
                return pipe.loss_fn(out, labels), None
            return out, torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)

        census = _run(
            pipe,
            blocks=blocks,
            embed=embed,
            head_start=head,
            forward=forward,
            checkpoint=checkpoint,
            whole_blocks=checkpointing == "full",
        )
        return census, bounds


@dataclass(frozen=True)
class Comparison:
    """The planner's activation bytes for one micro-batch on one stage next to the census of the real model."""

    label: str
    """What was measured: model, precision, recomputation, stage."""
    blocks: int
    """Transformer blocks on the stage (DeepSpeed's partition)."""
    predicted_block: int
    """dspipe.planner.memory.activation_bytes_per_layer."""
    measured_block: float
    """Mean census bytes per block."""
    predicted_head: int
    """logits_bytes on the last stage (0 elsewhere)."""
    measured_head: int
    """Census bytes of the final norm, head and loss."""
    predicted_peak: int
    """micro_batch_activations: held + working, the stage's peak for one micro-batch in flight."""
    measured_peak: int
    """Census peak."""


def compare(
    *,
    model,
    micro_batch: int,
    checkpointing: str,
    precision: str,
    pp: int = 1,
    stage: int = 0,
    partition_method: str = "parameters",
    moe_layer: str = "loop",
    recompute_blocks: int = 0,
) -> Comparison:
    """Census of the real model (or pipeline stage) and the planner's figures for it, with PyTorch's CPU kernels. A
    mixture of experts runs `moe_layer` here (no engine; census_gpt: both keep what the planner counts); its blocks
    are averaged (predicted and measured alike)."""
    from dspipe.planner.memory import activation_bytes_per_layer, logits_bytes, micro_batch_activations
    from dspipe.planner.stages import stage_blocks, stage_bounds
    from dspipe.spec.dtypes import dtype_bytes

    act_bytes = dtype_bytes(precision)
    if pp == 1:
        census = census_gpt(
            model=model,
            micro_batch=micro_batch,
            checkpointing=checkpointing,
            precision=precision,
            moe_layer=moe_layer,
            recompute_blocks=recompute_blocks,
        )
    else:
        census, bounds = census_stage(
            model=model,
            pp=pp,
            stage=stage,
            micro_batch=micro_batch,
            checkpointing=checkpointing,
            precision=precision,
            partition_method=partition_method,
            recompute_blocks=recompute_blocks,
        )
        if tuple(bounds) != stage_bounds(model, pp, partition_method):
            raise RuntimeError(
                f"DeepSpeed's stage bounds {bounds} differ from the planner's "
                f"{list(stage_bounds(model, pp, partition_method))}"
            )
    blocks = stage_blocks(model=model, pp=pp, partition_method=partition_method)[stage]
    if blocks != len(census.blocks):
        raise RuntimeError(f"stage {stage}: planner counts {blocks} blocks, the module holds {len(census.blocks)}")
    last = stage == pp - 1
    first_block = sum(stage_blocks(model=model, pp=pp, partition_method=partition_method)[:stage])
    sparse = sum(1 for j in model.sparse_layers if first_block <= j < first_block + blocks)
    held, working = micro_batch_activations(
        model=model,
        micro_batch=micro_batch,
        checkpointing=checkpointing,
        act_bytes=act_bytes,
        blocks=blocks,
        first=stage == 0,
        last=last,
        kernels="cpu",
        sparse=sparse,
        recompute_blocks=recompute_blocks,
    )

    def per_block(*, is_sparse: bool, mode: str = checkpointing) -> int:
        return activation_bytes_per_layer(
            model=model,
            micro_batch=micro_batch,
            checkpointing=mode,
            act_bytes=act_bytes,
            kernels="cpu",
            sparse=is_sparse,
        )

    def stage_blocks_bytes() -> int:
        if checkpointing == "full" and 0 < recompute_blocks < blocks:  # the first recomputed, the rest kept
            kept = blocks - recompute_blocks
            return recompute_blocks * per_block(is_sparse=False) + kept * per_block(is_sparse=False, mode="none")
        return sparse * per_block(is_sparse=True) + (blocks - sparse) * per_block(is_sparse=False)

    where = f", stage {stage}/{pp} ({blocks} blocks)" if pp > 1 else ""
    plural = "s" if recompute_blocks != 1 else ""
    first = f" (first {recompute_blocks} block{plural})" if recompute_blocks else ""
    return Comparison(
        label=f"{model.name} L{model.layers} h{model.hidden}, {precision}, {checkpointing}{first}{where}",
        blocks=blocks,
        predicted_block=stage_blocks_bytes() / max(1, blocks),
        measured_block=sum(census.blocks) / max(1, blocks),
        predicted_head=logits_bytes(model=model, micro_batch=micro_batch, act_bytes=act_bytes, kernels="cpu")
        if last
        else 0,
        measured_head=census.head,
        predicted_peak=held + working,
        measured_peak=census.peak,
    )
