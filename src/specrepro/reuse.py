"""What a `specrepro reproduce` stage found already made: a complete run or artifact, cached target data, saved
batches, a training checkpoint. The stage's minutes then say less than what it costs from nothing cached, so
`reproduce` keeps an earlier measurement that reused nothing as the stage's estimate. Every process of the stage
appends one line per thing it reused to the file `SPECREPRO_REUSE_LOG` names (set by `reproduce` only)."""

from __future__ import annotations

import os

REUSE_LOG = "SPECREPRO_REUSE_LOG"


def note_reused(what: str) -> None:
    """Tell the `reproduce` stage this process runs in, if any, that `what` was already made."""
    path = os.environ.get(REUSE_LOG)
    if path:
        with open(path, "a") as log:  # one short append per line: lines of concurrent processes do not interleave
            log.write(f"{what}\n")
