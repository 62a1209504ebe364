"""File locks: one job makes a thing (an artifact, a cache, a shared file) while another that needs it waits.

Kept free of torch and accelerate, so that the commands that only read records (`table`, `compare`, `summary`,
`reproduce` between its stages) start in a second or two; a training launch's processes share a lock through
`training.shards.exclusive`.
"""

from __future__ import annotations

import fcntl
import logging
from contextlib import contextmanager
from pathlib import Path

from specrepro.errors import SpecReproError

log = logging.getLogger(__name__)


def lock_file(path: Path) -> Path:
    """The lock of `path` (a cache, an artifact, a file): a hidden file beside it."""
    return path.with_name(f".{path.name}.lock")


@contextmanager
def file_lock(lock_path: Path, what: str):
    """Hold `lock_path` while making `what`: a second job that needs the same one waits here, then finds it made
    (jobs of a parallel sweep, a `specrepro train` beside a `reproduce`)."""
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock_path, "a")
    except OSError as exc:
        raise SpecReproError(f"cannot write to {lock_path.parent}: {exc.strerror or exc}") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another job to finish %s", what)
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, or when that job's process dies
        yield
