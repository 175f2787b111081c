"""User-facing errors: the CLI prints them as one line and exits non-zero."""


def first_line(err: BaseException, limit: int = 200) -> str:
    """The first line of a library's error (at most ``limit`` characters), or its type when it
    has no text: what a one-line error message quotes of the cause."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else type(err).__name__


class PloraError(Exception):
    """A problem the user can fix; the message names the problem and the fix."""


class ConfigError(PloraError):
    """A sweep or search-space file is malformed or names something unknown."""


class DataError(PloraError):
    """A task's data cannot be found or read."""


class ModelError(PloraError):
    """A base model cannot be found, loaded or is of an unsupported family."""


class CheckpointError(PloraError):
    """A saved adapter checkpoint is unreadable or belongs to a different sweep."""
