"""A blend of two prepared datasets trained on 2 CPU ranks: killed with kill -9 between checkpoints and resumed, it
reproduces the uninterrupted run's per-step metrics and per-source validation losses bitwise, across an epoch of
the small source."""
import random

import pytest

from dspipe.runtime import checkpoint as ckpt
from tests.helpers import csv_rows, launch, make_run, ok, written_metrics

STEPS, EVERY = 8, 3


def small_dataset(root, tokenizer):
    """4 documents, one of them validation (~13 windows of 65 tokens), the train split ~40 windows: the blend's
    0.4 share (51 of 128 samples in 8 steps) runs through it more than once."""
    from dspipe.data.prepare import prepare
    from dspipe.data.sources import resolve_inputs

    rng = random.Random(7)
    words = "alpha beta gamma delta lambda return def class import yield while print".split()
    docs = root / "txt"
    docs.mkdir()
    for i in range(4):
        (docs / f"doc{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(350)) + "\n")
    prepare(inputs=resolve_inputs([str(docs)]), out=root / "small", tokenizer=str(tokenizer), val_fraction=0.25,
            workers=1)
    return root / "small"


@pytest.mark.distributed
def test_a_blend_resumes_exactly_after_kill_and_validates_per_source(tmp_path, corpus):
    second = small_dataset(tmp_path, corpus / "tokenizer")
    blend = f"{corpus}:0.6,{second}:0.4"
    flags = ["--precision", "fp32", "--zero", "1", "--save-interval", str(EVERY), "--keep-checkpoints", "2",
             "--eval-interval", "4", "--eval-batches", "2"]
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
    assert "resumed from" in r.stdout and "at step 3 (48 samples)" in r.stdout

    ref_steps = written_metrics(ref)
    assert len(ref_steps) == STEPS and written_metrics(run) == ref_steps  # loss, lr and grad norm bitwise
    val, val_ref = csv_rows(run / "val_metrics.csv"), csv_rows(ref / "val_metrics.csv")
    assert list(val[0]) == ["step", "tokens", "val_loss", "val_ppl", "val_loss_stdlib", "val_loss_small"]
    assert val == val_ref and [v["step"] for v in val] == ["4", "8"]
    for v in val:
        assert float(v["val_loss"]) == pytest.approx(0.6 * float(v["val_loss_stdlib"]) +
                                                     0.4 * float(v["val_loss_small"]), rel=1e-12)
    data = ckpt.read_meta(run / "checkpoints" / "global_step8")["data"]  # validated
    assert data == ckpt.read_meta(ref / "checkpoints" / "global_step8")["data"]
    assert [s["fingerprint"] for s in data["sources"]] != [] and data["consumed_samples"] == STEPS * 16
    small = data["sources"][1]
    assert (small["weight"], small["drawn"]) == (0.4, 51) and small["epoch"] >= 1  # the small source repeated
