"""Build this rank's module the way the plan's start-up says (dspipe.planner.startup.build_mode), so that no rank
holds more of the model than its mode needs, and give it its step-0 weights: dspipe's seeded draws
(dspipe.model.gpt.initial_values) or, with train.init_from, the Hugging Face weights read lazily
(dspipe.model.hf_weights.HFWeights). Every mode gives the same step-0 weights as GPT(spec, seed=seed).

    partitioned  ZeRO-3, tp 1, pp 1: constructed under deepspeed.zero.Init (each parameter partitioned as soon
                 as its layer exists, in the training dtype, where offload_param says), then each rank writes only
                 its partition of each tensor (a draw makes the whole tensor, an import reads only the partition's
                 rows); where a partition is not a plain tensor on this rank (NVMe, hpZ), the tensor is gathered,
                 written by rank 0 and re-partitioned (GatheredParameters).
    device       constructed on the meta device, materialised in the training dtype on the accelerator, one
                 tensor at a time; with tp > 1 the layers are first swapped for this rank's tp shards
                 (dspipe.runtime.parallelize.shard_tensor_parallel), so only the shards are materialised, each
                 written from the whole value cut to it (ZeRO-3 then partitions the shard inside
                 deepspeed.initialize). A mixture of experts under expert parallelism (ep > 1): only the dense
                 parameters and this rank's experts [ep_rank x E/ep, (ep_rank + 1) x E/ep) of each sparse block;
                 the other experts stay on the meta device, never drawn (each expert has its own seeded stream,
                 dspipe.model.initial.expert_generator, so skipping one costs nothing) nor read, until
                 dspipe.runtime.moe replaces the SparseMLP by this rank's experts.
    stage        pp > 1: DeepSpeed's PipelineModule builds only this rank's LayerSpecs (with tp > 1 each layer made
                 on the meta device, swapped for its tp shards, materialised in fp32 and given its slice; under
                 expert parallelism each sparse block made with this rank's experts only, as the device mode).
"""

from __future__ import annotations

import os

from dspipe.planner.startup import build_mode
from dspipe.rundir import Run
from dspipe.spec.kinds import BuildMode

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def training_dtype(precision: str):
    import torch

    return getattr(torch, DTYPES[precision])


def build_module(run: Run, *, mpu=None, checkpoint_fn=None, rank: int | None = None, tp=None):
    """The plain GPT (pp=1) or its PipelineModule (pp>1) with its step-0 weights (dspipe.runtime.parallelize wires
    recomputation and sequence parallelism afterwards). `mpu`: the sequence-parallel groups (given to zero.Init's
    config check) or the tensor-parallel grid (a pipeline takes its topology); `checkpoint_fn`: DeepSpeed's
    checkpoint function, a pipeline's for its full recomputation; `rank`: this process's global rank (None:
    torch.distributed's, else 0), whose ep rank is rank % ep; `tp`: this rank's TensorGroup when tp > 1 (the layers
    are swapped for its shards on the meta device, and only the shards are materialised and given values)."""
    plan = run.plan
    mode = build_mode(zero_stage=plan.zero_stage, tp=plan.tp, pp=plan.pp, ep=plan.ep)
    weights = None
    if run.train.init_from:  # a resumed run's checkpoint loads over these after deepspeed.initialize
        from dspipe.model.hf_weights import HFWeights

        weights = HFWeights(run.train.init_from, run.model)
    if mode == BuildMode.STAGE:
        model = _stage(run, checkpoint_fn=checkpoint_fn, weights=weights, tp=tp)
    elif mode == BuildMode.PARTITIONED:
        model = _partitioned(run, weights=weights, mpu=mpu)
    else:
        model = _materialised(run, weights=weights, local=local_experts(run, rank=rank), tp=tp)
    return model


def local_experts(run: Run, *, rank: int | None) -> range | None:
    """The experts of each sparse block this rank holds under expert parallelism (None: every expert; a layout
    dspipe.runtime.moe refuses builds whole and is refused there)."""
    from dspipe.runtime.experts import expert_parallel

    ep, experts = expert_parallel(run), run.model.experts
    if ep <= 1 or not experts or experts % ep:
        return None
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    per = experts // ep
    return range(rank % ep * per, (rank % ep + 1) * per)


def _stage(run: Run, *, checkpoint_fn, weights, tp=None):
    """This rank's pipeline stage; with `tp`, each layer is made on the meta device, swapped for its tp shards,
    materialised in fp32 on the host and given its shard's values (the stage's tp shard is all the rank holds)."""
    import deepspeed

    from dspipe.model.pipeline import build_pipeline

    plan = run.plan
    kwargs = {}
    local = local_experts(run, rank=None)
    if local is not None and tp is None:  # expert parallelism: each stage's sparse blocks only with this rank's experts
        kwargs = dict(make=_layer_maker(weights=weights, local=local))
    if tp is not None:
        from dspipe.runtime.mesh import topology
        from dspipe.runtime.parallelize import vocab_parallel_loss

        kwargs = dict(
            topology=topology(plan.layout),
            make=_layer_maker(weights=weights, tp=tp, local=local),
            loss_fn=vocab_parallel_loss(spec=run.model, tp=tp),
        )
    model = build_pipeline(
        model=run.model,
        stages=plan.pp,
        partition_method=plan.partition_method,
        activation_checkpoint_interval=plan.activation_checkpoint_interval,
        checkpoint_fn=checkpoint_fn or deepspeed.checkpointing.checkpoint,
        seed=run.train.seed,
        **kwargs,
    )
    if tp is not None:
        tp.group = model.mpu().get_slice_parallel_group()
    elif weights is not None and local is None:  # this stage's tensors only
        from dspipe.model.hf_weights import load_into_module

        load_into_module(model, weights, spec=run.model)
    return model


def _layer_maker(*, weights, tp=None, local: range | None = None):
    """make(cls, model, **kwargs) for layer_specs: the layer on the meta device, then in fp32 on the host and given
    its step-0 values (drawn, or read from `weights`). `tp`: swapped for this rank's tp shards first, their values
    drawn whole and cut (or read: only the shard's rows where it is a row range). `local`: the routed experts this
    rank holds under expert parallelism (with tp, the experts spread over tp groups: ep = tp x k); the others stay
    meta (never drawn nor read), then a placeholder without parameters (PipelineModule moves every layer to the
    device: a meta tensor cannot move) until dspipe.runtime.moe keeps this rank's experts."""

    def make(cls, model, **kwargs):
        import torch

        from dspipe.model.gpt import fill

        seed = kwargs.pop("seed", None)
        with torch.device("meta"):
            layer = cls(model, seed=None, **kwargs)
        if tp is not None:
            from dspipe.runtime.parallelize import shard_tensor_parallel
            from dspipe.runtime.tensor_parallel import mark_shards

            shard_tensor_parallel(layer, spec=model, tp=tp, ep=1 if local is None else model.experts // len(local))
        away = _allocate_but(layer, local=local, device="cpu")
        if tp is not None:
            mark_shards(layer)
        if weights is None:
            fill(layer, seed=seed, write=_skip_meta(_write_shard))
        else:
            from dspipe.model.hf_weights import load_into_module

            read = _read_shard(weights) if tp is not None else None
            load_into_module(layer, weights, spec=model, write=_read_or_skip(weights, read), layer=True)
        if away:
            from dspipe.runtime.moe import ExpertElsewhere

            for mlp, experts in away:
                for e in experts:
                    mlp.experts[e] = ExpertElsewhere()
        return layer

    return make


def _allocate_but(module, *, local: range | None, device) -> list:
    """Allocate `module`'s tensors on `device` (uninitialised), all but those of its sparse blocks' routed experts
    outside `local` (None: every expert), which stay meta; (sparse MLP, its experts left meta) for each."""
    from dspipe.model.gpt import SparseMLP

    away = []
    if local is not None:
        for mlp in (m for m in module.modules() if isinstance(m, SparseMLP)):
            away.append((mlp, [e for e in range(len(mlp.experts)) if e not in local]))
    remote = {id(m) for mlp, experts in away for e in experts for m in mlp.experts[e].modules()}
    for m in module.modules():
        if id(m) not in remote:
            m.to_empty(device=device, recurse=False)
    return away


def _skip_meta(write):
    """`write(param, draw)` for the tensors a rank holds; a meta one (another rank's expert) has its draw skipped."""

    def maybe(param, draw) -> None:
        if param.is_meta:
            draw.skip()
        else:
            write(param, draw)

    return maybe


def _write_shard(param, draw) -> None:
    """This rank's shard of the draw, from its blocks of rows: the rows it holds, or each block cut along its later
    dimension (a row-parallel weight's columns); the whole tensor is never made (design: draw the shard's rows of
    the same seeded stream)."""
    from dspipe.model.initial import write_blocks

    write_blocks(param, draw, rows=getattr(param, "tp_rows", None), cut=getattr(param, "tp_shard", None))


def _read_shard(weights):
    from dspipe.runtime.tensor_parallel import read_shard

    return lambda param, name: param.copy_(
        read_shard(param, read_rows=lambda a, b: weights.rows(name, a, b), whole=lambda: weights.full(name))
    )


def _materialised(run: Run, *, weights, local: range | None = None, tp=None):
    """Constructed on the meta device (no memory, no default init), then each tensor allocated in the training
    dtype on its device and written from one fp32 value at a time. `local`: the experts of each sparse block to
    materialise (None: all); the others' parameters stay meta, their draws skipped, their weights not read. `tp`:
    the layers swapped for this rank's tp shards first, each written from the whole value cut to its shard."""
    import torch
    from deepspeed.accelerator import get_accelerator

    from dspipe.model.gpt import GPT, fill

    with torch.device("meta"):
        model = GPT(run.model, seed=None)
    if tp is not None:
        from dspipe.runtime.parallelize import shard_tensor_parallel

        shard_tensor_parallel(model, spec=run.model, tp=tp, ep=1 if local is None else run.model.experts // len(local))
    device = get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0")))
    model = model.to(dtype=training_dtype(run.plan.precision))
    _allocate_but(model, local=local, device=device)
    if tp is not None:
        from dspipe.runtime.tensor_parallel import mark_shards

        mark_shards(model)
    whole = tp is None and local is None  # every tensor whole: the model's own writes
    if weights is None:
        fill(model, seed=run.train.seed, **({} if whole else {"write": _skip_meta(_write_shard)}))
    else:
        from dspipe.model.hf_weights import load_into_module

        read = _read_shard(weights) if tp is not None else None
        load_into_module(model, weights, spec=run.model, write=None if whole else _read_or_skip(weights, read))
    return model


def _read_or_skip(weights, read=None):
    """`write(param, name)` reading the imported tensor (whole, or through `read`) into the tensors a rank holds; a
    meta one (another rank's expert) is not read."""
    read = read or (lambda param, name: param.copy_(weights.full(name)))
    return lambda param, name: None if param.is_meta else read(param, name)


def _partitioned(run: Run, *, weights, mpu):
    """Constructed under deepspeed.zero.Init with the run's config (dtype and offload_param device from it)."""
    import deepspeed
    import torch
    import torch.nn.functional as F

    from dspipe.model.gpt import GPT, fill

    linear = F.linear  # zero.Init's memory_efficient_linear replaces F.linear for the whole process; dspipe's
    try:  # models compute with torch's own (same numerics and memory as the other build modes)
        with deepspeed.zero.Init(config_dict_or_path=run.ds_config, mpu=mpu):
            model = GPT(run.model, seed=None)
    finally:
        F.linear = torch.nn.functional.linear = linear
    with torch.no_grad():
        if weights is None:
            # every rank draws every tensor (the draws of a component share one generator) block by block and keeps
            # its slice
            fill(model, seed=run.train.seed, write=lambda p, draw: write_partition(p, read=_drawn_range(draw)))
        else:
            from dspipe.model.hf_weights import load_into_module

            load_into_module(
                model,
                weights,
                spec=run.model,
                write=lambda p, name: write_partition(p, read=lambda a, b: weights.flat(name, a, b)),
            )
    return model


def _drawn_range(draw):
    """read(start, stop) for write_partition: those elements of the flattened draw, from its blocks of rows (the
    whole tensor is never made; the generator is consumed as by the whole draw)."""
    import math

    import torch

    def read(start: int, stop: int):
        out = torch.empty(stop - start, dtype=torch.float32)
        for row, block in draw.blocks():
            flat = block.reshape(-1)
            first = row * math.prod(block.shape[1:])  # the block's first element in the flattened tensor
            lo, hi = max(start, first), min(stop, first + flat.numel())
            if lo < hi:
                out[lo - start : hi - start] = flat[lo - first : hi - first]
        return out

    return read


def write_partition(param, *, read) -> None:
    """Write this rank's ZeRO-3 partition of `param`: elements [rank x size, (rank + 1) x size) of the flattened
    tensor (DeepSpeed's layout; the tail past the tensor is padding) from `read(start, stop)`, which returns those
    elements in fp32. A partition that is not a plain tensor here (NVMe-swapped, hpZ secondary) goes through
    GatheredParameters: the whole tensor gathered, written by rank 0, broadcast and partitioned again. A tensor
    ZeRO-3 does not partition (a buffer) is written whole."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus

    if not hasattr(param, "ds_tensor"):  # a buffer (a router's selection bias): whole on every rank
        param.copy_(read(0, param.numel()).view(param.shape))
        return
    part = param.ds_tensor
    if (
        getattr(param, "ds_secondary_tensor", None) is not None
        or part.final_location is not None
        or part.status != PartitionedParamStatus.AVAILABLE
    ):
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if dist.get_rank() == 0:
                param.data.copy_(read(0, param.ds_numel).view(param.ds_shape))
        return
    size, total = part.ds_numel, param.ds_numel
    start = size * dist.get_rank(group=param.ds_process_group)
    stop = min(start + size, total)
    if start < stop:
        part.data[: stop - start].copy_(read(start, stop))
