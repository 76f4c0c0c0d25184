"""The one module of helpers shared by the tests (unit and distributed): paths, the CLI, DeepSpeed launches, run
directories. Test modules import from here (`from tests.helpers import ...`), never from each other; fixtures live in
tests/conftest.py."""

import contextlib
import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # transformers reads only local files


def free_port() -> int:
    """A free port outside the ephemeral range (dspipe.cluster.ports), from this xdist worker's share of it."""
    from dspipe.cluster.ports import free_port as pick

    worker, count = os.environ.get("PYTEST_XDIST_WORKER", "gw0"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return pick(slot=int(worker.removeprefix("gw")) % count, slots=count)


def dspipe(*args, cwd=ROOT, env=None) -> subprocess.CompletedProcess:
    """`dspipe ARGS` in a subprocess; `env` adds to this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", "dspipe", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def dspipe_here(*args, cwd=None, env=None) -> subprocess.CompletedProcess:
    """`dspipe ARGS` run by the CLI's own main in this process, reported as dspipe() reports it (exit code, stdout,
    stderr); `env` is set for the call only. A fresh interpreter spends ~5 s importing torch and DeepSpeed, this
    process once: for the distributed tests, which generate, export and read many runs. The CLI's own tests run it
    in a subprocess (dspipe())."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    saved, here = {k: os.environ.get(k) for k in env or {}}, os.getcwd()
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    try:
        os.chdir(cwd or here)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run_cli(*args)
    finally:
        os.chdir(here)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(["dspipe", *map(str, args)], code or 0, out.getvalue(), err.getvalue())


def gen_config(*args, cwd=None) -> subprocess.CompletedProcess:
    """`dspipe gen-config ARGS` in this process (dspipe_here)."""
    return dspipe_here("gen-config", *args, cwd=cwd)


def dspipe_offline(*args) -> subprocess.CompletedProcess:
    return dspipe(*args, env=OFFLINE)


def offline_here(*args) -> subprocess.CompletedProcess:
    """`dspipe ARGS` in this process (dspipe_here), transformers reading local files only."""
    return dspipe_here(*args, env=OFFLINE)


def error_lines(r):
    return [line for line in r.stderr.splitlines() if line.strip()]


def launch(run_dir, *extra, env=None, num_gpus=2, port=None, timeout=900):
    """Start `num_gpus` ranks of `run.py --run RUN_DIR [extra...]` on this machine (2 CPU ranks by default), each
    as DeepSpeed's per-node launcher (deepspeed.launcher.launch) starts it: `python -u run.py --local_rank=N ...`
    with its environment (MASTER_ADDR/PORT, WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_SIZE, CROSS_RANK/SIZE) and the
    repository on PYTHONPATH. Like that launcher, the first rank to exit non-zero ends the others (their process
    trees: a killed rank's peer would wait in a collective) and gives the launch's exit status. Starting the ranks
    here saves that launcher's interpreter and DeepSpeed import (4.6 s a launch on 2 cores) and the `deepspeed`
    runner's before it; the `deepspeed` command itself is run by scripts/wheel_smoke.sh, the README's demo,
    tests/distributed/test_multinode.py and the SIGTERM test. Returns a CompletedProcess (both ranks' output)."""
    import tempfile
    import time

    import psutil

    port = port or free_port()
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    base = {**os.environ, "PYTHONPATH": path, **(env or {})}
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(num_gpus),
        LOCAL_SIZE=str(num_gpus),
        CROSS_RANK="0",
        CROSS_SIZE="1",
    )
    cmd = [sys.executable, "-u", "run.py"]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        ranks = [
            subprocess.Popen(
                [*cmd, f"--local_rank={rank}", "--run", str(run_dir), *map(str, extra)],
                cwd=ROOT,
                stdout=out,
                stderr=err,
                env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            )
            for rank in range(num_gpus)
        ]
        deadline, failed_at = time.monotonic() + timeout, None
        try:
            while any(p.poll() is None for p in ranks) and time.monotonic() < deadline:
                if failed_at is None and any(p.returncode for p in ranks):
                    failed_at = time.monotonic()  # the others get a second to end by themselves, as the launcher's
                if failed_at is not None and time.monotonic() > failed_at + 1.0:  # 1 s poll gives them
                    break
                time.sleep(0.05)
            codes = [p.returncode for p in ranks]
            code = next((c for c in codes if c), 0) if failed_at or None not in codes else None
        finally:
            for p in ranks:  # what is left: the process and its children (the checkpoint writer)
                try:
                    tree = psutil.Process(p.pid)
                    for proc in [*tree.children(recursive=True), tree]:
                        proc.kill()
                except psutil.Error:
                    pass
                p.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if code is None:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, code % 256, stdout, stderr)


def ok(r):
    """A launch exited 0; else the assertion shows the tails of its output."""
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def csv_rows(path) -> list:
    """The rows of a CSV file a run writes (metrics.csv, val_metrics.csv), as dicts of the strings written."""
    with open(path) as f:
        return list(csv.DictReader(f))


def metrics(run_dir, *columns) -> list:
    """metrics.csv's `columns` as floats, one entry a logged step: the value for one column, a tuple for several."""
    rows = [tuple(float(r[c]) for c in columns) for r in csv_rows(Path(run_dir) / "metrics.csv")]
    return [row[0] for row in rows] if len(columns) == 1 else rows


def written_metrics(run_dir, *, name="metrics.csv") -> list:
    """(step, loss, lr, grad_norm) per step of metrics.csv (or `name`) as written (full precision): for bitwise
    comparisons."""
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in csv_rows(Path(run_dir) / name)]


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts of tensors with the same keys."""
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def make_run(tmp_path, corpus, *flags, steps=20, name="run"):
    run_dir = tmp_path / name
    # an explicit strategy; later flags override
    r = gen_config(
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
        steps,
        "--warmup",
        "2",
        "--lr",
        "3e-3",
        "--log-interval",
        "5",
        "--data",
        corpus,
        "--out",
        run_dir,
        "--precision",
        "bf16",
        "--offload",
        "none",
        "--no-offload-params",
        "--pp",
        "1",
        "--checkpointing",
        "none",
        *flags,
    )
    assert r.returncode == 0, r.stderr
    return run_dir


def mount_tmpfs(path, size_bytes):
    """A tmpfs of `size_bytes` at `path` (we run as root in CI) whose size is enforced (a write one MiB past its
    free space fails with ENOSPC); False where mounting is not permitted or the size is not enforced."""
    import errno

    path.mkdir(exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        return False
    probe = path / "probe"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * (shutil.disk_usage(path).free + 2**20))
            f.flush()
            os.fsync(f.fileno())
        enforced = False
    except OSError as e:
        enforced = e.errno == errno.ENOSPC
    probe.unlink(missing_ok=True)
    if not enforced:
        subprocess.run(["umount", str(path)], check=True)
    return enforced


def run_cli(*args) -> int:
    """`dspipe ARGS` in this process (fast; capture output with capsys): the exit code, 0 when it returned."""
    from dspipe.cli.app import main

    try:
        main([str(a) for a in args])
    except SystemExit as e:
        return e.code
    return 0


def hand_checkpoint(run_dir, *, step=6, seed=0):
    """A complete checkpoint of a 2-rank fp32 ZeRO-0 run (pp 1), written the way DeepSpeed and dspipe write one but
    without launching: mp_rank_00_model_states.pt holding the GPT's weights (seed `seed`), rng-rank0/1.pt, and
    dspipe.json; `latest` names it. For readers (export-hf, generate, the resume check) on real file formats."""
    import json
    import random
    from dataclasses import asdict

    import numpy as np
    import torch

    from dspipe.model.gpt import GPT
    from dspipe.rundir import SPEC_FILE, load_run
    from dspipe.runtime import ckpt_tags

    run = load_run(run_dir)
    assert (run.plan.zero_stage, run.plan.pp, run.plan.tp, run.plan.sp) == (0, 1, 1, 1), "a ZeRO-0 pp 1 run"
    tag = run.checkpoint_dir / ckpt_tags.tag_for(step)
    tag.mkdir(parents=True)
    consumed = step * run.plan.global_batch
    data = {
        "consumed_samples": consumed,
        "epoch": 0,
        "seed": run.train.seed,
        "num_samples": 10_000,
        "seq_len": run.model.seq_len,
        "split": "train",
        "fingerprint": "ab" * 32,
    }
    module = GPT(run.model, seed=seed).state_dict()
    torch.save(
        {
            "module": module,
            "buffer_names": [],
            "optimizer": None,
            "lr_scheduler": {},
            "global_steps": step,
            "ds_version": "0.19.8",
            "step": step,
            "consumed_samples": consumed,
            "data": data,
        },
        tag / "mp_rank_00_model_states.pt",
    )
    rng = {
        "python": random.Random(seed).getstate(),
        "numpy": np.random.RandomState(seed).get_state(),
        "torch": torch.Generator().manual_seed(seed).get_state(),
    }  # fixed: the same bytes in every process
    for rank in range(run.plan.world_size):
        torch.save(rng, tag / f"rng-rank{rank}.pt")
    meta = {
        "step": step,
        "consumed_samples": consumed,
        "data": data,
        "model": asdict(run.model),
        "pp": 1,
        "tp": 1,
        "sp": 1,
        "zero_stage": 0,
        "dp": run.plan.dp,
        "world_size": run.plan.world_size,
        "run_spec": json.loads((run.path / SPEC_FILE).read_text()),
    }
    (tag / ckpt_tags.META_FILE).write_text(json.dumps(meta, indent=2))
    (run.checkpoint_dir / ckpt_tags.LATEST_FILE).write_text(tag.name)
    return tag


def meta_of(**fields):
    """A CheckpointMeta from the fields a test cares about: position 0, empty data and model, world size dp x pp x tp
    x sp unless given."""
    from dspipe.runtime.ckpt_meta import CheckpointMeta

    dims = {"dp": 1, "pp": 1, "tp": 1, "sp": 1, "zero_stage": 1, **fields}
    world = dims["dp"] * dims["pp"] * dims["tp"] * dims["sp"]
    return CheckpointMeta(**{"step": 0, "consumed_samples": 0, "data": {}, "model": {}, "world_size": world, **dims})


def edit_hf_config(directory, **edits) -> None:
    """Rewrite DIRECTORY/config.json with `edits` applied (a value of ... removes the key)."""
    path = Path(directory) / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in edits.items():
        if value is ...:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def save_hf_checkpoint(path, *, cls: str, config_cls: str, config: dict, seed: int, tokenizer_dir):
    """A random tiny transformers `cls` model (built from `config_cls(**config)` under `seed`) with its 1-d weights
    (norms, biases) moved off their initial ones and zeros, written by save_pretrained with the tokenizer files of
    `tokenizer_dir` beside it; returns the model transformers loads back from `path` (it computes what the files
    say)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, cls)(getattr(transformers, config_cls)(**config)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.2)
    model.save_pretrained(path)
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, Path(path) / f.name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    assert type(loaded).__name__ == cls
    return loaded


def perturb(model, seed=0):
    """Every weight moved by N(0, 0.05^2): non-trivial norms and biases (HF initialises them to 1 and 0), so a
    swapped or missed tensor cannot hide."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def bash_commands(path: Path) -> list[str]:
    """Every command line of the ```bash blocks of `path`, continuations joined."""
    commands, block, pending = [], False, ""
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            block, pending = line.strip() == "```bash" and not block, ""
            continue
        if not block:
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        if text and not text.startswith("#"):
            commands.append(text)
    return commands


GPU_ONLY = "# GPUs"  # a documented line whose comment starts so needs GPUs: no test runs it


def documented(page: Path, start: str) -> str:
    """The one command of `page`'s ```bash blocks (bash_commands) that starts with `start`, leaving out the lines
    marked GPU_ONLY and those with a placeholder (`...`): the line a test runs as written (run_documented)."""
    found = [c for c in bash_commands(page) if c.startswith(start) and GPU_ONLY not in c and "..." not in c]
    assert len(found) == 1, f"{page.relative_to(ROOT)}: one `{start}` line to run, found {found}"
    return found[0]


def run_documented(command: str, *, cwd: Path, env: dict | None = None, timeout: float = 900):
    """`command` as the docs show it, run by bash in `cwd` with this interpreter's `dspipe` and `deepspeed` first on
    PATH (as tests/distributed/test_docs_path.py runs the README's path); `env` adds to this process's environment."""
    bindir = Path(sys.executable).parent
    full = {**os.environ, **OFFLINE, **(env or {}), "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    assert shutil.which("dspipe", path=full["PATH"]), f"no dspipe in {bindir} (pip install -e .)"
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def deepspeed_one_rank():
    """This process as rank 0 of a 1-rank gloo world, through DeepSpeed's comm (a PipelineModule or an engine builds
    its groups there); the environment it set is put back after."""
    import deepspeed
    import torch.distributed as dist

    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in before.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
