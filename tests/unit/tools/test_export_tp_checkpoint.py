"""Tensor-parallel checkpoints built by hand in DeepSpeed's file layout (no launch): tp 2 at pp 1 (mp_rank_RR holds
tp rank RR's shards) and tp 2 x pp 2 (layer_LL-model_RR files, mp_rank_MM per stage x tp rank), fp32 ZeRO-0 so the
module weights are the master weights. The checks of their files (ckptfiles), and export's merge of the shards back
into the whole model (an uneven vocabulary, a tied GPT-2-style and an untied Llama/GQA model); damage is one line."""

import json
import random
from dataclasses import asdict, replace

import numpy as np
import pytest
import torch

from dspipe.errors import SpecError
from dspipe.model import tp_split
from dspipe.model.gpt import GPT
from dspipe.runtime import ckpt_meta, ckpt_tags
from dspipe.runtime.ckptfiles import check_checkpoint, expected_files
from dspipe.spec.presets import model_preset
from tests.helpers import meta_of

STEP = 6


def layer_of(name: str, layers: int) -> tuple[int, str]:
    """GPT name -> (pipeline layer index, the name inside the layer file)."""
    head, rest = name.split(".", 1)
    if head == "embed":
        return 0, rest
    if head == "h":
        index, rest = rest.split(".", 1)
        return int(index) + 1, rest
    return (layers + 1, rest) if head == "final" else (layers + 2, rest)


def tp_checkpoint(path, spec, *, tp, pp, seed=0):
    """A complete fp32 ZeRO-0 checkpoint of `spec` at (tp, pp), dp 1; returns (path, the whole weights)."""
    path.mkdir(parents=True)
    state = {
        k: v
        for k, v in GPT(spec, seed=seed).state_dict().items()
        if not (spec.tied_embeddings and k == "lm_head.weight")
    }
    with torch.no_grad():
        for k, v in state.items():
            if v.dim() == 1:
                v.add_(torch.randn(v.shape, generator=torch.Generator().manual_seed(len(k))) * 0.1)
    data = {
        "consumed_samples": STEP * 16,
        "epoch": 0,
        "seed": 1234,
        "num_samples": 10_000,
        "seq_len": spec.seq_len,
        "split": "train",
        "fingerprint": "ab" * 32,
    }
    common = {
        "buffer_names": [],
        "optimizer": None,
        "lr_scheduler": {},
        "global_steps": STEP,
        "ds_version": "0.19.8",
        "step": STEP,
    }
    shards = [{k: tp_split.shard(k, v, spec, rank=r, size=tp).clone() for k, v in state.items()} for r in range(tp)]
    if pp == 1:
        for r in range(tp):
            torch.save({"module": shards[r], **common}, path / f"mp_rank_{r:02d}_model_states.pt")
    else:
        for m in range(pp * tp):
            torch.save({"module": None, **common}, path / f"mp_rank_{m:02d}_model_states.pt")
        for r in range(tp):
            files: dict[int, dict] = {}
            for k, v in shards[r].items():
                index, inner = layer_of(k, spec.layers)
                files.setdefault(index, {})[inner] = v
            for index, layer in files.items():
                torch.save(layer, path / f"layer_{index:02d}-model_{r:02d}-model_states.pt")
    rng = {
        "python": random.Random(0).getstate(),
        "numpy": np.random.RandomState(0).get_state(),
        "torch": torch.Generator().manual_seed(0).get_state(),
    }
    for rank in range(tp * pp):
        torch.save(rng, path / f"rng-rank{rank}.pt")
    meta = {
        "step": STEP,
        "consumed_samples": STEP * 16,
        "data": data,
        "model": asdict(spec),
        "pp": pp,
        "tp": tp,
        "sp": 1,
        "zero_stage": 0,
        "dp": 1,
        "world_size": tp * pp,
    }
    (path / ckpt_tags.META_FILE).write_text(json.dumps(meta))
    return path, state


CASES = {
    "gpt2-uneven-vocab-tp2": (model_preset("tiny", vocab=4097), 2, 1),
    "gpt2-tp2pp2": (model_preset("tiny"), 2, 2),
    "llama-gqa-untied-tp2pp2": (model_preset("tiny-llama", vocab=4095), 2, 2),
    "llama-mha-tp4": (model_preset("tiny-llama", kv_heads=4, vocab=1023), 4, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_checked_and_merged_back_into_the_whole_model(tmp_path, case):
    from dspipe.tools.consolidate import consolidate, load_gpt

    spec, tp, pp = CASES[case]
    path, state = tp_checkpoint(tmp_path / "global_step6", spec, tp=tp, pp=pp)
    meta = ckpt_meta.read_meta(path)
    names = sorted(p.name for p in path.iterdir())
    assert set(expected_files(meta)) == {n for n in names if n != ckpt_tags.META_FILE}
    check_checkpoint(path, meta=meta)
    merged = consolidate(path, meta=meta)
    assert sorted(merged) == sorted(state)
    assert all(torch.equal(merged[k], state[k]) for k in state)
    gpt = load_gpt(path, meta=meta)
    assert torch.equal(gpt.state_dict()["embed.wte.weight"], state["embed.wte.weight"])


def test_layer_file_names_of_tp_pipelines():
    meta = meta_of(dp=1, sp=1, zero_stage=1, world_size=4, pp=2, tp=2)
    tied = expected_files(replace(meta, model=asdict(model_preset("tiny"))))
    untied = expected_files(replace(meta, model=asdict(model_preset("tiny-llama"))))
    assert [n for n in tied if n.startswith("layer_")] == [
        f"layer_{i:02d}-model_{r:02d}-model_states.pt" for i in range(4) for r in range(2)
    ]
    assert [n for n in untied if n.startswith("layer_")][-2:] == [
        "layer_04-model_00-model_states.pt",
        "layer_04-model_01-model_states.pt",
    ]
    assert [n for n in tied if n.startswith("mp_rank")] == [f"mp_rank_{m:02d}_model_states.pt" for m in range(4)]
    plain = expected_files(replace(meta, pp=1, world_size=2, model=asdict(model_preset("tiny"))))
    assert plain == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt", "rng-rank0.pt", "rng-rank1.pt"]


def test_damaged_tp_checkpoints_are_one_line_errors(tmp_path):
    from dspipe.tools.consolidate import consolidate

    spec = model_preset("tiny", vocab=4097)
    path, _ = tp_checkpoint(tmp_path / "pp2" / "global_step6", spec, tp=2, pp=2)
    meta = ckpt_meta.read_meta(path)
    layer = path / "layer_01-model_01-model_states.pt"
    saved = layer.read_bytes()
    layer.unlink()
    with pytest.raises(
        SpecError,
        match=rf"^checkpoint {path} is missing layer_01-model_01-model_states.pt \(dp 1, "
        rf"pp 2, tp 2, sp 1, ZeRO-0 writes them\)$",
    ):
        check_checkpoint(path, meta=meta)
    layer.write_bytes(saved)
    stray = path / "layer_01-model_02-model_states.pt"
    stray.write_bytes(saved)
    with pytest.raises(
        SpecError,
        match=rf"^{stray}: a layer file of tp rank 2 does not belong to this checkpoint "
        rf"\(tp 2 writes layer_LL-model_RR-model_states.pt, RR < tp\)$",
    ):
        check_checkpoint(path, meta=meta)
    stray.unlink()
    embed0, embed1 = (path / f"layer_00-model_{r:02d}-model_states.pt" for r in range(2))
    original = torch.load(embed0)
    torch.save(torch.load(embed1), embed0)  # tp rank 1's 2048 vocabulary rows where tp rank 0's 2049 belong
    with pytest.raises(
        SpecError,
        match=rf"^{embed0}: embed.wte.weight has shape \[2048, 64\], the checkpoint's "
        rf"model has \[4097, 64\], tp rank 0 of 2 holds \[2049, 64\] of it$",
    ):
        check_checkpoint(path, meta=meta)
    torch.save(original, embed0)
    block = torch.load(path / "layer_02-model_01-model_states.pt")
    block["ln_1.weight"] = block["ln_1.weight"] + 0.5  # a replicated tensor that differs between the tp ranks
    torch.save(block, path / "layer_02-model_01-model_states.pt")
    check_checkpoint(path, meta=meta)  # names and shapes are right
    with pytest.raises(
        SpecError,
        match=rf"^checkpoint {path}: h.1.ln_1.weight: replicated parameter differs between "
        rf"tp rank 0 and tp rank 1 \(max \|difference\| 0.5\)$",
    ):
        consolidate(path, meta=meta)

    flat, _ = tp_checkpoint(tmp_path / "pp1" / "global_step6", model_preset("tiny"), tp=2, pp=1)
    whole = torch.load(flat / "mp_rank_00_model_states.pt")
    whole["module"]["h.0.attn.c_attn.weight"] = torch.zeros(192, 64)  # the whole tensor where a shard belongs
    torch.save(whole, flat / "mp_rank_00_model_states.pt")
    with pytest.raises(
        SpecError,
        match=r"mp_rank_00_model_states.pt: h.0.attn.c_attn.weight has shape \[192, 64\], "
        r"the checkpoint's model has \[192, 64\], tp rank 0 of 2 holds \[96, 64\] of "
        r"it$",
    ):
        check_checkpoint(flat, meta=ckpt_meta.read_meta(flat))
