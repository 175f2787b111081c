"""User-facing errors: the CLI prints them as one line and exits non-zero."""

import errno
import os


def first_line(err: BaseException, limit: int = 200) -> str:
    """The first line of a library's error (at most ``limit`` characters), or its type when it
    has no text: what a one-line error message quotes of the cause."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else type(err).__name__


def disk_full(err: BaseException) -> str | None:
    """What says that ``err`` or an exception it came from is a full disk, or None: an OSError,
    SQLite's message, or the OS's words in a writer's own error (torch.save, safetensors)."""
    no_space = os.strerror(errno.ENOSPC)
    seen: BaseException | None = err
    while seen is not None:
        if (isinstance(seen, OSError) and seen.errno == errno.ENOSPC) or no_space in str(seen):
            return no_space
        if "disk is full" in str(seen):
            return "database or disk is full"
        seen = seen.__cause__ or seen.__context__
    return None


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
