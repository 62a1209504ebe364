"""self_sd (Draft & Verify, 002): layer-skip drafting, adaptive draft exit, skip-set search."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from specrepro.cli import CONF_DIR
from specrepro.config import register_configs
from specrepro.decoding import draft_verify, draft_vocab
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.controllers import AdaptiveDraftExit
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.self_sd import SelfSDConfig, SelfSDDecoder, SkipSet, skipped_sublayers
from specrepro.decoding.verify import keep_tree_path
from specrepro.errors import SpecReproError
from tests.conftest import tiny_llama
from tests.test_runner import FAST, run_dirs, specrepro

GREEDY = Sampling()
SKIP_SETS = [([1], [2]), ([0, 2], [0]), ([3], []), ([], [1, 2]), ([0, 1, 2, 3], [0, 1, 2, 3])]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and much faster than with two on a shared, busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sharp_model():
    # sharp distributions: drafts are confident, so the adaptive exit drafts several tokens per step
    return tiny_llama(vocab_size=64, seed=3, num_layers=4, logit_scale=8.0)


@pytest.mark.parametrize("attn_skip,mlp_skip", SKIP_SETS)
@pytest.mark.parametrize("control", ["adaptive", "fixed"])
def test_greedy_self_sd_equals_ar(sharp_model, attn_skip, mlp_skip, control):
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    reference = ARDecoder(sharp_model).generate(prompt, GREEDY, 40).token_ids
    decoder = SelfSDDecoder(sharp_model, None, attn_skip, mlp_skip, SelfSDConfig(control=control, k=5))
    for _ in range(2):  # the second generation starts from the first one's gamma
        gen = decoder.generate(prompt, GREEDY, 40)
        assert gen.token_ids == reference
        assert sum(gen.accepted) == len(gen.token_ids) - 1
        assert max(gen.drafted) <= 5
        if control == "fixed":  # k drafts per step until the budget caps them
            assert gen.drafted[0] == 5


def test_greedy_self_sd_with_a_token_tree_equals_ar(sharp_model, monkeypatch):
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    reference = ARDecoder(sharp_model).generate(prompt, GREEDY, 40).token_ids
    paths = []
    monkeypatch.setattr(
        draft_verify,
        "keep_tree_path",
        lambda cache, committed, path: paths.append(path) or keep_tree_path(cache, committed, path),
    )
    for control, k, width in (("fixed", 1, 4), ("fixed", 2, 4), ("adaptive", 5, 3)):
        gen = SelfSDDecoder(sharp_model, None, [1, 3], [0, 2], SelfSDConfig(control=control, k=k, tree_width=width))
        assert gen.generate(prompt, GREEDY, 40).token_ids == reference, (control, k, width)
    assert any(path and path[0] != 0 for path in paths)  # a sibling, not the chain, was accepted
    with pytest.raises(SpecReproError, match="tree_width"):
        SelfSDDecoder(sharp_model, None, [1], [2], SelfSDConfig(tree_width=0))


@pytest.mark.parametrize("control,k,width", [("fixed", 2, 1), ("fixed", 1, 4), ("adaptive", 5, 3)])
def test_greedy_self_sd_with_a_reduced_draft_vocabulary_equals_ar(sharp_model, control, k, width):
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    reference = ARDecoder(sharp_model).generate(prompt, GREEDY, 40).token_ids
    ranking = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    cfg = SelfSDConfig(control=control, k=k, tree_width=width, draft_vocab=16)
    decoder = SelfSDDecoder(sharp_model, None, [1, 3], [0, 2], cfg, vocab_ranking=ranking)
    gen = decoder.generate(prompt, GREEDY, 40)
    assert gen.token_ids == reference
    vocab = set(decoder.start(prompt, cache=None, length=0).vocab_ids.tolist())  # the generation's draft vocabulary
    assert vocab == set(ranking[:16].tolist()) | set(prompt[0].tolist()) and gen.extra["draft_vocab"] == len(vocab)
    assert sum(gen.accepted) > len(gen.accepted)  # drafts were accepted


def test_draft_vocabulary_is_frequent_tokens_then_the_prompts_own():
    vocab = draft_vocab.with_prompt_tokens(torch.tensor([7, 2, 70, 5]), torch.tensor([[5, 9, 9, 99, 3]]), 64)
    assert vocab.tolist() == [7, 2, 5, 3, 9]  # ids beyond the model's vocabulary are dropped
    with pytest.raises(SpecReproError, match="tokenizer"):
        SelfSDDecoder(tiny_llama(vocab_size=8, seed=0), None, [0], [], SelfSDConfig(draft_vocab=4))


def test_adaptive_exit_drafts_variable_lengths(sharp_model):
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(2))
    gen = SelfSDDecoder(sharp_model, None, [1], [2], SelfSDConfig(k=8)).generate(prompt, GREEDY, 60)
    assert len(set(gen.drafted)) > 1 and sum(gen.accepted) - len(gen.accepted) > 0


def test_speculative_sampling_runs_and_is_seeded(sharp_model):
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(3))
    sampling = Sampling(do_sample=True, temperature=0.8, top_p=0.9)
    decoder = SelfSDDecoder(sharp_model, None, [1, 3], [2], SelfSDConfig(k=4, carry_gamma=False))
    first, again = (decoder.generate(prompt, sampling, 30, seed=5) for _ in range(2))
    assert first.token_ids == again.token_ids and len(first.token_ids) == 30
    assert all(0 <= t < 64 for t in first.token_ids) and sum(first.drafted) > 0


@pytest.mark.slow  # 3,000 generations
def test_speculative_sampling_first_token_matches_target_distribution():
    """The token after the first verification follows the warped target distribution (chi-square-free check)."""
    model = tiny_llama(vocab_size=8, seed=4, num_layers=2, logit_scale=3.0)
    prompt = torch.tensor([[1, 2, 3]])
    sampling = Sampling(do_sample=True, temperature=1.0)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 5]])).logits[0, -1]
    target = logits.softmax(-1)
    decoder = SelfSDDecoder(model, None, [1], [0], SelfSDConfig(control="fixed", k=2))
    counts = torch.zeros(8)
    n = 0
    for seed in range(3000):
        tokens = decoder.generate(prompt, sampling, 2, seed=seed).token_ids
        if tokens[0] == 5:
            counts[tokens[1]] += 1
            n += 1
    assert n > 200
    assert (counts / n - target).abs().max() < 4 * (0.25 / n) ** 0.5


def test_adaptive_controller_follows_eq_2_to_4():
    c = AdaptiveDraftExit(k_max=12, gamma0=0.6, alpha=0.9, epsilon=0.01, beta1=0.5, beta2=0.9)
    assert c.next_length() == 12
    c.update(4, 4)  # AR = AR_1 = 1.0 > alpha: gamma~ = 0.59, gamma = 0.9*0.6 + 0.1*0.59
    assert c.accept_rate == 1.0 and c.gamma == pytest.approx(0.599)
    c.update(4, 1)  # AR = 0.5*1 + 0.5*0.25 = 0.625 <= alpha: gamma~ = 0.609
    assert c.accept_rate == pytest.approx(0.625) and c.gamma == pytest.approx(0.600)
    c.update(2, 2)  # AR = 0.8125: gamma~ = 0.61
    assert c.accept_rate == pytest.approx(0.8125) and c.gamma == pytest.approx(0.601)
    c.update(0, 0)  # nothing drafted: no update
    assert c.gamma == pytest.approx(0.601)
    c.update(5, 5)  # AR = 0.90625 > alpha: gamma~ = 0.591
    assert c.accept_rate == pytest.approx(0.90625) and c.gamma == pytest.approx(0.600)
    assert c.keep_drafting(0.61) and not c.keep_drafting(0.59)


def test_gamma_carries_across_generations_when_asked(sharp_model):
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    for carry in (True, False):
        decoder = SelfSDDecoder(sharp_model, None, [1], [2], SelfSDConfig(k=5, carry_gamma=carry))
        decoder.generate(prompt, GREEDY, 30)
        end_gamma = decoder.controller.gamma
        assert end_gamma != 0.6
        assert decoder.new_controller().gamma == (end_gamma if carry else 0.6)


def test_restoring_the_carried_gamma_starts_the_next_generation_from_it(sharp_model):
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    decoder = SelfSDDecoder(sharp_model, None, [1], [2], SelfSDConfig(k=5))
    carried = decoder.carried()
    first = decoder.generate(prompt, GREEDY, 30)
    assert decoder.carried() == decoder.controller.gamma != carried == 0.6
    decoder.restore(carried)
    again = decoder.generate(prompt, GREEDY, 30)
    assert (again.steps, again.accepted) == (first.steps, first.accepted)
    assert SelfSDDecoder(sharp_model, None, [1], [2], SelfSDConfig(k=5, carry_gamma=False)).carried() is None


def test_skip_context_restores_the_model_exactly(sharp_model):
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = sharp_model(ids).logits
        with skipped_sublayers(sharp_model, [0, 2], [2, 3]):
            skipped = sharp_model(ids).logits
        after = sharp_model(ids).logits
        with pytest.raises(RuntimeError), skipped_sublayers(sharp_model, [1], [1]):
            raise RuntimeError("interrupted")
        after_error = sharp_model(ids).logits
    assert not torch.equal(before, skipped)
    assert torch.equal(before, after) and torch.equal(before, after_error)
    assert all("forward" not in m.__dict__ for m in sharp_model.modules())


def test_skipping_every_sublayer_leaves_embedding_norm_head(sharp_model):
    ids = torch.randint(0, 64, (1, 5))
    with torch.no_grad(), skipped_sublayers(sharp_model, range(4), range(4)):
        logits = sharp_model(ids).logits
        expected = sharp_model.lm_head(sharp_model.model.norm(sharp_model.model.embed_tokens(ids)))
    torch.testing.assert_close(logits, expected)


def test_bad_skip_sets_and_artifacts_fail_clearly(sharp_model, tmp_path):
    with pytest.raises(SpecReproError, match="blocks 0..3"):
        SelfSDDecoder(sharp_model, None, [4], [], SelfSDConfig())
    with pytest.raises(SpecReproError, match="skip_set.json"):
        SkipSet.from_pretrained(tmp_path)
    SkipSet([1], [0, 2], 4, {"search": "bayes"}).save_pretrained(tmp_path)
    loaded = SkipSet.from_pretrained(tmp_path)
    assert (loaded.attn_skip, loaded.mlp_skip, loaded.num_layers, loaded.info) == ([1], [0, 2], 4, {"search": "bayes"})


def test_search_cli_writes_skip_sets_that_runs_use(tmp_path):
    common = [
        "train",
        "method=self_sd",
        "model=tiny_random",
        "model.random.num_layers=3",
        "logger=none",
        "hardware.threads=1",
        "training.iterations=4",
        "training.init_points=2",
        "training.dev_records=1",
        "training.max_new_tokens=6",
        "training.max_prompt_tokens=48",
    ]
    for search in (
        "training.search=bayes",
        "training.gp_inputs=binary training.recheck_top=0",
        "training.search=random",
    ):
        specrepro(*common, *search.split(), cwd=tmp_path)
    artifacts = sorted((tmp_path / "results" / "artifacts").glob("self_sd_skip_set-tiny_random-*"))
    assert len(artifacts) == 3
    for path in artifacts:
        meta = json.loads((path / "artifact.json").read_text())
        skip = json.loads((path / "skip_set.json").read_text())
        assert len(meta["history"]) == 4 and skip["num_layers"] == 3
        rechecks = meta["metrics"]["best_rechecks"]  # the best sets timed twice more (recheck_top 5 by default)
        if rechecks:
            assert len(rechecks) == 3 and rechecks[0] in [row["objective"] for row in meta["history"]]
            assert meta["metrics"]["best_objective"] == pytest.approx(sum(rechecks) / 3)
        else:
            assert meta["metrics"]["best_objective"] == max(row["objective"] for row in meta["history"])
        assert all(0 <= i < 3 for i in skip["attn_skip"] + skip["mlp_skip"])
    for vocab in (0, 32):  # 32: the draft scores the bundled ShareGPT's 32 most frequent tokens + the prompt's
        specrepro(
            "run",
            *FAST,
            "model.random.num_layers=3",
            "method=self_sd",
            f"method.skip_set={artifacts[0].name}",
            f"method.draft_vocab={vocab}",
            "dataset=cnn_dm",
            "dataset.limit=2",
            "logger=none",
            cwd=tmp_path,
        )
    runs = [path for key, path in run_dirs(tmp_path).items() if key.startswith("self_sd:")]
    assert len(runs) == 2
    for path in runs:
        metrics = json.loads((path / "metrics.json").read_text())
        assert metrics["lossless"] == 1.0 and metrics["complete"]


@pytest.mark.embedded
def test_greedy_self_sd_matches_ar_on_the_embedded_model(embedded):
    prompts = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]
    ar = ARDecoder(embedded.model, embedded.tokenizer)
    decoder = SelfSDDecoder(
        embedded.model, embedded.tokenizer, [12, 15, 18, 20, 22, 24, 26, 28], [21, 25, 27], SelfSDConfig()
    )
    for text in prompts:
        ids = embedded.tokenizer(text)["input_ids"]
        gen = decoder.generate(ids, GREEDY, 64)
        assert gen.token_ids == ar.generate(ids, GREEDY, 64).token_ids
        assert sum(gen.drafted) > 0


@pytest.mark.parametrize("restarts", [1, 3])
def test_acq_restarts_sets_the_l_bfgs_b_starts_of_each_suggestion(monkeypatch, restarts):
    import bayes_opt.acquisition
    from bayes_opt import BayesianOptimization

    from specrepro.training.self_sd_search import restart_limited_ucb

    starts = []
    real_minimize = bayes_opt.acquisition.minimize
    monkeypatch.setattr(bayes_opt.acquisition, "minimize", lambda *a, **k: starts.append(1) or real_minimize(*a, **k))
    optimizer = BayesianOptimization(
        f=None,
        pbounds={f"x{i}": (0.0, 1.0) for i in range(4)},
        acquisition_function=restart_limited_ucb(2.576, restarts),
        random_state=1,
        verbose=0,
    )
    for value, params in enumerate(optimizer.random_sample(5)):
        optimizer.register(params=params, target=float(value))
    optimizer.suggest()
    assert len(starts) == restarts


def test_an_artifact_name_hashes_every_training_option(tmp_path):
    from specrepro.training import artifact_path

    register_configs()
    base = ["method=self_sd", "model=tiny_random", f"artifacts_dir={tmp_path}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        default, explicit, fewer = (
            compose(config_name="train", overrides=base + extra)
            for extra in ([], ["training.acq_restarts=10"], ["training.acq_restarts=2"])
        )
    assert artifact_path(default) == artifact_path(explicit) != artifact_path(fewer)
