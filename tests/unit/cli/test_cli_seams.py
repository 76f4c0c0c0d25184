"""The CLI's seams: option defaults come from the spec dataclasses, dspipe.cli modules import no app.py (no cycle),
and gen-config and bench write their run directory through the same prepare-run function."""

import ast
import json
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import dspipe.cli
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.model import ModelSpec
from dspipe.spec.strategy import StrategySpec
from dspipe.spec.train import TrainSpec

CLI_DIR = Path(dspipe.cli.__file__).resolve().parent
SPECS = (ModelSpec, ClusterSpec, TrainSpec, StrategySpec)
ALIASES = {"warmup": "warmup_steps"}  # option name -> spec field where the two differ
DEFAULTED = {f.name: f.default for cls in SPECS for f in fields(cls) if f.default is not MISSING}
ALL_FIELDS = {f.name for cls in SPECS for f in fields(cls)}
CPU2 = [
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
    "20",
]


def _commands() -> dict[str, click.Command]:
    from dspipe.cli.app import cli

    return {name: cli.commands[name] for name in ("gen-config", "plan", "bench")}


def _spec_options(command: click.Command):
    for param in command.params:
        if isinstance(param, click.Option):
            field = ALIASES.get(param.name, param.name)
            if field in ALL_FIELDS:
                yield param, field


@pytest.mark.parametrize("name", ["gen-config", "plan", "bench"])
def test_spec_option_defaults_are_the_dataclass_defaults_or_auto(name):
    from dspipe.cli.bench import BENCH_OPTIONS

    own = BENCH_OPTIONS if name == "bench" else {}
    checked, wrong = set(), []
    for param, field in _spec_options(_commands()[name]):
        if param.name in own:  # bench's --steps/--warmup count benchmark steps, not the run's
            if param.default != own[param.name][0]:
                wrong.append(f"--{param.name} {param.default!r} != bench's {own[param.name][0]!r}")
            continue
        if field in DEFAULTED:
            checked.add(field)
            if param.default is not None and param.default != DEFAULTED[field]:
                wrong.append(f"--{param.name} {param.default!r} != {field} {DEFAULTED[field]!r}")
    assert wrong == []
    # the options that had their own copy of a default are among those checked, and are not left to auto
    for field in ("lr", "min_lr_ratio", "weight_decay", "grad_clip", "seed", "log_interval", "spike_sigma"):
        assert field in checked
        param = next(p for p, f in _spec_options(_commands()[name]) if f == field)
        assert param.default == DEFAULTED[field] and type(param.default) is type(DEFAULTED[field]), field
    checked |= {ALIASES.get(n, n) for n in own}
    assert {"warmup_steps", "dropout", "host_memory_gib", "partition_method", "nvme_path"} <= checked


def test_derived_warmup_is_said_once_in_the_help_and_is_used_when_not_given():
    from dspipe.cli.options import WARMUP_HELP, default_warmup, request_from_options

    assert "steps/10, at least 1, at most 2000" in WARMUP_HELP
    assert [default_warmup(s) for s in (1, 5, 10, 1000, 19_999, 10**6)] == [1, 1, 1, 100, 1999, 2000]
    for name in ("gen-config", "plan"):
        warmup = next(p for p in _commands()[name].params if p.name == "warmup")
        assert warmup.default is None and warmup.help == WARMUP_HELP
    ctx = _commands()["plan"].make_context("plan", [*CPU2, "--steps", "50"])
    with ctx:
        _, _, train, _ = request_from_options(ctx.params)
    assert train.warmup_steps == 5
    assert (train.lr, train.weight_decay, train.grad_clip, train.min_lr_ratio) == tuple(
        DEFAULTED[k] for k in ("lr", "weight_decay", "grad_clip", "min_lr_ratio")
    )


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of the modules `path` imports (relative imports resolved against dspipe.cli)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = ["dspipe", "cli"][: max(0, 3 - node.level)]
                base = ".".join([*package, *([node.module] if node.module else [])])
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)  # `from dspipe.cli import app`
    return names


def _cli_modules() -> dict[str, Path]:
    return {f"dspipe.cli.{p.stem}" if p.stem != "__init__" else "dspipe.cli": p for p in CLI_DIR.glob("*.py")}


def test_no_cli_module_imports_app_and_there_is_no_cycle():
    modules = _cli_modules()
    assert {"dspipe.cli.app", "dspipe.cli.options", "dspipe.cli.prepare_run", "dspipe.cli.bench"} <= set(modules)
    offenders = [
        name
        for name, path in modules.items()
        if name not in ("dspipe.cli", "dspipe.cli.__main__", "dspipe.cli.app")
        and "dspipe.cli.app" in _imported_modules(path)
    ]
    assert offenders == []
    graph = {
        name: {m for m in _imported_modules(path) if m in modules and m not in (name, "dspipe.cli")}
        for name, path in modules.items()
    }
    done, stack = set(), []

    def visit(node):
        assert node not in stack, f"import cycle: {' -> '.join(stack[stack.index(node) :] + [node])}"
        if node in done:
            return
        stack.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        stack.pop()
        done.add(node)

    for name in sorted(graph):
        visit(name)
    assert not any("dspipe.cli.app" in deps for name, deps in graph.items() if name != "dspipe.cli.app")


@pytest.mark.parametrize(
    "module",
    [
        "dspipe.cli.bench",
        "dspipe.cli.options",
        "dspipe.cli.prepare_run",
        "dspipe.cli.launch",
        "dspipe.cli.data",
        "dspipe.cli.app",
    ],
)
def test_each_cli_module_imports_first_and_alone_without_torch(module):
    code = (
        f"import sys, {module}; bad = [m for m in ('torch', 'deepspeed', 'dspipe.cli.app') "
        f"if m in sys.modules and m != {module!r}]; print(bad); sys.exit(bool(bad))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


class _Recorder:
    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, out, **kw):
        result = self.real(out, **kw)
        self.calls.append((Path(out), kw, sorted(p.name for p in Path(out).iterdir())))
        return result


def test_gen_config_and_bench_write_the_run_through_the_same_function(tmp_path, monkeypatch):
    import dspipe.cli.app as app
    import dspipe.cli.bench as bench_cli
    import dspipe.cli.prepare_run as prepare
    import dspipe.tools.bench as bench_tools

    assert app.prepare_run is bench_cli.prepare_run is prepare.prepare_run
    recorder = _Recorder(prepare.prepare_run)
    monkeypatch.setattr(app, "prepare_run", recorder)
    monkeypatch.setattr(bench_cli, "prepare_run", recorder)
    monkeypatch.chdir(tmp_path)

    r = CliRunner().invoke(app.cli, ["gen-config", *CPU2, "--zero", "1", "--out", "runs/a"])
    assert r.exit_code == 0, r.output
    out, kw, files = recorder.calls[-1]
    assert out == Path("runs/a") and files == ["config.yaml", "ds_config.json", "dspipe.json"]
    assert kw["data"] == "data/stdlib"
    spec = json.loads((tmp_path / "runs/a/dspipe.json").read_text())
    assert spec["train"]["lr"] == DEFAULTED["lr"] and spec["train"]["warmup_steps"] == 2  # 20 steps / 10
    assert f"wrote {Path('runs/a') / 'ds_config.json'} and" in r.output

    class Stop(Exception):
        pass

    def stop(**kw):
        raise Stop(kw["run_dir"])

    monkeypatch.setattr(bench_tools, "run_side", stop)  # the run dir is written; start no ranks
    r = CliRunner().invoke(app.cli, ["bench", "--model", "tiny", "--gpu", "cpu", "--global-batch", "8"])
    assert isinstance(r.exception, Stop), r.output
    out, kw, files = recorder.calls[-1]
    assert len(recorder.calls) == 2 and out == r.exception.args[0] and out.name == "run"
    assert files == ["ds_config.json", "dspipe.json"] and kw["data"] == "synthetic"
    assert kw["best"].train.steps == 3 + 10  # bench's warm-up + measured steps
