"""The import structure: the planner wing runs without torch or deepspeed, and dspipe's import graph has no cycle."""

import ast
import os
import subprocess
import sys
import textwrap

from tests.helpers import ROOT

PACKAGE = ROOT / "dspipe"

PLANNER_WING = textwrap.dedent("""
    import importlib, pkgutil, sys

    import dspipe.planner
    modules = [m.name for m in pkgutil.walk_packages(dspipe.planner.__path__, "dspipe.planner.")]
    assert len(modules) >= 5, modules
    for name in [*modules, "dspipe.rundir", "dspipe.cli.app"]:
        importlib.import_module(name)

    # the planning commands themselves, in this process
    from dspipe.cli.app import main
    cpu2 = ["--model", "tiny", "--gpu", "cpu", "--gpus-per-node", "2", "--global-batch", "16", "--micro-batch", "4"]
    for argv in (["plan", *cpu2], ["plan", *cpu2, "--json", "--tokens", "1B"], ["plan", "--model", "gpt3-13b"],
                 ["presets"]):
        try:
            main(argv)
        except SystemExit as e:
            assert not e.code, (argv, e.code)

    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "deepspeed"))
    print("LOADED:", loaded[:20])
    sys.exit(1 if loaded else 0)
""")

# gen-config parses the rendered config with DeepSpeedConfig where deepspeed is installed; without torch and deepspeed
# it still writes the run directory (with a note)
WITHOUT_TORCH = textwrap.dedent("""
    import sys
    from pathlib import Path

    class Absent:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "deepspeed"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, Absent())
    from dspipe.cli.app import main
    from dspipe.rundir import load_run

    run = Path(sys.argv[1])
    try:
        main(["gen-config", "--model", "tiny", "--gpu", "cpu", "--gpus-per-node", "2",
              "--data", str(run.parent / "data"), "--out", str(run)])
    except SystemExit as e:
        assert not e.code, e.code
    load_run(run)
    assert not [m for m in sys.modules if m.split(".")[0] in ("torch", "deepspeed")]
""")


def python(code, *args, cwd):
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_the_planner_wing_imports_neither_torch_nor_deepspeed(tmp_path):
    r = python(PLANNER_WING, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "LOADED: []" in r.stdout


def test_gen_config_works_where_torch_and_deepspeed_are_absent(tmp_path):
    r = python(WITHOUT_TORCH, tmp_path / "run", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "note: deepspeed is not installed; the config was not parsed by DeepSpeedConfig" in r.stderr
    assert (tmp_path / "run" / "ds_config.json").is_file() and (tmp_path / "run" / "dspipe.json").is_file()


def test_the_checkpoint_writer_process_starts_without_deepspeed(tmp_path):
    """The spawned writer (async_save.writer_process) imports its module and the rank's main module (run.py, whose
    imports wait for __main__): neither pulls in DeepSpeed, whose import would compete with the ranks' start-up."""
    code = (
        "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__mp_main__'); "
        "import dspipe.runtime.async_save; "
        "print('LOADED:', sorted(m for m in sys.modules if m.startswith('deepspeed')))"
    )
    r = python(code, ROOT / "run.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "LOADED: []" in r.stdout


def module_name(path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the dspipe modules it imports, at module level or inside functions (`from dspipe.x import y` counts
    as an import of dspipe.x.y where that is a module, else of dspipe.x)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    packages = {module_name(p) for p in PACKAGE.rglob("__init__.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        here = name if name in packages else name.rpartition(".")[0]  # the package relative imports start from
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # `import dspipe.x.y.z` of a name inside a module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a path a -> ... -> a."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)

    cycles = []
    for component in components:
        start = min(component)
        parents, frontier = {start: None}, [start]  # breadth-first inside the component back to `start`
        while frontier:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w == start:
                        path = [v]
                        while parents[path[-1]] is not None:
                            path.append(parents[path[-1]])
                        cycles.append([*reversed(path), start])
                        nxt = []
                        break
                    if w not in parents:
                        parents[w] = v
                        nxt.append(w)
                else:
                    continue
                break
            frontier = nxt
    return cycles


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_sees_function_level_and_submodule_imports():
    graph = import_graph()
    assert "dspipe.spec.model" in graph["dspipe.planner.plan"]
    assert "dspipe.planner.summary" in graph["dspipe.cli.app"]  # also imported inside plan_command


def test_the_import_graph_has_no_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def test_layers_import_downward_only():
    """runtime/ and model/ import neither tools/ nor cli/; spec/ (the vocabulary) imports none of the layers above."""
    rules = {
        ("dspipe.runtime", "dspipe.model"): ("dspipe.tools", "dspipe.cli"),
        ("dspipe.spec",): ("dspipe.planner", "dspipe.model", "dspipe.runtime", "dspipe.tools", "dspipe.cli"),
    }
    inside = lambda name, packages: any(name == p or name.startswith(p + ".") for p in packages)  # noqa: E731
    wrong = [
        f"{module} -> {target}"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        for sources, banned in rules.items()
        if inside(module, sources) and inside(target, banned)
    ]
    assert not wrong, "imports against the layers:\n  " + "\n  ".join(wrong)
