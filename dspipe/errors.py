"""The one error type users see: a one-line message, exit code 2."""

import errno
import os
import stat


class SpecError(ValueError):
    """Bad user input. The message is one line and shows the numbers involved."""

    exit_code = 2


class RunHalted(RuntimeError):
    """A run that stopped itself (e.g. too many non-finite steps in a row) after saving; one line, exit code 3."""

    exit_code = 3


def cannot_read(path, error: OSError, *, tail: str = "") -> SpecError:
    """`PATH: cannot read it (Input/output error)`: the one line for a file that exists but fails to read."""
    return SpecError(f"{path}: cannot read it ({error.strerror or error}){tail}")


def file_problem(path) -> str | None:
    """Why `path` cannot be read as a file ('does not exist', 'is a directory, not a file', 'is a symlink loop',
    'is a broken symlink (to X)', 'is not a regular file'), or None when it is a regular file (through any links)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symlink loop"
        if os.path.islink(path):
            return f"is a broken symlink (to {os.readlink(path)})"
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return "does not exist"
        return f"cannot be read ({e.strerror or e})"
    if stat.S_ISDIR(mode):
        return "is a directory, not a file"
    return None if stat.S_ISREG(mode) else "is not a regular file"
