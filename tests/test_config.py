"""Hydra composition: every group option composes; typos and bad values fail at composition."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from specrepro.cli import CONF_DIR
from specrepro.config import register_configs

register_configs()


def compose_run(*overrides, config="run"):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config, overrides=list(overrides))


@pytest.mark.parametrize("group", ["model", "method", "dataset", "decoding", "logger"])
def test_every_option_composes(group):
    for option in sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml")):
        cfg = compose_run(f"{group}={option}")
        assert cfg[group].name


def test_train_config_follows_the_method():
    cfg = compose_run("method=sps", config="train")
    assert cfg.training.component == "sps_draft"
    assert set(cfg.training.prompts) == {"gsm8k", "sharegpt", "mbpp"}


def test_unknown_key_fails_at_composition():
    with pytest.raises(ConfigCompositionException, match="max_new_tokns"):
        compose_run("decoding.max_new_tokns=3")


def test_wrong_type_fails_at_composition():
    with pytest.raises(ConfigCompositionException, match="max_new_tokens"):
        compose_run("decoding.max_new_tokens=many")


def test_unknown_option_fails_at_composition():
    with pytest.raises(ConfigCompositionException, match="method"):
        compose_run("method=no_such_method")


def test_a_newer_artifact_under_the_same_prefix_is_a_new_run_and_a_new_reference(tmp_path):
    import os

    from specrepro.runner import reference_config, reference_key, run_name

    def publish(name: str, mtime: float) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "artifact.json").write_text("{}")
        os.utime(tmp_path / name / "artifact.json", (mtime, mtime))

    method = compose_run("method=self_sd", "method.skip_set=self_sd_skip_set", f"artifacts_dir={tmp_path}")
    weights = compose_run("method=jacobi", "model.source=artifact", "model.id=cllm", f"artifacts_dir={tmp_path}")
    publish("self_sd_skip_set-m-aaaa", 1_000)
    publish("cllm-m-aaaa", 1_000)
    before = run_name(method), run_name(weights), reference_key(weights)
    assert reference_key(reference_config(weights)) == reference_key(weights)
    publish("self_sd_skip_set-m-bbbb", 2_000)
    publish("cllm-m-bbbb", 2_000)
    assert run_name(method) != before[0]
    assert run_name(weights) != before[1] and reference_key(weights) != before[2]


def test_an_option_at_its_default_leaves_older_run_names_alone():
    from omegaconf import OmegaConf

    from specrepro.runner import run_name

    cfg = compose_run("method=pld", "dataset=gsm8k")
    older = OmegaConf.create({k: v for k, v in OmegaConf.to_container(cfg).items() if k != "reference_nll"})
    assert run_name(cfg) == run_name(older)  # a run made before reference_nll existed keeps its name
    assert run_name(compose_run("method=pld", "dataset=gsm8k", "reference_nll=true")) != run_name(cfg)
    jacobi = compose_run("method=jacobi", "dataset=gsm8k")
    older = OmegaConf.to_container(jacobi)
    del older["method"]["sliding"]  # a nested option added later
    assert run_name(jacobi) == run_name(OmegaConf.create(older))
    assert run_name(compose_run("method=jacobi", "dataset=gsm8k", "method.sliding=true")) != run_name(jacobi)


def test_only_half_precision_runs_changed_identity(monkeypatch):
    """bf16 runs carry markers for their fp32 attention (rows and CPU calls); fp32 runs keep their names."""
    from specrepro import runner

    configs = {(dtype, flag): compose_run("method=pld", f"hardware.dtype={dtype}", f"hardware.row_invariant={flag}")
               for dtype in ("float32", "bfloat16") for flag in ("true", "false")}
    names = {key: (runner.run_name(cfg), runner.reference_key(cfg)) for key, cfg in configs.items()}
    monkeypatch.setattr(runner, "hardware_identity", lambda hardware: hardware)  # identities before the marker
    before = {key: (runner.run_name(cfg), runner.reference_key(cfg)) for key, cfg in configs.items()}
    changed = {key for key in configs if names[key][0] != before[key][0] and names[key][1] != before[key][1]}
    unchanged = {key for key in configs if names[key] == before[key]}
    assert changed == {("bfloat16", "true"), ("bfloat16", "false")} and len(unchanged) == 2
    assert names[("bfloat16", "true")] != names[("bfloat16", "false")]
