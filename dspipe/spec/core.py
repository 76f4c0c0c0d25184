"""The four specs together: SPECS, their settings, LIMITS, StrategyRequest and from_dict.

The specs themselves are dspipe.spec.model (ModelSpec), .cluster (ClusterSpec), .train (TrainSpec) and .strategy
(StrategySpec): plain frozen dataclasses, validated on construction. No torch, no deepspeed.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from typing import TYPE_CHECKING, TypeVar

from dspipe.errors import SpecError
from dspipe.spec.cluster import ClusterSpec
from dspipe.spec.model import ModelSpec
from dspipe.spec.settings import declared
from dspipe.spec.strategy import StrategySpec
from dspipe.spec.train import TrainSpec

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

SPECS = ((ModelSpec, "model"), (ClusterSpec, "cluster"), (TrainSpec, "train"), (StrategySpec, "strategy"))
"""Each spec and its --config section (a field may name another: precision and micro_batch are in strategy)."""
SPEC_SETTINGS = tuple(s for cls, section in SPECS for s in declared(cls, section=section))
"""Every setting declared on a spec field, in declaration order."""
LIMITS = {s.field: s.limit for s in SPEC_SETTINGS if s.limit is not None}
"""Largest accepted value per field, from its setting: beyond them a size is absurd (or overflows what DeepSpeed,
torch or numpy accept: seeds feed numpy's and torch's generators, which take 0..2**32-1 everywhere dspipe derives
streams)."""


def _requested(section: str) -> list[tuple[str, str, object]]:
    """(field, type or None, default None) for every spec field the `section` of the --config file holds."""
    types = {f.name: str(f.type) for cls, _ in SPECS for f in fields(cls)}  # str already: postponed annotations
    optional = {name: t if t.endswith("| None") else f"{t} | None" for name, t in types.items()}
    return [
        (s.field, optional[s.field], field(default=None))
        for s in SPEC_SETTINGS
        if s.section == section and s.field is not None
    ]  # every spec setting has a field


if TYPE_CHECKING:

    @dataclass(frozen=True, kw_only=True)
    class StrategyRequest:
        """What the type checker sees of the class make_dataclass builds below (a unit test keeps them equal)."""

        micro_batch: int | None = None
        precision: str | None = None
        zero: int | None = None
        offload: str | None = None
        offload_params: bool | None = None
        nvme_path: str | None = None
        pp: int | None = None
        tp: int | None = None
        tp_sp: bool | None = None
        immediate_grad_update: bool | None = None
        sp: int | None = None
        ep: int | None = None
        checkpointing: str | None = None
        recompute_blocks: int | None = None
        loss_chunk: int | None = None
        partition_method: str | None = None
        reduce_bucket_size: int | None = None
        prefetch_bucket_size: int | None = None
        param_persistence_threshold: int | None = None
        max_live_parameters: int | None = None
        max_reuse_distance: int | None = None
else:
    StrategyRequest = make_dataclass("StrategyRequest", _requested("strategy"), frozen=True, kw_only=True)
StrategyRequest.__doc__ = """The strategy as asked for: each field of the strategy section (StrategySpec's, and
TrainSpec's micro_batch and precision), a value, or None to let the search choose (or take the spec's default)."""


_Spec = TypeVar("_Spec", bound="DataclassInstance")


def from_dict(cls: type[_Spec], data: object) -> _Spec:
    """Rebuild a spec from its asdict() form, rejecting unknown keys, missing required ones (a field with a default
    takes it: a checkpoint's model from before the field existed) and anything that is not an object."""
    if not isinstance(data, dict):
        raise SpecError(f"{cls.__name__} must be a JSON object, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise SpecError(f"unknown {cls.__name__} keys: {', '.join(sorted(map(str, unknown)))}")
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        raise SpecError(f"missing {cls.__name__} keys: {', '.join(missing)}")
    return cls(**data)
