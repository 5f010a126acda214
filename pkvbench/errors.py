"""The one exception type users can cause; the CLI turns it into a single line and exit code 2."""


class PkvError(Exception):
    """Bad input or a missing prerequisite: the message says what is wrong and what is valid."""
