"""dspipe.cluster.ports: a rendezvous port outside the ephemeral range (where outgoing connections take their source
ports), split between concurrent pickers, and free when handed out."""

import socket

import pytest

from dspipe.cluster import ports


@pytest.mark.parametrize(
    "ephemeral, expected",
    [
        ((32768, 60999), (20000, 32768)),  # Linux's default: below it
        ((10000, 30000), (30001, 65536)),  # a low range: above it
        ((1024, 65000), None),  # no room either side: the kernel's port 0
    ],
)
def test_region_lies_outside_the_ephemeral_range(ephemeral, expected):
    assert ports.region(ephemeral=ephemeral) == expected


def test_ephemeral_range_is_read_from_the_kernel_file(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(f) == (40000, 50000)
    f.write_text("garbage")
    assert ports.ephemeral_range(f) == ports.DEFAULT_EPHEMERAL
    assert ports.ephemeral_range(tmp_path / "missing") == ports.DEFAULT_EPHEMERAL


def test_each_slot_picks_from_its_own_share_and_never_twice():
    picked = {
        slot: [ports.free_port(slot=slot, slots=4, ephemeral=(32768, 60999)) for _ in range(20)] for slot in range(4)
    }
    share = (32768 - 20000) // 4
    for slot, got in picked.items():
        assert all(20000 + slot * share <= p < 20000 + (slot + 1) * share for p in got), (slot, got)
    every = [p for got in picked.values() for p in got]
    assert len(set(every)) == len(every)


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("", 0))
        port = taken.getsockname()[1]
        taken.listen(1)
        monkeypatch.setattr(ports._random, "randrange", lambda low, high: port)
        got = ports.free_port(ephemeral=(port + 10, 65000))  # only `port` is offered: after the attempts, port 0's
    assert got != port


def test_the_port_can_be_listened_on():
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("", port))
        s.listen(1)
    lo, hi = ports.ephemeral_range()
    assert not lo <= port <= hi


def test_a_slot_outside_the_slots_is_refused():
    with pytest.raises(ValueError, match="slot 3 is not in 0..2"):
        ports.free_port(slot=3, slots=3)


def test_the_launchers_default_ports_are_never_picked(monkeypatch):
    offered = iter([29500, 29400, 29501])
    monkeypatch.setattr(ports, "_given", set())
    monkeypatch.setattr(ports._random, "randrange", lambda low, high: next(offered))
    assert ports.free_port(ephemeral=(32768, 60999)) == 29501
