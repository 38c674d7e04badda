"""The errors that end a run with a documented exit code (`launch.py` maps them to codes).

Kept free of torch so that `launch` can name them before anything heavy is imported: a bad config or
`--print-config` answers in about a second. `ConfigError` lives with the schema (`config/file.py`).
"""


class DataError(ValueError):
    """The data section of a config points at data that cannot be used; the message is one line (exit 2)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or was saved for another model (exit 2)."""


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient norm; the message is one line (exit 3)."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written: no space, no permission, an I/O error, on any rank (exit 4)."""
