"""prepare-data end to end on local inputs: formats, round trip to text, no-op re-runs, identical output for any
worker count, atomic output under interruption, Hugging Face tokenizers, and every bad input as one line, exit 2."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dspipe.data import TokenWindows, open_split, read_meta
from dspipe.data.prepare import is_val, prepare
from dspipe.data.sources import resolve_inputs, stdlib_sources
from dspipe.errors import SpecError
from tests.helpers import ROOT, run_cli

VOCAB = 300


def make_docs(n=40):
    """Real text (standard-library source, without blank lines so blank-line mode can split them) + non-ASCII."""
    docs = []
    for i, path in enumerate(p for p in stdlib_sources() if p.stat().st_size > 2000):
        if len(docs) == n:
            break
        try:
            lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except UnicodeDecodeError:
            continue
        docs.append("\n".join(lines[:60]) + f"\n# doc {i}: ünïcödé ✓ 日本語 🚀\n")
    return docs


@pytest.fixture(scope="module")
def docs():
    return make_docs()


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory, docs):
    d = tmp_path_factory.mktemp("texts")
    for i, doc in enumerate(docs):
        (d / f"d{i:03d}.txt").write_text(doc, encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, text_dir):
    """Text files -> trained BPE -> several small shards and a validation split."""
    out = tmp_path_factory.mktemp("prep") / "data"
    prepare(
        inputs=resolve_inputs([str(text_dir)]),
        out=out,
        train_tokenizer=VOCAB,
        val_fraction=0.1,
        shard_tokens=4000,
        workers=2,
    )
    return out


def split_docs(tokens, eos):
    cuts = np.flatnonzero(tokens == eos)
    return [tokens[a + 1 if i else 0 : b] for i, (a, b) in enumerate(zip(np.r_[-1, cuts[:-1]], cuts, strict=False))]


def test_round_trip_text_to_shards_to_windows_to_text(prepared, docs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(prepared / "tokenizer"))
    meta = read_meta(prepared)
    val = is_val(np.arange(len(docs), dtype=np.float64), 0.1)
    train_docs = [d for d, v in zip(docs, val, strict=False) if not v]
    val_docs = [d for d, v in zip(docs, val, strict=False) if v]
    assert meta["num_documents"] == len(docs) and meta["splits"]["val"]["num_documents"] == len(val_docs) == 4
    assert len(meta["splits"]["train"]["shards"]) > 3 and meta["dtype"] == "uint16" and meta["vocab_size"] == VOCAB

    seq = 16
    w = TokenWindows(prepared, seq_len=seq)
    pos, first_doc, checked = 0, 0, 0
    for shard, info in zip(w.shards, meta["splits"]["train"]["shards"], strict=False):
        n = (shard.size - 1) // seq  # rebuild the shard's token stream from its windows (stride seq, 1 overlap)
        stream = np.concatenate([w[pos]] + [w[pos + i][1:] for i in range(1, n)])
        assert np.array_equal(stream, shard[: stream.size])
        decoded = [tok.decode(p) for p in split_docs(stream, meta["eos_id"])]  # the whole documents in it
        assert decoded == train_docs[first_doc : first_doc + len(decoded)]
        assert len(decoded) >= info["num_documents"] - 1  # only the shard's tail (< seq tokens) is not covered
        pos, first_doc, checked = pos + n, first_doc + info["num_documents"], checked + len(decoded)
    assert first_doc == len(train_docs) and checked >= len(train_docs) - len(w.shards)

    val_tokens = np.concatenate([t for t, _ in open_split(prepared, "val")])
    assert [tok.decode(p) for p in split_docs(val_tokens, meta["eos_id"])] == val_docs


def test_document_index_marks_every_document(prepared, docs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(prepared / "tokenizer"))
    tokens, offsets = open_split(prepared, "train")[1]
    assert offsets[0] == 0 and offsets[-1] == tokens.size
    assert all(tokens[int(e) - 1] == tok.eos_token_id for e in offsets[1:])
    assert tok.decode(tokens[int(offsets[0]) : int(offsets[1]) - 1]) in docs


def test_tokenizer_is_saved_in_hugging_face_format_and_reused_from_a_directory(prepared, text_dir, tmp_path, docs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(prepared / "tokenizer"))
    assert tok.eos_token == "<|endoftext|>" and len(tok) == VOCAB
    tokens, offsets = open_split(prepared, "train")[0]
    for i in range(len(offsets) - 1):  # the workers' ids are exactly what transformers gives, then EOS
        doc = tokens[int(offsets[i]) : int(offsets[i + 1])].tolist()
        assert doc == tok(docs[i], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    again = tmp_path / "again"
    r = prepare(
        inputs=resolve_inputs([str(text_dir)]),
        out=again,
        tokenizer=str(prepared / "tokenizer"),
        val_fraction=0.1,
        shard_tokens=4000,
        workers=1,
    )
    assert r.meta["tokenizer_source"] == str(prepared / "tokenizer")
    for name in ("train-00000.bin", "train-00003.bin", "val-00000.bin"):
        assert (again / name).read_bytes()[32:] == (prepared / name).read_bytes()[32:]


def test_worker_count_does_not_change_the_output(prepared, text_dir, tmp_path):
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        prepare(
            inputs=resolve_inputs([str(text_dir)]),
            out=out,
            tokenizer=str(prepared / "tokenizer"),
            val_fraction=0.1,
            shard_tokens=4000,
            workers=workers,
        )
        outs.append({p.name: p.read_bytes() for p in out.iterdir() if p.is_file()})
    assert outs[0] == outs[1] and "meta.json" in outs[0]


def test_rerun_is_a_no_op_and_changed_input_rebuilds(tmp_path, docs, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for i, d in enumerate(docs[:10]):
        (src / f"{i}.txt").write_text(d)
    args = ("prepare-data", src, "--out", tmp_path / "out", "--train-tokenizer", VOCAB, "--workers", 1)
    assert run_cli(*args) == 0
    assert "wrote" in capsys.readouterr().out
    shard = tmp_path / "out/train-00000.bin"
    before = shard.stat().st_mtime_ns
    assert run_cli(*args) == 0
    assert "already prepared from the same inputs" in capsys.readouterr().out
    assert shard.stat().st_mtime_ns == before
    (src / "0.txt").write_text(docs[0] + "# changed\n")
    assert run_cli(*args) == 0
    out = capsys.readouterr().out
    assert "holds another preparation" in out and "wrote" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no temp or old directories left


def test_jsonl_parquet_and_blank_line_documents(tmp_path, docs):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs[:5])))
    pq.write_table(pa.table({"body": docs[5:8]}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text("\n\n".join(d.rstrip("\n") for d in docs[8:12]) + "\n")
    out = tmp_path / "out"
    r = prepare(
        inputs=resolve_inputs(
            [str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet"), str(tmp_path / "c.txt")],
            text_field="body",
            txt_docs="blank-line",
        ),
        out=out,
        train_tokenizer=VOCAB,
        val_fraction=0,
        workers=1,
    )
    assert r.meta["num_documents"] == 12 and r.meta["splits"]["val"]["num_documents"] == 0
    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    tokens, offsets = open_split(out, "train")[0]
    got = [tok.decode(tokens[int(a) : int(b) - 1]) for a, b in zip(offsets[:-1], offsets[1:], strict=False)]
    assert got[:8] == docs[:8]  # records are taken verbatim
    assert got[8:11] == [d.rstrip("\n") for d in docs[8:11]] and got[11] == docs[11]  # blocks between blank lines


def test_no_streaming_reads_the_same_documents(prepared, text_dir, tmp_path):
    out = tmp_path / "arrow"
    prepare(
        inputs=resolve_inputs([str(text_dir)], streaming=False),
        out=out,
        tokenizer=str(prepared / "tokenizer"),
        val_fraction=0.1,
        shard_tokens=4000,
        workers=1,
    )
    assert (out / "train-00002.bin").read_bytes()[32:] == (prepared / "train-00002.bin").read_bytes()[32:]


def test_empty_validation_split_says_so(tmp_path, text_dir, prepared):
    out = tmp_path / "noval"
    prepare(
        inputs=resolve_inputs([str(text_dir)]),
        out=out,
        tokenizer=str(prepared / "tokenizer"),
        val_fraction=0,
        workers=1,
    )
    with pytest.raises(SpecError, match=r"the val split of .* is empty \(prepared with --val-fraction 0 from 40"):
        TokenWindows(out, seq_len=16, split="val")


def test_interrupted_run_leaves_the_previous_output_intact(prepared, text_dir, tmp_path, monkeypatch):
    from dspipe.data import shards

    out = tmp_path / "data"
    kw = dict(
        inputs=resolve_inputs([str(text_dir)]),
        out=out,
        tokenizer=str(prepared / "tokenizer"),
        shard_tokens=4000,
        workers=1,
    )
    first = prepare(**kw).meta
    real_add = shards.ShardWriter.add

    def interrupt(self, tokens, lengths):  # Ctrl-C after the first shard files were written
        real_add(self, tokens, lengths)
        raise KeyboardInterrupt

    monkeypatch.setattr(shards.ShardWriter, "add", interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare(**kw, force=True)
    assert read_meta(out) == first and len(TokenWindows(out, seq_len=16)) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_killed_run_leaves_no_shard_a_loader_accepts(tmp_path, text_dir):
    out = tmp_path / "data"
    cmd = [
        sys.executable,
        "-m",
        "dspipe",
        "prepare-data",
        "--out",
        str(out),
        "--max-mb",
        "4",
        "--workers",
        "1",
        "--train-tokenizer",
        "300",
        "--tokenizer-sample-mb",
        "0.1",
        "--shard-tokens",
        "20000",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not list(tmp_path.glob(".data.tmp-*/train-00001.bin")) and time.time() < deadline:
            assert proc.poll() is None, "prepare-data ended before it could be interrupted"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    (tmp,) = tmp_path.glob(".data.tmp-*")
    assert not out.exists() and list(tmp.glob("train-*.bin"))
    with pytest.raises(SpecError, match="is not a prepared data directory"):
        TokenWindows(tmp, seq_len=16)
    prepare(inputs=resolve_inputs([str(text_dir)]), out=out, train_tokenizer=VOCAB, workers=1)
    assert not tmp.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # stale temp removed


def bad_utf8_dir(tmp_path, docs):
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.txt").write_text(docs[0])
    (d / "b.txt").write_bytes(docs[1].encode()[:7] + b"\xff\xfe rest")
    (d / "c.txt").write_text(docs[2])
    return d


def test_skip_bad_skips_non_utf8_files_with_a_count(tmp_path, docs, capsys):
    src = bad_utf8_dir(tmp_path, docs)
    assert (
        run_cli(
            "prepare-data", src, "--out", tmp_path / "out", "--train-tokenizer", VOCAB, "--skip-bad", "--workers", 1
        )
        == 0
    )
    assert "3 documents" not in capsys.readouterr().out
    meta = read_meta(tmp_path / "out")
    assert meta["num_documents"] == 2 and meta["skipped"]["bad_utf8"] == 1


def bad_cases(tmp_path, docs):
    empty = tmp_path / "empty"
    empty.mkdir()
    blank = tmp_path / "blank"
    blank.mkdir()
    (blank / "a.txt").write_text("")
    (blank / "b.txt").write_text("  \n\n")
    (tmp_path / "other.jsonl").write_text(json.dumps({"body": docs[0]}) + "\n")
    tiny = tmp_path / "tiny.txt"
    tiny.write_text(docs[0])
    return [
        ([empty], "empty input: no files under"),
        ([blank], "empty input: no documents with text in"),
        ([bad_utf8_dir(tmp_path, docs)], "b.txt is not UTF-8: byte 0xff at offset 7 (--skip-bad skips such files)"),
        ([tmp_path / "other.jsonl"], "no field 'text' in"),
        ([tmp_path / "nope.txt"], "no such file or directory"),
        ([tmp_path / "*.none"], "no files match"),
        ([tiny, "--val-fraction", "1.5"], "--val-fraction 1.5 must be in [0, 1)"),
        ([tiny, "--train-tokenizer", "100"], "must hold at least 257 tokens"),
        ([tiny, "--tokenizer", tmp_path / "no-tok", "--train-tokenizer", "300"], "not both"),
        ([tiny, "--tokenizer", "./no-such-dir"], "tokenizer directory ./no-such-dir does not exist"),
        ([tiny, "--txt-docs", "lines"], "'lines' is not one of 'file', 'blank-line'"),
    ]


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, docs, capsys):
    for args, message in bad_cases(tmp_path, docs):
        out = tmp_path / "out"
        before = sorted(p.name for p in tmp_path.iterdir())
        code = run_cli("prepare-data", *args, "--out", out, "--workers", 1)
        err = capsys.readouterr().err
        assert code == 2, (args, err)
        assert message in err, (message, err)
        assert err.startswith("dspipe: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
        assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == before


def cli_subprocess(*args, timeout=120):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "dspipe", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return r, time.time() - t0


def test_hub_names_fail_fast_offline_with_one_line(tmp_path, text_dir):
    from dspipe.data.sources import hub_reachable

    if hub_reachable() is None:
        pytest.skip("the Hugging Face hub is reachable from here")
    r, seconds = cli_subprocess(
        "prepare-data", "no-such-org/no-such-dataset", "--config", "x", "--out", tmp_path / "out"
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(
        "dspipe: error: cannot load dataset 'no-such-org/no-such-dataset' (config x, split "
        "train; not a local path either): huggingface.co is unreachable"
    )
    r2, seconds2 = cli_subprocess("prepare-data", text_dir, "--tokenizer", "gpt2", "--out", tmp_path / "out")
    assert r2.returncode == 2 and r2.stderr.count("\n") == 1, r2.stderr
    assert "dspipe: error: cannot load tokenizer 'gpt2': huggingface.co is unreachable" in r2.stderr
    assert seconds < 60 and seconds2 < 60, (seconds, seconds2)  # no retry loop (it takes 25-50 s, and warns)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
