"""Diagnostics (notes, warnings, errors, progress) go through `logging`, under the "dspipe" logger; a command's result
(tables, JSON, the paths it wrote) goes to stdout with click.echo.

Rank-aware: in a job of many ranks a diagnostic is one line per job, not one per rank. setup_logging installs one
handler on stderr that writes the message as it is (one line, no level or time prefix: the messages already say
`dspipe: ...` or `note: ...` where they should) from rank 0 only; DSPIPE_LOG_ALL_RANKS=1 lets every rank write, each
line prefixed with `[rank N]`. A record logged with extra={"all_ranks": True} (something only that rank knows, e.g.
its own failure) is written by whichever rank logs it, with the prefix. Standard library only: the planning modules
import this without torch.
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "dspipe"
ALL_RANKS_ENV = "DSPIPE_LOG_ALL_RANKS"
RANK_ENV = "RANK"


def get_logger(name: str | None = None) -> logging.Logger:
    """The logger `name` under the "dspipe" namespace (a module's __name__ is already in it; None: "dspipe")."""
    if not any(isinstance(h, _StderrHandler) for h in logging.getLogger(ROOT).handlers):
        setup_logging()  # a diagnostic reaches stderr even where no entry point set logging up (a library call)
    if not name or name == ROOT or name.startswith(ROOT + "."):
        return logging.getLogger(name or ROOT)
    return logging.getLogger(f"{ROOT}.{name}")


def _env_rank(env) -> int:
    text = env.get(RANK_ENV, "").strip()
    return int(text) if text.isdigit() else 0


class _RankFilter(logging.Filter):
    """Rank 0 writes; other ranks only with all_ranks (the env var or the record's own extra), prefixed."""

    def __init__(self, rank: int, all_ranks: bool):
        super().__init__()
        self.rank, self.all_ranks = rank, all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        every = self.all_ranks or getattr(record, "all_ranks", False)
        record.rank_prefix = f"[rank {self.rank}] " if every else ""
        return self.rank == 0 or every


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever sys.stderr is when a record is written (pytest's capsys, click's CliRunner and
    redirect_stderr swap it after set-up)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ / setStream assign it: always the current sys.stderr
        pass


def setup_logging(*, rank: int | None = None, level: int | str = logging.INFO, env=None) -> logging.Logger:
    """Configure the "dspipe" logger: one handler on stderr, format `[rank N] message` (the prefix only where every
    rank writes), the rank filter above. `rank` defaults to the RANK environment variable (0 where unset), so the CLI
    and each runner rank call it alike. Calling it again replaces the handler (never two lines per record)."""
    env = os.environ if env is None else env
    rank = _env_rank(env) if rank is None else rank
    all_ranks = env.get(ALL_RANKS_ENV, "").strip() == "1"
    logger = logging.getLogger(ROOT)
    for h in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(h)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(rank_prefix)s%(message)s"))
    handler.addFilter(_RankFilter(rank, all_ranks))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # a root handler someone else configured would print each line twice
    return logger
