"""Divergence classification (metrics/divergence.py): where a greedy method's output leaves `ar`'s, a near-tie
within the measured rounding of a multi-row verification, or a bug."""

from __future__ import annotations

import json

import pytest
import torch

from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.jacobi import JacobiDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.steps import EagerSteps
from specrepro.metrics.divergence import (
    ar_logits_and_rounding,
    position_logits,
    classify,
    classify_row,
    first_difference,
    interleaved_step,
    near_tie_metrics,
    rounding_widths,
    tree_rounding_widths,
)
from specrepro.metrics.summary import results_table
from specrepro.models import LoadedModel
from tests.conftest import tiny_llama
from tests.test_config import compose_run
from tests.test_decoding import prompts
from tests.test_runner import FAST

GREEDY = Sampling()


def bf16_llama(seed: int, logit_scale: float = 1.0):
    return tiny_llama(vocab_size=96, seed=seed, num_layers=2, logit_scale=logit_scale).to(torch.bfloat16)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one stopped where the other went on


@pytest.mark.parametrize("seed", [1, 3])
def test_a_bf16_verification_that_rounds_differently_is_a_near_tie(seed):
    """In bf16 (oneDNN linears, no row invariance) Jacobi's 8-row verifications round differently from `ar`'s
    one-row steps, and on these tiny models pick the other of two tied tokens on one prompt: a near-tie."""
    model = bf16_llama(seed)
    ar, jacobi = ARDecoder(model), JacobiDecoder(model, block_size=8)
    found = []
    for prompt in prompts():
        reference, tokens = ar.generate(prompt, GREEDY, 40).token_ids, jacobi.generate(prompt, GREEDY, 40).token_ids
        found.append(classify(EagerSteps(model), prompt, tokens, reference, rounding_widths(8)))
    divergences = [d for d in found if d is not None]
    assert divergences  # the premise: bf16 verification is not lossless here
    for d in divergences:
        assert d["near_tie"] and d["token"] != d["ar_token"]
        assert 0 <= d["gap"] <= d["rounding"] or d["gap"] == 0


class FlippingAR(ARDecoder):
    """A wrong decoder: `ar`, but at `position` it commits the runner-up token instead of the argmax."""

    def __init__(self, model, position: int, tokenizer=None):
        super().__init__(model, tokenizer, steps=EagerSteps(model))
        self.position = position

    def _decode(self, prompt_ids, sampling, out, rng):
        cache = self.steps.new_cache(0)
        logits = self.steps(prompt_ids, cache, logits_to_keep=1).logits[0, -1]
        while not out.done:
            choice = logits.topk(2).indices[int(len(out.gen.token_ids) == self.position)]
            out.commit([int(choice)], prefill=not out.gen.token_ids)
            logits = self.steps(choice.view(1, 1), cache, logits_to_keep=1).logits[0, -1]


def test_a_token_flipped_where_the_margin_is_large_is_a_bug():
    model = bf16_llama(seed=4, logit_scale=3.0)
    prompt, steps, widths = prompts()[0], EagerSteps(model), rounding_widths(8)
    reference = ARDecoder(model).generate(prompt, GREEDY, 24).token_ids
    margins = []  # ar's top-2 margin and the measured rounding at each position
    for position in range(1, 24):
        logits, rounding = ar_logits_and_rounding(steps, prompt, reference, position, widths)
        top2 = logits.topk(2).values
        margins.append((float(top2[0] - top2[1]) - rounding, position))
    clearance, position = max(margins)
    assert clearance > 0.05  # a position where no rounding measured here explains a flip
    tokens = FlippingAR(model, position).generate(prompt, GREEDY, 24).token_ids
    divergence = classify(steps, prompt, tokens, reference, widths)
    assert divergence["position"] == position and not divergence["near_tie"]
    assert divergence["gap"] == pytest.approx(divergence["margin"]) and divergence["gap"] > divergence["rounding"]


def test_an_early_position_is_measured_as_a_first_verification_computes_it():
    """A method's first verification after the prefill predicts positions 1..w-1 from its first rows: there the
    rounding is measured with `ar`'s next tokens after the position in the same forward, not taken as 0 because
    fewer than w tokens come before it."""
    model = tiny_llama(vocab_size=96, seed=1, num_layers=2).to(torch.bfloat16)
    steps, prompt = EagerSteps(model), prompts()[0]
    reference = ARDecoder(model).generate(prompt, GREEDY, 12).token_ids
    assert ar_logits_and_rounding(steps, prompt, reference, 0, rounding_widths(8))[1] == 0.0  # the prefill's own
    for position in (2, 3):
        one_row, rounding = ar_logits_and_rounding(steps, prompt, reference, position, rounding_widths(8))
        first_verification = position_logits(steps, prompt, reference[:position], 8, ahead=reference[position:8])
        assert rounding >= float((first_verification - one_row).abs().max()) > 0.0


def test_a_record_is_classified_turn_by_turn_and_summarized():
    """A sample's first diverging turn is classified; a later turn, whose prompt holds that answer, inherits its
    class; the run's lossless_near_tie counts identical and near-tie generations."""
    model = bf16_llama(seed=1)
    prompt = prompts()[0]
    reference = ARDecoder(model).generate(prompt, GREEDY, 20).token_ids
    flipped = FlippingAR(model, 3).generate(prompt, GREEDY, 20).token_ids

    def gen(tokens):
        return {"token_ids": tokens}

    reference_row = {
        "id": "r",
        "prompts": [" ".join(map(str, prompt)), "unused"],
        "samples": [[gen(reference), gen([1, 2])], [gen(reference), gen([1, 2])]],
    }
    row = {"id": "r", "samples": [[gen(flipped), gen([1, 3])], [gen(reference), gen([1, 2])]]}
    classify_row(row, reference_row, LoadedModel(model, None, "tiny"), 8, lambda answers: prompt)
    first, later = row["samples"][0]
    assert first["divergence"]["position"] == 3 and first["divergence"]["token"] == flipped[3]
    assert later["divergence"] == {"after_turn": 0, "near_tie": first["divergence"]["near_tie"]}
    assert all("divergence" not in g for g in row["samples"][1])  # identical turns are left alone
    gens = [g for sample in row["samples"] for g in sample]
    ref_gens = [g for sample in reference_row["samples"] for g in sample]
    bug = not first["divergence"]["near_tie"]
    metrics = near_tie_metrics(gens, ref_gens)
    assert metrics["lossless_near_tie"] == (0.5 if bug else 1.0)
    assert (metrics["divergences"], metrics["divergence_bugs"]) == (1, int(bug))
    del first["divergence"]  # a record made before classification: nothing is claimed
    assert near_tie_metrics(gens, ref_gens) == {}


def test_near_tie_metrics_of_classified_divergences():
    near = {"position": 2, "gap": 0.01, "rounding": 0.008, "near_tie": True}
    bug = {"position": 5, "gap": 0.9, "rounding": 0.008, "near_tie": False}
    gens = [
        {"token_ids": [1]},
        {"token_ids": [2], "divergence": near},
        {"token_ids": [3], "divergence": bug},
        {"token_ids": [4], "divergence": {"after_turn": 0, "near_tie": True}},
    ]
    reference = [{"token_ids": [1]}, {"token_ids": [9]}, {"token_ids": [9]}, {"token_ids": [9]}]
    assert near_tie_metrics(gens, reference) == {
        "lossless_near_tie": 0.75,
        "divergences": 2,
        "divergence_bugs": 1,
        "near_tie_max_gap": 0.01,
        "near_tie_max_rounding": 0.008,
    }


def test_a_run_of_a_wrong_decoder_records_its_divergences_as_bugs(tmp_path, monkeypatch):
    """Through the runner: each generation's divergence from the `ar` reference lands in generations.jsonl, the
    run's lossless_near_tie and bug count in metrics.json, and the results table shows the column."""
    from specrepro import runner

    def build(method, target, ctx):  # the `ar` reference as it is, the method wrong at its third token
        if method.name == "ar":
            return ARDecoder(target.model, target.tokenizer)
        return FlippingAR(target.model, 2, target.tokenizer)

    monkeypatch.setattr(runner, "build_decoder", build)
    cfg = compose_run(*FAST, "method=pld", "dataset=gsm8k", "dataset.limit=2", "logger=none", f"results_dir={tmp_path}")
    metrics = runner.run(cfg)
    assert metrics["lossless"] == 0.0 and metrics["lossless_near_tie"] == 0.0
    assert (metrics["divergences"], metrics["divergence_bugs"]) == (2, 2)
    [run_dir] = [p for p in tmp_path.glob("runs/*pld*")]
    rows = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    divergences = [row["samples"][0][0]["divergence"] for row in rows]
    assert all(d["position"] == 2 and not d["near_tie"] and d["gap"] > d["rounding"] for d in divergences)
    assert "lossless_near_ties" in results_table([metrics])
    assert "lossless_near_ties" not in results_table([{**metrics, "lossless": 1.0, "lossless_near_tie": 1.0}])


def test_a_divergence_and_the_reference_nll_are_scored_after_the_prompt_as_decoded(tmp_path, monkeypatch):
    """A record whose text holds a chat special token's string decodes it as text (`data.prompt_ids`): the
    divergence's position is recomputed, and the reference answer's NLL scored, after those same ids, not after
    the rendered text tokenized again (which turns the string into a template turn)."""
    from specrepro import runner
    from specrepro.data import load_records, prompt_ids
    from specrepro.metrics import divergence
    from tests.test_silent_numbers import HOSTILE, gsm8k_file

    def build(method, target, ctx):
        return ARDecoder(target.model, target.tokenizer) if method.name == "ar" else FlippingAR(target.model, 2)

    seen = {}

    def spy(name, function):
        def call(model_or_steps, prompt, *args, **kwargs):
            seen[name] = list(prompt)
            return function(model_or_steps, prompt, *args, **kwargs)

        return call

    monkeypatch.setattr(runner, "build_decoder", build)
    monkeypatch.setattr(runner, "reference_nll", spy("nll", runner.reference_nll))
    monkeypatch.setattr(divergence, "classify", spy("divergence", divergence.classify))
    data = gsm8k_file(tmp_path / "hostile.jsonl", [HOSTILE])
    cfg = compose_run(
        *FAST,
        "method=pld",
        "dataset=gsm8k",
        f"dataset.path={data}",
        "reference_nll=true",
        "logger=none",
        f"results_dir={tmp_path}",
    )
    metrics = runner.run(cfg)
    assert metrics["divergences"] == 1
    tokenizer = runner.load_target(cfg, runner.ModelLoader.for_hardware(cfg.hardware, cfg.artifacts_dir)).tokenizer
    [record] = load_records(cfg.dataset)
    decoded = prompt_ids(record, tokenizer, cfg.dataset)
    rendered = tokenizer(runner.render_prompt(record, tokenizer, cfg.dataset), add_special_tokens=False)["input_ids"]
    assert seen == {"nll": decoded, "divergence": decoded} and rendered != decoded


def test_divergences_are_classified_on_compiled_steps_too():
    """A compiled run recomputes the position on its own compiled steps (static cache, padded widths, rollback by
    write position): the classes and `ar`'s logits there are the eager steps' (aot_eager traces the same ops)."""
    from specrepro.decoding.steps import CompiledSteps
    from specrepro.models.kernels import set_linear_kernel

    model = set_linear_kernel(bf16_llama(seed=4, logit_scale=3.0), "torch")
    compiled = CompiledSteps(model, backend="aot_eager", widths=[1, 4, 16])
    compiled.warm_up(max_width=16, length=80)
    prompt, widths = prompts()[0], rounding_widths(16)
    reference = ARDecoder(model, steps=compiled).generate(prompt, GREEDY, 24).token_ids
    for position in (0, 9):  # the prefill's token, and one after one-row steps
        tokens = FlippingAR(model, position).generate(prompt, GREEDY, 24).token_ids
        ours, eager = (classify(steps, prompt, tokens, reference, widths) for steps in (compiled, EagerSteps(model)))
        assert ours["position"] == eager["position"] == position and ours["margin"] == pytest.approx(eager["margin"])
        assert ours["near_tie"] == eager["near_tie"]


def test_a_tree_path_verification_scores_and_keeps_what_a_chain_does():
    """`interleaved_step` verifies a chunk as a tree's path with a sibling before each node: its logits are the
    chain's up to rounding, and the cache it keeps continues as the chain's (fp32, eager)."""
    model = tiny_llama(vocab_size=96, seed=1, num_layers=2)
    steps, tokens = EagerSteps(model), torch.tensor([prompts()[0][:14]])
    chain_cache, tree_cache = steps.new_cache(32), steps.new_cache(32)
    with torch.inference_mode():
        for cache in (chain_cache, tree_cache):
            steps(tokens[:, :8], cache)
        chain = steps(tokens[:, 8:12], chain_cache).logits
        tree = interleaved_step(steps, tokens[:, 8:12], tree_cache, 8)
        assert tree_cache.get_seq_length() == chain_cache.get_seq_length() == 12
        torch.testing.assert_close(tree, chain)
        torch.testing.assert_close(steps(tokens[:, 12:], tree_cache).logits, steps(tokens[:, 12:], chain_cache).logits)


@pytest.mark.embedded
def test_a_tree_method_is_measured_at_the_rounding_its_path_sums_on_row_invariant_steps():
    """On row-invariant compiled steps (bf16, the embedded model) a chain verification rounds as `ar` does (rounding
    0: only an exact tie is a near-tie), but a tree's path, whose keys have siblings between them, does not: a
    method that verifies trees is measured at both, so its bf16 flips of a step or two are near-ties, not bugs."""
    from specrepro.config import HardwareConfig, ModelConfig
    from specrepro.models import ModelLoader

    hardware = HardwareConfig(
        device="cpu",
        dtype="bfloat16",
        linear_kernel="torch",
        row_invariant=True,
        compile=True,
        compile_backend="aot_eager",
        compile_widths=[8],
    )
    model = ModelConfig(name="smollm2_135m", source="embedded")
    target = ModelLoader.for_hardware(hardware, "unused").load_model(model)
    question = "Natalia sold clips to 48 of her friends in April, and then half as many in May."
    prompt = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    decoder = ARDecoder(target.model, target.tokenizer)
    decoder.steps.warm_up(8, len(prompt) + 24)
    tokens = decoder.generate(prompt, GREEDY, 24).token_ids
    assert tree_rounding_widths(8, trees=False) == [] and tree_rounding_widths(8, trees=True) == [2, 4]
    _, chain_rounding = ar_logits_and_rounding(decoder.steps, prompt, tokens, len(tokens), rounding_widths(8))
    _, tree_rounding = ar_logits_and_rounding(
        decoder.steps, prompt, tokens, len(tokens), rounding_widths(8), tree_rounding_widths(8, trees=True)
    )
    assert chain_rounding == 0.0 and tree_rounding > 0.0


def test_decoders_say_whether_their_verifications_hold_trees():
    """What `classify_row` is told: siblings (tree_width > 1), EAGLE's top-k > 1 and the tree drafters verify trees;
    a chain (pld, EAGLE's top-1 chain, a one-wide draft) does not."""
    from specrepro.decoding.pld import PLDConfig, PLDDecoder
    from specrepro.decoding.token_recycling import TokenRecyclingDecoder
    from tests.test_compiled import eagle_decoder, self_sd_decoders

    model = tiny_llama(vocab_size=64, seed=1)
    self_sd = self_sd_decoders(model)
    assert not PLDDecoder(model, None, PLDConfig()).verifies_trees and not self_sd["self_sd"].verifies_trees
    assert self_sd["self_sd_tree"].verifies_trees and eagle_decoder(model).verifies_trees
    assert not eagle_decoder(model, depth=3, top_k=1, total_tokens=3).verifies_trees
    assert TokenRecyclingDecoder.verifies_trees and not ARDecoder(model).verifies_trees
