"""Megatron / GPT-NeoX indexed datasets: files written by megatron-core's own IndexedDatasetBuilder are read as
they are (the tokens a loader yields are the .bin's, splits and EOD as documented), Megatron's blend syntax and
weighting, prepare-data --format megatron and convert-data read back by megatron-core's reader token for token,
and every bad file one line with exit code 2 and nothing written."""

import json
import shutil
import struct
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from dspipe.data import TokenWindows, TrainLoader, megatron, read_meta
from dspipe.data.blend import make_loader, open_sources, parse
from dspipe.errors import SpecError
from tests.helpers import dspipe, error_lines, run_cli

mcore = pytest.importorskip("megatron.core.datasets.indexed_dataset", reason="megatron-core (the test extra)")
SEQ = 16


def build(prefix: Path, docs: list[list[list[int]]], *, dtype=np.uint16) -> Path:
    """A Megatron dataset written by megatron-core's IndexedDatasetBuilder: each document a list of sequences."""
    import torch

    b = mcore.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        flat = [t for seq in doc for t in seq]
        b.add_document(torch.tensor(flat, dtype=torch.int64), [len(s) for s in doc])
    b.finalize(f"{prefix}.idx")
    return prefix


def random_docs(n: int, *, vocab: int, seed: int, eod: int | None = None, min_len=4, max_len=60):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        toks = rng.integers(0, vocab - 1, size=int(rng.integers(min_len, max_len))).tolist()
        if eod is not None:
            toks.append(eod)
        out.append([toks])
    return out


@pytest.fixture(scope="module")
def mdata(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("megatron")
    return build(root / "a_text_document", random_docs(400, vocab=1000, seed=1, eod=999))


def test_the_loader_yields_the_bins_tokens_in_the_documented_windows(mdata):
    """The first 3 steps' rows (2 ranks x micro 2 x ga 2 each) are windows of the .bin at multiples of SEQ inside
    the train split, all different; the split is the first 97% of documents; EOD and vocab from the data."""
    meta = read_meta(mdata)
    toks = np.fromfile(f"{mdata}.bin", dtype=np.uint16).astype(np.int64)
    idx = mcore.IndexedDataset(str(mdata))
    train_docs = 400 - round(0.03 * 400)
    assert meta["splits"]["train"]["num_documents"] == train_docs == 388
    assert meta["splits"]["val"]["num_documents"] == 12
    train_end = int(idx.sequence_lengths[:train_docs].sum())  # one sequence per document here
    assert meta["splits"]["train"]["num_tokens"] == train_end and meta["num_tokens"] == toks.size
    assert (meta["eos_id"], meta["max_id"], meta["vocab_size"]) == (999, 999, 1000)
    windows = TokenWindows(mdata, seq_len=SEQ)
    assert len(windows) == (train_end - 1) // SEQ
    seen = []
    for rank in range(2):
        loader = TrainLoader(windows=windows, seed=5, micro_batch=2, dp=2, dp_rank=rank)
        for _ in range(3 * 2):  # 3 steps of 2 micro-batches
            x, y = next(loader)
            for row_x, row_y in zip(x.numpy(), y.numpy(), strict=False):
                row = np.concatenate([row_x, row_y[-1:]])
                assert np.array_equal(row[1:], row_y)
                starts = [w for w in range(len(windows)) if np.array_equal(toks[w * SEQ : w * SEQ + SEQ + 1], row)]
                assert len(starts) == 1 and starts[0] * SEQ + SEQ < train_end
                seen.append(starts[0])
    assert len(set(seen)) == len(seen) == 24
    val = TokenWindows(mdata, seq_len=SEQ, split="val")
    assert np.array_equal(val[0], toks[train_end : train_end + SEQ + 1])


def test_megatrons_own_reader_and_dspipe_agree_on_documents_and_sequences(tmp_path):
    """Documents of several sequences (Megatron's sentence split), int32 ids above uint16, a dataset without EOD."""
    docs = [[[5, 6, 7], [8, 9]], [[70000, 1]], [[2], [3], [4, 99999]]]
    p = build(tmp_path / "multi", docs, dtype=np.int32)
    meta = read_meta(p)
    assert (meta["dtype"], meta["num_documents"], meta["num_tokens"]) == ("int32", 3, 11)
    assert (meta["max_id"], meta["vocab_size"], meta["eos_id"]) == (99999, 100000, None)  # no common last token
    index = megatron.read_index(p)
    assert list(index.doc_token_starts(np.arange(4))) == [0, 5, 7, 11]
    ours = np.concatenate(
        [t for t, _ in megatron.open_split(str(p), "train", meta) + megatron.open_split(str(p), "val", meta)]
    )
    ds = mcore.IndexedDataset(str(p))  # held: its arrays are views of its memory map, closed when it goes
    theirs = np.concatenate([ds[i] for i in range(6)])
    assert np.array_equal(ours, theirs) and ours.dtype == np.int32


def test_a_megatron_blend_gives_the_requested_mixture(tmp_path, mdata):
    b = build(tmp_path / "b_text_document", random_docs(300, vocab=1000, seed=2, eod=999))
    spec = parse(f"0.3 {mdata} 0.7 {b}")
    assert [str(s.share) for s in spec.sources] == ["3/10", "7/10"] and spec.text == f"{mdata}:0.3,{b}:0.7"
    windows = open_sources(spec, model_vocab=1024, seq_len=SEQ)
    loader = make_loader(spec, windows, seed=0, micro_batch=100, dp=1, dp_rank=0)
    src = np.concatenate([loader.next_indices()[0] for _ in range(100)])  # 10,000 samples
    assert abs((src == 0).mean() - 0.3) < 0.01 and abs((src == 1).mean() - 0.7) < 0.01
    sizes = [read_meta(p)["splits"]["train"]["num_tokens"] for p in (mdata, b)]
    weightless = parse(f"{mdata} {b}")  # Megatron weighs prefixes alone by their sizes
    assert [s.share for s in weightless.sources] == [Fraction(n, sum(sizes)) for n in sizes]


@pytest.mark.parametrize(
    "text,message",
    [
        ("0.3 {a} 0.7 {tmp}/missing", "blend source {tmp}/missing: {tmp}/missing is not a prepared data directory"),
        ("{a} {tmp}/missing", "--data source {tmp}/missing: not a Megatron dataset or prepared directory"),
        ("0 {a} 0 {a2}", "weight 0 must be positive"),
        ("-1 {a} 2 {a2}", "weight -1 must be positive"),
        ("0.3 {a} x {a2}", "'x' stands where a weight goes"),
    ],
)
def test_bad_megatron_blends_are_one_line(tmp_path, mdata, text, message):
    a2 = tmp_path / "a2"
    for ext in (".bin", ".idx"):
        shutil.copy(f"{mdata}{ext}", f"{a2}{ext}")
    fill = {"a": mdata, "a2": a2, "tmp": tmp_path}
    out = tmp_path / "run"
    r = dspipe(
        "gen-config",
        "--model",
        "tiny",
        "--gpus-per-node",
        "2",
        "--gpu",
        "cpu",
        "--global-batch",
        "8",
        "--data",
        text.format(**fill),
        "--out",
        out,
    )
    assert r.returncode == 2 and len(error_lines(r)) == 1, r.stderr
    assert message.format(**fill) in r.stderr and not out.exists()


def corrupt(tmp_path: Path, mdata: Path, how: str) -> Path:
    p = tmp_path / f"bad_{how}"
    for ext in (".bin", ".idx"):
        shutil.copy(f"{mdata}{ext}", f"{p}{ext}")
    if how == "truncated-bin":
        with open(f"{p}.bin", "r+b") as f:
            f.truncate(Path(f"{p}.bin").stat().st_size - 6)
    elif how == "version":
        with open(f"{p}.idx", "r+b") as f:
            f.seek(9)
            f.write(struct.pack("<Q", 2))
    elif how == "foreign":
        Path(f"{p}.idx").write_bytes(b"DSPINDEX" + bytes(100))
    elif how == "float":
        with open(f"{p}.idx", "r+b") as f:
            f.seek(17)
            f.write(struct.pack("<B", 7))
    elif how == "truncated-idx":
        with open(f"{p}.idx", "r+b") as f:
            f.truncate(Path(f"{p}.idx").stat().st_size - 8)
    elif how == "truncated-header":  # the magic, then the file ends inside the header
        with open(f"{p}.idx", "r+b") as f:
            f.truncate(16)
    elif how == "small-dtype":  # a uint16 dataset beside a tokenizer of 70,000 tokens
        tok = p.parent / "tokenizer"
        tok.mkdir()
        (tok / "tokenizer.json").write_text(
            json.dumps({"model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(70000)}}})
        )
    return p


@pytest.mark.parametrize(
    "how,message",
    [
        (
            "truncated-bin",
            "bad_truncated-bin.bin has 26302 bytes; the index's 400 sequences hold 13154 uint16 tokens = 26308 bytes",
        ),
        ("version", "is index version 2; dspipe reads version 1"),
        ("foreign", "is not a Megatron index (its first bytes are b'DSPINDEX\\x00'"),
        ("float", "stores float32 values, not token ids"),
        ("truncated-idx", "implies 34 + 12 x 400 + 8 x 401 = 8042: truncated or corrupt"),
        ("truncated-header", "bad_truncated-header.idx is truncated: 16 bytes, shorter than its 34-byte header"),
        ("small-dtype", "stores uint16 token ids (at most 65,535) but tokenizer"),
    ],
)
def test_bad_megatron_files_are_one_line_and_nothing_is_written(tmp_path, mdata, how, message):
    p = corrupt(tmp_path, mdata, how)
    out = tmp_path / "run"
    r = dspipe(
        "gen-config",
        "--model",
        "tiny",
        "--gpus-per-node",
        "2",
        "--gpu",
        "cpu",
        "--global-batch",
        "8",
        "--data",
        p,
        "--out",
        out,
    )
    assert r.returncode == 2 and len(error_lines(r)) == 1, r.stderr
    assert message in r.stderr and not out.exists()
    r = dspipe("convert-data", p, "--out", tmp_path / "conv")
    assert r.returncode == 2 and message in r.stderr and not (tmp_path / "conv").exists()


def test_the_model_vocab_must_hold_the_largest_id(tmp_path, mdata, capsys):
    assert (
        run_cli(
            "gen-config",
            "--model",
            "tiny",
            "--gpus-per-node",
            "2",
            "--gpu",
            "cpu",
            "--global-batch",
            "8",
            "--data",
            mdata,
            "--out",
            tmp_path / "small",
            "--vocab",
            "512",
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "token id 999 in" in err and "does not fit model vocab 512" in err and not (tmp_path / "small").exists()
    assert (
        run_cli(
            "gen-config",
            "--model",
            "tiny",
            "--gpus-per-node",
            "2",
            "--gpu",
            "cpu",
            "--global-batch",
            "8",
            "--data",
            mdata,
            "--out",
            tmp_path / "fits",
            "--pad-vocab",
            "--micro-batch",
            "1",
        )
        == 0
    ), capsys.readouterr().err
    assert json.loads((tmp_path / "fits" / "dspipe.json").read_text())["model"]["vocab"] == 1024


def test_prepare_data_format_megatron_reads_back_in_megatron_core(tmp_path, corpus):
    """prepare-data --format megatron -> megatron-core's reader: every token equal to the dspipe preparation's
    (train documents then validation); then convert-data back: the same tokens and documents again."""
    text = tmp_path / "txt"
    text.mkdir()
    for i in range(30):
        (text / f"d{i:02d}.txt").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (3 + i % 5))
    ref, out = tmp_path / "ref", tmp_path / "mg"
    tok = corpus / "tokenizer"
    assert run_cli("prepare-data", text, "--out", ref, "--tokenizer", tok, "--workers", "1") == 0
    assert (
        run_cli("prepare-data", text, "--out", out, "--tokenizer", tok, "--workers", "1", "--format", "megatron") == 0
    )
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "text_document.bin",
        "text_document.idx",
        "tokenizer",
    ]
    assert not list(tmp_path.glob(".mg*"))  # the intermediate tokens are gone
    theirs = mcore.IndexedDataset(str(out / "text_document"))
    from dspipe.data.shards import open_split

    meta = read_meta(ref)
    docs = []
    for split in ("train", "val"):
        for toks, offsets in open_split(ref, split, meta):
            docs += [toks[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=False)]
    assert len(theirs) == len(docs) == meta["num_documents"] == 30
    assert all(np.array_equal(theirs[i], d) for i, d in enumerate(docs))
    assert list(theirs.document_indices) == list(range(31))
    back = tmp_path / "back"
    assert run_cli("convert-data", out / "text_document", "--out", back) == 0
    again = read_meta(back)
    assert again["eos_id"] == meta["eos_id"] and again["vocab_size"] == meta["vocab_size"]
    redo = []
    for split in ("train", "val"):
        for toks, offsets in open_split(back, split, again):
            redo += [toks[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=False)]
    assert len(redo) == 30 and all(np.array_equal(a, b) for a, b in zip(redo, docs, strict=False))
    assert (back / "tokenizer" / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()


def test_a_megatron_prefix_round_trips_byte_for_byte(tmp_path, mdata, corpus):
    d, m = tmp_path / "d", tmp_path / "m"
    assert run_cli("convert-data", mdata, "--out", d, "--tokenizer", corpus / "tokenizer") == 0  # ids < 1000 < 1024
    assert run_cli("convert-data", d, "--out", m) == 0
    for ext in (".bin", ".idx"):
        assert Path(f"{mdata}{ext}").read_bytes() == (m / f"text_document{ext}").read_bytes()
    assert run_cli("convert-data", d, "--out", m) == 2  # an earlier output is replaced only with --force
    assert run_cli("convert-data", d, "--out", m, "--force") == 0


def test_a_prefix_without_eod_does_not_convert_but_trains(tmp_path, capsys):
    p = build(tmp_path / "noeod", random_docs(40, vocab=300, seed=3))
    assert run_cli("convert-data", p, "--out", tmp_path / "d") == 2
    assert "do not all end in one EOD token" in capsys.readouterr().err and not (tmp_path / "d").exists()
    windows = TokenWindows(p, seq_len=SEQ)
    assert len(windows) > 10 and read_meta(p)["eos_id"] is None


def test_the_scan_is_cached_per_file_version(tmp_path, mdata, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = read_meta(mdata)
    assert len(list((tmp_path / "cache" / "dspipe" / "megatron").glob("*.json"))) == 1
    calls = []
    monkeypatch.setattr(megatron, "tokens", lambda index: calls.append(1) or np.zeros(0))
    assert read_meta(mdata)["max_id"] == first["max_id"] and not calls  # from the cache
    with pytest.raises(SpecError):
        megatron.read_index(tmp_path / "absent")


@pytest.mark.parametrize(
    "damage", [{"max_id": "x"}, {"max_id": None}, {"min_id": "0"}, {"max_id": -5}, {"max_id": 1.5}, {"eod": "a"}]
)
def test_a_damaged_scan_cache_entry_is_scanned_again(tmp_path, mdata, monkeypatch, damage):
    """The cache is dspipe's own derived file: an entry that is not what the scan writes (a TypeError once) is a
    miss, scanned again and written over."""
    import json

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = read_meta(mdata)
    (entry,) = (tmp_path / "cache" / "dspipe" / "megatron").glob("*.json")
    entry.write_text(json.dumps({**json.loads(entry.read_text()), **damage}))
    assert read_meta(mdata) == first
    assert all(json.loads(entry.read_text())[k] == v for k, v in megatron.scan(megatron.read_index(mdata)).items())


def test_a_config_files_data_section_takes_megatrons_blend(tmp_path, mdata):
    b = tmp_path / "b"
    for ext in (".bin", ".idx"):
        shutil.copy(f"{mdata}{ext}", f"{b}{ext}")
    (tmp_path / "c.yaml").write_text(f'data: {{data: "30 {mdata} 70 {b}"}}\n')
    out = tmp_path / "run"
    r = dspipe(
        "gen-config",
        "--config",
        tmp_path / "c.yaml",
        "--model",
        "tiny",
        "--gpus-per-node",
        "2",
        "--gpu",
        "cpu",
        "--global-batch",
        "8",
        "--micro-batch",
        "1",
        "--pad-vocab",
        "--out",
        out,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "dspipe.json").read_text())["data"] == f"{mdata}:30,{b}:70"
    assert f"blend: {mdata} 30.0%, {b} 70.0%" in r.stdout


def test_generate_and_export_find_the_tokenizer_beside_the_prefix(tmp_path, mdata, corpus):
    from dspipe.data.blend import tokenizer_dir

    assert tokenizer_dir(str(mdata)) == mdata.parent / "tokenizer"
    d = tmp_path / "mg"
    assert run_cli("convert-data", corpus, "--out", d) == 0
    assert tokenizer_dir(f"{d}/text_document:0.5,{corpus}:0.5") == d / "tokenizer"
    meta = read_meta(d / "text_document")
    assert meta["tokenizer_dir"] == str(d / "tokenizer") and meta["vocab_size"] == read_meta(corpus)["vocab_size"]
    assert meta["eos_id"] == read_meta(corpus)["eos_id"]


def test_gen_config_keeps_a_prefixs_tokenizer_with_the_run(tmp_path, corpus):
    from dspipe.tools.export import tokenizer_dir as checkpoint_tokenizer

    d = tmp_path / "mg"
    assert run_cli("convert-data", corpus, "--out", d) == 0
    run = tmp_path / "run"
    assert (
        run_cli(
            "gen-config",
            "--model",
            "tiny",
            "--gpus-per-node",
            "2",
            "--gpu",
            "cpu",
            "--global-batch",
            "8",
            "--data",
            d / "text_document",
            "--out",
            run,
            "--pad-vocab",
            "--micro-batch",
            "1",
        )
        == 0
    )
    kept = run / "tokenizer" / "tokenizer.json"
    assert kept.read_bytes() == (corpus / "tokenizer" / "tokenizer.json").read_bytes()
    shutil.rmtree(d / "tokenizer")  # the corpus's side may move on; the run keeps its own
    assert checkpoint_tokenizer(run / "checkpoints" / "global_step1") == run / "tokenizer"
    assert (
        run_cli(
            "gen-config",
            "--model",
            "tiny",
            "--gpus-per-node",
            "2",
            "--gpu",
            "cpu",
            "--global-batch",
            "8",
            "--data",
            d / "text_document",
            "--out",
            run,
            "--pad-vocab",
            "--micro-batch",
            "1",
            "--force",
        )
        == 0
    )
    assert kept.is_file()  # a prefix without a tokenizer beside it now: the run's stays


def test_an_unreadable_bin_is_one_line(tmp_path, mdata, monkeypatch):
    p = tmp_path / "locked"
    for ext in (".bin", ".idx"):
        shutil.copy(f"{mdata}{ext}", f"{p}{ext}")
    real_open = open

    def failing(path, *a, **k):
        if str(path) == f"{p}.bin":
            raise PermissionError(13, "Permission denied")
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", failing)
    with pytest.raises(SpecError, match=r"locked\.bin: cannot read it \(Permission denied\)"):
        read_meta(p)


def test_gen_config_tokenizer_is_checked_and_kept_with_the_run(tmp_path, mdata, corpus):
    """--tokenizer DIR for a prefix without tokenizer/ beside it: --pad-vocab sizes the model to its vocab, the note
    names it, RUN/tokenizer is a copy, config.yaml keeps it; a prepared directory, a directory without
    tokenizer.json, ids outside it and a model vocab below it are one line each, nothing written."""
    tok = corpus / "tokenizer"
    flags = [
        "--model",
        "tiny",
        "--seq-len",
        str(SEQ),
        "--gpus-per-node",
        "2",
        "--gpu",
        "cpu",
        "--global-batch",
        "8",
        "--eval-interval",
        "0",
    ]
    out = tmp_path / "run"
    r = dspipe("gen-config", *flags, "--data", mdata, "--tokenizer", tok, "--pad-vocab", "--out", out)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "dspipe.json").read_text())["model"]["vocab"] == 1024  # the tokenizer's 1024, not 1000
    assert f"tokenizer {tok} (--tokenizer)" in r.stderr
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    assert f"tokenizer: {tok}" in (out / "config.yaml").read_text()
    small = build(tmp_path / "small_ids", random_docs(50, vocab=200, seed=3, eod=199))
    wide = build(tmp_path / "wide_ids", random_docs(50, vocab=5000, seed=3, eod=4999))
    cases = [
        (["--data", corpus, "--tokenizer", tok], f"--tokenizer {tok} is for Megatron prefixes; {corpus} is not one"),
        (["--data", mdata, "--tokenizer", tmp_path], f"--tokenizer {tmp_path}: no tokenizer.json"),
        (["--data", wide, "--tokenizer", tok, "--vocab", "8192"], "token id 4,999 in"),
        (
            ["--data", small, "--tokenizer", tok, "--vocab", "512"],
            f"tokenizer vocab 1,024 in --tokenizer {tok} > model vocab 512",
        ),
    ]
    for extra, message in cases:
        bad = tmp_path / "bad"
        r = dspipe("gen-config", *flags, *extra, "--out", bad)
        assert r.returncode == 2 and len(error_lines(r)) == 1, r.stderr
        assert message in r.stderr and not bad.exists(), r.stderr
