"""CheckpointMeta: a checkpoint's dspipe.json read and written in one place, its on-disk format unchanged."""

import json
from dataclasses import asdict, replace

import pytest

from dspipe.errors import SpecError
from dspipe.runtime.ckpt_meta import CheckpointMeta, SaveRecord, read_meta, write_meta
from dspipe.spec.presets import model_preset

DATA = {"consumed_samples": 48, "seed": 0, "seq_len": 64, "num_samples": 100, "split": "train", "fingerprint": "ab"}
CURRENT = {
    "step": 3,
    "consumed_samples": 48,
    "data": DATA,
    "model": asdict(model_preset("tiny")),
    "pp": 1,
    "tp": 1,
    "sp": 1,
    "zero_stage": 1,
    "dp": 2,
    "ep": 1,
    "world_size": 2,
    "run_spec": {"model": {"name": "tiny"}},
    "save_interval": 4,
    "save": {
        "mode": "sync",
        "completed_after_step": 3,
        "blocking_s": 0.5,
        "write_s": 0.5,
        "writer_cpu_s": 0.0,
        "rank_max_bytes": 10,
        "bytes": 20,
    },
}


def test_a_current_meta_round_trips_to_identical_json(tmp_path):
    text = json.dumps(CURRENT, indent=2, allow_nan=False) + "\n"  # as checkpoint.complete has always written it
    (tmp_path / "dspipe.json").write_text(text)
    meta = read_meta(tmp_path)
    assert (meta.step, meta.dp, meta.layout, meta.save_interval) == (3, 2, (2, 1, 1), 4)
    assert meta.to_json() == text
    (tmp_path / "again").mkdir()
    write_meta(tmp_path / "again", meta)
    assert (tmp_path / "again" / "dspipe.json").read_text() == text


def test_an_older_meta_reads_with_its_defaults(tmp_path):
    old = {k: v for k, v in CURRENT.items() if k not in ("tp", "sp", "ep", "run_spec", "save_interval", "save")}
    (tmp_path / "dspipe.json").write_text(json.dumps({**old, "unknown_later_key": 1}))
    meta = read_meta(tmp_path)
    assert (meta.tp, meta.sp, meta.ep, meta.run_spec, meta.save_interval, meta.save) == (1, 1, 1, None, None, None)
    assert list(meta.to_dict()) == [
        "step",
        "consumed_samples",
        "data",
        "model",
        "pp",
        "tp",
        "sp",
        "zero_stage",
        "dp",
        "ep",
        "world_size",
    ]


@pytest.mark.parametrize(
    "change,words",
    [
        ({"step": None}, "missing key step"),
        ({"dp": "2"}, "dp must be an integer"),
        ({"save_interval": "soon"}, "save_interval must be an integer"),
        ({"zero_stage": 5}, "zero_stage 5 is not one of"),
        ({"save": [1]}, "save must be an object (the save's figures), got list"),
        ({"save": {k: v for k, v in CURRENT["save"].items() if k != "write_s"}}, "missing save.write_s"),
        ({"save": {**CURRENT["save"], "mode": "later"}}, "save.mode 'later' is not one of: sync, async"),
        ({"save": {**CURRENT["save"], "bytes": -1}}, "save.bytes must be an integer >= 0, got -1"),
        ({"save": {**CURRENT["save"], "write_s": "slow"}}, "save.write_s must be a number >= 0, got 'slow'"),
    ],
)
def test_a_missing_or_mistyped_key_is_one_line_naming_file_and_key(tmp_path, change, words):
    meta = {**CURRENT, **change}
    meta = {k: v for k, v in meta.items() if v is not None}
    (tmp_path / "dspipe.json").write_text(json.dumps(meta))
    with pytest.raises(SpecError) as e:
        read_meta(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'dspipe.json'}: ") and words in str(e.value)
    assert "\n" not in str(e.value)


def test_the_meta_is_frozen():
    meta = CheckpointMeta.from_dict(CURRENT, source="x")
    with pytest.raises(AttributeError):
        meta.step = 4
    assert isinstance(meta.save, SaveRecord) and meta.save.to_dict() == CURRENT["save"]
    with pytest.raises(AttributeError):
        meta.save.mode = "async"
    background = replace(meta.save, mode="async")
    assert meta.with_save(background).save == background and meta.save.mode == "sync"


def test_the_save_record_keeps_its_values_as_read(tmp_path):
    """Seconds written as integers stay integers and a null bytes stays null: dspipe.json reads back unchanged."""
    save = {**CURRENT["save"], "blocking_s": 2, "write_s": 0, "bytes": None, "later_key": 1}
    meta = CheckpointMeta.from_dict({**CURRENT, "save": save}, source="x")
    assert meta.save == SaveRecord(
        mode="sync", completed_after_step=3, blocking_s=2, write_s=0, writer_cpu_s=0.0, rank_max_bytes=10, bytes=None
    )
    assert meta.to_dict()["save"] == {k: v for k, v in save.items() if k != "later_key"}
    assert list(meta.to_dict()) == list(CURRENT)
