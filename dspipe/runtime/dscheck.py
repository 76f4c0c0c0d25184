"""Parse a rendered config back through DeepSpeed's own config class (imports deepspeed)."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from unittest import mock


class _DataParallelView:
    """The one mpu method DeepSpeedConfig asks for: how many data-parallel ranks share the batch."""

    def __init__(self, dp: int):
        self._dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self._dp


def import_deepspeed_quietly() -> None:
    """Import deepspeed with its import-time output swallowed (it logs to stdout from import on, e.g. 'Setting
    accelerator to CPU'), its logger then writing to stderr: a command's stdout stays its own (launch --dry-run's
    commands, generate's text)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        import deepspeed  # noqa: F401  (a part of it may be imported already: its logger still writes to stdout)
        from deepspeed.utils import logger
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler.stream, _Stderr):
            handler.setStream(_Stderr())


class _Stderr:
    """Whatever sys.stderr is when a line is written (a test's capture replaces it and closes the old one)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def parse_with_deepspeed(ds_config: dict, *, dp: int):
    """DeepSpeedConfig as rank 0 of `dp` data-parallel ranks; raises whatever DeepSpeed raises."""
    import_deepspeed_quietly()
    import deepspeed.runtime.config as ds_config_module
    from deepspeed.runtime.config import DeepSpeedConfig

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    with mock.patch.object(ds_config_module.dist, "get_rank", return_value=0):
        return DeepSpeedConfig(dict(ds_config), mpu=_DataParallelView(dp))
