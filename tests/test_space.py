"""SPACE (000): the block's mask and positions (Eq. 5-7), cache surgery, losslessness, SAR-SFT samples, CLI."""

from __future__ import annotations

import json
import random

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import DynamicCache

from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.space import SpaceConfig, SpaceDecoder, block_layout
from specrepro.decoding.verify import additive_mask
from specrepro.errors import SpecReproError
from specrepro.metrics.speed import speed_metrics
from specrepro.models.loading import LoadedModel, load_model
from specrepro.training.space_sft import IGNORE, add_mask_token, grouped_sample, pad_batch, sar_sample, sar_sft_loss
from tests.conftest import tiny_llama
from tests.test_lossless_sampling import VOCAB, exact, models, p_value  # noqa: F401  (fixtures)
from tests.test_runner import run_dirs, specrepro

GREEDY = Sampling()
MASK = 63


def test_block_layout_is_figure_3():
    """k = 2: `LLMs are [M] [M] auto [M] [M] model [M] [M]` from `are` on; rows are queries. The block is
    stored real slots first (are auto model, then each group's masks): `figure` reorders it as Fig. 3."""
    stored_allow, stored_offsets = block_layout(2)
    figure = [0, 3, 4, 1, 5, 6, 2, 7, 8]
    allow, offsets = stored_allow[figure][:, figure], stored_offsets[figure]
    figure_3 = [  # columns: are [M] [M] auto [M] [M] model [M] [M]
        [1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 0, 0, 0],
        [1, 0, 0, 1, 1, 0, 0, 0, 0],
        [1, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 0, 0, 1, 0, 0, 1, 1, 0],
        [1, 0, 0, 1, 0, 0, 1, 1, 1],
    ]
    assert allow.int().tolist() == figure_3
    assert offsets.tolist() == (allow.sum(-1) - 1).tolist()  # Eq. 7 with no cached prefix
    allow5, _ = block_layout(5)  # the prose, not Eq. 6's literal i - j < k: no mask sees an earlier group's masks
    group_0, group_1 = range(6, 11), range(11, 16)
    assert not allow5[group_1][:, group_0].any() and allow5[group_1[1], group_1[0]] and allow5[group_1[0], 1]


def test_one_block_equals_plain_causal_forwards():
    """Real slots give AR's logits; mask group g gives the logits of [prefix, anchor, c_1..c_g, [M]*k] (training
    layout)."""
    model, k = tiny_llama(seed=1), 3
    prefix, anchor, candidates = list(range(3, 15)), 20, [21, 22, 23]
    cache = DynamicCache(config=model.config)
    model(torch.tensor([prefix]), cache=cache)
    allow, offsets = block_layout(k)
    block = [anchor] + candidates + [MASK] * k * (k + 1)
    full = torch.cat([torch.ones(len(block), len(prefix), dtype=torch.bool), allow], 1)
    with torch.no_grad():
        logits = model(
            torch.tensor([block]),
            cache=cache,
            position_ids=(len(prefix) + offsets)[None],
            attention_mask=additive_mask(full, model.dtype),
        ).logits[0]
        for g in range(k + 1):
            plain = model(torch.tensor([prefix + [anchor] + candidates[:g] + [MASK] * k])).logits[0, -(k + 1) :]
            group = logits[k + 1 + g * k : k + 1 + (g + 1) * k]
            assert torch.allclose(torch.cat([logits[g : g + 1], group]), plain, atol=1e-5)


class OracleSpace(SpaceDecoder):
    """Candidates from a known greedy continuation, with every `wrong_every`-th one corrupted."""

    def __init__(self, model, continuation: list[int], wrong_every: int, k: int):
        super().__init__(model, None, MASK, k)
        self.continuation, self.wrong_every = continuation, wrong_every

    def _decode(self, prompt_ids, sampling, out, rng):
        self.out = out
        super()._decode(prompt_ids, sampling, out, rng)

    def _draft(self, mask_logits, sampling, rng):
        start = len(self.out.gen.token_ids)
        guess = (self.continuation + [0] * self.k)[start : start + self.k]
        guess = [tok if (start + j) % self.wrong_every else (tok + 1) % MASK for j, tok in enumerate(guess)]
        return torch.tensor(guess), None


@pytest.mark.parametrize("wrong_every,k", [(1000, 4), (3, 4), (5, 2), (2, 5)])
def test_cache_surgery_with_accepted_candidates(wrong_every, k):
    model, prompt = tiny_llama(seed=2, logit_scale=3.0), list(range(3, 20))
    ar = ARDecoder(model).generate(prompt, GREEDY, 40).token_ids
    gen = OracleSpace(model, ar, wrong_every, k).generate(prompt, GREEDY, 40)
    assert gen.token_ids == ar
    assert max(gen.accepted) == k + 1 if wrong_every > k + 1 else max(gen.accepted) > 1


@pytest.mark.parametrize("eos_at", [9, 10, 11])
def test_accepted_per_position_counts_no_candidate_past_an_eos(eos_at):
    """A step cut at an EOS inside its accepted candidates counts only the candidates it committed."""
    model, prompt = tiny_llama(seed=2, logit_scale=3.0), list(range(3, 20))
    ar = ARDecoder(model).generate(prompt, GREEDY, 40).token_ids
    decoder = OracleSpace(model, ar, 1000, 4)
    decoder.eos_ids = {ar[eos_at]}
    gen = decoder.generate(prompt, GREEDY, 40)
    assert gen.token_ids == ar[: ar.index(ar[eos_at]) + 1]
    committed_drafts = sum(gen.accepted) - gen.steps + gen.last_step_cut  # a cut step kept drafts only
    assert sum(gen.extra["accepted_per_position"]) == committed_drafts


@pytest.mark.parametrize("budget", [13, 14, 16, 20])
def test_right_candidates_cut_by_the_budget_are_not_counted_as_rejected(budget):
    """With every candidate right, the acceptance rate is 1 at any budget: the last step drafts only what the
    budget can still commit, as the shared loop does (at 14 tokens, k = 5 counted 5 drafted of which 3 fit)."""
    model, prompt = tiny_llama(seed=2, logit_scale=3.0), list(range(3, 20))
    ar = ARDecoder(model)
    ar.eos_ids = set()
    continuation = ar.generate(prompt, GREEDY, budget).token_ids
    decoder = OracleSpace(model, continuation, 1000, 5)
    decoder.eos_ids = set()
    gen = decoder.generate(prompt, GREEDY, budget)
    assert gen.token_ids == continuation
    assert speed_metrics([gen.to_dict()])["accept_rate"] == 1.0


@pytest.mark.parametrize("seed", range(3))
def test_greedy_space_equals_ar_with_untrained_masks(seed):
    model, prompt = tiny_llama(seed=seed, logit_scale=3.0), list(range(3, 20))
    ar = ARDecoder(model).generate(prompt, GREEDY, 32).token_ids
    for k in (1, 3, 5):
        assert SpaceDecoder(model, None, MASK, k).generate(prompt, GREEDY, 32).token_ids == ar


def test_exact_space_sampling_preserves_the_target_distribution(models, exact):  # noqa: F811
    assert p_value(SpaceDecoder(models[0], None, VOCAB - 1, k=2), exact) > 1e-3


def test_sar_sample_alignment():
    prompt, response = [1, 2, 3], [10, 11, 12, 13, 14, 15, 16]
    ar = sar_sample(prompt, response, k=2, p_ar=1.0, mask_id=99, rng=random.Random(0))
    assert ar["input_ids"] == prompt + response and ar["labels"] == [IGNORE] * 3 + response
    sar = sar_sample(prompt, response, k=2, p_ar=0.0, mask_id=99, rng=random.Random(0))
    m = len(sar["input_ids"]) - 3 - 3  # prompt + y_<m + (k + 1) masks
    assert sar["input_ids"] == prompt + response[:m] + [99] * 3
    assert sar["labels"] == [IGNORE] * 3 + response[: m + 3]  # last real token -> y_m, mask j -> y_{m+j}
    assert sar["is_mask"] == [False] * (3 + m) + [True] * 3
    short = sar_sample(prompt, response[:2], k=2, p_ar=0.0, mask_id=99, rng=random.Random(0))
    assert 99 not in short["input_ids"]  # N < k + 1 falls back to AR


def test_sar_sft_loss_trains_the_masks():
    model = tiny_llama(seed=3)
    rng = random.Random(0)
    samples = [sar_sample([1, 2, 3], list(range(10, 30)), 3, 0.5, MASK, rng) for _ in range(4)]
    loss, logs = sar_sft_loss(model, pad_batch(samples, 0, torch.device("cpu")), mask_loss_weight=2.0)
    loss.backward()
    assert loss > 0 and "mask_loss" in logs and model.model.embed_tokens.weight.grad[MASK].abs().sum() > 0


def test_grouped_sample_trains_what_the_one_cut_layout_trains():
    """Every mask group of a grouped sample gets the logits and labels of the paper's one-cut sample at its anchor."""
    model = tiny_llama(seed=3).eval()
    prompt, response, k = [1, 2, 3], list(range(10, 30)), 3
    grouped = grouped_sample(prompt, response, k, groups=4, p_ar=0.0, mask_id=MASK, rng=random.Random(1))
    batch = pad_batch([grouped], 0, torch.device("cpu"))
    assert batch["input_ids"][0, : len(prompt) + len(response)].tolist() == prompt + response  # AR loss on all of Y
    logits = model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"]
    ).logits[0]
    anchors = sorted(set(a for a in grouped["anchor"][:-1] if a >= 0))  # the last mask is the dummy
    assert len(anchors) == 4
    for g, at in enumerate(anchors):
        m = at - len(prompt) + 1  # the one-cut sample with y_<m real: its last real token is the anchor
        alone = prompt + response[:m] + [MASK] * k
        expected = model(input_ids=torch.tensor([alone])).logits[0, -k:]
        first = len(prompt) + len(response) + g * k
        torch.testing.assert_close(logits[first : first + k], expected, atol=1e-5, rtol=1e-4)
        assert grouped["labels"][first + 1 : first + k + 1] == response[m + 1 : m + k + 1]  # mask j -> y_{m+j}


def test_training_a_sar_sft_checkpoint_again_keeps_its_trained_mask():
    model = tiny_llama()
    model.config.space_mask_token_id = MASK
    embeddings = model.get_input_embeddings().weight.clone()
    assert add_mask_token(model, None, None) == MASK
    assert torch.equal(model.get_input_embeddings().weight, embeddings)


def test_space_refuses_a_model_without_mask_token():
    with pytest.raises(SpecReproError, match="SAR-SFT"):
        SpaceDecoder.from_config(SpaceConfig(), LoadedModel(model=tiny_llama(), tokenizer=None, name="tiny"), None)


def test_sar_sft_then_lossless_space_run(tmp_path):
    """`train method=space` (LoRA with the [M] row trainable) then `run method=space` on the checkpoint: lossless.
    The artifact is the adapter alone; loading merges it into the base model, the trained [M] row included."""
    limits = [f"training.data.{name}.limit=3" for name in ("sharegpt", "gsm8k", "mbpp", "spider")]
    specrepro(
        "train",
        "method=space",
        "model=tiny_random",
        "logger=none",
        "hardware.threads=1",
        "training.loop.steps=3",
        "training.eval_tokens=8",
        "training.heldout_prompts=2",
        "training.lora.r=4",
        *limits,
        cwd=tmp_path,
    )
    [checkpoint] = (tmp_path / "results" / "artifacts").glob("space-*")
    config = json.loads((checkpoint / "config.json").read_text())
    mask_id = config["space_mask_token_id"]
    assert config["space_k"] == 6 and mask_id == config["vocab_size"] - 1
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    trained_rows = [
        v for k, v in load_file(checkpoint / "adapter_model.safetensors").items() if "trainable_tokens" in k
    ]
    loaded = load_model(
        OmegaConf.create({"source": "artifact", "id": str(checkpoint), "name": "space"}),
        torch.device("cpu"),
        torch.float32,
    )
    assert loaded.model.config.space_mask_token_id == mask_id and not hasattr(loaded.model, "peft_config")
    for matrix in (loaded.model.get_input_embeddings().weight, loaded.model.get_output_embeddings().weight):
        assert any(torch.equal(matrix[mask_id], row.reshape(-1)) for row in trained_rows)
    assert json.loads((checkpoint / "artifact.json").read_text())["metrics"]["sar_samples"] > 0
    specrepro(
        "run",
        "model=tiny_random",
        "model.source=artifact",
        "model.id=space",
        "method=space",
        "method.k=3",
        "dataset=gsm8k",
        "dataset.limit=2",
        "decoding.max_new_tokens=12",
        "timing.warmup_tokens=4",
        "hardware.threads=1",
        "logger=none",
        cwd=tmp_path,
    )
    [space_run] = [p for name, p in run_dirs(tmp_path).items() if name.startswith("space:")]
    assert json.loads((space_run / "metrics.json").read_text())["lossless"] == 1.0
    proc = specrepro(
        "run", "model=tiny_random", "method=space", "dataset.limit=1", "logger=none", cwd=tmp_path, check=False
    )
    assert proc.returncode == 2 and "model.source=artifact" in proc.stderr.strip().splitlines()[-1]
