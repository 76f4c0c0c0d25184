"""Data blending (`--data a:0.7,b:0.3`): the parser and its one-line errors, the exact greedy order (proportions,
every prefix within 1 of its share, determinism), the blend loader over real prepared data (the same global order at
any dp, each source's own per-epoch order, exact resume, refusal of a changed blend), a single directory read exactly
as before, the checks between sources, per-source validation columns, the checkpoint's data state and gen-config."""

import json
import random
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from dspipe.data import Permutation, SampleOrder, TokenWindows, TrainLoader, read_meta
from dspipe.data.blend import (
    BlendLoader,
    BlendOrder,
    blend_change,
    make_loader,
    normalise,
    open_sources,
    parse,
    source_seed,
)
from dspipe.data.checks import check_blend_sources
from dspipe.errors import SpecError
from tests.helpers import csv_rows, make_run, run_cli

SEQ = 16


# ---- two real prepared datasets with one tokenizer ----------------------------------------------------------------


def write_docs(folder: Path, *, docs: int, words: int, seed: int) -> Path:
    rng = random.Random(seed)
    vocab = "alpha beta gamma delta lambda return def class import yield while print".split()
    folder.mkdir(parents=True)
    for i in range(docs):
        (folder / f"doc{i:03d}.txt").write_text(" ".join(rng.choice(vocab) for _ in range(words)) + "\n")
    return folder


@pytest.fixture(scope="module")
def second(tmp_path_factory, corpus) -> Path:
    """A small dataset prepared with the corpus's tokenizer (a few hundred windows of 17 tokens, ~1/4 of the
    corpus's count at 16 tokens: it runs through epochs while the corpus does not)."""
    from dspipe.data.prepare import prepare
    from dspipe.data.sources import resolve_inputs

    root = tmp_path_factory.mktemp("second")
    docs = write_docs(root / "txt", docs=30, words=300, seed=1)
    prepare(
        inputs=resolve_inputs([str(docs)]),
        out=root / "small",
        tokenizer=str(corpus / "tokenizer"),
        val_fraction=0.1,
        workers=1,
    )
    return root / "small"


def spec_of(corpus, second, wa="0.7", wb="0.3"):
    return parse(f"{corpus}:{wa},{second}:{wb}")


def blend_loader(spec, windows, *, dp=1, rank=0, mb=2, seed=0):
    return make_loader(spec, windows, seed=seed, micro_batch=mb, dp=dp, dp_rank=rank)


# ---- parse ----------------------------------------------------------------------------------------------------------


def test_parse_normalises_weights_exactly_and_keeps_a_single_path_as_given():
    s = parse(" data/web:70 , data/books:30")
    assert s.is_blend and s.paths == ("data/web", "data/books")
    assert s.shares == (Fraction(7, 10), Fraction(3, 10)) and [x.weight for x in s.sources] == [0.7, 0.3]
    assert s.text == "data/web:70,data/books:30" and parse(s.text) == s
    assert s.describe() == "blend: data/web 70.0%, data/books 30.0%"
    assert s.names == ("web", "books")
    assert parse("a:1,b:2,c:1").shares == (Fraction(1, 4), Fraction(1, 2), Fraction(1, 4))
    assert parse("x/data:1,y/data:1").names == ("data", "data_2")
    one = parse("data/stdlib/")
    assert not one.is_blend and one.text == "data/stdlib/" and one.paths == ("data/stdlib/",)
    assert normalise("data/stdlib/") == "data/stdlib/" and normalise("data/x:3") == "data/x"  # one source: its path
    assert normalise("a:0.7, b:0.3") == "a:0.7,b:0.3"


def test_a_directory_whose_name_has_a_colon_is_one_path(tmp_path):
    odd = tmp_path / "v1:2024"
    odd.mkdir()
    assert parse(str(odd)).paths == (str(odd),)


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "--data is empty: give a prepared data directory (a blend is PATH:WEIGHT,PATH:WEIGHT, e.g. a:0.7,b:0.3)"),
        ("a:x,b:1", "--data source a: weight 'x' is not a number"),
        ("a:x", "--data source a: weight 'x' is not a number"),
        ("a:-1,b:1", "--data source a: weight -1 must be positive"),
        ("a:0,b:1", "--data source a: weight 0 must be positive"),
        ("a:inf,b:1", "--data source a: weight inf is not finite"),
        ("a:1,b:NaN", "--data source b: weight NaN is not finite"),
        ("a:1e-400,b:1", "--data source a: weight 1e-400 is out of range (want a finite positive number)"),
        ("a:0x10,b:1", "--data source a: weight '0x10' is not a number"),
        ("a:1e999999999,b:1", "--data source a: weight 1e999999999 is out of range (want a finite positive number)"),
        ("a:-0,b:1", "--data source a: weight -0 must be positive"),
        (
            ":1,b:1",
            "--data source 1 has an empty path before its weight :1 (a blend is PATH:WEIGHT,PATH:WEIGHT, "
            "e.g. a:0.7,b:0.3)",
        ),
        ("a:,b:1", "--data source a: empty weight after ':' (a blend is PATH:WEIGHT,PATH:WEIGHT, e.g. a:0.7,b:0.3)"),
        ("a:1,,b:1", "--data source 2 is empty (a blend is PATH:WEIGHT,PATH:WEIGHT, e.g. a:0.7,b:0.3)"),
        ("a:1,b:1,", "--data source 3 is empty (a blend is PATH:WEIGHT,PATH:WEIGHT, e.g. a:0.7,b:0.3)"),
        ("a:1,a:2", "--data source a is given twice"),
        ("d/a:1,./d/a/:2", "--data source d/a is given twice (as d/a and ./d/a/)"),
        (
            "a:0.7,b",
            "--data source b has no weight while a has one: give every source a weight (a blend is "
            "PATH:WEIGHT,PATH:WEIGHT, e.g. a:0.7,b:0.3)",
        ),
        ("a,b", "--data names 2 sources without weights: give each one a weight, e.g. a:1,b:1 for equal shares"),
    ],
)
def test_parse_errors_are_one_line_naming_the_source(text, message):
    with pytest.raises(SpecError) as e:
        parse(text)
    assert str(e.value) == message


# ---- the order ------------------------------------------------------------------------------------------------------


def counts_by_prefix(src: np.ndarray, k: int) -> np.ndarray:
    return np.cumsum(np.stack([src == j for j in range(k)]), axis=1)  # (k, n): drawn from j after n + 1 samples


def test_proportions_over_10000_samples():
    src, draw = BlendOrder(parse("a:0.7,b:0.3").shares).assign(0, 10_000)
    share = np.bincount(src, minlength=2) / src.size
    assert abs(share[0] - 0.7) < 0.01 and abs(share[1] - 0.3) < 0.01
    assert np.bincount(src).tolist() == [7000, 3000]  # exact, in fact
    for j in range(2):  # the k-th sample of source j is its draw k
        assert draw[src == j].tolist() == list(range(int((src == j).sum())))


@pytest.mark.parametrize("k", [2, 3, 4, 6])
def test_every_prefix_is_within_one_sample_of_its_share(k):
    rng = random.Random(k)
    for _ in range(4):
        weights = [str(round(rng.random() ** 3 + 0.001, 4)) for _ in range(k)]
        spec = parse(",".join(f"s{j}:{w}" for j, w in enumerate(weights)))
        n = 3000
        src, _ = BlendOrder(spec.shares).assign(0, n)
        shares = np.array([float(s) for s in spec.shares])
        gap = np.abs(counts_by_prefix(src, k) - np.outer(shares, np.arange(1, n + 1)))
        assert gap.max() < 1, (weights, gap.max())
        assert gap.max() <= 1 - 1 / (2 * k - 2) + 1e-9  # Tijdeman's bound


def test_the_order_is_deterministic_and_the_same_from_any_starting_point():
    shares = parse("a:0.5,b:0.3,c:0.2").shares
    src, draw = BlendOrder(shares).assign(0, 20_000)
    again = BlendOrder(shares)
    assert np.array_equal(again.assign(0, 20_000)[0], src)
    fresh = BlendOrder(shares)  # random access: forward jumps, then back past the cached chunk
    for start in (12_345, 30, 19_990, 5000):
        s, d = fresh.assign(start, 10)
        assert np.array_equal(s, src[start : start + 10]) and np.array_equal(d, draw[start : start + 10])
    counts = fresh.counts_at(15_000)
    assert list(counts) == np.bincount(src[:15_000], minlength=3).tolist()
    anchored = BlendOrder(shares)  # from a known state (a checkpoint's counts), without the samples before it
    anchored.anchor(15_000, counts)
    assert np.array_equal(anchored.assign(15_000, 5000)[0], src[15_000:])
    # equal blends written differently are the same blend
    assert np.array_equal(BlendOrder(parse("a:50,b:30,c:20").shares).assign(0, 20_000)[0], src)


def test_anchors_make_a_far_position_cheap_to_reach_again():
    order = BlendOrder(parse("a:2,b:1").shares)
    order.assign(200_000, 4)
    assert max(order._anchors) == 3 * BlendOrder.ANCHOR_STRIDE  # kept on the way
    calls = []
    original = order._simulate
    order._simulate = lambda start, counts, n, record: calls.append(n) or original(start, counts, n, record)
    order._chunk = None
    order.counts_at(200_000)
    assert calls == [200_000 - 3 * BlendOrder.ANCHOR_STRIDE]


# ---- the loader over real data --------------------------------------------------------------------------------------


def test_the_global_order_is_the_same_at_dp_1_2_and_4(corpus, second):
    spec = spec_of(corpus, second)
    windows = open_sources(spec, model_vocab=1024, seq_len=SEQ)
    one = blend_loader(spec, windows, dp=1, mb=2)
    serial = [np.stack(one.next_indices()).T.tolist() for _ in range(24)]  # 48 samples
    for dp in (2, 4):
        ranks = [blend_loader(spec, windows, dp=dp, rank=r, mb=2) for r in range(dp)]
        parallel = [np.stack(ranks[r].next_indices()).T.tolist() for _ in range(24 // dp) for r in range(dp)]
        assert parallel == serial, dp
    mb4 = blend_loader(spec, windows, dp=1, mb=4)  # another micro-batch size: the same sequence
    assert sum((np.stack(mb4.next_indices()).T.tolist() for _ in range(12)), []) == sum(serial, [])
    rows = blend_loader(spec, windows, dp=2, rank=1, mb=2)
    inputs, labels = next(rows)
    (src, win) = blend_loader(spec, windows, dp=2, rank=1, mb=2).next_indices()
    want = np.stack([windows[j][w] for j, w in zip(src, win, strict=False)])
    assert torch.equal(inputs, torch.from_numpy(want[:, :-1])) and torch.equal(labels, torch.from_numpy(want[:, 1:]))


def test_each_source_follows_its_own_order_and_repeats_with_a_new_permutation_per_epoch(corpus, second):
    spec = spec_of(corpus, second, "1", "1")
    windows = open_sources(spec, model_vocab=1024, seq_len=SEQ)
    n_small = len(windows[1])
    ld = blend_loader(spec, windows, mb=50)
    got = [[], []]
    while len(got[1]) < 2 * n_small + 10:
        src, win = ld.next_indices()
        for j, w in zip(src, win, strict=False):
            got[j].append(int(w))
    for j in range(2):
        order = SampleOrder(num_samples=len(windows[j]), seed=source_seed(0, j))
        assert got[j] == order.windows(0, len(got[j])).tolist()
    small = got[1]
    first, again = small[:n_small], small[n_small : 2 * n_small]
    assert sorted(first) == sorted(again) == list(range(n_small)) and first != again  # every window once per epoch
    state = ld.state_dict()["sources"]
    assert state[1]["epoch"] == state[1]["drawn"] // n_small >= 2 and state[0]["epoch"] == 0


def test_resume_mid_epoch_continues_exactly_also_under_another_dp(corpus, second, tmp_path):
    spec = spec_of(corpus, second)
    windows = open_sources(spec, model_vocab=1024, seq_len=SEQ)
    ranks = [blend_loader(spec, windows, dp=2, rank=r, mb=3) for r in range(2)]
    for _ in range(7):
        for ld in ranks:
            next(ld)
    state = ranks[1].state_dict()
    assert state == ranks[0].state_dict() and state["consumed_samples"] == 42
    assert [s["drawn"] for s in state["sources"]] == [29, 13] and state["sources"][1]["epoch"] == 0
    path = tmp_path / "meta.json"  # through JSON, as the checkpoint's dspipe.json holds it
    path.write_text(json.dumps({"data": state}))
    saved = json.loads(path.read_text())["data"]
    expected = [next(ranks[1]) for _ in range(5)]
    resumed = blend_loader(spec, windows, dp=2, rank=1, mb=3)
    resumed.load_state_dict(saved)
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for a, b in zip(expected, (next(resumed) for _ in range(5)), strict=False)
    )
    reference = blend_loader(spec, windows, dp=1, mb=3)
    order = [np.stack(reference.next_indices()).T.tolist() for _ in range(22)]
    after = [blend_loader(spec, windows, dp=1, rank=0, mb=3)]
    after[0].load_state_dict(saved)
    assert [np.stack(after[0].next_indices()).T.tolist() for _ in range(8)] == order[14:22]


def test_a_changed_blend_is_refused_in_one_line(corpus, second):
    spec = spec_of(corpus, second)
    windows = open_sources(spec, model_vocab=1024, seq_len=SEQ)
    state = blend_loader(spec, windows).state_dict()

    def refused(loader, st=state):
        with pytest.raises(SpecError) as e:
            loader.load_state_dict(st)
        assert "\n" not in str(e.value)
        return str(e.value)

    other = spec_of(corpus, second, "0.6", "0.4")
    msg = refused(blend_loader(other, windows))
    assert msg == (
        f"the checkpoint's data blend differs from this run's --data: source 1 ({corpus}) has weight "
        f"60% now, 70% in the checkpoint; resume with the blend it was saved with ({corpus}:0.7,"
        f"{second}:0.3)"
    )
    swapped = parse(f"{second}:0.3,{corpus}:0.7")
    assert "source 1 (" in refused(blend_loader(swapped, open_sources(swapped, model_vocab=1024, seq_len=SEQ)))
    assert (
        f"source 2 ({second}) holds other data now (fingerprint {read_meta(second)['fingerprint'][:16]}, "
        f"abababababababab in the checkpoint, read from {second})"
        in refused(
            blend_loader(spec, windows),
            {**state, "sources": [state["sources"][0], {**state["sources"][1], "fingerprint": "ab" * 32}]},
        )
    )
    assert "seed 0 in the checkpoint, 1 now" in refused(blend_loader(spec, windows, seed=1))
    single = TrainLoader(windows=windows[0], seed=0, micro_batch=2, dp=1, dp_rank=0)
    assert "is of a blend of 2 sources" in refused(single)
    assert "is of one data directory" in refused(blend_loader(spec, windows), single.state_dict())
    assert blend_change(state["sources"], state["sources"]) == ""
    assert blend_change(state["sources"], state["sources"][:1]) == "1 sources now, 2 in the checkpoint"


def test_a_single_directory_reads_exactly_as_before(corpus):
    """--data DIR (and DIR:1) gives TrainLoader with the very same batches and state; the expected windows are
    computed here from the documented order: global sample k is window P_e(k mod n), e = k div n."""
    for text in (str(corpus), f"{corpus}:1"):
        spec = parse(normalise(text))
        assert not spec.is_blend and spec.paths == (str(corpus),)
        windows = open_sources(spec, model_vocab=1024, seq_len=512)
        n = len(windows[0])
        loaders = [make_loader(spec, windows, seed=3, micro_batch=2, dp=2, dp_rank=r) for r in range(2)]
        assert all(type(ld) is TrainLoader for ld in loaders)
        got = [loaders[r].next_indices().tolist() for _ in range(2 * n // 4 + 3) for r in range(2)]
        want = np.concatenate([Permutation(n, seed=3, epoch=e)(np.arange(n)) for e in range(3)])
        assert sum(got, []) == want[: 2 * len(got)].tolist()
        current = TrainLoader(windows=TokenWindows(corpus, seq_len=512), seed=3, micro_batch=2, dp=2, dp_rank=1)
        fresh = make_loader(spec, windows, seed=3, micro_batch=2, dp=2, dp_rank=1)
        for _ in range(4):
            a, b = next(current), next(fresh)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert current.state_dict() == fresh.state_dict() and "sources" not in fresh.state_dict()


def test_blend_loader_needs_two_sources(corpus):
    w = TokenWindows(corpus, seq_len=SEQ)
    with pytest.raises(ValueError, match="two or more sources"):
        BlendLoader(windows=[w], shares=[1], seed=0, micro_batch=2, dp=1, dp_rank=0)


# ---- the checks between sources ---------------------------------------------------------------------------------


def copy_of(corpus, tmp_path, name, change_meta=None, change_tokenizer=None):
    import shutil

    out = tmp_path / name
    shutil.copytree(corpus, out)
    if change_meta:
        meta = json.loads((out / "meta.json").read_text())
        change_meta(meta)
        (out / "meta.json").write_text(json.dumps(meta))
    if change_tokenizer:
        tok = json.loads((out / "tokenizer" / "tokenizer.json").read_text())
        change_tokenizer(tok)
        (out / "tokenizer" / "tokenizer.json").write_text(json.dumps(tok))
    return out


def rename_a_token(tok):
    vocab = tok["model"]["vocab"]
    name = sorted(vocab)[100]
    vocab[name + "x"] = vocab.pop(name)


def test_sources_must_be_prepared_and_share_one_tokenizer(corpus, second, tmp_path):
    assert [m["fingerprint"] for m in check_blend_sources([str(corpus), str(second)])] == [
        read_meta(corpus)["fingerprint"],
        read_meta(second)["fingerprint"],
    ]
    fix = f"blended datasets must share one tokenizer (prepare it with --tokenizer {corpus / 'tokenizer'})"
    big = copy_of(corpus, tmp_path, "big", change_meta=lambda m: m.update(vocab_size=2048))
    other = copy_of(corpus, tmp_path, "other", change_tokenizer=rename_a_token)
    eos = copy_of(corpus, tmp_path, "eos", change_meta=lambda m: m.update(eos_id=1))
    cases = {
        big: f"blend source {big}: tokenizer vocab 2048 (uint16 tokens) differs from {corpus}'s 1024 (uint16); {fix}",
        other: f"blend source {other}: its tokenizer differs from {corpus}'s (model in tokenizer/tokenizer.json); "
        f"{fix}",
        eos: f"blend source {eos}: EOS id 1 differs from {corpus}'s 0; {fix}",
        tmp_path / "nope": f"blend source {tmp_path / 'nope'}: {tmp_path / 'nope'} is not a prepared data directory "
        f"(no meta.json); run 'dspipe prepare-data --out {tmp_path / 'nope'}'",
    }
    for path, message in cases.items():
        with pytest.raises(SpecError) as e:
            check_blend_sources([str(corpus), str(path)])
        assert str(e.value) == message
    with pytest.raises(SpecError, match=r"^blend source .*second.*: the train split of .* is shorter than one "):
        open_sources(spec_of(corpus, second), model_vocab=1024, seq_len=100_000)
    with pytest.raises(SpecError, match=r"^blend source .*: tokenizer vocab 1024 in .* > model vocab 512"):
        open_sources(spec_of(corpus, second), model_vocab=512, seq_len=SEQ)


# ---- validation per source ----------------------------------------------------------------------------------------


class FakeEngine:
    """eval_loss = the mean of the first input token of the batches it is given (distinct per source)."""

    class layout:
        dp = 1

    dp_rank = 0

    def eval_loss(self, batches, *, count):
        return float(np.mean([float(inputs[0, 0]) for inputs, _ in batches]))


def test_validation_reports_each_source_and_their_weighted_mean(corpus, second):
    from dspipe.runtime.evaluate import evaluate, evaluate_sets, val_columns, val_sets

    spec = spec_of(corpus, second)
    sets = val_sets(spec, seq_len=SEQ, micro_batch=2, dp=1, batches=3)
    assert val_columns(sets) == ("val_loss_stdlib", "val_loss_small") and [s.batches for s in sets] == [3, 3]
    row = evaluate_sets(FakeEngine(), sets, micro_batch=2)
    a, b = (evaluate(FakeEngine(), windows=s.windows, micro_batch=2, batches=3) for s in sets)
    assert row["val_loss_stdlib"] == a and row["val_loss_small"] == b
    assert row["val_loss"] == pytest.approx(0.7 * a + 0.3 * b)
    single = val_sets(parse(str(corpus)), seq_len=SEQ, micro_batch=2, dp=1, batches=3)
    assert val_columns(single) == () and evaluate_sets(FakeEngine(), single, micro_batch=2)["val_loss"] == a
    with pytest.raises(SpecError, match=r"^blend source .*stdlib: the val split has \d+ windows"):
        val_sets(spec, seq_len=SEQ, micro_batch=10_000, dp=1, batches=3)


def test_val_metrics_csv_gets_a_column_per_source(tmp_path):
    from dspipe.runtime.metrics_log import RunLog

    log = RunLog(
        tmp_path,
        monitor=None,
        enabled=True,
        resumed_at=0,
        log_interval=1,
        steps=4,
        validating=True,
        terminal=False,
        val_columns=("val_loss_web", "val_loss_books"),
    )
    log.validation(
        {"step": 2, "tokens": 64, "val_loss": 4.5, "val_ppl": 90.0, "val_loss_web": 4.0, "val_loss_books": 5.0}
    )
    log.close()
    rows = csv_rows(tmp_path / "val_metrics.csv")
    assert list(rows[0]) == ["step", "tokens", "val_loss", "val_ppl", "val_loss_web", "val_loss_books"]
    assert rows[0]["val_loss_books"] == "5.0"


# ---- the checkpoint's data state ----------------------------------------------------------------------------------


def checkpoint_with(tmp_path, data):
    from dataclasses import asdict

    from dspipe.spec.presets import model_preset

    ckpt = tmp_path / "global_step2"
    ckpt.mkdir(exist_ok=True)
    meta = {
        "step": 2,
        "consumed_samples": data["consumed_samples"],
        "data": data,
        "model": asdict(model_preset("tiny")),
        "pp": 1,
        "zero_stage": 1,
        "dp": 2,
        "world_size": 2,
    }
    (ckpt / "dspipe.json").write_text(json.dumps(meta))
    return ckpt


BLEND_STATE = {
    "consumed_samples": 10,
    "seed": 0,
    "seq_len": 16,
    "split": "train",
    "sources": [
        {"path": "a", "fingerprint": "ab" * 32, "num_samples": 100, "weight": 0.7, "drawn": 7, "epoch": 0},
        {"path": "b", "fingerprint": "cd" * 32, "num_samples": 2, "weight": 0.3, "drawn": 3, "epoch": 1},
    ],
}


def damaged(change):
    state = json.loads(json.dumps(BLEND_STATE))
    change(state)
    return state


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.update(sources=[]), "data.sources must be a list of two or more blend sources, got []"),
        (
            lambda s: s["sources"][1].pop("fingerprint"),
            "data.sources[1].fingerprint must be a non-empty string, got None",
        ),
        (lambda s: s["sources"][0].pop("drawn"), "missing data.sources[0].drawn"),
        (lambda s: s["sources"][0].update(weight=0), "data.sources[0].weight must be a number in (0, 1], got 0"),
        (lambda s: s["sources"][1].update(weight=0.4), "data.sources weights sum to 1.1, not 1"),
        (lambda s: s["sources"][1].update(epoch=0), "data.sources[1].epoch 0 != drawn 3 // num_samples 2"),
        (
            lambda s: s["sources"][0].update(drawn=9),
            "data.sources[0].drawn 9 is not the blend's share of data.consumed_samples 10 at weight 0.7",
        ),
        (
            lambda s: (s["sources"][0].update(drawn=6), s["sources"][1].update(drawn=2)),
            "data.sources drawn 8 in all != data.consumed_samples 10",
        ),
        (lambda s: s.pop("split"), "data.split must be a string, got None"),
    ],
)
def test_checkpoint_meta_validates_the_blend_state(tmp_path, change, message):
    from dspipe.runtime.ckpt_meta import read_meta as read_checkpoint

    assert read_checkpoint(checkpoint_with(tmp_path, BLEND_STATE)).data == BLEND_STATE
    single = {
        "consumed_samples": 10,
        "epoch": 0,
        "seed": 0,
        "num_samples": 100,
        "seq_len": 16,
        "split": "train",
        "fingerprint": "ab" * 32,
    }
    assert read_checkpoint(checkpoint_with(tmp_path, single)).data == single  # the single-source form
    bad = damaged(change)
    path = checkpoint_with(tmp_path, bad)
    with pytest.raises(SpecError) as e:
        read_checkpoint(path)
    assert str(e.value) == f"{path / 'dspipe.json'}: {message}"


def test_a_real_blend_state_passes_the_checkpoint_validation(corpus, second, tmp_path):
    from dspipe.runtime.ckpt_meta import read_meta as read_checkpoint

    spec = spec_of(corpus, second)
    ld = blend_loader(spec, open_sources(spec, model_vocab=1024, seq_len=SEQ), mb=8)
    for _ in range(37):
        ld.next_indices()
    assert read_checkpoint(checkpoint_with(tmp_path, ld.state_dict())).data["consumed_samples"] == 296


# ---- gen-config and the run directory ---------------------------------------------------------------------------


def test_gen_config_writes_the_normalised_blend_and_says_so(corpus, second, tmp_path, capsys):
    from dspipe.rundir import load_run

    run_dir = make_run(tmp_path, f"{corpus}:7, {second}:3", "--eval-interval", "4", steps=8)
    assert load_run(run_dir).data == f"{corpus}:7,{second}:3"
    out = capsys.readouterr()
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
            "16",
            "--micro-batch",
            "4",
            "--steps",
            "8",
            "--data",
            f"{corpus}:7,{second}:3",
            "--out",
            tmp_path / "again",
            "--precision",
            "fp32",
            "--zero",
            "1",
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"blend: {corpus} 70.0%, {second} 30.0% (weights normalised to sum to 100%)"
    spec = json.loads((tmp_path / "again" / "dspipe.json").read_text())
    spec["data"] = "a:1,a:1"
    (tmp_path / "again" / "dspipe.json").write_text(json.dumps(spec))
    with pytest.raises(SpecError, match=r"dspipe.json: data: --data source a is given twice$"):
        load_run(tmp_path / "again")


@pytest.mark.parametrize(
    "data, message",
    [
        ("{c}:x,{s}:1", "--data source {c}: weight 'x' is not a number"),
        (
            "{c}:1,{t}/missing:1",
            "blend source {t}/missing: {t}/missing is not a prepared data directory (no meta.json); "
            "run 'dspipe prepare-data --out {t}/missing'",
        ),
        (
            "{c}:1,{t}/noval:1",
            "blend source {t}/noval: the val split of {t}/noval holds 0 windows of 65 tokens, fewer "
            "than one validation batch of dp 2 x micro_batch 4 = 8; pass --eval-interval 0 or prepare "
            "the data with a larger --val-fraction (now 0.01)",
        ),
        (
            "{c}:1,{t}/big:1",
            "blend source {t}/big: tokenizer vocab 2048 (uint16 tokens) differs from {c}'s 1024 (uint16); "
            "blended datasets must share one tokenizer (prepare it with --tokenizer {c}/tokenizer)",
        ),
    ],
)
def test_gen_config_refuses_a_bad_blend_in_one_line_and_writes_nothing(corpus, second, tmp_path, capsys, data, message):
    def no_val(meta):
        val = meta["splits"].pop("val")
        meta["splits"]["val"] = {"num_documents": 0, "num_tokens": 0, "shards": []}
        meta["num_tokens"] -= val["num_tokens"]
        meta["num_documents"] -= val["num_documents"]

    copy_of(corpus, tmp_path, "noval", change_meta=no_val)
    copy_of(corpus, tmp_path, "big", change_meta=lambda m: m.update(vocab_size=2048))
    fill = {"c": corpus, "s": second, "t": tmp_path}
    code = run_cli(
        "gen-config",
        "--model",
        "tiny",
        "--gpus-per-node",
        "2",
        "--gpu",
        "cpu",
        "--global-batch",
        "16",
        "--micro-batch",
        "4",
        "--steps",
        "8",
        "--data",
        data.format(**fill),
        "--out",
        tmp_path / "run",
        "--precision",
        "fp32",
        "--zero",
        "1",
        "--seq-len",
        "64",
    )
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and err == [f"dspipe: error: {message.format(**fill)}"]
    assert not (tmp_path / "run").exists()
