"""A free TCP port for a rendezvous on this machine, chosen where nothing else will take it before it is listened on.

The usual trick, bind port 0 and hand out what the kernel gave, returns a port from the ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default). Between that close and rank 0's TCPStore listening
on it, any outgoing connection on the machine (gloo opens many) can be given the same port as its source, and the
store then fails with EADDRINUSE. Ports below the ephemeral range are never given to outgoing connections, so a port
picked there stays free unless another process picks it too; `slot` / `slots` split the range between processes that
pick at the same time (pytest-xdist workers)."""

import random
import socket
from pathlib import Path

EPHEMERAL_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default
LOWEST = 20000  # below: well-known and registered services
DEFAULTS = {29400, 29500}  # torchrun's rendezvous and DeepSpeed's / torch's master port: a launch without a port uses
MIN_SPAN = 1000  # a region smaller than this is not used (the kernel's port 0 is used instead)
ATTEMPTS = 200

_given: set[int] = set()  # handed out by this process: a caller may ask for two ports before listening on either
_random = random.SystemRandom()  # not the random module's state, which tests and training seed alike in every worker


def ephemeral_range(path: Path = EPHEMERAL_FILE) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def region(*, ephemeral: tuple[int, int]) -> tuple[int, int] | None:
    """[low, high) outside the ephemeral range, the larger of below and above it; None when neither is big enough."""
    low, high = ephemeral
    below, above = (LOWEST, low), (max(high + 1, LOWEST), 65536)
    best = max(below, above, key=lambda r: r[1] - r[0])
    return best if best[1] - best[0] >= MIN_SPAN else None


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))  # TCPStore listens on every interface
        except OSError:
            return False
    return True


def free_port(*, slot: int = 0, slots: int = 1, ephemeral: tuple[int, int] | None = None) -> int:
    """A port that is free now and outside the ephemeral range; `slot` of `slots` picks from its share of the range."""
    if not 0 <= slot < slots:
        raise ValueError(f"slot {slot} is not in 0..{slots - 1}")
    span = region(ephemeral=ephemeral or ephemeral_range())
    if span is not None:
        share = (span[1] - span[0]) // slots
        if share >= 1:
            low = span[0] + slot * share
            for _ in range(ATTEMPTS):
                port = _random.randrange(low, low + share)
                if port not in _given and port not in DEFAULTS and _bindable(port):
                    _given.add(port)
                    return port
    with socket.socket() as s:  # no room outside the ephemeral range: the kernel's choice
        s.bind(("", 0))
        return s.getsockname()[1]
