"""`hardware.linear_kernel`: the prepacked oneDNN linear computes torch's function, stays fresh after weight
updates, leaves autograd to torch, and keeps every lossless decoder equal to `ar`."""

from __future__ import annotations

import pytest
import torch

from specrepro.decoding import ARDecoder
from specrepro.decoding.pld import PLDConfig, PLDDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.errors import SpecReproError
from specrepro.models import kernels
from specrepro.models.kernels import linear_kernel, set_linear_kernel
from tests.conftest import tiny_llama

pytestmark = pytest.mark.skipif(not kernels.onednn_available(), reason="this torch build has no oneDNN linear")


@pytest.fixture
def onednn():
    set_linear_kernel("onednn")
    yield
    set_linear_kernel("onednn")


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_onednn_linear_matches_torch(onednn, dtype, atol):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96).to(dtype)
    x = torch.randn(3, 5, 64, dtype=dtype)
    set_linear_kernel("torch")
    with torch.no_grad():
        expected = layer(x)
    set_linear_kernel("onednn")
    with torch.no_grad():
        got = layer(x)
    assert kernels._packed.get(layer) is not None  # the oneDNN path ran
    torch.testing.assert_close(got, expected, atol=atol, rtol=atol)


def test_packed_weight_follows_in_place_updates(onednn):
    layer = torch.nn.Linear(16, 8, bias=False)
    x = torch.randn(2, 16)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2)  # what an optimizer step or load_state_dict does
        after = layer(x)
    torch.testing.assert_close(after, 2 * before)


def test_autograd_and_other_dtypes_take_torch_path(onednn):
    layer = torch.nn.Linear(8, 4)
    out = layer(torch.randn(2, 8))
    out.sum().backward()
    assert layer.weight.grad is not None and layer not in kernels._packed
    half = torch.nn.Linear(8, 4).half()
    with torch.no_grad():
        assert half(torch.randn(2, 8).half()).dtype == torch.float16
    assert half not in kernels._packed


def test_layer_built_in_inference_mode_takes_torch_path(onednn):
    with torch.inference_mode():
        layer = torch.nn.Linear(8, 4)
        out = layer(torch.randn(2, 8))
    assert out.shape == (2, 4) and layer not in kernels._packed


def test_switching_kernels_and_bad_name():
    set_linear_kernel("torch")
    assert linear_kernel() == "torch" and torch.nn.Linear.forward is kernels._torch_linear_forward
    set_linear_kernel("onednn")
    assert linear_kernel() == "onednn"
    with pytest.raises(SpecReproError, match="linear_kernel=mkl"):
        set_linear_kernel("mkl")


def test_greedy_ar_and_pld_agree_under_both_kernels(onednn):
    model = tiny_llama(vocab_size=64, seed=3, num_layers=2, logit_scale=4.0)
    prompt = [1, 5, 9, 5, 9, 5, 9, 2, 7]
    outputs = {}
    for kernel in ("torch", "onednn"):
        set_linear_kernel(kernel)
        ar = ARDecoder(model).generate(prompt, Sampling(), 40)
        pld = PLDDecoder(model, None, PLDConfig(num_pred_tokens=4)).generate(prompt, Sampling(), 40)
        assert pld.token_ids == ar.token_ids
        outputs[kernel] = ar.token_ids
    assert outputs["onednn"] == outputs["torch"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_inputs_compute_the_rows_of_a_full_block(onednn, dtype):
    """hardware.linear_min_rows: fewer rows run in the min_rows kernel, so each equals its row of a full block."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96).to(dtype)
    block = torch.randn(1, 4, 64, dtype=dtype)
    try:
        kernels.set_linear_min_rows(4)
        with torch.no_grad():
            full = layer(block)
            for rows in (1, 2, 3):
                assert torch.equal(layer(block[:, :rows]), full[:, :rows])
    finally:
        kernels.set_linear_min_rows(1)
    with pytest.raises(SpecReproError, match="linear_min_rows must be >= 1"):
        kernels.set_linear_min_rows(0)


def test_greedy_pld_equals_ar_with_padded_rows(onednn):
    model = tiny_llama(vocab_size=64, seed=3, num_layers=2, logit_scale=4.0)
    prompt = [1, 5, 9, 5, 9, 5, 9, 2, 7]
    try:
        kernels.set_linear_min_rows(5)
        ar = ARDecoder(model).generate(prompt, Sampling(), 40)
        pld = PLDDecoder(model, None, PLDConfig(num_pred_tokens=4)).generate(prompt, Sampling(), 40)
    finally:
        kernels.set_linear_min_rows(1)
    assert pld.token_ids == ar.token_ids and sum(pld.accepted) > len(pld.accepted)
