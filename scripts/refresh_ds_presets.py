"""Re-render every ds_configs/NAME.json from ds_configs/recipes.json (reference model/cluster + the preset's flags)."""
import json
import shutil
import tempfile
from pathlib import Path

from dspipe.cli.app import main

ROOT = Path(__file__).resolve().parent.parent
recipes = json.loads((ROOT / "ds_configs" / "recipes.json").read_text())
for name, flags in recipes["presets"].items():
    with tempfile.TemporaryDirectory() as tmp:
        try:
            main(["gen-config", *recipes["reference"], *flags, "--out", f"runs/{name}", "--force",
                  "--data", str(Path(tmp) / "none")])
        except SystemExit as e:
            if e.code:
                raise
        shutil.move(f"runs/{name}/ds_config.json", ROOT / "ds_configs" / f"{name}.json")
        shutil.rmtree(f"runs/{name}")
