"""Hydra composition: every group option composes; typos and bad values fail at composition."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from specrepro.cli import CONF_DIR
from specrepro.config import COMPILE_BACKENDS, check_names, check_run_config, hydra_root, register_configs
from specrepro.errors import SpecReproError

register_configs()


def compose_run(*overrides, config="run"):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config, overrides=list(overrides))


@pytest.mark.parametrize("group", ["model", "method", "dataset", "decoding", "logger"])
def test_every_option_composes(group):
    for option in sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml")):
        cfg = compose_run(f"{group}={option}", *(["model.id=org/Model"] if option == "hf" else []))
        assert cfg[group].name
        check_names(cfg)  # every shipped name can label a run


def test_train_config_follows_the_method():
    cfg = compose_run("method=sps", config="train")
    assert cfg.training.component == "sps_draft"
    assert set(cfg.training.prompts) == {"gsm8k", "sharegpt", "mbpp"}


@pytest.mark.parametrize("config", ["run", "train"])
def test_two_sweeps_started_in_one_second_get_their_own_job_dirs(config):
    """Two lanes of one pipeline launch sweeps side by side: a shared sweep dir mixed their jobs' results."""

    def sweep_dir():
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name=config, return_hydra_config=True).hydra.sweep.dir

    assert sweep_dir() != sweep_dir()


def test_unknown_key_fails_at_composition():
    with pytest.raises(ConfigCompositionException, match="max_new_tokns"):
        compose_run("decoding.max_new_tokns=3")


def test_wrong_type_fails_at_composition():
    with pytest.raises(ConfigCompositionException, match="max_new_tokens"):
        compose_run("decoding.max_new_tokens=many")


def test_unknown_option_fails_at_composition():
    with pytest.raises(ConfigCompositionException, match="method"):
        compose_run("method=no_such_method")


@pytest.mark.parametrize(
    "model_id, name",
    [
        ("meta-llama/Llama-2-7b-hf", "llama_2_7b_hf"),
        ("/data/models/My-Model/", "my_model"),
        ("Qwen2.5-0.5B", "qwen2.5_0.5b"),
    ],
)
def test_any_hub_id_or_local_path_is_a_model_named_by_its_last_part(model_id, name):
    cfg = compose_run("model=hf", f"model.id={model_id}")
    assert (cfg.model.source, cfg.model.id, cfg.model.name) == ("hf", model_id, name)
    check_names(cfg)


@pytest.mark.parametrize("config", ["run", "train"])
@pytest.mark.parametrize(
    "override, message",
    [
        (
            "model.name=meta-llama/Llama-2-7b-hf",
            "model.name 'meta-llama/Llama-2-7b-hf' names run and artifact directories",
        ),
        ("model.name=llama-2", "e.g. llama_2"),  # "-" joins the parts of a run's name
        ("method.name=../ar", "method.name '../ar'"),
    ],
)
def test_a_name_that_cannot_label_a_directory_is_refused(config, override, message):
    with pytest.raises(SpecReproError, match=re.escape(message)):
        check_names(compose_run(override, config=config))


@pytest.mark.parametrize("config", ["run", "train"])
@pytest.mark.parametrize("key", ["results_dir", "artifacts_dir"])
def test_an_empty_results_or_artifacts_dir_is_refused_not_read_as_the_working_directory(config, key):
    with pytest.raises(SpecReproError, match=f"{key} is empty: name a directory"):
        check_names(compose_run(f"{key}=", config=config))
    assert Path(hydra_root("")).parent == Path(tempfile.gettempdir())  # Hydra's job dir is not put in the cwd either


@pytest.mark.parametrize("run_name", ["../elsewhere", "a/b", ".hidden"])
def test_a_run_name_that_is_a_path_is_refused(run_name):
    with pytest.raises(SpecReproError, match="not a path"):
        check_names(compose_run(f"run_name={run_name}"))


def test_a_newer_artifact_under_the_same_prefix_is_a_new_run_and_a_new_reference(tmp_path):
    import os

    from specrepro.identity import reference_key, run_name
    from specrepro.reference import reference_config

    def publish(name: str, mtime: float) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "artifact.json").write_text("{}")
        os.utime(tmp_path / name / "artifact.json", (mtime, mtime))

    method = compose_run("method=self_sd", "method.skip_set=self_sd_skip_set", f"artifacts_dir={tmp_path}")
    weights = compose_run("method=jacobi", "model.source=artifact", "model.id=cllm", f"artifacts_dir={tmp_path}")
    peer = compose_run("method=hf_assisted", "method.mode=assistant", f"artifacts_dir={tmp_path}")  # an sps draft
    for name in ("self_sd_skip_set", "cllm", "sps_draft"):
        publish(f"{name}-m-aaaa", 1_000)
    before = run_name(method, "data"), run_name(weights, "data"), reference_key(weights, "data"), run_name(peer, "data")
    assert reference_key(reference_config(weights), "data") == reference_key(weights, "data")
    for name in ("self_sd_skip_set", "cllm", "sps_draft"):
        publish(f"{name}-m-bbbb", 2_000)
    assert run_name(method, "data") != before[0] and run_name(peer, "data") != before[3]
    assert run_name(weights, "data") != before[1] and reference_key(weights, "data") != before[2]


def test_another_machine_is_a_new_run_and_a_new_reference(monkeypatch):
    """The same config timed on an H100 and then an H200 (a GPU leaderboard filled over two lent machines), or on
    two CPUs: a run cut off on one is not resumed on the other, nor is one's `ar` the other's reference."""
    from specrepro import identity
    from specrepro.identity import reference_key, run_name

    cfg = compose_run("method=pld")
    identity._machine.cache_clear()
    before = run_name(cfg, "data"), reference_key(cfg, "data")
    assert run_name(cfg, "data") == before[0]
    other = {"cpu": "Intel(R) Xeon(R) Processor", "cpu_cores": 2, "cpu_capability": "AVX512"}
    monkeypatch.setattr(identity, "device_description", lambda device: other)
    identity._machine.cache_clear()
    try:
        assert identity.timing_machine(cfg) == "Intel(R) Xeon(R) Processor (AVX512), 2 cores"
        assert run_name(cfg, "data") != before[0] and reference_key(cfg, "data") != before[1]
    finally:
        identity._machine.cache_clear()


def test_an_ar_timed_another_way_is_not_the_reference():
    """A run timed once divides by an `ar` timed once, never by one that kept the fastest of three timings or warmed
    up otherwise; pairing and the order beside the method are not how the reference itself is timed."""
    from specrepro.identity import reference_key
    from specrepro.reference import reference_config

    base = reference_key(compose_run("method=pld"), "data")
    for override in ("timing.repeats=3", "timing.warmup=0", "timing.warmup_tokens=32"):
        cfg = compose_run("method=pld", override)
        assert reference_key(cfg, "data") != base, override
        assert reference_key(reference_config(cfg), "data") == reference_key(cfg, "data"), override
    for override in ("timing.paired=true", "timing.order=alternate"):
        assert reference_key(compose_run("method=pld", override), "data") == base, override


def test_the_threads_a_run_is_timed_with_are_part_of_its_identity():
    """hardware.threads=null takes torch's default, which OMP_NUM_THREADS and CPU affinity set: a run timed on one
    thread is not resumed, reused or divided by as one timed on two."""
    import torch

    from specrepro.identity import reference_key, run_name

    cfg, default = compose_run("method=pld"), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_name(cfg, "data"), reference_key(cfg, "data")
        torch.set_num_threads(2)
        two = run_name(cfg, "data"), reference_key(cfg, "data")
        assert one[0] != two[0] and one[1] != two[1]
        pinned = compose_run("method=pld", "hardware.threads=1")
        assert run_name(pinned, "data") == run_name(pinned, "data")  # set: what torch has does not matter
    finally:
        torch.set_num_threads(default)


def test_an_artifact_retrained_under_its_name_with_other_weights_is_a_new_run_and_a_new_reference(tmp_path):
    """`resume=false`, or deleting a damaged artifact and training it again, keeps the name; the weights decide."""
    from specrepro.identity import reference_key, run_name

    def publish(name: str, weights: bytes) -> None:
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "skip_set.json").write_bytes(weights)
        (tmp_path / name / "artifact.json").write_text('{"metrics": {"compute_minutes": 1.0}}')

    method = compose_run("method=self_sd", "method.skip_set=self_sd_skip_set", f"artifacts_dir={tmp_path}")
    weights = compose_run("method=jacobi", "model.source=artifact", "model.id=cllm", f"artifacts_dir={tmp_path}")
    publish("self_sd_skip_set-m-aaaa", b"[1, 2]")
    publish("cllm-m-aaaa", b"first")
    before = run_name(method, "data"), run_name(weights, "data"), reference_key(weights, "data")
    publish("self_sd_skip_set-m-aaaa", b"[1, 3]")
    publish("cllm-m-aaaa", b"second")
    assert run_name(method, "data") != before[0]
    assert run_name(weights, "data") != before[1] and reference_key(weights, "data") != before[2]
    publish("cllm-m-aaaa", b"first")  # the same weights again (a deterministic retrain): the same run
    assert (run_name(weights, "data"), reference_key(weights, "data")) == before[1:]
    (tmp_path / "cllm-m-aaaa" / "artifact.json").write_text('{"metrics": {"compute_minutes": 2.0}}')
    assert run_name(weights, "data") == before[1]  # the metadata (history, minutes) is not what a run loads


def test_a_checkpoint_saved_again_at_the_same_local_path_is_a_new_run_and_a_new_reference(tmp_path):
    """`model.source=hf model.id=<a directory>` (a target or a draft): its files, not its path, say which weights."""
    from specrepro.identity import reference_key, run_name

    target, draft = tmp_path / "my_model", tmp_path / "my_draft"
    for directory in (target, draft):
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"first")
    on_target = compose_run("method=pld", "model.source=hf", f"model.id={target}")
    with_draft = compose_run("method=sps", "method.draft.source=hf", f"method.draft.id={draft}")
    before = run_name(on_target, "data"), reference_key(on_target, "data"), run_name(with_draft, "data")
    (target / "model.safetensors").write_bytes(b"second")
    (draft / "model.safetensors").write_bytes(b"second")
    assert run_name(on_target, "data") != before[0] and reference_key(on_target, "data") != before[1]
    assert run_name(with_draft, "data") != before[2]
    assert reference_key(with_draft, "data") == reference_key(compose_run("method=sps"), "data")  # the target's ar
    (target / "model.safetensors").write_bytes(b"first")
    assert (run_name(on_target, "data"), reference_key(on_target, "data")) == before[:2]


def test_what_training_makes_from_a_checkpoint_is_named_by_its_weights(tmp_path):
    """A component trained on an artifact or a local checkpoint (SPACE's later rounds, a draft for a fine-tuned
    target), and the continuations cached from it, are made anew for a new checkpoint behind the same config."""
    from specrepro.training import artifact_path
    from specrepro.training.distill_data import distill_cache_dir

    cfg = compose_run(
        "method=sps", "model.source=artifact", "model.id=base", f"artifacts_dir={tmp_path}", config="train"
    )
    not_trained = artifact_path(cfg)  # its base is not trained yet: named by the config alone (a dry run's view)
    (tmp_path / "base-m-aaaa").mkdir()
    (tmp_path / "base-m-aaaa" / "artifact.json").write_text("{}")
    (tmp_path / "base-m-aaaa" / "pytorch_model.bin").write_bytes(b"first")
    first = artifact_path(cfg), distill_cache_dir(cfg, "continuations", {}, 8, 64)
    (tmp_path / "base-m-aaaa" / "pytorch_model.bin").write_bytes(b"second")
    assert first[0] != artifact_path(cfg) != not_trained
    assert first[1] != distill_cache_dir(cfg, "continuations", {}, 8, 64)
    embedded = compose_run("method=sps", f"artifacts_dir={tmp_path}", config="train")
    assert artifact_path(embedded).name == "sps_draft-smollm2_135m-" + artifact_path(embedded).name.split("-")[-1]


def test_a_newer_download_of_a_hub_model_is_a_new_run_and_a_new_reference(tmp_path, monkeypatch):
    """A hub id loads from the local cache first: the commit its revision points to there names the weights."""
    import huggingface_hub

    from specrepro.identity import reference_key, run_name

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--tiny"

    def download(commit: str) -> None:
        (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)

    cfg = compose_run("method=pld", "model.source=hf", "model.id=org/tiny")
    pinned = compose_run("method=pld", "model.source=hf", "model.id=org/tiny", f"model.revision={'a' * 40}")
    not_cached = run_name(cfg, "data"), reference_key(cfg, "data")
    download("a" * 40)
    first = run_name(cfg, "data"), reference_key(cfg, "data"), run_name(pinned, "data")
    download("b" * 40)
    assert run_name(cfg, "data") != first[0] != not_cached[0] and reference_key(cfg, "data") != first[1]
    assert run_name(pinned, "data") == first[2]  # a pinned commit still names the same weights


def test_a_tokenizer_of_its_own_saved_again_is_a_new_run_and_a_new_reference(tmp_path):
    """`model.tokenizer` naming a directory (or another hub id than `model.id`): its files render and tokenize every
    prompt, as the weights' files decide every logit."""
    from specrepro.identity import reference_key, run_name

    target, tokenizer = tmp_path / "target", tmp_path / "tokenizer"
    for directory in (target, tokenizer):
        directory.mkdir()
    (target / "model.safetensors").write_bytes(b"weights")
    (tokenizer / "tokenizer_config.json").write_text('{"chat_template": "{{ messages[0].content }}"}')
    cfg = compose_run("method=pld", "model=hf", f"model.id={target}", f"model.tokenizer={tokenizer}")
    before = run_name(cfg, "data"), reference_key(cfg, "data")
    (tokenizer / "tokenizer_config.json").write_text('{"chat_template": "User: {{ messages[0].content }}"}')
    after = run_name(cfg, "data"), reference_key(cfg, "data")
    assert after[0] != before[0] and after[1] != before[1]


def test_a_lora_artifacts_base_saved_again_is_a_new_run_and_a_new_reference(tmp_path):
    """A LoRA artifact decoded as the model is merged into the base its training config names, as that base is now
    (loading.merged_adapter): the base's weights are the run's weights too."""
    import json

    from specrepro.identity import reference_key, run_name

    base, artifacts = tmp_path / "base", tmp_path / "artifacts"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"first")
    lora = artifacts / "space-base-aaaaaaaa"
    lora.mkdir(parents=True)
    (lora / "adapter_config.json").write_text("{}")
    (lora / "adapter_model.bin").write_bytes(b"adapter")
    model = {"name": "base", "source": "hf", "id": str(base), "revision": None, "tokenizer": None}
    (lora / "artifact.json").write_text(json.dumps({"component": "space", "config": {"model": model}}))
    cfg = compose_run(
        "method=ar", "model.source=artifact", f"model.id={lora.name}", "model.name=space", f"artifacts_dir={artifacts}"
    )
    before = run_name(cfg, "data"), reference_key(cfg, "data")
    (base / "model.safetensors").write_bytes(b"second")  # the base fine-tuned again at its path
    after = run_name(cfg, "data"), reference_key(cfg, "data")
    assert after[0] != before[0] and after[1] != before[1]


@pytest.mark.parametrize(
    "override",
    [
        "reference_nll=true",
        "method.sliding=true",
        "hardware.linear_min_rows=1",
        "hardware.row_invariant=true",
        "timing.paired=true",
        "decoding.seed=3",
    ],
)
def test_every_option_that_changes_a_run_changes_its_name(override):
    """Run identity is a hash of the full resolved config: no option is left out to keep older names."""
    from specrepro.identity import run_name

    method = "method=jacobi" if override.startswith("method.") else "method=pld"
    assert run_name(compose_run(method, override), "data") != run_name(compose_run(method), "data")


@pytest.mark.parametrize("override", ["logger=none", "results_dir=elsewhere", "resume=false", "reference=false"])
def test_where_results_go_is_not_part_of_a_run(override):
    from specrepro.identity import run_name

    assert run_name(compose_run("method=pld", override), "data") == run_name(compose_run("method=pld"), "data")


def test_the_data_a_run_decodes_is_part_of_its_name_and_reference():
    from specrepro.identity import reference_key, run_name

    cfg = compose_run("method=pld")
    assert run_name(cfg, "a") != run_name(cfg, "b") and reference_key(cfg, "a") != reference_key(cfg, "b")


@pytest.mark.parametrize(
    "override, message",
    [
        ("decoding.top_p=0", "decoding.top_p must be in (0, 1], got 0"),
        ("decoding=sample", None),
        ("decoding.do_sample=true", "decoding.do_sample=true contradicts decoding=greedy, which names the run"),
        ("decoding=sample decoding.do_sample=false", "decoding.do_sample=false contradicts decoding=sample"),
        ("decoding.do_sample=true decoding.name=greedy_t1", None),
        ("decoding.num_samples=0", "decoding.num_samples must be positive, got 0"),
        ("decoding.seed=-1", "decoding.seed must be 0 or more, got -1"),
        ("decoding.num_samples=10", "decoding.num_samples=10 under greedy decoding decodes one completion 10 times"),
        ("timing.order=random", "timing.order must be one of ar_first, alternate, got random"),
        (
            "hardware.compile_backend=tvm",
            "hardware.compile_backend must be one of inductor, aot_eager, eager, cudagraphs",
        ),
        ("hardware.compile_widths=[0,4]", "hardware.compile_widths must be positive widths, got [0, 4]"),
        ("hardware.compile_guards=none", "hardware.compile_guards must be one of all, differentiating, got none"),
        ("hardware.device=gpu", "hardware.device must be auto, cpu, cuda, cuda:<index> or mps, got gpu"),
        ("logger.mode=ofline", "logger.mode must be one of online, offline, disabled (or null), got ofline"),
        ("logger.name=wandbb", "logger.name must be one of none, wandb, got wandbb"),
        # what Hydra's message for a misspelled key advises: the key is added, and was ignored by the run
        ("+decoding.max_new_token=4", "decoding.max_new_token is not a setting of decoding, and would be ignored"),
        ("+model.random.hiden_size=8", "model.random.hiden_size is not a setting of model.random, and would be"),
        ("+method.window=3", "method.window is not a setting of method, and would be ignored (method has: name)"),
        ("method=lookahead ++method.window=3", None),
        # at the top level and in the judge too: decoding.max_new_tokens=16 decoded, under another name
        ("++max_new_tokens=4", "max_new_tokens is not a setting of the top level, and would be ignored (the top"),
        ("++judge.temprature=0", "judge.temprature is not a setting of judge, and would be ignored (did you mean"),
        ("dataset=mt_bench judge=local", None),
        ("model.id=/ckpt", "model.id=/ckpt is not read by model smollm2_135m (model.source=embedded): load a hub"),
        ("model=tiny_random model.id=x", "model.id=x is not read by model tiny_random (model.source=random): load"),
        ("model.max_memory={0:1GiB}", "model.max_memory caps what model.device_map spreads: set model.device_map=auto"),
        ("model.device_map=weird", "model.device_map=weird is not one of auto, balanced, balanced_low_0, sequential,"),
        ("model.device_map=cuda:1", None),
        ("hardware.device=cuda:1", None),
        (
            "hardware.compile_freezing=true hardware.compile_backend=aot_eager",
            "hardware.compile_freezing is inductor's: it needs hardware.compile_backend=inductor, got aot_eager",
        ),
    ],
)
def test_the_schemas_refuse_bad_values_in_one_line(override, message):
    """A run's checks live in its schemas' `__post_init__`: a composed config is checked without a model."""
    cfg = compose_run(*override.split())
    if message is None:
        check_run_config(cfg)
        return
    with pytest.raises(SpecReproError) as refused:
        check_run_config(cfg)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("hardware.device=gpu", "hardware.device must be auto, cpu, cuda, cuda:<index> or mps, got gpu"),
        ("logger.mode=ofline", "logger.mode must be one of online, offline, disabled (or null), got ofline"),
        (
            "+training.loop.stepz=3",
            "training.loop.stepz is not a setting of training.loop, and would be ignored (did you mean "
            "training.loop.steps?)",
        ),
        ("++resum=false", "resum is not a setting of the top level, and would be ignored (did you mean resume?)"),
        (
            "model.id=/ckpt",
            "model.id=/ckpt is not read by model tiny_random (model.source=random): load a hub id or local directory "
            "with model=hf model.id=...",
        ),
    ],
)
def test_train_refuses_a_device_or_logger_that_cannot_work_in_one_line(override, message):
    """torch.device("gpu") raised a RuntimeError's traceback, in `run` as it named the run and in `train`; a W&B
    mode wandb does not know logged nothing, after a warning of several lines; a key added with `+` was ignored."""
    from specrepro.training import train

    with pytest.raises(SpecReproError) as refused:
        train(compose_run("model=tiny_random", override, config="train"))
    assert str(refused.value) == message


def test_the_schemas_compile_backends_are_the_compiled_steps_backends():
    from specrepro.decoding.steps import BACKENDS

    assert COMPILE_BACKENDS == BACKENDS
