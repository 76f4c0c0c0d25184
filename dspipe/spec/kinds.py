"""The option values dspipe compares against, as str Enums: a member equals its plain string (Precision.BF16 ==
"bf16"), so specs and plans keep holding plain strings and every file written (JSON, YAML, templates) stays the
same text. Python 3.10 has no enum.StrEnum: `str, Enum` with __str__ giving the value. Imports nothing of dspipe."""

from __future__ import annotations

from enum import Enum


class _Kind(str, Enum):
    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Precision(_Kind):
    """train.precision: the training dtype (dspipe.spec.values.PRECISIONS)."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


class Offload(_Kind):
    """strategy.offload: where ZeRO offloads the optimizer state (and, with offload_params, the parameters); also
    DeepSpeed's offload_optimizer/offload_param device (dspipe.spec.values.OFFLOADS)."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


class Checkpointing(_Kind):
    """strategy.checkpointing: activation recomputation (dspipe.spec.values.CHECKPOINTING)."""

    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


class BuildMode(_Kind):
    """How a rank of a layout builds its model (dspipe.planner.startup.build_mode): the whole model on its device
    (tp shards included), ZeRO-3's partitions, or its pipeline stage."""

    DEVICE = "device"
    PARTITIONED = "partitioned"
    STAGE = "stage"


class Axis(_Kind):
    """The parallel axes a layout has: the names written in dspipe.json, engine.json and a checkpoint's meta
    (data, pipeline, tensor, sequence and expert parallel)."""

    DP = "dp"
    PP = "pp"
    TP = "tp"
    SP = "sp"
    EP = "ep"
