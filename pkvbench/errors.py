"""The one exception type users can cause; the CLI turns it into a single line and exit code 2."""


class PkvError(Exception):
    """Bad input or a missing prerequisite: the message says what is wrong and what is valid."""


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (libraries' messages run long): enough for a one-line error."""
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:limit]
