"""Training on 🤗 Accelerate with two CPU processes over gloo (torchrun; `accelerate launch --cpu` starts one): the
sps draft of a tiny model trains exactly as one process whose micro-batches are the processes' halves, its training
data (target continuations and labels, generated in shards) is the dataset one process writes, the artifact is
published once, and a launch killed mid-training resumes exactly"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
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
# one process whose micro-batches are the two processes' halves: each loss is a mean over its own rows' tokens
HALVES = ["training.loop.batch_size=1", "training.loop.grad_accum=2"]


def launch(cwd: Path, *overrides: str) -> subprocess.Popen:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command = [*torchrun, "-m", "specrepro.cli", "train", *TRAINING, *overrides]
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
    (tmp_path / "halves").mkdir()
    specrepro("train", *TRAINING, cwd=tmp_path / "one")
    specrepro("train", *TRAINING, *HALVES, cwd=tmp_path / "halves")
    out = finish(launch(tmp_path / "two"))
    assert out.count("artifact: ") == 1  # the main process alone publishes and reports
    (one, _), (two, double) = artifact(tmp_path / "one"), artifact(tmp_path / "two")
    assert one.name == two.name and len(losses(double)) == 12
    assert losses(double) == pytest.approx(losses(artifact(tmp_path / "halves")[1]), rel=1e-5)
    assert len(list((tmp_path / "two" / "results" / "artifacts").glob(".*staging*"))) == 0
    assert len(list((tmp_path / "two").rglob("offline-run-*"))) == 1  # one W&B run, from the main process
    for kind in ("continuations", "labels"):  # data generated in shards: the one-process dataset
        [a] = (tmp_path / "one" / "results" / "artifacts" / ".work").glob(f"{kind}-*")
        [b] = (tmp_path / "two" / "results" / "artifacts" / ".work").glob(f"{kind}-*")
        assert a.name == b.name and load_from_disk(str(a)).to_dict() == load_from_disk(str(b)).to_dict()


@pytest.mark.parametrize("processes", [2, 1])
def test_a_killed_launch_resumes(tmp_path, processes):
    """Killed mid-training with two processes, resumed with two (exactly the uninterrupted losses) or with one (the
    same rows from the checkpoint on, each micro-batch's loss then a mean over all its tokens)."""
    (tmp_path / "straight").mkdir(), (tmp_path / "killed").mkdir()
    finish(launch(tmp_path / "straight"))
    proc = launch(tmp_path / "killed")
    work = tmp_path / "killed" / "results" / "artifacts" / ".work"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and not list(work.glob("sps_draft-*/latest")):
        time.sleep(0.02)
    assert proc.poll() is None, "the launch ended before it could be killed mid-training"
    for worker in psutil.Process(proc.pid).children(recursive=True):  # torchrun starts each in its own session
        worker.kill()
    proc.kill()
    proc.communicate()
    [pointer] = work.glob("sps_draft-*/latest")
    step = int(pointer.read_text().strip().removeprefix("checkpoint-"))
    assert (pointer.parent / f"checkpoint-{step}" / "random_states_1.pkl").is_file()  # saved by a second process
    assert step < 12
    if processes == 2:
        out, err = finish(launch(tmp_path / "killed")), ""
        exact = 12
    else:
        resumed = specrepro("train", *TRAINING, cwd=tmp_path / "killed")
        out, err, exact = resumed.stdout, resumed.stderr, step
    assert f"resuming training from step {step}" in err + out
    resumed_losses, straight = losses(artifact(tmp_path / "killed")[1]), losses(artifact(tmp_path / "straight")[1])
    assert len(resumed_losses) == 12
    assert resumed_losses[:exact] == pytest.approx(straight[:exact], rel=1e-6)
