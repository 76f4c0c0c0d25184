"""Put fully written outputs into place: readers see the old directory/file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, ContextManager, Iterator


def replace_dir(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`; an existing `out` is moved aside first and deleted once the new one is in place.
    If the new one cannot be put in place, the old one is moved back: `out` is never left missing or renamed.
    Callers decide whether `out` may be replaced at all (dspipe.outputs)."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(
    out: Path, *, tag: str = "", errors: Callable[[], ContextManager] = contextlib.nullcontext
) -> Iterator[Path]:
    """Yield a new temp directory (mode 0o755, named `.{out's name}.{tag}...`, beside `out`) for the block to fill;
    when the block ends, put it in place with replace_dir. If the block or the replace fails, the temp directory is
    removed and `out` is as it was. `errors` wraps the filesystem steps of its own (making the directory, putting it
    in place), not the block: e.g. outputs.write_errors for `out`."""
    dest = Path(os.path.abspath(out))
    with errors():
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.{tag}", dir=dest.parent))
    try:
        with errors():
            tmp.chmod(0o755)
        yield tmp
        with errors():
            replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_file(out: Path, data: str | bytes, *, mode: int = 0o644) -> None:
    """Write `data` to a sibling temp file, flush it to disk, then rename it over `out`; the temp file is removed
    if anything fails, so `out` is the old file or the new one."""
    out = Path(out)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
