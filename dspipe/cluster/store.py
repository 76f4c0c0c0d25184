"""`dspipe rendezvous`: the c10d rendezvous store of elastic jobs (`dspipe launch --max-restarts N --rendezvous
HOST:PORT`), served by a process of its own on a host that trains nothing (a login or service node).

Without it the store lives in node 0's elastic agent (torch's c10d backend hosts it where --rdzv-endpoint points), so
losing node 0 ends every node's rendezvous with it; with it, each agent is a client (`is_host=0`) and any node, node 0
included, can be lost while the others restart at the smaller dp. One store serves any number of jobs: each job's
keys are under its rendezvous id (the run directory's). torch is imported by `serve` only."""

from __future__ import annotations

import errno
import re
import signal
import socket
import threading
from collections.abc import Callable

from dspipe.cluster.hostname import check_host
from dspipe.errors import SpecError


def parse_endpoint(text: str, *, what: str = "--rendezvous") -> tuple[str, int]:
    """(host, port) of HOST:PORT ([IPv6]:PORT for an IPv6 literal); one SpecError otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not re.fullmatch(r"[0-9]{1,5}", port):
        raise SpecError(f"{what} {ascii(text)} is not HOST:PORT (e.g. login1:29400, [fd00::1]:29400)")
    bracketed = host.startswith("[") and host.endswith("]")
    if (":" in host) != bracketed:
        raise SpecError(f"{what} {ascii(text)}: an IPv6 address, and only one, goes in brackets, [ADDRESS]:PORT")
    if not 1 <= int(port) <= 65535:
        raise SpecError(f"{what} {ascii(text)}: port {int(port)} is outside 1..65535")
    return check_host(host.removeprefix("[").removesuffix("]"), what=f"{what} host"), int(port)


def endpoint_text(host: str, port: int) -> str:
    """HOST:PORT as torch's rendezvous parses it (an IPv6 literal in brackets, given with or without them)."""
    host = host.removeprefix("[").removesuffix("]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_reachable(host: str, port: int, *, timeout_s: float = 5.0) -> None:
    """One SpecError when nothing accepts a connection at host:port (the store is not started, or a firewall)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as e:
        why = e.strerror or type(e).__name__
    raise SpecError(
        f"--rendezvous {endpoint_text(host, port)}: nothing answers there ({why}); start "
        f"'dspipe rendezvous --port {port}' on {host} first"
    )


def serve(*, port: int, ready: Callable[[], None]) -> None:
    """Hold a TCPStore server on `port` (every interface) until SIGTERM or SIGINT; `ready` is called once it
    listens. One SpecError when the port is taken."""
    import torch.distributed as dist

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        text = " ".join(str(e).split())
        if "address already in use" in text.lower() or getattr(e, "errno", None) == errno.EADDRINUSE:
            raise SpecError(f"port {port} is in use on this machine; pass --port with a free port") from None
        raise SpecError(f"cannot serve a rendezvous store on port {port}: {text[:200]}") from None
    ready()
    while not stop.wait(1.0):
        pass
    del store
