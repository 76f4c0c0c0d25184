"""A blend of a prepared dataset and a Megatron dataset written by megatron-core's own builder, trained on 2 CPU
ranks: killed with kill -9 between checkpoints and resumed, it reproduces the uninterrupted run's per-step metrics
and per-source validation losses bitwise, across an epoch of the small source."""

import random
import shutil

import numpy as np
import pytest

from dspipe.runtime import ckpt_meta
from tests.helpers import csv_rows, launch, make_run, ok, written_metrics

STEPS, EVERY = 8, 3


def small_dataset(root, tokenizer):
    """33 short documents and a long last one, tokenized by dspipe, then written as a Megatron dataset by
    megatron-core's IndexedDatasetBuilder with the tokenizer beside it: the last 3% of its documents (the long
    one, ~18 windows of 65 tokens) are the validation split, the train split ~37 windows, so the blend's 0.4
    share (51 of 128 samples in 8 steps) runs through it more than once."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from dspipe.data import read_meta
    from dspipe.data.prepare import prepare
    from dspipe.data.shards import open_split
    from dspipe.data.sources import resolve_inputs

    rng = random.Random(7)
    words = "alpha beta gamma delta lambda return def class import yield while print".split()
    docs = root / "txt"
    docs.mkdir()
    for i in range(34):
        (docs / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(30 if i < 33 else 500)) + "\n")
    prepare(
        inputs=resolve_inputs([str(docs)]), out=root / "tokens", tokenizer=str(tokenizer), val_fraction=0.0, workers=1
    )
    ((toks, offsets),) = open_split(root / "tokens", "train", read_meta(root / "tokens"))
    (root / "mg").mkdir()
    shutil.copytree(root / "tokens" / "tokenizer", root / "mg" / "tokenizer")
    builder = IndexedDatasetBuilder(str(root / "mg" / "small.bin"), dtype=np.uint16)
    for a, b in zip(offsets[:-1], offsets[1:], strict=True):
        builder.add_document(torch.from_numpy(np.asarray(toks[a:b], dtype=np.int64)), [int(b - a)])
    builder.finalize(str(root / "mg" / "small.idx"))
    return root / "mg" / "small"


@pytest.mark.distributed
def test_a_blend_resumes_exactly_after_kill_and_validates_per_source(tmp_path, corpus):
    second = small_dataset(tmp_path, corpus / "tokenizer")
    blend = f"{corpus}:0.6,{second}:0.4"
    flags = [
        "--precision",
        "fp32",
        "--zero",
        "1",
        "--save-interval",
        str(EVERY),
        "--keep-checkpoints",
        "2",
        "--eval-interval",
        "4",
        "--eval-batches",
        "2",
    ]
    ref = make_run(tmp_path, blend, *flags, steps=STEPS, name="ref")
    r = launch(ref)
    ok(r)
    assert "| stdlib " in r.stdout and "| small " in r.stdout  # the validation line names each source

    run = make_run(tmp_path, blend, *flags, steps=STEPS, name="run")
    r = launch(run, "--test-faults", '{"kill_at_step": 5}')
    assert r.returncode != 0  # killed after step 5, checkpoint at 3
    assert (run / "checkpoints" / "latest").read_text() == "global_step3"
    r = launch(run)
    ok(r)
    assert "resumed from" in r.stderr and "at step 3 (48 samples)" in r.stderr  # the dspipe logger's (stderr)

    ref_steps = written_metrics(ref)
    assert len(ref_steps) == STEPS and written_metrics(run) == ref_steps  # loss, lr and grad norm bitwise
    val, val_ref = csv_rows(run / "val_metrics.csv"), csv_rows(ref / "val_metrics.csv")
    assert list(val[0]) == ["step", "tokens", "val_loss", "val_ppl", "val_loss_stdlib", "val_loss_small"]
    assert val == val_ref and [v["step"] for v in val] == ["4", "8"]
    for v in val:
        assert float(v["val_loss"]) == pytest.approx(
            0.6 * float(v["val_loss_stdlib"]) + 0.4 * float(v["val_loss_small"]), rel=1e-12
        )
    data = ckpt_meta.read_meta(run / "checkpoints" / "global_step8").data  # validated
    assert data == ckpt_meta.read_meta(ref / "checkpoints" / "global_step8").data
    assert [s["fingerprint"] for s in data["sources"]] != [] and data["consumed_samples"] == STEPS * 16
    small = data["sources"][1]
    assert (small["weight"], small["drawn"]) == (0.4, 51) and small["epoch"] >= 1  # the small source repeated
