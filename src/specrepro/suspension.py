"""Notice that the process was suspended (Ctrl-Z, `kill -STOP`, a scheduler suspending a job) while a decode
was timed: a stopped process gets SIGCONT when it resumes, so a count of SIGCONTs that changed over a timed
region means its wall time includes the pause, and the runner times that turn again."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

_resumes = 0


def resumes() -> int:
    """How many times the process was resumed (SIGCONT) while `watching()`."""
    return _resumes


def _count_resume(signum, frame) -> None:
    global _resumes
    _resumes += 1


@contextmanager
def watching():
    """Count resumes while the block runs. Only the main thread can handle signals: elsewhere nothing is
    counted, and timings are taken as they come."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGCONT, _count_resume)
    try:
        yield
    finally:
        signal.signal(signal.SIGCONT, previous)
