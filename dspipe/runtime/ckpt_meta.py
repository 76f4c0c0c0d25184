"""A checkpoint's dspipe.json: CheckpointMeta, read (read_meta, validated) and written (write_meta) here only, what
a launch saves (checkpoint_meta), and the resume's checks against the run (check_compatible). Imports no torch."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from dspipe.errors import SpecError
from dspipe.jsonio import read_object, show
from dspipe.rundir import SPEC_FILE
from dspipe.runtime.ckpt_tags import META_FILE, write_atomic
from dspipe.runtime.experts import expert_parallel
from dspipe.runtime.reshard import layout_change_refusal
from dspipe.spec.core import from_dict
from dspipe.spec.kinds import Axis
from dspipe.spec.model import ModelSpec
from dspipe.spec.values import DATA_ORDERS, ZERO_STAGES

CHECKPOINT_KEYS = ("step", "consumed_samples", "data", "model", "pp", "zero_stage", "dp", "world_size")
"""What a checkpoint's dspipe.json must hold (checkpoint_meta writes them, with run_spec)."""


META_KEYS = (
    "step",
    "consumed_samples",
    "data",
    "model",
    "pp",
    "tp",
    "sp",
    "zero_stage",
    "dp",
    "ep",
    "world_size",
    "run_spec",
    "save_interval",
    "save",
)
"""dspipe.json's keys in the order checkpoints are written."""
OPTIONAL_KEYS = ("run_spec", "save_interval", "save")
"""Written when set, absent in older checkpoints."""
SAVE_KEYS = ("mode", "completed_after_step", "blocking_s", "write_s", "writer_cpu_s", "rank_max_bytes", "bytes")
"""dspipe.json's "save" keys in the order checkpoints are written (all of them, since the record was added)."""
SAVE_MODES = ("sync", "async")
"""A save's mode: written in the step, or by the rank's background writer (dspipe.runtime.async_save)."""


@dataclass(frozen=True)
class SaveRecord:
    """A checkpoint's save figures (dspipe.json's "save", dspipe.runtime.checkpoint.complete's, every rank's
    slowest): read and validated by from_dict, written by to_dict, in SAVE_KEYS order; the on-disk format is the one
    checkpoints have always had."""

    mode: str
    """SAVE_MODES: "sync" (written in the step) or "async" (by the rank's background writer)."""
    completed_after_step: int
    """The last step done when every rank's files were written."""
    blocking_s: float
    """Seconds the step waited for the save (a background save: its host copy), the slowest rank's."""
    write_s: float
    """Seconds the files took to write, the slowest rank's (a synchronous save: blocking_s)."""
    writer_cpu_s: float
    """CPU seconds of a rank's background writer, the most of any rank (a synchronous save: 0)."""
    rank_max_bytes: int
    """The bytes of the rank whose background writer wrote the most (a synchronous save: 0, not counted)."""
    bytes: int | None
    """The checkpoint's bytes on rank 0's disk (None on the other ranks: rank 0 writes the record)."""

    def to_dict(self) -> dict:
        """The JSON object of dspipe.json's "save": every field, in SAVE_KEYS order."""
        return {key: getattr(self, key) for key in SAVE_KEYS}

    @classmethod
    def from_dict(cls, save, *, source: Path | str) -> SaveRecord:
        """The record validated: a mode of SAVE_MODES, counts >= 0, seconds finite and >= 0, bytes >= 0 or null;
        anything else is one SpecError naming `source` and the key. Keys it does not know are ignored. The values
        are kept as read (an integral number of seconds stays an int), so to_dict writes them back unchanged."""
        if not isinstance(save, dict):
            raise SpecError(f"{source}: save must be an object (the save's figures), got {type(save).__name__}")
        missing = [f"save.{k}" for k in SAVE_KEYS if k not in save]
        if missing:
            raise SpecError(f"{source}: missing {', '.join(missing)}")
        if save["mode"] not in SAVE_MODES:
            raise SpecError(f"{source}: save.mode {show(save['mode'])} is not one of: {', '.join(SAVE_MODES)}")
        for key in ("completed_after_step", "rank_max_bytes", "bytes"):
            value = save[key]
            if value is None and key == "bytes":  # counted on rank 0's disk only
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SpecError(f"{source}: save.{key} must be an integer >= 0, got {show(value)}")
        for key in ("blocking_s", "write_s", "writer_cpu_s"):
            value = save[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise SpecError(f"{source}: save.{key} must be a number >= 0, got {show(value)}")
        return cls(**{key: save[key] for key in SAVE_KEYS})


@dataclass(frozen=True)
class CheckpointMeta:
    """A checkpoint's dspipe.json (its complete mark): read and validated by from_dict (read_meta), written by
    to_json (write_meta), in this key order; the on-disk format is the one checkpoints have always had."""

    step: int
    consumed_samples: int
    data: dict
    """The loader's position (its state_dict; a blend's holds its sources)."""
    model: dict
    """The model's shape as saved (asdict of its ModelSpec then; keys added since are absent): see `spec`."""
    pp: int
    zero_stage: int
    dp: int
    world_size: int
    tp: int = 1
    sp: int = 1
    ep: int = 1
    """tp, sp, ep: absent in checkpoints saved before tensor/sequence/expert parallelism: 1."""
    run_spec: dict | None = None
    """The run's whole resolved spec (the run directory's dspipe.json)."""
    save_interval: int | None = None
    """The interval in force when saved (absent before --save-interval auto re-planned)."""
    save: SaveRecord | None = None
    """The save's figures (dspipe.runtime.checkpoint.complete), absent in checkpoints saved before they were
    recorded: None."""

    @property
    def layout(self) -> tuple[int, int, int]:
        """(dp, tp, pp) the checkpoint was saved with."""
        return self.dp, self.tp, self.pp

    @property
    def dims(self) -> dict:
        """{dp, tp, pp, sp, ep}: its layout for layout_text."""
        return {Axis.DP: self.dp, Axis.TP: self.tp, Axis.PP: self.pp, Axis.SP: self.sp, Axis.EP: self.ep}

    @property
    def spec(self) -> ModelSpec:
        """The saved model shape as a ModelSpec (keys added since: their defaults)."""
        return from_dict(ModelSpec, self.model)

    def with_save(self, figures: SaveRecord) -> CheckpointMeta:
        return replace(self, save=figures)

    def to_dict(self) -> dict:
        """The JSON object of dspipe.json: every field in META_KEYS order; run_spec, save_interval and save when
        set."""
        out = {key: getattr(self, key) for key in META_KEYS}
        if self.save is not None:
            out["save"] = self.save.to_dict()
        return {key: value for key, value in out.items() if value is not None or key not in OPTIONAL_KEYS}

    def to_json(self) -> str:
        """dspipe.json's text (a non-finite value: ValueError)."""
        return json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, meta: dict, *, source: Path | str) -> CheckpointMeta:
        """The keys and types every reader uses (step, position, data state, model shape, pp, ZeRO stage, dp x pp x
        tp x sp = world size), validated; anything else is one SpecError naming `source` and the field. Keys it
        does not know are ignored."""
        meta = dict(meta)

        def count(key: str, value, low: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise SpecError(f"{source}: {key} must be an integer >= {low}, got {show(value)}")

        missing = [k for k in CHECKPOINT_KEYS if k not in meta]
        if missing:
            raise SpecError(f"{source}: missing key {', '.join(missing)}")
        for key, low in (("step", 0), ("consumed_samples", 0), ("pp", 1), ("dp", 1), ("world_size", 1)):
            count(key, meta[key], low)
        if meta["zero_stage"] not in ZERO_STAGES or isinstance(meta["zero_stage"], bool):
            raise SpecError(
                f"{source}: zero_stage {show(meta['zero_stage'])} is not one of: {', '.join(map(str, ZERO_STAGES))}"
            )
        if "save_interval" in meta:  # absent before --save-interval auto re-planned
            count("save_interval", meta["save_interval"], 0)
        # tp, sp, ep: absent in checkpoints saved before tensor/sequence/expert parallelism: 1
        for key in (Axis.TP, Axis.SP, Axis.EP):
            count(key, meta.setdefault(key, 1), 1)
        ranks = meta["dp"] * meta["pp"] * meta["tp"] * meta["sp"]
        if ranks != meta["world_size"]:
            raise SpecError(
                f"{source}: dp {meta['dp']} x pp {meta['pp']} x tp {meta['tp']} x sp {meta['sp']} = "
                f"{ranks} != world_size {meta['world_size']}"
            )
        try:
            model = from_dict(ModelSpec, meta["model"])
        except (SpecError, TypeError) as e:
            raise SpecError(f"{source}: model: {e}") from None
        if meta["pp"] > model.layers:
            raise SpecError(f"{source}: pp {meta['pp']} > model.layers {model.layers}")
        _check_data(source, meta["data"], consumed=meta["consumed_samples"], count=count)
        if "run_spec" in meta and not isinstance(meta["run_spec"], dict):
            raise SpecError(f"{source}: run_spec must be an object, got {type(meta['run_spec']).__name__}")
        if meta.get("save") is not None:  # absent in checkpoints saved before the save's figures were recorded
            meta["save"] = SaveRecord.from_dict(meta["save"], source=source)
        return cls(**{key: meta[key] for key in META_KEYS if key in meta})


def read_meta(path: Path) -> CheckpointMeta:
    """A checkpoint's dspipe.json, validated (CheckpointMeta.from_dict): one SpecError naming the file and field."""
    source = Path(path) / META_FILE
    return CheckpointMeta.from_dict(read_object(source), source=source)


def write_meta(path: Path, meta: CheckpointMeta) -> None:
    """Write checkpoint directory `path`'s dspipe.json atomically (its complete mark)."""
    write_atomic(Path(path) / META_FILE, meta.to_json())


def _check_data(source: Path | str, data, *, consumed: int, count) -> None:
    """A checkpoint's data position (the loader's state_dict, a blend's or one directory's) as CheckpointMeta.from_dict
    checks it; `count` checks an integer field."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: data must be an object (the loader's position), got {type(data).__name__}")
    blend = "sources" in data  # a blend of data directories (dspipe.data.blend.BlendLoader.state_dict)
    counts = (("consumed_samples", 0), ("seed", 0), ("seq_len", 1), *(() if blend else (("num_samples", 1),)))
    for key, low in counts:
        if key not in data:
            raise SpecError(f"{source}: missing data.{key}")
        count(f"data.{key}", data[key], low)
    for key in ("split", *(() if blend else ("fingerprint",))):
        if not isinstance(data.get(key), str):
            raise SpecError(f"{source}: data.{key} must be a string, got {show(data.get(key))}")
    if data.get("order", "dspipe") not in DATA_ORDERS:  # absent before --data-order: dspipe's
        raise SpecError(f"{source}: data.order {show(data.get('order'))} is not one of: {', '.join(DATA_ORDERS)}")
    if blend:
        _check_blend_state(source, data, count)
    if data["consumed_samples"] != consumed:
        raise SpecError(f"{source}: data.consumed_samples {data['consumed_samples']} != consumed_samples {consumed}")


def _check_blend_state(source: Path, data: dict, count) -> None:
    """data.sources of a blend: two or more objects with path, fingerprint, num_samples, weight (in (0, 1], summing
    to 1), drawn and epoch (= drawn // num_samples); the drawn samples add up to data.consumed_samples and each is
    within 1 of weight x consumed_samples, as the blend's rule keeps them (Megatron's max-error rule, data.order
    megatron: within the number of sources; it reaches 1.8 for 8 skewed weights)."""
    import math

    sources = data["sources"]
    if not isinstance(sources, list) or len(sources) < 2:
        raise SpecError(f"{source}: data.sources must be a list of two or more blend sources, got {show(sources)}")
    total_weight, drawn, consumed = 0.0, 0, data["consumed_samples"]
    slack = len(sources) if data.get("order") == "megatron" else 1
    for i, s in enumerate(sources):
        at = f"data.sources[{i}]"
        if not isinstance(s, dict):
            raise SpecError(f"{source}: {at} must be an object, got {type(s).__name__}")
        for key in ("path", "fingerprint"):
            if not isinstance(s.get(key), str) or not s[key]:
                raise SpecError(f"{source}: {at}.{key} must be a non-empty string, got {show(s.get(key))}")
        for key, low in (("num_samples", 1), ("drawn", 0), ("epoch", 0)):
            if key not in s:
                raise SpecError(f"{source}: missing {at}.{key}")
            count(f"{at}.{key}", s[key], low)
        w = s.get("weight")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and 0 < w <= 1):
            raise SpecError(f"{source}: {at}.weight must be a number in (0, 1], got {show(w)}")
        if s["epoch"] != s["drawn"] // s["num_samples"]:
            raise SpecError(
                f"{source}: {at}.epoch {s['epoch']} != drawn {s['drawn']} // num_samples {s['num_samples']}"
            )
        if abs(s["drawn"] - w * consumed) > slack:
            raise SpecError(
                f"{source}: {at}.drawn {s['drawn']} is not the blend's share of data.consumed_samples "
                f"{consumed} at weight {w!r}"
            )
        total_weight += w
        drawn += s["drawn"]
    if abs(total_weight - 1) > 1e-9:
        raise SpecError(f"{source}: data.sources weights sum to {total_weight!r}, not 1")
    if drawn != consumed:
        raise SpecError(f"{source}: data.sources drawn {drawn} in all != data.consumed_samples {consumed}")


def model_diff(meta: CheckpointMeta, model: ModelSpec) -> list[str]:
    """'key saved -> now' for every field (but the name) where the checkpoint's model differs from `model` (keys
    added since the save: their defaults)."""
    saved, now = asdict(meta.spec), asdict(model)
    return [f"{k} {saved.get(k)} -> {now[k]}" for k in now if k != "name" and saved.get(k) != now[k]]


def check_compatible(meta: CheckpointMeta, run, path: Path) -> None:
    """Refuse a checkpoint whose model shape or ZeRO stage differ from this run's, or whose layout (dp, tp, pp,
    sp) differs where DeepSpeed cannot re-partition the state (layout_change_refusal)."""
    diff = model_diff(meta, run.model)
    if diff:
        raise SpecError(f"checkpoint {path} holds a different model shape: {', '.join(diff)}")
    if meta.zero_stage != run.plan.zero_stage:
        raise SpecError(
            f"checkpoint {path} was saved with zero_stage {meta.zero_stage}, this run has zero_stage "
            f"{run.plan.zero_stage}; resume with the same zero_stage"
        )
    ep = expert_parallel(run) if run.model.experts else 1
    plan = run.plan
    why = layout_change_refusal(
        meta=meta,
        zero_stage=plan.zero_stage,
        dp=plan.dp,
        tp=plan.tp,
        pp=plan.pp,
        sp=plan.sp,
        ep=ep,
        offload=plan.offload,
        path=path,
    )
    if why:
        saved_layout = layout_text(meta.dims)
        now_layout = layout_text({Axis.DP: plan.dp, Axis.TP: plan.tp, Axis.PP: plan.pp, Axis.SP: plan.sp, Axis.EP: ep})
        raise SpecError(
            f"checkpoint {path} was saved with {saved_layout}, this run has {now_layout}: {why}; resume "
            f"with {saved_layout} (world size "
            f"{meta.dp * meta.pp * meta.tp * meta.sp})"
        )


def layout_text(layout: dict) -> str:
    """'dp 2' or 'dp 1 x tp 2 x pp 2': the data-parallel size and every other dimension that is not 1 (tp/sp/ep
    absent: 1, checkpoints from before tensor/sequence/expert parallelism)."""
    axes = (Axis.TP, Axis.PP, Axis.SP, Axis.EP)
    parts = [f"dp {layout[Axis.DP]}"] + [f"{k} {layout.get(k, 1)}" for k in axes if layout.get(k, 1) > 1]
    return " x ".join(parts)


def checkpoint_meta(run, *, step: int, loader, world: int, save_interval: int | None = None) -> CheckpointMeta:
    """What dspipe.json in a checkpoint holds: position, data state, the shape it was saved with, and the run's
    whole resolved spec (the run directory's dspipe.json: model, cluster, train, strategy, plan, data)."""
    return CheckpointMeta(
        step=step,
        consumed_samples=loader.consumed_samples,
        data=loader.state_dict(),
        model=asdict(run.model),
        pp=run.plan.pp,
        tp=run.plan.tp,
        sp=run.plan.sp,
        zero_stage=run.plan.zero_stage,
        dp=run.plan.dp,
        ep=expert_parallel(run),
        world_size=world,
        run_spec=json.loads((run.path / SPEC_FILE).read_text()),
        save_interval=save_interval,
    )
