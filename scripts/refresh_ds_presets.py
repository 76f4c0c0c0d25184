"""Re-render every ds_configs/NAME.json from ds_configs/recipes.json: the reference model/cluster + the preset's flags,
then the keys recipes.json leaves to the run set to "auto" (dspipe.planner.render.shipped_preset)."""

import json
import shutil
import tempfile
from pathlib import Path

from dspipe.cli.app import main
from dspipe.jsonio import dumps
from dspipe.planner.render import shipped_preset

ROOT = Path(__file__).resolve().parent.parent
recipes = json.loads((ROOT / "ds_configs" / "recipes.json").read_text())
for name, flags in recipes["presets"].items():
    with tempfile.TemporaryDirectory() as tmp:
        try:
            main(
                [
                    "gen-config",
                    *recipes["reference"],
                    *flags,
                    "--out",
                    f"runs/{name}",
                    "--force",
                    "--data",
                    str(Path(tmp) / "none"),
                ]
            )
        except SystemExit as e:
            if e.code:
                raise
        rendered = json.loads(Path(f"runs/{name}/ds_config.json").read_text())
        (ROOT / "ds_configs" / f"{name}.json").write_text(
            dumps(shipped_preset(name, rendered), what=f"ds_configs/{name}.json")
        )
        shutil.rmtree(f"runs/{name}")
