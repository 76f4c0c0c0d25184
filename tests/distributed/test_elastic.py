"""Runs that restart themselves (`dspipe launch --max-restarts`, torch's elastic agent): on 4 CPU ranks a rank killed
with SIGKILL and then a rank hung inside a collective each restart the job from the newest checkpoint, and it
finishes by itself with every step once and the replayed steps bitwise equal to their first run (fp32); two local
"nodes" of 2 ranks, one lost for good, continue on 2 ranks at the same global batch (node 0 too, with the rendezvous
store served apart by `dspipe rendezvous`). One launch per test."""

import os
import re
import socket
import subprocess
import sys
import time

import pytest

from dspipe.runtime.watchdog import COLLECTIVES
from tests.helpers import ROOT, csv_rows, dspipe, free_port, make_run

pytestmark = [pytest.mark.distributed, pytest.mark.solo]  # 4+ ranks, or a time it measures
TIMEOUT = 600
HOSTS = "localhost slots=2\n127.0.0.1 slots=2\n"  # two names for this machine: two "nodes" of 2 CPU ranks
FLAGS = (
    "--precision",
    "fp32",
    "--zero",
    "1",
    "--sync-save",
    "--save-interval",
    "3",
    "--log-interval",
    "1",
    "--global-batch",
    "16",
    "--micro-batch",
    "4",
)


def env_with():
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def wait_for_port(port, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on port {port} after {timeout} s")


def by_step(path):
    return {int(r["step"]): r for r in csv_rows(path)}


def events(run):
    import json

    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def test_a_killed_rank_and_a_hung_rank_restart_the_job(tmp_path, corpus):
    run = make_run(tmp_path, corpus, *FLAGS, "--gpus-per-node", "4", steps=8)
    faults = '[{"kill_at_step": 5, "kill_rank": 2}, {"hang_at_step": 7, "hang_rank": 1}]'
    r = dspipe(
        "launch",
        run,
        "--max-restarts",
        "2",
        "--hang-timeout",
        "5",
        "--test-faults",
        faults,
        env={"PYTHONPATH": env_with()["PYTHONPATH"]},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = csv_rows(run / "metrics.csv")
    assert [int(x["step"]) for x in rows] == list(range(1, 9))  # each step once
    first, replay = by_step(run / "metrics.rewound.csv"), by_step(run / "metrics.csv")
    assert sorted(first) == [4, 5]  # killed after step 5, resumed from 3: steps 4 and 5 ran twice
    for step in (4, 5):
        assert [first[step][c] for c in ("loss", "lr", "grad_norm")] == [
            replay[step][c] for c in ("loss", "lr", "grad_norm")
        ]  # bitwise (their text is repr(float))
    hangs = [e for e in events(run) if e["event"] == "hang"]
    assert hangs and {e["step"] for e in hangs} == {7} and all(e["seconds"] < 5 + 3 for e in hangs)
    # each rank that timed out names itself and its operation (rank 1, asleep inside its collective, or a peer
    # waiting for it in the same one; the agent stops the others once the first has exited)
    assert all(e["op"] in COLLECTIVES and 0 <= e["rank"] < 4 for e in hangs)
    assert [(e["attempt"], e["step"], e["world"]) for e in events(run) if e["event"] == "restart"] == [
        (1, 3, 4),
        (2, 6, 4),
    ]
    assert re.search(
        r"^dspipe: hang: rank [0-3] has been inside \w+ for [5-7] s at step 7 \(hang timeout 5 s\); "
        r"stopping the job so that it restarts from the newest checkpoint$",
        r.stderr,
        re.M,
    )
    summary = [ln for ln in r.stderr.splitlines() if ln.startswith(f"dspipe: {run}: hang at step 7")]
    assert summary and "restart 1 resumed at step 3 on 4 ranks; restart 2 resumed at step 6 on 4 ranks" in summary[0]
    assert (run / "checkpoints" / "latest").read_text() == "global_step8"


@pytest.mark.parametrize("lost", [1, 0], ids=["node1-store-on-node0", "node0-store-apart"])
def test_a_lost_node_continues_on_the_others_at_the_same_global_batch(tmp_path, corpus, lost):
    """Node 1 lost while node 0's agent holds the rendezvous store; node 0 lost while `dspipe rendezvous` holds it
    (without that store, losing node 0 would end the others' rendezvous)."""
    (tmp_path / "hosts").write_text(HOSTS)
    run = make_run(tmp_path, corpus, *FLAGS, "--hostfile", str(tmp_path / "hosts"), steps=8)
    port = str(free_port())
    faults = f'[{{"kill_at_step": 5, "kill_node": {lost}}}]'  # the node's agent and ranks: gone for good after step 5
    store = None
    if lost == 0:  # the store apart from the nodes, as on a login node
        store = subprocess.Popen(
            [sys.executable, "-m", "dspipe", "rendezvous", "--port", port], cwd=tmp_path, env=env_with()
        )
        wait_for_port(int(port))
        meet = ["--rendezvous", f"127.0.0.1:{port}"]
    else:
        meet = ["--master-addr", "127.0.0.1", "--master-port", port]

    def node(rank):
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dspipe",
                "launch",
                str(run),
                "--hostfile",
                "hosts",
                "--no-ssh",
                "--node-rank",
                str(rank),
                *meet,
                "--max-restarts",
                "2",
                "--min-nodes",
                "1",
                "--rejoin-wait",
                "2",
                "--test-faults",
                faults,
            ],
            cwd=tmp_path,
            env=env_with(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    try:
        first = node(0)
        if store is None:
            wait_for_port(int(port))  # node 0's agent holds the rendezvous store
        nodes = [first, node(1)]
        outputs = [p.communicate(timeout=TIMEOUT)[0] for p in nodes]
    finally:
        if store is not None:
            store.terminate()
            assert store.wait(timeout=30) == 0  # SIGTERM ends the store cleanly
    codes = [p.returncode for p in nodes]
    kept = 1 - lost
    assert codes[kept] == 0 and codes[lost] != 0, outputs[0][-3000:] + outputs[1][-3000:]
    survivor = outputs[kept]
    assert (
        "dspipe: continuing on 2 of 4 ranks (1 of 2 node(s)): dp 4 -> 2, gradient accumulation 1 -> 2, global "
        "batch 16 = 4 x 2 x 2 unchanged"
    ) in survivor
    assert "world 2 = dp 2 x pp 1 | ZeRO-1" in survivor
    rows = csv_rows(run / "metrics.csv")
    assert [int(x["step"]) for x in rows] == list(range(1, 9))
    first, replay = by_step(run / "metrics.rewound.csv"), by_step(run / "metrics.csv")
    assert sorted(first) == [4, 5]
    for step in (4, 5):  # 4 ranks x 1 micro-batch then 2 ranks x 2: the same samples, summed in another order
        assert float(replay[step]["loss"]) == pytest.approx(float(first[step]["loss"]), rel=1e-5)
    losses = [float(x["loss"]) for x in rows]
    assert losses[-1] < losses[0]
    assert [(e["attempt"], e["step"], e["world"]) for e in events(run) if e["event"] == "restart"] == [(1, 3, 2)]


def test_a_refused_start_is_not_built_again_at_each_restart(tmp_path, corpus):
    """A start refused with a one-line error after its build (a check that fails the same way every time) is not
    retried the long way: its restarts by the agent say the error again at once, without building, and the job ends;
    a new `dspipe launch` of the same run tries again."""
    run = make_run(tmp_path, corpus, *FLAGS, steps=4)
    launch = ["launch", run, "--max-restarts", "2", "--test-faults", '{"refuse_after_build": true}']
    r = dspipe(*launch, env={"PYTHONPATH": env_with()["PYTHONPATH"]})
    assert r.returncode != 0
    error = "dspipe: error: test fault: refused after the build (--test-faults refuse_after_build)"
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith(error)]
    assert lines[0] == error and lines[1:] == [f"{error} (as at an earlier start of this job: not built again)"] * 2
    assert "start-up" not in r.stderr and not (run / "engine.json").exists()
    again = dspipe(*launch[:4], env={"PYTHONPATH": env_with()["PYTHONPATH"]})  # a new job, no fault: it trains
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert [int(x["step"]) for x in csv_rows(run / "metrics.csv")] == [1, 2, 3, 4]
    assert not (run / "refused.json").exists()
