"""The engine seam: build the module, its parameter groups and the DeepSpeed engine, check that the live engine
uses the planned settings, and run train and eval steps. One small interface, two implementations: `PlainEngine`
(pp = 1: the GPT module, micro-batch by micro-batch) and `PipelineEngine` (pp > 1: DeepSpeed's PipelineEngine,
whole batches through its 1F1B schedule). The runner, `dspipe bench`, evaluation and the memory census use it.

Tensor parallelism is dspipe's own Megatron-layout layers (dspipe.runtime.tensor_parallel), swapped in before the
module is materialised (each rank builds only its shard); DeepSpeed gets the process groups as its mpu
(dspipe.runtime.mesh: a PipelineModule's own grid, else a data x sequence x tensor Mesh). Sequence parallelism is
DeepSpeed-Ulysses: the Mesh's sequence groups go to `deepspeed.initialize` as its mpu (so gradients are reduced over
data x sequence ranks; its model-parallel group is the tp group, of 1 rank without tp),
each block's attention becomes a DistributedAttention (dspipe.runtime.parallelize), and PlainEngine feeds every sp
rank its slice of each sequence.
"""

from __future__ import annotations

import copy
import math
import time

from dspipe.rundir import Run
from dspipe.runtime.build import build_module
from dspipe.runtime.experts import expert_parallel
from dspipe.runtime.parallelize import checkpoint_function, parallelize, recomputed_blocks
from dspipe.spec.kinds import Offload, Precision
from dspipe.spec.layout import ParallelLayout


def to_device(tensor, device):
    """`tensor` (a host batch) on `device`. On CUDA through pinned memory with a non-blocking copy: a copy from
    pageable memory makes the host wait for the device's queue (CUDA's sync debug mode flagged the two of every
    micro-batch on the H200), which leaves the GPU idle while the host launches the next micro-batch's first
    kernels. The caching host allocator keeps the pinned buffer until the copy is done."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def param_groups(module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay matrices and embeddings, not biases or LayerNorm weights (1-d tensors). The shape is
    the tensor's own: a parameter built partitioned under zero.Init holds an empty 1-d placeholder (its ds_shape is
    the real one), which would otherwise put every tensor in the no-decay group."""
    decay, no_decay = [], []
    for p in module.parameters():
        if p.requires_grad:
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def engine_settings(engine) -> dict:
    """What the live engine actually uses, read from the engine and its optimizer, not from our JSON."""
    import torch.distributed as dist

    from dspipe.runtime.moe import live_ep

    module = engine.module
    zero_opt = engine.optimizer
    return {
        "zero_stage": int(engine.zero_optimization_stage()),
        "gradient_clipping": float(engine.gradient_clipping()),
        "bf16": bool(engine.bfloat16_enabled()),
        "fp16": bool(engine.fp16_enabled()),
        "param_dtype": str(next(module.parameters()).dtype).replace("torch.", ""),
        "grad_accum_dtype": str(engine.get_data_types()[1]).replace("torch.", ""),
        "train_batch_size": int(engine.train_batch_size()),
        "micro_batch": int(engine.train_micro_batch_size_per_gpu()),
        "grad_accum": int(engine.gradient_accumulation_steps()),
        "dp": dp_world_size(engine),
        "pp": int(getattr(engine, "num_stages", 1)),
        "tp": _tensor_parallel_size(engine),
        "tp_sharded_params": _tp_sharded_params(module),
        "tp_sequence_parallel": _tp_sequence_parallel(module),
        "tp_unreduced_params": len(tp_unreduced_params(module)),
        "sp": max(1, int(getattr(engine, "sequence_parallel_size", 1) or 1)),
        "ep": live_ep(module),
        "wrapper_optimizer": type(zero_opt).__name__,
        # DeepSpeed's BF16_Optimizer's (bf16.immediate_grad_update); None where another optimizer runs, which reads
        # no such setting
        "immediate_grad_update": getattr(zero_opt, "immediate_grad_update", None),
        "base_optimizer": type(engine.basic_optimizer).__name__,
        "offload_optimizer": bool(
            getattr(zero_opt, "cpu_offload", False) or getattr(zero_opt, "offload_optimizer", False)
        ),
        "offload_param": bool(getattr(zero_opt, "offload_param", False)),
        "activation_checkpoint_interval": int(getattr(module, "activation_checkpoint_interval", 0)),
        "blocks": held_blocks(module),
        "recomputed_blocks": recomputed_blocks(module),
        "compiled_blocks": compiled_modules(module),
        **loss_settings(engine),
        "scheduler": type(engine.lr_scheduler).__name__,
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
    }


def held_blocks(module) -> int:
    """Transformer blocks `module` holds (the plain GPT's, or this pipeline stage's)."""
    from dspipe.model.gpt import Block

    return sum(1 for part in module.modules() if isinstance(part, Block))


def compiled_modules(module) -> int:
    """Submodules of `module` that run through torch.compile (nn.Module.compile set their compiled call)."""
    return sum(1 for part in module.modules() if getattr(part, "_compiled_call_impl", None) is not None)


def loss_settings(engine) -> dict:
    """How the module computes its loss: 'loss' in words ('full logits', or the chunked loss and its kernel on
    this engine's device: liger-kernel's on CUDA where installed) and 'loss_chunk' (0: the full logits; None on a
    pipeline stage without the head)."""
    from dspipe.model.loss import HeadLoss

    module = engine.module
    loss = getattr(module, "head_loss", None) or getattr(getattr(module, "loss_fn", None), "loss", None)
    if isinstance(loss, HeadLoss):
        return {"loss": loss.describe(str(engine.device).split(":")[0]), "loss_chunk": loss.chunk}
    if int(getattr(engine, "num_stages", 1)) > 1 and not engine.is_last_stage():
        return {"loss": "none on this stage", "loss_chunk": None}
    return {"loss": "full logits", "loss_chunk": 0}


def dp_world_size(engine) -> int:
    """Data-parallel replicas as the engine sees them (under the Ulysses mpu DeepSpeed keeps only the
    sequence x data group: its size / sp)."""
    if engine.dp_world_size is not None:
        return int(engine.dp_world_size)
    return int(engine.seq_dp_world_size) // int(engine.sequence_parallel_size)


def _tensor_parallel_size(engine) -> int:
    """The tp group size of the engine's mpu (a pipeline's grid), 1 without one."""
    mpu = getattr(engine, "grid", None) or getattr(engine, "mpu", None)
    size = getattr(mpu, "get_slice_parallel_world_size", None)
    return int(size()) if size is not None else 1


def _tp_sequence_parallel(module) -> bool:
    """Whether the module's tensor-parallel layers run Megatron's sequence parallelism."""
    from dspipe.runtime.tensor_parallel import TensorGroup

    return any(isinstance(getattr(m, "tp", None), TensorGroup) and m.tp.sequence_parallel for m in module.modules())


def _tp_sharded_params(module) -> int:
    """How many of the module's parameters are tensor-parallel shards (dspipe.runtime.tensor_parallel marks them
    tensor_model_parallel); 0 means no layer was swapped."""
    return sum(1 for p in module.parameters() if getattr(p, "tensor_model_parallel", False))


def tp_unreduced_params(module) -> list[str]:
    """The q/k norm weights (replicated, but applied to this rank's heads only) whose gradient is not summed over
    the tensor-parallel group (not a ReducedRMSNorm) in a tensor-parallel module: every tp rank would step them with
    its own heads' share of the gradient and the replicas drift apart (measured: 0.1 apart after 6 steps)."""
    from dspipe.runtime.tensor_parallel import ReducedRMSNorm

    if not _tp_sharded_params(module):
        return []
    return [
        f"{name}.weight"
        for name, m in module.named_modules()
        if name.endswith(("attn.q_norm", "attn.k_norm")) and not isinstance(m, ReducedRMSNorm)
    ]


def check_engine(settings: dict, run: Run) -> None:
    """Refuse to train when a value we asked for did not reach the engine (silent config drift)."""
    plan = run.plan
    wanted = {
        "zero_stage": plan.zero_stage,
        "gradient_clipping": run.train.grad_clip,
        "bf16": plan.precision == Precision.BF16,
        "fp16": plan.precision == Precision.FP16,
        "train_batch_size": plan.ds_train_batch_size,
        "micro_batch": plan.micro_batch,
        "grad_accum": plan.grad_accum,
        "dp": plan.dp,
        "pp": plan.pp,
        "tp": plan.tp,
        "sp": plan.sp,
        "ep": expert_parallel(run),
        "offload_optimizer": plan.offload != Offload.NONE,
        "offload_param": plan.offload_params,
        "activation_checkpoint_interval": plan.activation_checkpoint_interval,
        "world_size": plan.world_size,
        "tp_sequence_parallel": plan.tp > 1 and plan.tp_sp,
    }
    drift = {k: (v, settings[k]) for k, v in wanted.items() if settings[k] != v}
    if plan.tp > 1 and settings["tp_sharded_params"] == 0:
        drift["tp_sharded_params"] = ("> 0", 0)  # no layer was swapped for its shards
    if plan.tp > 1 and settings["tp_unreduced_params"]:
        drift["tp_unreduced_params"] = (0, settings["tp_unreduced_params"])  # q/k norms whose gradient is not summed
    if settings["recomputed_blocks"] != plan.recomputed(settings["blocks"]):
        drift["recomputed_blocks"] = (plan.recomputed(settings["blocks"]), settings["recomputed_blocks"])
    compiled = settings["blocks"] if run.train.compile else 0  # every block the rank holds, or none
    if settings["compiled_blocks"] != compiled:
        drift["compiled_blocks"] = (compiled, settings["compiled_blocks"])
    live = settings["immediate_grad_update"]
    if live is not None and live != plan.immediate_grad_update:  # the 16-bit gradients kept, or freed, unasked
        drift["immediate_grad_update"] = (plan.immediate_grad_update, live)
    if settings["loss_chunk"] is not None and settings["loss_chunk"] != plan.loss_chunk:
        drift["loss_chunk"] = (plan.loss_chunk, settings["loss_chunk"])  # the loss in chunks, or not, unasked
    if drift:
        raise RuntimeError(
            "engine does not use the planned settings: "
            + ", ".join(f"{k} planned {a} live {b}" for k, (a, b) in drift.items())
        )


class Engine:
    """A DeepSpeed engine built from a run directory, behind the few calls the loop needs."""

    def __init__(self, engine, *, run: Run, layout: ParallelLayout, rank: int):
        self.engine, self.run, self.layout, self.rank = engine, run, layout, rank
        self.aux_loss: float | None = None
        """A mixture-of-experts model's load-balancing loss of the last train step (mean over micro-batches and
        data-parallel ranks, before aux_loss_coef); None for a dense model."""
        self.expert_load: float | None = None
        """A mixture-of-experts model's load imbalance of the last train step (dspipe.runtime.moe.load_ratio: the
        busiest expert's tokens over the mean, worst sparse block; 1 is balanced); None for a dense model."""
        self.dropped_routes: int | None = None
        """A mixture-of-experts model's routes dropped by the capacity in the last train step, over all ranks (0:
        dropless); None for a dense model."""
        self.phases: tuple[float, float, float] | None = None
        """Seconds of the last train step's forward passes, backward passes and optimizer steps (summed over its
        micro-batches), where they are exact: a CPU rank without a pipeline (its calls are synchronous); None
        elsewhere. metrics.csv keeps them; `dspipe calibrate --from-run` corrects the plan's terms by them."""
        self.settings = engine_settings(engine)
        check_engine(self.settings, run)
        grid = getattr(engine, "grid", None)  # the pipeline's own topology must agree with the layout
        if grid is not None and grid.get_data_parallel_rank() != self.dp_rank:
            raise RuntimeError(
                f"rank {rank}: DeepSpeed's grid says dp rank {grid.get_data_parallel_rank()}, "
                f"the layout ({layout.describe()}) says {self.dp_rank}"
            )

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: which slice of each global batch it reads."""
        return self.layout.dp_rank(self.rank)

    @property
    def reads_data(self) -> bool:
        """Whether this rank consumes batches (under a pipeline only the first and last stages do)."""
        return True

    @property
    def device(self):
        return self.engine.device

    def train_step(self, batches) -> float:
        """One optimizer step over grad_accum micro-batches from `batches`; the loss averaged over micro-batches
        and data-parallel ranks, the same on every rank."""
        raise NotImplementedError

    def _after_moe_step(self) -> None:
        """The step's expert loads and dropped routes (one all_reduce): their imbalance into `expert_load`, the
        drops into `dropped_routes`, and with router_bias_rate the selection biases moved (aux-loss-free
        balancing)."""
        from dspipe.runtime.moe import load_ratio, step_counts, update_router_bias

        loads, self.dropped_routes = step_counts(self.engine.module, spec=self.run.model, device=self.device)
        self.expert_load = load_ratio(loads)
        if self.run.model.router_bias_rate:
            update_router_bias(self.engine.module, loads=loads, rate=self.run.model.router_bias_rate)

    def eval_loss(self, batches, *, count: int) -> float:
        """Mean loss over `count` micro-batches per data-parallel rank, dropout off, the same on every rank."""
        raise NotImplementedError


class PlainEngine(Engine):
    """pp = 1: forward, backward and step per micro-batch; DeepSpeed steps the optimizer at the boundary.
    With sp > 1 every rank of a replica gets the same whole sequences and keeps its slice; its loss is its share
    of the replica's (dspipe.runtime.sequence.loss_share)."""

    def micro_loss(self, inputs, labels):
        """The loss of one micro-batch of whole sequences, as this rank contributes it (forward only)."""
        sp = self.layout.sp
        if sp == 1:
            return self.engine(to_device(inputs, self.device), to_device(labels, self.device))
        from dspipe.runtime.sequence import local_slice, loss_share

        start, stop = self.layout.sequence_slice(inputs.shape[1], self.rank)
        inputs, labels = (to_device(local_slice(t, start=start, stop=stop), self.device) for t in (inputs, labels))
        return loss_share(self.engine(inputs, labels), sp=sp)

    def train_step(self, batches) -> float:
        import torch

        engine, total = self.engine, torch.zeros(3, device=self.device)
        timed = self.device.type == "cpu"
        phases = [0.0, 0.0, 0.0]
        for _ in range(self.run.plan.grad_accum):
            inputs, labels = next(batches)
            t0 = time.perf_counter()
            loss = self.micro_loss(inputs, labels)
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()
            t3 = time.perf_counter()
            for i, seconds in enumerate((t1 - t0, t2 - t1, t3 - t2)):
                phases[i] += seconds
            total += self._parts(loss)
        self.phases = (phases[0], phases[1], phases[2]) if timed else None
        if self.run.model.experts:
            self._after_moe_step()
        return self._reported(self._mean(total, count=self.run.plan.grad_accum))

    def eval_loss(self, batches, *, count: int) -> float:
        import torch

        engine, total = self.engine, torch.zeros(3, device=self.device)
        engine.eval()
        with torch.no_grad():
            for inputs, labels in batches:
                total += self._parts(self.micro_loss(inputs, labels))
        engine.train()
        aux_loss = self.aux_loss
        try:
            return self._reported(self._mean(total, count=count))
        finally:
            self.aux_loss = aux_loss  # the training step's stays the one reported

    def _parts(self, loss):
        """(loss, LM loss, aux loss) of one micro-batch: a mixture-of-experts model's loss adds aux_loss_coef x its
        load-balancing loss to the LM loss, which the model records (GPT.last_lm_loss, last_aux_loss)."""
        import torch

        loss = loss.detach().float()
        if not self.run.model.experts:
            return torch.stack([loss, loss, torch.zeros_like(loss)])
        module = self.engine.module
        return torch.stack([loss, module.last_lm_loss.float(), module.last_aux_loss.float()])

    def _reported(self, means: list[float]) -> float:
        """The LM loss (NaN when the whole loss is not finite), the aux loss kept in `aux_loss`."""
        loss, lm, aux = means
        self.aux_loss = aux if self.run.model.experts else None
        return lm if math.isfinite(loss) else loss

    def _mean(self, total, *, count: int) -> list[float]:
        """Sum over every rank / (count x dp x tp): each tensor-parallel rank holds its replica's loss, the
        sequence-parallel ranks' shares add up to it."""
        import torch.distributed as dist

        dist.all_reduce(total)
        return [float(v) / (count * self.layout.loss_holders) for v in total.tolist()]


class PipelineEngine(Engine):
    """pp > 1: DeepSpeed's PipelineEngine runs whole batches (1F1B) and broadcasts the mean loss to every stage."""

    @property
    def reads_data(self) -> bool:
        return self.engine.is_first_stage() or self.engine.is_last_stage()

    def train_step(self, batches) -> float:
        loss = float(self.engine.train_batch(data_iter=batches if self.reads_data else None))
        if self.run.model.experts:
            self._after_moe_step()
            self.aux_loss = self._stage_aux_mean()
        return loss

    def _stage_aux_mean(self) -> float:
        """The step's load-balancing loss as the plain model reports it (the mean over sparse blocks, micro-batches
        and data-parallel ranks): every stage's blocks' recorded losses summed over all ranks (one all_reduce; the
        tp ranks of a stage record the same losses, each the whole sequence's)."""
        import torch.distributed as dist

        from dspipe.runtime.moe import take_aux_total

        total = take_aux_total(self.engine.module, device=self.device)
        dist.all_reduce(total)
        count = len(self.run.model.sparse_layers) * self.engine.gradient_accumulation_steps() * self.layout.dp
        count *= self.layout.tp
        return float(total) / count

    def eval_loss(self, batches, *, count: int) -> float:
        return float(self.engine.eval_batch(batches if self.reads_data else None, num_micro_batches=count))


def build_engine(run: Run, *, clock=None) -> Engine:
    """Collective (the process group must be up): module -> parallelize -> deepspeed.initialize -> live-settings
    check. `clock` (a dspipe.runtime.startup.StartupClock) is marked before and after the module build."""
    import deepspeed
    import torch.distributed as dist

    from dspipe.runtime.lean_start import without_muon
    from dspipe.runtime.moe import expert_parallel, install_for_run
    from dspipe.runtime.moe import param_groups as moe_param_groups
    from dspipe.runtime.reshard import universal_checkpoint_info

    plan, rank = run.plan, dist.get_rank()
    mpu, tp = None, None
    if plan.tp > 1:
        from dspipe.runtime.mesh import Mesh, tensor_group

        tp = tensor_group(plan.layout, rank=rank, sequence_parallel=plan.tp_sp)
        if plan.pp == 1:  # a PipelineModule builds its grid (and sets tp.group) itself
            mpu = Mesh(plan.layout, rank=rank)
            tp.group = mpu.get_tensor_model_parallel_group()
    elif plan.sp > 1:
        from dspipe.runtime.mesh import Mesh

        # not DeepSpeed's parallel_state_sp, which names the sequence group its model-parallel group: its
        # BF16_Optimizer (bf16 ZeRO-1) then leaves every replicated gradient out of the norm on sequence ranks > 0
        # and fails at the first step ("stack expects a non-empty TensorList")
        mpu = Mesh(plan.layout, rank=rank)
    checkpoint_fn = checkpoint_function(run)
    if clock:
        clock.mark("before_build")
    module = build_module(run, mpu=mpu, checkpoint_fn=checkpoint_fn, tp=tp)
    if clock:
        clock.mark("built", module=module)
    # how DeepSpeed's universal checkpoint re-cuts the tp shards (saved with every checkpoint: resume at another layout)
    module.universal_checkpoint_info = universal_checkpoint_info(run.model)
    parallelize(
        module, plan=run.plan, rank=dist.get_rank(), checkpoint_fn=checkpoint_fn, mpu=mpu, compile_=run.train.compile
    )
    groups = param_groups(module, run.train.weight_decay)
    if run.model.experts or expert_parallel(run) > 1:  # sparse blocks onto DeepSpeed's MoE layer (or the refusal)
        install_for_run(module, run=run, rank=dist.get_rank())
        groups = moe_param_groups(param_groups(module, run.train.weight_decay))  # experts: groups of their own
    without_muon(optimizer=run.ds_config.get("optimizer", {}).get("type", ""))  # dspipe.runtime.lean_start: 3 s a rank
    # the config as read and checked (an elastic restart's smaller dp changed its gradient accumulation in memory)
    engine, _, _, _ = deepspeed.initialize(
        model=module, model_parameters=groups, config=copy.deepcopy(run.ds_config), mpu=mpu
    )
    if run.model.experts and run.plan.pp > 1:  # a stage's blocks give their load-balancing losses their gradient
        from dspipe.runtime.moe import set_aux_scale

        set_aux_scale(engine.module, spec=run.model, grad_accum=engine.gradient_accumulation_steps())
    cls = PipelineEngine if run.plan.pp > 1 else PlainEngine
    return cls(engine, run=run, layout=run.plan.layout, rank=dist.get_rank())
