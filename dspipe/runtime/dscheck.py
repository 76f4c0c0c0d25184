"""Parse a rendered config back through DeepSpeed's own config class (imports deepspeed)."""

from __future__ import annotations

import logging
from unittest import mock


class _DataParallelView:
    """The one mpu method DeepSpeedConfig asks for: how many data-parallel ranks share the batch."""

    def __init__(self, dp: int):
        self._dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self._dp


def parse_with_deepspeed(ds_config: dict, *, dp: int):
    """DeepSpeedConfig as rank 0 of `dp` data-parallel ranks; raises whatever DeepSpeed raises."""
    import deepspeed.runtime.config as ds_config_module
    from deepspeed.runtime.config import DeepSpeedConfig

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    with mock.patch.object(ds_config_module.dist, "get_rank", return_value=0):
        return DeepSpeedConfig(dict(ds_config), mpu=_DataParallelView(dp))
