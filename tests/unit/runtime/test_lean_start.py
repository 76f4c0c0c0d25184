"""dspipe.runtime.lean_start: py-cpuinfo asked once per boot, and DeepSpeed's Muon modules (torch._inductor at
import) replaced by stand-ins in a rank that trains with Adam, with the engine's steps unchanged."""

import json
import os
import subprocess
import sys
import types

import pytest

from dspipe.runtime.lean_start import MUON_MODULES, cache_cpu_info, cpuinfo_cache, without_muon
from tests.helpers import ROOT, free_port

INFO = {"arch": "X86_64", "flags": ["avx2", "fma"], "brand_raw": "test cpu"}


def fake_cpuinfo(monkeypatch, answer=INFO):
    """A py-cpuinfo whose get_cpu_info counts its calls (a fresh process's module)."""
    module = types.ModuleType("cpuinfo")
    module.calls = 0

    def get_cpu_info():
        module.calls += 1
        return dict(answer)

    module.get_cpu_info = get_cpu_info
    monkeypatch.setitem(sys.modules, "cpuinfo", module)
    return module


def test_cpuinfo_is_asked_once_a_process_and_once_a_boot(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "cpuinfo-boot.json"
    first = fake_cpuinfo(monkeypatch)
    cache_cpu_info(path=path)
    assert first.get_cpu_info() == INFO and first.get_cpu_info() == INFO
    assert first.calls == 1  # once for the process
    assert json.loads(path.read_text()) == INFO and not list(path.parent.glob("*.part"))
    cache_cpu_info(path=path)  # a second call in the process keeps the cached function
    assert first.calls == 1

    second = fake_cpuinfo(monkeypatch, answer={"arch": "OTHER", "flags": []})  # the next rank of this boot
    cache_cpu_info(path=path)
    assert second.get_cpu_info() == INFO and second.calls == 0  # read back, not asked


@pytest.mark.parametrize("content", ["{not json", '{"arch": "X86_64"}', "[1, 2]"])
def test_an_unreadable_or_partial_cache_is_asked_again_and_rewritten(tmp_path, monkeypatch, content):
    path = tmp_path / "cpuinfo.json"
    path.write_text(content)
    module = fake_cpuinfo(monkeypatch)
    cache_cpu_info(path=path)
    assert module.get_cpu_info() == INFO and module.calls == 1
    assert json.loads(path.read_text()) == INFO


def test_an_unwritable_cache_still_answers(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    module = fake_cpuinfo(monkeypatch)
    cache_cpu_info(path=blocker / "cpuinfo.json")  # its directory is a file
    assert module.get_cpu_info() == INFO and module.get_cpu_info() == INFO and module.calls == 1


def test_an_answer_that_cannot_be_written_leaves_no_file(tmp_path, monkeypatch):
    path = tmp_path / "cpuinfo.json"
    module = fake_cpuinfo(monkeypatch, answer={**INFO, "odd": {1, 2}})  # a set: not JSON
    cache_cpu_info(path=path)
    assert module.get_cpu_info()["odd"] == {1, 2} and module.calls == 1
    assert list(tmp_path.iterdir()) == []  # neither the cache nor a part of it


def test_a_muon_config_or_an_imported_muon_keeps_deepspeeds_modules(monkeypatch):
    for name in MUON_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert without_muon(optimizer="MuonWithAuxAdam") is False
    assert not any(name in sys.modules for name in MUON_MODULES)
    imported = types.ModuleType(MUON_MODULES[0])  # DeepSpeed's own, imported before
    monkeypatch.setitem(sys.modules, MUON_MODULES[0], imported)
    assert without_muon(optimizer="AdamW") is False
    assert sys.modules[MUON_MODULES[0]] is imported and MUON_MODULES[1] not in sys.modules


ENGINE = """
import json, os, sys
import torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
lean = sys.argv[2] == "lean"
if lean:
    from dspipe.runtime.lean_start import without_muon
    assert without_muon(optimizer="AdamW")
import deepspeed
deepspeed.init_distributed(dist_backend="gloo")
losses, optimizers = {}, {}
for stage in (1, 2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    losses[stage] = []
    for _ in range(4):
        loss = (engine(x) - x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses[stage].append(loss.item())
    optimizers[stage] = type(engine.optimizer).__name__
from deepspeed.runtime.zero.muon.original_muon import muon_update
refused = False
if lean:
    try:
        muon_update(None)
    except RuntimeError:
        refused = True
print(json.dumps({"losses": losses, "inductor": "torch._inductor.compile_fx" in sys.modules, "refused": refused,
                  "optimizers": optimizers}))
"""


def _engines(mode: str) -> dict:
    """A ZeRO-1 and a ZeRO-2 engine's four steps in one process, with the Muon stand-ins ('lean') or not."""
    r = subprocess.run(
        [sys.executable, "-c", ENGINE, str(free_port()), mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_zero_engines_without_muon_step_as_deepspeeds_own_without_importing_inductor():
    lean, full = _engines("lean"), _engines("full")
    assert full["inductor"] and not lean["inductor"]  # the Muon module imports inductor; the stand-in not
    assert lean["optimizers"] == full["optimizers"]  # the same ZeRO optimizer wraps the same Adam
    assert lean["losses"] == full["losses"]  # bitwise
    assert all(steps[-1] < steps[0] for steps in lean["losses"].values())  # and they learn
    assert lean["refused"]  # the stand-in update refuses to run


OPS = """
import json, sys
from dspipe.runtime.lean_start import cache_cpu_info, cpuinfo_cache
cache_cpu_info()
from deepspeed.ops.op_builder.cpu import FusedAdamBuilder
print(json.dumps({"args": FusedAdamBuilder().cxx_args(), "cache": str(cpuinfo_cache())}))
"""


def test_deepspeeds_op_builder_reads_the_boots_answer_from_disk(tmp_path):
    """Real py-cpuinfo and DeepSpeed's own op builder, in two processes: the first asks and writes the boot's cache,
    the second builds the same compile flags from it without writing it again."""
    if cpuinfo_cache() is None:
        pytest.skip("no boot id here (not Linux)")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}

    def flags() -> dict:
        r = subprocess.run([sys.executable, "-c", OPS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = flags()
    cache = tmp_path / "dspipe" / first["cache"].rsplit("/", 1)[-1]
    assert first["cache"].startswith(str(tmp_path)) and cache.is_file()
    written = cache.stat().st_mtime_ns
    second = flags()
    assert second["args"] == first["args"] and any(a.startswith("-march") or "AVX" in a for a in first["args"])
    assert cache.stat().st_mtime_ns == written  # read back, not asked and written again
