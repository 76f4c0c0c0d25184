"""prepare-data / convert-data / gen-config's data checks on inputs found by fuzzing: each is one line `dspipe: error:`
(exit 2) that names the file and the numbers, and nothing is written, deleted or silently changed."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from dspipe.data.checks import check_data_for_model
from dspipe.errors import SpecError
from tests.helpers import run_cli

WORDS = "sat cat mat fast ran on the dog".split()


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A prepared directory of a few small text files (a 300-token BPE, 20% validation), and its Megatron copy."""
    root = tmp_path_factory.mktemp("small")
    txt = root / "txt"
    txt.mkdir()
    rng = np.random.default_rng(0)
    for i in range(5):
        (txt / f"f{i}.txt").write_text(" ".join(rng.choice(WORDS, 600)))
    assert run_cli("prepare-data", txt, "--out", root / "ok", "--train-tokenizer", 300, "--workers", 1,
                   "--val-fraction", 0.2) == 0  # fmt: skip
    assert run_cli("convert-data", root / "ok", "--out", root / "mg") == 0
    return root


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def one_error(capsys, code: int, *words) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dspipe: error: "), err
    assert "Traceback" not in err
    for w in words:
        assert str(w) in lines[0], lines[0]
    return lines[0]


def copy(small: Path, tmp_path: Path, name: str = "d", what: str = "ok") -> Path:
    dst = tmp_path / name
    shutil.copytree(small / what, dst)
    return dst


# ---- 1. convert-data never replaces its own source ---------------------------------------------------------------


def test_convert_data_refuses_an_out_that_is_its_source_and_keeps_it(small, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = copy(small, tmp_path)
    before = snapshot(d)
    one_error(capsys, run_cli("convert-data", "d", "--out", "d", "--force"), "--out d is the source directory d")
    os.symlink("d", "link")
    one_error(capsys, run_cli("convert-data", "link", "--out", "d", "--force"), "resolved", "itself")
    one_error(capsys, run_cli("convert-data", "d", "--out", "d/sub"), "--out d/sub lies inside the source directory d")
    one_error(capsys, run_cli("convert-data", "d", "--out", ".", "--force"), "--out . contains the source directory d")
    assert snapshot(d) == before and not (d / "sub").exists()


def test_convert_data_refuses_a_prefix_into_the_directory_that_holds_it(small, tmp_path, capsys):
    m = copy(small, tmp_path, "m", "mg")
    before = snapshot(m)
    code = run_cli("convert-data", m / "text_document", "--out", m, "--force")
    one_error(capsys, code, f"--out {m} contains the source's index {m / 'text_document.idx'}")
    assert snapshot(m) == before


# ---- 2. prepare-data never reads its own output ------------------------------------------------------------------


def test_prepare_data_refuses_an_out_inside_an_input_directory(small, tmp_path, capsys):
    txt = tmp_path / "txt"
    shutil.copytree(small / "txt", txt)
    for fmt in ("dspipe", "megatron"):
        code = run_cli("prepare-data", txt, "--out", txt / "sub", "--workers", 1, "--format", fmt)
        one_error(capsys, code, f"--out {txt / 'sub'} lies inside input directory {txt}", "re-run")
    assert sorted(p.name for p in txt.iterdir()) == [f"f{i}.txt" for i in range(5)]
    one_error(capsys, run_cli("prepare-data", txt, "--out", txt, "--force"), f"--out {txt} is input directory")
    code = run_cli("prepare-data", txt / "f0.txt", "--out", txt, "--force")
    one_error(capsys, code, f"input {txt / 'f0.txt'} lies inside --out {txt}")
    assert sorted(p.name for p in txt.iterdir()) == [f"f{i}.txt" for i in range(5)]


# ---- 3. convert-data writes nothing incomplete or unchecked ------------------------------------------------------


def test_convert_data_needs_the_tokenizer_of_a_prepared_directory(small, tmp_path, capsys):
    d = copy(small, tmp_path)
    shutil.rmtree(d / "tokenizer")
    one_error(capsys, run_cli("convert-data", d, "--out", tmp_path / "m"), f"{d / 'tokenizer'} is missing")
    assert not (tmp_path / "m").exists()
    (d / "tokenizer").mkdir()
    (d / "tokenizer" / "tokenizer.json").write_text("{garbage")
    one_error(capsys, run_cli("convert-data", d, "--out", tmp_path / "m"), "tokenizer.json", "not valid JSON")
    assert not (tmp_path / "m").exists()


def test_convert_data_does_not_invent_a_prefixs_tokenizer(small, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(small / "mg" / f"text_document{ext}", bare / f"text_document{ext}")
    code = run_cli("convert-data", bare / "text_document", "--out", tmp_path / "d")
    one_error(capsys, code, "has no tokenizer", str(bare / "tokenizer"), "--tokenizer DIR")
    assert not (tmp_path / "d").exists()
    tok = small / "ok" / "tokenizer"
    code = run_cli("convert-data", bare / "text_document", "--out", tmp_path / "d", "--tokenizer", tok)
    assert code == 0
    vocab = json.loads((small / "ok/meta.json").read_text())["vocab_size"]
    assert json.loads((tmp_path / "d/meta.json").read_text())["vocab_size"] == vocab


def test_convert_data_refuses_ids_outside_meta_jsons_vocab(small, tmp_path, capsys):
    d = copy(small, tmp_path)
    meta = json.loads((d / "meta.json").read_text())
    top = int(np.fromfile(d / "train-00000.bin", dtype=np.uint16, offset=32).max())
    meta["vocab_size"] = 5
    (d / "meta.json").write_text(json.dumps(meta))
    code = run_cli("convert-data", d, "--out", tmp_path / "m")
    one_error(capsys, code, f"train-00000.bin holds token id {top}, outside vocab_size 5")
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".*"))


# ---- 4, 5. inputs that are no input ------------------------------------------------------------------------------


def test_prepare_data_refuses_an_empty_input(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_error(capsys, run_cli("prepare-data", "", "--out", "o"), "input '' is empty")
    one_error(capsys, run_cli("prepare-data", "--source", "", "--out", "o"), "input '' is empty")
    one_error(capsys, run_cli("prepare-data", "x.txt", "--out", ""), "--out is empty")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--config", "foo"], "--config 'foo': only a Hugging Face dataset has a configuration and split"),
        (["--split", ""], "--split '': only"),
        (["--split", "validation", "--config", "c"], "--config 'c' and --split 'validation': only"),
    ],
)
def test_hub_options_with_local_inputs_are_refused(small, tmp_path, capsys, flags, words):
    for inputs in ([small / "txt"], []):  # local files, and the built-in corpus
        one_error(capsys, run_cli("prepare-data", *inputs, "--out", tmp_path / "o", *flags), words, "local files")
    assert not (tmp_path / "o").exists()


def test_a_looping_or_broken_link_input_is_no_hub_name(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.symlink("loop", "loop")
    os.symlink("nowhere", "broken")
    err = one_error(capsys, run_cli("prepare-data", "loop", "--out", "o"), "input loop is a symlink loop")
    assert "huggingface" not in err
    one_error(capsys, run_cli("prepare-data", "broken", "--out", "o"), "input broken is a broken symlink")


# ---- 6. a vocabulary smaller than asked is explained -------------------------------------------------------------


def test_a_bpe_smaller_than_asked_says_why(small, tmp_path, capsys):
    code = run_cli("prepare-data", small / "txt", "--out", tmp_path / "o", "--train-tokenizer", 300, "--workers", 1)
    assert code == 0
    err = capsys.readouterr().err
    assert "note: the BPE has 279 tokens, not the 300 asked for" in err and "22 merges" in err, err


# ---- 7. a .jsonl row that is no object ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, text, words",
    [
        ("a.jsonl", "[1,2,3]\n", "line 1 is a JSON array, not an object"),
        ("b.jsonl", '{"text": "a b"}\n"word"\n', "line 2 is a JSON string, not an object"),
        ("c.json", '[{"text": "a b"}, 5]', "record 1 of its top-level array is a JSON number"),
        ("d.jsonl", '{"text": "a"}\n{bad\n', "line 2 is not JSON (Expecting property name enclosed in double quotes"),
    ],
)
def test_a_json_record_that_is_no_object_says_so(tmp_path, capsys, name, text, words):
    (tmp_path / name).write_text(text)
    code = run_cli("prepare-data", tmp_path / name, "--out", tmp_path / "o", "--workers", 1, "--train-tokenizer", 300)
    one_error(capsys, code, f"{tmp_path / name}: {words}", "field 'text'")
    assert not (tmp_path / "o").exists()


# ---- 8, 9. a damaged shard is named for what is wrong ------------------------------------------------------------


def test_a_damaged_shard_header_is_named_for_what_differs(small, tmp_path, capsys):
    d = copy(small, tmp_path)
    shard = d / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[10:12] = b"\x07\x00"  # the format version's upper half
    shard.write_bytes(bytes(data))
    err = one_error(capsys, run_cli("convert-data", d, "--out", tmp_path / "m"), "header says format version 458753")
    assert "another prepared dataset" not in err and not (tmp_path / "m").exists()
    data[8:16] = (1).to_bytes(4, "little") + (4).to_bytes(4, "little")  # version 1, 4-byte items
    shard.write_bytes(bytes(data))
    one_error(capsys, run_cli("convert-data", d, "--out", tmp_path / "m"), "4-byte items", "implies 2 (uint16)")


def test_a_shard_that_is_a_directory_says_so(small, tmp_path, capsys):
    d = copy(small, tmp_path)
    (d / "train-00000.bin").unlink()
    (d / "train-00000.bin").mkdir()
    one_error(capsys, run_cli("convert-data", d, "--out", tmp_path / "m"), "train-00000.bin is a directory, not a file")


def test_document_offsets_that_decrease_are_refused_not_converted(small, tmp_path, capsys):
    """open_split checks the first and last offsets only; convert-data reads every document, and a decreasing offset
    would be written as a negative length (a Megatron file dspipe itself then refuses)."""
    d = copy(small, tmp_path)
    idx = d / "train-00000.idx"
    data = bytearray(idx.read_bytes())
    n = json.loads((d / "meta.json").read_text())["splits"]["train"]["shards"][0]["num_documents"]
    head = len(data) - 8 * (n + 1)
    offsets = np.frombuffer(bytes(data[head:]), dtype="<u8").copy()
    offsets[2] = offsets[4]  # document 2 now starts after document 3
    idx.write_bytes(bytes(data[:head]) + offsets.tobytes())
    err = one_error(capsys, run_cli("convert-data", d, "--out", tmp_path / "m"), "train-00000.idx: document 3 starts")
    assert f"before document 2 (at {int(offsets[4]):,}): the index is damaged" in err
    assert not (tmp_path / "m").exists()


def test_a_broken_entry_inside_an_input_directory_or_glob_is_named(small, tmp_path, capsys):
    """Given alone, a broken link or FIFO is refused; found inside a directory or by a glob it was left out without
    a word. Now it is named (with the count), or left out with a note under --skip-bad."""
    src = tmp_path / "in"
    shutil.copytree(small / "txt", src)
    os.symlink(tmp_path / "nowhere", src / "gone.txt")
    os.mkfifo(src / "pipe.txt")
    out = tmp_path / "out"
    for spec, within in ((src, f"(under {src})"), (f"{src}/*.txt", f"(matched by '{src}/*.txt')")):
        err = one_error(capsys, run_cli("prepare-data", spec, "--out", out), f"input {src}/gone.txt {within}")
        assert "is a broken symlink" in err and "and 1 more such entry; remove it or give --skip-bad" in err
        assert not out.exists()
    assert run_cli("prepare-data", src, "--out", out, "--train-tokenizer", 300, "--workers", 1, "--skip-bad") == 0
    err = capsys.readouterr().err
    assert f"note: --skip-bad: left out 2 entries under {src} that are no file to read (first {src}/gone.txt)" in err


# ---- 10. gen-config's data check sees broken files ---------------------------------------------------------------


def _empty_bin(d):
    (d / "train-00000.bin").write_bytes(b"")


def _no_bin(d):
    (d / "val-00000.bin").unlink()


def _random_idx(d):
    size = (d / "train-00000.idx").stat().st_size
    (d / "train-00000.idx").write_bytes(np.random.default_rng(1).bytes(size))


def _bad_offsets(d):
    data = bytearray((d / "train-00000.idx").read_bytes())
    data[-8:] = (5).to_bytes(8, "little")
    (d / "train-00000.idx").write_bytes(bytes(data))


def _no_tokenizer(d):
    shutil.rmtree(d / "tokenizer")


def _tokenizer_file(d):
    shutil.rmtree(d / "tokenizer")
    (d / "tokenizer").write_text("x")


def _garbage_tokenizer_config(d):
    (d / "tokenizer" / "tokenizer_config.json").write_bytes(b"\x00garbage")


def _empty_special_tokens(d):
    (d / "tokenizer" / "special_tokens_map.json").write_text("")


BROKEN = [
    (_empty_bin, "train-00000.bin has 0 bytes, less than a dspipe token shard's 32-byte header"),
    (_no_bin, "val-00000.bin does not exist"),
    (_random_idx, "train-00000.idx is not a dspipe document index (it starts with"),
    (_bad_offsets, "train-00000.idx: its document offsets run 0..5, want 0.."),
    (_no_tokenizer, "tokenizer is missing (meta.json names it"),
    (_tokenizer_file, "tokenizer is not a directory"),
    (_garbage_tokenizer_config, "tokenizer/tokenizer_config.json is not valid JSON"),
    (_empty_special_tokens, "tokenizer/special_tokens_map.json is not valid JSON: it ends early"),
]


@pytest.mark.parametrize("damage, words", BROKEN, ids=[b[0].__name__[1:] for b in BROKEN])
def test_the_data_check_sees_broken_files(small, tmp_path, damage, words):
    d = copy(small, tmp_path)
    check_data_for_model(d, model_vocab=512, seq_len=16)
    damage(d)
    with pytest.raises(SpecError, match="^.*" + words.replace("(", r"\(").replace(".", r"\.")):
        check_data_for_model(d, model_vocab=512, seq_len=16)


def test_convert_data_refuses_a_damaged_tokenizer_config(small, tmp_path, capsys):
    d = copy(small, tmp_path)
    _garbage_tokenizer_config(d)
    code = run_cli("convert-data", d, "--out", tmp_path / "mg")
    one_error(capsys, code, f"{d / 'tokenizer' / 'tokenizer_config.json'} is not valid JSON")
    assert not (tmp_path / "mg").exists()


def test_gen_config_refuses_a_data_dir_with_a_missing_shard(small, tmp_path, capsys):
    d = copy(small, tmp_path)
    (d / "train-00000.bin").unlink()
    gen = ["--model", "tiny", "--gpu", "cpu", "--gpus-per-node", 2, "--measure", "never", "--steps", 20]
    code = run_cli("gen-config", *gen, "--eval-interval", 0, "--data", d, "--out", tmp_path / "run")
    one_error(capsys, code, f"{d / 'train-00000.bin'} does not exist")
    assert not (tmp_path / "run").exists()
