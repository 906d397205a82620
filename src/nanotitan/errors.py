"""Errors that end a run with one line instead of a traceback (ConfigError, for bad input, lives in config.py)."""


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a non-finite step with train.on_nonfinite=stop). Raised on every rank alike,
    after they agreed on it, so none is left inside a collective; the CLI prints it as one line and exits 1."""
