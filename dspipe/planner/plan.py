"""Specs -> Plan: every derived value, after DeepSpeed's rules are checked. No torch, no deepspeed."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import lru_cache

from dspipe.errors import SpecError
from dspipe.jsonio import show
from dspipe.model.tp_split import vocab_split as vocab_rows
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.kinds import Checkpointing, Offload, Precision
from dspipe.spec.layout import ParallelLayout
from dspipe.spec.model import ModelSpec
from dspipe.spec.strategy import ZERO3_KNOBS, StrategySpec
from dspipe.spec.train import TrainSpec

MIN_BUCKET = 1 << 20  # elements; h^2 buckets for tiny models would mean thousands of tiny collectives


@dataclass(frozen=True)
class Plan:
    """Resolved strategy and every number derived from the specs; downstream code reads, never recomputes."""

    world_size: int
    """Total ranks = nodes x gpus_per_node."""
    dp: int
    """Data-parallel replicas = world_size / (pp x tp x sp)."""
    pp: int
    """Pipeline stages."""
    micro_batch: int
    """Sequences per rank per forward/backward."""
    grad_accum: int
    """Micro-batches per optimizer step = global_batch / (micro_batch x dp)."""
    global_batch: int
    """Sequences per optimizer step."""
    zero_stage: int
    """ZeRO stage 0-3."""
    offload: str
    """Optimizer state device: none, cpu, nvme."""
    offload_params: bool
    """Parameters offloaded too (ZeRO-3)."""
    nvme_path: str | None
    """NVMe swap directory, or None."""
    precision: str
    """bf16, fp16 or fp32."""
    grad_accum_dtype: str
    """dtype DeepSpeed accumulates gradients in (data_types.grad_accum_dtype)."""
    checkpointing: str
    """none, full or selective activation recomputation."""
    activation_checkpoint_interval: int
    """Pipeline layers per checkpoint (0: off); full recomputation checkpoints every block."""
    partition_method: str
    """PipelineModule partition_method."""
    reduce_bucket_size: int
    """Elements per gradient reduce bucket (given, or max(h^2, 2^20))."""
    allgather_bucket_size: int
    """Elements per ZeRO-1/2 parameter all-gather bucket."""
    prefetch_bucket_size: int
    """ZeRO-3 parameter prefetch, elements (0.9 h^2)."""
    param_persistence_threshold: int
    """ZeRO-3 keeps parameters smaller than this gathered (10 h)."""
    max_live_parameters: int
    """stage3_max_live_parameters, elements: ZeRO-3 prefetches only while fewer are gathered (prefetch bucket + the
    largest tensor, so the module computing and a full prefetch bucket always fit)."""
    max_reuse_distance: int
    """stage3_max_reuse_distance, elements: a module's parameters stay gathered after it runs only if the next this
    many elements of the trace use them again (the prefetch bucket: the head at the forward/backward turn)."""
    overlap_comm: bool
    """Overlap gradient reduction with backward (off under a pipeline, as DeepSpeed forces)."""
    contiguous_gradients: bool
    """Copy gradients into one contiguous buffer as they are produced."""
    num_params: int
    """Model parameters, tied embedding counted once."""
    tokens_per_step: int
    """global_batch x seq_len."""
    pin_memory: bool
    """Pin host buffers of offloaded state (GPUs only; there is nothing to pin for on CPU)."""
    backend: str
    """torch.distributed backend for the GPU type (nccl or gloo)."""
    tp: int = 1
    """Tensor-parallel ranks per replica."""
    sp: int = 1
    """Sequence-parallel ranks per replica."""
    reduce_scatter: bool = True
    """ZeRO reduces gradients by reduce-scatter (off for ZeRO-3 with sp > 1: stage 3's averaging lacks the sp
    correction there and gradients come out 1/sp of their value)."""
    ep: int = 1
    """Expert-parallel ranks (DeepSpeed MoE's ep_size): each holds experts / ep of every sparse block; 1 for a dense
    model."""
    experts: int = 0
    """Routed experts per sparse block (0: a dense model)."""
    tp_sp: bool = False
    """Megatron sequence parallelism with tp > 1: the activations outside the tensor-parallel regions split along
    the sequence over the tp ranks (all-gather / reduce-scatter instead of all-reduce)."""
    loss_chunk: int = 0
    """Tokens per chunk of the cross-entropy (dspipe.model.loss): one chunk's logits at a time; 0: the full logits."""
    immediate_grad_update: bool = True
    """DeepSpeed's bf16.immediate_grad_update (StrategySpec.immediate_grad_update, rendered as given): under its
    BF16_Optimizer (bf16_optimizer below) each 16-bit gradient goes into the fp32 buffer as it is produced and is
    freed."""
    recompute_blocks: int = 0
    """Under full recomputation, the first this many blocks of each pipeline stage are recomputed and the others keep
    their activations (Megatron's block method); 0: every block."""

    def __post_init__(self) -> None:
        for name in ("world_size", "dp", "pp", "tp", "sp"):  # named as dspipe.json writes them, before the layout
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SpecError(f"plan.{name} must be a positive integer, got {show(value)}")
        if self.layout.dp != self.dp:
            raise SpecError(f"plan.dp {self.dp} disagrees with its layout: {self.layout.describe()}")

    @property
    def ds_batch_ranks(self) -> int:
        """Ranks DeepSpeed 0.19.8's batch check counts as data-parallel: dp (the mpu's data-parallel group holds
        neither the tp ranks of dspipe's tensor-parallel layers nor the sequence-parallel ranks of the Ulysses
        mpu)."""
        return self.dp

    @property
    def ds_train_batch_size(self) -> int:
        """train_batch_size as DeepSpeed checks it: micro_batch x grad_accum x ds_batch_ranks (= global_batch)."""
        return self.micro_batch * self.grad_accum * self.ds_batch_ranks

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel ranks (DeepSpeed's expert data parallel group): dp / ep ranks hold the same experts,
        and ZeRO partitions their gradients and optimizer states over them; at tp > 1 dp / (ep / tp): whole on
        every tp rank (ep 1) or spread over the tp group (ep = tp: dspipe.runtime.experts.folded) dp, over k tp groups
        (ep = tp x k: beyond_tp) dp / k."""
        return self.dp // max(1, self.ep // self.tp)

    def recomputed(self, blocks: int) -> int:
        """How many of a stage's `blocks` blocks the backward recomputes: every one under full recomputation (the
        first recompute_blocks of them when that is set), none otherwise (selective recomputes only the attention
        core)."""
        if self.checkpointing != Checkpointing.FULL:
            return 0
        return min(self.recompute_blocks, blocks) if self.recompute_blocks else blocks

    @property
    def recomputation(self) -> str:
        """The recomputation in words: none, selective, full, or full (first N blocks of each stage)."""
        if self.checkpointing == Checkpointing.FULL and self.recompute_blocks:
            n = self.recompute_blocks
            return f"full (first {n} block{'s' if n != 1 else ''} of each stage)"
        return self.checkpointing

    @property
    def bf16_optimizer(self) -> bool:
        """DeepSpeed 0.19.8 runs its BF16_Optimizer (a whole gradient accumulation buffer in grad_accum_dtype beside
        the 16-bit gradients, the fp32 master weights and Adam's moments partitioned over the data-parallel ranks):
        bf16 with ZeRO-1 and fp32 gradient accumulation, no offload, and bf16 ZeRO-0 under a pipeline, with bf16
        gradient accumulation (engine._do_optimizer_sanity_check)."""
        if self.precision != Precision.BF16 or self.offload != Offload.NONE:
            return False
        return self.zero_stage == 1 or (self.zero_stage == 0 and self.pp > 1)

    @property
    def layout(self) -> ParallelLayout:
        """Who is who among the world's ranks; the one place the world is divided."""
        return ParallelLayout(world=self.world_size, pp=self.pp, tp=self.tp, sp=self.sp)


class RuleError(SpecError):
    """A strategy one of DeepSpeed's rules refuses: the one-line message, and the rule's number (rules are checked in
    order; a later number means the input got further)."""

    def __init__(self, rule: int, message: str) -> None:
        super().__init__(message)
        self.rule = rule


def check_rules(*, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, strategy: StrategySpec) -> None:
    """DeepSpeed's rules (design notes section 5), each failing with a one-line message that shows the numbers.
    search() tries a refused strategy's other micro-batches only after rule 4 (the batch equation) and never its
    other recomputation modes: a rule that reads train.micro_batch or strategy.checkpointing must change that."""
    world, pp, zero, tp, sp = cluster.world_size, strategy.pp, strategy.zero, strategy.tp, strategy.sp
    if pp > model.layers:
        raise RuleError(1, f"pipeline stages {pp} > layers {model.layers}: every stage needs at least one block")
    if world % (pp * tp * sp):
        raise RuleError(
            2,
            f"world size {world} ({cluster.nodes} nodes x {cluster.gpus_per_node} GPUs) is not "
            f"divisible by pp {pp} x tp {tp} x sp {sp} = {pp * tp * sp}",
        )
    _check_experts(model=model, train=train, strategy=strategy, world=world)
    _check_tensor_sequence(model=model, cluster=cluster, train=train, strategy=strategy)
    if pp > 1 and zero >= 2:
        raise RuleError(
            3,
            f"ZeRO-{zero} with pp {pp}: DeepSpeed's pipeline engine supports ZeRO stages 0-1 only; "
            f"use --zero 1 (optimizer states still sharded over dp "
            f"{ParallelLayout(world=world, pp=pp, tp=tp, sp=sp).dp})",
        )
    dp = ParallelLayout(world=world, pp=pp, tp=tp, sp=sp).dp
    if train.global_batch % (train.micro_batch * dp):
        raise RuleError(
            4,
            f"global batch {train.global_batch} is not divisible by micro_batch {train.micro_batch} "
            f"x dp {dp} = {train.micro_batch * dp}",
        )
    if strategy.offload_params and zero != 3:
        raise RuleError(5, f"--offload-params needs ZeRO-3 (got ZeRO-{zero}): only stage 3 partitions parameters")
    stage3 = [
        f"--{name.replace('_', '-')} {getattr(strategy, name)}"
        for name in ZERO3_KNOBS
        if getattr(strategy, name) is not None
    ]
    if stage3 and zero != 3:
        raise RuleError(
            5, f"{', '.join(stage3)} needs ZeRO-3 (got ZeRO-{zero}): only stage 3 gathers and prefetches parameters"
        )
    if strategy.offload_params and strategy.offload == Offload.NONE:
        raise RuleError(6, "--offload-params needs an offload device: --offload cpu or --offload nvme")
    if strategy.offload != Offload.NONE and zero == 0:
        raise RuleError(7, f"--offload {strategy.offload} needs ZeRO 1-3 (got ZeRO-0): offload moves ZeRO's partitions")
    if strategy.offload == Offload.NVME and zero != 3:
        raise RuleError(8, f"--offload nvme needs ZeRO-3 (ZeRO-Infinity), got ZeRO-{zero}; use --offload cpu")
    if strategy.offload == Offload.NVME and not strategy.nvme_path:
        raise RuleError(9, "--offload nvme needs --nvme-path DIR on a local NVMe drive")
    if strategy.nvme_path and strategy.offload != Offload.NVME:
        raise RuleError(9, f"--nvme-path {strategy.nvme_path} needs --offload nvme (got --offload {strategy.offload})")
    if train.precision == Precision.FP16 and cluster.gpu == "cpu":
        raise RuleError(10, "fp16 is not supported by DeepSpeed's CPU accelerator; use --precision bf16 or fp32")
    if train.warmup_steps >= train.steps:
        raise RuleError(11, f"warmup_steps {train.warmup_steps} must be < steps {train.steps}")


TP_SP_ZERO3_REFUSAL = (
    "DeepSpeed 0.19.8 partitions a module built outside zero.Init over the mpu's data-parallel "
    "group (parameter_offload.py _convert_to_zero_parameters) but reduces its gradients over the "
    "sequence-data-parallel group: measured, the losses leave the plain model's at step 4; use "
    "--zero 1 or --zero 2"
)
"""Why ZeRO-3 with tp > 1 and Ulysses sp > 1 together is refused (ZeRO-3 with tp alone, and ZeRO 1-2 with tp x sp,
train the plain model's losses: tests/distributed/test_tp_pp.py, test_startup.py)."""


def _check_tensor_sequence(*, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, strategy: StrategySpec) -> None:
    """What dspipe's tensor-parallel layers (Megatron layout: tp inside a node, composed with the pipeline, ZeRO
    0-3 and Ulysses) and DeepSpeed 0.19.8's Ulysses support (design notes sections 7 and 8)."""
    tp, sp, g = strategy.tp, strategy.sp, cluster.gpus_per_node
    if tp > 1:
        _check_tensor(model=model, train=train, strategy=strategy, gpus_per_node=g)
    if sp > 1:
        _check_sequence(model=model, strategy=strategy)


def _check_tensor(*, model: ModelSpec, train: TrainSpec, strategy: StrategySpec, gpus_per_node: int) -> None:
    """_check_tensor_sequence's rules for tp > 1."""
    tp, sp, zero, g = strategy.tp, strategy.sp, strategy.zero, gpus_per_node
    if g % tp:
        raise RuleError(
            2,
            f"tp {tp} does not divide the {g} GPUs per node: tensor-parallel ranks exchange "
            f"activations in every layer and must share one node (tp across nodes is refused)",
        )
    for name, value in (("heads", model.heads), ("kv_heads", model.kv_groups), ("ffn", model.ffn)):
        if value % tp:
            raise RuleError(2, f"model {name} {value} is not divisible by tp {tp} ({value} / {tp} = {value / tp:g})")
    per, last = vocab_rows(model.vocab, tp)
    if last < 1:
        raise RuleError(
            2,
            f"model vocab {model.vocab} over tp {tp}: ceil({model.vocab} / {tp}) = {per} rows per "
            f"rank leaves the last rank {last} (vocab - {tp - 1} x {per}); the vocab-parallel "
            f"embedding and head need at least 1 row on every rank",
        )
    tokens = model.seq_len // sp if model.seq_len % sp == 0 else model.seq_len
    if strategy.tp_sp and tokens % tp:
        raise RuleError(
            2,
            f"model seq_len {model.seq_len} / sp {sp} = {tokens} tokens per rank are not divisible "
            f"by tp {tp}: Megatron sequence parallelism splits them over the tp ranks; use --no-tp-sp "
            f"or a seq_len divisible by {sp * tp}",
        )
    if strategy.loss_chunk:
        raise RuleError(
            3,
            f"loss_chunk {strategy.loss_chunk} with tp {tp}: the tensor-parallel head computes a "
            f"vocab-parallel cross-entropy of its ceil({model.vocab} / {tp}) = {per} vocabulary rows "
            f"(no chunked loss there); use --loss-chunk 0 or --tp 1",
        )
    if zero == 0 and train.precision != Precision.FP32:
        raise RuleError(
            3,
            f"tp {tp} with ZeRO-0 in {train.precision}: DeepSpeed's ZeRO-0 {train.precision} "
            f"optimizer reports and clips by the gradient norm of rank 0's shards only; "
            "use --zero 1 or 2",
        )


def _check_sequence(*, model: ModelSpec, strategy: StrategySpec) -> None:
    """_check_tensor_sequence's rules for sp > 1."""
    tp, sp, pp, zero = strategy.tp, strategy.sp, strategy.pp, strategy.zero
    for name, value in (("heads", model.heads), ("seq_len", model.seq_len)):
        if value % sp:
            raise RuleError(
                2,
                f"model {name} {value} is not divisible by sp {sp} "
                f"({value} / {sp} = {value / sp:g}): "
                f"Ulysses splits the sequence, then the heads, across the sp ranks",
            )
    if tp > 1 and (model.heads // tp) % sp:
        raise RuleError(
            2,
            f"model heads {model.heads} / tp {tp} = {model.heads // tp} heads per tp rank are not "
            f"divisible by sp {sp}: Ulysses spreads each tp rank's heads over the sp ranks",
        )
    if tp > 1 and zero == 3:
        raise RuleError(3, f"ZeRO-3 with tp {tp} x sp {sp}: {TP_SP_ZERO3_REFUSAL}")
    if pp > 1:
        raise RuleError(
            3,
            f"sp {sp} with pp {pp}: DeepSpeed's pipeline engine cannot carry Ulysses sequence "
            f"shards (its partitioned pipe tensors and gradient reduction ignore the sp group); "
            "use sp or pp",
        )


def _check_experts(*, model: ModelSpec, train: TrainSpec, strategy: StrategySpec, world: int) -> None:
    """What dspipe's mixture-of-experts training supports: on DeepSpeed 0.19.8's native MoE layer
    (deepspeed.moe.layer.MoE) ZeRO 0-2 at tp 1 (ep > 1: ZeRO 1-2, ZeRO-1 with contiguous gradients), any pp (each
    stage its own sparse blocks), ep dividing the experts and dp; under ZeRO-3 the model's own SparseMLP at any ep
    (at ep > 1 each rank its experts, partitioned over their expert-data-parallel group); with tp > 1 (Megatron
    sequence parallelism on: each tp rank routes its slice's tokens) the model's own, at ep 1 whole on every tp rank
    or at ep = tp spread over the tp group (dspipe.runtime.experts.native_layer, folded), at ep = tp x k (k > 1)
    over k whole tp groups (beyond_tp: DeepSpeed's layer under ZeRO 1-2, the model's own under ZeRO-3); every
    layout's experts run
    through dspipe.runtime.dispatch, so a capacity factor applies to any of them; bf16 or fp32, sp 1; ep 1 for a
    dense model."""
    e, ep, pp, tp, sp, zero = model.experts, strategy.ep, strategy.pp, strategy.tp, strategy.sp, strategy.zero
    dp = ParallelLayout(world=world, pp=pp, tp=tp, sp=sp).dp  # rule 2 held: pp x tp x sp divides the world
    if not e:
        if ep > 1:
            raise RuleError(3, f"ep {ep} needs a mixture-of-experts model: {model.name} is dense (experts 0)")
        return
    if tp > 1 and ep > 1 and ep % tp:
        raise RuleError(
            3,
            f"tp {tp} and experts {e} at ep {ep}: with tensor parallelism the experts are spread over whole tp "
            f"groups (each tp rank routes its slice of the sequence to their holders), so ep must be 1 or a "
            f"multiple of tp = {tp}; ep % tp = {ep % tp}",
        )
    if tp > 1 and not strategy.tp_sp:
        raise RuleError(
            3,
            f"tp {tp} with experts {e} and --no-tp-sp: each tp rank would run every token through the replicated "
            f"experts (tp x their FLOPs); with Megatron sequence parallelism (--tp-sp, as Megatron-Core requires "
            f"for MoE) each runs its 1/{tp} of the sequence",
        )
    if sp > 1:
        raise RuleError(
            3,
            f"sp {sp} with experts {e}: dspipe trains mixture-of-experts models with sp 1 only (DeepSpeed's MoE "
            f"layer is not wired to the Ulysses sequence groups); use --sp 1 and expert parallelism (--ep)",
        )
    if train.precision == Precision.FP16:
        raise RuleError(
            3,
            f"fp16 with experts {e}: dspipe trains mixture-of-experts models in bf16 or fp32 only "
            f"(not tested with fp16 loss scaling); use --precision bf16",
        )
    if e % ep:
        raise RuleError(
            3,
            f"ep {ep} does not divide experts {e}: each expert-parallel rank holds experts / ep of "
            f"every MoE block ({e} / {ep} = {e / ep:g})",
        )
    if tp > 1 and ep > tp and dp % (ep // tp):
        raise RuleError(
            3,
            f"ep {ep} = tp {tp} x {ep // tp} does not divide into dp {dp} = world {world} / (pp {pp} x tp {tp} x "
            f"sp {sp}): an expert-parallel group is {ep // tp} whole tp groups of neighbouring data-parallel ranks "
            f"(dp % {ep // tp} = {dp % (ep // tp)})",
        )
    if dp % ep and tp == 1:
        raise RuleError(
            3,
            f"ep {ep} does not divide dp {dp} = world {world} / (pp {pp} x tp {tp} x sp {sp}): the "
            f"expert-parallel groups are made of data-parallel ranks",
        )
    if zero == 0 and ep > 1:
        raise RuleError(
            3,
            f"ep {ep} under ZeRO-0 with experts {e}: DeepSpeed 0.19.8 clips by a gradient norm that is "
            f"not the model's under expert parallelism (measured 0.6813 where ep 1 gives 0.6823); use "
            f"ZeRO-1 or 2, or ep 1",
        )


def _grad_accum_dtype(*, precision: str, zero: int, pp: int) -> str:
    if precision == Precision.BF16:
        # ZeRO 1-3 (and the pipeline's bf16 optimizer) keep fp32 gradient partitions; plain DP in bf16
        # must accumulate in the model dtype (DeepSpeed refuses the bf16/fp32 mix without ZeRO).
        return "fp32" if zero >= 1 else "bf16"
    return precision


def _default(value: int | None, default: int) -> int:
    """The strategy's value where it gives one (0 included), else the planner's default."""
    return default if value is None else value


@lru_cache(maxsize=256)
def _largest_tensor(model: ModelSpec) -> int:
    """Elements of the model's largest parameter tensor (cached: a large MoE model declares tens of thousands)."""
    return max(math.prod(shape) for _, shape in model.model_tensors())


def make_plan(*, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, strategy: StrategySpec) -> Plan:
    check_rules(model=model, cluster=cluster, train=train, strategy=strategy)
    world, pp, zero, h = cluster.world_size, strategy.pp, strategy.zero, model.hidden
    layout = ParallelLayout(world=world, pp=pp, tp=strategy.tp, sp=strategy.sp)
    dp = layout.dp
    prefetch = strategy.prefetch_bucket_size or max(int(0.9 * h * h), MIN_BUCKET)
    return Plan(
        world_size=world,
        dp=dp,
        pp=pp,
        micro_batch=train.micro_batch,
        grad_accum=train.global_batch // (train.micro_batch * dp),
        global_batch=train.global_batch,
        zero_stage=zero,
        offload=strategy.offload,
        offload_params=strategy.offload_params,
        nvme_path=strategy.nvme_path if strategy.offload == Offload.NVME else None,
        precision=train.precision,
        grad_accum_dtype=_grad_accum_dtype(precision=train.precision, zero=zero, pp=pp),
        checkpointing=strategy.checkpointing,
        activation_checkpoint_interval=1 if (pp > 1 and strategy.checkpointing == Checkpointing.FULL) else 0,
        partition_method=strategy.partition_method,
        reduce_bucket_size=strategy.reduce_bucket_size or max(h * h, MIN_BUCKET),
        allgather_bucket_size=strategy.reduce_bucket_size or max(h * h, MIN_BUCKET),
        prefetch_bucket_size=prefetch,
        param_persistence_threshold=strategy.param_persistence_threshold or 10 * h,
        max_live_parameters=_default(strategy.max_live_parameters, prefetch + _largest_tensor(model)),
        max_reuse_distance=_default(strategy.max_reuse_distance, prefetch),
        overlap_comm=zero >= 2 and pp == 1,
        # ZeRO-1 with ep > 1 trains off ep 1 in DeepSpeed 0.19.8 unless its gradients are contiguous (measured:
        # dspipe.runtime.experts.EP_ZERO1_REFUSAL)
        contiguous_gradients=zero >= 2 or (zero == 1 and strategy.ep > 1),
        num_params=model.num_params,
        tokens_per_step=train.global_batch * model.seq_len,
        pin_memory=cluster.gpu_type.backend == "nccl",
        backend=cluster.gpu_type.backend,
        tp=layout.tp,
        sp=layout.sp,
        reduce_scatter=not (zero == 3 and layout.sp > 1),
        ep=strategy.ep,
        experts=model.experts,
        tp_sp=strategy.tp_sp and layout.tp > 1,
        loss_chunk=strategy.loss_chunk,
        recompute_blocks=strategy.recompute_blocks,
        immediate_grad_update=strategy.immediate_grad_update,
    )


def check_plan(plan: Plan, *, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, strategy: StrategySpec) -> None:
    """A plan read back from disk against the specs beside it: DeepSpeed's rules hold, and every field equals what
    make_plan derives from those specs (a hand-edited or damaged plan is refused, naming the first field that
    disagrees and both values)."""
    expected = make_plan(model=model, cluster=cluster, train=train, strategy=strategy)
    # causes
    first = ("world_size", "pp", "tp", "sp", "ep", "experts", "zero_stage", "precision", "micro_batch", "global_batch")
    for name in (*first, *(f.name for f in fields(Plan) if f.name not in first)):  # before consequences (dp)
        have, want = getattr(plan, name), getattr(expected, name)
        if have != want or type(have) is not type(want):
            why = {
                "world_size": f"nodes {cluster.nodes} x gpus_per_node {cluster.gpus_per_node}",
                "dp": f"world {expected.world_size} / (pp {expected.pp} x tp {expected.tp} x sp {expected.sp})",
                "grad_accum": f"global_batch {train.global_batch} / (micro_batch {train.micro_batch} x dp "
                f"{expected.dp})",
                "zero_stage": f"strategy.zero {strategy.zero}",
                "pp": f"strategy.pp {strategy.pp}",
                "tp": f"strategy.tp {strategy.tp}",
                "sp": f"strategy.sp {strategy.sp}",
                "ep": f"strategy.ep {strategy.ep}",
                "experts": f"model.experts {model.experts}",
                "precision": f"train.precision {train.precision!r}",
                "micro_batch": f"train.micro_batch {train.micro_batch}",
                "global_batch": f"train.global_batch {train.global_batch}",
            }.get(name, "model/cluster/train/strategy")
            shown = repr(have) if len(repr(have)) <= 40 else repr(have)[:37] + "..."
            raise SpecError(f"plan.{name} {shown} disagrees with {why}, which give {want!r}")
