"""How each rank builds its model at start-up, and what that costs before the first step. No torch, no deepspeed.

The runtime (dspipe.runtime.build) builds the way `build_mode` says, so the planner's start-up figures and the
rank's start-up agree by construction:

    partitioned   ZeRO-3, tp 1, pp 1: the module is constructed under deepspeed.zero.Init (every parameter
                  partitioned as soon as its layer exists, in the training dtype, on the device or, with
                  offload_param, on the host); each rank then writes only its partition of each tensor, drawing
                  (or reading from --init-from) one tensor at a time: a random draw in blocks of rows
                  (DRAW_BLOCK), an import whole.
    device        pp 1, otherwise: constructed on the meta device (at tp > 1 its layers swapped for dspipe's
                  tensor-parallel layers, Megatron layout), then the rank's share (the whole model at tp 1, its tp
                  shard at tp > 1) materialised in the training dtype on the accelerator one tensor at a time; the
                  host holds one block of rows of a draw (or one tensor read) at a time, cut to the shard. (ZeRO
                  0-2 keep the rank's share whole on its device; with ZeRO-3 at tp > 1 the shard is built whole
                  on the device and ZeRO-3 partitions it inside deepspeed.initialize.)
    stage         pp > 1: each rank builds only its own pipeline stage (DeepSpeed's LayerSpec), fp32 on the host,
                  then PipelineModule moves it to the device; at tp > 1 each layer is constructed on the meta
                  device and only the rank's tp shard materialised on the host, from one block of rows of a
                  draw (or one tensor read) at a time.

What each mode costs (startup_estimate, called by dspipe.planner.cost.estimate for every candidate): host bytes per
rank while building, the build's device transient, and the seconds of the build (the values a rank draws at
DRAW_RATE, or with --init-from the node's distinct checkpoint bytes at DISK_GBPS; the whole time to the first step,
process start and deepspeed.initialize included, is dspipe.planner.first_step's). A plan fits only if ranks per node
x max(the build's host bytes, the offload's host peak) is within the node's RAM and the transient within the usable
GPU memory (Estimate.fits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from dspipe.spec.dtypes import dtype_bytes
from dspipe.spec.kinds import BuildMode

BUILD_MODES = ("partitioned", "device", "stage")
"""The build modes (the "host" mode of DeepSpeed's AutoTP, the whole model on the host, is retired: dspipe's own
tensor-parallel layers build only the rank's shard)."""


def build_mode(*, zero_stage: int, tp: int, pp: int, ep: int = 1) -> str:
    """Which of BUILD_MODES a rank of this layout uses to build its model (ZeRO-3 at ep > 1: device, the dense
    parameters and the rank's experts, which deepspeed.initialize partitions over their own groups)."""
    if pp > 1:
        return "stage"
    return "partitioned" if zero_stage == 3 and tp == 1 and ep == 1 else "device"


DRAW_RATE = 60e6
"""Elements per second one rank draws for a random initialisation: torch.randn into an fp32 tensor, measured on one
CPU rank of the 2-core development machine (the figure issue 25 gives). A check on the same machine (2026-11-24, one
thread, other jobs running) drew, scaled by the std and cast to bf16 at ~167M/s, so with a core to itself a rank may
start ~2.8x sooner than this predicts. Every rank draws every element its build covers (the whole
model, or its stage), so that all ranks hold the same step-0 values: at tp > 1 too (the draws are whole tensors, then
sliced), so the draws do not divide by tp."""
DISK_GBPS = 2.0
"""Distinct checkpoint bytes one node reads per second (GB/s) at start-up with --init-from: an assumption (a local
NVMe drive or a node's share of a parallel file system), printed with every plan that imports. Ranks of a node that
read the same bytes share the page cache: only the node's distinct bytes count."""
DRAW_BLOCK = 1 << 22
"""Elements of one block of rows of a random draw (dspipe.model.initial.BLOCK: a build writes each tensor's step-0
values block by block and never makes a random tensor whole; an import reads a tensor whole, or a dim-0 shard's
rows)."""
NOT_COUNTED = "the build alone: the process start, deepspeed.initialize and the first step are first_step's terms"
"""What the build's seconds leave out (dspipe.planner.first_step counts the whole time to the first step)."""

MODE_TEXT = {
    "partitioned": "partitioned build (ZeRO-3 under zero.Init)",
    "device": "device build (meta device, materialised on the GPU)",
    "stage": "stage build (each rank its pipeline stage)",
}
"""How `plan` names each build mode."""


@dataclass(frozen=True)
class StartupEstimate:
    """What one plan's start-up costs (per rank unless named per node). No torch."""

    mode: str
    """One of BUILD_MODES (build_mode)."""
    host_build_per_rank_bytes: int
    """Host bytes a rank holds while it builds its module (the mode's formula, startup_estimate)."""
    host_offload_per_rank_bytes: int
    """Host bytes a rank's offload holds at the step's peak (the estimate's steady host figure; 0 without offload)."""
    host_per_rank_bytes: int
    """The larger of the two: a rank's host peak from start-up on (the build comes first, then deepspeed.initialize
    allocates the offload's states)."""
    host_per_node_bytes: int
    """ranks_per_node x host_per_rank_bytes: what the node's host RAM must hold."""
    ranks_per_node: int
    device_bytes: int
    """Device bytes a rank holds while it builds (a transient the GPU must also hold)."""
    seconds: float
    """The build's seconds: the draws at DRAW_RATE, or the node's distinct checkpoint bytes at disk_gbps
    (NOT_COUNTED: the rest of the time to the first step is dspipe.planner.first_step's)."""
    drawn_elements: int
    """Elements one rank draws (0 with --init-from)."""
    read_bytes: int
    """Distinct checkpoint bytes one node reads (0 without --init-from)."""
    import_bytes: int | None
    """Bytes of the --init-from checkpoint's tensors (None: a random initialisation)."""
    disk_gbps: float = DISK_GBPS
    draw_rate: float = DRAW_RATE
    precision: str = "bf16"
    offload_params: bool = False
    tp: int = 1
    """Tensor-parallel ranks: at tp > 1 a rank builds only its shard (holds() says so)."""

    @property
    def build_dominates(self) -> bool:
        """Whether the build, not the offload, sets the host peak."""
        return self.host_build_per_rank_bytes >= self.host_offload_per_rank_bytes

    def holds(self) -> str:
        """What the rank's host peak is made of, in words."""
        if not self.build_dominates:
            return "the offloaded optimizer states, after the build"
        drawn = self.import_bytes is None  # a random draw is made in blocks of rows (DRAW_BLOCK), an import whole
        if self.mode == BuildMode.PARTITIONED:
            own = f", and its {self.precision} partitions offloaded to the host" if self.offload_params else ""
            held = "one block of rows of a drawn fp32 tensor" if drawn else "one fp32 tensor read whole"
            return f"{held}, plus its slice{own}"
        piece = "one block of rows of an fp32 draw" if drawn else "one whole fp32 tensor read"
        if self.mode == BuildMode.DEVICE:
            if self.tp > 1:
                return f"{piece} at a time, cut to the rank's tp {self.tp} shard on the GPU"
            return f"{piece} at a time on its way to the GPU"
        if self.mode == BuildMode.STAGE:
            if self.tp > 1:
                return f"the stage's tp {self.tp} shard in fp32 on the host, plus {piece} at a time"
            return "the stage's layers in fp32 on the host before PipelineModule moves them"
        return self.mode

    def first_step_text(self) -> str:
        """The build's seconds: '~1,150 s (69.0B values drawn per rank at 60M/s, measured on one CPU rank)'."""
        if self.import_bytes is None:
            why = (
                f"{_count(self.drawn_elements)} values drawn per rank at {self.draw_rate / 1e6:.0f}M/s, measured "
                f"on one CPU rank"
            )
        else:
            why = (
                f"{self.read_bytes / 1e9:,.1f} GB of the checkpoint read per node at an assumed {self.disk_gbps:g} GB/s"
            )
        return f"~{_seconds(self.seconds)} ({why})"

    def to_dict(self) -> dict[str, object]:
        """The keys `plan --json` and dspipe.json's estimate carry under "startup"."""
        return {
            "mode": self.mode,
            "build": MODE_TEXT.get(self.mode, self.mode),
            "holds": self.holds(),
            "host_build_per_rank_bytes": self.host_build_per_rank_bytes,
            "host_offload_per_rank_bytes": self.host_offload_per_rank_bytes,
            "host_per_rank_bytes": self.host_per_rank_bytes,
            "host_per_node_bytes": self.host_per_node_bytes,
            "ranks_per_node": self.ranks_per_node,
            "device_bytes": self.device_bytes,
            "seconds": self.seconds,
            "drawn_elements": self.drawn_elements,
            "draw_rate_per_s": self.draw_rate,
            "import_bytes": self.import_bytes,
            "read_bytes_per_node": self.read_bytes,
            "disk_gbps": self.disk_gbps,
            "not_counted": NOT_COUNTED,
        }


def size_text(n: float) -> str:
    """Bytes for a reader: '1,056 GiB', '28.0 GiB', '3.50 GiB', '2.0 MiB'."""
    gib = n / 1024**3
    if gib >= 100:
        return f"{gib:,.0f} GiB"
    if gib >= 10:
        return f"{gib:.1f} GiB"
    if gib >= 1:
        return f"{gib:.2f} GiB"
    return f"{n / 1024**2:,.1f} MiB"


def _count(n: float) -> str:
    """69.0B, 152M, 4.1K."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}" if n / size < 100 else f"{n / size:,.0f}{unit}"
    return f"{n:g}"


def _seconds(s: float) -> str:
    return f"{s:,.0f} s" if s >= 10 else f"{s:.2g} s"


def startup_estimate(
    *,
    mode: str,
    num_params: int,
    stage_params: int,
    largest_tensor: int,
    precision: str,
    offload_params: bool,
    zero_ranks: int,
    tp: int,
    ranks_per_node: int,
    host_offload_per_rank: int,
    import_bytes: int | None = None,
    rank_params: int | None = None,
    stage_elements: int | None = None,
) -> StartupEstimate:
    """The start-up of one plan, rank by rank. Phi = num_params (the whole model, every element a rank's build
    draws without a pipeline), Phi_r = rank_params (the rank's tp shard of it; Phi at tp 1), Phi_s = stage_params
    (the rank's tp shard of its pipeline stage, for `stage`), E_s = stage_elements (that stage's whole elements, which
    the rank draws: Phi_s at tp 1), T = largest_tensor (elements of the largest whole tensor the build draws: the
    stage's for `stage`), H = what the host holds of it (T read whole with --init-from; a random draw's block of rows,
    min(T, 2 x DRAW_BLOCK)), b = 2 for bf16/fp16 else 4, n = zero_ranks (the ZeRO-3 partition count, dp x sp),
    t = tp, g = ranks_per_node.

      host bytes while building:   partitioned (b.Phi/n with offload_params, else 0) + 8H: one tensor's block or
                                                whole tensor, plus its slice
                                   device      8H (cut to the shard at tp > 1)
                                   stage       tp 1: max(4 Phi_s, 8H), the stage's layers in fp32;
                                               tp > 1: 4 Phi_s + 4H, the stage's shard in fp32 and one block (or
                                               tensor read) before it is cut
      device bytes while building: partitioned (0 with offload_params, else b.Phi/n) + b.T; device b.Phi_r;
                                   stage 4 Phi_s
      host per node:               g x max(host while building, host_offload_per_rank)
      seconds to the first step:   random: elements drawn per rank / DRAW_RATE (Phi; E_s for stage: whole tensors
                                   are drawn, so not divided by tp); import: distinct bytes per node / DISK_GBPS,
                                   of import_bytes: partitioned min(1, g/n), device all, stage
                                   min(1, max(1, g/t) x E_s/Phi) (a node's tp ranks read one stage's tensors)."""
    if mode not in BUILD_MODES:
        raise ValueError(f"unknown build mode {mode!r}")
    b = dtype_bytes(precision)
    phi, phi_s, t, n, g = num_params, stage_params, largest_tensor, max(1, zero_ranks), ranks_per_node
    phi_r = phi if rank_params is None else rank_params
    whole_s = phi_s if stage_elements is None else stage_elements
    h = t if import_bytes is not None else min(t, 2 * DRAW_BLOCK)  # a read tensor, or a draw's block of rows
    build = _build_cost(
        mode=mode, b=b, phi=phi, phi_r=phi_r, phi_s=phi_s, s=whole_s, t=t, h=h, n=n, g=g, tp=tp, offload=offload_params
    )
    return _startup(
        build,
        mode=mode,
        import_bytes=import_bytes,
        host_offload_per_rank=host_offload_per_rank,
        ranks_per_node=g,
        precision=precision,
        offload_params=offload_params,
        tp=tp,
    )


class _BuildCost(NamedTuple):
    """What a rank's build holds and draws (startup_estimate's formulas, by mode)."""

    host: int
    device: int
    drawn: int
    share: float
    """The share of import_bytes a node reads."""


def _build_cost(
    *,
    mode: str,
    b: int,
    phi: int,
    phi_r: int,
    phi_s: int,
    s: int,
    t: int,
    h: int,
    n: int,
    g: int,
    tp: int,
    offload: bool,
) -> _BuildCost:
    """The host and device bytes while building, the elements drawn and a node's share of the import, in `mode`
    (s: the stage's whole elements, t: the largest tensor's elements, h: what the host holds of one tensor while it
    is drawn or read)."""
    if mode == BuildMode.PARTITIONED:
        host = (b * phi // n if offload else 0) + 8 * h
        device = (0 if offload else b * phi // n) + b * t  # zero.Init makes each tensor whole, then partitions it
        drawn, share = phi, min(1.0, g / n)
    elif mode == BuildMode.DEVICE:
        host, device, drawn, share = 8 * h, b * phi_r, phi, 1.0
    else:
        host = max(4 * phi_s, 8 * h) if tp == 1 else 4 * phi_s + 4 * h
        groups = max(1, divmod(g, tp)[0])  # tp groups in the node: a group's ranks read one stage's tensors
        device, drawn, share = 4 * phi_s, s, min(1.0, groups * s / phi)
    return _BuildCost(host, device, drawn, share)


def _startup(
    build: _BuildCost,
    *,
    mode: str,
    import_bytes: int | None,
    host_offload_per_rank: int,
    ranks_per_node: int,
    precision: str,
    offload_params: bool,
    tp: int,
) -> StartupEstimate:
    """The StartupEstimate of a build: its seconds to the first step and its host bytes per rank and per node."""
    host, device, drawn, share = build
    g = ranks_per_node
    if import_bytes is None:
        read, seconds = 0, drawn / DRAW_RATE
    else:
        drawn = 0
        read = int(share * import_bytes)
        seconds = read / (DISK_GBPS * 1e9)
    per_rank = max(host, host_offload_per_rank)
    return StartupEstimate(
        mode=mode,
        host_build_per_rank_bytes=host,
        host_offload_per_rank_bytes=host_offload_per_rank,
        host_per_rank_bytes=per_rank,
        host_per_node_bytes=g * per_rank,
        ranks_per_node=g,
        device_bytes=device,
        seconds=seconds,
        drawn_elements=drawn,
        read_bytes=read,
        import_bytes=import_bytes,
        precision=precision,
        offload_params=offload_params,
        tp=tp,
    )
