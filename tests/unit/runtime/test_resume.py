"""Checkpoints every N steps, keep-K, crash-safe saves and exact resume, with real DeepSpeed launches on 2 CPU
ranks; plus unit tests of the pure checkpoint logic."""

import json
import os
import subprocess

import pytest

from dspipe.errors import SpecError
from dspipe.runtime import checkpoint as ckpt
from dspipe.runtime import ckpt_meta, ckpt_tags
from dspipe.runtime.metrics_log import repair_rows
from dspipe.runtime.reshard import layout_change_refusal
from tests.helpers import meta_of, mount_tmpfs

# ---- unit: pure logic ------------------------------------------------------------------------------------------


def _fake(ckpt_dir, step, complete=True):
    d = ckpt_dir / ckpt_tags.tag_for(step)
    d.mkdir(parents=True)
    if complete:
        (d / ckpt_tags.META_FILE).write_text(json.dumps({"step": step}))
    return d


def test_keep_k_and_partial_leftovers(tmp_path):
    for s in (3, 6, 9, 12):
        _fake(tmp_path, s)
    _fake(tmp_path, 15, complete=False)
    (tmp_path / ".partial-global_step15").mkdir()
    assert [s for s, _ in ckpt_tags.complete_checkpoints(tmp_path)] == [3, 6, 9, 12]
    assert [p.name for p in ckpt_tags.to_delete(tmp_path, 2)] == [
        "global_step3",
        "global_step6",
        ".partial-global_step15",
    ]


def test_find_checkpoint(tmp_path):
    assert ckpt_tags.find_checkpoint(tmp_path / "none", "auto") is None
    _fake(tmp_path, 3)
    _fake(tmp_path, 6, complete=False)
    assert ckpt_tags.find_checkpoint(tmp_path, "auto").name == "global_step3"
    assert ckpt_tags.find_checkpoint(tmp_path, "global_step3").name == "global_step3"
    with pytest.raises(SpecError, match="is incomplete"):
        ckpt_tags.find_checkpoint(tmp_path, "global_step6")
    with pytest.raises(SpecError, match="not found"):
        ckpt_tags.find_checkpoint(tmp_path, "global_step7")
    (tmp_path / "latest").write_text("global_step6")
    with pytest.raises(SpecError, match="missing or incomplete"):
        ckpt_tags.find_checkpoint(tmp_path, "auto")


def test_repair_rows_and_atomic_write(tmp_path):
    m = tmp_path / "metrics.csv"
    m.write_text("step,loss\n1,9.0\n2,8.0\n3,7.0\n4,6.5\n")
    repair_rows(m, upto=2)
    assert m.read_text() == "step,loss\n1,9.0\n2,8.0\n"
    ckpt_tags.write_atomic(tmp_path / "latest", "global_step2")
    assert (tmp_path / "latest").read_text() == "global_step2" and [
        p.name for p in tmp_path.iterdir() if p.name.startswith(".")
    ] == []


def test_save_interval_and_keep_are_validated():
    from dspipe.spec.train import TrainSpec

    with pytest.raises(SpecError, match="save_interval"):
        TrainSpec(global_batch=8, micro_batch=1, steps=10, save_interval=-1)
    with pytest.raises(SpecError, match="keep_checkpoints"):
        TrainSpec(global_batch=8, micro_batch=1, steps=10, keep_checkpoints=0)


def test_dp_change_refusals(tmp_path):
    def refusal(**changed):
        args = {
            "meta": meta_of(dp=2, pp=1, zero_stage=1),
            "zero_stage": 1,
            "pp": 1,
            "dp": 1,
            "offload": "none",
            "path": tmp_path,
        }
        if isinstance(changed.get("meta"), dict):
            changed["meta"] = meta_of(**changed["meta"])
        return layout_change_refusal(**{**args, **changed})

    assert refusal() is None and refusal(zero_stage=2) is None and refusal(offload="cpu") is None
    assert refusal(zero_stage=0, meta={"dp": 2, "pp": 2}, pp=2) is None  # ZeRO-0 state is not partitioned
    assert refusal(dp=2, zero_stage=3, offload="nvme") is None  # same dp: always the plain load
    assert refusal(zero_stage=3) is None and refusal(zero_stage=3, offload="cpu") is None  # universal + groups fixed
    assert "NVMe" in refusal(offload="nvme")
    assert "universal_checkpoint_info" in refusal(meta={"dp": 2, "pp": 2}, pp=2)  # a pipeline needs the info saved
    moe = {"dp": 2, "pp": 1, "zero_stage": 1, "model": {"experts": 4}}
    assert refusal(meta=moe) is None  # converted by dspipe.runtime.moe_reshard
    assert refusal(meta={**moe, "zero_stage": 2}, zero_stage=2) is None
    assert refusal(meta={**moe, "zero_stage": 0}, zero_stage=0) is None  # ep 1, whole state: DeepSpeed loads it
    (tmp_path / "offloaded_tensors").mkdir()
    assert "NVMe" in refusal()


def _raise(e):
    raise e


def test_write_failures_are_recorded_not_raised(tmp_path):
    import errno

    failures = ckpt.WriteFailures()
    assert failures.call(lambda: 7) == 7 and failures.code == 0
    failures.call(open, tmp_path / "missing" / "x", "w")
    assert failures.code == errno.ENOENT
    assert failures.call(lambda: 7) is None  # later writes are skipped once one failed
    enospc = ckpt.WriteFailures()
    enospc.call(_raise, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert enospc.code == errno.ENOSPC
    # torch's stream close on a full disk: classified by what failed (a routed write), not by the text
    ios = ckpt.WriteFailures()
    ios.call(_raise, RuntimeError("basic_ios::clear: iostream error"))
    assert (ios.code, ios.detail) == (ckpt.WriteFailures.GENERIC, "RuntimeError: basic_ios::clear: iostream error")
    ios.confirm_full(50.0)
    assert ios.code == ckpt.WriteFailures.GENERIC  # plenty of space left: not called a full disk
    ios.confirm_full(0.0)
    assert ios.code == errno.ENOSPC  # the target's free space confirms it
    for bug in (TypeError("save() got an unexpected keyword"), AttributeError("no attribute 'x'"), KeyError("k")):
        with pytest.raises(type(bug)):  # a bug in the code doing the write, not a failed write: propagates
            ckpt.WriteFailures().call(_raise, bug)


def test_a_full_disk_inside_torch_save_is_a_write_failure(tmp_path):
    """A real torch.save onto a 1 MiB tmpfs of a 4 MiB tensor: recorded (whatever torch's message), then
    confirmed as ENOSPC by the free space."""
    import errno

    import torch

    from dspipe.runtime.writefail import free_mib

    small = tmp_path / "small"
    if not mount_tmpfs(small, 2**20):
        pytest.skip("no size-enforcing tmpfs can be mounted here")
    try:
        failures = ckpt.WriteFailures()
        failures.call(torch.save, {"w": torch.zeros(2**20)}, small / "states.pt")
        assert failures.code in (errno.ENOSPC, ckpt.WriteFailures.GENERIC), failures.detail
        failures.confirm_full(free_mib(small))
        assert failures.code == errno.ENOSPC
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_save_failure_message_names_the_intact_checkpoint(tmp_path):
    import errno

    _fake(tmp_path, 3)
    (tmp_path / "latest").write_text("global_step3")
    (tmp_path / ".universal-global_step3").mkdir()
    assert [p.name for p in ckpt_tags.to_delete(tmp_path, 3)] == [".universal-global_step3"]
    msg = ckpt.save_failure_message(
        code=errno.ENOSPC, detail="", ckpt_dir=tmp_path, tag="global_step6", free_before=0.2
    )
    assert msg.startswith(
        f"saving checkpoint global_step6 in {tmp_path} failed: No space left on device (0.2 MiB free, "
    )
    assert (
        msg.endswith(
            f"the last complete checkpoint {tmp_path / 'global_step3'} is intact and 'latest' names it; "
            f"free space there, then continue with --resume auto"
        )
        and "\n" not in msg
    )


def test_check_compatible_refuses_a_pipeline_saved_without_universal_info_under_another_dp(tmp_path):
    from dataclasses import asdict, replace
    from types import SimpleNamespace

    import torch

    from dspipe.spec.presets import model_preset

    model = model_preset("tiny")
    run = SimpleNamespace(model=model, plan=SimpleNamespace(pp=2, tp=1, sp=1, zero_stage=1, dp=1, offload="none"))
    meta = meta_of(model=asdict(model), pp=2, zero_stage=1, dp=2)
    torch.save({"module": None}, tmp_path / "mp_rank_00_model_states.pt")  # saved before the module carried it
    with pytest.raises(SpecError) as e:
        ckpt_meta.check_compatible(meta, run, tmp_path)
    assert str(e.value).startswith(
        f"checkpoint {tmp_path} was saved with dp 2 x pp 2, this run has dp 1 x pp 2: "
        f"the checkpoint was saved without universal_checkpoint_info"
    )
    assert str(e.value).endswith("; resume with dp 2 x pp 2 (world size 4)")
    ckpt_meta.check_compatible(replace(meta, dp=1), run, tmp_path)  # same dp: fine
    ckpt_meta.check_compatible(
        replace(meta, pp=1, zero_stage=3),
        SimpleNamespace(model=model, plan=SimpleNamespace(pp=1, tp=1, sp=1, zero_stage=3, dp=1, offload="none")),
        tmp_path,
    )  # ZeRO-3 at another dp: resharded on load
    torch.save(
        {"module": None, "universal_checkpoint_info": {"original_vocab_size": 4096}},
        tmp_path / "mp_rank_00_model_states.pt",
    )
    ckpt_meta.check_compatible(meta, run, tmp_path)  # saved with it: converted on load
    ckpt_meta.check_compatible(replace(meta, dp=1, tp=2), run, tmp_path)  # tp 2 -> 1 likewise


def test_each_optimizer_group_gets_its_saved_hyperparameters_back():
    import torch

    from dspipe.runtime.reshard import restore_group_hyperparameters

    decay, no_decay = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([{"params": [decay], "weight_decay": 0.1}, {"params": [no_decay], "weight_decay": 0.1}])
    saved = [{"params": [0], "weight_decay": 0.1, "lr": 2e-3}, {"params": [1], "weight_decay": 0.0, "lr": 2e-3}]
    restore_group_hyperparameters(opt, saved_groups=saved)  # as DeepSpeed 0.19's ZeRO-3 universal load leaves them
    assert [(g["weight_decay"], g["lr"]) for g in opt.param_groups] == [(0.1, 2e-3), (0.0, 2e-3)]
    assert opt.param_groups[1]["params"] == [no_decay]  # DeepSpeed's parameters stay
    with pytest.raises(SpecError, match="checkpoint has 1 optimizer parameter groups, this run has 2"):
        restore_group_hyperparameters(opt, saved_groups=saved[:1])


def test_a_checkpoint_from_before_newer_model_fields_is_compatible(tmp_path):
    """A checkpoint's model holds the ModelSpec keys of its day: a key added since (the router's score function, the
    MoE fields) reads as its default, not as a changed shape; a key that really differs is still refused."""
    from dataclasses import asdict, replace
    from types import SimpleNamespace

    from dspipe.spec.presets import model_preset

    model = model_preset("tiny")
    run = SimpleNamespace(model=model, plan=SimpleNamespace(pp=1, tp=1, sp=1, zero_stage=1, dp=1, offload="none"))
    old = {
        k: v
        for k, v in asdict(model).items()
        if k not in ("router_score", "router_scale", "experts", "experts_per_token", "aux_loss_coef")
    }
    ckpt_meta.check_compatible(meta_of(model=old), run, tmp_path)
    with pytest.raises(SpecError, match=r"different model shape: layers 2 -> 1$"):
        ckpt_meta.check_compatible(
            meta_of(model={**old, "layers": 2}),
            SimpleNamespace(model=replace(model, layers=1), plan=run.plan),
            tmp_path,
        )
