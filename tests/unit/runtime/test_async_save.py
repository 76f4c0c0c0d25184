"""Background checkpoint writes (dspipe.runtime.async_save) and retention (checkpoint.Retention): unit tests on real
files; the launches that train through them are in tests/distributed/test_resume.py."""

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dspipe.errors import SpecError
from dspipe.runtime import checkpoint as ckpt
from dspipe.runtime import ckpt_tags
from dspipe.runtime.async_engine import BackgroundWriter
from dspipe.runtime.async_save import ArenaPool, rebuild, stage_into
from dspipe.runtime.faults import Faults
from dspipe.spec.train import TrainSpec
from tests.helpers import mount_tmpfs


def _fake(ckpt_dir, step):
    d = ckpt_dir / ckpt_tags.tag_for(step)
    d.mkdir(parents=True)
    (d / ckpt_tags.META_FILE).write_text(json.dumps({"step": step}))
    ckpt_tags.write_atomic(ckpt_dir / ckpt_tags.LATEST_FILE, d.name)
    return d


def _apply(ckpt_dir, keep):
    for p in ckpt_tags.to_delete(ckpt_dir, keep):
        shutil.rmtree(p)


def _left(ckpt_dir):
    return [s for s, _ in ckpt_tags.complete_checkpoints(ckpt_dir)]


def test_retention_over_20_saves_keeps_exactly_the_newest_k_and_the_milestones(tmp_path):
    keep = ckpt_tags.Retention(last=3, every=50)
    for step in range(10, 201, 10):  # 20 saves, every 10 steps
        _fake(tmp_path, step)
        _apply(tmp_path, keep)
        newest = list(range(max(10, step - 20), step + 1, 10))
        assert _left(tmp_path) == sorted({*range(50, step + 1, 50), *newest}), step
    assert _left(tmp_path) == [50, 100, 150, 180, 190, 200]


def test_retention_never_deletes_the_resumed_one_nor_the_one_latest_names(tmp_path):
    for step in (3, 6, 9, 12):
        _fake(tmp_path, step)
    # resumed from 3 (an older one, by name): the saves after it never delete it while this launch runs
    keep = ckpt_tags.Retention(last=1, protect=frozenset({"global_step3"}))
    assert [p.name for p in ckpt_tags.to_delete(tmp_path, keep)] == ["global_step6", "global_step9"]
    # `latest` names 6 (a save at step 6 replaced an older timeline's): 6 stays though 12 is the newest by step
    ckpt_tags.write_atomic(tmp_path / ckpt_tags.LATEST_FILE, "global_step6")
    kept = ckpt_tags.Retention(last=1)
    assert [p.name for p in ckpt_tags.to_delete(tmp_path, kept)] == ["global_step3", "global_step9"]
    assert [p.name for p in ckpt_tags.to_delete(tmp_path, 2)] == ["global_step3"]  # an int: the newest that many


def test_keep_every_is_validated_against_the_save_interval():
    with pytest.raises(
        SpecError,
        match=r"train.keep_every 1000 is not a multiple of save_interval 300 "
        r"\(1000 % 300 = 100\)",
    ):
        TrainSpec(global_batch=8, micro_batch=1, steps=10, save_interval=300, keep_every=1000)
    with pytest.raises(SpecError, match="keep_every"):
        TrainSpec(global_batch=8, micro_batch=1, steps=10, keep_every=-1)
    assert TrainSpec(global_batch=8, micro_batch=1, steps=10, save_interval=250, keep_every=1000).keep_every == 1000
    assert TrainSpec(global_batch=8, micro_batch=1, steps=10, save_interval=0, keep_every=7).keep_every == 7
    assert TrainSpec(global_batch=8, micro_batch=1, steps=10).async_save is True


def test_staged_into_one_arena_per_file_and_dtype_and_rebuilt_exactly(tmp_path):
    from dspipe.runtime.async_save import save_file

    w = torch.arange(6.0)
    state = {
        "module": {
            "w": w,
            "tied": w,
            "view": w[2:4],
            "t": w.view(2, 3).t(),
            "b": torch.tensor([True, False]),
            "h": torch.ones(3, dtype=torch.bfloat16),
            "s": torch.tensor(7, dtype=torch.int64),
            "e": torch.empty(0),
        },
        "opt": [torch.ones(2)],
        "meta": ("x", 3),
    }
    pool = ArenaPool()
    arenas, staged, nbytes = stage_into(state, pool=pool, name="model_states.pt")
    assert nbytes == 24 + 8 + 24 + 2 + 6 + 8 + 8  # distinct tensors: w once, the empty one none
    assert set(arenas) == {torch.float32, torch.bool, torch.bfloat16, torch.int64}
    assert all(a.is_shared() for a in arenas.values())
    assert arenas[torch.float32].numel() == 4 * 16  # w, view, t, opt: each slot 64 bytes
    w.add_(100.0)
    back = rebuild(staged, arenas)
    m = back["module"]
    assert m["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and m["tied"] is m["w"]
    assert m["view"].tolist() == [2.0, 3.0] and m["t"].tolist() == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
    assert m["b"].tolist() == [True, False] and m["h"].dtype == torch.bfloat16 and m["e"].shape == (0,)
    assert m["s"].shape == () and m["s"].item() == 7 and back["meta"] == ("x", 3)
    # views of their dtype's arena, no copy; torch.save stores each arena once and loads every tensor back
    assert m["view"].untyped_storage().data_ptr() == arenas[torch.float32].untyped_storage().data_ptr()
    save_file(torch, back, str(tmp_path / "m.pt"), zipfile=True)
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert all(torch.equal(loaded["module"][k], m[k]) for k in m) and torch.equal(loaded["opt"][0], back["opt"][0])
    again, _, _ = stage_into(state, pool=pool, name="model_states.pt")
    assert again[torch.float32] is arenas[torch.float32]  # the next checkpoint's same file: the same pages


def test_a_file_of_only_empty_tensors_has_no_arena(tmp_path):
    """ZeRO-3's module states hold 0-element placeholders: they load back with torch.load."""
    from dspipe.runtime.async_save import save_file

    state = {"a": torch.empty(0), "b": torch.empty(0, 3, dtype=torch.bfloat16)}
    arenas, staged, nbytes = stage_into(state, pool=ArenaPool(), name="empty.pt")
    assert arenas == {} and nbytes == 0
    save_file(torch, rebuild(staged, arenas), str(tmp_path / "empty.pt"), zipfile=True)
    back = torch.load(tmp_path / "empty.pt", weights_only=True)
    assert {k: (tuple(v.shape), v.dtype) for k, v in back.items()} == {
        k: (tuple(v.shape), v.dtype) for k, v in state.items()
    }


def test_background_writer_writes_what_was_saved_at_the_call_in_its_own_process(tmp_path):
    writer = BackgroundWriter(zipfile_serialization=True)
    writer.begin()
    w = torch.full((1000,), 1.0)
    writer.save({"w": w, "step": 3}, str(tmp_path / "w.pt"))
    w.mul_(7.0)  # the training step goes on before the file is written
    assert not writer.drained() and not (tmp_path / "w.pt").exists()  # held until release
    writer.release()
    writer.wait()
    assert writer.drained() and writer.failures.code == 0
    saved = torch.load(tmp_path / "w.pt", weights_only=True)
    assert saved["step"] == 3 and saved["w"].unique().tolist() == [1.0]
    assert writer.bytes == 4000 and writer.blocking_s > 0 and writer.write_s > 0
    assert writer._process.is_alive() and writer._process.pid != os.getpid()
    # the next checkpoint reuses the buffers (same shapes): no new host memory
    held = writer.pool.nbytes()
    writer.begin()
    writer.save({"w": w}, str(tmp_path / "w.pt"))
    writer.release()
    writer.wait()
    assert writer.pool.nbytes() == held == 4032  # 1000 float32 in 64-byte (16-element) slots
    assert torch.load(tmp_path / "w.pt", weights_only=True)["w"].unique().tolist() == [7.0]


def test_a_rehearsal_holds_the_buffers_the_first_save_then_copies_into_without_writing_a_file(tmp_path):
    """prepare_buffers' rehearsal: every file's buffers allocated (and their pages written) before the first save,
    which then reuses them; nothing is written and nothing staged for the writer."""
    writer = BackgroundWriter(zipfile_serialization=True)
    state = {"w": torch.full((1000,), 3.0), "h": torch.ones(5, dtype=torch.bfloat16), "step": 1}
    with writer.rehearsal():
        writer.save(state, str(tmp_path / "a" / "model.pt"))
        writer.save({"r": torch.zeros(3, dtype=torch.uint8)}, str(tmp_path / "a" / "rng-rank0.pt"))
    assert writer.prepared and writer.bytes == 4000 + 10 + 3 and not writer._held
    assert writer.pool.nbytes() == 4032 + 64 + 64 and not (tmp_path / "a").exists()
    held = dict(writer.pool.arenas)
    assert held[("model.pt", torch.float32)].eq(0).all()  # written (faulted in), not the state's values
    writer.begin()
    writer.save(state, str(tmp_path / "model.pt"))  # the first real save: the same buffers, now filled
    writer.release()
    writer.wait()
    assert all(writer.pool.arenas[k] is v for k, v in held.items()) and writer.pool.nbytes() == 4032 + 64 + 64
    assert torch.load(tmp_path / "model.pt", weights_only=True)["w"].unique().tolist() == [3.0]


def test_the_rehearsal_runs_in_the_checkpoint_directory_and_leaves_nothing(tmp_path, monkeypatch):
    """prepare_buffers rehearses DeepSpeed's save in a `.partial-` scratch directory of the rank's own inside the
    run's checkpoint directory (the disk the checkpoints go to, writable by then; a kill's leftover is cleared with
    the interrupted saves), and removes it: the buffers are held, no file is left, the writer's count is the files'."""
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    seen = []

    class Engine:
        checkpoint_engine = None

        def zero_nvme_offload_optimizer(self):
            return False

        def save_checkpoint(self, path, *, tag, client_state, save_latest):
            seen.append(path)
            (Path(path) / tag).mkdir(parents=True, exist_ok=True)
            (Path(path) / tag / "zero_to_fp32.py").write_text("# a recovery script")  # what DeepSpeed writes itself
            self.checkpoint_engine.save({"w": torch.ones(1000)}, f"{path}/{tag}/model.pt")

    writer = BackgroundWriter(zipfile_serialization=True)
    into = tmp_path / "checkpoints"
    (into / ".partial-rehearsal-rank0").mkdir(parents=True)  # a killed rehearsal's leftover
    nbytes, seconds = ckpt.prepare_buffers(Engine(), writer=writer, into=into)
    assert seen == [str(into / ".partial-rehearsal-rank0")] and seconds >= 0
    assert nbytes >= 4000 + 1 and writer.prepared and writer.pool.nbytes() > 0
    assert list(into.iterdir()) == []  # the scratch removed, nothing else written
    assert ckpt_tags.PARTIAL_PREFIX == ".partial-"  # so ckpt_tags.to_delete clears a kill's leftover


def test_no_rehearsal_under_nvme_optimizer_offload(tmp_path):
    """DeepSpeed's save copies the NVMe swap files into the checkpoint: the rehearsal is declined, once."""

    class NvmeEngine:
        def zero_nvme_offload_optimizer(self):
            return True

        def save_checkpoint(self, *args, **kwargs):
            raise AssertionError("rehearsed")

    writer = BackgroundWriter(zipfile_serialization=True)
    assert ckpt.prepare_buffers(NvmeEngine(), writer=writer, into=tmp_path) is None
    assert writer.prepared and not writer.pool.arenas


def test_background_writer_records_a_failed_write_and_a_dead_writer(tmp_path):
    writer = BackgroundWriter(zipfile_serialization=True)
    writer.begin()
    writer.save({"w": torch.zeros(4)}, str(tmp_path / "missing" / "a.pt"))
    writer.save({"w": torch.zeros(4)}, str(tmp_path / "b.pt"))
    writer.wait()
    assert writer.failures.code in (errno.ENOENT, ckpt.WriteFailures.GENERIC), writer.failures.detail
    writer.begin()  # the next checkpoint starts clean
    writer.save({"w": torch.zeros(4)}, str(tmp_path / "c.pt"))
    writer.wait()
    assert writer.failures.code == 0 and (tmp_path / "c.pt").is_file()
    writer._process.kill()  # the writer process dies: what it had is a failed write, not a wait forever
    writer._process.join()
    writer.begin()
    writer._outstanding = 1
    writer.wait()
    assert writer.failures.code == ckpt.WriteFailures.GENERIC
    assert writer.failures.detail == "the checkpoint writer process died (exit code -9)"


def test_a_full_disk_during_a_background_write_is_recorded_as_enospc(tmp_path):
    small = tmp_path / "small"
    if not mount_tmpfs(small, 2**20):
        pytest.skip("no size-enforcing tmpfs can be mounted here")
    try:
        writer = BackgroundWriter(zipfile_serialization=True)
        writer.begin()
        writer.save({"w": torch.zeros(2**20)}, str(small / "states.pt"))
        writer.wait()
        writer.failures.confirm_full(ckpt.free_mib(small))
        assert writer.failures.code == errno.ENOSPC
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_the_async_write_kill_fault_names_its_step():
    assert Faults.from_json('{"kill_in_async_write": 6}').async_write_kill_tag == "global_step6"
    assert Faults().async_write_kill_tag is None


@pytest.mark.parametrize("where", ["direct", "refused"])
def test_direct_file_writes_what_torch_save_would_at_any_length(tmp_path, monkeypatch, where):
    """With O_DIRECT, and where the filesystem refuses it (an ordinary buffered file then): both round-trip through
    torch.load, byte for byte the file torch.save writes to a file object, for lengths that are not whole blocks."""
    from dspipe.runtime import async_save
    from dspipe.runtime.async_save import DirectFile, save_file

    if where == "refused":
        plain_open = os.open

        def refuse(path, flags, *mode):
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            return plain_open(path, flags, *mode)

        monkeypatch.setattr(async_save.os, "open", refuse)
    for n in (0, 1, 1023, 3 * 2**20 + 5):
        state = {"w": torch.arange(n, dtype=torch.float32), "step": n}
        save_file(torch, state, str(tmp_path / f"d{n}.pt"), zipfile=True)
        with open(tmp_path / f"t{n}.pt", "wb") as f:
            torch.save(state, f)  # torch's own writer of a file object (a path names the records after it)
        assert (tmp_path / f"d{n}.pt").read_bytes() == (tmp_path / f"t{n}.pt").read_bytes()
        back = torch.load(tmp_path / f"d{n}.pt", weights_only=True, mmap=True)
        assert back["step"] == n and torch.equal(back["w"], state["w"])
    f = DirectFile(str(tmp_path / "probe"))
    f.close()
    assert f.direct == (where == "direct")
    monkeypatch.setattr(DirectFile, "CHUNK", 8192)  # several whole chunks and a tail
    save_file(torch, {"w": torch.ones(10_000)}, str(tmp_path / "chunks.pt"), zipfile=True)
    assert torch.load(tmp_path / "chunks.pt", weights_only=True)["w"].sum().item() == 10_000
