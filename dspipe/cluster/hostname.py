"""The one check of a host name or address that dspipe passes on (hostfile hosts, --master-addr, the Slurm job's
node list through the hostfile it writes, launch): an RFC 1123 host name, an IPv4 literal, or (where allowed) an
IPv6 literal. Nothing else reaches ssh, pdsh or torch's rendezvous: a name starting with '-' would be read as an
option by ssh/pdsh (`-oProxyCommand=...` runs a command), and blanks or shell characters split or inject. No torch.
"""

from __future__ import annotations

import ipaddress
import re

from dspipe.errors import SpecError

LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\Z", re.ASCII)
MAX_NAME = 253  # RFC 1123 / RFC 1035: a whole name, dots included


def host_problem(name: str, *, ipv6: bool = True) -> str | None:
    """Why `name` is not a host name or address (None: it is one)."""
    if not isinstance(name, str) or not name:
        return "it is empty"
    if name.startswith("-"):
        return "it starts with '-', which ssh and pdsh would take as an option"
    if ":" in name:
        try:
            ipaddress.IPv6Address(name.removeprefix("[").removesuffix("]"))
        except ValueError:
            return "':' is neither in a host name nor does it make an IPv6 address here"
        return (
            None
            if ipv6
            else (
                "an IPv6 address cannot go in a hostfile (':' separates a host from its slots in "
                "--include/--exclude); use the host's name"
            )
        )
    if re.fullmatch(r"[0-9.]+", name):
        try:
            ipaddress.IPv4Address(name)
            return None
        except ValueError:
            return "it is not an IPv4 address (four numbers 0-255 separated by '.')"
    if len(name) > MAX_NAME:
        return f"it is longer than {MAX_NAME} characters"
    for label in name.removesuffix(".").split("."):
        if not LABEL.match(label):
            return (
                "it is not an RFC 1123 host name (labels of letters, digits and '-', 1-63 characters, not "
                "starting or ending with '-', separated by '.')"
            )
    return None


def check_host(name: str, *, what: str, ipv6: bool = True) -> str:
    """`name` when it is a host name or address; else one SpecError, `what` naming where it came from."""
    problem = host_problem(name, ipv6=ipv6)
    if problem:
        shown = ascii(name) if len(name) <= 80 else ascii(name[:77]) + "..."
        raise SpecError(f"{what} {shown} is not a host name or address: {problem}")
    return name
