"""Hostfiles: parsing, one-line errors naming the line, host/slot selection that matches DeepSpeed's own runner."""

import json

import pytest

from dspipe.cluster.hostfile import describe, parse_hostfile, read_hostfile, select
from dspipe.errors import SpecError
from tests.helpers import dspipe

GOOD = """# two DGX nodes
node-1 slots=8   # rack A

node-2 slots=8 max_slots=8
"""


def test_parses_hosts_comments_and_blank_lines():
    hf = parse_hostfile(GOOD, source="hosts")
    assert [(h.name, h.slots, h.line) for h in hf.hosts] == [("node-1", 8, 2), ("node-2", 8, 4)]
    assert hf.world_size == 16 and hf.equal_slots() == 8


BAD = [
    ("a slots=4\nb slots=4\na slots=4\n", "hosts:3: 'a slots=4': duplicate host a (first on line 1)"),
    ("node1 slots=4\nNODE1. slots=4\n", "hosts:2: 'NODE1. slots=4': duplicate host NODE1. (first on line 1 as node1)"),
    ("a slots=4 max_slots=2\n", "hosts:1: 'a slots=4 max_slots=2': max_slots=2 is less than slots=4"),
    ("a slots=4\nb\n", "hosts:2: 'b': missing slots=N (the number of GPUs on b)"),
    (  # DeepSpeed's launcher matches '^HOST\\s+slots=N': it would call the line a bad entry
        "a max_slots=2 slots=2\n",
        "hosts:1: 'a max_slots=2 slots=2': slots=N must come right after the host, before 'max_slots=2'",
    ),
    ("a slots=four\n", "hosts:1: 'a slots=four': slots must be a positive integer, got 'four'"),
    ("a slots=0\n", "hosts:1: 'a slots=0': slots must be a positive integer, got '0'"),
    ("a slots=2.5\n", "slots must be a positive integer, got '2.5'"),
    ("a slots = 4\n", "hosts:1: 'a slots = 4': unexpected 'slots'; a line is 'HOST slots=N'"),
    ("a gpus=4\n", "unexpected 'gpus=4'"),
    ("node:1 slots=4\n", "host 'node:1' is not a host name or address: ':' is neither in a host name"),
    ("# nothing\n\n", "hostfile hosts lists no hosts"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_bad_hostfiles_are_one_line_errors_naming_the_line(text, message):
    with pytest.raises(SpecError) as e:
        parse_hostfile(text, source="hosts")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_mixed_slot_counts_name_both_lines():
    hf = parse_hostfile("a slots=8\nb slots=8\nc slots=4\n", source="hosts")
    assert hf.world_size == 20  # a launch may use it as is ...
    with pytest.raises(SpecError, match=r"hosts:3: c has slots=4 but a \(line 1\) has slots=8"):
        hf.equal_slots()  # ... but a plan of nodes x gpus_per_node cannot


def test_missing_hostfile(tmp_path):
    with pytest.raises(SpecError, match="hostfile .*nope does not exist"):
        read_hostfile(tmp_path / "nope")


# (include, exclude, num_nodes, num_gpus) over a 3-host pool with 4, 4 and 2 slots
SELECTIONS = [
    ("", "", None, None),
    ("b", "", None, None),
    ("a:0,2@c", "", None, None),
    ("c:1@a:3,1", "", None, None),
    ("", "b", None, None),
    ("", "a:0,1@c:1", None, None),
    ("", "", 2, None),
    ("", "", None, 2),
    ("", "", 2, 1),
]
POOL = "a slots=4\nb slots=4\nc slots=2\n"


@pytest.mark.parametrize("include,exclude,num_nodes,num_gpus", SELECTIONS)
def test_selection_matches_deepspeeds_runner(include, exclude, num_nodes, num_gpus):
    from deepspeed.launcher import runner

    ours = select(
        parse_hostfile(POOL, source="hosts"), include=include, exclude=exclude, num_nodes=num_nodes, num_gpus=num_gpus
    )
    pool = runner._parse_hostfile(POOL.splitlines(keepends=True))
    theirs = runner.parse_inclusion_exclusion(pool, include, exclude)
    theirs = runner.apply_num_nodes_and_gpus(theirs, num_nodes or -1, num_gpus or -1)
    assert json.dumps(ours) == json.dumps(theirs)  # same hosts, same order, same slot ids


def test_deepspeed_parses_every_hostfile_we_accept_to_the_same_pool():
    from deepspeed.launcher import runner

    ours = parse_hostfile(GOOD, source="hosts")
    assert dict(runner._parse_hostfile(GOOD.splitlines(keepends=True))) == {h.name: h.slots for h in ours.hosts}


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(include="d"), "--include 'd': host 'd' is not in hostfile hosts (hosts: a, b, c)"),
        (dict(exclude="a@z:0"), "--exclude 'a@z:0': host 'z' is not in hostfile hosts"),
        (dict(include="c:2"), "--include 'c:2': c has slots 0..1 (hosts:3), not '2'"),
        (dict(include="a:"), "'a:' is not NAME[:SLOT,...]"),
        (dict(include="a", exclude="b"), "--include and --exclude are mutually exclusive"),
        (dict(include="a", num_gpus=1), "cannot be combined with --include/--exclude"),
        (dict(exclude="a@b@c"), "--include/--exclude leave no hosts"),
        (dict(num_nodes=4), "--num-nodes 4 > 3 hosts in hosts"),
        (dict(num_gpus=3), "--num-gpus 3 > slots of c (2) in hosts"),
    ],
)
def test_bad_selections(kwargs, message):
    with pytest.raises(SpecError) as e:
        select(parse_hostfile(POOL, source="hosts"), **kwargs)
    assert message in str(e.value)


def test_describe():
    assert describe({"a": [0, 1, 2, 3], "c": [1], "b": [0, 2]}) == "a:0-3 + c:1 + b:0,2"


TINY = ["gen-config", "--model", "tiny", "--gpu", "cpu", "--global-batch", "16", "--micro-batch", "4"]


def test_gen_config_derives_the_cluster_from_the_hostfile(tmp_path):
    (tmp_path / "hosts").write_text("# cluster\nn1 slots=2\nn2 slots=2\n")
    r = dspipe(*TINY, "--hostfile", "hosts", "--out", "runs/a", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    spec = json.loads((tmp_path / "runs/a/dspipe.json").read_text())
    assert spec["cluster"]["nodes"] == 2 and spec["cluster"]["gpus_per_node"] == 2
    assert spec["plan"]["world_size"] == 4 and spec["plan"]["dp"] == 4  # the world size the config was made for
    assert (
        f"deepspeed --hostfile {tmp_path / 'hosts'} --num_nodes 2 --num_gpus 2 --module dspipe.runtime.entry "
        f"--run {tmp_path / 'runs/a'}"
    ) in r.stdout


@pytest.mark.parametrize(
    "hosts,flags,message",
    [
        ("n1 slots=2\nn2 slots=4\n", [], "hosts:2: n2 has slots=4 but n1 (line 1) has slots=2"),
        ("n1 slots=2\nn1 slots=2\n", [], "hosts:2: 'n1 slots=2': duplicate host n1 (first on line 1)"),
        ("n1 slots=x\n", [], "hosts:1: 'n1 slots=x': slots must be a positive integer, got 'x'"),
        ("n1 slots=2\nn2 slots=2\n", ["--nodes", "3"], "--nodes 3 contradicts hostfile hosts (2 nodes x 2 slots)"),
        (None, [], "hostfile hosts does not exist"),
    ],
)
def test_gen_config_hostfile_errors_are_one_line_exit_2(tmp_path, hosts, flags, message):
    if hosts is not None:
        (tmp_path / "hosts").write_text(hosts)
    r = dspipe(*TINY, "--hostfile", "hosts", *flags, "--out", "runs/a", cwd=tmp_path)
    assert r.returncode == 2
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"dspipe: error: {message}")
    assert "Traceback" not in r.stderr and not (tmp_path / "runs").exists()
