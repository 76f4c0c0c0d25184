"""What a plan costs: memory, step time and start-up; whether it fits; its throughput.

planner/memory.py's bytes per rank and host on the worst stage, planner/timing.py's seconds per step on the slowest,
planner/startup.py's build before the first step."""

from __future__ import annotations

from dataclasses import dataclass, replace

from dspipe.planner.checkpoint_size import CheckpointSize, checkpoint_size
from dspipe.planner.first_step import FirstStep, first_step
from dspipe.planner.memory import MEMORY_HEADROOM, Memory, host_offload_per_rank, stage_memory
from dspipe.planner.plan import Plan
from dspipe.planner.stages import largest_tensor, stage_elements, stage_largest_tensors, stage_params, zero_group_size
from dspipe.planner.startup import StartupEstimate, build_mode, startup_estimate
from dspipe.planner.timing import step_time
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.hardware import GpuType
from dspipe.spec.model import ModelSpec

STEP_TERMS = (
    ("compute", "compute_s"),
    ("dp comm", "dp_comm_s"),
    ("tp comm", "tp_comm_s"),
    ("sp comm", "sp_comm_s"),
    ("ep comm", "ep_comm_s"),
    ("bubble", "bubble_s"),
    ("pp comm", "pp_comm_s"),
    ("offload", "offload_s"),
    ("optimizer", "optimizer_s"),
)
"""The step's terms, (name as the plan prints it, Estimate's attribute), in the order the step-time line shows them."""


@dataclass(frozen=True)
class Estimate:
    """What a plan costs: memory per GPU and host, and the time of a step split by cause."""

    memory: Memory
    gpu_memory_bytes: int
    host_memory_bytes: int
    """Host RAM needed per node for offloaded state and pinned buffers."""
    host_memory_capacity: int
    compute_s: float
    dp_comm_s: float
    """Data-parallel (ZeRO) collectives not hidden behind the backward pass."""
    bubble_s: float
    pp_comm_s: float
    offload_s: float
    flops_per_token: float
    """Model FLOPs per token (6N + 6Lhs; throughput.py), recomputation excluded: the MFU numerator."""
    hardware_flops_per_token: float
    """FLOPs actually executed per token, recomputation included."""
    tp_comm_s: float = 0.0
    """Tensor-parallel activation all-reduces (synchronous)."""
    sp_comm_s: float = 0.0
    """Ulysses all-to-alls (synchronous)."""
    ep_comm_s: float = 0.0
    """Expert-parallel all-to-alls (MoE dispatch and combine, synchronous)."""
    active_params: int = 0
    """Parameters one token passes through (ModelSpec.active_params; the MFU's N)."""
    optimizer_s: float = 0.0
    """The engine's own optimizer step over the rank's shard (GpuType.optimizer_params_per_s; 0 where not modelled)."""
    dp_after_step_s: float = 0.0
    """Of dp_comm_s, the all-gather of the updated parameters inside the engine's optimizer step (ZeRO-1 / 2)."""
    headroom: float = MEMORY_HEADROOM
    """Fraction of GPU memory the plan must leave free."""
    matmul_efficiency: float = 0.5
    """Achieved / peak FLOP/s assumed for the compute (the GPU type's catalog figure, or a profile's measured rate
    over the peak)."""
    startup: StartupEstimate | None = None
    """What the start-up costs: host RAM per node while the ranks build their modules (or hold their offload),
    the device transient of the build, the time to the first step (dspipe.planner.startup)."""
    checkpoint: CheckpointSize | None = None
    """One checkpoint on disk: every rank's files, and the most one rank writes (dspipe.planner.checkpoint_size)."""
    first_step: FirstStep | None = None
    """The time to the end of the first step, whole (dspipe.planner.first_step; ops assumed cached until the caller
    looks at this machine's cache: with_ops)."""
    resident_bytes: int | None = None
    """Where the host is the device (CPU ranks): a rank's predicted peak RSS (GpuType.resident_bytes); else None."""

    def with_ops(self, missing: tuple[str, ...] | None, *, gpu: GpuType) -> Estimate:
        """This estimate with the first step's JIT term for the ops this machine's cache lacks."""
        if self.first_step is None:
            return self
        fs = self.first_step
        return replace(self, first_step=first_step(gpu=gpu, build_s=fs.build_s, step_s=fs.step_s, missing_ops=missing))

    @property
    def step_time_s(self) -> float:
        return (
            self.compute_s
            + self.dp_comm_s
            + self.bubble_s
            + self.pp_comm_s
            + self.offload_s
            + self.tp_comm_s
            + self.sp_comm_s
            + self.ep_comm_s
            + self.optimizer_s
        )

    @property
    def usable_gpu_memory_bytes(self) -> int:
        """GPU memory a plan may use: (1 - headroom) x the device's."""
        return int(self.gpu_memory_bytes * (1 - self.headroom))

    @property
    def fits(self) -> bool:
        """The step's peak within the usable GPU memory, the offload's host bytes within the node's RAM, and the
        start-up too: the node's host peak from the build on, and the build's device transient."""
        return (
            self.memory.total <= self.usable_gpu_memory_bytes
            and self.host_memory_bytes <= self.host_memory_capacity
            and not self.startup_host_shortfall_bytes
            and not self.startup_device_shortfall_bytes
        )

    @property
    def startup_host_shortfall_bytes(self) -> int:
        """Host bytes per node the start-up needs beyond the node's RAM (0: it fits)."""
        if self.startup is None:
            return 0
        return max(0, self.startup.host_per_node_bytes - self.host_memory_capacity)

    @property
    def startup_device_shortfall_bytes(self) -> int:
        """Device bytes the build's transient needs beyond the usable GPU memory (0: it fits)."""
        if self.startup is None:
            return 0
        return max(0, self.startup.device_bytes - self.usable_gpu_memory_bytes)

    @property
    def shortfall_bytes(self) -> int:
        return max(0, self.memory.total - self.usable_gpu_memory_bytes)


def _plan_startup(
    *, model: ModelSpec, cluster: ClusterSpec, plan: Plan, host_per_rank: int, import_bytes: int | None
) -> StartupEstimate:
    """Start-up: what each rank builds (or imports) before its first step, on the stage with the most parameters."""
    stages = stage_params(model=model, pp=plan.pp, partition_method=plan.partition_method, tp=plan.tp, ep=plan.ep)
    # MoE (tp 1, ZeRO 0-2: the device or the stage build): a rank materialises the dense parameters and its own
    # experts / ep of every sparse block (of its stage's), which the expert-parallel wrapper keeps
    built = max(stages) if model.experts else plan.num_params
    worst = max(range(len(stages)), key=lambda i: stages[i])
    largest = largest_tensor(model)
    if plan.pp > 1 and plan.tp > 1:  # the stage whose shard plus its largest tensor is the most
        tensors = stage_largest_tensors(model, plan.pp, plan.partition_method, plan.tp)
        worst = max(range(len(stages)), key=lambda i: stages[i] + tensors[i])
        largest = tensors[worst]
    whole = stage_elements(model, plan.pp, plan.partition_method, plan.tp, plan.ep)  # what a stage's rank draws
    return startup_estimate(
        mode=build_mode(zero_stage=plan.zero_stage, tp=plan.tp, pp=plan.pp, ep=plan.ep),
        num_params=built,
        rank_params=max(stages) if plan.pp == 1 else None,
        stage_params=stages[worst],
        stage_elements=max(whole),
        largest_tensor=largest,
        precision=plan.precision,
        offload_params=plan.offload_params,
        zero_ranks=zero_group_size(plan),
        tp=plan.tp,
        ranks_per_node=cluster.gpus_per_node,
        host_offload_per_rank=host_per_rank,
        import_bytes=import_bytes,
    )


def estimate(
    *,
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: Plan,
    headroom: float = MEMORY_HEADROOM,
    import_bytes: int | None = None,
) -> Estimate:
    """The plan's memory, time and start-up. `import_bytes`: bytes of the --init-from checkpoint's tensors
    (dspipe.model.hf_weights.check_weights), None for a random initialisation."""
    memory, phi = stage_memory(model=model, cluster=cluster, plan=plan)
    host_per_rank = host_offload_per_rank(model=model, plan=plan)
    startup = _plan_startup(
        model=model, cluster=cluster, plan=plan, host_per_rank=host_per_rank, import_bytes=import_bytes
    )
    t = step_time(model=model, cluster=cluster, plan=plan, phi=phi)
    gpu = cluster.gpu_type
    est = Estimate(
        memory=memory,
        gpu_memory_bytes=cluster.gpu_type.memory_bytes,
        host_memory_bytes=int(cluster.gpus_per_node * host_per_rank),
        host_memory_capacity=cluster.host_memory_bytes,
        compute_s=t.compute_s,
        dp_comm_s=t.dp_comm_s,
        bubble_s=t.bubble_s,
        pp_comm_s=t.pp_comm_s,
        offload_s=t.offload_s,
        flops_per_token=t.flops_per_token,
        hardware_flops_per_token=t.hardware_flops_per_token,
        tp_comm_s=t.tp_comm_s,
        sp_comm_s=t.sp_comm_s,
        ep_comm_s=t.ep_comm_s,
        active_params=model.active_params,
        headroom=headroom,
        matmul_efficiency=t.matmul_efficiency,
        optimizer_s=t.optimizer_s,
        dp_after_step_s=t.dp_after_step_s,
        startup=startup,
        checkpoint=checkpoint_size(model=model, plan=plan, ranks_per_node=cluster.gpus_per_node),
        resident_bytes=gpu.resident_bytes(memory.total) if gpu.host_is_device else None,
    )
    return replace(
        est, first_step=first_step(gpu=gpu, build_s=startup.seconds, step_s=est.step_time_s, missing_ops=None)
    )


def throughput(*, est: Estimate, model: ModelSpec, cluster: ClusterSpec, plan: Plan) -> tuple[float, float]:
    """(tokens/s, MFU) of the plan."""
    tokens_per_s = plan.tokens_per_step / est.step_time_s
    peak = cluster.world_size * cluster.gpu_type.peak_tflops(plan.precision) * 1e12
    return tokens_per_s, tokens_per_s * est.flops_per_token / peak
