"""Lookahead decoding: the n-gram pool, the candidate trie, the window's mask, losslessness on tiny LLaMAs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specrepro import decoding
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.lookahead import LookaheadConfig, LookaheadDecoder, NgramPool, candidate_trie, window_tree
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.verify import tree_attention
from specrepro.errors import SpecReproError
from tests.test_decoding import prompts
from tests.conftest import greedy_beside_ar, host_reads
from tests.test_lossless_sampling import exact, models, p_value  # noqa: F401  (module fixtures)

GREEDY = Sampling()


def test_the_pool_keeps_the_most_recent_continuations_of_each_first_token():
    pool = NgramPool(size=2)
    for ngram in [(1, 2, 3), (1, 4, 5), (7, 8, 9), (1, 2, 3), (1, 6, 6)]:
        pool.add(ngram)
    assert pool.candidates(1) == [(6, 6), (2, 3)]  # (4, 5) was the oldest when the third came
    assert pool.candidates(7) == [(8, 9)] and pool.candidates(2) == []


def test_candidates_merge_into_a_trie_cut_at_the_depth():
    tokens, parents = candidate_trie([(2, 3, 4), (2, 5, 6), (7, 8, 9)], depth=2)
    assert tokens == [2, 3, 5, 7, 8] and parents == [-1, 0, 0, -1, 3]


def test_the_window_is_a_tree_whose_ancestors_are_the_papers_mask():
    levels = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]  # W = 3, N = 4
    tokens, parents, newest = window_tree(levels, first_node=2)  # two verification nodes come first
    assert tokens == [10, 11, 12, 20, 21, 22, 30, 31, 32]
    assert parents == [-1, 2, 3, 2, 3, 4, 5, 6, 7] and newest == [8, 9, 10]
    allow, positions = tree_attention([-1, 0] + parents, past=5)
    row = 1 + 9  # level 2, column 1 (node 9): the cache, the last token, level 0's columns 0-1, level 1's column 1
    seen = allow[row, 5:].nonzero().flatten().tolist()
    assert seen == [0, 1 + 2, 1 + 3, 1 + 6, 1 + 9]
    assert positions[row] == 5 + 1 + 1 + 2  # t + 1 + i + l, t = 5


def test_a_step_reads_the_newest_levels_rows_and_adds_each_columns_ngram_to_the_pool(target):
    """W = 2, N = 3: a full window of two levels; the forward's argmax on the newest level's rows is the next
    level, each column read down the levels plus it is an n-gram keyed by its first token, the oldest level goes."""
    decoder = LookaheadDecoder(target, None, LookaheadConfig(window=2, ngram=3, guesses=2))
    state = decoder.start(None, None, 0)
    state.pool.add((7, 8, 9))
    state.last_token, state.levels = 7, [[10, 11], [20, 21]]
    proposal = decoder.propose(state, torch.tensor([[1, 2, 7]]), 2, GREEDY, None, decoder.new_controller())
    drafts = proposal.drafts.tolist()
    assert drafts[:2] == [8, 9] and [drafts[row - 1] for row in state.newest_rows] == [20, 21]
    logits = torch.zeros(1, 1 + len(drafts), 64)
    logits[0, state.newest_rows[0], 30] = logits[0, state.newest_rows[1], 31] = 1.0
    decoder.after_verify(state, torch.tensor([[1, 2, 7, 8, 5]]), SimpleNamespace(logits=logits), [0, 1])
    assert state.levels == [[20, 21], [30, 31]] and state.last_token == 5
    assert state.pool.candidates(10) == [(20, 30)] and state.pool.candidates(11) == [(21, 31)]


@pytest.mark.parametrize("option", [{"window": 0}, {"ngram": 1}, {"guesses": 0}])
def test_a_bad_option_is_refused_in_one_line(option):
    with pytest.raises(SpecReproError, match=f"method.{next(iter(option))}"):
        LookaheadConfig(**option)


@pytest.mark.parametrize(
    "cfg",
    [LookaheadConfig(), LookaheadConfig(window=4, ngram=3, guesses=3), LookaheadConfig(window=2, ngram=2, guesses=1)],
)
def test_greedy_equals_ar(target, cfg):
    decoder, ar = LookaheadDecoder(target, None, cfg), ARDecoder(target)
    assert len(list(greedy_beside_ar(decoder, ar, prompts()))) == 2 * 3 * len(prompts())


def test_the_pool_cuts_the_steps_on_a_repetitive_prompt(target):
    decoder, ar = LookaheadDecoder(target, None, LookaheadConfig(window=4, ngram=3, guesses=3)), ARDecoder(target)
    decoder.eos_ids = ar.eos_ids = set()
    prompt = prompts()[-1]
    reference, gen = ar.generate(prompt, GREEDY, 60), decoder.generate(prompt, GREEDY, 60)
    assert gen.token_ids == reference.token_ids and gen.steps < reference.steps


def test_the_config_is_the_papers_setting(target):
    cfg = decoding.validate_method_config({"name": "lookahead"})
    assert (cfg.window, cfg.ngram, cfg.guesses) == (15, 5, 15)
    assert LookaheadDecoder(target, None, cfg).max_step_width == 121


def test_sampling_preserves_the_target_distribution(models, exact):  # noqa: F811
    cfg = LookaheadConfig(window=2, ngram=2, guesses=2)
    assert p_value(LookaheadDecoder(models[0], None, cfg), exact) > 1e-3


def test_a_round_reads_the_device_for_its_window_and_its_verification(target):
    """After a verification, the window's new level and the newest token are read at once (the verification branch
    looks its n-grams up on the host); the verification reads once more. A generation adds the prefill's token, its
    newest token and the first window's picks from the context."""
    decoder = LookaheadDecoder(target, None, LookaheadConfig(window=4, ngram=3, guesses=3))
    decoder.eos_ids = set()
    rounds = decoder.generate(prompts()[0], Sampling(), 41).steps
    assert host_reads(decoder, prompts()[0], 41) <= 3 + 2 * rounds
