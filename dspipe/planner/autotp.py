"""The tensor_parallel.partition_config layer specs the rendered DeepSpeed JSON carries for the record: dspipe's
Megatron-layout split (dspipe.model.tp_split, which the planner's per-rank counts, the runtime's layers and export
share) in DeepSpeed AutoTP's terms. DeepSpeed's own AutoTP stays off (autotp_size 0 at every tp, planner/ds_schema.py):
these specs are inert. Imports no torch."""

from __future__ import annotations

from dspipe.model.tp_split import _ANY, DOWN, fused_parts
from dspipe.spec.model import ModelSpec

QK_NORM = _ANY + r"attn\.[qk]_norm\.weight$"


def layer_specs(model: ModelSpec) -> list[dict[str, object]]:
    """DeepSpeed TPLayerSpec dicts (tensor_parallel.partition_config.layer_specs) for `model`'s blocks: the split
    in DeepSpeed's AutoTP terms (q/k/v and gate/up as parts, whole heads per rank; q/k norms replicated with their
    gradients summed over the tp group)."""
    out: list[dict[str, object]] = []
    for pattern, parts in fused_parts(model).items():
        spec: dict[str, object] = {"patterns": [pattern], "partition_type": "column"}
        if len(parts) > 1:
            spec["shape"] = [len(parts) if len(set(parts)) == 1 else parts, -1]
            spec["partition_dim"] = 0
        out.append(spec)
    out.append({"patterns": list(DOWN), "partition_type": "row"})
    if model.qk_norm:
        out.append({"patterns": [QK_NORM], "partition_type": "skip", "grad_allreduce": True})
    return out


def partition_config(model: ModelSpec) -> dict[str, object]:
    """tensor_parallel.partition_config for `model`: only these specs, none of DeepSpeed's model presets (inert
    while autotp_size is 0)."""
    return {"use_default_specs": False, "layer_specs": layer_specs(model)}
