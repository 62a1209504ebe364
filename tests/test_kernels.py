"""`hardware.linear_kernel`: the prepacked oneDNN linear computes torch's function, stays fresh after weight
updates, leaves autograd to torch, and keeps every lossless decoder equal to `ar`."""

from __future__ import annotations

import copy
import json
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from specrepro import provenance
from specrepro.config import HardwareConfig
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.pld import PLDConfig, PLDDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.errors import SpecReproError
from specrepro.models import LoadedModel, kernels
from specrepro.models.kernels import PackedLinear, set_linear_kernel
from tests.conftest import tiny_llama

pytestmark = pytest.mark.skipif(not kernels.onednn_available(), reason="this torch build has no oneDNN linear")
BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(
        not kernels.onednn_available(torch.bfloat16),
        reason="this CPU has no oneDNN bfloat16 linear (AVX-512 or AVX-NE-CONVERT)",
    ),
)


def packed(layer: torch.nn.Linear, min_rows: int = 1) -> PackedLinear:
    return PackedLinear(layer.eval(), min_rows)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_onednn_linear_matches_torch(dtype):
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96).to(dtype)
    x = torch.randn(3, 5, 64, dtype=dtype)
    fast = packed(layer)
    with torch.no_grad():
        expected = layer(x)
        got = fast(x)
    assert fast._packed is not None  # the oneDNN path ran
    torch.testing.assert_close(got, expected, atol=atol, rtol=atol)


def test_a_dtype_this_cpu_has_no_kernel_for_runs_on_torch(monkeypatch):
    """An AVX2-only CPU has oneDNN's float32 linear but not its bfloat16 one: bf16 layers compute torch's linear."""
    monkeypatch.setattr(kernels, "onednn_dtypes", lambda: frozenset({torch.float32}))
    layer = torch.nn.Linear(64, 96).to(torch.bfloat16).eval()
    model = set_linear_kernel(torch.nn.Sequential(layer), "onednn")
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert model[0]._packed is None


def test_packed_weight_follows_in_place_updates_replacements_and_moves():
    layer = packed(torch.nn.Linear(16, 8, bias=False))
    x = torch.randn(2, 16)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2)  # what an optimizer step or load_state_dict does
        torch.testing.assert_close(layer(x), 2 * before)
        layer.weight = torch.nn.Parameter(3 * layer.weight)  # what tying or load_state_dict(assign=True) does
        torch.testing.assert_close(layer(x), 6 * before)
        layer.weight.data *= 0.5  # PEFT's merge: no version bump, but it follows a train() / eval()
        layer.eval()
        torch.testing.assert_close(layer(x), 3 * before)
        torch.testing.assert_close(layer.double().float()(x), 3 * before)


def test_a_packed_linear_saves_copies_and_unpacks_as_nn_linear():
    plain = torch.nn.Linear(8, 4).eval()
    layer = PackedLinear(plain, 5)
    with torch.no_grad():
        layer(torch.randn(2, 8))
    assert layer._packed is not None and layer.weight is plain.weight and layer.bias is plain.bias
    assert layer.state_dict().keys() == plain.state_dict().keys()
    clone = copy.deepcopy(layer)  # what EESD's head does with the target's modules
    assert clone._packed is None and clone.min_rows == 5 and torch.equal(clone.weight, layer.weight)
    back = layer.to_linear()
    assert type(back) is torch.nn.Linear and back.weight is plain.weight and back.bias is plain.bias


def test_autograd_and_other_dtypes_take_torch_path():
    layer = packed(torch.nn.Linear(8, 4))
    out = layer(torch.randn(2, 8))
    out.sum().backward()
    assert layer.weight.grad is not None and layer._packed is None
    half = packed(torch.nn.Linear(8, 4).half())
    with torch.no_grad():
        assert half(torch.randn(2, 8).half()).dtype == torch.float16
    assert half._packed is None


def test_layer_built_in_inference_mode_takes_torch_path():
    with torch.inference_mode():
        layer = packed(torch.nn.Linear(8, 4))
        out = layer(torch.randn(2, 8))
    assert out.shape == (2, 4) and layer._packed is None


def test_switching_kernels_and_bad_name():
    model = tiny_llama()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is PackedLinear for m in linears)
    set_linear_kernel(model, "torch")
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert torch.nn.Linear.forward.__module__ == "torch.nn.modules.linear"  # torch's own, never reassigned
    set_linear_kernel(model, "onednn")
    assert all(type(m) is PackedLinear for m in model.modules() if isinstance(m, torch.nn.Linear))
    with pytest.raises(SpecReproError, match="linear_kernel=mkl"):
        set_linear_kernel(model, "mkl")


def test_bench_kernels_times_no_weight_packing(monkeypatch):
    """experiments/bench_kernels.py's `ar` arms: a switch back to oneDNN makes new PackedLinears, whose first
    forward packs every weight (0.3-1.3 s on the embedded model); that is set-up, so no timed generation pays it."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "experiments"))
    import bench_kernels

    model = tiny_llama(vocab_size=20000)  # the bench's forwards read token ids up to 20000
    monkeypatch.setattr(bench_kernels, "load_model", lambda *args: LoadedModel(model, None, "tiny"))
    monkeypatch.setattr(bench_kernels, "gsm8k_prompts", lambda tokenizer, limit: [[1, 5, 9, 2]] * limit)
    timed_packs = []
    generate = ARDecoder.generate

    def timed(decoder, prompt, sampling, max_new_tokens, *args):
        if max_new_tokens == 3:  # the timed budget below
            timed_packs.append(any(m._packed is None for m in model.modules() if isinstance(m, PackedLinear)))
        return generate(decoder, prompt, sampling, max_new_tokens, *args)

    monkeypatch.setattr(ARDecoder, "generate", timed)
    settings = {kernel: lambda model, kernel=kernel: set_linear_kernel(model, kernel) for kernel in kernels.KERNELS}
    bench_kernels.compare_settings(settings, Namespace(dtype="float32", repeats=1, prompts=3, max_new_tokens=3))
    assert len(timed_packs) == 6 and not any(timed_packs)


def test_bench_kernels_page_names_the_fastest_ar_and_what_timed_it(monkeypatch, tmp_path):
    """experiments/bench_kernels.py --json --markdown: the figures it printed, a row per kernel with its `ar` over
    the fastest, the machine and the command that regenerates the page."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "experiments"))
    import bench_kernels

    model = tiny_llama(vocab_size=20000)
    monkeypatch.setattr(bench_kernels, "load_model", lambda *args: LoadedModel(model, None, "tiny"))
    monkeypatch.setattr(bench_kernels, "gsm8k_prompts", lambda tokenizer, limit: [[1, 5, 9, 2]] * limit)
    page, figures = tmp_path / "kernels.md", tmp_path / "kernels.json"
    argv = ["bench_kernels.py", "--repeats", "1", "--prompts", "2", "--max-new-tokens", "3"]
    monkeypatch.setattr("sys.argv", [*argv, "--json", str(figures), "--markdown", str(page)])
    bench_kernels.main()
    written = json.loads(figures.read_text())
    rate = written["ar_tok_per_s"]
    fastest = max(rate, key=rate.get)
    assert set(rate) == set(kernels.KERNELS) and written["identical"] == 2
    assert written["provenance"]["machine"]["cpu"] and written["provenance"]["dtype"] == "float32"
    text = page.read_text()
    assert f"The fastest `ar` here by tok/s: `{fastest}`" in text
    assert f"| `{fastest}` | {rate[fastest]:.1f} | 1.00x |" in text
    ratio = written["ar_ratio"]
    assert ratio["of"] == list(rate) and f"prompt by prompt: {ratio['mean']:.2f}x ±{ratio['ci95']:.2f}x" in text
    assert all(f"| `{name}` |" in text for name in rate)
    assert "- Regenerate: `python experiments/bench_kernels.py --repeats 1 --prompts 2" in text


def test_bench_attention_settings_differ_in_attention_only(monkeypatch):
    """experiments/bench_attention.py: every setting pads its linears' inputs to the same rows (those runs use), or
    a row-invariant setting's two-row padding would be timed as attention."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "experiments"))
    from bench_attention import use

    model, rows = tiny_llama(), set()
    for attention in ("sdpa", "row_invariant"):
        use(attention, model)
        rows |= {m.min_rows for m in model.modules() if isinstance(m, PackedLinear)}
    assert rows == {HardwareConfig().linear_min_rows}


def test_greedy_ar_and_pld_agree_under_both_kernels():
    model = tiny_llama(vocab_size=64, seed=3, num_layers=2, logit_scale=4.0)
    prompt = [1, 5, 9, 5, 9, 5, 9, 2, 7]
    outputs = {}
    for kernel in ("torch", "onednn"):
        set_linear_kernel(model, kernel)
        ar = ARDecoder(model).generate(prompt, Sampling(), 40)
        pld = PLDDecoder(model, None, PLDConfig(num_pred_tokens=4)).generate(prompt, Sampling(), 40)
        assert pld.token_ids == ar.token_ids
        outputs[kernel] = ar.token_ids
    assert outputs["onednn"] == outputs["torch"]


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_padded_inputs_compute_the_rows_of_a_full_block(dtype):
    """hardware.linear_min_rows: fewer rows run in the min_rows kernel, so each equals its row of a full block."""
    torch.manual_seed(0)
    layer = packed(torch.nn.Linear(64, 96).to(dtype), min_rows=4)
    block = torch.randn(1, 4, 64, dtype=dtype)
    with torch.no_grad():
        full = layer(block)
        for rows in (1, 2, 3):
            assert torch.equal(layer(block[:, :rows]), full[:, :rows])
    with pytest.raises(SpecReproError, match="linear_min_rows must be >= 1"):
        set_linear_kernel(torch.nn.Sequential(layer), "onednn", min_rows=0)


def test_greedy_pld_equals_ar_with_padded_rows():
    model = set_linear_kernel(tiny_llama(vocab_size=64, seed=3, num_layers=2, logit_scale=4.0), "onednn", min_rows=5)
    prompt = [1, 5, 9, 5, 9, 5, 9, 2, 7]
    ar = ARDecoder(model).generate(prompt, Sampling(), 40)
    pld = PLDDecoder(model, None, PLDConfig(num_pred_tokens=4)).generate(prompt, Sampling(), 40)
    assert pld.token_ids == ar.token_ids and sum(pld.accepted) > len(pld.accepted)


@pytest.mark.parametrize(("avx512_bf16", "amx"), [(False, False), (True, False), (False, True)])
def test_bf16_work_on_a_cpu_without_native_bf16_is_warned_about(monkeypatch, caplog, avx512_bf16, amx):
    """bf16 autocast or a bf16 teacher runs several times slower than fp32 on a CPU without AVX512-BF16 or AMX, an
    AVX-512 one whose oneDNN runs a bf16 linear too: one warning, there only, and its records say so."""
    monkeypatch.setattr(kernels, "onednn_dtypes", lambda: frozenset({torch.float32, torch.bfloat16}))
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    with caplog.at_level("WARNING", logger="specrepro.models.kernels"):
        kernels.warn_if_bf16_is_slow("training.loop.bf16_autocast")
    native = avx512_bf16 or amx
    assert ["without native bfloat16" in r.getMessage() for r in caplog.records] == ([] if native else [True])
    assert provenance.device_description()["cpu_native_bf16"] is native


def test_within_torch_linears_a_packed_linear_runs_torchs_kernel_on_its_weights():
    """`timing.torch_ar` times `ar` on torch's linears on the model packed for oneDNN: within `torch_linears` every
    PackedLinear computes `F.linear` on its own parameters, bit for bit, and its packed copy is kept for later."""
    if not kernels.onednn_available():
        pytest.skip("no oneDNN linear on this CPU")
    linear = torch.nn.Linear(16, 8)
    layer = packed(linear)
    x = torch.randn(3, 16)
    with torch.no_grad():
        layer(x)
        kept = layer._packed
        with kernels.torch_linears():
            assert torch.equal(layer(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
        assert layer._packed is kept
