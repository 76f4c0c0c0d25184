"""Golden outputs (written before issue 27's refactor, kept since): what gen-config writes for every shipped example
config and for every third-party DeepSpeed JSON it accepts, and `--print-config`, byte for byte. A change that
alters any of them is a behaviour change and must say so by regenerating them:
    DSPIPE_REGENERATE_GOLDEN=1 python -m pytest tests/unit/test_golden.py
Runs in-process (click's runner): one file per case under tests/data/golden/."""
import os
import json

import pytest
from click.testing import CliRunner

from dspipe.cli.app import cli
from dspipe.errors import SpecError
from tests.helpers import ROOT

GOLDEN = ROOT / "tests" / "data" / "golden"
EXAMPLES = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
THIRD_PARTY = sorted((ROOT / "tests" / "data" / "third_party_ds_configs").glob("*.json"))
WRITTEN = ("ds_config.json", "dspipe.json", "config.yaml")


def invoke(*args, out):
    """(exit code, output); a refusal (dspipe's own error, shown by main as one line) as 'error: ...'."""
    r = CliRunner().invoke(cli, [str(a) for a in args])
    text = r.output
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        assert isinstance(r.exception, SpecError), r.exception
        text += f"error: {r.exception}\n"
    return r.exit_code, text.replace(str(out), "<OUT>")


def check(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("DSPIPE_REGENERATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: DSPIPE_REGENERATE_GOLDEN=1 writes it"
    assert text == path.read_text(), name


def written(out) -> str:
    """The run files gen-config wrote, with the output path made neutral, as one text."""
    parts = [f"== {f}\n" + (out / f).read_text().replace(str(out), "<OUT>") for f in WRITTEN if (out / f).exists()]
    return "\n".join(parts)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_configs_render_as_before(example, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    code, _ = invoke("gen-config", "--config", example, "--out", out, out=out)
    assert code == 0
    check(f"examples/{example.stem}.txt", written(out))
    code, text = invoke("gen-config", "--config", example, "--print-config", out=out)
    assert code == 0
    check(f"examples/{example.stem}.print-config.yaml", text)


@pytest.mark.parametrize("preset", THIRD_PARTY, ids=[p.stem for p in THIRD_PARTY])
def test_third_party_presets_import_as_before(preset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    code, text = invoke("gen-config", "--model", "gpt2-124m", "--data", "none", "--preset", preset, "--out", out,
                        out=out)
    # the preset's absolute path appears in the output and in config.yaml: neutral, so the golden holds on any checkout
    check(f"third_party/{preset.stem}.txt", f"exit {code}\n{text}\n{written(out)}".replace(str(preset), "<PRESET>"))
