import pytest

from dspipe.errors import SpecError
from dspipe.planner.plan import make_plan
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.presets import model_preset
from dspipe.spec.strategy import StrategySpec
from dspipe.spec.train import TrainSpec


def plan(*, nodes=1, gpus=8, gpu="h100-80g", gbs=256, mb=4, precision="bf16", steps=100, **strategy):
    return make_plan(
        model=model_preset("gpt2-124m"),
        cluster=ClusterSpec(nodes, gpus, gpu),
        train=TrainSpec(global_batch=gbs, micro_batch=mb, steps=steps, warmup_steps=10, precision=precision),
        strategy=StrategySpec(**strategy),
    )


@pytest.mark.parametrize(
    "nodes,gpus,pp,mb,gbs", [(1, 8, 1, 4, 256), (2, 8, 2, 2, 512), (4, 8, 4, 1, 64), (1, 2, 2, 3, 3)]
)
def test_global_batch_equation_holds(nodes, gpus, pp, mb, gbs):
    p = plan(nodes=nodes, gpus=gpus, pp=pp, mb=mb, gbs=gbs)
    assert p.dp == nodes * gpus // pp
    assert p.global_batch == p.micro_batch * p.grad_accum * p.dp


def test_bucket_sizes_follow_hidden():
    p = plan(zero=3)
    assert p.reduce_bucket_size == max(768 * 768, 1 << 20)
    assert p.param_persistence_threshold == 7680
    assert p.overlap_comm and p.contiguous_gradients
    big = make_plan(
        model=model_preset("gpt3-175b"),
        cluster=ClusterSpec(1, 8, "h100-80g"),
        train=TrainSpec(global_batch=8, micro_batch=1, steps=100, warmup_steps=10),
        strategy=StrategySpec(zero=3),
    )
    assert (big.reduce_bucket_size, big.prefetch_bucket_size, big.param_persistence_threshold) == (
        12288**2,
        int(0.9 * 12288**2),
        122880,
    )


def test_given_bucket_sizes_win():
    p = plan(zero=3, reduce_bucket_size=5 * 10**8, prefetch_bucket_size=5 * 10**7, param_persistence_threshold=10**5)
    assert (p.reduce_bucket_size, p.allgather_bucket_size, p.prefetch_bucket_size, p.param_persistence_threshold) == (
        5 * 10**8,
        5 * 10**8,
        5 * 10**7,
        10**5,
    )


def test_grad_accum_dtype_per_rule():
    assert plan(zero=0).grad_accum_dtype == "bf16"  # DeepSpeed refuses bf16 params with fp32 accumulation w/o ZeRO
    assert plan(zero=1).grad_accum_dtype == "fp32"
    assert plan(zero=1, pp=2).grad_accum_dtype == "fp32"
    assert plan(zero=2, precision="fp16").grad_accum_dtype == "fp16"


def test_pipeline_forces_overlap_off_and_sets_checkpoint_interval():
    p = plan(zero=1, pp=2, checkpointing="full")
    assert not p.overlap_comm and p.activation_checkpoint_interval == 1
    assert plan(zero=1, checkpointing="full").activation_checkpoint_interval == 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(gbs=512, mb=3), "global batch 512 is not divisible by micro_batch 3 x dp 8 = 24"),
        (dict(pp=16), "pipeline stages 16 > layers 12"),
        (dict(gpus=6, pp=4), r"world size 6 \(1 nodes x 6 GPUs\) is not divisible by pp 4 x tp 1 x sp 1 = 4"),
        (
            dict(zero=2, pp=2),
            "ZeRO-2 with pp 2: DeepSpeed's pipeline engine supports ZeRO stages 0-1 only; use --zero 1",
        ),
        (dict(zero=3, pp=4), "ZeRO-3 with pp 4"),
        (dict(zero=2, offload="cpu", offload_params=True), "--offload-params needs ZeRO-3 \\(got ZeRO-2\\)"),
        (dict(zero=3, offload_params=True), "--offload-params needs an offload device"),
        (dict(zero=3, offload="nvme"), "--offload nvme needs --nvme-path"),
        (dict(zero=1, offload="nvme", nvme_path="/nvme"), "--offload nvme needs ZeRO-3"),
        (dict(zero=0, offload="cpu"), "--offload cpu needs ZeRO 1-3"),
        (dict(gpu="cpu", gpus=2, gbs=8, precision="fp16"), "fp16 is not supported by DeepSpeed's CPU accelerator"),
        (dict(steps=5), "warmup_steps 10 must be < steps 5"),
    ],
)
def test_rules_reject_with_the_numbers(kwargs, message):
    with pytest.raises(SpecError, match=message):
        plan(**kwargs)
