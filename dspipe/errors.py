"""The one error type users see: a one-line message, exit code 2."""


class SpecError(ValueError):
    """Bad user input. The message is one line and shows the numbers involved."""

    exit_code = 2


class RunHalted(RuntimeError):
    """A run that stopped itself (e.g. too many non-finite steps in a row) after saving; one line, exit code 3."""

    exit_code = 3


def cannot_read(path, error: OSError, *, tail: str = "") -> SpecError:
    """`PATH: cannot read it (Input/output error)`: the one line for a file that exists but fails to read."""
    return SpecError(f"{path}: cannot read it ({error.strerror or error}){tail}")
