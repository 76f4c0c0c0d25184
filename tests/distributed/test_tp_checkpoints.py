"""Checkpoints of tensor-parallel runs (dspipe's Megatron-layout layers, tp 2, alone and with pp 2; ZeRO-1, and
ZeRO-3 at tp 2 x dp 2; fp32),
with real DeepSpeed launches on CPU ranks: their files (layer_LL-model_RR, one mp_rank file per stage x tp rank),
export-hf and generate from them (GPT-2-style tied, Llama-style untied with grouped-query attention), the merged
weights against a tp 1 run, an exact resume after a kill at the same layout, and resumes at another tp / pp / dp
through DeepSpeed's universal checkpoint (dspipe.runtime.reshard; the module must carry universal_checkpoint_info).
One launch per layout, shared by the assertions (module-scoped fixtures)."""

import json
import shutil

import pytest
import torch

from dspipe.runtime import ckpt_meta, ckpt_tags
from tests.helpers import OFFLINE, launch, make_run, max_diff, offline_here, ok, written_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.solo]  # 4+ ranks, or a time it measures

STEPS, EVERY = 6, 3


def tp_run(tmp_path, corpus, name, *flags, model="tiny", gpus):
    return make_run(
        tmp_path,
        corpus,
        "--model",
        model,
        "--precision",
        "fp32",
        "--zero",
        "1",
        "--save-interval",
        str(EVERY),
        "--keep-checkpoints",
        "3",
        "--gpus-per-node",
        str(gpus),
        *flags,
        steps=STEPS,
        name=name,
    )


def trained(tmp_path, corpus, name, *flags, model="tiny", gpus):
    run = tp_run(tmp_path, corpus, name, *flags, model=model, gpus=gpus)
    ok(launch(run, num_gpus=gpus))
    assert [int(s) for s, *_ in written_metrics(run)] == list(range(1, STEPS + 1))
    return run


def tag(run, step=STEPS):
    return run / "checkpoints" / ckpt_tags.tag_for(step)


def resumed_at(tmp_path, corpus, source, name, *flags, model="tiny", gpus):
    """A run of another layout resumed from `source`'s step-3 checkpoint (copied, named by `latest`)."""
    run = tp_run(tmp_path, corpus, name, *flags, model=model, gpus=gpus)
    (run / "checkpoints").mkdir()
    shutil.copytree(tag(source, EVERY), tag(run, EVERY))
    (run / "checkpoints" / ckpt_tags.LATEST_FILE).write_text(ckpt_tags.tag_for(EVERY))
    r = launch(run, "--resume", "auto", num_gpus=gpus)
    return run, r


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("tp-checkpoints")


@pytest.fixture(scope="module")
def tiny_tp1(work, corpus):
    return trained(work, corpus, "tiny-tp1", "--tp", "1", "--pp", "1", gpus=1)


@pytest.fixture(scope="module")
def tiny_tp2pp2(work, corpus):
    return trained(work, corpus, "tiny-tp2pp2", "--tp", "2", "--pp", "2", gpus=4)


@pytest.fixture(scope="module")
def tiny_tp2_zero3(work, corpus):
    """tp 2 x dp 2 under ZeRO-3: each tp rank's shards partitioned over its dp ranks (zero_pp_rank_D_mp_rank_RR)."""
    return trained(work, corpus, "tiny-tp2-zero3", "--tp", "2", "--pp", "1", "--zero", "3", gpus=4)


@pytest.fixture(scope="module")
def llama_tp2pp2(work, corpus):
    return trained(work, corpus, "llama-tp2pp2", "--tp", "2", "--pp", "2", model="tiny-llama", gpus=4)


@pytest.fixture(scope="module")
def tiny_tp2(work, corpus, tiny_tp2pp2):
    """tp 2 x pp 2 -> tp 2, pp 1 (the pipeline's parameters renamed to the plain model's)."""
    return resumed_at(work, corpus, tiny_tp2pp2, "tiny-tp2", "--tp", "2", "--pp", "1", gpus=2)


@pytest.fixture(scope="module")
def llama_tp2(work, corpus, llama_tp2pp2):
    return resumed_at(work, corpus, llama_tp2pp2, "llama-tp2", "--tp", "2", "--pp", "1", model="tiny-llama", gpus=2)


# ---- the files and the merged weights --------------------------------------------------------------------------


def test_tp2pp2_checkpoint_files(tiny_tp2pp2, llama_tp2pp2):
    from dspipe.runtime.ckptfiles import check_checkpoint, expected_files

    for run, layers in ((tiny_tp2pp2, 4), (llama_tp2pp2, 5)):  # tied: embedding, 2 blocks, norm; untied: + head
        names = sorted(p.name for p in tag(run).iterdir())
        assert [n for n in names if n.startswith("layer_")] == [
            f"layer_{i:02d}-model_{r:02d}-model_states.pt" for i in range(layers) for r in range(2)
        ]
        assert [n for n in names if n.startswith(("mp_rank", "zero_pp"))] == [
            *(f"mp_rank_{m:02d}_model_states.pt" for m in range(4)),
            *(f"zero_pp_rank_0_mp_rank_{m:02d}_optim_states.pt" for m in range(4)),
        ]
        meta = ckpt_meta.read_meta(tag(run))
        assert set(expected_files(meta)) <= set(names)
        check_checkpoint(tag(run), meta=meta)


def test_merged_tp2pp2_weights_equal_the_tp1_run(tiny_tp1, tiny_tp2pp2, tiny_tp2_zero3):
    """Same seed, data and steps: the tp 2 x pp 2 shards merged (vocabulary rows, interleaved q/k/v, row-parallel
    columns) are the tp 1 run's weights up to summation order (measured 1.5e-6); so are tp 2 x dp 2 ZeRO-3's, each
    tp rank's put together from its ZeRO-3 partitions first (its files read to no mp_rank_RR file once)."""
    from dspipe.tools.consolidate import consolidate

    tp1, tp2pp2, zero3 = (
        consolidate(tag(r), meta=ckpt_meta.read_meta(tag(r))) for r in (tiny_tp1, tiny_tp2pp2, tiny_tp2_zero3)
    )
    assert max_diff(tp2pp2, tp1) < 1e-5 and max_diff(zero3, tp1) < 1e-5
    assert tp1["embed.wte.weight"].shape == (4096, 64)


# ---- export-hf and generate ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-tp2pp2", "tiny-tp2", "tiny-tp2-zero3", "llama-tp2pp2", "llama-tp2"])
def test_export_and_generate_from_tp_checkpoints(request, work, monkeypatch, name):
    """The export loads with transformers (offline) and computes the logits of dspipe's plain GPT holding the same
    merged weights (1e-5); greedy generation from the checkpoint and from the export prints the same text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspipe.tools.consolidate import load_gpt

    fixture = {
        "tiny-tp2pp2": "tiny_tp2pp2",
        "tiny-tp2": "tiny_tp2",
        "tiny-tp2-zero3": "tiny_tp2_zero3",
        "llama-tp2pp2": "llama_tp2pp2",
        "llama-tp2": "llama_tp2",
    }[name]
    run = request.getfixturevalue(fixture)
    if isinstance(run, tuple):  # resumed at this layout: its own step-6 checkpoint
        run, r = run
        ok(r)
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    meta = ckpt_meta.read_meta(tag(run))
    assert (meta.tp, meta.pp) == ((2, 2) if name.endswith("pp2") else (2, 1))
    out = work / f"hf-{name}"
    r = offline_here("export-hf", tag(run), "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.config.tie_word_embeddings is name.startswith("tiny")
    gpt = load_gpt(tag(run), meta=meta)
    ids = torch.tensor([AutoTokenizer.from_pretrained(out).encode("def f(x):\n    return x + 1\n")[:64]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, gpt(ids), atol=1e-5, rtol=0)
    texts = [
        offline_here("generate", src, "--prompt", "def ", "--temperature", "0", "--max-tokens", "8")
        for src in (tag(run), out)
    ]
    assert [t.returncode for t in texts] == [0, 0], [t.stderr[-2000:] for t in texts]
    assert texts[0].stdout == texts[1].stdout and texts[0].stdout.startswith("def ")


# ---- resume ----------------------------------------------------------------------------------------------------


def test_kill_and_resume_at_tp2pp2_reproduces_the_uninterrupted_run(work, corpus, tiny_tp2pp2):
    run = tp_run(work, corpus, "tiny-tp2pp2-killed", "--tp", "2", "--pp", "2", gpus=4)
    r = launch(run, "--test-faults", '{"kill_at_step": 5}', num_gpus=4)
    assert r.returncode != 0  # killed with SIGKILL after step 5, checkpoint at 3
    assert (run / "checkpoints" / "latest").read_text() == "global_step3"
    r = launch(run, "--resume", "auto", num_gpus=4)
    ok(r)
    assert "at step 3" in r.stderr  # "resumed from ... at step 3": the dspipe logger's (stderr)
    want = written_metrics(tiny_tp2pp2)
    assert written_metrics(run)[3:] == want[3:]  # steps 4-6: loss, lr, grad norm bitwise equal (fp32, CPU)
    assert written_metrics(run) == want


def same_continuation(run, ref, *, rel=1e-6):
    """Steps 4-6 after the resume at another layout against the uninterrupted run: same schedule, losses and
    gradient norms within `rel` (measured <= 1.2e-7: only the summation order differs)."""
    got, want = written_metrics(run), written_metrics(ref)[EVERY:]
    assert [(s, lr) for s, _, lr, _ in got] == [(s, lr) for s, _, lr, _ in want]
    for (s, loss, _, norm), (_, loss_ref, _, norm_ref) in zip(got, want, strict=True):
        assert float(loss) == pytest.approx(float(loss_ref), rel=rel), s
        assert float(norm) == pytest.approx(float(norm_ref), rel=rel), s
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(("global", ".", "latest"))) == [
        "global_step3",
        "global_step6",
        "latest",
    ]  # the universal copy was deleted


def test_resume_tp2pp2_at_tp2_pp1(tiny_tp2pp2, tiny_tp2):
    run, r = tiny_tp2
    ok(r)
    assert "at step 3" in r.stderr  # "resumed from ... at step 3": the dspipe logger's (stderr)
    same_continuation(run, tiny_tp2pp2)
    assert json.loads((run / "engine.json").read_text())["dp"] == 1


def test_resume_llama_tp2pp2_at_tp2_pp1_and_at_tp1(work, corpus, llama_tp2pp2, llama_tp2):
    """Grouped-query q/k/v and SwiGLU gate/up re-cut part by part, the untied head's vocabulary rows, the pipeline's
    layer names -> the plain model's."""
    run, r = llama_tp2
    ok(r)
    same_continuation(run, llama_tp2pp2)
    run, r = resumed_at(work, corpus, llama_tp2pp2, "llama-tp1", "--tp", "1", "--pp", "1", model="tiny-llama", gpus=1)
    ok(r)
    same_continuation(run, llama_tp2pp2)


def test_resume_tp1_at_tp2pp2(work, corpus, tiny_tp1):
    """The other way: a plain tp 1 checkpoint cut into tp 2 shards on 2 pipeline stages."""
    run, r = resumed_at(work, corpus, tiny_tp1, "tiny-tp1-to-tp2pp2", "--tp", "2", "--pp", "2", gpus=4)
    ok(r)
    same_continuation(run, tiny_tp1)
