"""The documentation site (mkdocs.yml, docs/) and the README: generated pages are current, the site builds with
`mkdocs build --strict`, and the commands the how-tos show work.

Which commands are run. Every ```bash block of README.md, docs/index.md and docs/howto/*.md is read line by line
(backslash continuations joined, `#` comments dropped); a command is run, in-process (`dspipe_here`) in a temporary
directory per page, in the page's order, and must exit 0 when it is

- `dspipe plan`, `dspipe gen-config` or `dspipe presets`: these plan and write files only, no GPU, no launch, no
  network; and
- not exempt by one of these rules:
  - it holds a placeholder: `...` or a word of three or more capitals (`runs/NAME`, `HF_DIR`, `PREFIX`);
  - it needs something only a real machine or an earlier launch gives: `--init-from` (a Hugging Face
    directory), `--profile` (a measured profile);
  - it is `gen-config` that writes nothing (no `--out`, no `--print-config`) or trains on data other than
    `data/stdlib` (another corpus, a blend, a Megatron prefix: their pages' own tests cover those readers).

The README's 5-minute path (prepare-data, the `deepspeed` launch on 2 CPU ranks, report, export-hf, generate; also
docs/index.md's) and the export-and-generate how-to are run as written, in order, by
tests/distributed/test_docs_path.py (a launch). The benchmark and calibrate how-tos' CPU lines (`bench --compare`,
`calibrate`, `calibrate --from-run`) are run as written (tests.helpers.documented and run_documented) by
tests/distributed/test_bench.py, tests/unit/planner/test_calibration.py and tests/unit/tools/test_plan_word.py. What
none of these runs needs a GPU (a line whose comment starts `# GPUs`, tests.helpers.GPU_ONLY; docker), the network
(hub names and tokenizers), several machines (`launch --hostfile`, `doctor`, `sbatch`) or a measured profile. The
directory each page runs in holds what its commands read: `data/stdlib` (a small corpus prepared once by `dspipe
prepare-data`), `examples/` (the repository's) and `hosts` (the two-node hostfile the multi-node page shows).
`> FILE` writes the command's stdout to FILE.
"""

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, bash_commands, dspipe_here

RUN = ("plan", "gen-config", "presets")
PLACEHOLDER = re.compile(r"\.\.\.|(?<![A-Za-z])[A-Z][A-Z_]{2,}(?![A-Za-z])")
NEEDS_MACHINE = ("--init-from", "--profile")
PAGES = [ROOT / "README.md", ROOT / "docs" / "index.md", *sorted((ROOT / "docs" / "howto").glob("*.md"))]


def runnable(command: str) -> list[str] | None:
    """The argv after `dspipe` of a command the docstring's rule runs, or None."""
    try:
        argv = shlex.split(command, comments=True)
    except ValueError:
        return None
    if len(argv) < 2 or argv[0] != "dspipe" or argv[1] not in RUN:
        return None
    if PLACEHOLDER.search(" ".join(argv)) or any(a in NEEDS_MACHINE for a in argv):
        return None
    if argv[1] == "gen-config":
        if "--out" not in argv and "--print-config" not in argv:
            return None
        if "--data" in argv and argv[argv.index("--data") + 1] != "data/stdlib":
            return None
    return argv[1:]


def cases():
    for page in PAGES:
        for command in bash_commands(page):
            argv = runnable(command)
            if argv is not None:
                yield pytest.param(page, argv, id=f"{page.relative_to(ROOT)}: {' '.join(argv)[:60]}")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """data/stdlib: a small corpus prepared by dspipe itself (a 1,024-token BPE, like the demo's but smaller), its
    validation split large enough for the documented runs' validation batches (gpt3-1.3b on 16 GPUs)."""
    import random

    root = tmp_path_factory.mktemp("docs-data")
    corpus = root / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    for k in range(32):
        (corpus / f"doc{k:02d}.txt").write_text(" ".join(rng.choice(vocab) for _ in range(6000)) + "\n")
    r = dspipe_here(
        "prepare-data",
        str(corpus),
        "--train-tokenizer",
        "1024",
        "--workers",
        "1",
        "--val-fraction",
        "0.5",
        "--out",
        str(root / "data" / "stdlib"),
        cwd=root,
    )
    assert r.returncode == 0, r.stderr
    return root / "data"


@pytest.fixture(scope="module")
def page_dirs(tmp_path_factory, prepared):
    made = {}

    def get(page: Path) -> Path:
        if page not in made:
            d = tmp_path_factory.mktemp(page.stem)
            (d / "data").symlink_to(prepared, target_is_directory=True)
            (d / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
            (d / "hosts").write_text("node-1 slots=8\nnode-2 slots=8\n")
            made[page] = d
        return made[page]

    return get


def test_the_rule_finds_the_commands_it_should():
    found = [argv for _, argv in (c.values for c in cases())]
    assert any(a[0] == "plan" for a in found) and any(a[0] == "gen-config" for a in found)
    assert runnable("dspipe launch runs/1b --hostfile hosts --dry-run") is None
    assert runnable("dspipe export-hf runs/NAME --out models/NAME") is None
    assert runnable("dspipe gen-config --model gpt2-125m --data /corpora/pile --out runs/pile ...") is None
    assert runnable("dspipe plan --model tiny  # a comment") == ["plan", "--model", "tiny"]


@pytest.mark.xdist_group("documented-commands")  # a page's commands in its order, in one worker (--dist loadgroup)
@pytest.mark.parametrize("page,argv", list(cases()))
def test_documented_command_runs(page, argv, page_dirs):
    cwd = page_dirs(page)
    out = None
    if ">" in argv:
        at = argv.index(">")
        argv, out = argv[:at], argv[at + 1]
    r = dspipe_here(*argv, cwd=cwd)
    assert r.returncode == 0, f"{page.relative_to(ROOT)}: dspipe {shlex.join(argv)}\n{r.stderr}"
    if out:
        (cwd / out).write_text(r.stdout)


def test_options_reference_is_generated_from_the_commands():
    r = subprocess.run(
        [sys.executable, "scripts/docs_reference.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")]
    assert [p for p in pages if f": {p}\n" not in nav] == []


def test_readme_is_short_and_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    head = "\n".join(text.splitlines()[:12])
    assert "bash scripts/demo.sh" in head and "bash scripts/setup.sh && bash scripts/test.sh" in head


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material are not installed (pip install -e .[test])",
)
def test_mkdocs_build_strict(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", **__import__("os").environ},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "index.html").is_file()
