"""Speculative sampling preserves the target distribution: a statistical test on a tiny vocabulary.

The exact joint distribution of the first 3 sampled tokens is enumerated from the target model; N
generations per arm (fixed seeds, so the test is deterministic) are compared with it by a chi-square
goodness-of-fit test. Bound: the lossless arms must not be rejected at significance 1e-3; a
deliberately wrong acceptance rule (accept every draft with q(x) > 0) must be rejected at 1e-6.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

import specrepro.decoding.draft_verify as draft_verify
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.eagle import EagleConfig, EagleDecoder, EagleDraft
from specrepro.decoding.eesd import EarlyExitHead, EESDConfig, EESDDecoder
from specrepro.decoding.pld import PLDConfig, PLDDecoder
from specrepro.decoding.sampling import Sampling, warp_logits
from specrepro.decoding.sar_draft import SARDraftConfig, SARDraftDecoder, head_for
from specrepro.decoding.self_sd import SelfSDConfig, SelfSDDecoder
from specrepro.decoding.sps import SPSDecoder
from tests.conftest import tiny_llama

VOCAB, LENGTH, N = 5, 3, 2000
SAMPLING = Sampling(do_sample=True, temperature=0.9, top_k=4, top_p=1.0)
PROMPT = [0, 3, 4, 0, 3]


@pytest.fixture(scope="module")
def models():
    return tiny_llama(VOCAB, seed=3, logit_scale=4.0), tiny_llama(VOCAB, seed=4, num_layers=1, logit_scale=4.0)


def exact_distribution(model) -> dict[tuple, float]:
    """P(first LENGTH tokens) under the warped target, by enumeration."""

    def step_probs(prefix):
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1]
        return warp_logits(logits, SAMPLING).softmax(-1)

    dist = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        p = 1.0
        for i in range(LENGTH):
            p *= float(step_probs(seq[:i])[seq[i]])
        dist[seq] = p
    return dist


def p_value(decoder, exact) -> float:
    decoder.eos_ids = set()
    counts = Counter(tuple(decoder.generate(PROMPT, SAMPLING, LENGTH, seed=s).token_ids) for s in range(N))
    # merge outcomes with expected count < 5 into one cell, as chi-square needs
    big = [seq for seq, p in exact.items() if p * N >= 5]
    observed = [counts[seq] for seq in big] + [N - sum(counts[seq] for seq in big)]
    expected = [exact[seq] * N for seq in big] + [N - sum(exact[seq] * N for seq in big)]
    return chisquare(observed, expected).pvalue


def accept_whenever_draft_possible(drafts, draft_probs, target_logits, sampling, rng):
    """A WRONG rule: accept every draft token that q gives positive mass, then a bonus token from p."""
    p = warp_logits(target_logits, sampling).softmax(-1)
    bonus = int(torch.multinomial(p[len(drafts)], 1, generator=rng))
    return drafts.tolist() + [bonus], len(drafts)


@pytest.fixture(scope="module")
def exact(models):
    return exact_distribution(models[0])


def test_ar_sampling_matches_the_exact_distribution(models, exact):
    assert p_value(ARDecoder(models[0]), exact) > 1e-3


def test_sps_preserves_the_target_distribution(models, exact):
    target, draft = models
    assert p_value(SPSDecoder(target, None, draft, 2, "fixed", 4), exact) > 1e-3


def test_pld_sampling_preserves_the_target_distribution(models, exact):
    # one-hot drafts (q = None): accept with p(x), resample from p without x
    assert p_value(PLDDecoder(models[0], None, PLDConfig(num_pred_tokens=2, max_ngram=2)), exact) > 1e-3


def test_eesd_with_a_reduced_draft_vocabulary_preserves_the_target_distribution(models, exact):
    # q is zero outside the draft vocabulary: the residual norm(max(p - q, 0)) restores those tokens' mass
    target = models[0]
    head = EarlyExitHead(target, 1, draft_vocab_ids=torch.tensor([3, 0, 4])).eval()
    cfg = EESDConfig(num_layers=1, control="fixed", k=2, draft_vocab=3)
    assert p_value(EESDDecoder(target, None, head, cfg), exact) > 1e-3


@pytest.mark.parametrize("vocab_ids", [None, [3, 0, 4]])
def test_eesd_with_a_token_tree_preserves_the_target_distribution(models, exact, vocab_ids):
    # a sampled chain (its q) and deterministic siblings (one-hot q), one speculative stage per child
    target = models[0]
    head = EarlyExitHead(target, 1, draft_vocab_ids=None if vocab_ids is None else torch.tensor(vocab_ids)).eval()
    cfg = EESDConfig(num_layers=1, control="fixed", k=2, draft_vocab=len(vocab_ids or []), tree_width=3)
    assert p_value(EESDDecoder(target, None, head, cfg), exact) > 1e-3


@pytest.mark.parametrize("tree_width", [1, 3])
def test_self_sd_with_a_reduced_draft_vocabulary_preserves_the_target_distribution(models, exact, tree_width):
    # the draft vocabulary: token 1 (the corpus' most frequent) + the prompt's 0, 3, 4; token 2 has q = 0
    cfg = SelfSDConfig(control="fixed", k=2, draft_vocab=1, tree_width=tree_width)
    decoder = SelfSDDecoder(models[0], None, [1], [0], cfg, vocab_ranking=torch.tensor([1, 2]))
    assert p_value(decoder, exact) > 1e-3


@pytest.mark.parametrize("tree_width", [1, 3])
def test_sps_with_a_reduced_draft_vocabulary_and_a_tree_preserves_the_target_distribution(models, exact, tree_width):
    # the draft vocabulary: token 1 + the prompt's 0, 3, 4 (token 2 has q = 0); siblings are deterministic
    target, draft = models
    decoder = SPSDecoder(target, None, draft, 2, "fixed", 16, tree_width=tree_width, frequent=torch.tensor([1]))
    assert p_value(decoder, exact) > 1e-3


def test_sar_draft_with_a_token_tree_preserves_the_target_distribution(models, exact):
    target = models[0]
    torch.manual_seed(0)
    head = head_for(target, "block", 2, 8, 1).eval()
    cfg = SARDraftConfig(variant="block", k=2, k_max=2, head_k=2, tree_width=3)
    assert p_value(SARDraftDecoder(target, None, head, cfg), exact) > 1e-3


def test_eagle_dynamic_tree_preserves_the_target_distribution(models, exact):
    target = models[0]
    torch.manual_seed(0)
    draft = EagleDraft(target.config).eval().attach_lm_head(target.lm_head)
    cfg = EagleConfig(depth=2, top_k=2, total_tokens=4, head="none")  # two top-2 levels: siblings at both depths
    assert p_value(EagleDecoder(target, None, draft, cfg), exact) > 1e-3


def test_wrong_acceptance_rule_is_detected(models, exact, monkeypatch):
    monkeypatch.setattr(draft_verify, "speculative_verify", accept_whenever_draft_possible)
    target, draft = models
    assert p_value(SPSDecoder(target, None, draft, 2, "fixed", 4), exact) < 1e-6
