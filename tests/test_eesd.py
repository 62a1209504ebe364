"""EESD: lossless greedy decoding, the shared first-N layers, Thompson-sampling controllers, training via the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import specrepro.decoding.draft_verify as draft_verify
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.controllers import BetaTS, CaliTS
from specrepro.decoding.eesd import (
    CalibrationPredictor,
    EarlyExitHead,
    EESDConfig,
    EESDDecoder,
    find_head,
    first_layers_hidden,
)
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.verify import keep_tree_path
from specrepro.errors import SpecReproError
from specrepro.training.distill_data import pack_batch
from tests.conftest import tiny_llama
from tests.test_runner import run_dirs, specrepro

GREEDY = Sampling()
SAMPLE = Sampling(do_sample=True)


def eesd(target, num_layers, control="fixed", k=3, exit_layer=True, shared_head=False, **extra):
    head = EarlyExitHead(target, num_layers, exit_layer, shared_head).eval()
    head.calibration = CalibrationPredictor(target.config.hidden_size)
    cfg = EESDConfig(
        num_layers=num_layers, control=control, k=k, exit_layer=exit_layer, shared_head=shared_head, **extra
    )
    return EESDDecoder(target, None, head, cfg)


@pytest.mark.parametrize("control", ["fixed", "beta_ts", "cali_ts"])
def test_greedy_eesd_equals_ar_for_every_layer_count_length_and_controller(control):
    target = tiny_llama(vocab_size=64, num_layers=4, logit_scale=3.0)
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    reference = ARDecoder(target).generate(prompt, GREEDY, 32).token_ids
    for num_layers, k, exit_layer, shared_head in (
        (1, 1, True, False),
        (2, 4, False, False),
        (3, 4, True, True),
        (3, 2, True, False),
    ):
        gen = eesd(target, num_layers, control, k, exit_layer, shared_head, k_max=6).generate(prompt, GREEDY, 32)
        assert gen.token_ids == reference, (num_layers, k, exit_layer, shared_head)
        assert sum(gen.drafted) > 0


@pytest.mark.parametrize("control", ["fixed", "beta_ts"])
def test_greedy_eesd_with_a_token_tree_equals_ar(control, monkeypatch):
    target = tiny_llama(vocab_size=64, num_layers=4, logit_scale=3.0)
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    reference = ARDecoder(target).generate(prompt, GREEDY, 40).token_ids
    paths = []
    monkeypatch.setattr(
        draft_verify,
        "keep_tree_path",
        lambda cache, committed, path: paths.append(path) or keep_tree_path(cache, committed, path),
    )
    for k, width in ((1, 4), (3, 2), (2, 5)):
        gen = eesd(target, 2, control, k, k_max=4, tree_width=width).generate(prompt, GREEDY, 40)
        assert gen.token_ids == reference, (k, width)
        assert max(gen.drafted) > k  # the siblings were verified too
    assert any(path and path[0] != 0 for path in paths)  # a sibling, not the chain, was accepted
    with pytest.raises(SpecReproError, match="tree_width"):
        eesd(target, 2, tree_width=0)


@pytest.mark.parametrize("control", ["beta_ts", "cali_ts"])
def test_a_thompson_round_drafts_at_least_k_min_tokens_and_stays_lossless(control):
    target = tiny_llama(vocab_size=64, num_layers=4, logit_scale=3.0)
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    reference = ARDecoder(target).generate(prompt, GREEDY, 32).token_ids
    free = eesd(target, 2, control, k_max=6).generate(prompt, GREEDY, 32)
    floored = eesd(target, 2, control, k_max=6, k_min=3).generate(prompt, GREEDY, 32)
    assert free.token_ids == floored.token_ids == reference
    assert min(free.drafted) < 3  # the samplers alone do stop early on this head
    produced = len(floored.token_ids) - sum(floored.accepted)  # tokens before the first round (prefill)
    for drafted, accepted in zip(floored.drafted, floored.accepted):
        assert drafted >= min(3, 32 - produced - 1)  # a round drafts k_min unless the output budget is shorter
        produced += accepted
    with pytest.raises(SpecReproError, match="k_min"):
        eesd(target, 2, control, k_max=2, k_min=3)


def test_greedy_eesd_with_a_reduced_draft_vocabulary_equals_ar():
    target = tiny_llama(vocab_size=64, num_layers=4, logit_scale=3.0)
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    reference = ARDecoder(target).generate(prompt, GREEDY, 32).token_ids
    vocab_ids = torch.tensor(sorted(set(reference))[::2] + [63])  # some target tokens cannot be drafted
    head = EarlyExitHead(target, 2, draft_vocab_ids=vocab_ids).eval()
    decoder = EESDDecoder(
        target, None, head, EESDConfig(num_layers=2, control="fixed", k=3, draft_vocab=len(vocab_ids))
    )
    gen = decoder.generate(prompt, GREEDY, 32)
    assert gen.token_ids == reference
    assert sum(gen.drafted) > 0
    hidden, layer = target.config.hidden_size, sum(p.numel() for p in target.model.layers[-1].parameters())
    assert gen.extra["extra_parameters"] == layer + hidden + len(vocab_ids) * hidden  # exit layer, norm, head rows
    with torch.no_grad():
        token, q, top1 = head.choose(
            head.logits(torch.randn(target.config.hidden_size)), SAMPLE, torch.Generator().manual_seed(0)
        )
        assert (q == 0).sum() == 64 - len(vocab_ids) and int(token) in vocab_ids.tolist() and 0 < top1 <= 1
        token, q, _ = head.choose(head.logits(torch.randn(target.config.hidden_size)), GREEDY, None)
        assert q is None and int(token) in vocab_ids.tolist()
    assert head.draft_index(torch.tensor([int(vocab_ids[1]), 1])).tolist() == [1, -100]


def test_draft_with_every_layer_but_the_last_is_the_target_itself():
    # N = L - 1 and an untrained exit layer copied from layer L: the draft computes exactly the target
    target = tiny_llama(vocab_size=64, num_layers=3)
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    gen = eesd(target, 2, "fixed", k=4).generate(prompt, GREEDY, 31)
    assert gen.token_ids == ARDecoder(target).generate(prompt, GREEDY, 31).token_ids
    assert [a - 1 for a in gen.accepted] == gen.drafted  # every draft accepted


def test_each_round_drafts_the_early_exit_models_greedy_chain_on_the_committed_tokens():
    """The exit layer's cache, carried across rounds, gives the drafts its from-scratch pass would."""
    target = tiny_llama(vocab_size=64, num_layers=4, logit_scale=3.0)
    decoder, rounds = eesd(target, 2, "fixed", k=3), []
    propose = decoder.propose

    def recorded_propose(state, tokens, *rest):
        rounds.append((tokens.clone(), propose(state, tokens, *rest)))
        return rounds[-1][1]

    decoder.propose = recorded_propose
    decoder.generate(torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3)), GREEDY, 30)
    for tokens, proposal in rounds:
        chain = tokens
        with torch.no_grad():
            for _ in range(len(proposal.drafts)):
                z = decoder.head.hidden(first_layers_hidden(target, chain, 2))[0, -1]
                chain = torch.cat([chain, decoder.head.logits(z).argmax().view(1, 1)], 1)
        assert proposal.drafts.tolist() == chain[0, tokens.shape[1] :].tolist()


def test_sampling_runs_through_speculative_verification():
    target = tiny_llama(vocab_size=64, num_layers=3)
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    gen = eesd(target, 1, "beta_ts").generate(prompt, Sampling(True, 0.8, 0, 1.0), 24, seed=1)
    assert len(gen.token_ids) == 24 and all(0 <= t < 64 for t in gen.token_ids)


def test_first_n_layer_hidden_states_equal_the_targets_own_with_and_without_the_shared_cache():
    from transformers import DynamicCache

    target = tiny_llama(vocab_size=64, num_layers=4)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = target(ids, output_hidden_states=True).hidden_states
        for n in (1, 2, 3):
            torch.testing.assert_close(first_layers_hidden(target, ids, n), reference[n])
            cache = DynamicCache(config=target.config)  # prefix in one chunk, then token by token, as when drafting
            rows = [first_layers_hidden(target, ids[:, :7], n, cache)]
            rows += [first_layers_hidden(target, ids[:, t : t + 1], n, cache) for t in range(7, 12)]
            torch.testing.assert_close(torch.cat(rows, 1), reference[n], rtol=1e-5, atol=1e-5)
            assert cache.get_seq_length(0) == 12 and cache.get_seq_length(n) == 0  # only the shared layers ran


def test_beta_ts_posterior_counts_follow_each_reading_of_q_v():
    rng = np.random.default_rng(0)
    r1 = BetaTS(1.0, 1.0, 8, rng, "literal_R1")
    r1.update(5, 2)  # r = a = 2, n = min(a + 2, k) = 4
    assert (r1.alpha, r1.beta) == (3.0, 3.0)
    r1.update(3, 3)  # all accepted: n = min(5, 3) = 3, no failure
    assert (r1.alpha, r1.beta) == (6.0, 3.0)
    r2 = BetaTS(1.0, 1.0, 8, rng, "literal_R2")
    r2.update(5, 2)  # r = a - 1 = 1, n = min(a + 1, k) = 3
    assert (r2.alpha, r2.beta) == (2.0, 3.0)
    r2.update(3, 0)  # r = -1, n = 1: alpha falls, beta gains 2
    assert (r2.alpha, r2.beta) == (1.0, 5.0)
    clean = BetaTS(1.0, 1.0, 8, rng, "clean")
    clean.update(5, 2)
    clean.update(3, 3)
    assert (clean.alpha, clean.beta) == (6.0, 2.0)
    # each keep-drafting draw is marginally Bernoulli(alpha / (alpha + beta))
    draws = [clean.keep_drafting(0.0) for _ in range(4000)]
    assert abs(np.mean(draws) - 6 / 8) < 0.03
    assert clean.next_length() == 8


def test_beta_ts_break_even_draws_once_a_round_and_drafts_while_theta_to_the_k_pays():
    confident = BetaTS(900.0, 100.0, 8, np.random.default_rng(0), decision="break_even", break_even=0.2)
    lengths = [confident.next_length() for _ in range(200)]  # theta ~ 0.9: 0.9^15 = 0.21, capped at k_max
    assert set(lengths) == {8} and all(confident.keep_drafting(0.0) for _ in range(20))
    middling = BetaTS(500.0, 500.0, 8, np.random.default_rng(0), decision="break_even", break_even=0.2)
    assert {middling.next_length() for _ in range(200)} == {2}  # theta ~ 0.5: 0.25 >= 0.2 > 0.125
    doubtful = BetaTS(1.0, 999.0, 8, np.random.default_rng(0), decision="break_even", break_even=0.2)
    assert {doubtful.next_length() for _ in range(200)} == {1}  # a round drafts at least one token
    uniform = BetaTS(1.0, 1.0, 8, np.random.default_rng(0), decision="break_even", break_even=0.2)
    assert len({uniform.next_length() for _ in range(200)}) > 3  # a wide posterior explores lengths
    with pytest.raises(SpecReproError, match="decision"):
        BetaTS(1.0, 1.0, 8, np.random.default_rng(0), decision="greedy")


def test_greedy_eesd_with_break_even_beta_ts_equals_ar():
    target = tiny_llama(vocab_size=64, num_layers=4, logit_scale=3.0)
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    reference = ARDecoder(target).generate(prompt, GREEDY, 32).token_ids
    gen = eesd(target, 2, "beta_ts", k_max=6, beta_decision="break_even").generate(prompt, GREEDY, 32)
    assert gen.token_ids == reference and sum(gen.drafted) > 0


@pytest.mark.parametrize("decision", ["bernoulli", "break_even"])
def test_beta_ts_steps_are_as_wide_as_its_longest_round(decision):
    """Compiled steps warm up to `max_step_width`: a break-even round drafts up to k_max once theta is high, whatever
    the prior's first draw says."""
    target = tiny_llama(vocab_size=64, seed=1)
    decoder = eesd(target, 1, "beta_ts", k_max=16, beta_decision=decision, shared_head=True)
    decoder.eos_ids = set()
    gen = decoder.generate([5, 6, 7, 8] * 6, GREEDY, 120)
    assert 1 + max(gen.drafted) <= decoder.max_step_width == 17


def test_cali_ts_posterior_and_theta_hat_updates_by_hand():
    cali = CaliTS(sigma_m=0.2, sigma_s=0.5, theta0=0.5, k_max=8, rng=np.random.default_rng(0))
    assert cali.posterior(0.9) == pytest.approx((0.9, 0.04))  # no verification yet: the model prior alone
    cali.update(4, 2)  # 3 committed tokens, 2 of them drafts: theta_hat = (0.5 * 1 + 2) / (0 + 3 + 1)
    assert (cali.theta_hat, cali.t, cali.n) == (pytest.approx(0.625), 3, 1)
    mu, var = cali.posterior(0.9)  # Eqs. 6-7 with n = 1
    assert mu == pytest.approx((0.25 * 0.9 + 0.04 * 0.625) / 0.29)
    assert var == pytest.approx(0.04 * 0.25 / 0.29)
    cali.update(3, 3)  # theta_hat = (0.625 * 4 + 3) / (3 + 4 + 1)
    assert cali.theta_hat == pytest.approx(0.6875)
    literal = CaliTS(0.2, 0.5, 0.5, 8, np.random.default_rng(0), theta_update="literal")
    literal.update(4, 2)  # Eq. 8 as printed counts every committed token as a success
    assert literal.theta_hat == pytest.approx((0.5 + 3) / 4)
    model_only = CaliTS(0.2, 0.5, 0.5, 8, np.random.default_rng(0), mode="model")
    model_only.update(4, 2)
    assert model_only.posterior(0.3) == pytest.approx((0.3, 0.04))
    sampling_only = CaliTS(0.2, 0.5, 0.5, 8, np.random.default_rng(0), mode="sampling")
    sampling_only.update(4, 2)
    assert sampling_only.posterior(None)[0] == pytest.approx(0.625)
    assert not sampling_only.needs_model_prediction
    always = CaliTS(1e-6, 0.5, 0.5, 8, np.random.default_rng(0), mode="model")
    assert all(always.keep_drafting(0.0, theta_model=1.0) for _ in range(50))
    assert not any(always.keep_drafting(0.0, theta_model=0.0) for _ in range(50))


def test_head_with_predictor_round_trips_and_untrained_predictor_says_one_half(tmp_path):
    target = tiny_llama(vocab_size=64, num_layers=3)
    head = EarlyExitHead(target, 1)
    head.calibration = CalibrationPredictor(target.config.hidden_size)
    d = target.config.hidden_size
    assert head.calibration.keep_probability(torch.randn(d), torch.randn(d), 12) == pytest.approx(0.5)
    with torch.no_grad():
        head.norm.weight.mul_(2.0)
    head.save_pretrained(tmp_path)
    loaded = EarlyExitHead.from_pretrained(tmp_path, target)
    torch.testing.assert_close(loaded.norm.weight, head.norm.weight)
    assert loaded.settings == {"num_layers": 1, "exit_layer": True, "shared_head": False, "draft_vocab": 0}
    assert loaded.calibration is not None
    reduced = EarlyExitHead(target, 1, draft_vocab_ids=torch.tensor([5, 2, 9]))
    reduced.save_pretrained(tmp_path / "reduced")
    loaded = EarlyExitHead.from_pretrained(tmp_path / "reduced", target)
    assert loaded.vocab_ids.tolist() == [5, 2, 9] and loaded.settings["draft_vocab"] == 3
    torch.testing.assert_close(loaded.lm_head.weight, target.lm_head.weight[[5, 2, 9]])
    (tmp_path / "artifact.json").write_text("{}")
    with pytest.raises(SpecReproError, match="no eesd head artifact"):
        find_head(
            str(tmp_path),
            tmp_path.parent,
            "tiny",
            {"num_layers": 2, "exit_layer": True, "shared_head": False, "draft_vocab": 0},
        )


def test_training_through_the_cli_publishes_a_head_that_decodes_losslessly(tmp_path):
    small = ["model=tiny_random", "method=eesd", "method.num_layers=1", "logger=none", "hardware.threads=1"]
    specrepro(
        "train",
        *small,
        "training.prompts.gsm8k.limit=4",
        "training.prompts.sharegpt.limit=2",
        "training.prompts.mbpp.limit=2",
        "training.continuation_tokens=8",
        "training.loop.steps=3",
        "training.calibration.sequences=4",
        "training.calibration.loop.steps=3",
        "training.calibration.loop.batch_size=16",
        cwd=tmp_path,
    )
    (artifact,) = (tmp_path / "results" / "artifacts").glob("eesd_head-tiny_random-*")
    metrics = json.loads((artifact / "artifact.json").read_text())["metrics"]
    assert {"heldout_top1_agreement_before", "heldout_top1_agreement_after", "calibration_examples"} <= set(metrics)
    specrepro(
        "run",
        "-m",
        *small,
        "method.control=fixed,cali_ts",
        "dataset=gsm8k",
        "dataset.limit=2",
        "decoding.max_new_tokens=8",
        "timing.warmup_tokens=4",
        cwd=tmp_path,
    )
    runs = {
        k: json.loads((p / "metrics.json").read_text()) for k, p in run_dirs(tmp_path).items() if k.startswith("eesd:")
    }
    assert len(runs) == 2
    assert all(m["lossless"] == 1.0 and m["hm"] is not None for m in runs.values())
    reduced = [*small, "method.draft_vocab=24", "method.control=fixed"]
    specrepro(
        "train",
        *reduced,
        "training.prompts.gsm8k.limit=4",
        "training.prompts.sharegpt.limit=2",
        "training.prompts.mbpp.limit=2",
        "training.continuation_tokens=8",
        "training.loop.steps=3",
        "training.calibration.sequences=0",
        "+dataset@training.labeled.gsm8k=gsm8k_train",
        "training.labeled.gsm8k.limit=3",
        "training.labeled_response_tokens=8",
        cwd=tmp_path,
    )
    specrepro(
        "run",
        *reduced,
        "dataset=gsm8k",
        "dataset.limit=2",
        "decoding.max_new_tokens=8",
        "timing.warmup_tokens=4",
        cwd=tmp_path,
    )
    (trained,) = [p for p in (tmp_path / "results" / "artifacts").glob("eesd_head-tiny_random-*") if p != artifact]
    trained_metrics = json.loads((trained / "artifact.json").read_text())["metrics"]
    assert 0 < trained_metrics["heldout_draft_vocab_coverage"] <= 1 and trained_metrics["train_sequences_labeled"] == 3
    runs = [
        json.loads((p / "metrics.json").read_text()) for k, p in run_dirs(tmp_path).items() if k.startswith("eesd:")
    ]
    assert len(runs) == 3 and all(m["lossless"] == 1.0 for m in runs)
    missing = specrepro(
        "run",
        *small[:2],
        "method.num_layers=1",
        "method.exit_layer=false",
        "logger=none",
        "dataset=gsm8k",
        "dataset.limit=1",
        "decoding.max_new_tokens=4",
        cwd=tmp_path,
        check=False,
    )
    assert missing.returncode == 2 and "no eesd head artifact" in missing.stderr


@pytest.mark.embedded
def test_greedy_eesd_is_token_identical_to_ar_on_the_embedded_model(embedded):
    tok = embedded.tokenizer
    prompts = [
        "Question: A baker makes 24 rolls and sells 15. How many are left?\nAnswer:",
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
        "The three primary colours are",
    ]
    head = EarlyExitHead(embedded.model, 3).eval()  # untrained: initialised from the target's last layer and head
    decoder = EESDDecoder(embedded.model, tok, head, EESDConfig(num_layers=3, control="fixed", k=3))
    ar = ARDecoder(embedded.model, tok)
    for text in prompts:
        ids = tok(text, return_tensors="pt").input_ids
        assert decoder.generate(ids, GREEDY, 64).token_ids == ar.generate(ids, GREEDY, 64).token_ids


def test_calibration_predictor_applies_the_position_map_of_each_draft_step():
    predictor = CalibrationPredictor(8)
    torch.manual_seed(0)
    torch.nn.init.normal_(predictor.classifier.weight)
    torch.nn.init.normal_(predictor.position_maps)
    target_hidden, draft_hidden, steps = torch.randn(5, 8), torch.randn(5, 8), torch.tensor([1, 3, 10, 12, 2])
    expected = torch.stack(
        [
            predictor.classifier(
                torch.cat([predictor.position_maps[min(i, 10) - 1] @ target_hidden[b], draft_hidden[b]])
            )
            for b, i in enumerate(steps.tolist())
        ]
    )
    torch.testing.assert_close(predictor(target_hidden, draft_hidden, steps), expected)  # Eq. 5, W^i capped at i = 10


def test_a_training_batch_teaches_the_continuation_itself_or_a_rows_target_labels():
    on_policy = {"prompt_ids": [3, 4, 5], "continuation_ids": [6, 7]}
    labeled = {"prompt_ids": [8], "continuation_ids": [9, 10, 11], "label_ids": [20, 21, 22]}
    batch = pack_batch([on_policy, labeled], pad_id=0, device="cpu", prompt_tokens=2)
    assert batch["input_ids"].tolist() == [[4, 5, 6, 7], [8, 9, 10, 11]]
    assert batch["target_mask"].tolist() == [[False, True, True, False], [True, True, True, False]]
    # position t predicts token t + 1: the next input on the target's own text, the target's argmax on human text
    assert batch["labels"][batch["target_mask"]].tolist() == [6, 7, 20, 21, 22]
