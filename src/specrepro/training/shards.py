"""Data generation split over the processes of an `accelerate launch` / torchrun (one process: plain loop).

The target's batches are dealt round-robin to the processes, each process runs its own, and every process gets
all results back in batch order. A batch is the same list of items whatever the number of processes, so the
merged result (and the dataset a trainer caches from it) is the one a single process computes. The main process
alone writes a cache (`write_once`); the others wait for it.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from accelerate import PartialState
from accelerate.utils import gather_object
from tqdm import tqdm

Item, Result = TypeVar("Item"), TypeVar("Result")


def map_batches(batches: list[Item], fn: Callable[[Item], list[Result]], desc: str) -> list[Result]:
    """`fn(batch)` (a list of results) of every batch, this process running every N-th; the concatenated
    results of all batches, in batch order, in every process."""
    state = PartialState()
    mine = range(state.process_index, len(batches), state.num_processes)
    done = [(index, fn(batches[index])) for index in tqdm(mine, desc=desc, unit="batch",
                                                         disable=not state.is_main_process)]
    if state.num_processes > 1:
        done = gather_object(done)
    return [result for _, results in sorted(done, key=lambda pair: pair[0]) for result in results]


def write_once(write: Callable[[], None]) -> None:
    """Run `write` (an atomic cache write) in the main process only; every process returns once it is done."""
    state = PartialState()
    if state.is_main_process:
        write()
    state.wait_for_everyone()
