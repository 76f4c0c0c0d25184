"""--data-order megatron: the samples megatron-core's own GPTDataset and BlendedDataset (built here by its
BlendedMegatronDatasetBuilder) give for a seed, token for token and in their order, through dspipe's loaders (the
data-parallel slices of Megatron's pretraining sampler), from gen-config's dspipe.json to the runner's loader; one
line for what the order cannot read or resume."""

import json
import shutil

import numpy as np
import pytest

from dspipe.data.blend import MegatronBlendOrder, make_loader, open_sources, parse
from dspipe.data.megatron_order import MegatronSamples, blend_sizes, blend_weights, build_indices, train_sequences
from dspipe.data.shards import read_meta
from dspipe.errors import SpecError
from tests.helpers import dspipe, error_lines
from tests.unit.data.test_megatron import build, random_docs

gpt = pytest.importorskip("megatron.core.datasets.gpt_dataset", reason="megatron-core (the test extra)")
builder = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
SEQ = 16


class Tokenizer:
    """The fields megatron-core's GPTDataset reads of a tokenizer."""

    eod, pad, vocab_size, unique_identifiers = 999, 0, 1000, {"class": "Tokenizer"}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """a: 300 documents, some of several sequences (Megatron's GPTDataset samples sequences); b: 1,000 documents of
    1..200 tokens (samples span many)."""
    root = tmp_path_factory.mktemp("order")
    docs = random_docs(300, vocab=1000, seed=1, eod=999)
    for d in docs[::7]:
        d[:] = [d[0][:3], d[0][3:]]
    return build(root / "a", docs), build(
        root / "b", random_docs(1000, vocab=1000, seed=2, eod=999, min_len=1, max_len=200)
    )


def megatron_dataset(paths, weights, *, seed, num_samples):
    """megatron-core's training dataset for `paths` (a BlendedDataset when weighted), split 969,31,0 (Megatron's
    train split of 969,30,1 without a test split: its empty test split of a small file never finishes building)."""
    cfg = gpt.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=SEQ,
        blend=([str(p) for p in paths], weights),
        split="969,31,0",
        tokenizer=Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=None,
    )
    sizes = [num_samples, 4, 0] if weights else [num_samples, None, None]
    return builder.BlendedMegatronDatasetBuilder(gpt.GPTDataset, sizes, lambda: True, cfg).build()[0]


def sample(ds, i) -> np.ndarray:
    item = ds[i]
    return np.concatenate([item["tokens"].numpy(), item["labels"].numpy()[-1:]])


@pytest.mark.parametrize("num_samples,seed", [(50, 1234), (1500, 3), (3000, 7), (5000, 11)])
def test_one_prefix_gives_megatrons_samples_in_megatrons_order(sources, num_samples, seed):
    """One epoch; 3 epochs with the last kept apart (1500: 4% of an epoch in it); 6 with it shuffled in (3000); 9."""
    a, _ = sources
    theirs = megatron_dataset([a], None, seed=seed, num_samples=num_samples)
    mine = MegatronSamples(str(a), seq_len=SEQ, seed=seed, num_samples=num_samples, meta=read_meta(a))
    assert len(mine) == len(theirs) >= num_samples
    got = mine.rows(np.arange(len(mine)))
    assert np.array_equal(got, np.stack([sample(theirs, i) for i in range(len(mine))]))
    assert np.array_equal(theirs.shuffle_index, mine._shuffle)  # the same shuffle, not just the same multiset
    again = MegatronSamples(str(a), seq_len=SEQ, seed=seed, num_samples=num_samples, meta=read_meta(a))
    assert isinstance(again._shuffle, np.memmap) and np.array_equal(again.rows([0, 7]), got[[0, 7]])  # cached


def test_without_a_writable_cache_the_order_is_built_in_memory(tmp_path, monkeypatch, sources):
    a, _ = sources
    cached = MegatronSamples(str(a), seq_len=SEQ, seed=5, num_samples=900, meta=read_meta(a))
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    fresh = MegatronSamples(str(a), seq_len=SEQ, seed=5, num_samples=900, meta=read_meta(a))
    assert not isinstance(fresh._shuffle, np.memmap)
    assert fresh.layout == cached.layout == "2 epochs, the last shuffled apart"
    assert np.array_equal(fresh.rows(range(len(fresh))), cached.rows(range(len(cached))))


def test_the_separate_final_epoch_rule_is_exercised():
    """With 40 tokens per epoch and seq 4 (9 samples/epoch): 10 samples need 2 epochs, the 1 of the second is
    < int(0.8 x 9): kept apart, so the shuffle's first 9 entries are a permutation of 0..8; 17 samples: shuffled
    together."""
    lengths = np.full(10, 4, dtype=np.int32)
    apart = build_indices(lengths=lengths, begin=0, end=10, seq_len=4, seed=1, num_samples=10)["shuffle"]
    assert sorted(apart[:9]) == list(range(9)) and sorted(apart[9:]) == list(range(9, 19))
    together = build_indices(lengths=lengths, begin=0, end=10, seq_len=4, seed=1, num_samples=17)
    assert sorted(together["shuffle"][:9]) != list(range(9)) and together["documents"].size == 20


def test_a_weighted_blend_through_the_loader_is_megatrons_blended_dataset(sources):
    """0.3 a 0.7 b, 2 data-parallel ranks x micro-batch 3: step by step the ranks read Megatron's samples
    consumed + rank x 3 + [0, 3), in its order, the sources its dataset_index names."""
    a, b = sources
    n, seed = 1200, 9
    theirs = megatron_dataset([a, b], [0.3, 0.7], seed=seed, num_samples=n)
    spec = parse(f"0.3 {a} 0.7 {b}")
    windows = open_sources(spec, model_vocab=1000, seq_len=SEQ, order="megatron", seed=seed, num_samples=n)
    assert [len(w) for w in windows] == [len(d) for d in theirs.datasets]
    sizes = blend_sizes(blend_weights(["0.3", "0.7"]), n)
    assert sizes == [d.num_samples for d in theirs.datasets] == [362, 845]  # ceil(ceil(N w) x 1.005)
    loaders = [make_loader(spec, windows, seed=seed, micro_batch=3, dp=2, dp_rank=r) for r in range(2)]
    for step in range(n // 6):
        for r, loader in enumerate(loaders):
            src, win = loader.next_indices()
            first = step * 6 + r * 3
            assert list(src) == [int(theirs.dataset_index[first + i]) for i in range(3)]
            rows = loader.rows(src, win)
            for i in range(3):
                assert np.array_equal(rows[i], sample(theirs, first + i)), (step, r, i)
    counts = np.bincount(theirs.dataset_index[:n], minlength=2)
    assert tuple(loaders[0].blend.counts_at(n)) == tuple(counts)
    state = loaders[1].state_dict()
    assert state["order"] == "megatron" and [s["drawn"] for s in state["sources"]] == list(counts)


def test_prefixes_without_weights_are_megatrons_one_pass_blend(sources, tmp_path):
    """ "a b": Megatron builds each for one pass and weighs them by those passes' samples; the run reads its samples
    in its order; a run longer than one pass of both is refused in one line at gen-config."""
    a, b = sources
    n, seed = 3000, 2
    theirs = megatron_dataset([a, b], None, seed=seed, num_samples=n)
    spec = parse(f"{a} {b}")
    assert spec.sized and spec.text == f"{a} {b}" and parse(spec.text) == spec  # stored as given: still sized
    windows = open_sources(spec, model_vocab=1000, seq_len=SEQ, order="megatron", seed=seed, num_samples=n)
    assert [len(w) for w in windows] == [len(d) for d in theirs.datasets] and len(theirs) == n
    loader = make_loader(spec, windows, seed=seed, micro_batch=n, dp=1, dp_rank=0)
    src, win = loader.next_indices()
    assert np.array_equal(src, theirs.dataset_index[:n])
    rows = loader.rows(src, win)
    assert all(np.array_equal(rows[i], sample(theirs, i)) for i in range(0, n, 7))
    state = loader.state_dict()  # the weights drawn by (samples of one pass), which the checkpoint check holds to
    assert [s["weight"] for s in state["sources"]] == blend_weights([len(w) for w in windows])
    from dspipe.runtime.ckpt_meta import read_meta as read_checkpoint
    from tests.unit.data.test_blend import checkpoint_with

    assert read_checkpoint(checkpoint_with(tmp_path, state)).data["consumed_samples"] == n
    one_pass = sum(len(w) for w in windows)
    out = tmp_path / "run"
    r = dspipe(
        "gen-config",
        "--model",
        "tiny",
        "--seq-len",
        str(SEQ),
        "--vocab",
        "1024",
        "--gpus-per-node",
        "2",
        "--gpu",
        "cpu",
        "--global-batch",
        "8",
        "--steps",
        str(one_pass // 8 + 1),
        "--eval-interval",
        "0",
        "--data",
        f"{a} {b}",
        "--data-order",
        "megatron",
        "--out",
        out,
    )
    assert r.returncode == 2 and len(error_lines(r)) == 1, r.stderr
    assert (
        f"Megatron reads a list of prefixes without weights once: {len(windows[0])} + {len(windows[1])} = "
        f"{one_pass} samples of 17 tokens, the run needs {(one_pass // 8 + 1) * 8}" in r.stderr
    )
    assert not out.exists()


def test_a_resumed_blend_continues_megatrons_order(sources):
    """A loader restored from the state at 600 samples reads what the uninterrupted one reads next."""
    a, b = sources
    spec = parse(f"{a}:0.25,{b}:0.75")
    windows = open_sources(spec, model_vocab=1000, seq_len=SEQ, order="megatron", seed=4, num_samples=1000)
    ref = make_loader(spec, windows, seed=4, micro_batch=5, dp=1, dp_rank=0)
    for _ in range(120):
        ref.next_indices()
    fresh = make_loader(spec, windows, seed=4, micro_batch=5, dp=1, dp_rank=0)
    fresh.load_state_dict(ref.state_dict())
    for _ in range(20):
        (src, win), (ref_src, ref_win) = fresh.next_indices(), ref.next_indices()
        assert np.array_equal(src, ref_src) and np.array_equal(win, ref_win)
    assert isinstance(fresh.blend, MegatronBlendOrder)


@pytest.mark.parametrize("given", [["1", "2"], ["0.3", "0.7"], ["0.05", "0.15", "0.8"], ["7", "1", "1", "1"]])
def test_megatrons_blend_rule_is_build_blending_indices(given):
    """The float max-error rule against megatron-core's compiled build_blending_indices over 10,000 samples, read in
    chunks from two positions; each share within 1%."""
    from megatron.core.datasets import helpers_cpp

    weights = blend_weights(given)
    n = 10_000
    dataset_index, sample_index = np.zeros(n, dtype=np.int16), np.zeros(n, dtype=np.int64)
    helpers_cpp.build_blending_indices(dataset_index, sample_index, np.array(weights), len(weights), n, False)
    order = MegatronBlendOrder(weights)
    src, draw = (np.concatenate(v) for v in zip(order.assign(0, 6_000), order.assign(6_000, 4_000), strict=False))
    assert np.array_equal(src, dataset_index) and np.array_equal(draw, sample_index)
    later = MegatronBlendOrder(weights)
    assert np.array_equal(later.assign(9_000, 1_000)[0], dataset_index[9_000:])  # from a far position
    for j, w in enumerate(weights):
        assert abs((src == j).mean() - w) < 0.01


def test_the_run_reads_megatrons_order_from_dspipe_json(tmp_path, sources):
    """gen-config --data-order megatron writes it into dspipe.json and config.yaml; the runner's data opening
    (dspipe.runtime.loop._open_data) then yields Megatron's samples for steps x global batch."""
    from dspipe.rundir import load_run
    from dspipe.runtime.loop import _open_data

    a, _ = sources
    out = tmp_path / "run"
    r = dspipe(
        "gen-config",
        "--model",
        "tiny",
        "--seq-len",
        str(SEQ),
        "--vocab",
        "1024",
        "--gpus-per-node",
        "2",
        "--gpu",
        "cpu",
        "--global-batch",
        "8",
        "--micro-batch",
        "2",
        "--steps",
        "30",
        "--seed",
        "21",
        "--eval-interval",
        "0",
        "--data",
        str(a),
        "--data-order",
        "megatron",
        "--out",
        out,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "dspipe.json").read_text())["train"]["data_order"] == "megatron"
    assert "data_order: megatron" in (out / "config.yaml").read_text()
    run = load_run(out)
    data, windows, _ = _open_data(run)
    theirs = megatron_dataset([a], None, seed=21, num_samples=240)
    loader = make_loader(data, windows, seed=21, micro_batch=2, dp=2, dp_rank=1)
    for step in range(3):
        x, _ = next(loader)
        for i in range(2):
            assert np.array_equal(x[i].numpy(), sample(theirs, step * 4 + 2 + i)[:-1])
    longer = open_sources(data, model_vocab=1024, seq_len=SEQ, order="megatron", seed=21, num_samples=480)
    restored = make_loader(data, longer, seed=21, micro_batch=2, dp=2, dp_rank=1)  # still 1 epoch: the same order
    restored.load_state_dict(loader.state_dict())
    assert np.array_equal(next(restored)[0], next(loader)[0])
    with pytest.raises(
        SpecError,
        match=r"built for another run length \(595 samples in 1 epoch of .* then, 5359 in "
        r"9 epochs, the last shuffled apart now",
    ):
        other = open_sources(data, model_vocab=1024, seq_len=SEQ, order="megatron", seed=21, num_samples=5000)
        make_loader(data, other, seed=21, micro_batch=2, dp=2, dp_rank=1).load_state_dict(loader.state_dict())
    dspipe_order = open_sources(data, model_vocab=1024, seq_len=SEQ)
    with pytest.raises(SpecError, match="in megatron's sample order, this run reads in dspipe's"):
        make_loader(data, dspipe_order, seed=21, micro_batch=2, dp=2, dp_rank=1).load_state_dict(loader.state_dict())


def test_megatrons_cache_directory_beside_the_files_is_still_a_prefix(tmp_path, sources):
    """megatron-core keeps its indices in PREFIX/cache by default: PREFIX is then a directory too."""
    a, _ = sources
    p = tmp_path / "c"
    for ext in (".bin", ".idx"):
        shutil.copy(f"{a}{ext}", f"{p}{ext}")
    (p / "cache").mkdir(parents=True)
    assert read_meta(p)["format"] == "megatron-mmidx" and parse(str(p)).paths == (str(p),)


def test_train_split_is_megatrons_default():
    assert [train_sequences(n) for n in (1, 100, 300, 1000, 10**9)] == [
        (0, 1),
        (0, 97),
        (0, 291),
        (0, 969),
        (0, 969_000_000),
    ]


@pytest.mark.parametrize("case", ["dspipe-dir", "mixed-blend"])
def test_what_megatrons_order_cannot_read_is_one_line(tmp_path, corpus, sources, case):
    data = str(corpus) if case == "dspipe-dir" else f"0.5 {sources[0]} 0.5 {corpus}"
    message = (
        f"--data-order megatron reads Megatron indexed datasets (PREFIX.bin + PREFIX.idx); {corpus} is not "
        f"one: convert it with 'dspipe convert-data {corpus} --out DIR'"
    )
    out = tmp_path / "run"
    r = dspipe(
        "gen-config",
        "--model",
        "tiny",
        "--seq-len",
        "16",
        "--gpus-per-node",
        "2",
        "--gpu",
        "cpu",
        "--global-batch",
        "8",
        "--eval-interval",
        "0",
        "--data",
        data,
        "--data-order",
        "megatron",
        "--out",
        out,
    )
    assert r.returncode == 2 and len(error_lines(r)) == 1, r.stderr
    assert message in r.stderr and not out.exists()


def test_a_train_split_shorter_than_one_sample_is_one_line(tmp_path):
    from dspipe.data.megatron_order import check_for_run

    data = str(build(tmp_path / "short", [[[1, 2, 3]]] * 40))
    with pytest.raises(SpecError) as e:
        check_for_run(parse(data), seq_len=128, num_samples=8)
    assert str(e.value) == (
        f"the train split of {data} under Megatron's --split 969,30,1 (sequences 0..38, 117 "
        f"tokens) is shorter than one sample of 129 tokens"
    )


def test_a_megatron_blend_state_passes_the_checkpoint_validation(tmp_path, sources):
    """Megatron's max-error rule strays further than dspipe's (here 1.4 samples from a share, 3 skewed weights): the
    checkpoint check allows it in Megatron's order, and refuses an unknown order."""
    from dspipe.runtime.ckpt_meta import read_meta as read_checkpoint
    from tests.unit.data.test_blend import checkpoint_with

    a, b = sources
    c = tmp_path / "c"
    for ext in (".bin", ".idx"):
        shutil.copy(f"{a}{ext}", f"{c}{ext}")
    spec = parse(f"0.06 {a} 0.13 {b} 0.81 {c}")
    windows = open_sources(spec, model_vocab=1000, seq_len=SEQ, order="megatron", seed=1, num_samples=4000)
    loader = make_loader(spec, windows, seed=1, micro_batch=1, dp=1, dp_rank=0)
    worst, at = 0.0, 0
    for n in range(1, 2001):
        loader.next_indices()
        drawn = loader.blend.counts_at(n)
        miss = max(abs(d - float(s.share) * n) for d, s in zip(drawn, spec.sources, strict=False))
        if miss > worst:
            worst, at = miss, n
    assert worst > 1  # beyond dspipe's own bound
    loader.consumed_samples = at
    state = loader.state_dict()
    assert read_checkpoint(checkpoint_with(tmp_path, state)).data["order"] == "megatron"
    with pytest.raises(SpecError, match="data.order 'random' is not one of: dspipe, megatron"):
        read_checkpoint(checkpoint_with(tmp_path, {**state, "order": "random"}))
