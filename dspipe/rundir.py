"""A run directory: resolved specs, plan and DeepSpeed JSON, written whole or not at all. No torch."""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from dspipe.atomic import replace_dir
from dspipe.errors import SpecError
from dspipe.planner.plan import Plan
from dspipe.planner.spec import ClusterSpec, ModelSpec, StrategySpec, TrainSpec, from_dict

FORMAT_VERSION = 1
SPEC_FILE = "dspipe.json"
DS_CONFIG_FILE = "ds_config.json"
ENGINE_FILE = "engine.json"  # the live engine's settings, written by the runner's rank 0
VAL_FILE = "val_metrics.csv"  # validation rows (dspipe.metrics.VAL_COLUMNS)


@dataclass(frozen=True)
class Run:
    """Everything a run directory holds, as read back."""

    path: Path
    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    strategy: StrategySpec
    plan: Plan
    data: str
    """Prepared token directory the run trains on."""

    @property
    def ds_config_path(self) -> Path:
        return self.path / DS_CONFIG_FILE

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.csv"

    @property
    def val_metrics_path(self) -> Path:
        return self.path / VAL_FILE

    @property
    def engine_path(self) -> Path:
        return self.path / ENGINE_FILE


def write_run(out: Path, *, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, strategy: StrategySpec,
              plan: Plan, data: str, ds_config: dict, command: str, estimate: dict, force: bool = False) -> None:
    """Write into a sibling temp dir, then rename: a failure never leaves a half-written run directory."""
    out = Path(out)
    if out.exists() and not force:
        raise SpecError(f"run directory {out} already exists (pass --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    spec = {"format_version": FORMAT_VERSION, "model": asdict(model), "cluster": asdict(cluster),
            "train": asdict(train), "strategy": asdict(strategy), "plan": asdict(plan), "estimate": estimate, "data": data,
            "command": command}
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)
    try:
        (tmp / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")
        (tmp / DS_CONFIG_FILE).write_text(json.dumps(ds_config, indent=2) + "\n")
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_run(path: str | Path) -> Run:
    path = Path(path)
    spec_file = path / SPEC_FILE
    if not spec_file.is_file() or not (path / DS_CONFIG_FILE).is_file():
        raise SpecError(f"{path} is not a run directory (no {SPEC_FILE} / {DS_CONFIG_FILE}); "
                        f"create one with 'dspipe gen-config --out {path}'")
    d = json.loads(spec_file.read_text())
    if d.get("format_version") != FORMAT_VERSION:
        raise SpecError(f"{spec_file}: format_version {d.get('format_version')} != {FORMAT_VERSION}")
    return Run(path=path, model=from_dict(ModelSpec, d["model"]), cluster=from_dict(ClusterSpec, d["cluster"]),
               train=from_dict(TrainSpec, d["train"]), strategy=from_dict(StrategySpec, d["strategy"]),
               plan=from_dict(Plan, d["plan"]), data=d["data"])
