"""Data generation split over the processes of an `accelerate launch` / torchrun (one process: plain loop).

The target's batches are dealt round-robin to the processes, each process runs its own, and every process gets
all results back in batch order. A batch is the same list of items whatever the number of processes, so the
merged result (and the dataset a trainer caches from it) is the one a single process computes. The main process
alone writes a cache (`write_once`); the others wait for it.

Each finished batch can be kept on disk (`saved_in`), so a generation killed after an hour resumes at the batch it
was on instead of starting over; a batch is saved atomically with a hash of its items, and loaded only for the same
items (a generation resumed with another batch size makes its batches again).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, TypeVar

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from tqdm import tqdm

from specrepro import suspension
from specrepro.locks import file_lock, lock_file
from specrepro.reuse import note_reused

Item, Result = TypeVar("Item"), TypeVar("Result")
BATCHES_SUFFIX = ".batches"  # a folder of saved batches


def map_batches(
    batches: list[Item], fn: Callable[[Item], list[Result]], desc: str, saved_in: Path | None = None
) -> tuple[list[Result], float]:
    """`fn(batch)` (a list of results) of every batch, this process running every N-th; the concatenated
    results of all batches, in batch order, in every process. With `saved_in`, each batch's results are saved
    there as it finishes and a saved batch is loaded instead of run again. Also returns the seconds this
    process's loaded batches took when they ran (a cost counts them, training/cost.py)."""
    state = PartialState()
    mine = range(state.process_index, len(batches), state.num_processes)
    done, earlier_seconds, loaded = [], 0.0, 0
    for index in tqdm(mine, desc=desc, unit="batch", disable=not state.is_main_process):
        path = Path(saved_in) / f"{index:06d}.pt" if saved_in is not None else None
        items = batch_digest(batches[index])
        if path is not None and path.is_file():
            saved = torch.load(path, weights_only=True)
            if saved.get("items") == items:  # else saved from other items (another batch size): made again
                done.append((index, saved["results"]))
                earlier_seconds += saved["seconds"]
                loaded += 1
                continue
        clock = suspension.clock()
        results = fn(batches[index])
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            torch.save({"results": results, "seconds": suspension.clock() - clock, "items": items}, partial)
            os.replace(partial, path)
        done.append((index, results))
    if loaded:
        note_reused(f"{loaded} saved batches of {desc}")
    if state.num_processes > 1:
        done = gather_object(done)
    return [result for _, results in sorted(done, key=lambda pair: pair[0]) for result in results], earlier_seconds


def batch_digest(batch) -> str:
    """A hash of a batch's items (indices, token ids, rows of them): a saved batch is loaded only for the same."""
    return hashlib.sha256(json.dumps(batch, sort_keys=True, default=repr).encode()).hexdigest()


def write_once(write: Callable[[], None]) -> None:
    """Run `write` (an atomic cache write) in the main process only; every process returns once it is done."""
    state = PartialState()
    if state.is_main_process:
        write()
    state.wait_for_everyone()


@contextmanager
def exclusive(lock_path: Path, what: str):
    """`file_lock` for every process of a launch: the main process holds the lock, the others wait for it."""
    state = PartialState()
    with file_lock(lock_path, what) if state.is_main_process else nullcontext():
        state.wait_for_everyone()
        yield


@contextmanager
def making_cache(cache_dir: Path, what: str):
    """While a job makes (or loads) the cache `cache_dir`: no other job makes it (`exclusive`), and the folder its
    finished batches are saved in (`map_batches`' `saved_in`), dropped once the cache is made."""
    saved = cache_dir.with_name(f".{cache_dir.name}{BATCHES_SUFFIX}")
    with exclusive(lock_file(cache_dir), what):
        yield saved
        if PartialState().is_main_process:
            shutil.rmtree(saved, ignore_errors=True)
