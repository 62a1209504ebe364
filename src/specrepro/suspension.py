"""Keep a pause of the process (Ctrl-Z, `kill -STOP`, a scheduler suspending a job) out of the harness's timings.

Decoding: a stopped process gets SIGCONT when it resumes, so a count of SIGCONTs that changed over a timed
region means its wall time includes the pause, and the runner times that turn again (`watching`, `resumes`).
Training and data generation are too long to redo: their minutes come from `clock()`, which stands still while
the whole process stood still (a heartbeat thread beats every `BEAT` seconds; a gap of more than `STALL` is a
pause).
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager

BEAT, STALL = 0.5, 5.0  # seconds between heartbeats; a longer gap than STALL counts as a pause
_resumes = 0
_paused = 0.0
_seen = 0.0  # when the process was last seen running
_paused_lock = threading.Lock()
_heart: threading.Thread | None = None


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


def _observe() -> float:
    """`clock()`'s reading now, first noting the gap since the process was last seen running as a pause when it
    exceeds STALL (by whichever of the heartbeat and `clock()` runs first after a resume)."""
    global _paused, _seen
    with _paused_lock:
        now = time.perf_counter()
        if now - _seen > STALL:  # every thread stood still: the process was stopped
            _paused += now - _seen - BEAT
        _seen = now
        return now - _paused


def _beat() -> None:
    while True:
        time.sleep(BEAT)
        _observe()


def clock() -> float:
    """Seconds, as `time.perf_counter()`, less the pauses of the process since the first call."""
    global _heart, _seen
    if _heart is None or not _heart.is_alive():  # also in a forked child, where the thread did not survive
        _seen = time.perf_counter()
        _heart = threading.Thread(target=_beat, name="specrepro-heartbeat", daemon=True)
        _heart.start()
    return _observe()
