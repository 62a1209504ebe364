"""The Decoder contract and losslessness on tiny random LLaMAs: greedy equality with `ar`, exact rollback."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, normalizers, trainers
from tokenizers import decoders as text_decoders
from tokenizers import models as bpe_models
from transformers import DynamicCache, LlamaTokenizerFast, StaticCache

from specrepro import decoding
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.base import GenerationBuilder, completion_text
from specrepro.decoding.controllers import FixedLength, HeuristicLength
from specrepro.decoding.draft_vocab import alternatives
from specrepro.decoding.hf_assisted import HFAssistedConfig, HFAssistedDecoder
from specrepro.decoding.pld import PLDConfig, PLDDecoder, lookup_ngram
from specrepro.decoding.sampling import Sampling, warp_logits
from specrepro.decoding.sps import SPSDecoder
from specrepro.decoding.verify import (
    crop_cache,
    greedy_verify,
    keep_tree_path,
    speculative_verify,
    tree_attention,
    tree_verify,
)
from tests.conftest import host_reads

GREEDY = Sampling()


def prompts(n=4, length=24):
    rng = torch.Generator().manual_seed(0)
    base = [torch.randint(3, 64, (length,), generator=rng).tolist() for _ in range(n)]
    return base + [[5, 6, 7, 8] * 6]  # a repetitive prompt, where prompt lookup drafts a lot


def decoders(target, draft):
    return {
        "pld": PLDDecoder(target, None, PLDConfig()),
        "pld_heuristic": PLDDecoder(target, None, PLDConfig(controller="heuristic", match="earliest")),
        "sps": SPSDecoder(target, None, draft, 4, "fixed", 16),
        "sps_self": SPSDecoder(target, None, target, 3, "heuristic", 16),
        "sps_tree_vocab": SPSDecoder(target, None, draft, 3, "fixed", 16, tree_width=4, frequent=torch.arange(3, 20)),
        "hf_plain": HFAssistedDecoder(target, None, HFAssistedConfig(mode="plain")),
        "hf_prompt_lookup": HFAssistedDecoder(target, None, HFAssistedConfig(mode="prompt_lookup")),
        "hf_assistant": HFAssistedDecoder(target, None, HFAssistedConfig(mode="assistant"), assistant=draft),
    }


@pytest.mark.parametrize(
    "name",
    ["pld", "pld_heuristic", "sps", "sps_self", "sps_tree_vocab", "hf_plain", "hf_prompt_lookup", "hf_assistant"],
)
def test_greedy_equals_ar(target, draft, name):
    decoder = decoders(target, draft)[name]
    for prompt in prompts():
        reference = ARDecoder(target).generate(prompt, GREEDY, 40)
        gen = decoder.generate(prompt, GREEDY, 40)
        assert gen.token_ids == reference.token_ids
        assert sum(gen.accepted) + 1 == len(gen.token_ids)  # every token after prefill is committed by a step
        assert gen.steps == len(gen.accepted) == len(gen.drafted)


def test_every_method_logs_the_parameters_it_adds(target, draft):
    target_parameters = sum(p.numel() for p in target.parameters())
    draft_parameters = sum(p.numel() for p in draft.parameters())
    expected = {
        "ar": 0,
        "pld": 0,
        "sps": draft_parameters,
        "sps_self": 0,  # drafting with itself adds none
        "hf_plain": 0,
        "hf_assistant": draft_parameters,
    }
    found = {"ar": ARDecoder(target)} | decoders(target, draft)
    for name, parameters in expected.items():
        extra = found[name].generate(prompts()[0], GREEDY, 4).extra
        assert extra["extra_parameters"] == parameters, name
        assert extra["extra_memory_pct"] == pytest.approx(100.0 * parameters / target_parameters), name


def test_ar_matches_transformers_generate(target):
    for prompt in prompts():
        ours = ARDecoder(target).generate(prompt, GREEDY, 30).token_ids
        ids = torch.tensor([prompt])
        theirs = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
        assert ours == theirs[0, len(prompt) :].tolist()


def test_drafting_methods_take_fewer_steps_when_drafts_match(target):
    prompt = prompts()[-1]
    ar = ARDecoder(target).generate(prompt, GREEDY, 40)
    self_draft = SPSDecoder(target, None, target, 4, "fixed", 16).generate(prompt, GREEDY, 40)
    assert ar.steps == 39 and ar.accepted == [1] * 39
    assert self_draft.steps < 12  # a draft identical to the target is always accepted: 5 tokens a step
    assert all(a == 5 for a in self_draft.accepted[:-1])


def test_a_step_records_every_token_it_drafted_not_only_those_accepted(target, draft):
    """The acceptance rate divides the accepted drafts by `drafted`: each step counts the k drafts it verified
    (k fixed at 4, less only where the budget leaves less room), rejected ones included."""
    budget = 40
    gen = SPSDecoder(target, None, draft, 4, "fixed", 16).generate(prompts()[0], GREEDY, budget)
    before = [1 + sum(gen.accepted[:i]) for i in range(gen.steps)]  # tokens committed before each step
    assert gen.drafted == [min(4, budget - n - 1) for n in before]
    assert any(a < d + 1 for a, d in zip(gen.accepted, gen.drafted))  # some drafts were rejected


def test_an_sps_tree_drafts_from_the_committed_tokens_after_a_sibling_wins(monkeypatch):
    """A tree's accepted sibling is not what the draft cached at its position (the chain's token was): every round
    must draft what the draft model, run afresh on the committed tokens, drafts. Keeping the chain's token stayed
    lossless, so only this shows it."""
    from tests.conftest import tiny_llama

    target, draft = tiny_llama(seed=1, logit_scale=3.0), tiny_llama(seed=2, logit_scale=3.0)
    decoder = SPSDecoder(target, None, draft, 3, "fixed", 16, tree_width=4)
    propose, rounds = decoder.propose, []

    def recorded(state, tokens, k, sampling, rng, controller):
        proposal = propose(state, tokens, k, sampling, rng, controller)
        rounds.append((tokens.clone(), proposal.drafts[:k].tolist()))
        return proposal

    monkeypatch.setattr(decoder, "propose", recorded)
    siblings_won = 0
    for prompt in prompts():
        rounds.clear()
        decoder.generate(prompt, GREEDY, 40)
        for (tokens, chain), (after, _) in zip(rounds, rounds[1:]):
            ids, afresh = tokens, []
            with torch.inference_mode():  # the decoder's tokens are inference tensors
                for _ in chain:
                    afresh.append(int(draft(ids).logits[0, -1].argmax()))
                    ids = torch.cat([ids, ids.new_tensor([[afresh[-1]]])], dim=1)
            assert chain == afresh
            siblings_won += after.shape[1] - tokens.shape[1] >= 2 and int(after[0, tokens.shape[1]]) != chain[0]
    assert siblings_won > 0  # the case this test is about happened


def test_budget_and_eos_stop_generation(target):
    prompt = prompts()[0]
    unbounded = ARDecoder(target)
    unbounded.eos_ids = set()
    reference = unbounded.generate(prompt, GREEDY, 40).token_ids
    eos = reference[10]
    for decoder in (
        ARDecoder(target),
        SPSDecoder(target, None, target, 4, "fixed", 16),
        PLDDecoder(target, None, PLDConfig()),
    ):
        decoder.eos_ids = {eos}
        gen = decoder.generate(prompt, GREEDY, 40)
        assert gen.token_ids == reference[: reference.index(eos) + 1]
        decoder.eos_ids = set()
        assert len(decoder.generate(prompt, GREEDY, 7).token_ids) == 7


@pytest.mark.parametrize("sync_every", [3, 8])
def test_ar_reading_its_tokens_in_chunks_decodes_the_same(target, sync_every):
    """`ar` on a GPU reads its tokens every `sync_every` steps: the same tokens, steps and acceptances as reading
    each, at every budget and at an EOS inside a chunk (the chunk's later steps are thrown away); sampling too."""
    prompt = prompts()[0]
    unbounded = ARDecoder(target)
    unbounded.eos_ids = set()
    tokens = unbounded.generate(prompt, GREEDY, 40).token_ids
    for eos_ids in (set(), {tokens[0]}, {tokens[10]}):
        for budget in (1, 6, 7, 40):
            each, chunked = ARDecoder(target), ARDecoder(target, sync_every=sync_every)
            each.eos_ids = chunked.eos_ids = eos_ids
            reference, generation = each.generate(prompt, GREEDY, budget), chunked.generate(prompt, GREEDY, budget)
            assert generation.token_ids == reference.token_ids
            assert (generation.steps, generation.accepted) == (reference.steps, reference.accepted)
    sampling = Sampling(do_sample=True, temperature=1.0)
    each, chunked = (ARDecoder(target, sync_every=k).generate(prompt, sampling, 40, seed=3) for k in (1, sync_every))
    assert chunked.token_ids == each.token_ids


def test_ar_steps_read_the_device_once_a_chunk(target):
    """Between its reads of a chunk's tokens (one `.tolist()` each), `ar`'s steps never wait on the device."""
    decoder = ARDecoder(target, sync_every=8)
    decoder.eos_ids = set()
    assert host_reads(decoder, prompts()[0], 41) - host_reads(decoder, prompts()[0], 9) == 4  # 5 chunks, not 1


def test_phase_times_add_up_within_the_wall_time(target, draft):
    """A round's phases are timed apart and all within the generation's wall time; on a GPU the builder keeps each
    phase's events and adds their span (milliseconds) to its phase once the generation is done."""
    gen = SPSDecoder(target, None, draft, 3, "fixed", 16).generate(prompts()[0], GREEDY, 24)
    assert gen.prefill_time > 0 and gen.draft_time > 0 and gen.verify_time > 0
    assert gen.prefill_time + gen.draft_time + gen.verify_time <= gen.wall_time

    class Span:  # what `GenerationBuilder.settle` reads of a CUDA event pair
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, end):
            return end.ms - self.ms

    out = GenerationBuilder(8, set(), torch.device("cpu"))
    out.spans = [("draft", Span(1.0), Span(3.5)), ("verify", Span(3.5), Span(4.0)), ("draft", Span(5.0), Span(6.0))]
    out.settle()
    assert (out.gen.draft_time, out.gen.verify_time, out.spans) == (pytest.approx(0.0035), pytest.approx(0.0005), [])


def test_max_new_tokens_must_be_positive(target):
    with pytest.raises(ValueError, match="max_new_tokens"):
        ARDecoder(target).generate([5, 6], GREEDY, 0)


def test_crop_cache_restores_the_shorter_cache(target):
    ids = torch.tensor([prompts()[0]])
    full, short = DynamicCache(config=target.config), DynamicCache(config=target.config)
    with torch.no_grad():
        target(ids, cache=full)
        target(ids[:, :10], cache=short)
    crop_cache(full, 10)
    assert full.get_seq_length() == 10
    for a, b in zip(full.layers, short.layers):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)


def test_crop_cache_moves_each_static_layer_back_to_at_most_the_length(target):
    """On a StaticCache, crop_cache clamps every written layer's write position to the length (in place, on the
    cache's device), leaving shorter layers (a layer-skipping draft wrote fewer) and unwritten ones as they are."""
    cache = StaticCache(config=target.config, max_cache_len=64)
    with torch.no_grad():
        target(torch.tensor([prompts()[0][:12]]), cache=cache)
    cache.layers[0].crop(-6)  # this layer holds 6 rows, the others 12
    positions = [layer.cumulative_length for layer in cache.layers]
    crop_cache(cache, 9)
    assert [int(layer.get_seq_length()) for layer in cache.layers] == [6] + [9] * (len(cache.layers) - 1)
    assert all(
        layer.cumulative_length is kept for layer, kept in zip(cache.layers, positions)
    )  # CUDA graphs read these


def test_greedy_verify_accepts_the_matching_prefix():
    logits = torch.full((4, 10), -1.0)
    for position, token in enumerate([3, 4, 9, 1]):
        logits[position, token] = 1.0
    assert greedy_verify(torch.tensor([3, 4, 5]), logits) == ([3, 4, 9], 2)
    assert greedy_verify(torch.tensor([3, 4, 9]), logits) == ([3, 4, 9, 1], 3)
    assert greedy_verify(torch.tensor([7, 4, 9]), logits) == ([3], 0)


def test_a_uniform_draw_of_zero_accepts_no_draft_the_target_rules_out(monkeypatch):
    """torch.rand draws from [0, 1): u = 0 passes u * q(x) <= p(x) for p(x) = 0 too (a pld draft top-k leaves out)."""
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0], [0.0, 4.0, 3.0, -1.0]])
    sampling = Sampling(do_sample=True, top_k=2)
    monkeypatch.setattr(torch, "rand", lambda n, generator=None, device=None: torch.zeros(n, device=device))
    tokens, n_accepted = speculative_verify(torch.tensor([3]), None, logits, sampling, torch.Generator())
    assert n_accepted == 0 and tokens[0] in (0, 1)


def test_a_tree_verification_sees_ancestors_and_accepts_the_matching_path():
    # node 0 -> node 1 is the main chain, node 2 is node 0's sibling, node 3 node 2's child
    parents = [-1, 0, -1, 2]
    allow, positions = tree_attention(parents, past=2)
    assert positions.tolist() == [2, 3, 4, 3, 4]
    assert allow.int().tolist() == [
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 1],
    ]
    logits = torch.full((5, 10), -1.0)
    for row, token in enumerate([7, 1, 2, 8, 9]):  # the target's argmax after [last, node 0, ..., node 3]
        logits[row, token] = 1.0
    drafts = torch.tensor([3, 4, 7, 8])
    assert tree_verify(drafts, parents, None, logits, GREEDY, None) == ([7, 8, 9], [2, 3])  # via the sibling
    assert tree_verify(torch.tensor([7, 1, 5, 8]), parents, None, logits, GREEDY, None) == ([7, 1, 2], [0, 1])
    assert tree_verify(torch.tensor([5, 1, 6, 8]), parents, None, logits, GREEDY, None) == ([7], [])


def test_keeping_a_tree_path_leaves_the_cache_of_that_sequence(target):
    ids = torch.tensor([prompts()[0][:12]])
    tree, chain = DynamicCache(config=target.config), DynamicCache(config=target.config)
    with torch.no_grad():
        target(ids[:, :8], cache=tree)
        allow, positions = tree_attention([-1, 0, -1, 2], past=8)
        nodes = torch.cat([ids[:, 8:9], torch.tensor([[5, 6]]), ids[:, 9:11]], 1)  # root, chain, then the path
        mask = torch.zeros(allow.shape).masked_fill(~allow, torch.finfo(torch.float32).min)[None, None]
        target(nodes, cache=tree, attention_mask=mask, position_ids=positions[None])
        target(ids[:, :11], cache=chain)
    keep_tree_path(tree, 9, [2, 3])
    for a, b in zip(tree.layers, chain.layers):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)


def test_a_draw_is_the_token_multinomial_draws_and_an_invalid_distribution_fails():
    from specrepro.decoding.sampling import sample

    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        p = (3 * torch.randn(2, 17, generator=generator)).softmax(-1)
        p[torch.rand(2, 17, generator=generator) < 0.3] = 0
        p[:, 0] += 1e-3  # no row sums to 0
        seed = int(torch.randint(0, 2**31, (), generator=generator))
        drawn = torch.multinomial(p, 1, generator=torch.Generator().manual_seed(seed)).view(-1)
        assert torch.equal(sample(p, torch.Generator().manual_seed(seed)), drawn)
    for invalid in ([0.5, float("nan")], [0.5, -0.1], [0.0, 0.0], [float("inf"), 1.0]):
        with pytest.raises(RuntimeError, match="sampling distribution"):
            sample(torch.tensor(invalid), torch.Generator())


def test_an_upload_keeps_its_values_and_their_type():
    from specrepro.decoding.device import upload

    allow = torch.ones(2, 3, dtype=torch.bool).tril()
    assert upload([[1, 2]], torch.device("cpu")).dtype == torch.long
    assert torch.equal(upload(allow, torch.device("cpu")), allow)


def test_lookup_ngram_finds_the_continuation():
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    assert lookup_ngram(tokens, 3, 1, 2, "latest") == [5, 7]
    assert lookup_ngram(tokens, 3, 1, 2, "earliest") == lookup_ngram(tokens, 3, 1, 2, "saxena") == [4, 9]
    assert lookup_ngram([1, 2, 3], 3, 1, 5, "latest") == []
    # the longest n-gram wins over a later shorter one: (1, 2, 3) -> 4, not (2, 3) -> 5
    assert lookup_ngram([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3], 3, 1, 1, "latest") == [4]
    assert lookup_ngram([5, 1, 7, 1], 3, 1, 1, "latest") == [7]  # down to min_ngram itself
    assert lookup_ngram([5, 1, 7, 1], 3, 2, 1, "latest") == []
    # Saxena's rule skips an occurrence overlapping the last n-gram: (7, 7) at 1-2 overlaps the last (7, 7) at 2-3
    assert lookup_ngram([4, 7, 7, 7], 2, 1, 3, "earliest") == [7]
    assert lookup_ngram([4, 7, 7, 7], 2, 1, 3, "saxena") == [7, 7]  # so the 1-gram (7) at 1 drafts


def saxena_lookup(tokens: list[int], max_ngram: int, k: int) -> list[int]:
    """The rule of Saxena's find_candidate_pred_tokens, written plainly: for n from max_ngram down to 1, the first
    occurrence of the last n tokens whose continuation starts before those last n tokens."""
    for n in range(max_ngram, 0, -1):
        for start in range(n, len(tokens) - n):
            if tokens[start - n : start] == tokens[-n:]:
                return tokens[start : start + k]
    return []


def test_pld_drafts_as_saxenas_code_by_default():
    """The paper's PLD (Saxena's code, as Spec-Bench runs it) drafts from the earliest occurrence whose continuation
    starts before the last n-gram; the default drafted from the latest (MAT 1.90 against his rule's 1.82 over the
    leaderboard's `ar` outputs), a setting beyond the paper that is now `match: latest`."""
    assert PLDConfig().match == "saxena"
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        tokens = torch.randint(0, 4, (int(torch.randint(2, 40, (1,), generator=generator)),), generator=generator)
        tokens = tokens.tolist()
        assert lookup_ngram(tokens, 3, 1, 10) == saxena_lookup(tokens, 3, 10), tokens


def test_controllers():
    assert FixedLength(4).next_length() == 4
    heuristic = HeuristicLength(4, k_max=7)
    heuristic.update(4, 4)
    assert heuristic.next_length() == 6
    heuristic.update(6, 6)
    assert heuristic.next_length() == 7
    heuristic.update(7, 2)
    assert heuristic.next_length() == 6


def test_alternatives_are_the_next_best_draft_tokens_without_the_chosen_one():
    logits = torch.tensor([0.1, 3.0, 2.0, 5.0, 1.0])
    assert alternatives(None, logits, torch.tensor(3), 2).tolist() == [1, 2]
    assert alternatives(None, logits, torch.tensor(4), 2).tolist() == [3, 1]  # a sampled token outside the best
    assert alternatives(torch.tensor([10, 11, 12, 13, 14]), logits, torch.tensor(13), 3).tolist() == [11, 12, 14]


def test_warpers_keep_top_k_and_nucleus():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    assert torch.isinf(warp_logits(logits, Sampling(True, 1.0, 2, 1.0))[2:]).all()
    kept = torch.isfinite(warp_logits(logits, Sampling(True, 1.0, 0, 0.7)))
    assert kept.tolist() == [True, True, False, False]  # 0.64 < 0.7 <= 0.64 + 0.24


def test_no_decoder_attribute_is_set_outside_its_constructor():
    """A decoder holds its configuration; what one generation carries from hook to hook lives in the state
    object its `start` returns (draft_verify's contract). self_sd's controller carries gamma across
    generations by design (the official code's `carry_gamma`), which `restore` puts back."""
    carried = {("SelfSDDecoder", "new_controller"), ("SelfSDDecoder", "restore")}
    found = []
    for path in sorted((Path(decoding.__file__).parent).glob("*.py")):
        for cls in ast.parse(path.read_text()).body:
            if not (isinstance(cls, ast.ClassDef) and cls.name.endswith("Decoder")):
                continue
            for method in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"):
                for node in ast.walk(method):
                    targets = node.targets if isinstance(node, ast.Assign) else getattr(node, "target", None)
                    for target in targets if isinstance(targets, list) else [targets]:
                        for element in ast.walk(target) if target is not None else []:
                            if (
                                isinstance(element, ast.Attribute)
                                and isinstance(element.value, ast.Name)
                                and element.value.id == "self"
                                and isinstance(element.ctx, ast.Store)
                                and (cls.name, method.name) not in carried
                            ):
                                found.append(f"{path.name}: {cls.name}.{method.name} sets self.{element.attr}")
    assert not found, found


def test_a_completion_keeps_its_leading_space_under_a_llama_tokenizer():
    """Llama-2's tokenizer.json decoder strips one leading space from a text: a HumanEval completion decoded alone
    lost a space of its first line's indent (an IndentationError, pass@k ~0); after the prompt it keeps it."""
    backend = Tokenizer(bpe_models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = text_decoders.Sequence(
        [
            text_decoders.Replace("\u2581", " "),
            text_decoders.ByteFallback(),
            text_decoders.Fuse(),
            text_decoders.Strip(" ", 1, 0),
        ]
    )
    prompt, completion = "def f(x):\n", "    return x\n"
    backend.train_from_iterator([prompt + completion] * 4, trainers.BpeTrainer(special_tokens=["<unk>", "<s>"]))
    tokenizer = LlamaTokenizerFast(tokenizer_object=backend, bos_token="<s>", unk_token="<unk>")
    prompt_ids = tokenizer(prompt)["input_ids"]  # <s>, then the dummy-prefixed prompt
    pieces = Tokenizer.from_str(backend.to_str())  # the same vocab without the dummy prefix: what a
    pieces.normalizer = normalizers.Replace(" ", "\u2581")  # model writing the completion emits
    completion_ids = pieces.encode(completion).ids
    assert tokenizer.decode(prompt_ids + completion_ids, skip_special_tokens=True) == prompt + completion
    assert tokenizer.decode(completion_ids) == completion[1:]  # the defect: decoded alone, one space short
    assert completion_text(tokenizer, prompt_ids, completion_ids) == completion


def test_warpers_are_transformers_temperature_top_k_and_top_p():
    """warp_logits keeps exactly the tokens transformers' warpers keep, at their values; a tie at the top-p
    boundary keeps one token, as transformers does; `ar`'s sampled token is warped too (top-k 1: the argmax)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from specrepro.decoding.sampling import pick_token

    logits = 3 * torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    for temperature, top_k, top_p in ((0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.6), (0.5, 8, 0.9), (1.0, 1, 1.0)):
        expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
        expected = TopKLogitsWarper(top_k)(None, expected) if top_k else expected
        expected = TopPLogitsWarper(top_p)(None, expected) if top_p < 1 else expected
        torch.testing.assert_close(warp_logits(logits, Sampling(True, temperature, top_k, top_p)), expected)
    assert torch.isfinite(warp_logits(torch.zeros(2), Sampling(True, 1.0, 0, 0.5))).sum() == 1
    top1 = Sampling(True, 1.0, 1, 1.0)
    assert {int(pick_token(logits[0], top1, torch.Generator().manual_seed(s))) for s in range(20)} == {
        int(logits[0].argmax())
    }


def _emitted_distributions_match(verify, target_rows, n=1500):
    """Run `verify(rng, draws)` n times (fresh seeds); the token it emits at each position must follow that
    position's `target_rows(tokens, path)` distribution (chi-square p > 1e-3, none where it is 0)."""
    from collections import defaultdict

    from scipy.stats import chisquare

    counts = defaultdict(lambda: torch.zeros(5))
    for seed in range(n):
        tokens, path = verify(torch.Generator().manual_seed(seed), torch.Generator().manual_seed(10**6 + seed))
        for position, token in enumerate(tokens):
            counts[target_rows(position, path)][token] += 1
    for row, observed in counts.items():
        expected = TARGET_P[row] * observed.sum()
        assert observed[expected == 0].sum() == 0, f"row {row} emitted a token the target rules out"
        assert chisquare(observed[expected > 0], expected[expected > 0]).pvalue > 1e-3, (row, observed, expected)


# warped target distributions (top-k 4 of 5 rules one token out in each row) and draft distributions
TARGET_LOGITS = torch.tensor(
    [[2.0, 1.0, 0.0, -1.0, 0.5], [0.0, 2.5, -1.0, 1.0, 0.3], [1.0, -2.0, 0.0, 1.5, 0.2], [0.0, 0.1, 1.2, -3.0, 0.4]]
)
SAMPLED = Sampling(do_sample=True, temperature=0.8, top_k=4)
TARGET_P = warp_logits(TARGET_LOGITS, SAMPLED).softmax(-1)
DRAFT_Q = torch.tensor([[0.1, 0.6, 0.0, 0.2, 0.1], [0.3, 0.1, 0.4, 0.0, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]])


def test_speculative_sampling_of_a_chain_emits_each_token_from_the_target_distribution():
    """speculative_verify on fixed p and q: with drafts drawn from q, or deterministic (q None) and one of them
    ruled out by p, the first token follows p's first row and each later one, once reached, its own row."""

    def sampled_chain(rng, draws):
        drafts = torch.multinomial(DRAFT_Q[:2], 1, generator=draws).view(-1)
        return speculative_verify(drafts, DRAFT_Q[:2], TARGET_LOGITS[:3], SAMPLED, rng)[0], None

    def deterministic_chain(rng, draws):
        return speculative_verify(torch.tensor([0, 2]), None, TARGET_LOGITS[:3], SAMPLED, rng)[0], None

    for verify in (sampled_chain, deterministic_chain):
        _emitted_distributions_match(verify, lambda position, path: position)


def test_speculative_sampling_of_a_tree_emits_each_token_from_the_target_distribution():
    """tree_verify: a sampled chain 0 -> 1 with a deterministic sibling 2 of node 0, and three deterministic
    siblings (one repeated, one ruled out by p): the first token follows p at the root, the next that of the
    node it follows."""

    def sampled_tree(rng, draws):
        drafts = torch.cat([torch.multinomial(DRAFT_Q[:2], 1, generator=draws).view(-1), torch.tensor([4])])
        q = torch.cat([DRAFT_Q[:2], torch.nn.functional.one_hot(drafts[2:], 5).float()])
        return tree_verify(drafts, [-1, 0, -1], q, TARGET_LOGITS, SAMPLED, rng)

    def deterministic_siblings(rng, draws):
        return tree_verify(torch.tensor([0, 3, 0]), [-1, -1, -1], None, TARGET_LOGITS, SAMPLED, rng)

    _emitted_distributions_match(sampled_tree, lambda position, path: 0 if position == 0 else path[position - 1] + 1)
    _emitted_distributions_match(deterministic_siblings, lambda position, path: 0 if position == 0 else path[0] + 1)
