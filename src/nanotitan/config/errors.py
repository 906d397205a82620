"""Errors that end a run with one line instead of a traceback, each kind with its own exit code
(docs/reliability.md). A leaf, as config.py (which re-exports ConfigError) and parse.py import it.

    exit 1  TrainingError    the run cannot go on (a non-finite step under train.on_nonfinite=stop)
    exit 2  ConfigError      bad input: config, data, layout, a run/cache/output dir that cannot be written
    exit 3  CheckpointError  a checkpoint cannot be trusted or does not fit this model
    exit 4  StorageError     a write failed or cannot fit: disk full, quota, permission, read-only file system
"""

EXIT_CODES = {"training": 1, "config": 2, "checkpoint": 3, "storage": 4}  # by `kind`
LABELS = {"training": "", "config": "config error: ", "checkpoint": "checkpoint error: ", "storage": "storage error: "}


class ConfigError(ValueError):
    """Bad user input: one line naming the field and the fix; exit 2."""


def check(ok: bool, line: str) -> None:
    """Raise the one-line ConfigError `line` unless `ok`: every config rule's check (config.py and the axes' rules)."""
    if not ok:
        raise ConfigError(line)


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a non-finite step with train.on_nonfinite=stop). Raised on every rank alike,
    after they agreed on it, so none is left inside a collective; the CLI prints it as one line and exits 1."""
    kind = "training"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be trusted (damaged, incomplete) or does not fit this model: one line naming the file
    (or tensor) and the way out; exit 3. Not a ConfigError: the config may be fine, the files are not."""
    kind = "checkpoint"


class StorageError(RuntimeError):
    """A file could not be written, or will not fit (disk full, quota, permission, read-only file system): one
    line with what failed, where, the free space and the newest good checkpoint kept; exit 4. A later
    `--train.resume auto` continues from that checkpoint."""
    kind = "storage"


def first_line(e: BaseException) -> str:
    """An exception as one line for a user: its type and the first line of its message ("OSError: disk full")."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def os_reason(e: OSError) -> str:
    """An OSError as a user reads it: "No space left on device (ENOSPC)", the errno's name being what one searches."""
    import errno

    name = errno.errorcode.get(e.errno or 0, "")
    return f"{e.strerror or first_line(e)}{f' ({name})' if name else ''}"
