"""prepare-data resumes after a crash (issue 37): a run killed with SIGKILL half-way is continued by the next run of
the same command from its last journal, tokenizing only the documents after it, into an output byte for byte an
uninterrupted run's; a work directory of another fingerprint, or with an unusable journal, gives a clean fresh
build; a live run's work directory is never taken; and the shard writer's state restores exactly."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from dspipe.data import prepare as prep
from dspipe.data import workdir
from dspipe.data.shards import ShardWriter
from dspipe.data.sources import first_bad_utf8, resolve_inputs, stdlib_sources
from dspipe.errors import SpecError
from tests.helpers import ROOT, run_cli

VOCAB = 512
FLAGS = (
    "--workers",
    "2",
    "--train-tokenizer",
    VOCAB,
    "--tokenizer-sample-mb",
    "0.5",
    "--shard-tokens",
    "50000",
    "--val-fraction",
    "0.05",
)


def files_of(directory):
    """Every file under `directory` (relative path -> bytes)."""
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def journal_of(out):
    """The journal of the one work directory beside `out` (None while there is none)."""
    found = list(out.parent.glob(f".{out.name}.{workdir.WORK_TAG}*/{workdir.JOURNAL_FILE}"))
    try:
        return json.loads(found[0].read_text()) if found else None
    except (OSError, ValueError):  # replaced between glob and read
        return None


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """About 4 MB of text in ~380 files: the standard library's UTF-8 sources of 1-40 KB, in order."""
    d = tmp_path_factory.mktemp("resume") / "corpus"
    d.mkdir()
    total = 0
    for p in stdlib_sources():
        if total >= 4_000_000:
            break
        if 1_000 < p.stat().st_size < 40_000 and first_bad_utf8(p) is None:
            (d / f"{total:08d}.txt").write_bytes(p.read_bytes())
            total += p.stat().st_size
    return d


@pytest.fixture(scope="module")
def small(tmp_path_factory, corpus):
    """The corpus's first 40 files, and their preparation by an uninterrupted run (kw: the options)."""
    d = tmp_path_factory.mktemp("small") / "in"
    d.mkdir()
    for p in sorted(corpus.iterdir())[:40]:
        (d / p.name).write_bytes(p.read_bytes())
    kw = dict(train_tokenizer=300, tokenizer_sample_bytes=1 << 18, val_fraction=0.1, shard_tokens=4000, workers=1)
    ref = d.parent / "ref"
    prep.prepare(inputs=resolve_inputs([str(d)]), out=ref, **kw)
    return d, ref, kw


def test_killed_run_resumes_where_it_stopped_into_the_same_bytes(corpus, tmp_path, monkeypatch, capsys):
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_cli("prepare-data", corpus, "--out", ref, *FLAGS) == 0
    total = json.loads((ref / "meta.json").read_text())["num_documents"]
    capsys.readouterr()

    cmd = [sys.executable, "-m", "dspipe", "prepare-data", str(corpus), "--out", str(out), *map(str, FLAGS)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            journal = journal_of(out)
            if journal and journal["num_documents"] >= total // 2 and len(journal["writers"]["train"]["shards"]) > 2:
                break
            assert proc.poll() is None, "prepare-data ended before it could be killed"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    kept = journal_of(out)["num_documents"]
    assert not out.exists() and total // 2 <= kept < total
    (work,) = tmp_path.glob(f".out.{workdir.WORK_TAG}*")
    (work / ".journal.json.x1y2.tmp").write_text('{"format": "dspipe-prep')  # as a kill while journaling leaves
    (work / "meta.json").write_text('{"format": "dspipe-tokens", "fing')  # as a kill while finishing leaves

    sent = []  # documents the rerun hands to the tokenizer workers (a document in parts counts at its last part)
    real_batches, results = prep._batches, []

    def counted(docs, **kw):
        for batch, continued in real_batches(docs, **kw):
            sent.append(0 if continued else len(batch))
            yield batch, continued

    def kept_result(**kw):
        results.append(real_prepare(**kw))
        return results[-1]

    real_prepare = prep.prepare
    monkeypatch.setattr(prep, "_batches", counted)
    monkeypatch.setattr(prep, "prepare", kept_result)
    assert run_cli("prepare-data", corpus, "--out", out, *FLAGS) == 0
    printed = capsys.readouterr().out
    line = printed.split(f"resuming {out}: ")[1].split("\n")[0]  # N documents (M tokens) already prepared
    resumed, resumed_tokens = (int(x.replace(",", "")) for x in line.replace("(", "").split()[0:3:2])
    assert resumed == kept and "training a" not in printed  # the BPE of the killed run is taken, not trained again
    r = results[0]
    assert r.resumed_documents == resumed and r.encoded_documents == total - resumed
    assert r.encoded_tokens == r.meta["num_tokens"] - resumed_tokens and 0 < resumed_tokens < r.meta["num_tokens"]
    assert sum(sent) == total - resumed <= total - total // 2
    assert files_of(out) == files_of(ref)  # every shard, meta.json, the tokenizer and the marker, byte for byte
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ref"]  # the work directory is gone


def test_ctrl_c_keeps_the_work_and_a_changed_input_starts_over(small, tmp_path, monkeypatch):
    src, ref, kw = small
    out, logged, calls = tmp_path / "out", [], []
    real_add = ShardWriter.add

    def interrupt(self, tokens, lengths):  # Ctrl-C once a few shards are journaled
        real_add(self, tokens, lengths)
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt

    monkeypatch.setattr(prep, "BATCH_DOCS", 4)  # several batches (the output does not depend on the batching)
    monkeypatch.setattr(ShardWriter, "add", interrupt)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(inputs=resolve_inputs([str(src)]), out=out, log=logged.append, **kw)
    monkeypatch.setattr(ShardWriter, "add", real_add)
    journal = journal_of(out)
    assert not out.exists() and 0 < journal["num_documents"] < 40
    assert f"interrupted: the {journal['num_documents']:,} documents prepared so far are kept in" in logged[-1]

    path = next(tmp_path.glob(f".out.{workdir.WORK_TAG}*/{workdir.JOURNAL_FILE}"))
    path.write_text(json.dumps({**journal, "num_bytes": journal["num_bytes"] + 1}))  # as if the input changed
    r = prep.prepare(inputs=resolve_inputs([str(src)]), out=out, log=logged.append, **kw)
    assert any("the input changed since the interrupted run" in line and "starting over" in line for line in logged)
    assert r.encoded_documents == 40 and files_of(out) == files_of(ref)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_another_fingerprint_or_a_corrupt_journal_gives_a_clean_fresh_build(small, tmp_path):
    src, ref, kw = small
    fp = json.loads((ref / "meta.json").read_text())["fingerprint"]
    cases = {
        "corrupt": '{"format": "dspipe-prepare-journal", "num_doc',
        "another fingerprint": json.dumps(
            {
                "format": workdir.JOURNAL_FORMAT,
                "fingerprint": "0" * 64,
                "num_documents": 3,
                "num_bytes": 10,
                "tokenizer": {},
                "writers": {},
            }
        ),
    }
    for case, text in cases.items():
        out, logged = tmp_path / case.replace(" ", "-"), []
        mine = tmp_path / f".{out.name}.{workdir.WORK_TAG}{fp[:16]}"
        other = tmp_path / f".{out.name}.{workdir.WORK_TAG}{'f' * 16}"  # a dead run of other inputs or options
        for d in (mine, other):
            (d / "tokenizer").mkdir(parents=True)
            (d / "tokenizer" / "tokenizer.json").write_text("{}")
            (d / "train-00000.bin").write_bytes(b"\xff" * 100)
            (d / "train-00007.idx").write_bytes(b"\xff" * 100)
            (d / workdir.JOURNAL_FILE).write_text(text)
        r = prep.prepare(inputs=resolve_inputs([str(src)]), out=out, log=logged.append, **kw)
        assert r.resumed_documents == 0 and r.encoded_documents == 40, case
        assert any("left no usable journal" in line for line in logged), (case, logged)
        assert files_of(out) == files_of(ref), case
        assert not mine.exists() and not other.exists(), case


def test_a_live_run_holds_its_work_directory(small, tmp_path):
    src, ref, kw = small
    fp = json.loads((ref / "meta.json").read_text())["fingerprint"]
    out = tmp_path / "out"
    mine = tmp_path / f".out.{workdir.WORK_TAG}{fp[:16]}"
    other = tmp_path / f".out.{workdir.WORK_TAG}{'e' * 16}"
    locks = []
    for d in (mine, other):  # held as a live run holds it: an flock on its lock file
        d.mkdir()
        (d / workdir.LOCK_FILE).write_text("4242\n")
        (d / "train-00000.bin").write_bytes(b"work in progress")
        locks.append(os.open(d / workdir.LOCK_FILE, os.O_RDWR))
        fcntl.flock(locks[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with pytest.raises(
            SpecError,
            match=r"another prepare-data run \(pid 4242\) is preparing .*out from the same "
            r"inputs and options .*; wait for it to end$",
        ):
            prep.prepare(inputs=resolve_inputs([str(src)]), out=out, **kw)
        assert not out.exists()
        assert (
            (mine / "train-00000.bin").read_bytes() == (other / "train-00000.bin").read_bytes() == b"work in progress"
        )
    finally:
        for fd in locks:
            os.close(fd)
    prep.prepare(inputs=resolve_inputs([str(src)]), out=out, **kw)  # released: the dead runs' work is removed
    assert files_of(out) == files_of(ref) and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_without_flock_the_pid_in_the_lock_file_tells_a_live_run(small, tmp_path, monkeypatch):
    import errno

    src, ref, kw = small
    fp = json.loads((ref / "meta.json").read_text())["fingerprint"]
    out, mine = tmp_path / "out", tmp_path / f".out.{workdir.WORK_TAG}{fp[:16]}"

    def no_flock(fd, op):  # a file system mounted without flock (Lustre's default)
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(
        workdir, "fcntl", types.SimpleNamespace(flock=no_flock, LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB)
    )  # for prepare-data only
    mine.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (mine / workdir.LOCK_FILE).write_text(f"{sleeper.pid}\n")
        with pytest.raises(SpecError, match=rf"another prepare-data run \(pid {sleeper.pid}\)"):
            prep.prepare(inputs=resolve_inputs([str(src)]), out=out, **kw)
    finally:
        sleeper.kill()
        sleeper.wait()
    prep.prepare(inputs=resolve_inputs([str(src)]), out=out, **kw)  # its run is gone: the directory is taken
    assert files_of(out) == files_of(ref) and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def documents(seed, n=60):
    """Token documents with EOS 0: lengths 1-400, ids 1-999."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 400, n)
    tokens = rng.integers(1, 1000, int(lengths.sum())).astype(np.uint16)
    tokens[np.cumsum(lengths) - 1] = 0
    return tokens, lengths


def write_all(directory, parts, *, restore_at=None, extra=None):
    """Write `parts` ((tokens, lengths) each) through a writer; with restore_at=k, the writer dies after part k (its
    state taken there, then `extra` parts written past it, its files left as they are) and a new writer restores
    the state and writes the rest. Returns the closed shards."""
    kw = dict(directory=directory, split="train", dtype="uint16", shard_tokens=5000, ident=b"12345678")
    w = ShardWriter(**kw)
    for i, part in enumerate(parts):
        w.add(*part)
        if i == restore_at:
            state = json.loads(json.dumps(w.state()))  # as the journal holds it
            for more in extra or []:
                w.add(*more)
            w.abort()
            w = ShardWriter(**kw)
            w.restore(state)
    return w.close()


@pytest.mark.parametrize("restore_at", [0, 2, 5])
def test_writer_state_restores_into_the_same_files(tmp_path, restore_at):
    parts = [documents(seed) for seed in range(8)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole = write_all(tmp_path / "a", parts)
    # after the state: more documents that close shards (their files must go) and grow the open one (cut back)
    resumed = write_all(tmp_path / "b", parts, restore_at=restore_at, extra=[documents(99), documents(98)])
    assert resumed == whole and len(whole) > 8
    assert files_of(tmp_path / "b") == files_of(tmp_path / "a")


def test_writer_restore_refuses_files_that_do_not_match_the_state(tmp_path):
    kw = dict(directory=tmp_path, split="train", dtype="uint16", shard_tokens=5000, ident=b"12345678")
    w = ShardWriter(**kw)
    w.add(*documents(0))
    state = w.state()
    w.abort()
    assert len(state["shards"]) >= 2 and state["open"]["num_tokens"] > 0
    open_bin = tmp_path / f"{state['open']['name']}.bin"
    with open(open_bin, "r+b") as f:
        f.truncate(state["open"]["bin_bytes"] - 2)
    with pytest.raises(ValueError, match=r"train-\d+\.bin has \d+ bytes, the state says at least \d+"):
        ShardWriter(**kw).restore(state)
    closed_idx = tmp_path / "train-00001.idx"
    closed_idx.write_bytes(b"\0" * 8 + closed_idx.read_bytes()[8:])  # a closed shard's header, overwritten
    with pytest.raises(ValueError, match="train-00001.idx has another header than the state's"):
        ShardWriter(**kw).restore(state)
    with pytest.raises(ValueError, match="is not one this writer could have written"):
        ShardWriter(**kw).restore({"shards": [], "open": {**state["open"], "name": "train-00005"}})
