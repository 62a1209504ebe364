"""Data generation resumes at the batch a kill interrupted (training/shards.py), and its cost counts the batches
that ran before the kill; one job at a time makes a cache or an artifact."""

import threading
import time

import pytest
import torch

from specrepro.training.loop import clear_checkpoints
from specrepro.locks import lock_file
from specrepro.training.shards import exclusive, map_batches


class Killed(Exception):
    pass


def test_a_killed_generation_resumes_at_its_batch(tmp_path):
    batches = [[0, 1], [2, 3], [4, 5], [6]]
    ran = []

    def square(batch, die_at=None):
        if batch == die_at:
            raise Killed
        ran.append(batch)
        return [torch.tensor([x * x]) for x in batch]

    saved = tmp_path / ".hidden-abc.batches"
    with pytest.raises(Killed):
        map_batches(batches, lambda b: square(b, die_at=[4, 5]), "squares", saved)
    assert sorted(p.name for p in saved.iterdir()) == ["000000.pt", "000001.pt"]  # nothing half-written

    ran.clear()
    results, earlier_seconds = map_batches(batches, square, "squares", saved)
    assert ran == [[4, 5], [6]]  # the two saved batches were loaded, not run again
    assert [int(t) for t in results] == [x * x for x in range(7)]
    assert earlier_seconds > 0

    fresh, none_earlier = map_batches(batches, square, "squares")
    assert [int(t) for t in fresh] == [int(t) for t in results] and none_earlier == 0.0


def test_a_generation_resumed_with_other_batches_makes_them_again(tmp_path):
    """Saved batch K of 2 items is not batch K of 1 item: a generation killed at one batch size and resumed at
    another would load other items' results in their place."""
    saved, ran = tmp_path / ".labels-abc.batches", []

    def ids(batch):
        ran.append(batch)
        return [x * 10 for x in batch]

    assert map_batches([[0, 1], [2, 3]], ids, "ids", saved)[0] == [0, 10, 20, 30]
    ran.clear()
    assert map_batches([[0], [1], [2], [3]], ids, "ids", saved)[0] == [0, 10, 20, 30]
    assert ran == [[0], [1], [2], [3]]


def test_resume_false_forgets_saved_batches(tmp_path):
    saved = tmp_path / "work" / "trajectories.batches"
    map_batches([[1], [2]], lambda b: b, "ids", saved)
    clear_checkpoints(tmp_path / "work")
    assert not saved.exists()


def test_a_second_job_waits_for_the_first_to_finish(tmp_path):
    lock, events = lock_file(tmp_path / "continuations-abc"), []

    def job(name: str, hold: float) -> None:
        with exclusive(lock, "the continuations"):
            events.append(f"{name} starts")
            time.sleep(hold)
            events.append(f"{name} ends")

    first = threading.Thread(target=job, args=("first", 0.5))
    first.start()
    while not events:
        time.sleep(0.01)
    second = threading.Thread(target=job, args=("second", 0.0))
    second.start()
    first.join(), second.join()
    assert events == ["first starts", "first ends", "second starts", "second ends"]
