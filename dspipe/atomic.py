"""Swap a fully written temp directory into place: readers see the old directory or the new one, never half."""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def replace_dir(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`; an existing `out` is moved aside first and deleted once the new one is in place."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old)
    else:
        os.rename(tmp, out)
