"""Jacobi decoding (004): greedy output equals `ar` on the same weights; per-step counters are consistent."""

from __future__ import annotations

from itertools import accumulate

import pytest
import torch

from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.jacobi import JacobiDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.errors import SpecReproError
from tests.conftest import tiny_llama

GREEDY = Sampling()


def prompts(vocab, n=3, length=20):
    rng = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (length,), generator=rng).tolist() for _ in range(n)] + [[5, 6, 7, 8] * 5]


@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.parametrize("block_size", [1, 2, 5, 16])
@pytest.mark.parametrize("logit_scale", [1.0, 30.0])
def test_jacobi_equals_ar(block_size, logit_scale, sliding):
    model = tiny_llama(vocab_size=64, seed=3, logit_scale=logit_scale)
    for seed, prompt in enumerate(prompts(64)):
        reference = ARDecoder(model).generate(prompt, GREEDY, 37)
        gen = JacobiDecoder(model, block_size=block_size, sliding=sliding).generate(prompt, GREEDY, 37, seed=seed)
        assert gen.token_ids == reference.token_ids
        assert sum(gen.accepted) + 1 == len(gen.token_ids)
        assert gen.steps == len(gen.extra["fast_forwarded"]) == len(gen.extra["stationary"])
        assert all(s <= f for s, f in zip(gen.extra["stationary"], gen.extra["fast_forwarded"]))
        assert all(d <= block_size - 1 for d in gen.drafted)
        if sliding:  # the state is topped back up to n - 1 guesses until the end is near
            done = accumulate([0, *gen.accepted])
            assert all(d == min(block_size - 1, 37 - 2 - n) for d, n in zip(gen.drafted, done))


def test_a_model_that_repeats_itself_fast_forwards():
    """Once the output settles into a repeated token, later positions are right before their prefix is."""
    model = tiny_llama(vocab_size=8, seed=0, logit_scale=30.0)
    model.generation_config.eos_token_id = None
    prompt = [1, 2, 3, 4] * 6
    gen = JacobiDecoder(model, block_size=8).generate(prompt, GREEDY, 64)
    assert gen.token_ids == ARDecoder(model).generate(prompt, GREEDY, 64).token_ids
    assert len(gen.token_ids) - 1 > gen.steps
    assert max(gen.extra["fast_forwarded"]) > 1 and sum(gen.extra["stationary"]) > 0


def test_an_eos_inside_a_fast_forwarded_block_cuts_its_counters():
    """The tokens an iteration fixes after an EOS are thrown away: they are neither fast-forwarded nor stationary."""
    model = tiny_llama(vocab_size=64, seed=2, logit_scale=3.0)
    prompt = list(range(3, 20))
    ar = ARDecoder(model)
    ar.eos_ids = set()
    reference = ar.generate(prompt, GREEDY, 40).token_ids  # settles into a repeated pair: long fast-forwards
    for eos in reference[1:16]:
        decoder = JacobiDecoder(model, block_size=16)
        decoder.eos_ids = {eos}
        gen = decoder.generate(prompt, GREEDY, 40)
        assert gen.extra["fast_forwarded"] == gen.accepted
        from_guesses = [a - 1 for a in gen.accepted[:-1]] + [gen.accepted[-1] - 1 + gen.last_step_cut]
        assert all(s <= g for s, g in zip(gen.extra["stationary"], from_guesses))


def test_jacobi_is_greedy_only():
    with pytest.raises(SpecReproError):
        JacobiDecoder(tiny_llama()).generate([3, 4, 5], Sampling(do_sample=True), 8)


@pytest.mark.embedded
def test_jacobi_reproduces_ar_on_the_embedded_model(embedded):
    tok = embedded.tokenizer
    questions = ["What is 12 times 7?", "Write a Python function that reverses a string.", "Name three colours."]
    for i, question in enumerate(questions):
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        reference = ARDecoder(embedded.model, tok).generate(ids, GREEDY, 64)
        for block_size, sliding in ((16, False), (4, True)):
            gen = JacobiDecoder(embedded.model, tok, block_size, sliding).generate(ids, GREEDY, 64, seed=i)
            assert gen.token_ids == reference.token_ids


class RecordedSteps:
    """The decoder's steps, recording each Jacobi iteration's (state, position of its first token, update)."""

    def __init__(self, steps):
        self.steps, self.records = steps, []

    def __getattr__(self, name):
        return getattr(self.steps, name)

    def __call__(self, state, cache, past=None, **kwargs):
        output = self.steps(state, cache, past=past, **kwargs)
        if past is not None:
            self.records.append((state[0].tolist(), past, output.logits[0].argmax(-1).tolist()))
        return output


@pytest.mark.parametrize("sliding", [False, True])
def test_the_next_state_and_the_stationary_count_follow_from_each_iteration(sliding):
    """Line 13 of Alg. 3: the next state's guesses are the update past the fixed prefix (a sliding window keeps the
    last position's prediction too); a fixed token is stationary where the previous state held it at its position."""
    model = tiny_llama(vocab_size=8, seed=0, logit_scale=30.0)
    model.generation_config.eos_token_id = None
    decoder = JacobiDecoder(model, block_size=8, sliding=sliding)
    decoder.steps = RecordedSteps(decoder.steps)
    gen = decoder.generate([1, 2, 3, 4] * 6, GREEDY, 64)
    records = decoder.steps.records
    previous: dict[int, int] = {}
    for (state, past, update), (following, _, _), stationary in zip(
        records, records[1:] + [([], 0, [])], gen.extra["stationary"]
    ):
        guesses = state[1:]
        n_fixed = next((i for i, guess in enumerate(guesses) if guess != update[i]), len(guesses))
        kept = len(guesses) - n_fixed - (not sliding)
        assert following[1 : 1 + kept] == update[n_fixed + 1 : n_fixed + 1 + kept][: len(following) - 1]
        assert stationary == sum(previous.get(past + 1 + i) == guesses[i] for i in range(n_fixed))
        previous = {past + 1 + i: guess for i, guess in enumerate(guesses)}
    assert sum(gen.extra["stationary"]) > 0
