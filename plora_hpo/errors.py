"""User-facing errors: the CLI prints them as one line and exits non-zero."""


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
