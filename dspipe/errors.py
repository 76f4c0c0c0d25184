"""The one error type users see: a one-line message, exit code 2."""


class SpecError(ValueError):
    """Bad user input. The message is one line and shows the numbers involved."""

    exit_code = 2
