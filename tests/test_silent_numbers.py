"""No silent wrong numbers, round 2 (issue 81): an artifact trained for another target, a damaged finished run,
chat special tokens in dataset text, a prompt that is not text, more threads than cores, the notebook's figures
and a resumed run's timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specrepro.config import RandomArchConfig
from specrepro.errors import SpecReproError
from specrepro.models.loading import random_llama
from specrepro.training.artifacts import METADATA, find_artifact, find_matching_artifact, target_identity
from tests.test_loading_errors import one_error_line
from tests.test_runner import FAST, run_dirs, specrepro

TINY = {"name": "tiny_random", "source": "random", "id": "", "revision": None, "tokenizer": "embedded",
        "random": {"num_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2,
                   "vocab_size": 49152, "seed": 0}}


def trained_draft(root: Path, name: str, model: dict, recorded_target: bool) -> Path:
    """An sps draft artifact trained for `model`: recording its target (`target`), or only its training config (an
    artifact trained before targets were recorded)."""
    path = root / name
    random_llama(RandomArchConfig()).save_pretrained(path)
    meta = {"component": "sps_draft", "metrics": {}, "config": {"model": model}}
    if recorded_target:
        meta["target"] = target_identity(model) | {"vocab_size": 49152, "hidden_size": 64}
    (path / METADATA).write_text(json.dumps(meta))
    return path


# 1. an artifact trained for another target


@pytest.mark.parametrize("recorded_target", [True, False])
def test_an_artifact_is_found_only_for_the_target_it_was_trained_for(tmp_path, recorded_target):
    draft = trained_draft(tmp_path, "sps_draft-tiny_random-00000000", TINY, recorded_target)
    other = target_identity({**TINY, "name": "smollm2_135m", "source": "embedded"})
    assert find_artifact("sps_draft", tmp_path, target_identity(TINY)) == draft
    assert find_artifact("sps_draft", tmp_path, other) is None  # a prefix never crosses targets, however new
    with pytest.raises(SpecReproError, match="was trained for target 'tiny_random'"):
        find_artifact(draft.name, tmp_path, other)  # named in full: refused, not used
    reseeded = target_identity({**TINY, "random": {**TINY["random"], "seed": 1}})  # same name, other weights
    with pytest.raises(SpecReproError, match="random differ"):
        find_matching_artifact(draft.name, tmp_path, reseeded, lambda p: True)
    assert find_matching_artifact("sps_draft", tmp_path, reseeded, lambda p: True) is None


def test_a_run_on_another_model_does_not_load_a_draft_trained_for_tiny_random(tmp_path):
    trained_draft(tmp_path / "results" / "artifacts", "sps_draft-tiny_random-00000000", TINY, recorded_target=False)
    other = ["model.name=tiny_other", "model.random.seed=1"]
    line = one_error_line(specrepro("run", *FAST, *other, "method=sps", "dataset.limit=1", "logger=none",
                                    cwd=tmp_path, check=False))
    assert "no trained artifact 'sps_draft' for model tiny_other" in line
    pinned = "method.draft.id=sps_draft-tiny_random-00000000"
    line = one_error_line(specrepro("run", *FAST, *other, "method=sps", pinned, "dataset.limit=1", "logger=none",
                                    cwd=tmp_path, check=False))
    assert "sps_draft-tiny_random-00000000 was trained for target 'tiny_random'" in line
    assert not (tmp_path / "results" / "runs").is_dir() or not run_dirs(tmp_path)


# 2. a finished run whose generations.jsonl was damaged


def test_a_finished_run_cut_mid_line_is_resumed_not_reused_and_compare_refuses_it(tmp_path):
    args = [*FAST, "method=ar", "dataset.limit=3", "logger=none"]
    specrepro("run", *args, cwd=tmp_path)
    (run,) = run_dirs(tmp_path).values()
    generations = run / "generations.jsonl"
    whole = generations.read_text()
    generations.write_text(whole[: len(whole) - len(whole.splitlines()[-1]) // 2 - 1])  # the last line cut mid-line
    from specrepro.tables import local_runs
    from specrepro.tracking import RunRecord

    assert RunRecord(run).damage() == "its generations.jsonl was cut mid-line"
    assert local_runs(tmp_path / "results") == []  # a table leaves it out, saying why
    with pytest.raises(SpecReproError, match="cut mid-line"):
        RunRecord(run).timed_turns()  # what `specrepro compare` reads
    out = specrepro("run", *args, cwd=tmp_path)
    assert "is complete but its generations.jsonl was cut mid-line: decoding the records it lost again" in out.stdout + out.stderr
    assert RunRecord(run).damage() is None and len(RunRecord(run).rows()) == 3
    lost = generations.read_text().splitlines()
    generations.write_text("\n".join(lost[:1]) + "\n")  # whole lines lost: fewer records than metrics.json counts
    assert RunRecord(run).damage() == "its generations.jsonl holds 1 records, not the 3 its metrics.json counts"
    specrepro("run", *args, cwd=tmp_path)
    assert RunRecord(run).damage() is None

