"""MPI-style hostfiles (`host slots=N`) and DeepSpeed's --include/--exclude/--num_nodes/--num_gpus selection.

Validated more strictly than DeepSpeed's runner parses them, so that anything accepted here is accepted there and
resolves to the same hosts and slots (tests/unit/cluster/test_hostfile.py checks it against DeepSpeed's own functions).
No torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dspipe.cluster.hostname import check_host  # RFC 1123 names and IPv4 (no ':' or '@': --include separators)
from dspipe.errors import SpecError, cannot_read, file_problem

KEY_VALUE = re.compile(r"^(slots|max_slots)=(.*)$")
SLOT_COUNT = re.compile(r"[0-9]+", re.ASCII)
LINE_BREAK = re.compile(r"\r\n|\r|\n")  # what DeepSpeed's runner (a text-mode file) splits lines on
MAX_SLOTS = 1024  # = the largest --gpus-per-node (dspipe.spec.core.LIMITS)
MAX_HOSTS = 2**16  # = the largest --nodes
MAX_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    line: int
    """1-based line in the hostfile, for messages."""


@dataclass(frozen=True)
class Hostfile:
    """The resource pool a hostfile declares, in file order (DeepSpeed numbers nodes in this order)."""

    source: str
    hosts: tuple[Host, ...]

    @property
    def world_size(self) -> int:
        return sum(h.slots for h in self.hosts)

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise SpecError(
            f"host {name!r} is not in hostfile {self.source} (hosts: {', '.join(h.name for h in self.hosts)})"
        )

    def equal_slots(self) -> int:
        """GPUs per node, when every node has the same number (what a plan for `nodes x gpus_per_node` needs)."""
        first = self.hosts[0]
        for h in self.hosts[1:]:
            if h.slots != first.slots:
                raise SpecError(
                    f"{self.source}:{h.line}: {h.name} has slots={h.slots} but {first.name} (line "
                    f"{first.line}) has slots={first.slots}; dspipe plans nodes x gpus_per_node, "
                    f"so every node needs the same slot count"
                )
        return first.slots


def _check_characters(line: str, *, where: str) -> None:
    """Printable ASCII, spaces and tabs only (comments aside): DeepSpeed's runner reads Unicode digits and
    whitespace its own way, so anything else could mean different hosts or slots there."""
    for i, ch in enumerate(line):
        if not (" " <= ch <= "~" or ch == "\t"):
            raise SpecError(
                f"{where}: character {ch!r} (U+{ord(ch):04X}) at column {i + 1}: a hostfile line holds "
                f"ASCII 'HOST slots=N' only"
            )


def _count(text: str, *, what: str, where: str, high: int) -> int:
    """An ASCII decimal count in 1..high ('٣', '８', '²', '+3', '3.0' are refused, not int()-parsed)."""
    if not SLOT_COUNT.fullmatch(text) or len(text) > len(str(high)) + 2 or not 1 <= int(text) <= high:
        shown = repr(text) if len(text) <= 24 else f"{text[:20]!r}... ({len(text)} characters)"
        raise SpecError(f"{where}: {what} must be a positive integer, got {shown} (allowed range 1..{high})")
    return int(text)


def parse_hostfile(text: str, *, source: str) -> Hostfile:
    """`host slots=N [max_slots=M]` per line; `#` starts a comment; blank lines are skipped."""
    hosts: dict[str, Host] = {}
    seen: dict[str, str] = {}  # the host's name folded: as written
    for number, raw in enumerate(LINE_BREAK.split(text), start=1):
        line = raw.split("#", 1)[0].strip(" \t")
        if not line:
            continue
        where = f"{source}:{number}: {line[:60]!r}"
        _check_characters(line, where=f"{source}:{number}")
        name, *fields = line.split()
        check_host(name, what=f"{where}: host", ipv6=False)
        values = {}
        for field in fields:
            m = KEY_VALUE.match(field)
            if not m:
                raise SpecError(f"{where}: unexpected {field!r}; a line is 'HOST slots=N'")
            if m.group(1) in values:
                raise SpecError(f"{where}: {m.group(1)}= given twice; a line is 'HOST slots=N'")
            values[m.group(1)] = _count(m.group(2), what=m.group(1), where=where, high=MAX_SLOTS)
        if "slots" not in values:
            raise SpecError(f"{where}: missing slots=N (the number of GPUs on {name})")
        if not fields[0].startswith("slots="):
            raise SpecError(
                f"{where}: slots=N must come right after the host, before {fields[0]!r} (DeepSpeed's launcher "
                f"reads 'HOST slots=N' from the start of the line)"
            )
        if "max_slots" in values and values["max_slots"] < values["slots"]:
            raise SpecError(
                f"{where}: max_slots={values['max_slots']} is less than slots={values['slots']} (max_slots is "
                f"the most ranks {name} may take)"
            )
        folded = name.lower().rstrip(".")  # host names are case-blind, 'node1.' is 'node1'
        if folded in seen:
            same = seen[folded]
            also = "" if same == name else f" as {same}"
            raise SpecError(f"{where}: duplicate host {name} (first on line {hosts[same].line}{also})")
        seen[folded] = name
        hosts[name] = Host(name=name, slots=values["slots"], line=number)
        if len(hosts) > MAX_HOSTS:
            raise SpecError(f"hostfile {source} lists more than {MAX_HOSTS} hosts")
    if not hosts:
        raise SpecError(f"hostfile {source} lists no hosts; write one 'HOST slots=N' line per node")
    return Hostfile(source=source, hosts=tuple(hosts.values()))


def read_hostfile(path: str | Path) -> Hostfile:
    """Read and parse a hostfile: UTF-8 text without NUL bytes (any other bytes: one SpecError naming the
    offset), at most MAX_BYTES."""
    path = Path(path)
    problem = file_problem(path)
    if problem:
        raise SpecError(f"hostfile {path} {problem} (one 'HOST slots=N' line per node)")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise cannot_read(f"hostfile {path}", e) from None
    if len(raw) > MAX_BYTES:
        raise SpecError(
            f"hostfile {path} is larger than {MAX_BYTES // 2**20} MiB; it lists one 'HOST slots=N' line per node"
        )
    nul = raw.find(b"\0")
    if nul >= 0:
        raise SpecError(f"hostfile {path} holds a NUL byte at offset {nul}: not a text file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"hostfile {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    return parse_hostfile(text.removeprefix("\ufeff"), source=str(path))


def _node_specs(hostfile: Hostfile, spec: str, flag: str) -> dict[str, list[int]]:
    """NAME[:SLOT[,SLOT...]][@NAME...] -> {host: [slots]} (empty list: the whole host), checked against the file."""
    out: dict[str, list[int]] = {}
    for part in spec.split("@"):
        name, colon, slots = part.partition(":")
        if not name or (colon and not slots):
            raise SpecError(
                f"{flag} {spec!r}: {part!r} is not NAME[:SLOT,...]; the format is NAME[:SLOT,...][@NAME...]"
            )
        if name not in {h.name for h in hostfile.hosts}:
            raise SpecError(
                f"{flag} {spec!r}: host {name!r} is not in hostfile {hostfile.source} "
                f"(hosts: {', '.join(h.name for h in hostfile.hosts)})"
            )
        host = hostfile.host(name)
        ids = []
        for s in slots.split(",") if slots else []:
            if not SLOT_COUNT.fullmatch(s) or len(s) > 5 or int(s) >= host.slots:
                raise SpecError(
                    f"{flag} {spec!r}: {name} has slots 0..{host.slots - 1} ({hostfile.source}:{host.line}), not {s!r}"
                )
            ids.append(int(s))
        if name in out:
            raise SpecError(f"{flag} {spec!r}: host {name!r} is named twice; give its slots once (NAME:SLOT,SLOT)")
        if len(set(ids)) < len(ids):
            twice = next(i for i in ids if ids.count(i) > 1)
            raise SpecError(f"{flag} {spec!r}: {name}'s slot {twice} is given twice")
        out[name] = ids
    return out


def select(
    hostfile: Hostfile,
    *,
    include: str = "",
    exclude: str = "",
    num_nodes: int | None = None,
    num_gpus: int | None = None,
) -> dict[str, list[int]]:
    """The hosts and slot ids a launch uses, in hostfile order, as DeepSpeed's runner resolves them."""
    if include and exclude:
        raise SpecError("--include and --exclude are mutually exclusive (DeepSpeed's runner takes one)")
    if (include or exclude) and (num_nodes or num_gpus):
        raise SpecError("--num-nodes/--num-gpus cannot be combined with --include/--exclude (DeepSpeed's rule)")
    pool = {h.name: list(range(h.slots)) for h in hostfile.hosts}
    if include:
        wanted = _node_specs(hostfile, include, "--include")
        pool = {n: sorted(set(wanted[n])) or slots for n, slots in pool.items() if n in wanted}
    elif exclude:
        dropped = _node_specs(hostfile, exclude, "--exclude")
        pool = {
            n: [s for s in slots if dropped[n] and s not in dropped[n]] if n in dropped else slots
            for n, slots in pool.items()
        }
        pool = {n: slots for n, slots in pool.items() if slots}
    if num_nodes:
        if num_nodes > len(pool):
            raise SpecError(f"--num-nodes {num_nodes} > {len(pool)} hosts in {hostfile.source}")
        pool = dict(list(pool.items())[:num_nodes])
    if num_gpus:
        short = [f"{n} ({hostfile.host(n).slots})" for n in pool if hostfile.host(n).slots < num_gpus]
        if short:
            raise SpecError(f"--num-gpus {num_gpus} > slots of {', '.join(short)} in {hostfile.source}")
        pool = {n: list(range(num_gpus)) for n in pool}
    if not pool:
        raise SpecError(f"--include/--exclude leave no hosts of {hostfile.source}")
    return pool


def describe(resources: dict[str, list[int]]) -> str:
    """'node1:0-7 + node2:0-7' for messages."""

    def ids(slots):
        return (
            f"{slots[0]}-{slots[-1]}"
            if slots == list(range(slots[0], slots[-1] + 1)) and len(slots) > 1
            else ",".join(map(str, slots))
        )

    return " + ".join(f"{n}:{ids(s)}" for n, s in resources.items())
