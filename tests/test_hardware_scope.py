"""Hardware modes are per model: a loader puts its packed linears and its attention in the models it loads, and
nothing else in the process (another model, torch's `nn.Linear`, transformers' "sdpa") changes."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations import sdpa_attention
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specrepro.config import HardwareConfig, ModelConfig, RandomArchConfig
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.pld import PLDConfig, PLDDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.models import ModelLoader, kernels, load_model
from specrepro.models.kernels import PackedLinear

pytestmark = pytest.mark.skipif(not kernels.onednn_available(), reason="this torch build has no oneDNN linear")

TINY = ModelConfig(name="tiny", source="random", random=RandomArchConfig(vocab_size=96, num_layers=3, seed=2))
TORCH_LINEAR_FORWARD = torch.nn.Linear.forward
TRANSFORMERS_GQA_CHOICE = sdpa_attention.use_gqa_in_sdpa


def stock(dtype: torch.dtype) -> torch.nn.Module:
    return load_model(TINY, torch.device("cpu"), dtype).model


def logits(model) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill's logits, then a 5-token block's after that cache (a verification's shape)."""
    tokens = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache()
    with torch.no_grad():
        return model(tokens[:, :25], cache=cache).logits, model(tokens[:, 25:], cache=cache).logits


def test_a_second_model_in_the_process_keeps_torch_and_transformers_kernels():
    before = logits(stock(torch.bfloat16))
    hardware = HardwareConfig(device="cpu", dtype="bfloat16", linear_kernel="onednn", row_invariant=True)
    ours = ModelLoader.for_hardware(hardware, "unused").load_model(TINY).model
    logits(ours)  # packs its weights, plans its rows
    assert all(type(m) is PackedLinear for m in ours.modules() if isinstance(m, torch.nn.Linear))
    assert ours.config._attn_implementation == "specrepro_row_invariant_sdpa"

    other = stock(torch.bfloat16)
    linears = [m for m in other.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is torch.nn.Linear for m in linears)
    assert other.config._attn_implementation == "sdpa"
    assert torch.nn.Linear.forward is TORCH_LINEAR_FORWARD
    assert TORCH_LINEAR_FORWARD.__module__ == "torch.nn.modules.linear"  # torch's own, even at this file's import
    assert AttentionInterface._global_mapping["sdpa"] is sdpa_attention.sdpa_attention_forward
    assert AttentionMaskInterface._global_mapping["sdpa"] is sdpa_mask
    assert sdpa_attention.use_gqa_in_sdpa is TRANSFORMERS_GQA_CHOICE
    after = logits(other)
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert all(torch.equal(a, b) for a, b in zip(logits(stock(torch.bfloat16)), before))


def test_greedy_output_on_our_kernels_equals_plain_torch():
    """fp32: the loader's oneDNN linears (padded to linear_min_rows) and CPU attention keep `ar`'s tokens, and
    pld on them stays equal to `ar`."""
    loader = ModelLoader.for_hardware(HardwareConfig(device="cpu", linear_kernel="onednn"), "unused")
    ours, plain = loader.load_model(TINY).model, stock(torch.float32)
    assert all(type(m) is PackedLinear for m in ours.modules() if isinstance(m, torch.nn.Linear))
    assert ours.config._attn_implementation == "specrepro_sdpa" and plain.config._attn_implementation == "sdpa"
    with torch.no_grad():
        for model in (ours, plain):
            model.lm_head.weight.mul_(4.0)  # sharper next-token distributions: fewer near-ties
    prompt = [1, 5, 9, 5, 9, 5, 9, 2, 7]
    ar = ARDecoder(ours).generate(prompt, Sampling(), 40).token_ids
    assert ar == ARDecoder(plain).generate(prompt, Sampling(), 40).token_ids
    assert PLDDecoder(ours, None, PLDConfig(num_pred_tokens=4)).generate(prompt, Sampling(), 40).token_ids == ar
