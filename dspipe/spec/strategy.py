"""StrategySpec: how the work is split (ZeRO, offload, pp, tp, sp, ep) and where state lives.

A plain frozen dataclass, validated on construction; dspipe.spec.core.StrategyRequest is the strategy as asked for,
each field possibly left to the planner. No torch, no deepspeed.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspipe.errors import SpecError
from dspipe.spec.checks import absolute_dir, add_limits, flag, int_range, one_of, positive, text
from dspipe.spec.settings import setting
from dspipe.spec.values import CHECKPOINTING, OFFLOADS, PARTITION_METHODS, ZERO_STAGES

ZERO3_KNOBS = ("prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "max_reuse_distance")
"""StrategySpec fields that only ZeRO-3 reads: given, they restrict the plan to ZeRO-3 (dspipe.planner.plan)."""


@dataclass(frozen=True)
class StrategySpec:
    """How the work is split and where state lives."""

    zero: int = setting(1, kind="auto_choice", choices=("0", "1", "2", "3"), help="ZeRO stage [auto]")
    """ZeRO stage 0-3 (0: plain data parallel)."""
    offload: str = setting("none", kind="auto_choice", choices=OFFLOADS, help="optimizer state offload [auto]")
    """Where optimizer states live: none (GPU), cpu or nvme."""
    offload_params: bool = setting(
        False, kind="bool", flag="--offload-params/--no-offload-params", help="offload parameters too (ZeRO-3) [auto]"
    )
    """Also offload parameters to the offload device (ZeRO-3 only)."""
    nvme_path: str | None = setting(None, help="NVMe directory for --offload nvme (enables it in auto)")
    """Directory on a local NVMe drive, required for nvme offload."""
    pp: int = setting(1, kind="auto_int", limit=4096, help="pipeline stages [auto]")
    """Pipeline stages; data parallel size is world / (pp x tp x sp)."""
    tp: int = setting(
        1,
        kind="auto_int",
        limit=4096,
        help="tensor-parallel ranks per replica (dspipe's Megatron-layout layers), inside a node [auto]",
    )
    """Tensor-parallel ranks per replica (dspipe's tensor-parallel layers, Megatron layout, inside a node)."""
    tp_sp: bool = setting(
        True,
        kind="bool",
        flag="--tp-sp/--no-tp-sp",
        help="Megatron sequence parallelism with tp > 1: activations between the tensor-parallel "
        "regions split along the sequence [on]",
    )
    """Megatron sequence parallelism with tp > 1 (all-gather / reduce-scatter instead of all-reduce; the activations
    outside the tensor-parallel regions divide by tp). Never worse: the same traffic, less memory and compute."""
    immediate_grad_update: bool = setting(
        True,
        kind="bool",
        flag="--immediate-grad-update/--no-immediate-grad-update",
        help="bf16 with ZeRO-1: add each 16-bit gradient into the fp32 accumulation buffer as soon as it is "
        "produced, and free it (DeepSpeed's bf16.immediate_grad_update) [on]",
    )
    """DeepSpeed's bf16.immediate_grad_update: where its BF16_Optimizer runs (bf16, ZeRO-1, no offload) every
    16-bit gradient is added into the fp32 accumulation buffer by a hook as soon as it is produced, and freed, so
    the 16-bit gradients (2 bytes per parameter) are never all alive at once; the same sums in the same order
    (measured: losses, gradient norms and weights bitwise equal to off). Rendered as given; DeepSpeed reads it
    nowhere else."""
    sp: int = setting(
        1, kind="auto_int", limit=4096, help="sequence-parallel ranks per replica, DeepSpeed-Ulysses [auto: 1]"
    )
    """Sequence-parallel ranks per replica (DeepSpeed-Ulysses)."""
    ep: int = setting(
        1,
        kind="auto_int",
        limit=4096,
        help="expert-parallel ranks: each holds experts / ep of every MoE block, inside the data-parallel ranks [auto]",
    )
    """Expert-parallel ranks (DeepSpeed MoE): the routed experts split over ep data-parallel ranks, which exchange
    tokens by all-to-all; ep divides dp and the experts."""
    checkpointing: str = setting(
        "none", kind="auto_choice", choices=CHECKPOINTING, help="activation recomputation [auto]"
    )
    """Activation recomputation: none, full (per block) or selective (attention core)."""
    recompute_blocks: int = setting(
        0,
        kind="auto_int",
        limit=2**20,
        help="with --checkpointing full, recompute only the first N blocks of each pipeline stage; the others keep "
        "their activations (Megatron's --recompute-method block; 0: every block) [auto: every block, or the "
        "fewest that fit when --checkpointing is auto too]",
    )
    """Full recomputation of only the first N blocks of each pipeline stage (Megatron-LM's --recompute-granularity
    full --recompute-method block --recompute-num-layers N): those blocks keep their input, the others everything
    their backward needs, so the recomputation costs N / (the stage's blocks) of a forward instead of a whole one.
    0: every block. A stage with at most N blocks recomputes them all."""
    loss_chunk: int = setting(
        0,
        kind="int",
        limit=2**24,
        help="tokens per chunk of the cross-entropy: the head's logits are made one chunk at a "
        "time, never whole (0: the full logits) [0]",
    )
    """Tokens per chunk of the loss (dspipe.model.loss): only one chunk's logits exist at a time, liger-kernel's
    fused linear cross-entropy on CUDA where installed; 0: the full logits and lm_loss. Plain GPT and the pipeline's
    last stage, tp 1 (tensor parallelism has its own vocab-parallel loss)."""
    partition_method: str = setting(
        "parameters", kind="auto_choice", choices=PARTITION_METHODS, help="pipeline partition [{default}]"
    )
    """How the pipeline splits layers into stages: parameters, uniform or type:Block."""
    reduce_bucket_size: int | None = setting(
        None, kind="int", limit=2**40, help="gradient reduce / all-gather bucket, elements [hidden^2, at least 2^20]"
    )
    """Elements per gradient reduce bucket; None: hidden^2 (at least 2^20)."""
    prefetch_bucket_size: int | None = setting(
        None, kind="int", limit=2**40, help="ZeRO-3 prefetch bucket, elements [0.9 hidden^2, at least 2^20]"
    )
    """ZeRO-3 parameter prefetch in elements; None: 0.9 hidden^2 (at least 2^20)."""
    param_persistence_threshold: int | None = setting(
        None, kind="int", limit=2**40, help="ZeRO-3: keep parameters smaller than this whole [10 hidden]"
    )
    """ZeRO-3 keeps parameters smaller than this whole on every rank; None: 10 hidden."""
    max_live_parameters: int | None = setting(
        None,
        kind="int",
        limit=2**40,
        help="ZeRO-3: prefetch only while fewer elements are gathered [prefetch bucket + largest tensor]",
    )
    """ZeRO-3 prefetches only while fewer elements are gathered; None: the prefetch bucket + the largest tensor."""
    max_reuse_distance: int | None = setting(
        None,
        kind="int",
        limit=2**40,
        help="ZeRO-3: keep a module gathered if reused within this many elements [prefetch bucket]",
    )
    """ZeRO-3 keeps a module gathered if the trace reuses it within this many elements; None: the prefetch bucket."""

    def __post_init__(self) -> None:
        one_of("strategy", "zero", self.zero, ZERO_STAGES)
        one_of("strategy", "offload", self.offload, OFFLOADS)
        one_of("strategy", "checkpointing", self.checkpointing, CHECKPOINTING)
        one_of("strategy", "partition_method", self.partition_method, PARTITION_METHODS)
        flag("strategy", "offload_params", self.offload_params)
        flag("strategy", "tp_sp", self.tp_sp)
        flag("strategy", "immediate_grad_update", self.immediate_grad_update)
        text("strategy", "nvme_path", self.nvme_path, optional=True)
        if self.nvme_path is not None:
            absolute_dir("strategy", "nvme_path", self.nvme_path)
        positive("strategy", pp=self.pp, tp=self.tp, sp=self.sp, ep=self.ep)
        for name in ("reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold"):
            if getattr(self, name) is not None:
                positive("strategy", **{name: getattr(self, name)})
        for name in ("max_live_parameters", "max_reuse_distance"):
            if getattr(self, name) is not None:
                int_range("strategy", name, getattr(self, name), low=0)
        int_range("strategy", "loss_chunk", self.loss_chunk, low=0)
        int_range("strategy", "recompute_blocks", self.recompute_blocks, low=0)
        if self.recompute_blocks and self.checkpointing != "full":
            raise SpecError(
                f"strategy.recompute_blocks {self.recompute_blocks} needs checkpointing full (got "
                f"{self.checkpointing}): it is how many of each stage's blocks full recomputation re-runs"
            )


add_limits(StrategySpec)
