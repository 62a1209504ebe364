"""`hardware.compile`: the target's steps on a static cache, compiled per padded width (decoding/steps.py).

On the CPU the `aot_eager` backend captures the same graphs as inductor without generating code, which is
what these tests check: graph capture, padding, masks and the static cache's rollback give token-identical
output to eager `ar` (tests/test_cuda.py runs the inductor + CUDA graphs path on a GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.eagle import DRAFT_CACHE, EagleConfig, EagleDecoder, EagleDraft
from specrepro.decoding.eesd import EarlyExitHead, EESDConfig, EESDDecoder
from specrepro.decoding.hf_assisted import HFAssistedConfig, HFAssistedDecoder
from specrepro.decoding.jacobi import JacobiDecoder
from specrepro.decoding.lookahead import LookaheadConfig, LookaheadDecoder
from specrepro.decoding.pld import PLDConfig, PLDDecoder
from specrepro.decoding.self_sd import SelfSDConfig, SelfSDDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.sar_draft import SARDraftConfig, SARDraftDecoder, head_for
from specrepro.decoding.space import SpaceDecoder
from specrepro.decoding.sps import SPSDecoder
from specrepro.decoding.steps import STEPS_ATTRIBUTE, CompiledSteps, EagerSteps
from specrepro.decoding.token_recycling import TokenRecyclingConfig, TokenRecyclingDecoder
from specrepro.decoding.verify import crop_cache, tree_attention
from specrepro.config import RandomArchConfig
from specrepro.errors import SpecReproError
from specrepro.models.kernels import set_linear_kernel
from specrepro.models.loading import random_llama
from tests.conftest import host_reads, tiny_llama
from tests.test_decoding import prompts
from tests.test_runner import FAST, run_dirs, specrepro

GREEDY = Sampling()


def torch_llama(**kwargs):
    return set_linear_kernel(tiny_llama(**kwargs), "torch")


@pytest.fixture(scope="module")
def compiled_target():
    """A tiny target whose steps are compiled (aot_eager), its widths warmed up once for the module."""
    model = torch_llama(vocab_size=64, seed=1, num_layers=2, logit_scale=3.0)
    steps = CompiledSteps(model, backend="aot_eager", widths=[1, 4, 16])
    steps.warm_up(max_width=65, length=80, hidden=True)  # pld_heuristic's widest step; hidden states for sar, space
    setattr(model, STEPS_ATTRIBUTE, steps)
    return model


@pytest.fixture(scope="module")
def differentiating_target():
    """The same, its steps checking after warm-up only the guards that tell their graphs apart
    (`hardware.compile_guards=differentiating`)."""
    model = torch_llama(vocab_size=64, seed=1, num_layers=2, logit_scale=3.0)
    steps = CompiledSteps(model, backend="aot_eager", widths=[1, 4, 16], guards="differentiating")
    steps.warm_up(max_width=65, length=80, hidden=True)
    setattr(model, STEPS_ATTRIBUTE, steps)
    return model


def compiled_decoders(model, draft):
    def sar(tree_width, variant="block"):  # its target steps return hidden states too (`steps.with_hidden`)
        return sar_decoder(model, variant, tree_width=tree_width)

    def eesd(exit_layer=True, **cfg):  # its draft runs layer 0 and its exit layer, its verification layer 1
        head = EarlyExitHead(model, num_layers=1, exit_layer=exit_layer).eval()
        return EESDDecoder(model, None, head, EESDConfig(num_layers=1, exit_layer=exit_layer, head="none", **cfg))

    return {
        "ar": ARDecoder(model),
        "ar_chunked": ARDecoder(model, sync_every=8),  # reads its tokens every 8 steps, as on a GPU
        "pld": PLDDecoder(model, None, PLDConfig()),
        "pld_heuristic": PLDDecoder(model, None, PLDConfig(controller="heuristic")),  # widths past 16 run eagerly
        "sps": SPSDecoder(model, None, draft, 4, "fixed", 16),
        "sar_draft": sar(1),
        "sar_draft_tree": sar(4),
        "sar_draft_simplified": sar(1, "simplified"),  # the paper's head, compiled as the others
        "sar_draft_transformer": sar(1, "transformer"),
        "sar_draft_lstm": sar(1, "lstm"),  # drafts eagerly: dynamo cannot capture nn.LSTM
        "jacobi": JacobiDecoder(model, block_size=4),  # a shrinking state: widths 4, 3, 2, 1
        "jacobi_sliding": JacobiDecoder(model, block_size=16, sliding=True),
        "space": SpaceDecoder(model, None, MASK, k=3),  # a 16-slot block with its custom mask, hidden states only
        "space_wide": SpaceDecoder(model, None, MASK, k=5),  # 36 slots: past the largest bucket, run eagerly
        "eesd": eesd(control="fixed", k=3),
        "eesd_beta_ts": eesd(k_max=6),  # round lengths drawn every round: every width up to 7
        "eesd_tree": eesd(control="fixed", k=2, tree_width=3),
        "eesd_without_exit_layer": eesd(exit_layer=False, control="fixed", k=3),
        "eagle": eagle_decoder(model, depth=3, top_k=1, total_tokens=3),  # a chain
        "eagle_tree": eagle_decoder(model),  # EAGLE-2's dynamic tree; its draft layer on a static cache of its own
        **self_sd_decoders(model),
    }


def eagle_decoder(model, steps=None, **cfg) -> EagleDecoder:
    """EAGLE with a random draft (a dynamic tree of 3 levels, top-4, 10 nodes unless `cfg` says otherwise)."""
    torch.manual_seed(0)
    draft = EagleDraft(model.config).to(model.device, model.dtype).eval().attach_lm_head(model.lm_head)
    cfg = EagleConfig(**{"depth": 3, "top_k": 4, "total_tokens": 10, "head": "none", **cfg})
    return EagleDecoder(model, None, draft, cfg, steps)


def sar_decoder(model, variant: str, steps=None, **cfg) -> SARDraftDecoder:
    """sar_draft with a random head of `variant` (k = 3 a round unless `cfg` says otherwise)."""
    head = head_for(model, variant, 4, 16, 1, False).eval()
    return SARDraftDecoder(model, None, head, SARDraftConfig(variant=variant, **{"k": 3, "k_max": 4, **cfg}), steps)


def self_sd_decoders(model):
    """Draft & Verify on the 2-layer target: a draft that skips layer 0's attention and layer 1's MLP."""
    return {
        "self_sd": SelfSDDecoder(model, None, [0], [1], SelfSDConfig(control="adaptive", k=6)),
        "self_sd_tree": SelfSDDecoder(model, None, [0], [1], SelfSDConfig(control="fixed", k=3, tree_width=3)),
        "self_sd_draft_vocab": SelfSDDecoder(
            model,
            None,
            [0],
            [1],  # its draft reads hidden states
            SelfSDConfig(control="fixed", k=3, draft_vocab=16),
            vocab_ranking=torch.arange(64),
        ),
    }


MASK = 63  # SPACE's mask token on the tiny target (untrained: its drafts are poor, its output still ar's)
COMPILABLE = [
    "ar",
    "ar_chunked",
    "pld",
    "pld_heuristic",
    "sps",
    "sar_draft",
    "sar_draft_tree",
    "sar_draft_simplified",
    "sar_draft_transformer",
    "sar_draft_lstm",
    "jacobi",
    "jacobi_sliding",
    "space",
    "space_wide",
    "eesd",
    "eesd_beta_ts",
    "eesd_tree",
    "eesd_without_exit_layer",
    "self_sd",
    "self_sd_tree",
    "self_sd_draft_vocab",
    "eagle",
    "eagle_tree",
]


@pytest.mark.parametrize("name", COMPILABLE)
def test_compiled_greedy_output_equals_eager_ar(compiled_target, name):
    draft = torch_llama(vocab_size=64, seed=2, num_layers=1)
    decoder = compiled_decoders(compiled_target, draft)[name]
    assert decoder.steps.compiled
    eager_ar = ARDecoder(compiled_target, steps=EagerSteps(compiled_target))
    for prompt in prompts():
        reference = eager_ar.generate(prompt, GREEDY, 40).token_ids
        assert decoder.generate(prompt, GREEDY, 40).token_ids == reference


@pytest.mark.parametrize(
    "name", ["ar_chunked", "pld", "sps", "sar_draft_tree", "jacobi", "space", "eesd_tree", "self_sd_tree", "eagle_tree"]
)
def test_steps_checking_only_differentiating_guards_equal_eager_ar(differentiating_target, name):
    """With only the guards that tell a code object's graphs apart checked, each family of graphs still runs the
    graph it traced: the target's widths, a layer slice on its cache or the draft's own, a model state (self_sd), a
    draft head's step."""
    from specrepro.runner import compile_steps_for

    draft = torch_llama(vocab_size=64, seed=2, num_layers=1)
    decoder = compiled_decoders(differentiating_target, draft)[name]
    compile_steps_for(80, [decoder])  # as the runner does: its slices, states and head steps too, or they would raise
    eager_ar = ARDecoder(differentiating_target, steps=EagerSteps(differentiating_target))
    for prompt in prompts():
        assert decoder.generate(prompt, GREEDY, 40).token_ids == eager_ar.generate(prompt, GREEDY, 40).token_ids


@pytest.mark.parametrize("name", ["lookahead", "token_recycling"])
def test_a_step_wider_than_every_bucket_fits_the_static_cache_at_the_budgets_end(name):
    """Lookahead's window and Token Recycling's tree are verified whole until the budget's last tokens, in steps wider
    than the largest width (run uncompiled): the cache warmed up for the longest prompt holds their rows too."""
    from specrepro.runner import compile_steps_for

    model = torch_llama(vocab_size=64, seed=1, num_layers=2, logit_scale=3.0)
    model.generation_config.eos_token_id = None
    eager_ar = ARDecoder(model, steps=EagerSteps(model))
    setattr(model, STEPS_ATTRIBUTE, CompiledSteps(model, backend="eager", widths=[1, 4, 16]))
    if name == "lookahead":
        decoder = LookaheadDecoder(model, None, LookaheadConfig(window=8, ngram=4, guesses=8))  # 49 rows
    else:
        decoder = TokenRecyclingDecoder(model, None, TokenRecyclingConfig())  # 81 rows
    prompt, budget = [5, 6, 7, 8] * 6, 88  # 24 + 88 + the widest bucket (16) = 128 positions: no rounding slack
    compile_steps_for(len(prompt) + budget, [decoder])
    assert decoder.generate(prompt, GREEDY, budget).token_ids == eager_ar.generate(prompt, GREEDY, budget).token_ids


def test_the_hardware_config_picks_the_guards_the_loaded_steps_check():
    from specrepro.config import HardwareConfig
    from specrepro.decoding.steps import compile_steps

    for guards in ("all", "differentiating"):
        model = torch_llama(vocab_size=64, seed=1, num_layers=1)
        hardware = HardwareConfig(
            compile=True, compile_backend="aot_eager", linear_kernel="torch", compile_guards=guards
        )
        compile_steps(model, hardware)
        assert getattr(model, STEPS_ATTRIBUTE).guards == guards


def test_the_hardware_config_freezes_the_loaded_steps_under_the_mode_it_names():
    """torch.compile takes a mode or options: freezing's options carry the mode's (CUDA graphs)."""
    from specrepro.config import HardwareConfig
    from specrepro.decoding.steps import FREEZING_OPTIONS, compile_steps

    for mode, freezing in ((None, False), (None, True), ("reduce-overhead", True)):
        model = torch_llama(vocab_size=64, seed=1, num_layers=1)
        compile_steps(
            model, HardwareConfig(compile=True, compile_mode=mode, linear_kernel="torch", compile_freezing=freezing)
        )
        options = getattr(model, STEPS_ATTRIBUTE).options
        if not freezing:
            assert "options" not in options
            continue
        assert "mode" not in options and options["options"].items() >= FREEZING_OPTIONS.items()
        assert options["options"].get("triton.cudagraphs", False) == (mode == "reduce-overhead")


@pytest.mark.slow  # inductor generates and builds C++ for each width
def test_frozen_steps_decode_eager_ars_tokens_on_weights_folded_into_their_graphs():
    """`hardware.compile_freezing`: the warmed-up graphs hold the weights as constants (a weight changed afterwards
    is not seen: what makes q/k/v one matmul), decode eager `ar`'s tokens, and compile nothing more."""
    from torch._dynamo.utils import counters

    model = torch_llama(vocab_size=64, seed=1, num_layers=2, logit_scale=3.0)
    steps = CompiledSteps(model, backend="inductor", widths=[1, 4], freezing=True)
    steps.warm_up(max_width=4, length=64)
    compiled = counters["stats"]["unique_graphs"]
    eager_ar = ARDecoder(model, steps=EagerSteps(model))
    for decoder in (ARDecoder(model, steps=steps), PLDDecoder(model, None, PLDConfig(), steps=steps)):
        for prompt in prompts():
            assert decoder.generate(prompt, GREEDY, 24).token_ids == eager_ar.generate(prompt, GREEDY, 24).token_ids
    assert counters["stats"]["unique_graphs"] == compiled

    cache = steps.new_cache(8)
    with torch.inference_mode():
        steps(torch.tensor([[1, 2, 3]]), cache)  # the prefill, eager
        before = steps(torch.tensor([[4]]), cache, past=3).logits
        crop_cache(cache, 3)
        model.lm_head.weight.zero_()
        assert torch.equal(steps(torch.tensor([[4]]), cache, past=3).logits, before) and before.abs().max() > 0


def test_differentiating_guards_refuse_a_graph_warm_up_did_not_compile():
    """Checking only the guards that tell its graphs apart, a step that warm-up did not compile raises rather than
    run a graph traced for other inputs (or compile inside a timed region): a width, the hidden-state forward."""
    model = torch_llama(vocab_size=64, seed=1, num_layers=2)
    steps = CompiledSteps(model, backend="aot_eager", widths=[1, 2], guards="differentiating")
    steps.warm_up(max_width=1, length=40)
    cache = steps.new_cache(40)
    with torch.inference_mode():
        steps(torch.tensor([[1, 2, 3]]), cache)  # the prefill, eager
        steps(torch.tensor([[4]]), cache)  # width 1: compiled
        for step in (lambda: steps(torch.tensor([[5, 6]]), cache), lambda: steps.hidden(torch.tensor([[5]]), cache)):
            with pytest.raises(RuntimeError, match="Recompilation triggered with skip_guard_eval_unsafe"):
                step()


def test_compiled_ar_steps_read_the_device_once_a_chunk(compiled_target):
    """A compiled step continues the position the caller gives it: nothing in a chunk of `ar`'s steps reads the
    device but the chunk's tokens, at its end (on a GPU, the host queues the chunk's steps while earlier ones run)."""
    decoder = ARDecoder(compiled_target, sync_every=8)
    decoder.eos_ids = set()
    assert host_reads(decoder, prompts()[0], 41) - host_reads(decoder, prompts()[0], 9) == 4  # 5 chunks, not 1


# Reads of the device in a greedy round beyond the one that reads the verification's choices (each a wait on a
# GPU): what a method's own rule needs. Every other method drafts, verifies and rolls back on what it knows.
EXTRA_READS_PER_ROUND = {
    "pld": 1,  # the committed tokens, searched on the host
    "pld_heuristic": 1,
    "jacobi": 1,  # a round that draws new guesses from the context reads the picks
    "jacobi_sliding": 1,
    "self_sd": 6,  # the adaptive exit reads each draft's top-1 probability (k_max 6)
    "eagle": 1,  # EAGLE-2's tree, built on the device, read once chosen (its shape masks the verification)
    "eagle_tree": 1,
}


@pytest.mark.parametrize("name", COMPILABLE)
def test_a_compiled_round_reads_the_device_only_where_its_method_must(compiled_target, name):
    """On compiled steps, which get every position from the caller, a round reads the device once (the target's
    choices and the drafts, at once) plus what its method's own rule reads (`EXTRA_READS_PER_ROUND`): drafters
    track their caches' lengths, verification and a tree's rollback read nothing else, and a draft vocabulary's
    token ids are gathered on the device."""
    decoder = compiled_decoders(compiled_target, torch_llama(vocab_size=64, seed=2, num_layers=1))[name]
    decoder.eos_ids = set()
    short, long = (decoder.generate(prompts()[0], GREEDY, budget).steps for budget in (9, 41))
    reads = host_reads(decoder, prompts()[0], 41) - host_reads(decoder, prompts()[0], 9)
    assert reads <= (1 + EXTRA_READS_PER_ROUND.get(name, 0)) * (long - short)


@pytest.mark.parametrize("name", ["sps", "sar_draft"])
def test_a_sampled_chain_round_reads_the_device_once(compiled_target, name):
    """Sampling too: a draw is `torch.multinomial`'s without its validity checks' reads, and speculative sampling's
    acceptances, residual and next token stay on the device until the round's one read."""
    decoder = compiled_decoders(compiled_target, torch_llama(vocab_size=64, seed=2, num_layers=1))[name]
    decoder.eos_ids = set()
    sampling = Sampling(do_sample=True, temperature=1.0)
    short, long = (decoder.generate(prompts()[0], sampling, budget).steps for budget in (9, 41))
    assert (
        host_reads(decoder, prompts()[0], 41, sampling) - host_reads(decoder, prompts()[0], 9, sampling) == long - short
    )


@pytest.mark.parametrize("name", ["sar_draft_tree", "eesd_tree", "self_sd_tree", "eagle_tree"])
def test_a_sampled_tree_round_reads_the_device_once_a_node_on_its_path(compiled_target, name):
    """A sampled tree's verification runs a node's stages (each child against what the earlier ones left of p) on
    the device and reads which child it accepted, if any: one read for each node the accepted path visits."""
    decoder = compiled_decoders(compiled_target, torch_llama(vocab_size=64, seed=2, num_layers=1))[name]
    decoder.eos_ids = set()
    sampling = Sampling(do_sample=True, temperature=1.0)
    short, long = (decoder.generate(prompts()[0], sampling, budget) for budget in (9, 41))
    rounds, accepted_drafts = (
        long.steps - short.steps,
        sum(long.accepted) - sum(short.accepted) - (long.steps - short.steps),
    )
    reads = host_reads(decoder, prompts()[0], 41, sampling) - host_reads(decoder, prompts()[0], 9, sampling)
    assert accepted_drafts > 0 and reads <= (1 + EXTRA_READS_PER_ROUND.get(name, 0)) * rounds + accepted_drafts


@pytest.mark.parametrize("name", ["eagle", "eagle_tree"])
def test_eagle_drafts_without_reading_its_draft_caches_length(compiled_target, name, monkeypatch):
    """EAGLE knows how many rows its draft cache holds (the committed pairs, then a round's expanded nodes) and gives
    each draft step that length: a compiled step would otherwise read it from the device, once a tree level."""
    decoder = compiled_decoders(compiled_target, torch_llama(vocab_size=64, seed=2, num_layers=1))[name]
    reference = decoder.generate(prompts()[0], GREEDY, 24).token_ids
    draft_cache = compiled_target.specrepro_steps.caches[DRAFT_CACHE]

    def read(*args):
        raise AssertionError("the draft cache's length was read")

    monkeypatch.setattr(draft_cache, "get_seq_length", read)
    assert decoder.generate(prompts()[0], GREEDY, 24).token_ids == reference


def test_compiled_sampling_draws_what_eager_sampling_draws(compiled_target):
    """Same seed, same logits: speculative sampling on compiled steps emits eager sampling's tokens, so the
    target-distribution tests of eager sps carry over."""
    draft = torch_llama(vocab_size=64, seed=2, num_layers=1)
    sampling = Sampling(do_sample=True, temperature=1.0)
    compiled = SPSDecoder(compiled_target, None, draft, 3, "fixed", 16)
    eager = SPSDecoder(compiled_target, None, draft, 3, "fixed", 16)
    eager.steps = EagerSteps(compiled_target)
    for seed, prompt in enumerate(prompts()):
        assert (
            compiled.generate(prompt, sampling, 30, seed).token_ids
            == eager.generate(prompt, sampling, 30, seed).token_ids
        )


def test_a_tree_verification_on_compiled_steps_gives_the_eager_logits(compiled_target):
    """A token tree's custom mask, padded to the bucket and to the static cache's length, is an input of the
    same graph a chain uses; its rows equal an eager tree verification's."""
    prompt = torch.tensor([prompts()[0][:10]])
    parents = [-1, 0, 1, -1, 3]  # two branches under the last token
    nodes = torch.tensor([[7, 8, 9, 10, 11]])
    outputs = []
    for steps in (compiled_target.specrepro_steps, EagerSteps(compiled_target)):
        with torch.inference_mode():
            cache = steps.new_cache(64)
            steps(prompt, cache, logits_to_keep=1)
            allow, positions = tree_attention(parents, prompt.shape[1])
            verify_input = torch.cat([torch.tensor([[5]]), nodes], dim=1)  # [the last committed token, nodes]
            outputs.append(steps(verify_input, cache, tree=(allow, positions)).logits[0])
            assert int(cache.get_seq_length()) == prompt.shape[1] + 1 + len(parents)  # padding rows are not kept
    torch.testing.assert_close(outputs[0], outputs[1])


def wide_bf16_llama(seed: int) -> torch.nn.Module:
    """A one-layer bf16 LLaMA of SmolLM2's width: wide enough that a matmul of one row and one of several round a
    row differently on this CPU (seed 0: the few-width steps below give a block other logits than one-token steps)."""
    arch = RandomArchConfig(vocab_size=96, seed=seed, num_layers=1, hidden_size=576, intermediate_size=1536)
    return set_linear_kernel(random_llama(arch).eval(), "torch").to(torch.bfloat16)


def row_invariant_steps(model, widths=(1, 4, 16), backend="aot_eager", mode=None) -> CompiledSteps:
    """Row-invariant compiled steps (`hardware.row_invariant`: the widest width only) attached to `model`."""
    steps = CompiledSteps(model, backend=backend, mode=mode, widths=widths, row_invariant=True)
    setattr(model, STEPS_ATTRIBUTE, steps)
    return steps


def one_token_and_block_logits(steps, seed: int) -> tuple:
    """Logits of 6 tokens after a 24-token prefix: scored one token a step, in one block forward, and by
    `with_hidden` (with its hidden states), on `steps` warmed up to 16 rows."""
    steps.warm_up(16, 64)
    tokens = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(seed))
    cache = steps.new_cache(64)
    with torch.inference_mode():
        steps(tokens[:, :24], cache)
        one_token_steps = torch.cat([steps(tokens[:, i : i + 1], cache).logits[0] for i in range(24, 30)])
        crop_cache(cache, 24)
        block = steps(tokens[:, 24:], cache).logits[0]
        crop_cache(cache, 24)
        headed, hidden = steps.with_hidden(tokens[:, 24:], cache)
    return one_token_steps, block, headed[0], hidden


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_row_invariant_compiled_steps_give_a_block_the_one_token_steps_logits(seed):
    """`hardware.row_invariant` on compiled steps: one width, one graph for logits and hidden states, so a
    verification's rows (`__call__` and `with_hidden`) equal one-token steps bit for bit in bf16."""
    steps = row_invariant_steps(wide_bf16_llama(seed))
    assert steps.widths == (16,)
    one_token_steps, block, headed, hidden = one_token_and_block_logits(steps, seed)
    assert torch.equal(block, one_token_steps) and torch.equal(headed, one_token_steps)
    assert hidden.shape == (1, 6, 576)


def test_compiled_steps_of_several_widths_round_a_block_otherwise_in_bf16():
    """What row invariance is for: without it the block runs at width 16 and the steps at width 1, other kernels
    (skipped on a CPU whose bf16 matmul happens to round this model's rows alike at both widths)."""
    steps = CompiledSteps(wide_bf16_llama(0), backend="aot_eager", widths=[1, 4, 16])
    one_token_steps, block, _, _ = one_token_and_block_logits(steps, 0)
    if torch.equal(block, one_token_steps):
        pytest.skip("this CPU's bf16 matmul rounds a row alike at widths 1 and 16 on this model")
    assert (block.float() - one_token_steps.float()).abs().max() < 1e-2  # rounding, not another computation


def test_row_invariant_compiled_chains_decode_ar_tokens_in_bf16():
    """Greedy chains run on row-invariant compiled steps in bf16 and give compiled `ar`'s tokens: a draft-model-free
    chain (pld), a head on the target's hidden states (sar_draft, `with_hidden`) and EAGLE's chain (its draft cache
    spares a second width). The test above shows the rows equal; this model's margins rarely make them matter."""
    torch.manual_seed(0)
    model = wide_bf16_llama(0)
    row_invariant_steps(model)
    head = head_for(model, "block", 4, 16, 1, False).to(torch.bfloat16).eval()
    decoders = {
        "pld": PLDDecoder(model, None, PLDConfig()),
        "sar_draft": SARDraftDecoder(model, None, head, SARDraftConfig(k=3, k_max=4)),
        "eagle": eagle_decoder(model, depth=3, top_k=1, total_tokens=3),
    }
    from specrepro.runner import compile_steps_for

    ar = ARDecoder(model)
    compile_steps_for(80, [ar, *decoders.values()])
    for prompt in prompts()[:3]:
        reference = ar.generate(prompt, GREEDY, 24).token_ids
        for name, decoder in decoders.items():
            assert decoder.generate(prompt, GREEDY, 24).token_ids == reference, name


def test_row_invariant_compiled_steps_refuse_wider_steps_and_other_heads():
    """A step wider than the one width would run uncompiled, rounding otherwise: refused at warm-up. So is a model
    whose logits are not its LM head on the last hidden states (row-invariant steps compute them so)."""
    model = wide_bf16_llama(1)
    with pytest.raises(SpecReproError, match=r"one width, 16, but this method's steps take up to 17 rows"):
        row_invariant_steps(model).warm_up(17, 64)
    forward = model.forward

    def soft_capped(*args, **kwargs):  # as Gemma 2's final soft-cap: logits that are not the LM head's
        out = forward(*args, **kwargs)
        return type(out)(logits=30 * torch.tanh(out.logits / 30))

    model.forward = soft_capped
    with pytest.raises(SpecReproError, match="needs logits = lm_head"):
        row_invariant_steps(model).warm_up(16, 64)


def sps_with_compiled_draft(model, tree_width=1, draft_vocab=False):
    """sps whose draft, a copy of the tiny target with noise on its LM head (accepted at times, not always), runs
    on compiled steps of its own (not warmed up: the runner does that)."""
    draft = torch_llama(vocab_size=64, seed=1, num_layers=2, logit_scale=3.0)
    noise = torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        draft.lm_head.weight.add_(0.05 * noise)  # rounds that keep from 1 to all 5 tokens
    setattr(draft, STEPS_ATTRIBUTE, CompiledSteps(draft, backend="aot_eager", widths=[1, 2, 4, 8]))
    frequent = torch.arange(3, 40) if draft_vocab else None  # a reduced vocabulary: the draft's hidden-state graphs
    return SPSDecoder(model, None, draft, 4, "fixed", 16, tree_width=tree_width, frequent=frequent)


def warmed_eesd(model):
    return EESDDecoder(
        model,
        None,
        EarlyExitHead(model, num_layers=1).eval(),
        EESDConfig(num_layers=1, head="none", k_max=6, tree_width=2),
    )


WARMED = {  # decoders whose compiled steps include graphs beyond the widths: EESD's layer slices, self_sd's state
    "eesd": lambda model: [warmed_eesd(model)],
    "self_sd": lambda model: [self_sd_decoders(model)["self_sd"]],
    "eesd_and_self_sd": lambda model: [warmed_eesd(model), self_sd_decoders(model)["self_sd"]],  # one warm-up
    "sps_compiled_draft": lambda model: [sps_with_compiled_draft(model, tree_width=3, draft_vocab=True)],
    "sar_draft_head": lambda model: [sar_decoder(model, "simplified", k=2, controller="heuristic", k_max=4)],
    "eagle": lambda model: [eagle_decoder(model, depth=3, top_k=2, total_tokens=5)],
}


@pytest.mark.parametrize("name", sorted(WARMED))
def test_a_warmed_up_decoder_compiles_nothing_while_it_decodes(name):
    """The runner warms up every width, layer slice (EESD's draft and exit layer), model state (self_sd's skipped
    sub-layers, left around every verification) and draft model's step (sps's) a decoder can take
    (`compile_steps_for`), so no graph is compiled inside the timed region."""
    from torch._dynamo.utils import counters

    from specrepro.runner import compile_steps_for

    model = torch_llama(vocab_size=64, seed=1, num_layers=2, logit_scale=3.0)
    setattr(model, STEPS_ATTRIBUTE, CompiledSteps(model, backend="aot_eager", widths=[1, 2, 4, 8]))
    decoders = WARMED[name](model)
    assert compile_steps_for(80, decoders) > 0
    compiled = counters["stats"]["unique_graphs"]
    for decoder in decoders:
        for prompt in prompts():
            decoder.generate(prompt, GREEDY, 40)
    assert counters["stats"]["unique_graphs"] == compiled


@pytest.mark.parametrize(
    "name",
    [
        "self_sd",
        "self_sd_tree",
        "self_sd_draft_vocab",
        "eesd",
        "eesd_beta_ts",
        "eesd_tree",
        "eesd_without_exit_layer",
        "eagle",
        "eagle_tree",
    ],
)
def test_a_compiled_draft_drafts_what_the_eager_one_does(compiled_target, name):
    """Output equal to `ar` holds whatever a draft proposes; equal rounds show that the compiled draft computes what
    the eager one does: Draft & Verify's graphs skip the skip set's sub-layers (traced inside `skipped_sublayers`),
    not run the whole target; EESD's layer slices and exit layer, on static caches, see the eager draft's rows and
    positions (a static cache's `get_seq_length` is its live write position: kept uncopied, it was rolled back
    under EESD, whose exit layer then read the wrong rows, losslessly); EAGLE's draft layer, padded on a static cache
    whose expanded rows each round rolls back, grows the eager draft's trees."""
    draft = torch_llama(vocab_size=64, seed=2, num_layers=1)  # sps's, unused here
    compiled, eager = (compiled_decoders(compiled_target, draft)[name] for _ in range(2))
    eager.steps = EagerSteps(compiled_target)
    for prompt in prompts():
        ours, theirs = compiled.generate(prompt, GREEDY, 40), eager.generate(prompt, GREEDY, 40)
        assert (ours.token_ids, ours.accepted, ours.drafted) == (theirs.token_ids, theirs.accepted, theirs.drafted)


@pytest.mark.parametrize("variant", ["simplified", "block", "transformer"])
def test_a_compiled_sar_head_drafts_what_the_eager_one_does(compiled_target, variant):
    """The SAR head's forward, compiled (a graph per prefix length), gives the eager head's logits on every prefix
    length a round reaches, and the rounds and output equal an eager decoder's; recurrent heads stay eager."""
    compiled = sar_decoder(compiled_target, variant, tree_width=2)
    eager = sar_decoder(compiled_target, variant, EagerSteps(compiled_target), tree_width=2)
    eager.head = compiled.head
    assert compiled.compiled_head and not eager.compiled_head and len(compiled.drafter_calls) == 3
    hp = torch.randn(compiled_target.config.hidden_size)
    with torch.inference_mode():
        for j in range(1, 4):
            prefix = torch.randint(0, 64, (j,))
            torch.testing.assert_close(compiled.next_draft_logits(hp, prefix), eager.next_draft_logits(hp, prefix))
    for prompt in prompts():
        ours, theirs = compiled.generate(prompt, GREEDY, 40), eager.generate(prompt, GREEDY, 40)
        assert (ours.token_ids, ours.accepted, ours.drafted) == (theirs.token_ids, theirs.accepted, theirs.drafted)
    assert not sar_decoder(compiled_target, "lstm").compiled_head


@pytest.mark.parametrize("tree_width, draft_vocab", [(1, False), (3, True)])
def test_a_compiled_draft_model_drafts_what_the_eager_one_does(tree_width, draft_vocab):
    """sps's draft on compiled steps of its own (a static cache rolled back by write position, its inputs padded to
    a bucket) proposes round for round what the eager draft does, and the output is eager `ar`'s."""
    from specrepro.runner import compile_steps_for

    model = torch_llama(vocab_size=64, seed=1, num_layers=2, logit_scale=3.0)
    setattr(model, STEPS_ATTRIBUTE, CompiledSteps(model, backend="aot_eager", widths=[1, 2, 4, 8]))
    compiled, eager = (sps_with_compiled_draft(model, tree_width, draft_vocab) for _ in range(2))
    compile_steps_for(80, [compiled])
    assert compiled.draft_steps.compiled and compiled.steps.compiled
    eager.steps, eager.draft_steps = EagerSteps(model), EagerSteps(eager.draft)
    eager_ar = ARDecoder(model, steps=EagerSteps(model))
    drafts_accepted = 0
    for prompt in prompts():
        ours, theirs = compiled.generate(prompt, GREEDY, 40), eager.generate(prompt, GREEDY, 40)
        assert (ours.token_ids, ours.accepted, ours.drafted) == (theirs.token_ids, theirs.accepted, theirs.drafted)
        assert ours.token_ids == eager_ar.generate(prompt, GREEDY, 40).token_ids
        drafts_accepted += sum(ours.accepted) - len(ours.accepted)
    assert drafts_accepted > 0  # the draft is accepted at times: equal rounds say something


def test_decoders_that_run_their_own_forwards_refuse_compiled_steps(compiled_target):
    with pytest.raises(SpecReproError, match="does not support hardware.compile"):
        HFAssistedDecoder(compiled_target, None, HFAssistedConfig(mode="prompt_lookup"))


def test_a_compiled_run_reports_speedups_over_compiled_and_eager_ar(tmp_path):
    compiled = [
        "hardware.compile=true",
        "hardware.compile_backend=aot_eager",
        "hardware.linear_kernel=torch",
        "hardware.compile_widths=[1,16]",
    ]
    args = ["run", *FAST, *compiled, "method=pld", "dataset=gsm8k", "dataset.limit=2", "timing.paired=true"]
    specrepro(*args, "logger=none", "reference=false", cwd=tmp_path)
    [first] = [json.loads((path / "metrics.json").read_text()) for path in run_dirs(tmp_path).values()]
    out = specrepro(*args, "logger=none", cwd=tmp_path)  # summarized again over its reference: nothing decoded
    runs = run_dirs(tmp_path)
    metrics = {key.split(":")[0]: json.loads((path / "metrics.json").read_text()) for key, path in runs.items()}
    assert set(metrics) == {"ar", "pld"}  # the reference is compiled `ar`
    pld = metrics["pld"]
    assert pld["compile_time"] == first["compile_time"] > 0  # the up-front compile, kept with its first sample
    assert pld["provenance"]["compile"]["compile"] is True
    assert pld["lossless"] == pld["lossless_paired"] == pld["lossless_eager"] == 1.0
    assert pld["speedup_paired"] > 0 and pld["speedup_paired_eager"] > 0
    assert pld["speedup_paired_ci95"] >= 0 and pld["speedup_paired_eager_ci95"] >= 0  # two prompts: an interval
    assert f"{pld['speedup_paired']:.2f}x ±{pld['speedup_paired_ci95']:.2f}x" in out.stdout  # the printed table


def test_a_row_invariant_compiled_run_refuses_a_method_wider_than_its_one_width(tmp_path):
    """`hardware=cuda_bf16_compiled_exact` on a CPU: one width, 4 here, where pld verifies up to 11 rows: refused in
    one line before anything is timed, not run uncompiled at other kernels."""
    from tests.test_config import compose_run

    preset = compose_run("method=pld", "hardware=cuda_bf16_compiled_exact").hardware
    assert (preset.compile, preset.row_invariant, list(preset.compile_widths)) == (True, True, [32])
    proc = specrepro(
        "run",
        *FAST,
        "hardware=cuda_bf16_compiled_exact",
        "hardware.device=cpu",
        "hardware.compile_backend=aot_eager",
        "hardware.compile_widths=[4]",
        "method=pld",
        "dataset.limit=1",
        "logger=none",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "pads every compiled step to one width, 4, but this method's steps take up to 11 rows" in proc.stderr


@pytest.mark.parametrize("guards", ["all", "differentiating"])
def test_a_generation_past_the_static_cache_is_compiled_for_before_it_is_timed(guards):
    """A later turn's prompt holds earlier answers and can outgrow the caches sized up front: `holds` says so, and
    `compile_steps_for` that length (the runner calls it untimed) leaves nothing to compile while it decodes. With
    only the guards that tell its graphs apart checked, the grown cache's shapes still pick new graphs."""
    from torch._dynamo.utils import counters

    from specrepro.runner import compile_steps_for, holds

    model = torch_llama(vocab_size=64, seed=1, num_layers=2, logit_scale=3.0)
    steps = CompiledSteps(model, backend="aot_eager", widths=[1, 2], cache_multiple=16, guards=guards)
    setattr(model, STEPS_ATTRIBUTE, steps)
    decoder = ARDecoder(model)
    assert not holds(20, [decoder])  # nothing compiled yet
    compile_steps_for(20, [decoder])
    prompt = list(range(1, 60))
    assert holds(20, [decoder]) and not holds(len(prompt) + 8, [decoder])
    compile_steps_for(len(prompt) + 8, [decoder])
    compiled = counters["stats"]["unique_graphs"]
    ours = decoder.generate(prompt, GREEDY, 8).token_ids
    assert counters["stats"]["unique_graphs"] == compiled
    assert ours == ARDecoder(model, steps=EagerSteps(model)).generate(prompt, GREEDY, 8).token_ids


def test_compile_steps_for_compiles_every_steps_object_its_decoders_run_on():
    """A bench's arm on steps of its own (other guards) is compiled with the rest, not in its first timed call."""
    from torch._dynamo.utils import counters

    from specrepro.runner import compile_steps_for, holds

    model = torch_llama(vocab_size=64, seed=1, num_layers=2, logit_scale=3.0)
    setattr(model, STEPS_ATTRIBUTE, CompiledSteps(model, backend="aot_eager", widths=[1, 2]))
    guarded = CompiledSteps(model, backend="aot_eager", widths=[1, 2], guards="differentiating")
    decoders = [ARDecoder(model), ARDecoder(model, steps=guarded), ARDecoder(model, steps=EagerSteps(model))]
    assert not holds(40, decoders)
    compile_steps_for(40, decoders)
    assert holds(40, decoders)
    compiled = counters["stats"]["unique_graphs"]
    for decoder in decoders:
        decoder.generate(prompts()[0], GREEDY, 8)
    assert counters["stats"]["unique_graphs"] == compiled


def test_steps_of_differently_shaped_models_each_keep_their_own_recompile_limit():
    """Dynamo allows `recompile_limit` (8) graphs per code object, and a graph traced for one model serves another of
    its shape: three depths of model alive at once (a target, a draft model, earlier tests' fixtures in one process)
    at three widths each need nine, so each steps object compiles on code objects of its own."""
    models = [torch_llama(vocab_size=64, seed=1, num_layers=depth) for depth in (1, 2, 3)]
    steps = [CompiledSteps(model, backend="aot_eager", widths=[1, 2, 4]) for model in models]
    for each in steps:
        each.warm_up(max_width=4, length=24)
    for model, each in zip(models, steps):
        reference = ARDecoder(model, steps=EagerSteps(model)).generate(prompts()[0], GREEDY, 4).token_ids
        assert ARDecoder(model, steps=each).generate(prompts()[0], GREEDY, 4).token_ids == reference


@pytest.mark.parametrize("config", ["mistral", "qwen2"])
def test_a_sliding_window_model_compiles_and_decodes_past_its_window(config):
    """Mistral-7B-v0.1's layers all attend in a sliding window: transformers' static layer for one counts its length
    in a Python int, which dynamo guards on, so compiled `ar` stopped at the recompile limit on its first tokens; and
    it drops the keys a rollback returns to, so a cache longer than the window was refused. The steps' layers are
    full ones and their masks apply the window, one for every layer (Mistral) or one per layer type (a Qwen2 with
    use_sliding_window): compiled `ar`, pld and token_recycling decode 30 tokens, past a 16-token window, as eager
    `ar` does. With the sliding layers' masks left unwindowed, compiled `ar` already differed."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    shape.update(num_key_value_heads=2, sliding_window=16, initializer_range=0.2)
    model = {
        "mistral": lambda: MistralForCausalLM(MistralConfig(**shape)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=True, max_window_layers=1)),
    }[config]().eval()
    steps = CompiledSteps(model, backend="aot_eager", widths=[1, 4])
    steps.warm_up(max_width=4, length=40)
    decoders = [
        ARDecoder(model, steps=steps),
        PLDDecoder(model, None, PLDConfig(), steps=steps),
        TokenRecyclingDecoder(model, None, TokenRecyclingConfig(candidates=2, tree=[[2], [1, 1]]), steps=steps),
    ]
    for prompt in prompts()[:2]:
        reference = ARDecoder(model, steps=EagerSteps(model)).generate(prompt, GREEDY, 30).token_ids
        for decoder in decoders:
            assert decoder.generate(prompt, GREEDY, 30).token_ids == reference


def test_compiled_steps_refuse_a_cache_longer_than_attention_chunks_in_one_line():
    """Compiled masks take a key's cache index for its position, which a tree's rows can carry across the edge of
    Llama 4's attention chunks: a static cache longer than a chunk is refused in one line (eager steps mask chunks
    exactly: tests/test_architectures.py)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    shape = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = Llama4TextConfig(
        **shape,
        num_key_value_heads=2,
        head_dim=16,
        attention_chunk_size=16,
        num_local_experts=2,
        intermediate_size_mlp=128,
    )
    steps = CompiledSteps(Llama4ForCausalLM(config).eval(), backend="aot_eager", widths=[1, 4])
    with pytest.raises(SpecReproError, match="attention chunks of 16 tokens") as refused:
        steps.warm_up(max_width=4, length=40)
    assert "\n" not in str(refused.value)


def test_caches_that_grow_compile_every_default_width_again_and_step_as_before():
    """A later turn that outgrows the static cache needs a second graph for each width: on the same code objects the
    default seven widths' fourteen graphs broke dynamo's limit of eight a code object (a hard failure under
    fullgraph, mid-run, for any method whose widest step is over 8). Grown caches compile on fresh code objects."""
    from specrepro.decoding.steps import DEFAULT_WIDTHS
    from specrepro.models.kernels import set_linear_kernel

    model = set_linear_kernel(tiny_llama(seed=1), "torch")
    steps = CompiledSteps(model, backend="eager", widths=DEFAULT_WIDTHS)
    steps.warm_up(max_width=64, length=40)
    steps.warm_up(max_width=64, length=200)  # raised FailOnRecompileLimitHit
    prompt = torch.randint(3, 64, (1, 141), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # a prefill past the first caches' 128 positions, then a one-token compiled step
        cache = steps.new_cache(200)
        steps(prompt[:, :140], cache, logits_to_keep=1)
        compiled = steps(prompt[:, 140:], cache, logits_to_keep=1).logits[0, -1]
        eager = EagerSteps(model)(prompt, EagerSteps(model).new_cache(200), logits_to_keep=1).logits[0, -1]
    assert torch.allclose(compiled, eager, atol=1e-5)


def test_a_compiled_two_turn_run_compiles_for_a_second_turn_that_outgrows_its_caches_untimed(tmp_path):
    """The tiny random model's first answer re-tokenizes longer than it was decoded, so the second turn outgrows the
    caches sized up front: the reference `ar` run compiles for it before timing it and adds that to compile_time;
    pld, on the caches it grew, compiles nothing more and stays lossless."""
    compiled = [
        "hardware.compile=true",
        "hardware.compile_backend=aot_eager",
        "hardware.linear_kernel=torch",
        "hardware.compile_widths=[1,16]",
    ]
    specrepro(
        "run",
        *FAST,
        *compiled,
        "method=pld",
        "dataset=mt_bench",
        "dataset.limit=1",
        "decoding.max_new_tokens=80",
        "logger=none",
        cwd=tmp_path,
    )
    runs = {key.split(":")[0]: path for key, path in run_dirs(tmp_path).items()}
    metrics = {name: json.loads((path / "metrics.json").read_text()) for name, path in runs.items()}
    turns = {name: json.loads((path / "generations.jsonl").read_text())["samples"][0] for name, path in runs.items()}
    assert [len(turn["token_ids"]) for turn in turns["ar"]] == [80, 80]
    assert turns["ar"][1]["prompt_tokens"] + 80 + 16 > 256  # the budget and a padded step's widest row past 4 x 64
    assert 0 < turns["ar"][1]["compile_time"] < metrics["ar"]["compile_time"]
    assert not any("compile_time" in turn for turn in (*turns["ar"][:1], *turns["pld"]))
    assert metrics["pld"]["lossless"] == 1.0


def test_compile_refuses_kernels_it_cannot_capture(tmp_path):
    proc = specrepro(
        "run", *FAST, "hardware.compile=true", "method=ar", "dataset.limit=1", "logger=none", cwd=tmp_path, check=False
    )
    assert proc.returncode != 0
    assert "hardware.compile=true compiles torch's own kernels" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_eagle_refuses_compiled_rounds_wider_than_the_static_cache_spares(compiled_target):
    """A dynamic tree's expanded rows follow the committed pairs on the draft's static cache, which spares the
    widest bucket: a tree that would write past it is refused in one line, not written out of bounds."""
    with pytest.raises(SpecReproError, match="writes up to 56 draft rows a round"):
        eagle_decoder(compiled_target, depth=6, top_k=10, total_tokens=60)
    assert eagle_decoder(compiled_target, EagerSteps(compiled_target), depth=6, top_k=10).cfg.depth == 6
