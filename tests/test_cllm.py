"""CLLM (004): Jacobi trajectories, augmentation, consistency losses, both `specrepro train` stages end to end."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from datasets import load_from_disk

from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.jacobi import CLLMDecoder, CLLMConfig, JacobiDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.errors import SpecReproError
from specrepro.models.loading import LoadedModel
from specrepro.training.cllm import (
    CLLMTrainingConfig,
    augment_states,
    consistency_loss_fn,
    distance,
    find_trajectories,
    jacobi_trajectories,
    longest_run,
    row_losses,
)
from tests.conftest import tiny_llama
from tests.test_runner import run_dirs, specrepro

GREEDY = Sampling()


def test_trajectories_end_in_the_greedy_output():
    model = tiny_llama(vocab_size=64, seed=4)
    prompt = list(range(3, 23))
    rows = jacobi_trajectories(model, prompt, n=5, max_new_tokens=20, eos_ids=set(), rng=random.Random(0))
    output = [tok for row in rows for tok in row["fixed_point"]]
    assert output == ARDecoder(model).generate(prompt, GREEDY, 20).token_ids
    for row in rows:
        assert len(row["states"]) <= 5  # each Jacobi iteration fixes at least one more token (k <= n)
        assert row["fixed_point"] not in row["states"]
        assert row["prefix_ids"][: len(prompt)] == prompt


def test_augmentation_corrects_wrong_tokens_but_never_the_first():
    fixed = [1, 2, 3, 4, 5, 6]
    states = [[9, 9, 9, 9, 9, 9], [1, 9, 9, 9, 9, 9], [1, 2, 3, 4, 5, 9]]
    augmented = augment_states(states, fixed, random.Random(0))
    assert augmented[-1] == states[-1]  # the state before y* is kept
    for before, after in zip(states[:-1], augmented[:-1]):
        first_wrong = next(i for i, (a, b) in enumerate(zip(before, fixed)) if a != b)
        assert after[first_wrong] != fixed[first_wrong]
        assert sum(a != b for a, b in zip(after, fixed)) < sum(a != b for a, b in zip(before, fixed))
    assert longest_run([1, 1, 2, 2, 2, 3]) == 3


def test_repetition_filter_ignores_the_block_after_eos():
    # a block's fixed point runs past the EOS; the official filter stops there, so must this one
    assert longest_run([5, 6, 2] + [0] * 12, stop={2}) == 1
    assert longest_run([5] + [0] * 12 + [2], stop={2}) == 12


def test_distances_vanish_on_equal_distributions():
    logits = torch.randn(3, 10)
    for kind in ("fkl", "rkl", "jsd"):
        assert torch.allclose(distance(logits, logits, kind), torch.zeros(3), atol=1e-5)
        assert (distance(logits, torch.randn(3, 10), kind) > 0).all()


def test_distances_are_the_kl_divergences_they_name():
    p_logits, q_logits = torch.randn(3, 10), torch.randn(3, 10)
    log_p, log_q = p_logits.log_softmax(-1), q_logits.log_softmax(-1)

    def kl(log_a, log_b):
        return (log_a.exp() * (log_a - log_b)).sum(-1)

    log_m = (0.5 * (log_p.exp() + log_q.exp())).log()
    torch.testing.assert_close(distance(p_logits, q_logits, "fkl"), kl(log_p, log_q))
    torch.testing.assert_close(distance(p_logits, q_logits, "rkl"), kl(log_q, log_p))
    torch.testing.assert_close(distance(p_logits, q_logits, "jsd"), 0.5 * (kl(log_p, log_m) + kl(log_q, log_m)))


@pytest.mark.parametrize("consistency", ["global", "local"])
def test_row_losses_compare_the_blocks_predictions_and_score_the_fixed_point_as_next_tokens(consistency):
    """Consistency: D(logits on prefix + y*, logits on prefix + y) at the rows predicting the block's tokens, from
    the first token the two states differ at; AR: the fixed point's response tokens, each from the row before it."""
    model = tiny_llama(vocab_size=64, seed=5)
    prompt, prefix, fixed, state = list(range(3, 15)), list(range(3, 15)) + [20, 21], [30, 31, 32, 33], [30, 40, 41, 33]
    row = {"prefix_ids": prefix, "prompt_len": len(prompt), "states": [state], "fixed_point": fixed}
    spec = CLLMTrainingConfig(block_size=4)
    spec.loss.consistency, spec.loss.label_smoothing = consistency, 0.0
    got_consistency, got_ar = row_losses(model, row, spec, random.Random(0), torch.device("cpu"))
    with torch.no_grad():
        on_fixed, on_state = (
            model(torch.tensor([prefix + fixed])).logits[0],
            model(torch.tensor([prefix + state])).logits[0],
        )
        block = slice(len(prefix) - 1 + 1, len(prefix) - 1 + 4)  # the states first differ at the block's token 1
        expected = distance(on_fixed[block], on_state[block], "fkl").mean()
        ids = torch.tensor(prefix + fixed)
        ar = torch.nn.functional.cross_entropy(on_fixed[len(prompt) - 1 : -1], ids[len(prompt) :])
    torch.testing.assert_close(got_consistency.detach(), expected)
    torch.testing.assert_close(got_ar.detach(), ar)


@pytest.mark.parametrize("consistency,ar_target", [("global", "teacher"), ("local", "teacher"), ("global", "gt")])
def test_consistency_loss_has_gradients(consistency, ar_target):
    model = tiny_llama(vocab_size=64, seed=5)
    prompt = list(range(3, 15))
    rows = jacobi_trajectories(model, prompt, n=4, max_new_tokens=8, eos_ids=set(), rng=random.Random(0))
    for row in rows:
        row.update(prompt_len=len(prompt), reference_ids=[7, 8, 9])
    spec = CLLMTrainingConfig(block_size=4)
    spec.loss.consistency, spec.loss.ar_target = consistency, ar_target
    loss, logs = consistency_loss_fn(spec, rows, torch.device("cpu"))(model, {"indices": [0, 1], "seed": 0})
    loss.backward()
    assert loss > 0 and logs["ar_loss"] > 0
    assert model.lm_head.weight.grad.abs().sum() > 0


def test_cllm_method_refuses_base_weights():
    model = tiny_llama()
    with pytest.raises(SpecReproError):
        CLLMDecoder.from_config(CLLMConfig(), LoadedModel(model=model, tokenizer=None, name="tiny"), None)


def test_trajectories_then_training_then_lossless_jacobi(tmp_path):
    """The two train stages through the CLI (LoRA merged into the saved model), then `run method=cllm` on it."""
    common = ["method=cllm", "model=tiny_random", "logger=none", "hardware.threads=1", "training.block_size=8"]
    specrepro(
        "train",
        *common,
        "training.stage=trajectories",
        "training.max_new_tokens=16",
        *[f"training.prompts.{s}.limit=2" for s in ("gsm8k", "spider", "mbpp", "sharegpt")],
        cwd=tmp_path,
    )
    [trajectories] = (tmp_path / "results" / "artifacts").glob("cllm_trajectories-*")
    dataset = load_from_disk(str(trajectories / "trajectories"))
    assert set(dataset["source"]) == {"gsm8k", "spider", "mbpp", "sharegpt"}
    assert all(len(fp) == 8 for fp in dataset["fixed_point"])
    specrepro(
        "train",
        *common,
        "training.stage=train",
        "training.loop.steps=3",
        "training.heldout_prompts=2",
        "training.eval_tokens=8",
        "training.loss.consistency=local",
        "training.lora.r=4",
        cwd=tmp_path,
    )
    [model_dir] = (tmp_path / "results" / "artifacts").glob("cllm-*")
    assert (model_dir / "config.json").is_file() and (model_dir / "artifact.json").is_file()
    held_out = json.loads((model_dir / "artifact.json").read_text())["metrics"]
    for window in ("", "_sliding"):  # the paper's block and the sliding window, before and after training
        assert all(1.0 <= held_out[f"heldout_tokens_per_iteration{window}_{when}"] <= 8 for when in ("before", "after"))
    specrepro(
        "run",
        "model=tiny_random",
        "model.source=artifact",
        "model.id=cllm",
        "method=cllm",
        "dataset=gsm8k",
        "dataset.limit=2",
        "decoding.max_new_tokens=12",
        "timing.warmup_tokens=4",
        "hardware.threads=1",
        "logger=none",
        cwd=tmp_path,
    )
    runs = run_dirs(tmp_path)
    [cllm_run] = [p for name, p in runs.items() if name.startswith("cllm:")]
    assert json.loads((cllm_run / "metrics.json").read_text())["lossless"] == 1.0


def test_jacobi_on_trained_weights_equals_ar_on_them(tmp_path):
    """A few consistency steps change the weights; Jacobi on them still equals AR on them."""
    model = tiny_llama(vocab_size=64, seed=6)
    prompt = list(range(3, 19))
    rows = jacobi_trajectories(model, prompt, n=6, max_new_tokens=12, eos_ids=set(), rng=random.Random(0))
    for row in rows:
        row.update(prompt_len=len(prompt), reference_ids=[])
    spec = CLLMTrainingConfig(block_size=6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        loss, _ = consistency_loss_fn(spec, rows, torch.device("cpu"))(
            model, {"indices": [step % len(rows)], "seed": step}
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    assert (
        JacobiDecoder(model, block_size=6).generate(prompt, GREEDY, 30).token_ids
        == ARDecoder(model).generate(prompt, GREEDY, 30).token_ids
    )


def consistency_stage(tmp_path, block_size: int, ref: str = "cllm_trajectories-m", *overrides):
    from tests.test_config import compose_run

    return compose_run(
        "method=cllm",
        "model=tiny_random",
        f"training.trajectories={ref}",
        f"training.block_size={block_size}",
        f"artifacts_dir={tmp_path}",
        *overrides,
        config="train",
    )


def collected(tmp_path, name: str, block_size: int, age: float, target: dict | None = None, rows: bytes = b"") -> None:
    """A trajectories artifact as the collecting stage publishes it: metadata, and the dataset in `trajectories/`."""
    (tmp_path / name / "trajectories").mkdir(parents=True)
    (tmp_path / name / "trajectories" / "data.arrow").write_bytes(rows)
    meta = {"metrics": {"block_size": block_size}, **({"target": target} if target else {})}
    (tmp_path / name / "artifact.json").write_text(json.dumps(meta))
    os.utime(tmp_path / name / "artifact.json", (1e9 - age, 1e9 - age))


def test_training_finds_the_trajectories_of_its_block_size(tmp_path):
    """The newest trajectories with training.block_size are used; an exact name of another n is refused."""
    for age, (name, n) in enumerate([("cllm_trajectories-m-new", 4), ("cllm_trajectories-m-old", 16)]):
        collected(tmp_path, name, n, age)
    assert find_trajectories(consistency_stage(tmp_path, 16)).name == "cllm_trajectories-m-old"
    assert find_trajectories(consistency_stage(tmp_path, 4)).name == "cllm_trajectories-m-new"
    with pytest.raises(SpecReproError, match="block_size=8"):
        find_trajectories(consistency_stage(tmp_path, 8))
    with pytest.raises(SpecReproError, match="block_size 4"):
        find_trajectories(consistency_stage(tmp_path, 4, "cllm_trajectories-m-old"))


def test_a_cllm_is_named_by_the_trajectories_it_trains_on_and_never_by_another_targets(tmp_path):
    """Trajectories collected again (other prompts) train a new CLLM, not the one trained on the earlier ones; and
    trajectories another target collected (another seed of the same model name) are not trained on."""
    from specrepro.identity import run_target
    from specrepro.training import artifact_path

    stage = consistency_stage(tmp_path, 16)
    collected(tmp_path, "cllm_trajectories-m-first", 16, 3.0, run_target(stage), b"first prompts")
    first = artifact_path(stage)
    collected(tmp_path, "cllm_trajectories-m-second", 16, 2.0, run_target(stage), b"more prompts")
    second = artifact_path(stage)
    assert second != first and artifact_path(stage) == second
    other_seed = run_target(consistency_stage(tmp_path, 16, "cllm_trajectories-m", "model.random.seed=1"))
    collected(tmp_path, "cllm_trajectories-m-other-target", 16, 1.0, other_seed, b"its own prompts")
    assert find_trajectories(stage).name == "cllm_trajectories-m-second" and artifact_path(stage) == second
