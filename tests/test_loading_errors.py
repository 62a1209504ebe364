"""Damaged or missing models and artifacts (issue 32): one clear line and a quick non-zero exit, or a repair.

Cases: a damaged converted embedded checkpoint (converted again), a truncated artifact, an absolute artifact path
that is not one, a half-written artifact directory, and a hub model that is not cached while the hub is
unreachable (no retries: a few seconds, not 75).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from specrepro.config import RandomArchConfig
from specrepro.errors import SpecReproError
from specrepro.models import loading
from specrepro.models.loading import EMBEDDED_FILES, checkpoint_damage, embedded_checkpoint, random_llama
from specrepro.training.artifacts import METADATA, find_artifact, find_matching_artifact
from tests.test_runner import FAST, specrepro

UNREACHABLE_HUB = "http://127.0.0.1:9"  # the discard port: the connection is refused at once


def write_model(path: Path, vocab_size: int = 64) -> Path:
    """A tiny random LLaMA saved with save_pretrained (config.json + model.safetensors)."""
    random_llama(RandomArchConfig(vocab_size=vocab_size)).save_pretrained(path)
    return path


def cached_hub_model(hf_home: Path, repo: str, commit: str = "0" * 40) -> Path:
    """A tiny random LLaMA (SmolLM2's vocabulary size) in the Hugging Face cache under `hf_home`, as `hf download`
    leaves it: its snapshot directory."""
    cached = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    write_model(cached / "snapshots" / commit, vocab_size=49152)
    (cached / "refs").mkdir()
    (cached / "refs" / "main").write_text(commit)
    return cached / "snapshots" / commit


def write_artifact(root: Path, name: str, complete: bool = True) -> Path:
    path = write_model(root / name)
    if complete:
        (path / METADATA).write_text(json.dumps({"component": "sps_draft", "metrics": {}}))
    return path


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def one_error_line(proc) -> str:
    """The run's single `specrepro: error:` line; no traceback and no retry noise on stderr."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("specrepro: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Retrying" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


# a. the converted embedded checkpoint


def fake_conversion(calls: list):
    def convert(target: Path) -> Path:
        calls.append(target)
        target.mkdir(parents=True)
        write_model(target)
        for name in EMBEDDED_FILES[2:]:
            (target / name).write_text("{}")
        return target

    return convert


@pytest.mark.parametrize("damage", ["truncated", "missing tokenizer", "missing chat template", "empty config"])
def test_a_damaged_embedded_checkpoint_is_converted_again(tmp_path, monkeypatch, damage):
    calls = []
    monkeypatch.setattr(loading, "_convert_embedded", fake_conversion(calls))
    target = embedded_checkpoint(str(tmp_path))
    assert calls == [target] and checkpoint_damage(target) is None
    {
        "truncated": lambda: truncate(target / "model.safetensors"),
        "missing tokenizer": lambda: (target / "tokenizer.json").unlink(),
        "missing chat template": lambda: (target / "chat_template.jinja").unlink(),
        "empty config": lambda: (target / "config.json").write_text(""),
    }[damage]()
    assert checkpoint_damage(target) is not None
    assert embedded_checkpoint(str(tmp_path)) == target
    assert len(calls) == 2 and checkpoint_damage(target) is None
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # the damaged copy is gone
    embedded_checkpoint(str(tmp_path))
    assert len(calls) == 2  # an intact copy is not converted again


def test_an_unwritable_cache_dir_is_one_clear_error():
    with pytest.raises(SpecReproError, match="writable directory"):
        embedded_checkpoint("/proc/specrepro-cache")


@pytest.mark.embedded
def test_a_truncated_embedded_checkpoint_is_rebuilt_for_real(tmp_path):
    target = tmp_path / "models" / loading.EMBEDDED_NAME
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"\x10\x00\x00")
    assert embedded_checkpoint(str(tmp_path)) == target
    assert checkpoint_damage(target) is None
    assert [p.name for p in tmp_path.joinpath("models").iterdir()] == [target.name]


# b. a truncated artifact


def test_a_truncated_artifact_is_one_line_naming_it(tmp_path):
    artifact = write_artifact(tmp_path / "results" / "artifacts", "sps_draft-tiny_random-00000000")
    truncate(artifact / "model.safetensors")
    start = time.monotonic()
    line = one_error_line(
        specrepro("run", *FAST, "method=sps", "dataset.limit=1", "logger=none", cwd=tmp_path, check=False)
    )
    assert "sps_draft-tiny_random-00000000 is damaged" in line and "delete" in line
    assert time.monotonic() - start < 60


def test_an_artifact_missing_or_cutting_a_file_it_was_published_with_is_damaged_for_runs_and_training(tmp_path):
    """`publish` records each file's size: a file deleted or cut short that is not a safetensors file (a REST
    datastore's tokens, a weights file gone) is found before anything loads it; an artifact.json that does not
    read is one line, and `specrepro train` trains a damaged artifact again instead of skipping it."""
    from specrepro.training.artifacts import artifact_damage, check_intact, publish, read_metadata

    def published(name: str) -> Path:
        staging = tmp_path / f".{name}.staging"
        (staging / "datastore").mkdir(parents=True)
        (staging / "datastore" / "tokens.npy").write_bytes(b"0123456789")
        (staging / "config.json").write_text("{}")
        return publish(staging, tmp_path / name, {"metrics": {}})

    artifact = published("rest_datastore-tiny-00000000")
    assert read_metadata(artifact)["files"] == {"config.json": 2, "datastore/tokens.npy": 10}
    assert artifact_damage(artifact) is None and check_intact(artifact) == artifact
    (artifact / "datastore" / "tokens.npy").write_bytes(b"01234")
    with pytest.raises(SpecReproError, match=r"is damaged \(datastore/tokens.npy is 5 bytes, not the 10"):
        check_intact(artifact)
    (artifact / "datastore" / "tokens.npy").unlink()
    assert artifact_damage(artifact) == "datastore/tokens.npy is missing"
    (artifact / METADATA).write_text('{"metrics": {')
    assert artifact_damage(artifact) == f"its {METADATA} does not read"
    with pytest.raises(SpecReproError, match=f"rest_datastore-tiny-00000000 is damaged \\(its {METADATA}"):
        find_artifact("rest_datastore", tmp_path, "tiny")


def test_a_truncated_head_artifact_found_by_its_settings_is_an_error(tmp_path):
    artifact = tmp_path / "eesd_head-tiny-00000000"
    write_model(artifact)
    (artifact / METADATA).write_text("{}")
    shutil.move(artifact / "model.safetensors", artifact / "eesd_head.safetensors")
    assert find_matching_artifact("eesd_head", tmp_path, "tiny", lambda p: True) == artifact
    truncate(artifact / "eesd_head.safetensors")
    with pytest.raises(SpecReproError, match="eesd_head-tiny-00000000 is damaged"):
        find_matching_artifact("eesd_head", tmp_path, "tiny", lambda p: True)


def test_of_several_matching_artifacts_the_newest_is_loaded_with_a_warning_and_a_full_name_pins_one(tmp_path, caplog):
    older, newer, other_model = (
        tmp_path / name
        for name in ("eesd_head-tiny-00000000", "eesd_head-tiny-11111111", "eesd_head-tiny_sft-22222222")
    )
    for age, artifact in enumerate((older, newer, other_model)):  # trained in this order
        artifact.mkdir()
        (artifact / METADATA).write_text("{}")
        os.utime(artifact / METADATA, (1_000_000 + age, 1_000_000 + age))
    with caplog.at_level("WARNING", logger="specrepro.training.artifacts"):
        assert find_matching_artifact("eesd_head", tmp_path, "tiny", lambda p: True) == newer  # not tiny_sft's
    assert "2 trained artifacts match eesd_head-tiny-*" in caplog.text and newer.name in caplog.text
    caplog.clear()
    assert find_matching_artifact(older.name, tmp_path, "tiny", lambda p: True) == older  # named in full: pinned
    assert find_artifact(older.name, tmp_path) == older and not caplog.text
    assert find_matching_artifact("eesd_head", tmp_path, "tiny", lambda p: p != newer) == older and not caplog.text


# c. an absolute path


def test_an_absolute_draft_path_that_is_not_an_artifact_is_one_line(tmp_path):
    line = one_error_line(
        specrepro(
            "run",
            *FAST,
            "method=sps",
            f"method.draft.id={tmp_path}/no-such-draft",
            "dataset.limit=1",
            "logger=none",
            cwd=tmp_path,
            check=False,
        )
    )
    assert f"no trained artifact '{tmp_path}/no-such-draft'" in line


def test_an_absolute_path_to_a_complete_artifact_resolves(tmp_path):
    artifact = write_artifact(tmp_path / "elsewhere", "sps_draft-tiny-00000000")
    assert find_artifact(str(artifact), tmp_path / "artifacts") == artifact
    assert find_artifact(str(tmp_path / "nothing"), tmp_path / "artifacts") is None


# d. a half-written artifact directory


def test_a_half_written_artifact_given_by_path_is_refused_in_one_line(tmp_path):
    staging = write_artifact(tmp_path / "results" / "artifacts", ".sps_draft-tiny_random-00000000.staging")
    line = one_error_line(
        specrepro(
            "run",
            *FAST,
            "method=sps",
            f"method.draft.id={staging}",
            "dataset.limit=1",
            "logger=none",
            cwd=tmp_path,
            check=False,
        )
    )
    assert f"{staging} is an incomplete artifact" in line


@pytest.mark.parametrize("staging", [True, False])
def test_an_artifact_without_its_completion_marker_is_incomplete(tmp_path, staging):
    root = tmp_path / "artifacts"
    name = ".sps_draft-tiny-00000000.staging" if staging else "sps_draft-tiny-00000000"
    half = write_artifact(root, name, complete=staging)  # a staging dir is incomplete even with its marker
    for ref in (name, str(half)):
        with pytest.raises(SpecReproError, match="incomplete artifact"):
            find_artifact(ref, root)
    done = write_artifact(root, "sps_draft-tiny-11111111")
    assert find_artifact("sps_draft", root) == done  # the prefix still finds the complete one


# e. a hub model neither cached nor reachable


@pytest.mark.parametrize(
    "overrides, env, message",
    [
        (["model.name=x", "model.source=hf", "model.id=someorg/not-cached"], {}, "model 'someorg/not-cached'"),
        (
            ["model.name=x", "model.source=hf", "model.id=someorg/not-cached"],
            {"HF_ENDPOINT": UNREACHABLE_HUB},
            "model 'someorg/not-cached' is not a local directory nor in the local Hugging Face cache",
        ),
        (
            ["model=tiny_random", "model.tokenizer=someorg/no-tokenizer"],
            {"HF_ENDPOINT": UNREACHABLE_HUB},
            f"the hub ({UNREACHABLE_HUB}) is unreachable",
        ),
        (
            ["model=tiny_random", "model.tokenizer=someorg/no-tokenizer"],
            {"HF_HUB_OFFLINE": "1"},
            "tokenizer 'someorg/no-tokenizer' is not a local directory nor in the local Hugging Face cache",
        ),
    ],
    ids=["as-is", "model", "tokenizer", "offline"],
)
def test_an_uncached_hub_model_fails_fast_when_the_hub_is_unreachable(tmp_path, monkeypatch, overrides, env, message):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty Hugging Face cache (the subprocess's env)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    start = time.monotonic()
    proc = specrepro(
        "run",
        *overrides,
        "method=ar",
        "dataset.limit=1",
        "logger=none",
        "hardware.threads=1",
        cwd=tmp_path,
        check=False,
    )
    elapsed = time.monotonic() - start
    line = one_error_line(proc)
    assert message in line
    assert elapsed < 45, f"took {elapsed:.0f} s"  # ~15 s here, most of it imports; the hub's retries took 75 s


@pytest.mark.parametrize("holds", ["nothing", "a config only", "truncated weights", "a model without a tokenizer"])
def test_a_local_directory_without_a_checkpoint_is_refused_in_one_line(tmp_path, holds):
    """A directory is taken as a checkpoint, never looked up on the hub; what it lacks is said in one line."""
    from specrepro.config import ModelConfig

    directory = tmp_path / "checkpoint"
    if holds == "nothing":
        directory.mkdir()
    else:
        write_model(directory)
        if holds == "a config only":
            (directory / "model.safetensors").unlink()
        if holds == "truncated weights":  # safetensors' own error, not an OSError: it was a traceback
            truncate(directory / "model.safetensors")
    what = "tokenizer" if holds == "a model without a tokenizer" else "model"
    cfg = ModelConfig(name="local", source="hf", id=str(directory))
    with pytest.raises(SpecReproError, match=f"^{what} directory '{directory}' holds no {what} transformers can"):
        loading.load_model(cfg, torch.device("cpu"), torch.float32)
    with pytest.raises(SpecReproError, match="model.source=hf needs model.id"):
        loading.load_model(ModelConfig(name="local", source="hf", id=None), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("path", ["/nonexistent/llama", "./not_here", "~/no_such_model"])
def test_a_model_path_that_does_not_exist_is_named_as_one(path):
    """A missing directory was looked up as a hub id, and the error advised `hf download /nonexistent/llama`."""
    from transformers import AutoModelForCausalLM

    with pytest.raises(SpecReproError, match=f"model directory '{re.escape(path)}' does not exist"):
        loading._from_pretrained(AutoModelForCausalLM, path)


def test_a_device_this_machine_lacks_is_one_line(monkeypatch):
    """`hardware.device=mps` without MPS, or a CUDA index past the devices: the schema takes both, and torch raised
    its own traceback when the model moved there."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(SpecReproError, match="^hardware.device=mps but MPS is not available"):
        loading.resolve_device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SpecReproError, match=r"^hardware.device=cuda:1 but this process sees 1 CUDA device\(s\)"):
        loading.resolve_device("cuda:1")
    assert loading.resolve_device("cuda:0").type == loading.resolve_device("cuda").type == "cuda"


def test_an_artifact_without_a_tokenizer_takes_the_configured_one(tmp_path):
    """A model trained for a random target saves no tokenizer; `model.tokenizer` (what the error advises) gives it
    one, where it was ignored and the run refused for want of a tokenizer."""
    from specrepro.config import ModelConfig

    path = write_artifact(tmp_path, "cllm-tiny")
    cfg = ModelConfig(name="tiny", source="artifact", id=str(path), tokenizer="embedded")
    loaded = loading.load_model(cfg, torch.device("cpu"), torch.float32, artifacts_dir=tmp_path)
    assert loaded.tokenizer is not None and loaded.tokenizer.eos_token == "<|im_end|>"
    cfg.tokenizer = None
    assert loading.load_model(cfg, torch.device("cpu"), torch.float32, artifacts_dir=tmp_path).tokenizer is None


def test_the_embedded_model_takes_the_configured_tokenizer(tmp_path, monkeypatch):
    """`model.tokenizer` ("the tokenizer source when it differs") was ignored for source=embedded: the run still used
    the embedded tokenizer, under a name that hashed the other one."""
    from specrepro.config import ModelConfig

    tokenizer = loading.load_tokenizer("embedded", ModelConfig(name="t"))
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    tokenizer.save_pretrained(tmp_path / "own_tokenizer")
    monkeypatch.setattr(loading, "embedded_checkpoint", lambda cache_dir: write_model(tmp_path / "embedded"))
    cfg = ModelConfig(name="smollm2", source="embedded", tokenizer=str(tmp_path / "own_tokenizer"))
    loaded = loading.load_model(cfg, torch.device("cpu"), torch.float32)
    assert loaded.tokenizer.chat_template == "{{ messages[0]['content'] }}"


def test_a_local_directory_under_the_home_directory_loads_by_its_tilde_path(tmp_path, monkeypatch):
    """`model.id=~/models/x` is that directory, as the run's identity takes it, not a hub id that is not cached."""
    from specrepro.config import ModelConfig

    monkeypatch.setenv("SPECREPRO_CACHE", str(loading.cache_root()))  # the embedded tokenizer's, converted already
    monkeypatch.setenv("HOME", str(tmp_path))
    write_model(tmp_path / "models" / "tiny")
    cfg = ModelConfig(name="local", source="hf", id="~/models/tiny", tokenizer="embedded")
    loaded = loading.load_model(cfg, torch.device("cpu"), torch.float32)
    assert loaded.model.config.vocab_size == 64


def test_a_cached_hub_model_loads_without_asking_an_unreachable_hub(tmp_path, monkeypatch):
    """The adapter lookup of `from_pretrained(local_files_only=True)` would otherwise retry the hub for 23 s."""
    cached_hub_model(tmp_path / "hf", "someorg/tiny")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", UNREACHABLE_HUB)
    proc = specrepro(
        "run",
        *FAST,
        "model.name=tiny_hub",
        "model.source=hf",
        "model.id=someorg/tiny",
        "model.tokenizer=embedded",
        "method=ar",
        "dataset.limit=1",
        "logger=none",
        cwd=tmp_path,
    )
    assert "Retrying" not in proc.stderr, proc.stderr[-3000:]


def test_a_cached_hub_model_of_an_unknown_architecture_is_one_line(tmp_path, monkeypatch):
    """transformers' ValueError for a model type it does not know was a traceback from the cache (a directory's was
    one line already)."""
    snapshot = cached_hub_model(tmp_path / "hf", "someorg/newarch")
    config = json.loads((snapshot / "config.json").read_text())
    (snapshot / "config.json").write_text(json.dumps(config | {"model_type": "llama9000"}))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", UNREACHABLE_HUB)
    proc = specrepro(
        "run",
        *FAST,
        "model.source=hf",
        "model.id=someorg/newarch",
        "dataset.limit=1",
        "logger=none",
        cwd=tmp_path,
        check=False,
    )
    assert "model 'someorg/newarch' in the local Hugging Face cache" in one_error_line(proc)
    assert "model type `llama9000`" in one_error_line(proc)


def test_a_pinned_model_revision_is_not_asked_of_a_separate_tokenizer(tmp_path, monkeypatch):
    """`model.revision` is a commit of `model.id`'s repository; `model.tokenizer`, another repository, loads its own
    newest cached commit (it was refused as not cached, asked for the model's commit)."""
    from transformers import AutoTokenizer

    commits = {"tiny": "0123456789abcdef0123456789abcdef01234567", "tok": "89abcdef0123456789abcdef0123456789abcdef"}
    cached_hub_model(tmp_path / "hf", "someorg/tiny", commits["tiny"])
    tokenizer_snapshot = cached_hub_model(tmp_path / "hf", "someorg/tok", commits["tok"])  # its tokenizer files:
    AutoTokenizer.from_pretrained(embedded_checkpoint()).save_pretrained(tokenizer_snapshot)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", UNREACHABLE_HUB)
    specrepro(
        "run",
        *FAST,
        "model.name=tiny_hub",
        "model.source=hf",
        "model.id=someorg/tiny",
        f"model.revision={commits['tiny']}",
        "model.tokenizer=someorg/tok",
        "method=ar",
        "dataset.limit=1",
        "logger=none",
        cwd=tmp_path,
    )
