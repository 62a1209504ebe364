"""Training on 🤗 Accelerate with two CPU processes (`accelerate launch --cpu --num_processes 2`): the sps draft of a
tiny model trains to the loss history of one process at the same global batch, its training data (target
continuations and labels, generated in shards) is the dataset one process writes, the artifact is published once,
and a launch killed mid-training resumes exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from datasets import load_from_disk

from tests.test_runner import specrepro
from tests.test_training import TINY_TRAINING

# generation batches of 2 prompts: 5 continuation batches and 3 label batches to deal to the processes
TRAINING = [
    *[o for o in TINY_TRAINING if not o.startswith("training.loop.steps")],
    "logger=wandb",
    "training.generation_batch_size=2",
    "training.loop.steps=12",
    "training.loop.log_every=1",
    "training.loop.checkpoint_every=1",
]
LOSS_TOLERANCE = 0.02  # relative: each process averages its own half of the batch's tokens, one process all of them


def launch(cwd: Path, *overrides: str) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--cpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "-m",
        "specrepro.cli",
        "train",
        *TRAINING,
        *overrides,
    ]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "0"}
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def finish(proc: subprocess.Popen) -> str:
    """The launch's stdout and stderr, once it has succeeded."""
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return out + err


def artifact(cwd: Path) -> tuple[Path, dict]:
    [path] = (cwd / "results" / "artifacts").glob("sps_draft-*")
    return path, json.loads((path / "artifact.json").read_text())


def losses(metadata: dict) -> list[float]:
    return [entry["loss"] for entry in metadata["history"]]


def test_two_processes_train_as_one_and_shard_the_data_generation(tmp_path):
    (tmp_path / "one").mkdir(), (tmp_path / "two").mkdir()
    specrepro("train", *TRAINING, cwd=tmp_path / "one")
    out = finish(launch(tmp_path / "two"))
    assert out.count("artifact: ") == 1  # the main process alone publishes and reports
    (one, single), (two, double) = artifact(tmp_path / "one"), artifact(tmp_path / "two")
    assert one.name == two.name and len(losses(double)) == 12
    assert losses(double) == pytest.approx(losses(single), rel=LOSS_TOLERANCE)
    assert len(list((tmp_path / "two" / "results" / "artifacts").glob(".*staging*"))) == 0
    assert len(list((tmp_path / "two").rglob("offline-run-*"))) == 1  # one W&B run, from the main process
    for kind in ("continuations", "labels"):  # data generated in shards: the one-process dataset
        [a] = (tmp_path / "one" / "results" / "artifacts" / ".work").glob(f"{kind}-*")
        [b] = (tmp_path / "two" / "results" / "artifacts" / ".work").glob(f"{kind}-*")
        assert a.name == b.name and load_from_disk(str(a)).to_dict() == load_from_disk(str(b)).to_dict()


@pytest.mark.parametrize("processes", [2, 1])
def test_a_killed_launch_resumes(tmp_path, processes):
    """Killed mid-training with two processes, resumed with two (exactly the uninterrupted losses) or with one
    (the same global batch: within the tolerance of one process against two)."""
    (tmp_path / "straight").mkdir(), (tmp_path / "killed").mkdir()
    finish(launch(tmp_path / "straight"))
    proc = launch(tmp_path / "killed")
    work = tmp_path / "killed" / "results" / "artifacts" / ".work"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and not list(work.glob("sps_draft-*/checkpoint-3")):
        time.sleep(0.02)
    assert proc.poll() is None, "the launch ended before it could be killed mid-training"
    os.killpg(proc.pid, signal.SIGKILL)  # both processes and the launcher
    proc.communicate()
    [pointer] = work.glob("sps_draft-*/latest")
    step = int(pointer.read_text().strip().removeprefix("checkpoint-"))
    assert step < 12
    if processes == 2:
        out, err = finish(launch(tmp_path / "killed")), ""
        tolerance = 1e-6
    else:
        resumed = specrepro("train", *TRAINING, cwd=tmp_path / "killed")
        out, err, tolerance = resumed.stdout, resumed.stderr, LOSS_TOLERANCE
    assert f"resuming training from step {step}" in err + out
    resumed_losses = losses(artifact(tmp_path / "killed")[1])
    assert resumed_losses == pytest.approx(losses(artifact(tmp_path / "straight")[1]), rel=tolerance)
