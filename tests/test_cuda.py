"""The CUDA path, on tiny random LLaMAs (skipped where no GPU is present, as on CI): every decoder's greedy
output equals `ar`'s on the GPU, and speculative sampling on the GPU preserves the target distribution."""

from __future__ import annotations

import warnings

import pytest
import torch

from specrepro.decoding.ar import ASYNC_SYNC_EVERY, ARDecoder
from specrepro.decoding.device import upload
from specrepro.decoding.eesd import CalibrationPredictor, EarlyExitHead, EESDConfig, EESDDecoder
from specrepro.decoding.jacobi import JacobiDecoder
from specrepro.decoding.pld import PLDConfig, PLDDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.sar_draft import SARDraftConfig, SARDraftDecoder, head_for
from specrepro.decoding.self_sd import SelfSDConfig, SelfSDDecoder
from specrepro.decoding.space import SpaceDecoder
from specrepro.decoding.sps import SPSDecoder
from specrepro.decoding.steps import STEPS_ATTRIBUTE, CompiledSteps, EagerSteps
from specrepro.models.kernels import set_linear_kernel
from specrepro.models.loading import dispatched
from specrepro.runner import compile_steps_for
from tests.conftest import tiny_llama
from tests.test_compiled import eagle_decoder
from tests.test_decoding import decoders, prompts
from tests.test_lossless_sampling import exact_distribution, p_value

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def test_greedy_decoders_equal_ar_on_cuda():
    target = tiny_llama(vocab_size=64, seed=1, num_layers=4, logit_scale=3.0).to(CUDA)
    draft = tiny_llama(vocab_size=64, seed=2, num_layers=1).to(CUDA)
    head = EarlyExitHead(target, 2, True, False).to(CUDA).eval()
    head.calibration = CalibrationPredictor(target.config.hidden_size).to(CUDA)
    found = decoders(target, draft) | {
        "self_sd": SelfSDDecoder(target, None, [1, 3], [0, 2], SelfSDConfig(control="adaptive", k=5)),
        "self_sd_tree": SelfSDDecoder(target, None, [1, 3], [0, 2], SelfSDConfig(control="fixed", k=1, tree_width=4)),
        "eesd": EESDDecoder(target, None, head, EESDConfig(num_layers=2, control="fixed", k=3)),
        "jacobi": JacobiDecoder(target, block_size=6),
        "space_untrained_masks": SpaceDecoder(target, None, mask_id=0, k=3),
        "eagle": eagle_decoder(target),
    }
    for name, decoder in found.items():
        for prompt in prompts():
            reference = ARDecoder(target).generate(prompt, Sampling(), 40).token_ids
            assert decoder.generate(prompt, Sampling(), 40).token_ids == reference, name


def test_speculative_sampling_preserves_the_target_distribution_on_cuda():
    target = tiny_llama(5, seed=3, logit_scale=4.0).to(CUDA)
    draft = tiny_llama(5, seed=4, num_layers=1, logit_scale=4.0).to(CUDA)
    exact = exact_distribution(tiny_llama(5, seed=3, logit_scale=4.0))  # enumerated on the CPU copy
    assert p_value(SPSDecoder(target, None, draft, 3, "fixed", 16), exact) > 1e-3


def test_compiled_steps_with_cuda_graphs_equal_eager_ar_on_cuda():
    """`hardware.compile` as a GPU runs it: inductor, CUDA graphs, padded widths on a static cache."""
    target = set_linear_kernel(tiny_llama(vocab_size=64, seed=1, num_layers=4, logit_scale=3.0), "torch").to(CUDA)
    draft = set_linear_kernel(tiny_llama(vocab_size=64, seed=2, num_layers=1), "torch").to(CUDA)
    compiled_draft = set_linear_kernel(tiny_llama(vocab_size=64, seed=2, num_layers=1), "torch").to(CUDA)
    draft_steps = CompiledSteps(compiled_draft, backend="inductor", mode="reduce-overhead", widths=[1, 4, 16])
    setattr(compiled_draft, STEPS_ATTRIBUTE, draft_steps)  # sps's draft on steps of its own
    steps = CompiledSteps(target, backend="inductor", mode="reduce-overhead", widths=[1, 4, 16])
    setattr(target, STEPS_ATTRIBUTE, steps)
    eager_ar = ARDecoder(target, steps=EagerSteps(target))
    head = head_for(target, "block", 4, 16, 1, False).to(CUDA).eval()
    paper_head = head_for(target, "simplified", 4, 16, 1, False).to(CUDA).eval()  # its forward compiled too
    compiled = {
        "ar": ARDecoder(target),
        "pld": PLDDecoder(target, None, PLDConfig()),
        "sps": SPSDecoder(target, None, draft, 4, "fixed", 16),
        "sps_compiled_draft": SPSDecoder(target, None, compiled_draft, 4, "fixed", 16, tree_width=3),
        "sar_draft": SARDraftDecoder(target, None, head, SARDraftConfig(variant="block", k=3, k_max=4, tree_width=4)),
        "sar_draft_simplified": SARDraftDecoder(target, None, paper_head, SARDraftConfig(k=3, k_max=4)),
        "jacobi": JacobiDecoder(target, block_size=6),
        "space_untrained_masks": SpaceDecoder(target, None, mask_id=0, k=3),
        "eesd": EESDDecoder(
            target,
            None,
            EarlyExitHead(target, 2, True, False).to(CUDA).eval(),
            EESDConfig(num_layers=2, control="fixed", k=3, tree_width=2),
        ),
        "self_sd": SelfSDDecoder(target, None, [1, 3], [0, 2], SelfSDConfig(control="adaptive", k=5)),
        "eagle": eagle_decoder(target),  # its draft layer compiled on a static cache of its own
    }
    compile_steps_for(80, list(compiled.values()))  # as the runner does: widths, slices, states, draft and head steps
    for name, decoder in compiled.items():
        for prompt in prompts():
            assert (
                decoder.generate(prompt, Sampling(), 40).token_ids
                == eager_ar.generate(prompt, Sampling(), 40).token_ids
            ), name


@pytest.mark.parametrize(
    "setting",
    [
        {"guards": "differentiating"},
        {"freezing": True},
        {"guards": "differentiating", "freezing": True},
        {"row_invariant": True},
    ],
    ids=["differentiating_guards", "freezing", "both", "row_invariant"],
)
def test_compile_settings_with_cuda_graphs_equal_eager_ar_on_cuda(setting):
    """`hardware.compile_guards=differentiating`, `hardware.compile_freezing` and `hardware.row_invariant` (one
    width, one graph) under inductor and CUDA graphs: the target's widths, a draft layer on its own cache (eagle)
    and a head's step (sar_draft) after the runner's warm-up."""
    target = set_linear_kernel(tiny_llama(vocab_size=64, seed=1, num_layers=4, logit_scale=3.0), "torch").to(CUDA)
    steps = CompiledSteps(target, "inductor", "reduce-overhead", [1, 4, 16], **setting)
    setattr(target, STEPS_ATTRIBUTE, steps)
    eager_ar = ARDecoder(target, steps=EagerSteps(target))
    head = head_for(target, "block", 4, 16, 1, False).to(CUDA).eval()
    compiled = {
        "ar": ARDecoder(target),
        "pld": PLDDecoder(target, None, PLDConfig()),
        "sar_draft": SARDraftDecoder(target, None, head, SARDraftConfig(variant="block", k=3, k_max=4, tree_width=4)),
        "eagle": eagle_decoder(target),
    }
    compile_steps_for(80, list(compiled.values()))
    for name, decoder in compiled.items():
        for prompt in prompts():
            reference = eager_ar.generate(prompt, Sampling(), 40).token_ids
            assert decoder.generate(prompt, Sampling(), 40).token_ids == reference, name


def test_compiled_ar_reads_the_device_once_a_chunk_on_cuda():
    """On a GPU `ar` reads its tokens once every `ASYNC_SYNC_EVERY` steps and nothing between those reads waits on
    the device (CUDA's sync debug mode warns at each wait): two chunks of 8 and 1 steps wait as often as two of 8
    and 8, and a third chunk adds what a chunk's read and timing cost (at most 3 waits), whatever it holds."""
    target = set_linear_kernel(tiny_llama(vocab_size=64, seed=1, num_layers=4), "torch").to(CUDA)
    setattr(target, STEPS_ATTRIBUTE, CompiledSteps(target, backend="inductor", mode="reduce-overhead", widths=[1, 4]))
    decoder = ARDecoder(target)
    decoder.eos_ids = set()
    assert decoder.sync_every == ASYNC_SYNC_EVERY
    compile_steps_for(80, [decoder])

    waits_on_cuda(decoder, 9)  # anything done once per process
    two_chunks = waits_on_cuda(decoder, 1 + ASYNC_SYNC_EVERY + 1)
    assert waits_on_cuda(decoder, 1 + 2 * ASYNC_SYNC_EVERY) == two_chunks
    assert 1 <= waits_on_cuda(decoder, 1 + 2 * ASYNC_SYNC_EVERY + 1) - two_chunks <= 3


def waits_on_cuda(decoder, budget: int, sampling: Sampling | None = None) -> int:
    """The waits on the device (CUDA's sync debug mode warns at each) in a generation of `budget` tokens."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            decoder.generate(prompts()[0], sampling or Sampling(), budget)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(warning.message) for warning in caught)


# layers 2 and 3 offloaded to the CPU, named by their parts: accelerate hooks the modules a map names, and self_sd
# calls a layer's attention and MLP on their own
SPLIT = {
    "model.embed_tokens": 0,
    "model.layers.0": 0,
    "model.layers.1": 0,
    "model.norm": 0,
    "model.rotary_emb": 0,
    "lm_head": 0,
    **{
        f"model.layers.{i}.{part}": "cpu"
        for i in (2, 3)
        for part in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    },
}


def test_greedy_decoders_equal_ar_with_the_target_split_over_gpu_and_cpu():
    """`model.device_map`: half the layers on the GPU, half offloaded to the CPU (accelerate streams their weights
    in for each forward); drafts and heads on the device of the input (the embedding's)."""
    target = tiny_llama(vocab_size=64, seed=1, num_layers=4, logit_scale=3.0)
    head = EarlyExitHead(target, 2, True, False).to(CUDA).eval()  # a copy of layer 3: made before it is offloaded,
    head.calibration = CalibrationPredictor(target.config.hidden_size).to(CUDA)  # as a trained head is loaded
    target = dispatched(target, {"device_map": SPLIT})
    draft = tiny_llama(vocab_size=64, seed=2, num_layers=1).to(CUDA)
    found = decoders(target, draft) | {
        "self_sd": SelfSDDecoder(target, None, [1, 3], [0, 2], SelfSDConfig(control="adaptive", k=5)),
        "eesd": EESDDecoder(target, None, head, EESDConfig(num_layers=2, control="fixed", k=3)),
        "jacobi": JacobiDecoder(target, block_size=6),
    }
    for name, decoder in found.items():
        for prompt in prompts():
            reference = ARDecoder(target).generate(prompt, Sampling(), 40).token_ids
            assert decoder.generate(prompt, Sampling(), 40).token_ids == reference, name


def test_every_bf16_divergence_from_ar_on_cuda_is_a_near_tie():
    """In bf16 on a GPU a verification's kernels round differently from `ar`'s one-row steps, so greedy outputs may
    leave `ar`'s: each first divergence is recomputed on the GPU (metrics/divergence.py) and must be a near-tie,
    the two tokens' logits within the rounding measured there, never a bug."""
    from specrepro.metrics.divergence import classify, rounding_widths, tree_rounding_widths

    target = tiny_llama(vocab_size=64, seed=1, num_layers=4, logit_scale=3.0).to(CUDA, torch.bfloat16)
    draft = tiny_llama(vocab_size=64, seed=2, num_layers=1).to(CUDA, torch.bfloat16)
    ours = {name: d for name, d in decoders(target, draft).items() if not name.startswith("hf_")}  # not transformers'
    found = ours | {"jacobi": JacobiDecoder(target, block_size=6), "eagle": eagle_decoder(target)}
    ar, steps = ARDecoder(target), EagerSteps(target)
    for name, decoder in found.items():
        for prompt in prompts():
            reference = ar.generate(prompt, Sampling(), 40).token_ids
            tokens = decoder.generate(prompt, Sampling(), 40).token_ids
            widths = rounding_widths(decoder.max_step_width)
            tree_widths = tree_rounding_widths(decoder.max_step_width, decoder.verifies_trees)
            divergence = classify(steps, prompt, tokens, reference, widths, tree_widths)
            assert divergence is None or divergence["near_tie"], (name, divergence)


def test_row_invariant_compiled_steps_give_bf16_chains_ars_tokens_on_cuda():
    """`hardware=cuda_bf16_compiled_exact` on the card: inductor and CUDA graphs at one width give a bf16 block the
    one-token steps' logits bit for bit, and greedy chains (pld, a head on the target's hidden states) `ar`'s
    tokens on the same steps."""
    from tests.test_compiled import one_token_and_block_logits, row_invariant_steps, wide_bf16_llama

    for seed in (0, 1):
        model = wide_bf16_llama(seed).to(CUDA)
        steps = CompiledSteps(model, "inductor", "reduce-overhead", [1, 4, 16], row_invariant=True)
        one_token_steps, block, headed, _ = one_token_and_block_logits(steps, seed)
        assert torch.equal(block, one_token_steps) and torch.equal(headed, one_token_steps), seed
    model = wide_bf16_llama(0).to(CUDA)
    row_invariant_steps(model, backend="inductor", mode="reduce-overhead")
    head = head_for(model, "block", 4, 16, 1, False).to(CUDA, torch.bfloat16).eval()
    ar = ARDecoder(model)
    chains = {
        "pld": PLDDecoder(model, None, PLDConfig()),
        "sar_draft": SARDraftDecoder(model, None, head, SARDraftConfig(variant="block", k=3, k_max=4)),
    }
    compile_steps_for(80, [ar, *chains.values()])
    for prompt in prompts():
        reference = ar.generate(prompt, Sampling(), 40).token_ids
        for name, decoder in chains.items():
            assert decoder.generate(prompt, Sampling(), 40).token_ids == reference, name


def test_an_upload_is_queued_behind_the_gpus_work():
    """`upload` copies host values to the GPU from pinned memory, without waiting for the kernels queued there."""
    allow = torch.ones(3, 5, dtype=torch.bool).tril(2)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            busy = torch.randn(2048, 2048, device=CUDA) @ torch.randn(2048, 2048, device=CUDA)
            uploads = upload([[4, 5, 6]], CUDA), upload(allow, CUDA)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not [warning for warning in caught if "synchronizing" in str(warning.message)]
    assert uploads[0].tolist() == [[4, 5, 6]] and torch.equal(uploads[1].cpu(), allow) and busy.isfinite().all()


def test_a_compiled_round_waits_on_the_gpu_only_where_its_method_must():
    """What tests/test_compiled.py counts on the CPU, on the GPU, where uploads wait too unless staged in pinned
    memory: a round waits once (the verification's read) plus what its method's own rule reads. Its phases are timed
    by events on the stream, which wait for nothing."""
    from tests.test_compiled import EXTRA_READS_PER_ROUND

    target = set_linear_kernel(tiny_llama(vocab_size=64, seed=1, num_layers=4, logit_scale=3.0), "torch").to(CUDA)
    draft = set_linear_kernel(tiny_llama(vocab_size=64, seed=2, num_layers=1), "torch").to(CUDA)
    steps = CompiledSteps(target, backend="aot_eager", widths=[1, 4, 16])  # the waits are the host's: no codegen
    setattr(target, STEPS_ATTRIBUTE, steps)
    head = head_for(target, "block", 4, 16, 1, False).to(CUDA).eval()
    decoders = {
        "pld": PLDDecoder(target, None, PLDConfig(num_pred_tokens=3)),
        "sps": SPSDecoder(target, None, draft, 3, "fixed", 16),
        "sar_draft_tree": SARDraftDecoder(
            target, None, head, SARDraftConfig(variant="block", k=3, k_max=4, tree_width=4)
        ),
        "jacobi": JacobiDecoder(target, block_size=4),
        "eesd_tree": EESDDecoder(
            target,
            None,
            EarlyExitHead(target, 2, True, False).to(CUDA).eval(),
            EESDConfig(num_layers=2, control="fixed", k=2, tree_width=2),
        ),
        "eagle_tree": eagle_decoder(target),
    }
    compile_steps_for(80, list(decoders.values()))
    sampled = Sampling(do_sample=True, temperature=1.0)
    for name, decoder in decoders.items():
        decoder.eos_ids = set()
        waits_on_cuda(decoder, 9)  # anything done once per process
        short, long = (decoder.generate(prompts()[0], Sampling(), budget).steps for budget in (9, 41))
        waits = waits_on_cuda(decoder, 41) - waits_on_cuda(decoder, 9)
        assert waits <= (1 + EXTRA_READS_PER_ROUND.get(name, 0)) * (long - short), (name, waits, long - short)
        if name.endswith("_tree"):  # sampled: a wait for each node on the accepted path
            short, long = (decoder.generate(prompts()[0], sampled, budget) for budget in (9, 41))
            rounds = long.steps - short.steps
            accepted_drafts = sum(long.accepted) - sum(short.accepted) - rounds
            waits = waits_on_cuda(decoder, 41, sampled) - waits_on_cuda(decoder, 9, sampled)
            assert waits <= (1 + EXTRA_READS_PER_ROUND.get(name, 0)) * rounds + accepted_drafts, (name, waits)


def test_phase_times_on_the_gpu_are_event_spans_within_the_wall_time():
    """`GenerationBuilder.timed` on CUDA: each phase's time is read from its events when the generation is done."""
    target = tiny_llama(vocab_size=64, seed=1, num_layers=2).to(CUDA)
    draft = tiny_llama(vocab_size=64, seed=2, num_layers=1).to(CUDA)
    gen = SPSDecoder(target, None, draft, 3, "fixed", 16).generate(prompts()[0], Sampling(), 24)
    assert gen.prefill_time > 0 and gen.draft_time > 0 and gen.verify_time > 0
    assert gen.prefill_time + gen.draft_time + gen.verify_time <= gen.wall_time
