"""ClusterSpec: where the job runs (nodes, GPUs per node, GPU type, bandwidth, profile).

A plain frozen dataclass, validated on construction. No torch, no deepspeed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dspipe.errors import SpecError
from dspipe.spec.checks import add_limits, limit, number, positive, show
from dspipe.spec.hardware import GPU_CATALOG, GPU_MTBF_HOURS, GpuType, gpu_type
from dspipe.spec.profile import Profile, apply_profile, check_profile_gpu, profile_from_dict
from dspipe.spec.settings import FIELD_DEFAULT, setting

MIN_GBPS = 1e-3
"""The least --intra/--inter-node-gbps (1 MB/s): far below any interconnect, and every time the plan derives stays a
finite number."""


@dataclass(frozen=True)
class ClusterSpec:
    """Where the job runs."""

    nodes: int = setting(kind="int", limit=2**16, cli_default=1, help="machines")
    """Number of machines."""
    gpus_per_node: int = setting(kind="int", limit=1024, cli_default=8, help="ranks per machine")
    """Ranks per machine (GPUs, or CPU processes on the 'cpu' type)."""
    gpu: str = setting(cli_default="h100-80g", help="GPU type: {gpus}")
    """GPU type, a key of the hardware catalog (dspipe.spec.hardware)."""
    host_memory_gib: float | None = setting(
        None,
        kind="float",
        limit=2.0**20,
        help="host RAM per node [default: --gpu's reference RAM per GPU x --gpus-per-node]",
    )
    """Host RAM per node for offloaded state; None: the GPU type's reference figure per GPU x gpus_per_node
    (hardware.GpuType.host_memory_per_gpu_bytes, e.g. DGX H100: 2 TiB / 8 GPUs)."""
    intra_node_gbps: float | None = setting(
        None, kind="float", limit=1e6, help="bandwidth per GPU inside a node, GB/s [the catalog's or the profile's]"
    )
    """Bandwidth per GPU to peers in the node, GB/s, overriding the catalog's and a profile's (--intra-node-gbps)."""
    inter_node_gbps: float | None = setting(
        None, kind="float", limit=1e6, help="per-GPU share of the network bandwidth across nodes, GB/s [the catalog's]"
    )
    """Per-GPU share of the network bandwidth, GB/s, overriding the catalog's (--inter-node-gbps)."""
    gpu_mtbf_hours: float = setting(
        GPU_MTBF_HOURS,
        kind="float",
        limit=1e9,
        cli_default=FIELD_DEFAULT,
        help="GPU-hours between job-interrupting failures per GPU, for --save-interval auto (Llama 3's rate: 50,700)",
    )
    """Mean time between job-interrupting failures of one GPU, in hours (the job's: this / world size): the failure
    rate --save-interval auto plans against, and the runner re-plans against from each save's measured time."""
    profile: Profile | None = setting(
        None,
        after="host_memory_gib",
        metavar="FILE",
        help="calibration profile from 'dspipe calibrate': its measured compute, bandwidth, latency, copy and "
        "optimizer rates replace the catalog's (gen-config keeps it in the run directory)",
    )
    """A `dspipe calibrate` profile whose figures replace the catalog's in the time model (--profile; a run directory
    keeps it here and in profile.json); from JSON, its profile_to_dict form."""

    def __post_init__(self) -> None:
        positive("cluster", nodes=self.nodes, gpus_per_node=self.gpus_per_node)
        if not isinstance(self.gpu, str):
            raise SpecError(f"cluster.gpu must be a GPU type name, got {show(self.gpu)}")
        gpu_type(self.gpu)
        for name in ("intra_node_gbps", "inter_node_gbps"):
            if getattr(self, name) is not None:
                number(
                    "cluster",
                    name,
                    getattr(self, name),
                    low=MIN_GBPS,
                    high=limit(name),
                    rule=f"must be at least {MIN_GBPS:g} GB/s (1 MB/s)",
                )
        if self.profile is not None:
            if not isinstance(self.profile, Profile):  # read back from dspipe.json
                object.__setattr__(self, "profile", profile_from_dict(self.profile, where="cluster.profile"))
            check_profile_gpu(self.profile, gpu=self.gpu, where="cluster.profile")
        number(
            "cluster",
            "gpu_mtbf_hours",
            self.gpu_mtbf_hours,
            low=0,
            high=limit("gpu_mtbf_hours"),
            low_open=True,
            rule="must be a positive number of hours",
        )
        if self.host_memory_gib is not None:
            number(
                "cluster",
                "host_memory_gib",
                self.host_memory_gib,
                low=0,
                high=limit("host_memory_gib"),
                low_open=True,
                rule="must be positive",
            )

    @property
    def host_memory_bytes(self) -> int:
        """Host RAM per node: --host-memory-gib, else the GPU type's RAM per GPU x gpus_per_node."""
        if self.host_memory_gib is None:
            return self.gpu_type.host_memory_per_gpu_bytes * self.gpus_per_node
        return int(self.host_memory_gib * 1024**3)

    @property
    def host_memory_source(self) -> str:
        """Where host_memory_bytes comes from, for plan output: 'set by --host-memory-gib' or the catalog rule."""
        if self.host_memory_gib is not None:
            return "set by --host-memory-gib"
        per_gpu = self.gpu_type.host_memory_per_gpu_bytes / 1024**3
        return (
            f"{self.gpu} default: {per_gpu:g} GiB per GPU x {self.gpus_per_node} GPUs, docs/hardware.md; "
            f"--host-memory-gib overrides"
        )

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_type(self) -> GpuType:
        """The catalog's entry for `gpu`, with the profile's figures and the bandwidth overrides in place."""
        g = GPU_CATALOG[self.gpu]
        if self.profile is not None:
            g = apply_profile(g, self.profile)
        overrides = {k: v for k in ("intra_node_gbps", "inter_node_gbps") if (v := getattr(self, k)) is not None}
        return replace(g, **overrides) if overrides else g


add_limits(ClusterSpec)
