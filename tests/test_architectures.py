"""Methods on the architectures besides LLaMA that `model=hf model.id=...` loads: each method, built from its config
as a run builds it (untrained components), decodes greedily token for token as `ar` does, or refuses the
architecture up front in one line that names it; so do the methods that train or build something first (cllm,
space, sps's draft, rest's datastore), through their training code on tiny budgets. Tiny random models of each:
Qwen2 (q/k/v biases and a tied LM head, as Qwen2.5's), Mistral (a sliding window, as Mistral-7B-v0.1's) and GPT-2
(learned positions, no `model.model`); and past a 16-token window, Mistral, a Qwen2 with sliding layers and the
newer architectures of `WINDOWED`."""

from __future__ import annotations

import random
import types

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, GPT2Config, MistralConfig, Qwen2Config

from specrepro import registry
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.errors import SpecReproError
from tests.conftest import greedy_beside_ar

SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
INIT = 0.2  # weights this large make tiny random models write varied text (at 0.02 a tied one repeats a token)
CONFIGS = {
    "qwen2": lambda: Qwen2Config(**SHAPE, num_key_value_heads=2, tie_word_embeddings=True, initializer_range=INIT),
    "mistral": lambda: MistralConfig(**SHAPE, num_key_value_heads=2, sliding_window=4096, initializer_range=INIT),
    "gpt2": lambda: GPT2Config(
        vocab_size=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=128,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=INIT,
    ),
}
# each method's options for a run without a trained artifact
METHODS = {
    "pld": {},
    "token_recycling": {"candidates": 4, "tree": [[4], [3, 2, 1, 1]]},
    "lookahead": {"window": 4, "ngram": 3, "guesses": 3},
    "jacobi": {"block_size": 4},
    "self_sd": {"attn_skip": [1], "mlp_skip": [0], "control": "fixed", "k": 3},
    "eesd": {"head": "none", "num_layers": 1, "shared_head": True, "control": "fixed", "k": 3},
    "sar_draft": {"head": "none", "shared_lm_head": True, "proj_size": 32},
    "eagle": {"head": "none", "depth": 3, "top_k": 2, "total_tokens": 5},
}
# LLaMA-style rotary decoder layers are what they run
REFUSED = {("gpt2", "self_sd"), ("gpt2", "eesd"), ("gpt2", "eagle")}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def arch(request):
    """(name, tiny random model) of one architecture."""
    torch.manual_seed(0)
    return request.param, AutoModelForCausalLM.from_config(CONFIGS[request.param]()).eval()


@pytest.mark.parametrize("method", sorted(METHODS))
def test_each_method_equals_ar_on_other_architectures_or_refuses_them_in_one_line(arch, method):
    name, model = arch
    registry.load()
    target = types.SimpleNamespace(model=model, tokenizer=None, name=name, identity={"name": name})
    entry = registry.method(method)
    if (name, method) in REFUSED:
        with pytest.raises(SpecReproError) as refused:
            entry.decoder.from_config(entry.schema(**METHODS[method]), target, None)
        assert name in str(refused.value).lower() and "\n" not in str(refused.value)
        return
    decoder = entry.decoder.from_config(entry.schema(**METHODS[method]), target, None)
    prompts = [[5, 9, 13, 5, 9, 13, 21, 30], [7, 3, 40, 41, 42, 7, 3, 40]]
    for _ in greedy_beside_ar(decoder, ARDecoder(model), prompts, budgets=(24,), stop_at_eos=False):
        pass


@pytest.mark.parametrize("method", ["eesd", "eagle"])
def test_training_refuses_an_architecture_the_method_cannot_run_before_making_its_data(method, tmp_path):
    """`specrepro train` for a method that refuses GPT-2 stops in the same one line, before it generates or caches
    any training data (eagle's training stopped in a traceback while extracting the target's features)."""
    from specrepro.training import eagle_head, eesd_head
    from tests.test_config import compose_run

    depth = ["method.num_layers=1"] if method == "eesd" else []  # within its depth: the architecture is refused
    cfg = compose_run(f"method={method}", *depth, f"artifacts_dir={tmp_path}", config="train")
    model = AutoModelForCausalLM.from_config(CONFIGS["gpt2"]()).eval()
    target = types.SimpleNamespace(model=model, tokenizer=None, name="gpt2", identity={"name": "gpt2"})
    train = {"eesd": eesd_head.train_eesd_head, "eagle": eagle_head.train_eagle_head}[method]
    with pytest.raises(SpecReproError) as refused:
        train(cfg, target, tmp_path / "work", lambda *a: None, torch.device("cpu"))
    assert "gpt2" in str(refused.value) and "\n" not in str(refused.value)
    assert not any(tmp_path.iterdir())  # no data made


@pytest.mark.parametrize("config", ["mistral", "qwen2"])
@pytest.mark.parametrize("method", ["pld", "token_recycling", "eesd", "eagle"])
def test_drafting_past_a_sliding_window_decodes_as_ar_does(config, method):
    """A sliding-window layer (every layer of Mistral's, the upper ones of a Qwen2 with use_sliding_window) drops
    keys once its window is reached, so transformers' crop could not roll a rejected draft back there: such runs were
    refused. A decoder that rolls back now keeps every key and applies the window through the mask (a chain's
    from transformers, a tree's from `steps.tree_mask`, one for every layer or one per layer type), and decodes
    as `ar`, on the model's own sliding cache, does past the window. With the tree masks left unwindowed,
    token_recycling, eesd and eagle differed from `ar` here. Its sliding layers hold the window's keys between rounds,
    as `ar`'s do (they held every key, and attended them all); with a tree's rows copied by position alone, or its
    masks left the width of every key, token_recycling and eagle differed from `ar` or stopped."""
    torch.manual_seed(0)
    shape = {**SHAPE, "num_key_value_heads": 2, "initializer_range": INIT}
    windowed = {
        "mistral": lambda: MistralConfig(**shape, sliding_window=16),
        "qwen2": lambda: Qwen2Config(**shape, use_sliding_window=True, sliding_window=16, max_window_layers=1),
    }
    model = AutoModelForCausalLM.from_config(windowed[config]()).eval()
    registry.load()
    target = types.SimpleNamespace(model=model, tokenizer=None, name=config, identity={"name": config})
    entry = registry.method(method)
    decoder = entry.decoder.from_config(entry.schema(**METHODS[method]), target, None)
    caches = []
    new_cache = decoder.steps.new_cache
    decoder.steps.new_cache = lambda *args, **kwargs: caches.append(new_cache(*args, **kwargs)) or caches[-1]
    prompts = [[5, 9, 13, 5, 9, 13, 21, 30], [7, 3, 40, 41, 42, 7, 3, 40]]
    for _ in greedy_beside_ar(decoder, ARDecoder(model), prompts, budgets=(40,), stop_at_eos=False):
        layer = caches[0].layers[-1]  # a sliding layer of the target's cache
        assert layer.cumulative_length > 40 and layer.keys.shape[-2] <= 15 + decoder.max_step_width
        caches.clear()


# newer architectures, each with a 16-token sliding window the 32-token generations below pass: Gemma 3 (a rotary
# embedding per layer type), Cohere 2 (parallel attention and MLP), gpt-oss (attention sinks, experts, rotary on half
# a head), Qwen3 (q/k norms) and Llama 4 (16-token attention chunks instead: its tree masks were not chunked, so
# token_recycling and lookahead differed from `ar`; its text model is its own `base_model`, where eesd and sar_draft
# stopped in an AttributeError); and what each refuses, by a phrase of its one-line refusal
WINDOWED = {
    "gemma3": lambda shape: transformers.Gemma3TextConfig(**shape, head_dim=16, final_logit_softcapping=None),
    "cohere2": lambda shape: transformers.Cohere2Config(**shape, logit_scale=1.0),
    "gpt_oss": lambda shape: transformers.GptOssConfig(
        **shape, head_dim=16, num_local_experts=2, num_experts_per_tok=1
    ),
    "qwen3": lambda shape: transformers.Qwen3Config(**shape, head_dim=16, use_sliding_window=True, max_window_layers=1),
    "llama4": lambda shape: transformers.Llama4TextConfig(
        **{name: value for name, value in shape.items() if name != "sliding_window"},
        attention_chunk_size=16,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        intermediate_size_mlp=128,
    ),
}
WINDOWED_REFUSALS = {
    ("gemma3", "eesd"): "give each layer type its own",
    ("gemma3", "eagle"): "not LLaMA-like",
    ("cohere2", "self_sd"): "needs a LLaMA-family model",
    ("cohere2", "eagle"): "not LLaMA-like",
    ("gpt_oss", "self_sd"): "needs sdpa or flash attention",
    ("gpt_oss", "eagle"): "rotary embedding is not a LLaMA one",  # it ran into a shape error in the draft layer
    ("llama4", "self_sd"): "needs a LLaMA-family model",
    ("llama4", "eagle"): "rotary embedding is not a LLaMA one",
}


def each_method_decodes_as_ar_or_is_refused(name: str, model, refusals: dict) -> None:
    """Every method of METHODS on `model` (of architecture `name`): refused in one line where `refusals` names it
    (matching its phrase, where one is given), else greedy 32 tokens token for token as `ar` decodes them."""
    registry.load()
    target = types.SimpleNamespace(model=model, tokenizer=None, name=name, identity={"name": name})
    for method, options in METHODS.items():
        entry = registry.method(method)
        if method in refusals:
            with pytest.raises(SpecReproError, match=refusals[method]) as refused:
                entry.decoder.from_config(entry.schema(**options), target, None)
            assert "\n" not in str(refused.value)
            continue
        decoder = entry.decoder.from_config(entry.schema(**options), target, None)
        prompt = [[5, 9, 13, 5, 9, 13, 21, 30]]
        for _ in greedy_beside_ar(decoder, ARDecoder(model), prompt, budgets=(32,), stop_at_eos=False):
            pass


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_newer_architectures_decode_as_ar_past_their_windows_or_refuse_in_one_line(name):
    torch.manual_seed(0)
    shape = {**SHAPE, "num_key_value_heads": 2, "initializer_range": INIT, "sliding_window": 16}
    model = AutoModelForCausalLM.from_config(WINDOWED[name](shape)).eval()
    refusals = {method: phrase for (arch, method), phrase in WINDOWED_REFUSALS.items() if arch == name}
    each_method_decodes_as_ar_or_is_refused(name, model, refusals)


# more architectures users load, without a window unless named: Phi-3 (fused q/k/v and gate/up, a 16-token window),
# OLMo 2 (norms after attention and MLP), GLM (partial rotary), Phi (parallel attention and MLP, LayerNorm), StableLM
# (partial rotary), Falcon (its own layer names), SmolLM3 (some layers without rotary), Gemma 2 (soft-capped logits, a
# 16-token window) and OLMo 3 (a 16-token window); and which methods each refuses in one line
MORE = {
    "phi3": lambda shape: transformers.Phi3Config(**shape, sliding_window=16),
    "olmo2": lambda shape: transformers.Olmo2Config(**shape),
    "glm": lambda shape: transformers.GlmConfig(**shape, head_dim=16),
    "phi": lambda shape: transformers.PhiConfig(**shape),
    "stablelm": lambda shape: transformers.StableLmConfig(**shape),
    "falcon": lambda shape: transformers.FalconConfig(
        **{name: shape[name] for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")},
        new_decoder_architecture=True,
        num_kv_heads=2,
    ),
    "smollm3": lambda shape: transformers.SmolLM3Config(**shape),
    "gemma2": lambda shape: transformers.Gemma2Config(**shape, head_dim=16, sliding_window=16),
    "olmo3": lambda shape: transformers.Olmo3Config(**shape, sliding_window=16),
}
MORE_REFUSED = {
    "olmo2": {"self_sd"},
    "glm": {"eagle"},
    "phi": {"self_sd", "eesd", "eagle"},
    "stablelm": {"eagle"},
    "falcon": {"self_sd", "eesd", "eagle"},
    "gemma2": {"self_sd", "eesd", "sar_draft", "eagle"},
    "olmo3": {"self_sd", "eesd", "eagle"},
}


@pytest.mark.parametrize("name", sorted(MORE))
def test_more_architectures_decode_as_ar_or_refuse_in_one_line(name):
    torch.manual_seed(0)
    shape = {**SHAPE, "num_key_value_heads": 2, "initializer_range": INIT, "pad_token_id": 0, "bos_token_id": 1}
    model = AutoModelForCausalLM.from_config(MORE[name]({**shape, "eos_token_id": 2})).eval()
    each_method_decodes_as_ar_or_is_refused(name, model, dict.fromkeys(MORE_REFUSED.get(name, ())))


def test_eesd_refuses_a_model_whose_forward_is_more_than_its_layers():
    """EESD verifies on the target's layers as it runs them itself (embed_tokens, layers, norm). A Granite whose
    logits are unscaled passes the LM-head check, but its forward multiplies the embeddings: eesd's greedy output
    differed from `ar`'s on two prompts. It is refused in one line; pld decodes it."""
    from transformers import GraniteConfig

    torch.manual_seed(0)
    shape = {**SHAPE, "num_key_value_heads": 2, "initializer_range": INIT}
    model = AutoModelForCausalLM.from_config(GraniteConfig(**shape, embedding_multiplier=4.0, logits_scaling=1.0))
    registry.load()
    target = types.SimpleNamespace(model=model.eval(), tokenizer=None, name="granite", identity={"name": "granite"})
    entry = registry.method("eesd")
    with pytest.raises(SpecReproError, match="do not make granite models' forward") as refused:
        entry.decoder.from_config(entry.schema(**METHODS["eesd"]), target, None)
    assert "\n" not in str(refused.value)
    pld = registry.method("pld")
    decoder = pld.decoder.from_config(pld.schema(), target, None)
    for _ in greedy_beside_ar(decoder, ARDecoder(model), [[5, 9, 13, 5, 9, 13, 21, 30]], budgets=(24,)):
        pass


def test_drafting_on_a_model_with_recurrent_layers_is_refused_in_one_line():
    """A convolution or linear-attention layer (LFM2's, Qwen3-Next's) keeps a recurrent state that cropping the cache
    does not roll back: pld's greedy output on a tiny LFM2 differed from `ar`'s even with no draft accepted. Methods
    that roll back refuse such a model in one line; `ar` decodes it."""
    from transformers import Lfm2Config

    torch.manual_seed(0)
    shape = {**SHAPE, "num_key_value_heads": 2, "initializer_range": INIT}
    model = AutoModelForCausalLM.from_config(Lfm2Config(**shape, layer_types=["conv", "full_attention"])).eval()
    registry.load()
    target = types.SimpleNamespace(model=model, tokenizer=None, name="lfm2", identity={"name": "lfm2"})
    for method in ("pld", "token_recycling"):
        entry = registry.method(method)
        with pytest.raises(SpecReproError, match="1 of lfm2's layers cannot do: their state is recurrent") as refused:
            entry.decoder.from_config(entry.schema(**METHODS[method]), target, None)
        assert "\n" not in str(refused.value)
    assert len(ARDecoder(model).generate([5, 9, 13, 5, 9, 13], Sampling(), 12).token_ids) == 12


@pytest.mark.parametrize(
    ("config", "method"),  # eagle refuses Gemma 2's and Cohere's configs before (not LLaMA-like)
    [(config, method) for config in ("gemma2", "granite", "cohere") for method in ("sar_draft", "eesd")]
    + [("granite", "eagle")],
)
def test_a_method_verifying_on_the_head_of_hidden_states_refuses_logits_computed_otherwise(method, config):
    """eagle, sar_draft, space and eesd take the target's logits as lm_head(last hidden states); Gemma 2 soft-caps
    them, Granite and Cohere scale them. The argmax stays, so a greedy run's `lossless` shows nothing, but a sampled
    run verified against probabilities up to 0.4 away from the target's (on these tiny models). Refused in one line."""
    from transformers import CohereConfig, Gemma2Config, GraniteConfig

    shape = {**SHAPE, "num_key_value_heads": 2, "initializer_range": INIT}
    made = {
        "gemma2": lambda: Gemma2Config(**shape, head_dim=16, final_logit_softcapping=30.0),
        "granite": lambda: GraniteConfig(**shape, logits_scaling=8.0),
        "cohere": lambda: CohereConfig(**shape, logit_scale=0.0625),
    }[config]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(made).eval()
    registry.load()
    target = types.SimpleNamespace(model=model, tokenizer=None, name=config, identity={"name": config})
    entry = registry.method(method)
    with pytest.raises(SpecReproError, match=f"{config} models compute their logits otherwise") as refused:
        entry.decoder.from_config(entry.schema(**METHODS[method]), target, None)
    assert "\n" not in str(refused.value)


def test_eesd_refuses_a_model_whose_rotary_embedding_differs_per_layer_type():
    """EESD runs the target's first layers itself with one rotary embedding, as LlamaModel.forward does; Gemma 3's
    local and global layers each have their own (its `rotary_emb` takes the layer type), and eesd stopped in a
    TypeError traceback. Refused in one line."""
    from transformers import Gemma3TextConfig

    torch.manual_seed(0)
    shape = {**SHAPE, "num_key_value_heads": 2, "initializer_range": INIT}
    model = AutoModelForCausalLM.from_config(Gemma3TextConfig(**shape, head_dim=16)).eval()
    registry.load()
    target = types.SimpleNamespace(model=model, tokenizer=None, name="gemma3", identity={"name": "gemma3"})
    entry = registry.method("eesd")
    with pytest.raises(SpecReproError, match="gemma3_text models give each layer type its own") as refused:
        entry.decoder.from_config(entry.schema(**METHODS["eesd"]), target, None)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("method", ["sps", "hf_assisted"])
def test_a_draft_model_of_the_targets_architecture_decodes_as_ar_does(arch, method):
    """sps and hf_assisted (mode assistant) with a draft of the target's architecture and vocabulary (another seed).
    hf_assisted gave transformers an empty EOS list for a model with no EOS (this Qwen2 config): an IndexError there."""
    from specrepro.decoding.hf_assisted import HFAssistedConfig, HFAssistedDecoder
    from specrepro.decoding.sps import SPSDecoder

    name, model = arch
    torch.manual_seed(1)
    draft = AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()
    decoder = {
        "sps": lambda: SPSDecoder(model, None, draft, 4, "fixed", 16),
        "hf_assisted": lambda: HFAssistedDecoder(model, None, HFAssistedConfig(mode="assistant"), assistant=draft),
    }[method]()
    for prompt in ([5, 9, 13, 5, 9, 13, 21, 30], [7, 3, 40, 41, 42, 7, 3, 40]):
        assert (
            decoder.generate(prompt, Sampling(), 24).token_ids
            == ARDecoder(model).generate(prompt, Sampling(), 24).token_ids
        )


def untrained(name: str):
    """A fresh tiny random model of the architecture (for a test that trains it)."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()


def short_loop(steps: int = 2, batch_size: int = 1):
    from specrepro.training.loop import LoopConfig

    return LoopConfig(steps=steps, batch_size=batch_size, warmup_steps=0, checkpoint_every=100, log_every=1)


def test_cllm_consistency_training_with_lora_then_cllm_on_it_equals_ar(arch, tmp_path, monkeypatch):
    """CLLM's consistency stage on Jacobi trajectories of each architecture, with LoRA (merged into the model it
    returns), published and loaded as the run's model, then `cllm` (Jacobi) on it decodes as `ar` on it. LoRA named
    LLaMA's projections, which GPT-2 has none of (its Conv1D c_attn, c_proj, c_fc): peft's NoMatchingPeftModuleError
    traceback."""
    from datasets import Dataset

    from specrepro.decoding.jacobi import CLLMConfig, CLLMDecoder
    from specrepro.training import cllm
    from specrepro.training.lora import LoRAConfig

    model = untrained(arch[0])
    prompts = [[5, 9, 13, 5, 9, 13, 21, 30], [7, 3, 40, 41, 42, 7, 3, 40]]
    rows = [
        {**row, "prompt_index": index, "prompt_len": len(prompt), "reference_ids": []}
        for index, prompt in enumerate(prompts)
        for row in cllm.jacobi_trajectories(model, prompt, 4, 8, set(), random.Random(0))
    ]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "trajectories" / "trajectories"))
    monkeypatch.setattr(cllm, "find_trajectories", lambda cfg: tmp_path / "trajectories")
    spec = cllm.CLLMTrainingConfig(block_size=4, heldout_prompts=1, eval_tokens=8, lora=LoRAConfig(r=4))
    spec.loop = short_loop()
    target = types.SimpleNamespace(model=model, tokenizer=None)
    trained, _, _ = cllm.train_consistency(
        types.SimpleNamespace(training=spec), target, tmp_path, lambda *a: None, torch.device("cpu")
    )
    trained.save_pretrained(tmp_path / "cllm-tiny")  # published as a full model, the run's model for method=cllm
    cllm_model = AutoModelForCausalLM.from_pretrained(tmp_path / "cllm-tiny").eval()
    decoder = CLLMDecoder.from_config(
        CLLMConfig(block_size=4), types.SimpleNamespace(model=cllm_model, tokenizer=None), None
    )
    for _ in greedy_beside_ar(decoder, ARDecoder(cllm_model), prompts, (16,), False):
        pass


class MaskTokenizer:
    """What SAR-SFT asks of a tokenizer besides the data (given here): [M]'s id, after the vocabulary; no text."""

    eos_token_id, pad_token_id = 2, None

    def add_tokens(self, tokens, special_tokens=False):
        self.mask_id = 64

    def convert_tokens_to_ids(self, token):
        return self.mask_id

    def decode(self, ids, skip_special_tokens=False):
        return ""


def test_space_sar_sft_with_lora_then_space_on_it_equals_ar(arch, tmp_path, monkeypatch):
    """SPACE's SAR-SFT with LoRA on each architecture (the [M] row trainable in the embedding as the architecture
    names it), then SPACE on the merged model decodes as `ar` on it. The trainable row was asked of a module named
    `embed_tokens`, which GPT-2 (`wte`) has none of: a ValueError traceback from peft."""
    from specrepro.decoding.space import SpaceDecoder
    from specrepro.training import space_sft
    from specrepro.training.lora import LoRAConfig

    model = untrained(arch[0])
    prompts = [[5, 9, 13, 5, 9, 13, 21, 30], [7, 3, 40, 41, 42, 7, 3, 40], [9, 8, 7, 6, 5, 4, 3, 2]]
    answers = [ARDecoder(model).generate(prompt, Sampling(), 12).token_ids for prompt in prompts]
    rows = [{"source": "s", "prompt_ids": p, "continuation_ids": a} for p, a in zip(prompts, answers)]
    monkeypatch.setattr(space_sft, "reference_rows", lambda *args: rows)
    spec = space_sft.SpaceSFTConfig(k=3, p_ar=0.0, groups=4, heldout_prompts=1, eval_tokens=8, lora=LoRAConfig(r=4))
    spec.loop = short_loop(batch_size=2)
    target = types.SimpleNamespace(model=model, tokenizer=MaskTokenizer())
    trained, metrics, _ = space_sft.train_space_sft(
        types.SimpleNamespace(training=spec), target, tmp_path, lambda *a: None, torch.device("cpu")
    )
    merged = trained.merge_and_unload()
    decoder = SpaceDecoder(merged, None, metrics["mask_token_id"], 3)
    for _ in greedy_beside_ar(decoder, ARDecoder(merged), prompts, (16,), False):
        pass


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_an_sps_draft_distilled_from_the_target_drafts_as_ar_decodes(arch, loss, tmp_path, monkeypatch):
    """sps's draft recipe for each architecture's target (a small LLaMA, its embedding from the target's; `kl`
    reads the target's logits), given the target's continuations, then sps with that draft decodes as `ar`. On
    GPT-2 it stopped in AttributeError tracebacks: its config has no rms_norm_eps, its body is not `model`."""
    from specrepro.decoding.sps import SPSDecoder
    from specrepro.training import sps_draft

    name, model = arch
    prompts = [[5, 9, 13, 5, 9, 13, 21, 30], [7, 3, 40, 41, 42, 7, 3, 40], [9, 8, 7, 6, 5, 4, 3, 2]]
    answers = [ARDecoder(model).generate(prompt, Sampling(), 12).token_ids for prompt in prompts]
    rows = [{"source": "s", "prompt_ids": p, "continuation_ids": a} for p, a in zip(prompts, answers)]
    monkeypatch.setattr(sps_draft, "distill_cache_dir", lambda *args: tmp_path)
    monkeypatch.setattr(sps_draft, "continuation_dataset", lambda *args: rows)
    spec = sps_draft.SPSDraftTrainingConfig(heldout_fraction=0.4, loss=loss, loop=short_loop(batch_size=2))
    spec.draft = sps_draft.DraftArchConfig(num_layers=1, hidden_size=32, intermediate_size=64)
    target = types.SimpleNamespace(model=model, tokenizer=types.SimpleNamespace(pad_token_id=None, eos_token_id=2))
    draft, _, _ = sps_draft.train_sps_draft(
        types.SimpleNamespace(training=spec), target, tmp_path, lambda *a: None, torch.device("cpu")
    )
    decoder = SPSDecoder(model, None, draft.eval(), 4, "fixed", 16)
    for _ in greedy_beside_ar(decoder, ARDecoder(model), prompts, (16,), False):
        pass


def test_cllm_trajectories_pass_a_sliding_window_and_reach_ars_tokens():
    """Collecting Jacobi trajectories crops the target's cache after every iteration: on a sliding-window model
    transformers' crop raised a RuntimeError once the window was reached. Its cache keeps every key now
    (`steps.rollback_cache`), and the fixed points of 32 tokens past a 16-token window are `ar`'s greedy tokens."""
    import random

    from specrepro.training.cllm import jacobi_trajectories

    torch.manual_seed(0)
    shape = {**SHAPE, "num_key_value_heads": 2, "initializer_range": INIT}
    model = AutoModelForCausalLM.from_config(MistralConfig(**shape, sliding_window=16)).eval()
    prompt = [5, 9, 13, 5, 9, 13, 21, 30]
    rows = jacobi_trajectories(model, prompt, 4, 32, set(), random.Random(0))
    assert [token for row in rows for token in row["fixed_point"]] == ARDecoder(model).generate(
        prompt, Sampling(), 32
    ).token_ids


def test_rest_with_a_datastore_built_for_the_target_decodes_as_ar_does(arch, tmp_path):
    """REST's datastore built from a corpus with a (stand-in) tokenizer for the target, saved and read back for its
    vocabulary, then REST on each architecture: the corpus holds the target's own continuations of the prompts, so
    the trees retrieved are accepted, and the output is `ar`'s."""
    from omegaconf import OmegaConf

    from specrepro.decoding.rest import Datastore, RestConfig, RestDecoder
    from specrepro.training.rest_datastore import build_rest_datastore
    from tests.test_rest import CharTokenizer, conversations_file, recipe

    _, model = arch
    ar = ARDecoder(model)
    ar.eos_ids = set()
    prompts = [[5, 9, 13, 5, 9, 13, 21, 30], [7, 3, 40, 41, 42, 7, 3, 40]]
    texts = ["".join(chr(64 + t) for t in p + ar.generate(p, Sampling(), 24).token_ids) for p in prompts]
    cfg = OmegaConf.create({"training": recipe(conversations_file(tmp_path, texts))})
    target = types.SimpleNamespace(model=model, tokenizer=CharTokenizer())  # chr(64 + t) is token t
    store, _, _ = build_rest_datastore(cfg, target, tmp_path, None, "cpu")
    store.save_pretrained(tmp_path)
    decoder = RestDecoder(model, None, Datastore.from_pretrained(tmp_path, 64), RestConfig(tree_nodes=15))
    for gen in greedy_beside_ar(decoder, ar, prompts, (24,), False):
        assert gen.steps < len(gen.token_ids) / 2  # retrieved trees were accepted


def tiny(model_type: str, **options):
    """A tiny random model of `model_type` (transformers' AutoConfig), SHAPE's sizes where its config takes them."""
    torch.manual_seed(0)
    shape = {**SHAPE, "num_key_value_heads": 2, "initializer_range": INIT, "max_position_embeddings": 256}
    config = transformers.AutoConfig.for_model(model_type, **{**shape, **options})
    return AutoModelForCausalLM.from_config(config).eval()


def greedy_or_refusal(model, name: str, method: str) -> str:
    """What `method` does on `model`: "lossless" (greedy 32 tokens as `ar` decodes them), or its one-line refusal."""
    registry.load()
    target = types.SimpleNamespace(model=model, tokenizer=None, name=name, identity={"name": name})
    entry = registry.method(method)
    try:
        decoder = entry.decoder.from_config(entry.schema(**METHODS.get(method, {})), target, None)
        for _ in greedy_beside_ar(decoder, ARDecoder(model), [[5, 9, 13, 5, 9, 13, 21, 30]], (32,), False):
            pass
    except SpecReproError as refused:
        assert "\n" not in str(refused)
        return str(refused)
    return "lossless"


# models whose forward does not take the harness's steps on transformers' DynamicCache: RWKV keeps its state in an
# argument of its own and openai-gpt keeps none (both ignore the cache, so `ar` decoded every step without its
# context, silently), CPM-Ant takes its whole input at every step (a traceback)
@pytest.mark.parametrize("model_type", ["rwkv", "openai-gpt", "cpmant"])
def test_a_model_that_does_not_step_on_a_dynamic_cache_is_refused_by_every_method_and_ar(model_type):
    model = tiny(model_type)
    with pytest.raises(SpecReproError, match=f"{model_type} does not decode as every method here steps a model"):
        ARDecoder(model)
    for method in ("pld", "token_recycling", "jacobi"):
        assert "does not decode as every method here steps" in greedy_or_refusal(model, model_type, method)


# ALiBi models (MPT, BLOOM) place a key by its slot in the cache, not by the position a tree gives it: MPT's
# token_recycling and lookahead diverged from `ar`, BLOOM's stopped in a ValueError. Chains decode as `ar` does.
@pytest.mark.parametrize("model_type", ["mpt", "bloom"])
def test_a_model_that_places_keys_by_cache_slot_refuses_tree_methods_and_runs_chains(model_type):
    options = {"d_model": 64, "n_heads": 4, "n_layers": 2, "expansion_ratio": 2} if model_type == "mpt" else {}
    model = tiny(model_type, **options)
    for method in ("token_recycling", "lookahead"):
        refusal = greedy_or_refusal(model, model_type, method)
        assert f"which {model_type} does not take as chains" in refusal
    for method in ("pld", "jacobi"):
        assert greedy_or_refusal(model, model_type, method) == "lossless"


def test_a_cache_layer_with_state_of_its_own_is_refused_by_methods_that_roll_back():
    """DeepSeek-V4's cache layers keep compressed keys that a crop leaves: its lookahead and jacobi diverged from `ar`
    (past its window, crop_cache stopped in a RuntimeError). Methods that roll back refuse it; `ar` decodes it."""
    model = tiny(
        "deepseek_v4",
        head_dim=16,
        sliding_window=16,
        num_local_experts=2,
        n_routed_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=128,
        n_shared_experts=1,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"],
    )
    for method in ("pld", "lookahead", "jacobi"):
        assert "keep state a crop does not roll back" in greedy_or_refusal(model, "deepseek_v4", method)
    assert len(ARDecoder(model).generate([5, 9, 13, 5, 9, 13], Sampling(), 12).token_ids) == 12


MLA = dict(  # a DeepSeek-V3.2-style model: latent attention, experts, and a sparse-attention indexer
    num_key_value_heads=4,
    n_routed_experts=2,
    num_experts_per_tok=1,
    moe_intermediate_size=128,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    kv_lora_rank=32,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    head_dim=8,
    mlp_layer_types=["dense", "sparse"],
)


def test_a_sparse_attention_indexer_keeps_the_accepted_tree_path():
    """DeepSeek-V3.2's indexer picks the `index_topk` keys each row attends by indexer keys cached beside K and V. A
    tree's accepted path moved down in K and V but not in the indexer's keys, so with fewer keys picked than cached
    its token_recycling and lookahead diverged from `ar`; `verify.keep_tree_path` moves those rows too."""
    model = tiny("deepseek_v32", index_topk=4, **MLA)
    for method in ("token_recycling", "lookahead"):
        assert greedy_or_refusal(model, "deepseek_v32", method) == "lossless"


@pytest.mark.parametrize(
    ("model_type", "options", "method", "phrase"),
    [
        ("glm_moe_dsa", MLA, "self_sd", "glm_moe_dsa's blocks do not"),  # a ValueError in its block
        ("glm_moe_dsa", MLA, "eesd", "do not make glm_moe_dsa models' forward"),  # a TypeError in its indexer
        ("granitemoehybrid", {"layer_types": ["linear_attention", "full_attention"]}, "eesd", "have no such layers"),
        ("biogpt", {}, "sar_draft", "biogpt models do not have"),  # an AttributeError: no lm_head
    ],
)
def test_methods_that_run_a_models_parts_refuse_parts_that_run_otherwise_in_one_line(
    model_type, options, method, phrase
):
    """Each stopped in a traceback before; each refuses in one line now."""
    assert phrase in greedy_or_refusal(tiny(model_type, **options), model_type, method)
