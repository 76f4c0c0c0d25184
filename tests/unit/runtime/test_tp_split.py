"""dspipe.model.tp_split: the tensor-parallel shard layout as data and its inverse. Synthetic whole tensors are cut
as dspipe's tensor-parallel layers cut them (checked against the layers' own tp_shard on a meta-device build) and
merged back, for every parameter kind, GPT-2-style (tied, biases, MHA) and Llama-style (GQA, SwiGLU, untied, q/k
norm), with an uneven vocabulary; bad shards are one-line errors."""

import pytest
import torch

from dspipe.model import tp_split
from dspipe.spec.presets import model_preset

SPECS = {
    "gpt2-tied": model_preset("tiny"),
    "gpt2-uneven-vocab": model_preset("tiny", vocab=4097),
    "llama-gqa-untied": model_preset("tiny-llama", vocab=4095, qk_norm=True),
    "llama-mha-uneven-untied": model_preset("tiny-llama", vocab=1023, kv_heads=4),
}


def whole(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in spec.model_tensors()}


@pytest.mark.parametrize("key", list(SPECS))
@pytest.mark.parametrize("tp", [2, 4])
def test_merge_of_the_shards_is_the_whole_tensor(key, tp):
    spec = SPECS[key]
    if spec.kv_groups % tp:
        pytest.skip(f"kv heads {spec.kv_groups} over tp {tp}")
    kinds = set()
    for name, full in whole(spec).items():
        shards = [tp_split.shard(name, full, spec, rank=r, size=tp) for r in range(tp)]
        for r, s in enumerate(shards):
            assert tuple(s.shape) == tp_split.shard_shape(name, tuple(full.shape), spec, rank=r, size=tp), name
        assert torch.equal(tp_split.merge_shards(name, shards, spec), full), name
        rule = tp_split.split_of(name, spec)
        kinds.add("replicated" if rule is None else str(rule[0]) if rule[0] != 0 else f"rows{len(rule[1])}")
    assert {"replicated", "1", "vocab", "rows3"} <= kinds


def test_the_layout_is_the_one_the_tensor_parallel_layers_cut():
    """Every parameter's shard as tp_split cuts it equals the shard dspipe's layers take (their tp_shard), on a
    model built on the meta device as each rank of tp 2 builds it (no process group needed)."""
    from dspipe.model.gpt import GPT
    from dspipe.runtime.parallelize import shard_tensor_parallel
    from dspipe.runtime.tensor_parallel import TensorGroup, mark_shards, shard_of

    for spec in (SPECS["gpt2-uneven-vocab"], SPECS["llama-gqa-untied"]):
        full = whole(spec, seed=1)
        for rank in range(2):
            with torch.device("meta"):
                model = GPT(spec, seed=None)
            shard_tensor_parallel(model, spec=spec, tp=TensorGroup(rank=rank, size=2))
            mark_shards(model)
            params = dict(model.named_parameters())
            assert sorted(params) == sorted(full)
            for name, p in params.items():
                want = shard_of(p, full[name])
                assert tuple(p.shape) == tuple(want.shape), name
                assert torch.equal(tp_split.shard(name, full[name], spec, rank=rank, size=2), want), name
                assert bool(getattr(p, "tensor_model_parallel", False)) == (tp_split.split_of(name, spec) is not None)


def test_uneven_vocabulary_rows():
    spec = SPECS["gpt2-uneven-vocab"]
    assert tp_split.shard_shape("embed.wte.weight", (4097, 64), spec, rank=0, size=2) == (2049, 64)
    assert tp_split.shard_shape("embed.wte.weight", (4097, 64), spec, rank=1, size=2) == (2048, 64)
    assert tp_split.split_of("tied_modules.embed.wte.weight", spec) == ("vocab", 4097)  # a pipeline's name
    assert tp_split.split_of("lm_head.weight", spec) == ("vocab", 4097)
    with pytest.raises(ValueError, match=r"rank 3 would hold no rows"):
        tp_split.vocab_rows(9, rank=3, size=4)


def test_bad_shards_are_one_line_errors():
    spec = SPECS["gpt2-tied"]
    full = whole(spec)
    name = "h.0.ln_1.weight"
    other = full[name].clone()
    other[3] += 1e-3
    with pytest.raises(
        ValueError,
        match=rf"^{name}: replicated parameter differs between tp rank 0 and tp rank 1 "
        rf"\(max \|difference\| 0.001\)$",
    ):
        tp_split.merge_shards(name, [full[name], other], spec)
    wte = [tp_split.shard("embed.wte.weight", full["embed.wte.weight"], spec, rank=r, size=2) for r in range(2)]
    with pytest.raises(
        ValueError,
        match=r"^embed.wte.weight: tp ranks hold \[2048, 2047\] vocabulary rows \(sum "
        r"4095\), vocab 4096 over tp 2 gives \[2048, 2048\]$",
    ):
        tp_split.merge_shards("embed.wte.weight", [wte[0], wte[1][:-1]], spec)
    qkv = [
        tp_split.shard("h.1.attn.c_attn.weight", full["h.1.attn.c_attn.weight"], spec, rank=r, size=2) for r in range(2)
    ]
    with pytest.raises(
        ValueError,
        match=r"^h.1.attn.c_attn.weight: tp ranks hold \[96, 95\] along dim 0, parts "
        r"\[64, 64, 64\] over tp 2 give 96 each$",
    ):
        tp_split.merge_shards("h.1.attn.c_attn.weight", [qkv[0], qkv[1][:-1]], spec)
    with pytest.raises(ValueError, match=r"parts \[64, 64, 64\] are not divisible by tp 3"):
        tp_split.merge_shards("h.1.attn.c_attn.weight", [qkv[0]] * 3, spec)


def test_tp_split_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, dspipe.model.tp_split; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
