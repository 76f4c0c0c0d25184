"""Golden outputs (written before issue 27's refactor, kept since): what gen-config writes for every shipped example
config and for every third-party DeepSpeed JSON it accepts, and `--print-config`. A change that alters any of them
is a behaviour change and must say so by regenerating them:
    DSPIPE_REGENERATE_GOLDEN=1 python -m pytest tests/unit/test_golden.py
Runs in-process (click's runner): one file per case under tests/data/golden/.

What a golden holds is what the case is about: ds_config.json byte for byte (every DeepSpeed value is explicit), and
dspipe.json, config.yaml and --print-config without the values at their declared defaults (a spec field's dataclass
default, a Plan field's, an option's click default), so a new setting with a default touches its declaration and
the code that uses it, not every golden. The omission compares with declarations, never with another run's output:
a change to what every run computes still changes every golden."""

import json
import os
from dataclasses import MISSING, fields

import pytest
import yaml
from click.testing import CliRunner

from dspipe.cli.app import cli
from dspipe.cli.config_file import command_params, file_value
from dspipe.errors import SpecError
from dspipe.planner.plan import Plan
from dspipe.spec.core import SPECS
from tests.helpers import ROOT


def _declared(cls) -> dict:
    """field -> default (tuples as the JSON lists they are written as) of a dataclass's defaulted fields."""

    def plain(value):
        return list(value) if isinstance(value, tuple) else value

    return {f.name: plain(f.default) for f in fields(cls) if f.default is not MISSING}


PLAN_DEFAULTS = _declared(Plan)
JSON_DEFAULTS = {
    **{section: _declared(cls) for cls, section in SPECS},
    "plan": PLAN_DEFAULTS,
    "estimate": PLAN_DEFAULTS,
}  # the estimate repeats the plan's fields
"""dspipe.json's sections -> the declared defaults of their fields."""
YAML_DEFAULTS = {
    key: file_value(param, param.default) for key, param in command_params(cli.commands["gen-config"]).items()
}
"""config.yaml / --print-config key -> its value when neither a file nor a flag sets it."""


def without_defaults(name: str, text: str) -> str:
    """The golden view of one written file: dspipe.json and the YAML files without the values at their defaults,
    anything else unchanged."""
    if name == "dspipe.json":
        doc = json.loads(text)
        for section, defaults in JSON_DEFAULTS.items():
            body = doc.get(section)
            if isinstance(body, dict):
                doc[section] = {k: v for k, v in body.items() if k not in defaults or v != defaults[k]}
        return json.dumps(doc, indent=2) + "\n"
    if name.endswith(".yaml"):
        doc = yaml.safe_load(text) or {}
        doc = {
            section: {k: v for k, v in body.items() if k not in YAML_DEFAULTS or v != YAML_DEFAULTS[k]}
            for section, body in doc.items()
        }
        return yaml.safe_dump({s: b for s, b in doc.items() if b}, sort_keys=False, width=120)
    return text


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
    """The run files gen-config wrote (their golden view), with the output path made neutral, as one text."""
    parts = [
        f"== {f}\n" + without_defaults(f, (out / f).read_text()).replace(str(out), "<OUT>")
        for f in WRITTEN
        if (out / f).exists()
    ]
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
    check(f"examples/{example.stem}.print-config.yaml", without_defaults("print-config.yaml", text))


@pytest.mark.parametrize("preset", THIRD_PARTY, ids=[p.stem for p in THIRD_PARTY])
def test_third_party_presets_import_as_before(preset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    code, text = invoke(
        "gen-config", "--model", "gpt2-124m", "--data", "none", "--preset", preset, "--out", out, out=out
    )
    # the preset's absolute path appears in the output and in config.yaml: neutral, so the golden holds on any checkout
    check(f"third_party/{preset.stem}.txt", f"exit {code}\n{text}\n{written(out)}".replace(str(preset), "<PRESET>"))
