"""The one lock module: a run's lock, a made thing's lock, and the check that nothing holds a set of locks."""

from __future__ import annotations

import threading
import time

import pytest

from specrepro.locks import all_free, run_lock


def test_a_second_job_of_one_run_waits_then_finds_it_recorded(tmp_path):
    run_dir, seen = tmp_path / "runs" / "r", []

    def second_job():
        with run_lock(run_dir):
            seen.append((run_dir / "metrics.json").is_file())

    with run_lock(run_dir):
        other = threading.Thread(target=second_job)
        other.start()
        time.sleep(0.2)
        assert not seen  # waiting for the first job's lock
        (run_dir / "metrics.json").write_text("{}")
    other.join(timeout=10)
    assert seen == [True]


def test_a_job_waiting_for_a_run_says_so(tmp_path, caplog):
    """A second job of a run another job is decoding (maybe for hours) says why it waits, not a silent hang."""
    run_dir = tmp_path / "runs" / "r"

    def second_job():
        with run_lock(run_dir):
            pass

    with run_lock(run_dir):
        (run_dir / "metrics.json").write_text("{}")
        other = threading.Thread(target=second_job)
        with caplog.at_level("INFO", logger="specrepro.locks"):
            other.start()
            time.sleep(0.2)
    other.join(timeout=10)
    assert "waiting for another job to finish run r" in caplog.text


def test_a_run_that_failed_before_recording_anything_leaves_no_directory(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    with pytest.raises(RuntimeError), run_lock(run_dir):
        raise RuntimeError("failed while loading the model")
    assert not run_dir.exists()


def test_all_free_holds_nothing_while_another_holds_one(tmp_path):
    locks = [tmp_path / ".a.lock", tmp_path / ".b.lock"]
    with all_free(locks) as free:
        assert free
        with all_free(locks[1:]) as other:
            assert not other
    with all_free(locks) as free:  # released on leaving
        assert free
