"""The environment every rank needs on a cluster, written to `.deepspeed_env` for DeepSpeed's launcher. No torch.

DeepSpeed's runner reads `KEY=VALUE` lines from the file named by $DS_ENV_FILE (default `.deepspeed_env` in ~ and
the working directory) and exports them on every node it starts through pdsh, mpirun or srun. It reads no comments
and no blank lines, so the file holds nothing else.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dspipe.errors import SpecError
from dspipe.spec.cluster import ClusterSpec

ENV_FILE = ".deepspeed_env"
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DEVICE_LIST = re.compile(r"^\^?=?[A-Za-z0-9_.:@+-]+(,[A-Za-z0-9_.:@+-]+)*$")  # NCCL_SOCKET_IFNAME / NCCL_IB_HCA
NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")
FLAG_ENV_KEYS = {
    "ifname": ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"),
    "ib_hca": ("NCCL_IB_HCA",),
    "no_ib": ("NCCL_IB_DISABLE",),
    "nccl_debug": ("NCCL_DEBUG",),
    "timeout_min": ("DEEPSPEED_TIMEOUT",),
}
"""The variables each network flag may set (on some backend): an --env of one of them replaces the flag's default
(slurm-script then passes no flag for it). Which of them a flag sets on the run's backend: `backend_keys`."""
# Set per rank or per launch by the launcher itself; a user value would be overwritten or break rank discovery.
LAUNCHER_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CROSS_RANK",
    "CROSS_SIZE",
    "DS_ENV_FILE",
    "CUDA_VISIBLE_DEVICES",
)


MAX_TIMEOUT_MIN = 10080
"""The longest collective timeout --timeout-min takes: a week (DeepSpeed turns DEEPSPEED_TIMEOUT into a timedelta at
import in every rank, which overflows past ~1.5e12 minutes)."""


@dataclass(frozen=True)
class NetworkSpec:
    """How ranks talk to each other, beyond what the plan says."""

    socket_ifname: str | None = None
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME: interfaces for bootstrap and socket traffic (e.g. 'eth0', '^lo')."""
    ib_hca: str | None = None
    """NCCL_IB_HCA: InfiniBand adapters to use (e.g. 'mlx5_0,mlx5_1'); None lets NCCL pick."""
    infiniband: bool = True
    """False sets NCCL_IB_DISABLE=1 (sockets only)."""
    nccl_debug: str = "WARN"
    """NCCL_DEBUG level."""
    timeout_minutes: int = 30
    """Collective timeout (DEEPSPEED_TIMEOUT, DeepSpeed's default process-group timeout; its default is 10)."""
    extra: tuple[tuple[str, str], ...] = ()
    """User additions from --env KEY=VALUE; they win over the values above."""
    given: tuple[str, ...] = ()
    """The network flags given explicitly (FLAG_ENV_KEYS' names): an --env of a variable one of them sets on the
    run's backend contradicts it (rank_environment refuses the pair)."""

    def __post_init__(self) -> None:
        if self.nccl_debug not in NCCL_DEBUG_LEVELS:
            raise SpecError(f"--nccl-debug {self.nccl_debug!r} is not one of: {', '.join(NCCL_DEBUG_LEVELS)}")
        if not isinstance(self.timeout_minutes, int) or not 1 <= self.timeout_minutes <= MAX_TIMEOUT_MIN:
            raise SpecError(
                f"--timeout-min must be 1..{MAX_TIMEOUT_MIN} minutes (a week), got {self.timeout_minutes!r}"
            )
        for flag, value in (("--ifname", self.socket_ifname), ("--ib-hca", self.ib_hca)):
            if value is not None and not DEVICE_LIST.match(value):
                raise SpecError(
                    f"{flag} {ascii(value)} is not a device list such as eth0, ^docker,lo or "
                    f"=mlx5_0:1,mlx5_1 (letters, digits, '_', '.', ':', '@', '+', '-', comma-separated; "
                    f"a leading ^ and/or =)"
                )
        if self.ib_hca and not self.infiniband:
            raise SpecError(f"--ib-hca {self.ib_hca} and --no-ib contradict each other")
        for key, value in self.extra:
            if key in LAUNCHER_KEYS:
                raise SpecError(f"--env {key}=...: {key} is set by DeepSpeed's launcher for each rank")
            if re.search(r"[\x00-\x1f\x7f]", value):
                raise SpecError(
                    f"--env {key}={ascii(value)}: control characters (newline, tab...) do not survive "
                    f"the launcher's export"
                )
            if any(c in value for c in "\n\r\"'`$\\"):
                raise SpecError(
                    f"--env {key}={value!r}: quotes, '$', '\\' and newlines do not survive the "
                    f"launcher's export (DeepSpeed writes 'export {key}=VALUE' into a shell line)"
                )
            if value != value.strip():
                raise SpecError(
                    f"--env {key}={value!r}: DeepSpeed's launcher strips leading and trailing spaces from an "
                    f"exported value; give {key}={value.strip()!r} or a value without them"
                )


def parse_env_assignments(items: tuple[str, ...] | list[str]) -> tuple[tuple[str, str], ...]:
    """('KEY=VALUE', ...) from --env, validated."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not ENV_KEY.match(key):
            raise SpecError(f"--env {item!r} is not KEY=VALUE with KEY made of letters, digits and '_'")
        out[key] = value
    return tuple(out.items())


def backend_keys(backend: str) -> dict[str, str]:
    """{variable: the network flag that sets it} on `backend` (nccl or gloo): --ifname sets NCCL_SOCKET_IFNAME under
    NCCL and GLOO_SOCKET_IFNAME under gloo; --ib-hca, --no-ib and --nccl-debug set nothing under gloo."""
    keys = {"DEEPSPEED_TIMEOUT": "timeout_min"}
    if backend == "nccl":
        keys |= {"NCCL_SOCKET_IFNAME": "ifname", "NCCL_IB_HCA": "ib_hca", "NCCL_IB_DISABLE": "no_ib"}
        keys |= {"NCCL_DEBUG": "nccl_debug"}
    else:
        keys["GLOO_SOCKET_IFNAME"] = "ifname"
    return keys


def _refuse_env_against_flags(*, network: NetworkSpec, backend: str) -> None:
    """An --env KEY=... of a variable a network flag given beside it sets on this backend: one of the two would
    silently lose."""
    keys = backend_keys(backend)
    for key, value in network.extra:
        name = keys.get(key)
        if name in network.given:
            flag = "--" + name.replace("_", "-")
            raise SpecError(f"--env {key}={value} and {flag} both set {key} (backend {backend}): give one of them")


def rank_environment(*, cluster: ClusterSpec, network: NetworkSpec) -> dict[str, str]:
    """What every rank gets: the collective timeout, the backend's interface/transport settings, user additions."""
    env = {"DEEPSPEED_TIMEOUT": str(network.timeout_minutes)}
    backend = cluster.gpu_type.backend
    _refuse_env_against_flags(network=network, backend=backend)
    if backend == "nccl":
        env["NCCL_DEBUG"] = network.nccl_debug
        if network.socket_ifname:  # unset, NCCL prefers ib*, then any interface but lo and docker*
            env["NCCL_SOCKET_IFNAME"] = network.socket_ifname
        env["NCCL_IB_DISABLE"] = "0" if network.infiniband else "1"
        if network.ib_hca:
            env["NCCL_IB_HCA"] = network.ib_hca
    else:
        nccl = [
            flag
            for flag, set_ in (
                ("--ib-hca", bool(network.ib_hca)),
                ("--no-ib", not network.infiniband),
                ("--nccl-debug", "nccl_debug" in network.given),
            )
            if set_
        ]
        if nccl:
            raise SpecError(
                f"{'/'.join(nccl)} set{'s' if len(nccl) == 1 else ''} NCCL variables, but this run's cluster "
                f"({cluster.gpu}) uses {backend}, not NCCL"
            )
        if network.socket_ifname:
            env["GLOO_SOCKET_IFNAME"] = network.socket_ifname
    env.update(network.extra)
    return env


def env_file_text(env: dict[str, str]) -> str:
    return "".join(f"{k}={v}\n" for k, v in env.items())


def write_env_file(run_path: Path, env: dict[str, str]) -> Path:
    """runs/NAME/.deepspeed_env, replaced atomically (every node of a no-ssh launch writes the same file)."""
    path = Path(run_path) / ENV_FILE
    fd, tmp = tempfile.mkstemp(prefix=f".{ENV_FILE}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(env_file_text(env))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
