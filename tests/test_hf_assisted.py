"""`hf_assisted` counts transformers' own steps: every step commits what it verified, nothing more."""

from __future__ import annotations

import copy

import pytest
import torch

from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.hf_assisted import HFAssistedConfig, HFAssistedDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.metrics.speed import speed_metrics
from tests.conftest import tiny_llama

GREEDY = Sampling()
CYCLE = [5, 6, 7, 8] * 6  # this target continues it with 22, 38, 22, 38, ...
PROMPTS = {
    "drafts_after_prefill": CYCLE,
    "drafts_at_prefill": CYCLE + [22, 38] * 3,  # the prompt already holds the continuation: the prefill verifies drafts
    "random": torch.randint(3, 64, (24,), generator=torch.Generator().manual_seed(2)).tolist(),
}


def generate_counting_forwards(decoder, prompt, sampling, max_new_tokens=40):
    forwards = []
    hook = decoder.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        gen = decoder.generate(prompt, sampling, max_new_tokens)
    finally:
        hook.remove()
    return gen, len(forwards)


def assert_step_invariants(gen, forwards):
    assert gen.steps == len(gen.accepted) == len(gen.drafted)
    assert all(a >= 1 for a in gen.accepted)  # a step commits its bonus/correction token at least
    assert all(a <= d + 1 for a, d in zip(gen.accepted, gen.drafted))  # and at most its drafts besides
    assert sum(gen.accepted) + 1 == len(gen.token_ids)  # the prefill commits the first token
    assert sum(gen.accepted) / gen.steps <= max(gen.drafted) + 1  # MAT
    assert forwards - 1 <= gen.steps <= forwards  # one target forward per step (the prefill's own may verify drafts)


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_prompt_lookup_steps_are_what_each_forward_verified(target, prompt):
    ids = PROMPTS[prompt]
    decoder = HFAssistedDecoder(target, None, HFAssistedConfig(mode="prompt_lookup"))
    gen, forwards = generate_counting_forwards(decoder, ids, GREEDY)
    assert gen.token_ids == ARDecoder(target).generate(ids, GREEDY, 40).token_ids
    assert_step_invariants(gen, forwards)
    if prompt.startswith("drafts"):
        assert max(gen.accepted) > 1 and sum(gen.drafted) > 0  # drafts were accepted, in several steps
        assert gen.steps > 3


def test_plain_generate_commits_one_token_per_step(target):
    decoder = HFAssistedDecoder(target, None, HFAssistedConfig(mode="plain"))
    for ids in PROMPTS.values():
        gen, forwards = generate_counting_forwards(decoder, ids, GREEDY)
        assert gen.accepted == [1] * gen.steps and gen.drafted == [0] * gen.steps
        assert gen.steps == forwards - 1 == len(gen.token_ids) - 1


def test_assistant_and_sampled_steps_keep_the_invariants(target, draft):
    assistant = HFAssistedDecoder(target, None, HFAssistedConfig(mode="assistant"), assistant=draft)
    lookup = HFAssistedDecoder(target, None, HFAssistedConfig(mode="prompt_lookup"))
    sampled = Sampling(do_sample=True, temperature=0.7)
    for decoder, sampling in ((assistant, GREEDY), (assistant, sampled), (lookup, sampled)):
        for ids in PROMPTS.values():
            assert_step_invariants(*generate_counting_forwards(decoder, ids, sampling))


def test_a_step_cut_at_a_drafted_eos_counts_its_tokens_as_drafts(target):
    """An assistant that drafts the target's own tokens has all its drafts accepted, in the step that ends at a drafted
    EOS too: transformers keeps no token of its own after it, so that step committed drafts only (the acceptance
    rate read 0.75 for 1.00 before the step was counted as cut)."""
    ar = ARDecoder(target)
    ar.eos_ids = set()
    prompt = PROMPTS["random"]
    free = ar.generate(prompt, GREEDY, 40).token_ids
    eos = next(t for i, t in enumerate(free) if i > 9 and i % 9 and t not in free[:i])  # mid-step, not a bonus token
    assistant = HFAssistedConfig(mode="assistant", num_assistant_tokens=8)
    decoder = HFAssistedDecoder(target, None, assistant, assistant=copy.deepcopy(target))
    decoder.eos_ids = {eos}
    gen = decoder.generate(prompt, GREEDY, 40)
    assert gen.token_ids == free[: free.index(eos) + 1] and gen.last_step_cut
    assert speed_metrics([gen.to_dict()])["accept_rate"] == 1.0


@pytest.mark.parametrize("mode", ["plain", "prompt_lookup", "assistant"])
def test_a_checkpoints_generation_config_does_not_change_what_generate_decodes(mode):
    """`generate` fills every setting it is not given from the model's generation_config: a checkpoint's repetition
    penalty (Qwen2.5-Instruct's is 1.05) or no-repeat n-gram size made hf_assisted's greedy output differ from `ar`'s
    in every mode. It decodes by the run's settings alone now, and leaves both models' generation_config as they
    were."""
    target, assistant = tiny_llama(vocab_size=64, seed=1), tiny_llama(vocab_size=64, seed=2, num_layers=1)
    for model in (target, assistant):
        model.generation_config.repetition_penalty = 1.3
        model.generation_config.no_repeat_ngram_size = 2
    decoder = HFAssistedDecoder(target, None, HFAssistedConfig(mode=mode), assistant=assistant)
    for ids in PROMPTS.values():
        assert decoder.generate(ids, GREEDY, 40).token_ids == ARDecoder(target).generate(ids, GREEDY, 40).token_ids
    for model in (target, assistant):
        assert (model.generation_config.repetition_penalty, model.generation_config.no_repeat_ngram_size) == (1.3, 2)
