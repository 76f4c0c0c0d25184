"""The hardware catalog and the one rule that maps a detected device to it. Every GPU figure, every list of GPU
types in a help or error text, and every device -> type decision comes from here. Imports no torch at module
level (`detect()` imports it when called)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from dspipe.errors import SpecError

MIB = 1024**2
GIB = 1024**3
CPU_RANKS = 2
"""Ranks on a machine without GPUs (bench, calibrate): 2 CPU ranks on gloo, as the tests run."""


@dataclass(frozen=True)
class GpuType:
    """One accelerator kind from the catalog."""

    name: str
    """Catalog key, e.g. 'h100-80g'."""
    memory_bytes: int
    """Device memory as the driver reports it."""
    peak_bf16_tflops: float
    """Dense bf16 tensor-core peak, TFLOP/s (NVIDIA datasheets, without sparsity: A100 SXM 312, H100 SXM 989, H200
    989)."""
    peak_fp16_tflops: float
    """Dense fp16 tensor-core peak, TFLOP/s (same datasheets: equal to bf16)."""
    peak_fp32_tflops: float
    """Dense fp32 (non-TF32) peak, TFLOP/s (datasheets: A100 19.5, H100 SXM 67, H200 67)."""
    intra_node_gbps: float
    """Per-GPU bandwidth to peers in the node as NCCL achieves it (nccl-tests bus bandwidth of a large ring collective
    on 8 GPUs), GB/s; what a ring reduce-scatter / all-gather moves per GPU per second. A100 (NVLink 3, 300 GB/s line
    rate): 230, 8x A100-SXM4 all_reduce_perf busbw 232.5 GB/s (NVIDIA/nccl-tests#175). H100 (NVLink 4, 450 GB/s line
    rate): 370, NCCL's effective NVLink bandwidth after ~20% protocol overhead, the ring busbw (NCCL maintainer in
    NVIDIA/nccl-tests#212; NVLink SHARP all-reduces reach ~480 busbw, not modelled). H200: the same NVLink 4 switch
    fabric, 370 (its NVLS all-reduce busbw 475 GB/s matches the H100's, NVIDIA/nccl-tests#272). See docs/hardware.md."""
    inter_node_gbps: float
    """Per-GPU share of the node's network bandwidth as NCCL achieves it, GB/s; DGX-class nodes have one NIC per GPU.
    A100 (DGX A100: 8x ConnectX-6 HDR InfiniBand, 200 Gb/s = 25 GB/s line rate): 24, the busbw NCCL reaches per HDR
    NIC (NCCL maintainer in NVIDIA/nccl#412; NVIDIA/nccl#1048 measured 24 GB/s on one HCA). H100 / H200 (DGX H100 /
    H200: 8x ConnectX-7 NDR, 400 Gb/s = 50 GB/s): 46, the low end of the 46-48 GB/s per NDR NIC NCCL's developers quote
    (NVIDIA/nccl-tests#290, #267)."""
    backend: str
    """torch.distributed backend DeepSpeed uses on it."""
    host_memory_per_gpu_bytes: int
    """Host RAM per GPU of the reference system (x GPUs per node = the node's RAM for offload checks): DGX A100 320GB
    1 TiB / 8 GPUs = 128 GiB; DGX A100 640GB 2 TiB / 8 = 256 GiB; DGX H100 and DGX H200 2 TiB / 8 = 256 GiB (NVIDIA
    datasheets). 'cpu': 12 GiB per rank, the 24 GiB development machine split over its default 2 ranks."""
    device_pattern: str
    """Regex matched (case-insensitively) against the name the driver reports; '' for none."""
    min_memory_bytes: int = 0
    """The device must report at least this much memory to match (tells 40 GB from 80 GB parts)."""
    matmul_efficiency: float = 0.5
    """Achieved / peak FLOP/s of a training step's compute (communication excluded: the planner adds it on top).
    Taken from published end-to-end runs, which include communication and every non-matmul kernel, so the compute
    alone runs at least this fast: MosaicML llm-foundry, scripts/train/benchmarking/README.md (bf16, FSDP, flash
    attention, 2k-8k tokens). A100 0.65: "A100 80GB"/"A100 40GB" tables, MFU 0.56-0.64 without activation
    checkpointing (1B-13B), hardware FLOPs utilisation 0.65-0.77 with it (7B-70B). H100 0.48: "H100 80GB BF16" table,
    MFU 0.40-0.46 without checkpointing, HFU 0.48-0.59 with it. H200: the H100's compute die, its figure assumed until
    measured. 'cpu': nominal 0.5 (not a performance model). Not yet calibrated on this project's own GPU runs."""
    host_copy_gbps: float = 25.0
    """Host <-> device bandwidth per GPU for offload traffic, GB/s (pinned copies over PCIe gen4 x16); a
    `dspipe calibrate` profile replaces it with the measured rate."""
    cpu_adam_params_per_s: float = 1.0e9
    """DeepSpeedCPUAdam throughput per node, parameters per second (nominal); a profile replaces it."""
    optimizer_params_per_s: float = 0.0
    """The engine's own (device) Adam step, parameters per second per rank; 0: not modelled (a fused GPU Adam step is
    small beside the compute). A profile measures it: on CPU ranks it is a visible part of the step."""
    ring_base_latency_s: float = 8.4e-6
    """Launch cost of one ring collective: NCCL's own model (src/graph/tuning.cc, Ring / Simple baseLat 8.4 us); a
    profile replaces it with its measured small all-reduce less the per-hop cost."""
    ring_hop_latency_s: float = 3.4e-6
    """Cost of one ring step inside a node: NCCL's hwLat for NVLink, 3.4 us (steps across nodes: estimate's
    RING_HOP_LATENCY_S['inter'])."""
    launch_s: float = 12.0
    """Seconds from a rank's process start to its model build when no op is compiled: Python, the torch and
    DeepSpeed imports, the process group, the data opened (engine.json's seconds_before_build). GPU types: nominal,
    from one H200 demo launch (44.6 s to the first step, FusedAdam's build included); 'cpu': measured on the 2-core
    development machine (dspipe.planner.first_step). A profile folded from a run (`dspipe calibrate --from-run`)
    replaces it and the start-up figures below with the run's own."""
    initialize_s: float = 6.0
    """Seconds from the build's end to the first step when no op is compiled: deepspeed.initialize, the loader."""
    first_step_extra_s: float = 3.0
    """What the first step costs beyond a steady one (allocator warm-up, the kernels' first launches)."""
    jit_build_s: tuple[tuple[str, float], ...] = (("fused_adam", 25.0), ("cpu_adam", 40.0))
    """Seconds to compile each of DeepSpeed's JIT ops a launch finds missing from the extension cache
    (dspipe.cluster.opcache), by op name."""
    rank_base_rss_bytes: int = 0
    """Host RSS of a rank before its build (Python, torch, DeepSpeed, the process group): counted in the memory
    prediction only where the host is the device ('cpu': what the measured peak RSS holds besides the plan)."""
    engine_rss_bytes: int = 0
    """Host RSS deepspeed.initialize adds beyond the plan's states where the host is the device (its buffers, the
    loaded ops, gloo's shared memory)."""
    host_alloc_factor: float = 1.0
    """Resident bytes per byte the plan counts where the host is the device (the allocator's overhead and
    fragmentation; 1 on a GPU, whose peak is torch's own allocated figure)."""
    calibrated_precision: str = ""
    """Precision a profile measured the compute in ('' without a profile): calibrated_tflops applies to it."""
    calibrated_tflops: float = 0.0
    """Measured TFLOP/s per rank of the model's forward + backward at calibrated_precision (0: none)."""

    def peak_tflops(self, precision: str) -> float:
        return {"bf16": self.peak_bf16_tflops, "fp16": self.peak_fp16_tflops, "fp32": self.peak_fp32_tflops}[precision]

    def compute_tflops(self, precision: str) -> float:
        """TFLOP/s per rank the planner assumes for a step's compute: a profile's measured figure at its precision,
        else peak x matmul_efficiency."""
        if self.calibrated_tflops and precision == self.calibrated_precision:
            return self.calibrated_tflops
        return self.peak_tflops(precision) * self.matmul_efficiency

    def jit_seconds(self, op: str) -> float:
        """Seconds to compile `op` (jit_build_s; an op it does not list: the largest it lists)."""
        table = dict(self.jit_build_s)
        return table.get(op, max(table.values(), default=0.0))

    @property
    def host_is_device(self) -> bool:
        """A CPU rank: its memory is the host's, measured as RSS."""
        return self.backend == "gloo"

    def resident_bytes(self, counted: int) -> int:
        """A CPU rank's peak RSS when the plan counts `counted` bytes on its device: the process before its build,
        what deepspeed.initialize adds beyond the plan, and the counted bytes at the allocator's factor."""
        return int(self.rank_base_rss_bytes + self.engine_rss_bytes + self.host_alloc_factor * counted)


# Vendor datasheet figures. 'cpu' is a nominal entry for the 2-rank gloo path (not a performance model).
# Devices report e.g. "NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB";
# where several entries match a name, the one with the larger memory floor is tried first.
GPU_MTBF_HOURS = 50_700
"""Hours between job-interrupting failures per GPU (the default of --gpu-mtbf-hours): Llama 3's 405B pre-training
saw 419 unexpected interruptions in 54 days on 16,384 H100s (Dubey et al. 2024, section 3.3.4):
54 x 24 x 16,384 / 419 = 50,700 GPU-hours."""

GPU_CATALOG: dict[str, GpuType] = {
    g.name: g
    for g in (
        # The 'cpu' type's start-up and memory figures were measured on the 2-core development machine (AMD EPYC,
        # 24 GiB, 2 ranks of 1 thread, torch 2.13 CPU, DeepSpeed 0.19.8) with the demo's GPT (4 x 128, ZeRO-1, fp32),
        # 2026-11-28: a rank's process start to its build 6.9-7.2 s (6.2-7.9 s on 2026-11-30), the build's end to the
        # first step 3.3-4.3 s (0.4-0.7 s since 2026-11-30: no Muon import in deepspeed.initialize, lean_start),
        # the first step 0.1-0.3 s longer than a steady one; compiling DeepSpeed's shared-memory collectives 56 s
        # and FusedAdam 99 s (CPUAdam compiles the same sources); a rank's RSS 327 MiB before its build, 53 MiB more
        # once deepspeed.initialize has allocated what the plan does not count, and 1.6 resident bytes per byte the
        # plan counts at the steps' peak.
        GpuType(
            "cpu",
            16 * 1024 * MIB,
            1.0,
            0.0,
            1.0,
            10.0,
            10.0,
            "gloo",
            12 * GIB,
            "",
            launch_s=7.0,
            initialize_s=0.6,
            first_step_extra_s=0.2,
            jit_build_s=(("deepspeed_shm_comm", 56.0), ("fused_adam", 99.0), ("cpu_adam", 99.0)),
            rank_base_rss_bytes=327 * MIB,
            engine_rss_bytes=53 * MIB,
            host_alloc_factor=1.6,
        ),
        GpuType(
            "a100-40g", 40960 * MIB, 312.0, 312.0, 19.5, 230.0, 24.0, "nccl", 128 * GIB, r"A100", matmul_efficiency=0.65
        ),
        GpuType(
            "a100-80g",
            81920 * MIB,
            312.0,
            312.0,
            19.5,
            230.0,
            24.0,
            "nccl",
            256 * GIB,
            r"A100",
            min_memory_bytes=50 * GIB,
            matmul_efficiency=0.65,
        ),
        GpuType(
            "h100-80g", 81559 * MIB, 989.0, 989.0, 67.0, 370.0, 46.0, "nccl", 256 * GIB, r"H100", matmul_efficiency=0.48
        ),
        GpuType(
            "h200", 143771 * MIB, 989.0, 989.0, 67.0, 370.0, 46.0, "nccl", 256 * GIB, r"H200", matmul_efficiency=0.48
        ),
    )
}


def gpu_names(*, gpus_only: bool = False) -> tuple[str, ...]:
    """Catalog keys in table order (without 'cpu' when `gpus_only`)."""
    return tuple(n for n, g in GPU_CATALOG.items() if not (gpus_only and g.backend == "gloo"))


def names_text(*, gpus_only: bool = False) -> str:
    """The catalog keys as help and error texts list them: 'cpu, h200, ...'."""
    return ", ".join(gpu_names(gpus_only=gpus_only))


def gpu_type(name: str) -> GpuType:
    try:
        return GPU_CATALOG[name]
    except KeyError:
        raise SpecError(f"unknown GPU type {name!r}; valid: {names_text()}") from None


def match_device(device_name: str, *, memory_bytes: int | None = None) -> GpuType | None:
    """The catalog entry for a device's reported name (and memory, where the catalog needs it to decide);
    None for a CPU or a device the catalog does not know. The one device -> type rule."""
    for g in sorted(GPU_CATALOG.values(), key=lambda g: -g.min_memory_bytes):
        if not g.device_pattern or not re.search(g.device_pattern, device_name, re.I):
            continue
        if g.min_memory_bytes and memory_bytes is None:
            if re.search(rf"{g.memory_bytes // GIB}\s*GB", device_name, re.I):  # the size is in the name
                return g
            continue
        if memory_bytes is None or memory_bytes >= g.min_memory_bytes:
            return g
    return None


@dataclass(frozen=True)
class Detected:
    """What this process runs on."""

    device_name: str
    """The driver's name for device 0 ('cpu' without CUDA)."""
    gpu: GpuType | None
    """Its catalog entry ('cpu' without CUDA), None for a GPU the catalog does not know."""


def detect() -> Detected:
    """This machine's device 0 and its catalog entry (imports torch)."""
    import torch

    if not torch.cuda.is_available():
        return Detected("cpu", GPU_CATALOG["cpu"])
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return Detected(p.name, match_device(p.name, memory_bytes=p.total_memory))
