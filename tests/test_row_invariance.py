"""Row-invariant forwards (`hardware.row_invariant`): a verification row computes bit for bit what a one-token
step computes, in fp32 and bf16, so greedy draft-then-verify stays token-identical to `ar` in bf16."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.eesd import EarlyExitHead, EESDConfig, EESDDecoder
from specrepro.decoding.pld import PLDConfig, PLDDecoder
from specrepro.decoding.space import SpaceDecoder, block_layout
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.verify import additive_mask
from specrepro.errors import SpecReproError
from specrepro.config import HardwareConfig
from specrepro.models import attention, kernels, use_hardware
from specrepro.models.attention import allowed_keys, set_attention
from tests.conftest import tiny_llama

ROW_INVARIANT = HardwareConfig(device="cpu", linear_kernel="onednn", linear_min_rows=1, row_invariant=True)


def row_invariant(model):
    """`model` with `hardware.row_invariant`'s kernels, as a run's loader gives them."""
    return use_hardware(model, ROW_INVARIANT)


def steps_and_block(model, prompt: torch.Tensor, block: torch.Tensor):
    """Logits of `block` scored one token at a time, and in one forward, after the same prefill."""
    one, many = DynamicCache(), DynamicCache()
    with torch.no_grad():
        model(prompt, cache=one)
        model(prompt, cache=many)
        steps = torch.cat([model(block[:, i : i + 1], cache=one).logits[0] for i in range(block.shape[1])])
        return steps, model(block, cache=many).logits[0]


@pytest.mark.skipif(not kernels.onednn_available(), reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_forward_equals_one_token_steps_bit_for_bit(dtype):
    model = row_invariant(tiny_llama(vocab_size=96, seed=2, num_layers=3).to(dtype))
    tokens = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(0))
    steps, block = steps_and_block(model, tokens[:, :24], tokens[:, 24:])
    assert torch.equal(steps, block)


def test_each_row_sees_the_keys_its_mask_allows():
    causal = torch.arange(10)[None, :] <= (torch.arange(3)[:, None] + 7)
    assert torch.equal(allowed_keys(None, 3, 10), causal)  # no mask after a cache: causal
    assert torch.equal(allowed_keys(causal[None, None], 3, 10), causal)
    grouped = causal.clone()
    grouped[2, 8] = False  # a query that may not see an earlier one: SPACE's mask groups
    assert torch.equal(allowed_keys(grouped[None, None], 3, 10), grouped)
    additive = torch.zeros(1, 1, 3, 10).masked_fill(~grouped, torch.finfo(torch.float32).min)
    assert torch.equal(allowed_keys(additive, 3, 10), grouped)
    assert allowed_keys(torch.full((1, 1, 3, 10), -0.5), 3, 10) is None  # a real bias is left to SDPA
    assert allowed_keys(grouped[None, None].expand(2, 1, 3, 10), 3, 10) is None  # two sequences
    assert allowed_keys(torch.zeros(1, 1, 3, 10, dtype=torch.bool), 3, 10) is None  # rows that see nothing
    with pytest.raises(SpecReproError, match="attention 'flash' is not one of"):
        set_attention(tiny_llama(), "flash")


def test_the_row_plan_is_reused_within_a_forward_and_remade_for_a_new_mask():
    causal = (torch.arange(10)[None, :] <= (torch.arange(3)[:, None] + 7))[None, None]
    plan = attention.row_key_plan(causal, 3, 10)
    assert plan == [8, 9, 10]  # prefixes: views of the cache
    assert attention.row_key_plan(causal, 3, 10) is plan  # the next layer of the same forward
    grouped = causal.clone()
    grouped[0, 0, 2, 8] = False
    regrouped = attention.row_key_plan(grouped, 3, 10)
    assert regrouped[:2] == [8, 9] and regrouped[2].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9]


@pytest.mark.parametrize("kind", ["sdpa", "row_invariant"])
def test_sdpa_grouping_heads_on_cpu_equals_repeated_keys_bit_for_bit(kind):
    """A multi-token forward after a cache (a verification) with SDPA's own GQA computes exactly what
    transformers' repeated keys and values compute (the tiny LLaMA has 4 query heads over 2 KV heads)."""
    model = tiny_llama(vocab_size=96, seed=3, num_layers=2)
    tokens = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(1))
    logits = {}
    for cpu_gqa in (False, True):
        set_attention(model, kind, cpu_gqa)
        _, logits[cpu_gqa] = steps_and_block(model, tokens[:, :25], tokens[:, 25:])
    assert torch.equal(logits[False], logits[True])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_attention_runs_half_precision_in_fp32_and_fp32_unchanged(dtype):
    """`cpu_sdpa`: half-precision q/k/v are attended in fp32 and rounded back once; fp32 is SDPA as it was."""
    model = tiny_llama(vocab_size=96, seed=3, num_layers=1)
    module = model.model.layers[0].self_attn  # 4 query heads over 2 KV heads
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, heads, 5, 16, generator=gen) for heads in (4, 2, 2))
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    half = [t.to(dtype) for t in (query, key, value)]
    out, _ = attention.cpu_sdpa(module, *half, mask, scaling=0.25)
    expected, _ = sdpa_attention_forward(module, *[t.float() for t in half], mask, scaling=0.25)
    assert out.dtype == dtype and torch.equal(out, expected.to(dtype))
    if dtype == torch.bfloat16:  # bf16 SDPA on the same inputs rounds differently inside
        native, _ = sdpa_attention_forward(module, *half, mask, scaling=0.25)
        assert (native.float() - expected).abs().max() > 0


@pytest.mark.skipif(not kernels.onednn_available(), reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("name_real_slots", [False, True])
def test_space_block_real_slots_equal_one_token_steps_in_bf16(name_real_slots, monkeypatch):
    """SPACE's grouped block: each real slot (anchor, c_1..c_k) computes bit for bit the ar step at its position,
    whether every row takes the one-row path or only the real slots, named as `exact_rows`."""
    model, k = row_invariant(tiny_llama(vocab_size=96, seed=2, num_layers=3).to(torch.bfloat16)), 3
    tokens = torch.randint(0, 95, (1, 28), generator=torch.Generator().manual_seed(0))
    prefix, real = tokens[:, :24], tokens[0, 24:]
    allow, offsets = block_layout(k)
    block = torch.cat([real, torch.full(((k + 1) * k,), 95)])[None]  # real slots first, then the mask groups
    full = torch.cat([torch.ones(len(allow), 24, dtype=torch.bool), allow], 1)
    cache = DynamicCache()
    with torch.no_grad():
        model(prefix, cache=cache)
        exact = {"exact_rows": torch.arange(k + 1)} if name_real_slots else {}
        calls = []
        attend = attention.attend
        monkeypatch.setattr(attention, "attend", lambda *args, **kwargs: calls.append(1) or attend(*args, **kwargs))
        logits = model(
            block,
            cache=cache,
            position_ids=(24 + offsets)[None],
            attention_mask=additive_mask(full, model.dtype),
            **exact,
        ).logits[0]
        monkeypatch.undo()
    steps, _ = steps_and_block(model, prefix, real[None])
    assert torch.equal(logits[: k + 1], steps)
    assert len(calls) == 3 * ((1 + (k + 1)) if name_real_slots else (k + 1) ** 2)  # per layer


@pytest.mark.skipif(not kernels.onednn_available(), reason="this torch build has no oneDNN linear")
def test_bf16_greedy_space_is_token_identical_to_ar():
    model = row_invariant(tiny_llama(vocab_size=96, seed=4, num_layers=3).to(torch.bfloat16))
    prompt = list(range(3, 40))
    ar = ARDecoder(model).generate(prompt, Sampling(), 48).token_ids
    for k in (2, 5):
        assert SpaceDecoder(model, None, 95, k).generate(prompt, Sampling(), 48).token_ids == ar


@pytest.mark.skipif(not kernels.onednn_available(), reason="this torch build has no oneDNN linear")
def test_bf16_greedy_eesd_with_a_token_tree_is_token_identical_to_ar():
    """A tree verification's rows (siblings at one position, each seeing only its ancestors) compute what the
    one-token steps compute: the tree's mask takes the same per-row key gathering as SPACE's."""
    model = row_invariant(tiny_llama(vocab_size=96, seed=4, num_layers=3, logit_scale=3.0).to(torch.bfloat16))
    prompt = list(range(3, 40))
    ar = ARDecoder(model).generate(prompt, Sampling(), 48).token_ids
    for k in (1, 2):
        head = EarlyExitHead(model, 1).to(torch.bfloat16).eval()
        decoder = EESDDecoder(model, None, head, EESDConfig(num_layers=1, control="fixed", k=k, tree_width=4))
        assert decoder.generate(prompt, Sampling(), 48).token_ids == ar


@pytest.mark.embedded
def test_bf16_pld_is_token_identical_to_ar_on_the_embedded_model():
    from specrepro.config import ModelConfig
    from specrepro.models import ModelLoader

    loader = ModelLoader(torch.device("cpu"), torch.bfloat16, hardware=ROW_INVARIANT)
    target = loader.load_model(ModelConfig(name="smollm2_135m", source="embedded"))
    for question in (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "Write a Python function that returns the n-th Fibonacci number.",
    ):
        ids = target.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        ar = ARDecoder(target.model, target.tokenizer).generate(ids, Sampling(), 128)
        pld = PLDDecoder(target.model, target.tokenizer, PLDConfig(num_pred_tokens=4)).generate(ids, Sampling(), 128)
        assert pld.token_ids == ar.token_ids and sum(pld.accepted) > len(pld.accepted)  # drafts were accepted
