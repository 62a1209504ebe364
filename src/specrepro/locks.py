"""File locks: one job makes a thing (a run, an artifact, a cache, a shared file) while another that needs it waits.

Kept free of torch and accelerate, so that the commands that only read records (`table`, `compare`, `summary`,
`reproduce` between its stages) start in a second or two; a training launch's processes share a lock through
`training.shards.exclusive`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from contextlib import ExitStack, contextmanager
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


@contextmanager
def run_lock(run_dir: Path):
    """An exclusive lock on `<run dir>/.lock`: a second job that needs the same run waits, then finds it done.
    None in a finished run's directory that cannot be written (archived records), which can only be reused."""
    lock_path = run_dir / ".lock"
    while True:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            handle = open(lock_path, "a")
        except OSError as exc:
            if (run_dir / "metrics.json").is_file():  # read-only records: no job writes here, reusing needs no lock
                yield
                return
            raise SpecReproError(f"cannot write the run record to {run_dir}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another job to finish run %s", run_dir.name)
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, or when a killed job's process dies
        if lock_path.exists() and os.stat(lock_path).st_ino == os.fstat(handle.fileno()).st_ino:
            break
        handle.close()  # the holder removed the directory of a failed run: lock the new one
    with handle:
        try:
            yield
        finally:
            if [p.name for p in run_dir.iterdir()] == [".lock"]:  # failed before recording anything
                shutil.rmtree(run_dir, ignore_errors=True)


@contextmanager
def all_free(lock_paths):
    """Hold every lock of `lock_paths` if no other process holds one of them: True inside; else False, holding none
    (a job that uses what they guard is running: leave it alone)."""
    with ExitStack() as held:
        for lock_path in lock_paths:
            handle = held.enter_context(open(lock_path, "a"))
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.close()
                yield False
                return
        yield True
