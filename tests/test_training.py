"""The shared training loop (schedule, checkpoints, exact resume), distillation data and the sps draft trained
end to end."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from specrepro.config import ModelConfig, RandomArchConfig
from specrepro.data import DatasetConfig
from specrepro.errors import SpecReproError
from specrepro.identity import content_digest
from specrepro.models.loading import LoadedModel, load_tokenizer, random_llama
from specrepro.training import cost
from specrepro.training.distill_data import continuation_dataset, distill_cache_dir
from specrepro.training.loop import LoopConfig, lr_lambda, train_loop
from tests.test_data import compose_dataset
from tests.test_runner import FAST, run_dirs, specrepro


def regression_setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))  # dropout: as LoRA
    data = torch.randn(64, 4), torch.randn(64, 1)

    def batch_for_step(step, micro):
        index = (step * 2 + micro) % 8
        return {"x": data[0][index * 8 : index * 8 + 8], "y": data[1][index * 8 : index * 8 + 8]}

    def loss_fn(model, batch):
        return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]), {}

    return model, loss_fn, batch_for_step


def test_warmup_then_cosine_schedule():
    factor = lr_lambda(LoopConfig(steps=110, warmup_steps=10, min_lr_ratio=0.1))
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)
    assert factor(60) == pytest.approx(0.55) and factor(110) == pytest.approx(0.1)


def test_interrupted_training_resumes_exactly(tmp_path):
    """The same weights as an uninterrupted training, dropout masks included (the random state is restored)."""
    cfg = LoopConfig(steps=6, grad_accum=2, lr=0.1, warmup_steps=2, checkpoint_every=2, log_every=1)
    model, loss_fn, batch_for_step = regression_setup()
    train_loop(model, loss_fn, batch_for_step, cfg, tmp_path / "straight")

    interrupted, loss_fn, batch_for_step = regression_setup()

    def crash_at_step_5(step, micro):
        if step == 4:
            raise KeyboardInterrupt
        return batch_for_step(step, micro)

    with pytest.raises(KeyboardInterrupt):
        train_loop(interrupted, loss_fn, crash_at_step_5, cfg, tmp_path / "resumed")
    resumed, _, _ = regression_setup()  # a fresh process: parameters re-initialised
    history = train_loop(resumed, loss_fn, batch_for_step, cfg, tmp_path / "resumed")
    for a, b in zip(model.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b)
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5, 6]  # the history survives the interruption
    seconds = [h["seconds"] for h in history]  # loop time, carried across the resume by the checkpoint
    assert 0 < seconds[0] and seconds == sorted(seconds) and cost.loop_seconds(history) == seconds[-1]


TINY_TRAINING = [
    "model=tiny_random",
    "method=sps",
    "logger=none",
    "hardware.threads=1",
    "training.prompts.gsm8k.limit=6",
    "training.prompts.sharegpt.limit=2",
    "training.prompts.mbpp.limit=2",
    "training.labeled.gsm8k.limit=4",
    "training.labeled.sharegpt.limit=2",
    "training.continuation_tokens=8",
    "training.loop.steps=4",
    "training.loop.batch_size=2",
    "training.loop.warmup_steps=1",
    "training.draft.num_layers=1",
    "training.draft.hidden_size=64",
    "training.draft.intermediate_size=128",
    "training.heldout_fraction=0.2",
]


def test_continuations_from_a_bf16_copy_are_cached_apart_and_leave_the_target_in_fp32(tmp_path):
    cfg = OmegaConf.create(
        {
            "model": {"name": "tiny", "source": "random"},
            "artifacts_dir": str(tmp_path),
            "hardware": {"dtype": "float32"},
        }
    )
    prompts = {
        "gsm8k": DatasetConfig(
            name="gsm8k_train",
            path="gsm8k/train.jsonl.gz",
            task="gsm8k",
            prompt_style="chat",
            template="hash_answer",
            limit=3,
        )
    }
    bf16_dir = distill_cache_dir(cfg, "continuations", prompts, 6, 64, "bfloat16")
    assert (
        distill_cache_dir(cfg, "continuations", prompts, 6, 64)
        == distill_cache_dir(cfg, "continuations", prompts, 6, 64, "float32")
        != bf16_dir
    )
    target = LoadedModel(
        model=random_llama(RandomArchConfig(vocab_size=49152)).eval(),
        tokenizer=load_tokenizer("embedded", ModelConfig()),
        name="tiny",
    )
    rows = continuation_dataset(target, prompts, 6, 2, 64, bf16_dir, "bfloat16")
    assert len(rows) == 3 and all(1 <= len(row["continuation_ids"]) <= 6 for row in rows)
    assert {p.dtype for p in target.model.parameters()} == {torch.float32}
    assert continuation_dataset(target, prompts, 6, 2, 64, bf16_dir)["continuation_ids"] == rows["continuation_ids"]
    assert cost.recorded(bf16_dir) > 0  # what the cache took to make, for every training that re-uses it
    assert not list(tmp_path.rglob("*.batches"))  # the saved batches go once the cache is written


def test_train_sps_draft_then_decode_with_it(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "0"}
    beside = subprocess.Popen(
        [sys.executable, "-m", "specrepro.cli", "train", *TINY_TRAINING],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # the same artifact at once
    out = specrepro("train", *TINY_TRAINING, cwd=tmp_path)
    beside_out, beside_log = beside.communicate(timeout=600)
    assert beside.returncode == 0, beside_log[-3000:]
    assert beside_out.splitlines()[-1] == out.stdout.splitlines()[-1]
    logs = beside_out + beside_log + out.stdout + out.stderr
    assert "already trained" in logs  # one trained it; the other waited for it, then re-used it
    artifact = tmp_path / out.stdout.strip().splitlines()[-1].removeprefix("artifact: ")
    metadata = json.loads((artifact / "artifact.json").read_text())
    assert metadata["component"] == "sps_draft" and len(metadata["history"]) >= 1
    assert 0 <= metadata["metrics"]["heldout_top1_agreement_after"] <= 1
    spent = metadata["metrics"]["compute_minutes"]  # its data (continuations, labels) and its loop
    assert spent * 60 > metadata["history"][-1]["seconds"] > 0
    again = specrepro("train", *TINY_TRAINING, cwd=tmp_path)  # finished: skipped, same artifact
    assert again.stdout.strip().endswith(out.stdout.strip().splitlines()[-1].removeprefix("artifact: "))

    specrepro("run", *FAST, "method=sps", "dataset.limit=2", "logger=none", cwd=tmp_path)
    sps = next(p for k, p in run_dirs(tmp_path).items() if k.startswith("sps:"))
    metrics = json.loads((sps / "metrics.json").read_text())
    assert metrics["lossless"] == 1.0 and metrics["training_minutes"] == spent
    assert metrics["artifacts"] == {"draft": {"name": artifact.name, "content_digest": content_digest(artifact)}}
    ar = next(p for k, p in run_dirs(tmp_path).items() if k.startswith("ar:"))
    assert json.loads((ar / "metrics.json").read_text())["training_minutes"] == 0.0

    retrained = specrepro("train", *TINY_TRAINING, "resume=false", cwd=tmp_path)  # from scratch, on the same thread
    assert retrained.stdout.strip().endswith(artifact.name)  # count: the same weights, so the sps run stays reusable
    assert content_digest(artifact) == metrics["artifacts"]["draft"]["content_digest"]
    rerun = specrepro("run", *FAST, "method=sps", "dataset.limit=2", "logger=none", cwd=tmp_path)
    assert "already complete" in rerun.stdout + rerun.stderr

    # trained again under its name with other weights (another thread count, a retrain after damage): a new run,
    # never the record the old weights made; the ar reference (no artifact of its own) is reused
    weights = artifact / "model.safetensors"
    tensors = load_file(weights)
    save_file({name: value + 0.01 for name, value in tensors.items()}, weights)
    metadata["files"]["model.safetensors"] = weights.stat().st_size  # as `publish` records a retrain's files
    (artifact / "artifact.json").write_text(json.dumps(metadata))
    again = specrepro("run", *FAST, "method=sps", "dataset.limit=2", "logger=none", cwd=tmp_path)
    assert "already complete" not in again.stdout + again.stderr
    runs = [p for k, p in run_dirs(tmp_path).items() if k.startswith("sps:")]
    assert len(runs) == 2 and len(run_dirs(tmp_path)) == 3
    newer = json.loads(next(p for p in runs if p != sps).joinpath("metrics.json").read_text())
    assert newer["artifacts"]["draft"]["content_digest"] != metrics["artifacts"]["draft"]["content_digest"]
    assert newer["artifacts"]["draft"]["content_digest"] == content_digest(artifact)


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.loop.steps=-3", "training.loop.steps must be positive, got -3"),
        ("training.loop.lr=0", "training.loop.lr must be positive, got 0"),
        ("training.calibration.loop.batch_size=0", "training.calibration.loop.batch_size must be positive, got 0"),
    ],
)
def test_a_bad_loop_option_fails_before_any_work(tmp_path, override, message):
    out = specrepro("train", "method=eesd", "model=tiny_random", override, cwd=tmp_path, check=False)
    assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "results" / "artifacts" / ".work").exists()  # nothing was prepared


def test_held_out_settings_that_leave_nothing_to_train_or_measure_on_are_refused():
    """A fraction of 1 or more held every sequence out (SAR then measured agreement on its training rows), a
    negative one held one out; an empty training set divided by zero."""
    from specrepro.training.distill_data import heldout_count
    from specrepro.training.loop import LoopConfig, micro_batch_indices

    assert heldout_count(20, 0.05) == 1 and heldout_count(20, 0.2) == 4
    for fraction in (1.0, 1.5, 0.0, -0.5):
        with pytest.raises(SpecReproError, match=f"training.heldout_fraction must be between 0 and 1, got {fraction}"):
            heldout_count(20, fraction)
    with pytest.raises(SpecReproError, match="leaves none to train on"):
        heldout_count(1, 0.5)
    with pytest.raises(SpecReproError, match="no training rows"):
        micro_batch_indices(0, 0, 0, LoopConfig())


def test_every_epoch_shows_every_row_once_across_a_micro_batch_that_crosses_it():
    """A micro-batch crossing an epoch's end wrapped within the old epoch's permutation: it showed that epoch's
    first rows twice, and the next epoch's first rows were never shown."""
    from specrepro.training.loop import LoopConfig, micro_batch_indices

    loop = LoopConfig(batch_size=4, grad_accum=1)
    shown = [row for step in range(10) for row in micro_batch_indices(step, 0, 7, loop)]  # 40 rows, 7 a epoch
    for epoch in range(5):
        assert sorted(shown[7 * epoch : 7 * epoch + 7]) == list(range(7))
    assert micro_batch_indices(0, 0, 7, loop) == shown[:4]  # a pure function of the step, for exact resume


def test_a_held_out_setting_out_of_range_is_one_line(tmp_path):
    out = specrepro("train", *TINY_TRAINING, "training.heldout_fraction=1.5", cwd=tmp_path, check=False)
    assert out.returncode == 2 and "training.heldout_fraction must be between 0 and 1, got 1.5" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_finished_artifact_is_reused_without_taking_its_lock(tmp_path, monkeypatch):
    """Artifacts on read-only storage (an archive, a shared mount): `train` finds the finished one before it would
    write a lock file beside it."""
    from specrepro import training
    from tests.test_config import compose_run

    cfg = compose_run(*TINY_TRAINING, f"artifacts_dir={tmp_path}", config="train")
    final = training.artifact_path(cfg)
    final.mkdir()
    (final / "artifact.json").write_text("{}")

    def no_lock(*args):
        raise PermissionError("read-only")

    monkeypatch.setattr(training, "exclusive", no_lock)
    assert training.train(cfg) == final


def test_records_replaced_at_their_path_train_the_artifact_again_from_fresh_targets_outputs(tmp_path, monkeypatch):
    """The artifact and the cached target continuations were named by the dataset settings alone: GSM8K prompts
    replaced in the file a recipe names kept the artifact ("already trained; skipping"), and even resume=false
    trained it again on the continuations of the old prompts."""
    from specrepro import registry, training
    from specrepro.training.loop import LATEST
    from tests.test_config import compose_run

    prompts = tmp_path / "prompts.jsonl"
    question = {"question": "Natalia sold 48 clips in April. How many in all?", "answer": "48\n#### 48"}
    prompts.write_text(json.dumps(question) + "\n")
    read_from = f"training.prompts.gsm8k.path={prompts}"
    cfg = compose_run(*TINY_TRAINING, f"artifacts_dir={tmp_path}", read_from, config="train")
    final, spec, made_from = training.artifact_path(cfg), cfg.training, training.training_data(cfg)
    continuations = distill_cache_dir(cfg, "continuations", spec.prompts, spec.continuation_tokens, 256)
    final.mkdir()
    (final / "artifact.json").write_text(json.dumps({"training_data": made_from}))
    work_dir = tmp_path / ".work" / final.name
    work_dir.mkdir(parents=True)
    (work_dir / "training_data.json").write_text(json.dumps(made_from))
    (work_dir / LATEST).write_text("checkpoint-2")  # a checkpoint trained on these records

    class Trained(Exception):
        pass

    def trainer(cfg, target, work_dir, log_metrics, device):  # what training would start from
        raise Trained(f"resumes a checkpoint: {(work_dir / LATEST).exists()}")

    monkeypatch.setitem(
        registry.COMPONENTS, "sps_draft", dataclasses.replace(registry.COMPONENTS["sps_draft"], trainer=trainer)
    )
    assert training.train(cfg) == final  # the same records: reused
    question["question"] = "Weng earns $12 an hour. How much for 3 hours?"
    prompts.write_text(json.dumps(question) + "\n")
    with pytest.raises(Trained, match="resumes a checkpoint: False"):  # trained again, not from the old checkpoint
        training.train(cfg)
    assert training.training_data(cfg)["training.prompts.gsm8k"] != made_from["training.prompts.gsm8k"]
    assert distill_cache_dir(cfg, "continuations", spec.prompts, spec.continuation_tokens, 256) != continuations


def test_a_draft_wider_than_the_target_is_one_line_not_a_traceback(tmp_path):
    wider = [o for o in TINY_TRAINING if not o.startswith("training.draft.hidden_size")]
    out = specrepro("train", *wider, "training.draft.hidden_size=128", cwd=tmp_path, check=False)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "training.draft.hidden_size=128 is wider than the target's (64)" in out.stderr


@pytest.mark.parametrize(
    "overrides",
    [
        ["method=eesd", "training=eesd_general"],
        ["method=sar_draft", "training=sar_draft_general"],
        ["method=sps", "training=sps_general"],
    ],
)
def test_the_general_recipes_never_see_a_leaderboard_question(overrides):
    """The leaderboard's "best here" drafters learn from conf/data_mix/general.yaml: no prompt of it shares a
    passage with any Spec-Bench question (data/overlap.py), while it covers chat, math, code, summaries and
    answers from a context."""
    from hydra import compose, initialize_config_dir

    from specrepro.cli import CONF_DIR
    from specrepro.config import register_configs
    from specrepro.data import load_records
    from specrepro.data.overlap import passages, shares_a_passage

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        training = compose("train", overrides=overrides).training
    prompt_sets = training.get("prompts") or training.continuations
    assert {"sharegpt", "alpaca", "gsm8k", "mbpp", "xsum", "pubmedqa"} <= set(prompt_sets)
    known = passages(load_records(compose_dataset("spec_bench")))
    for name, dataset in prompt_sets.items():
        assert not [r.id for r in load_records(dataset) if shares_a_passage(r, known)], name
    assert [r.id for r in load_records(compose_dataset("alpaca_eval")) if shares_a_passage(r, known)] == ["791", "801"]


def test_distillation_continuations_are_the_targets_greedy_tokens_whatever_its_generation_config():
    """A draft distils the target's greedy continuations, which `generate` makes: it filled every setting it was
    not given from the model's generation_config, so a checkpoint's repetition penalty (Qwen2.5-Instruct's 1.05)
    changed them. They are `ar`'s greedy tokens now, and the model's generation_config is left as it was."""
    import types

    from specrepro.decoding.ar import ARDecoder
    from specrepro.decoding.sampling import Sampling
    from specrepro.training.distill_data import generate_continuations
    from tests.conftest import tiny_llama

    model = tiny_llama(vocab_size=64, seed=1)
    model.generation_config.repetition_penalty = 1.3
    tokenizer = types.SimpleNamespace(pad_token_id=0, eos_token_id=2)
    prompts = [("a", [5, 9, 13, 5, 9, 13, 21, 30]), ("b", [7, 3, 40, 41, 42, 7, 3, 40])]
    pairs, _ = generate_continuations(model, tokenizer, prompts, 24, 2, 64)
    ar = ARDecoder(model)
    ar.eos_ids = {0, 2}
    assert [continuation for _, continuation in pairs] == [
        ar.generate(ids, Sampling(), 24).token_ids for _, ids in prompts
    ]
    assert model.generation_config.repetition_penalty == 1.3
