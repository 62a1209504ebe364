"""Every method's schema refuses options out of range before any model is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from specrepro import registry
from specrepro.cli import CONF_DIR
from specrepro.decoding import validate_method_config
from specrepro.errors import SpecReproError
from specrepro.registry import MethodConfig
from tests.test_config import compose_run

OPTIONS = sorted(p.stem for p in (Path(CONF_DIR) / "method").glob("*.yaml"))

BAD = [  # (method, overrides, the option the message names)
    ("sps", ["method.k=0"], "k"),
    ("sps", ["method.controller=adaptive"], "controller"),
    ("sps", ["method.controller=heuristic", "method.k=8", "method.k_max=4"], "k_max"),
    ("sps", ["method.tree_width=0"], "tree_width"),
    ("sps", ["method.draft_vocab=-1"], "draft_vocab"),
    ("pld", ["method.num_pred_tokens=0"], "num_pred_tokens"),
    ("pld", ["method.max_ngram=0"], "max_ngram"),
    ("pld", ["method.max_ngram=2", "method.min_ngram=3"], "min_ngram"),
    ("pld", ["method.min_ngram=0"], "min_ngram"),
    ("pld", ["method.controller=greedy"], "controller"),
    ("pld", ["method.match=first"], "match"),
    ("hf_assisted", ["method.mode=lookahead"], "mode"),
    ("hf_assisted", ["method.prompt_lookup_num_tokens=0"], "prompt_lookup_num_tokens"),
    ("hf_assisted", ["method.max_matching_ngram_size=0"], "max_matching_ngram_size"),
    ("hf_assisted", ["method.num_assistant_tokens=0"], "num_assistant_tokens"),
    ("hf_assisted", ["method.num_assistant_tokens_schedule=linear"], "num_assistant_tokens_schedule"),
    ("eesd", ["method.num_layers=0"], "num_layers"),
    ("eesd", ["method.draft_vocab=-1"], "draft_vocab"),
    ("eesd", ["method.draft_vocab=64", "method.head=none"], "draft_vocab"),
    ("eesd", ["method.draft_vocab=64", "method.shared_head=true"], "draft_vocab"),
    ("eesd", ["method.control=greedy"], "control"),
    ("eesd", ["method.k=0"], "k"),
    ("eesd", ["method.k_max=0"], "k_max"),
    ("eesd", ["method.k_min=0"], "k_min"),
    ("eesd", ["method.k_min=5", "method.k_max=4"], "k_min"),
    ("eesd", ["method.beta_alpha0=0"], "beta_alpha0"),
    ("eesd", ["method.beta_beta0=-1"], "beta_beta0"),
    ("eesd", ["method.beta_counting=literal_R3"], "beta_counting"),
    ("eesd", ["method.beta_decision=greedy"], "beta_decision"),
    ("eesd", ["method.beta_break_even=1.0"], "beta_break_even"),
    ("eesd", ["method.sigma_m=0"], "sigma_m"),
    ("eesd", ["method.sigma_s=-0.5"], "sigma_s"),
    ("eesd", ["method.theta0=1.5"], "theta0"),
    ("eesd", ["method.cali_mode=neither"], "cali_mode"),
    ("eesd", ["method.theta_update=eq8"], "theta_update"),
    ("eesd", ["method.control_seed=-1"], "control_seed"),
    ("eesd", ["method.tree_width=0"], "tree_width"),
    ("self_sd", ["method.attn_skip=[-1]"], "attn_skip"),
    ("self_sd", ["method.mlp_skip=[2,-3]"], "mlp_skip"),
    ("self_sd", ["method.control=threshold"], "control"),
    ("self_sd", ["method.k=0"], "k"),
    ("self_sd", ["method.gamma0=1.2"], "gamma0"),
    ("self_sd", ["method.alpha=0"], "alpha"),
    ("self_sd", ["method.epsilon=-0.01"], "epsilon"),
    ("self_sd", ["method.beta1=1.5"], "beta1"),
    ("self_sd", ["method.beta2=-0.1"], "beta2"),
    ("self_sd", ["method.tree_width=0"], "tree_width"),
    ("self_sd", ["method.draft_vocab=-1"], "draft_vocab"),
    ("jacobi", ["method.block_size=0"], "block_size"),
    ("cllm", ["method.block_size=0"], "block_size"),
    ("cllm", ["method.artifact_prefix="], "artifact_prefix"),
    ("sar_draft", ["method.variant=medusa2"], "variant"),
    ("sar_draft", ["method.k=0"], "k"),
    ("sar_draft", ["method.controller=adaptive"], "controller"),
    ("sar_draft", ["method.controller=heuristic", "method.k=4", "method.k_max=2"], "k_max"),
    ("sar_draft", ["method.head_k=0"], "head_k"),
    ("sar_draft", ["method.proj_size=0"], "proj_size"),
    ("sar_draft", ["method.transformer_layers=-1"], "transformer_layers"),
    ("sar_draft", ["method.draft_vocab=-1"], "draft_vocab"),
    ("sar_draft", ["method.draft_vocab=64", "method.head=none"], "draft_vocab"),
    ("sar_draft", ["method.tree_width=0"], "tree_width"),
    ("space", ["method.k=0"], "k"),
    ("token_recycling", ["method.candidates=0"], "candidates"),
    ("lookahead", ["method.window=0"], "window"),
    ("lookahead", ["method.ngram=1"], "ngram"),
    ("lookahead", ["method.guesses=0"], "guesses"),
    ("rest", ["method.min_suffix=0"], "min_suffix"),
    ("rest", ["method.max_suffix=1"], "max_suffix"),
    ("rest", ["method.tree_nodes=0"], "tree_nodes"),
    ("rest_pld", ["method.min_ngram=4"], "min_ngram"),
]


@pytest.mark.parametrize("option", OPTIONS)
def test_every_method_option_validates_as_its_method(option):
    """Each file in conf/method/ (a method, or a named preset of one) builds its method's schema."""
    validated = validate_method_config(compose_run(f"method={option}").method)
    assert isinstance(validated, MethodConfig) and validated.name in registry.METHODS
    assert validated.name == option or option.startswith(f"{validated.name}_")  # a preset names its method


def test_every_method_has_a_config_file():
    registry.load()
    assert set(registry.METHODS) <= set(OPTIONS)


@pytest.mark.parametrize("method,overrides,option", BAD, ids=[f"{m}:{' '.join(o)}" for m, o, _ in BAD])
def test_an_option_out_of_range_is_refused_by_name(method, overrides, option):
    cfg = compose_run(f"method={method}", *overrides)  # composes: types are right, values are not
    with pytest.raises(SpecReproError, match=rf"^method\.{option} must be .*, got "):
        validate_method_config(cfg.method)


def test_a_config_without_a_schema_node_is_validated_against_its_method_schema():
    assert validate_method_config({"name": "ar"}).name == "ar"
    with pytest.raises(SpecReproError, match="method.num_pred_tokens"):
        validate_method_config({"name": "pld", "num_pred_tokens": 0})
    with pytest.raises(SpecReproError, match="unknown method 'medusa'"):
        validate_method_config({"name": "medusa"})
