"""`specrepro reproduce`: a tiny-model pipeline (train -> run -> table) end to end, killed between stages and
resumed, then called again with everything reused; and every shipped pipeline is well formed."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specrepro.errors import SpecReproError
from specrepro.reproduce import (
    PIPELINES_DIR,
    load_pipeline,
    parse_stages,
    regenerating_command,
    stage_overrides,
)
from specrepro.summary import SUMMARY_PAGE, summary_page
from tests.test_runner import FAST, specrepro
from tests.test_training import TINY_TRAINING

TRAIN = [o for o in TINY_TRAINING if not o.startswith(("model=", "logger=", "hardware."))]
TABLE = """paper: tiny
title: "A tiny pipeline"
select: {model: tiny_random}
rows:
  - {label: [AR], select: {method: ar}}
  - {label: [SPS], select: {method: sps}}
columns:
  - {label: MAT, key: mat}
  - {label: lossless, key: lossless}
"""


def _pipeline(tmp_path: Path) -> Path:
    (tmp_path / "tiny_table.yaml").write_text(TABLE)
    pipeline = {
        "paper": "tiny",
        "stages": [
            {"train": TRAIN},
            {
                "run": [
                    "-m",
                    "method=ar,sps",
                    "dataset.limit=2",
                    *[o for o in FAST if not o.startswith(("model=", "hardware."))],
                ]
            },
            {"table": str(tmp_path / "tiny_table.yaml")},
        ],
        "headline": [
            {"table": "tiny_table", "row": ["SPS"], "column": "lossless", "claim": "lossless", "status": "reproduced"}
        ],
    }
    (tmp_path / "pipelines").mkdir()
    path = tmp_path / "pipelines" / "tiny.yaml"
    path.write_text(json.dumps(pipeline))  # JSON is YAML
    return path


def test_a_pipeline_killed_between_stages_resumes_and_a_second_call_reuses_everything(tmp_path):
    pipeline = _pipeline(tmp_path)
    args = ["reproduce", str(pipeline), "model=tiny_random", "logger=none", "hardware.threads=1"]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specrepro.cli", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    stages = tmp_path / "results" / "tiny" / "stages.json"  # what each stage took, beside the tables
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline and not stages.is_file():
        time.sleep(0.05)
    assert proc.poll() is None, "the pipeline ended before it could be killed after its first stage"
    os.killpg(proc.pid, signal.SIGKILL)  # between the train and the run stage, or inside the run stage
    proc.wait()
    assert not (tmp_path / "results" / "tiny" / "tiny_table.md").exists()

    trained = json.loads(stages.read_text())
    key = f"train {' '.join(TRAIN)} [model=tiny_random]"  # a call on another model keeps its minutes apart
    assert list(trained) == [key]
    first = trained[key]
    assert (
        first["reused"] == [] and first["minutes"] > 0 and first["command"].endswith("--stages 1 " + " ".join(args[2:]))
    )
    assert first["machine"] and first["date"] and "commit" in first

    out = specrepro(*args, cwd=tmp_path)
    assert "[3/3] table" in out.stdout and "done in" in out.stdout
    measured = json.loads(stages.read_text())  # the train stage reused its artifact: its first measurement stays
    assert measured[key] == first and len(measured) == 2
    table = (tmp_path / "results" / "tiny" / "tiny_table.md").read_text()
    assert "| AR |" in table and "| SPS |" in table and "Provenance:" in table
    assert f"Regenerate: `specrepro reproduce {pipeline} model=tiny_random" in table
    runs = tmp_path / "results" / "reproduce" / "tiny" / "runs"
    sps = next(
        json.loads((p / "metrics.json").read_text())
        for p in runs.iterdir()
        if json.loads((p / "metrics.json").read_text())["method"] == "sps"
    )
    assert sps["lossless"] == 1.0 and sps["provenance"]["record_version"] >= 2
    shared = tmp_path / "results" / "reproduce" / "artifacts"  # every pipeline's trained components
    artifacts = sorted(p.name for p in shared.iterdir())
    assert artifacts and not (tmp_path / "results" / "reproduce" / "tiny" / "artifacts").exists()

    def written():  # when each run record and artifact was last written
        return {
            p: p.stat().st_mtime_ns
            for name in ("metrics.json", "artifact.json")
            for p in (tmp_path / "results" / "reproduce").rglob(name)
        }

    records = written()
    again = specrepro(*args, cwd=tmp_path)  # everything re-used: no record or artifact is written again
    assert written() == records and len(records) == 3  # the ar and sps runs, the sps draft
    assert json.loads(stages.read_text()) == measured and again.stdout.count("stays the earlier one") == 2
    assert "already trained" in again.stdout + again.stderr and "already complete" in again.stdout + again.stderr
    assert sorted(p.name for p in shared.iterdir()) == artifacts
    assert (tmp_path / "results" / "tiny" / "tiny_table.md").read_text() == table
    progress = specrepro("reproduce", str(pipeline), "--dry-run", "--check-done", *args[2:], cwd=tmp_path).stdout
    assert re.search(r"\[2/3\] run .*; 2 of 2 run\(s\) done\)", progress), progress
    cut = next(runs.iterdir()) / "generations.jsonl"  # a record cut short is decoded again: not done
    kept = cut.read_text()
    cut.write_text(kept.splitlines()[0] + "\n")
    progress = specrepro("reproduce", str(pipeline), "--dry-run", "--check-done", *args[2:], cwd=tmp_path).stdout
    assert re.search(r"\[2/3\] run .*; 1 of 2 run\(s\) done\)", progress), progress
    cut.write_text(kept)

    other = tmp_path / "pipelines" / "other.yaml"  # another paper's pipeline training the same component
    other.write_text(
        json.dumps({"paper": "other", "stages": [{"train": TRAIN}, {"table": str(tmp_path / "tiny_table.yaml")}]})
    )
    planned = specrepro("reproduce", str(other), "--dry-run", "--check-done", *args[2:], cwd=tmp_path).stdout
    assert f"made already: {next(a for a in artifacts if not a.startswith('.'))}" in planned
    specrepro("reproduce", str(other), "--stages", "1", *args[2:], cwd=tmp_path)
    assert written() == records and sorted(p.name for p in shared.iterdir()) == artifacts
    (reused,) = json.loads((tmp_path / "results" / "other" / "stages.json").read_text()).values()
    assert reused["reused"], "the other pipeline's stage did not say it found the component already made"

    page = (tmp_path / "results" / SUMMARY_PAGE).read_text()  # refreshed by the table stage
    assert page == summary_page(str(tmp_path / "results"), pipeline_file=pipeline)
    (row,) = [line for line in page.splitlines() if line.startswith("| tiny | lossless | reproduced |")]
    assert row.endswith("| [tiny_table](tiny/tiny_table.md) |") and "| – | 1.00 | " in row
    assert f"; {first['commit'][:10]}" in row and "unknown" not in row  # the table's machine; commit; date
    assert "- Regenerate: `specrepro summary`" in page

    for run in list(runs.iterdir()):  # the same settings' records under other names: what other code decoded
        run.rename(run.with_name(run.name + "-old"))
    progress = specrepro("reproduce", str(pipeline), "--dry-run", "--check-done", *args[2:], cwd=tmp_path).stdout
    assert re.search(
        r"\[2/3\] run .*; 0 of 2 run\(s\) done \(2 more decoded by other code: decoded anew\)", progress
    ), progress


def test_dry_run_lists_the_stages_and_runs_nothing_without_importing_torch(tmp_path):
    pipeline = _pipeline(tmp_path)
    (tmp_path / "results" / "tiny").mkdir(parents=True)
    (tmp_path / "results" / "tiny" / "stages.json").write_text(
        json.dumps(
            {
                "train " + " ".join(TRAIN): {
                    "minutes": 12.0,
                    "reused": [],
                    "machine": "m",
                    "commit": "c",
                    "date": "2026-01-01",
                }
            }
        )
    )
    dry_run = (
        "import sys; from specrepro.cli import main; sys.argv[1:] = ['reproduce', %r, '--dry-run']; main(); "
        "print('torch imported:', 'torch' in sys.modules)" % str(pipeline)
    )
    out = subprocess.run([sys.executable, "-c", dry_run], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch imported: False" in out.stdout and "[1/3] train method=sps" in out.stdout
    assert (
        "total over all 3 stages: about 12 min for the 1 timed train and run stage(s); 1 not timed yet (not "
        "counted); 1 table stage(s), under a minute each"
    ) in out.stdout
    assert "[2/3] run -m method=ar,sps" in out.stdout and "(not timed yet)" in out.stdout
    assert sorted(p.name for p in (tmp_path / "results").rglob("*")) == ["stages.json", "tiny"]  # nothing written
    out = specrepro("reproduce", str(pipeline), "--dry-run", "--check-done", cwd=tmp_path)
    assert (
        "(not timed yet; 2 run(s), not startable yet: no trained artifact 'sps_draft' for model" in out.stdout
    )  # stage 1's
    proc = specrepro("reproduce", str(pipeline), "--check-done", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "--check-done goes with --dry-run" in proc.stderr


def test_a_dry_run_piped_into_a_reader_that_stops_early_ends_quietly(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "specrepro.cli", "reproduce", "all", "--dry-run"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # as `| head -1` does once it has its line: every write after it fails
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 1 and "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


def test_stages_picks_stage_numbers_and_a_bad_pick_is_one_line(tmp_path):
    pipeline = _pipeline(tmp_path)
    out = specrepro("reproduce", str(pipeline), "--dry-run", "--stages", "2-3", "hardware.threads=1", cwd=tmp_path)
    assert "[2/3] run -m method=ar,sps" in out.stdout and "[3/3] table" in out.stdout and "[1/3]" not in out.stdout
    proc = specrepro("reproduce", str(pipeline), "--dry-run", "--stages", "4", cwd=tmp_path, check=False)
    assert proc.returncode != 0 and "this pipeline has stages 1-3" in proc.stderr and "Traceback" not in proc.stderr
    assert parse_stages("3,1-2", 3) == {1, 2, 3}
    for pick in ("2-x", "", "0"):
        with pytest.raises(SpecReproError, match="--stages"):
            parse_stages(pick, 3)
    with pytest.raises(SpecReproError, match=r"--stages 3-1: a range goes from the lower stage up \(1-3\)"):
        parse_stages("3-1", 3)


def test_an_override_reaches_only_the_stages_whose_config_has_its_setting(tmp_path):
    """`specrepro reproduce <paper> dataset.limit=2` gave the override to every stage, and the first train stage
    failed on "Key 'dataset' not in 'TrainRunConfig'". A run-only setting now reaches run stages only, a training
    setting train stages only, and a setting both have (model, hardware) or Hydra's own, both."""
    overrides = ["dataset.limit=2", "+training.extra=1", "~judge", "model=tiny_random", "hardware.threads=1"]
    assert stage_overrides("run", overrides) == ["dataset.limit=2", "~judge", "model=tiny_random", "hardware.threads=1"]
    assert stage_overrides("train", overrides) == ["+training.extra=1", "model=tiny_random", "hardware.threads=1"]
    assert stage_overrides("run", ["hydra.job.chdir=false"]) == stage_overrides("train", ["hydra.job.chdir=false"])
    proc = specrepro(
        "reproduce", str(_pipeline(tmp_path)), "--dry-run", "--check-done", "dataset.limit=1", cwd=tmp_path, check=False
    )
    assert proc.returncode == 0 and "[1/3] train" in proc.stdout, proc.stderr


def test_the_regenerating_command_is_quoted_and_names_a_results_dir_of_its_own():
    """A table's Regenerate line and stages.json's commands joined words with spaces (an override holding a space or
    quote came out broken) and left out `--results-dir`, so the command wrote elsewhere than the pipeline had."""
    assert regenerating_command("sar", "results", ["model=tiny_random"]) == "specrepro reproduce sar model=tiny_random"
    assert regenerating_command("sar", "/data/res", ["run_name='a b'"], "--stages", "2") == (
        "specrepro reproduce sar --results-dir /data/res --stages 2 'run_name='\"'\"'a b'\"'\"''"
    )


def test_reproduce_all_runs_every_pipeline_past_one_that_fails(monkeypatch, tmp_path, capsys):
    """`reproduce all` stopped at the first failing pipeline, saying to call that one again, and the pipelines after
    it never ran. Each pipeline now runs; the failures are named at the end in one line."""
    from specrepro import reproduce

    for name in ("a_fails", "b_runs", "c_runs"):
        (tmp_path / f"{name}.yaml").write_text("")
    ran = []

    def pipeline(name, *args, **kwargs):
        ran.append(name)
        if name == "a_fails":
            raise SpecReproError("a_fails: stage 1 (train method=x) failed with exit status 2")

    monkeypatch.setattr(reproduce, "PIPELINES_DIR", tmp_path)
    monkeypatch.setattr(reproduce, "reproduce", pipeline)
    with pytest.raises(SpecReproError, match=r"1 of 3 pipelines failed \(a_fails\); the others ran"):
        reproduce.main(["all"])
    assert ran == ["a_fails", "b_runs", "c_runs"]
    assert "specrepro: error: a_fails: stage 1" in capsys.readouterr().err


def test_a_table_stage_naming_no_table_fails_in_one_line_before_any_stage_runs(tmp_path):
    """A mistyped table name is found by `--dry-run` and before the first stage, not after hours of training."""
    pipeline = _pipeline(tmp_path)
    pipeline.write_text(pipeline.read_text().replace(str(tmp_path / "tiny_table.yaml"), "tiny_tabel"))
    for dry_run in (["--dry-run"], []):
        proc = specrepro("reproduce", str(pipeline), *dry_run, "--stages", "1", cwd=tmp_path, check=False)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        assert "stage 3 (table tiny_tabel): no table spec 'tiny_tabel'" in proc.stderr, proc.stderr
    assert not (tmp_path / "results" / "reproduce").exists()  # no stage ran


def test_artifacts_a_pipeline_trained_into_its_own_folder_move_to_the_shared_one_unless_in_use(tmp_path):
    import fcntl

    from specrepro.reproduce import adopt_earlier_artifacts

    old, shared = tmp_path / "eesd" / "artifacts", tmp_path / "artifacts"
    for path in [
        "sps_draft-m-1/artifact.json",
        ".sps_draft-m-1.lock",
        ".work/.continuations-2.batches/000000.pt",
        ".work/.continuations-2.lock",
        ".work/hidden-3/rows.pt",
        "eesd_head-m-4/artifact.json",
    ]:
        (old / path).parent.mkdir(parents=True, exist_ok=True)
        (old / path).write_text(path)
    (shared / "eesd_head-m-4").mkdir(parents=True)  # trained by another pipeline already: kept, not overwritten
    (shared / "eesd_head-m-4" / "artifact.json").write_text("shared")
    with open(old / ".work" / ".continuations-2.lock", "a") as lock:  # a lane of an older checkout, still running
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert adopt_earlier_artifacts(old, shared) == 0 and (old / "sps_draft-m-1").is_dir()
    assert adopt_earlier_artifacts(old, shared) == 3
    assert (shared / "sps_draft-m-1" / "artifact.json").read_text() == "sps_draft-m-1/artifact.json"
    assert (shared / ".work" / ".continuations-2.batches" / "000000.pt").is_file()
    assert (shared / ".work" / "hidden-3" / "rows.pt").is_file()
    assert (shared / "eesd_head-m-4" / "artifact.json").read_text() == "shared"
    assert (old / "eesd_head-m-4").is_dir()  # a copy of one already shared stays: nothing is deleted unseen
    (old / "eesd_head-m-4" / "artifact.json").unlink()
    assert adopt_earlier_artifacts(old, shared) == 0 and not old.exists()


def test_stage_minutes_keep_lanes_apart_and_a_stage_that_reused_something_fills_only_a_gap(tmp_path):
    """Two lanes running other stages of one pipeline each add their own stage to stages.json, under its lock; a
    measurement of a stage that found something already made never replaces one, and is labelled as such."""
    from specrepro.reproduce import expected_time, read_measured, record_minutes

    path = tmp_path / "stages.json"
    sps = {
        "minutes": 48.0,
        "reused": [],
        "machine": "AMD EPYC (AVX2), 2 cores",
        "commit": "0123456789",
        "dirty": False,
        "date": "2026-11-27T23:00:00+00:00",
        "command": "specrepro reproduce spec_bench --stages 2",
    }
    eesd = sps | {"minutes": 30.5, "reused": ["44 saved batches of target continuations"]}
    assert record_minutes(path, "train method=sps", sps) and record_minutes(path, "train method=eesd", eesd)
    assert not record_minutes(path, "train method=sps", sps | {"minutes": 0.2, "reused": ["artifact sps_draft"]})
    assert record_minutes(path, "train method=eesd", eesd | {"minutes": 80.0, "reused": []})
    measured = read_measured(path)
    assert measured == {"train method=sps": sps, "train method=eesd": eesd | {"minutes": 80.0, "reused": []}}
    assert expected_time(sps) == "about 48.0 min: AMD EPYC (AVX2), 2 cores, 2026-11-27, commit 0123456"
    assert (
        expected_time(eesd).startswith("30.5 min with 1 thing already made") and expected_time(None) == "not timed yet"
    )


def test_a_stage_records_the_commit_it_started_on(tmp_path, monkeypatch):
    """A lane keeps running while its checkout moves on (a `git pull` beside it): the stage's entry names the
    commit its process started from, not the one checked out when it ended."""
    from specrepro import reproduce as pipeline

    checkout = {"commit": "a" * 40, "dirty": False}

    def stage_that_outlives_a_pull(command, work_dir):
        checkout["commit"] = "b" * 40
        return 0, 12.5, []

    monkeypatch.setattr(pipeline, "checkout_version", lambda: dict(checkout))
    monkeypatch.setattr(pipeline, "run_stage", stage_that_outlives_a_pull)
    pipeline.reproduce(str(_pipeline(tmp_path)), results_dir=str(tmp_path / "results"), only="1")
    (entry,) = pipeline.read_measured(tmp_path / "results" / "tiny" / "stages.json").values()
    assert entry["commit"] == "a" * 40 and entry["minutes"] == 12.5


@pytest.mark.slow  # composes every stage's sweep
@pytest.mark.parametrize("paper", sorted(p.stem for p in PIPELINES_DIR.glob("*.yaml")))
def test_every_shipped_pipeline_is_well_formed(paper):
    from tests.test_config import compose_run

    _, stages = load_pipeline(paper)
    assert any("table" in stage for stage in stages)
    for stage in stages:
        if "run" in stage or "train" in stage:
            # a swept value (`method.k=1,2`) composes as its first value; a list (`[1,4]`) is one value
            overrides = [o if "[" in o else o.split(",")[0] for o in stage.get("run", stage.get("train")) if o != "-m"]
            compose_run(*overrides, config="run" if "run" in stage else "train")  # composes


@pytest.mark.slow  # composes every pipeline's train stages
def test_a_component_two_pipelines_train_is_trained_alike():
    """Every pipeline's artifacts share one folder, and a run loads the newest artifact its method's settings
    match: so the shipped train stages that make a component for the same model and method settings must make the
    same artifact, or one paper's table could decode a component another pipeline trained differently."""
    from omegaconf import OmegaConf

    from specrepro.reproduce import describe, with_trained
    from specrepro.training import artifact_path
    from tests.test_config import compose_run

    made: dict[tuple, dict[str, list[str]]] = {}
    runs = []  # every run stage's arguments, an artifact named by its train stage (`@stageN`) in full
    for paper in sorted(p.stem for p in PIPELINES_DIR.glob("*.yaml")):
        stages = load_pipeline(paper)[1]
        for stage in stages:
            runs += [with_trained(stage, stages, Path("results"), [])["run"]] if "run" in stage else []
            if "train" in stage:
                cfg = compose_run(*stage["train"], config="train")
                method = json.dumps(OmegaConf.to_container(cfg.method, resolve=True), sort_keys=True)
                made.setdefault((cfg.training.component, cfg.model.name, method), {}).setdefault(
                    artifact_path(cfg, inputs=False).name,
                    [],  # by settings: nothing is trained here
                ).append(f"{paper}: {describe(stage)}")

    def pinned(names: dict, method: str) -> bool:
        """Several artifacts for one setting on purpose (a learning curve's budgets): each is decoded by name, and no
        run of the method can pick one up by its prefix (its head, named or the method's default, is one of them in
        full or the prefix of none)."""
        settings = json.loads(method)
        uses = [args for args in runs if any(a.startswith(f"method={settings['name']}") for a in args)]
        heads = {
            next((a.split("=", 1)[1] for a in args if a.startswith("method.head=")), settings.get("head"))
            for args in uses
        }
        by_prefix = [head for head in heads if head not in names and any(n.startswith(f"{head}-") for n in names)]
        return set(names) <= heads and not by_prefix

    assert not {key: names for key, names in made.items() if len(names) > 1 and not pinned(names, key[2])}
    shared = [
        stages for names in made.values() for stages in names.values() if len({s.split(":")[0] for s in stages}) > 1
    ]
    assert len(shared) >= 5, "the pipelines' common components (sps, self_sd, the EESD and SAR heads, ...) differ"


def test_a_run_stage_decodes_the_artifact_its_train_stage_makes_under_the_calls_overrides(tmp_path):
    """Run stages pinned the scaling heads' names in full: a call with `training.loop.bf16_autocast=false` trained
    other heads than its run stages then decoded (the pinned ones, where an earlier call had made them).
    `method.head=@stageN` names what train stage N makes under the call's overrides."""
    from specrepro.reproduce import stage_command, with_trained
    from specrepro.training import artifact_path
    from tests.test_config import compose_run

    _, stages = load_pipeline("eagle_scaling")
    run = next(stage for stage in stages if "method.head=@stage6" in stage.get("run", []))
    assert "training=eagle_2000" in stages[5]["train"]
    for overrides in ([], ["training.loop.bf16_autocast=false", "hardware.threads=1"]):
        trains = stage_command(stages[5], tmp_path, tmp_path, overrides, "")
        made = artifact_path(compose_run(*trains[trains.index("train") + 1 :], config="train")).name
        resolved = with_trained(run, stages, tmp_path, overrides)["run"]
        assert f"method.head={made}" in resolved and "method.head=@stage6" not in resolved
        if not overrides:
            assert made == "eagle_head-smollm2_135m-2e89ec14"  # what the committed tables' runs decoded


@pytest.mark.parametrize(
    "text, message",
    [
        ("paper: x\n", "needs `paper`"),
        ("paper: x\nstages: [{train: [a=1], run: [b=2]}]\n", "exactly one of"),
        ("paper: x\nstages: [{train: [a=1], minutes: 5}]\n", "measured into stages.json, not set"),
        ("paper: x\nstages: [{table: [a]}]\n", "takes a table name"),
        ("paper: [\n", "not valid YAML"),
        ("paper: x\nstages: [{run: [a=1], committed_inputs: true}]\n", "but a table's committed_inputs"),
        ("paper: x\nstages: [{table: t, committed_inputs: yes please}]\n", "committed_inputs takes true or false"),
        ("paper: x\nstages: [{run: [a=1]}, {run: [m.head=@stage1]}]\n", "stage 2: @stage1 names no train stage before"),
        ("paper: x\nstages: [{run: [m.head=@stage2]}, {train: [a=1]}]\n", "stage 1: @stage2 names no train stage"),
        (
            "paper: x\nstages: [{table: t}]\nheadline: [{table: t, row: [a], column: c, claim: x, status: maybe}]\n",
            "bad.yaml: headline\\[0\\].status: expected one of reproduced, not reproduced, not testable here, "
            "got 'maybe'",
        ),
        (
            "paper: x\nstages: [{table: t}]\nheadline: [{table: t, row: [a], column: c, claim: x}]\n",
            "headline\\[0\\]: missing required key 'status'",
        ),
        (
            "paper: x\nstages: [{table: t}]\nheadline: [{table: t, row: [a], column: c, claim: x, status: reproduced, "
            "versus: {rwo: [b]}}]\n",
            "headline\\[0\\].versus: unknown key 'rwo' \\(did you mean 'row'\\?\\)",
        ),
    ],
)
def test_a_malformed_pipeline_is_one_line(tmp_path, text, message):
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(SpecReproError, match=message):
        load_pipeline(str(tmp_path / "bad.yaml"))


def test_a_table_stage_with_committed_inputs_also_reads_the_runs_committed_beside_its_table(tmp_path):
    """`committed_inputs: true`: a pipeline adding rows to another pipeline's table writes the whole table on a
    machine that holds only its own runs (here pld) and the other rows' committed inputs (ar); without it the ar
    row would be emptied."""
    from specrepro.reproduce import reproduce
    from tests.test_tables import KEEP_TABLE, _record

    results = tmp_path / "results"
    _record(results / "reproduce" / "two", "pld-run", "pld", 1.5)  # this pipeline's own run
    _record(results / "two", "ar-run", "ar", 1.0)  # the other pipeline's run, as committed beside the table
    (tmp_path / "two.yaml").write_text(KEEP_TABLE.replace("paper: keep", "paper: two"))
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    (pipelines / "adds.yaml").write_text(
        f"paper: two\nstages:\n  - {{table: {tmp_path / 'two.yaml'}, committed_inputs: true}}\n"
    )
    reproduce("adds", str(results), pipelines_dir=pipelines)
    md = (results / "two" / "two.md").read_text()
    assert "| ar | 1.00 | [1] |" in md and "| pld | 1.50 | [2] |" in md
    assert sorted(p.name for p in (results / "two" / "runs").iterdir()) == ["ar-run", "pld-run"]


def test_a_table_stage_whose_runs_fill_no_cell_fails_in_one_line(tmp_path):
    """Runs of other settings than the table selects (`specrepro reproduce specbench_small dataset.limit=2`: six
    runs decoded, the table selects the experiment's limit of 5) fail the table stage in one line, not a table of
    dashes saying "no run yet" and "done"."""
    from specrepro.reproduce import reproduce
    from tests.test_tables import KEEP_TABLE, _record

    results = tmp_path / "results"
    _record(results / "reproduce" / "two", "sps-run", "sps", 2.0)  # no row of the table selects it
    (tmp_path / "two.yaml").write_text(KEEP_TABLE.replace("paper: keep", "paper: two"))
    (tmp_path / "other.yaml").write_text(f"paper: two\nstages: [{{table: {tmp_path / 'two.yaml'}}}]\n")
    with pytest.raises(SpecReproError, match=r"two: stage 1 \(table .*two.yaml\): no run in .* fills a cell"):
        reproduce(str(tmp_path / "other.yaml"), str(results))


def test_a_pipeline_file_kept_elsewhere_adds_its_headlines_to_the_summary_and_keeps_every_other(tmp_path):
    """A pipeline file outside experiments/reproduce/ refreshes results/SUMMARY.md with its headlines beside every
    shipped pipeline's: not a page of its folder's alone (which wiped the shipped rows), and the folder's other
    YAML files are not read as pipelines."""
    from specrepro.reproduce import reproduce
    from tests.test_tables import KEEP_TABLE, _record

    results = tmp_path / "results"
    _record(results / "reproduce" / "two", "pld-run", "pld", 1.5)
    (tmp_path / "two.yaml").write_text(KEEP_TABLE.replace("paper: keep", "paper: two"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.yaml").write_text("")  # not a pipeline
    (mine / "adds.yaml").write_text(
        f"paper: two\nstages: [{{table: {tmp_path / 'two.yaml'}}}]\n"
        "headline: [{table: two, row: [pld], column: MAT, claim: pld is fast, status: reproduced}]\n"
    )
    reproduce(str(mine / "adds.yaml"), str(results))
    page = (results / SUMMARY_PAGE).read_text()
    assert "| two | pld is fast | reproduced | – | 1.50 |" in page
    assert "| cllm | CLLM + Jacobi decoding speeds up GSM8K | not reproduced |" in page  # a shipped pipeline's row


@pytest.mark.parametrize("paper", sorted(p.stem for p in PIPELINES_DIR.glob("*.yaml")))
def test_every_headline_names_a_row_and_column_of_its_table(paper):
    import yaml

    from specrepro.tables import TableSpec

    for item in yaml.safe_load((PIPELINES_DIR / f"{paper}.yaml").read_text()).get("headline", []):
        spec = TableSpec.load(item["table"])
        assert item["row"] in [list(row.label) for row in spec.rows], item
        assert item["column"] in [column.label for column in spec.columns], item
        if "versus" in item:  # the cell the claim compares with
            versus = TableSpec.load(item["versus"].get("table", item["table"]))
            assert item["versus"]["row"] in [list(row.label) for row in versus.rows], item
            assert item["versus"].get("column", item["column"]) in [column.label for column in versus.columns], item


@pytest.mark.slow  # reads every committed table's inputs
def test_the_committed_summary_is_the_one_the_committed_results_give(monkeypatch):
    """Every figure in results/SUMMARY.md is copied from a committed table by `specrepro summary`, never typed."""
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)  # the page names tables by their path under results/
    assert (root / "results" / SUMMARY_PAGE).read_text() == summary_page("results"), (
        "results/SUMMARY.md is stale: run `specrepro summary`"
    )


def test_every_link_on_the_committed_pages_names_a_file_of_the_repository():
    """README, docs and the results pages link tables and claims pages by relative path: none may dangle."""
    root = Path(__file__).resolve().parents[1]
    pages = [
        root / "README.md",
        *(root / "docs").glob("*.md"),
        *(p for p in (root / "results").rglob("*.md") if not {"runs", "reproduce"} & set(p.relative_to(root).parts)),
    ]
    dangling = [
        (page.relative_to(root).as_posix(), target)
        for page in pages
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text())
        if not re.match(r"[a-z]+:|#", target) and not (page.parent / target.split("#")[0]).exists()
    ]
    assert len(pages) > 10 and not dangling, dangling


def test_a_headline_says_where_its_own_cell_was_measured(tmp_path):
    """A table merging runs of two machines: a headline's "measured on" is the machine, commit and date of the run
    behind its cell, not the whole table's, and a claim comparing cells of two machines names both; a table without
    committed inputs falls back to its footer."""
    from specrepro.summary import cell_origin
    from specrepro.tables import write_table
    from tests.test_tables import _amend, _two_runs

    tables, records = _two_runs(tmp_path)
    out = tmp_path / "keep"
    for name, cpu, commit, day in (
        ("ar-run", "AMD EPYC", "a" * 40, "2026-01-01"),
        ("pld-run", "Intel Xeon", "b" * 40, "2026-01-02"),
    ):
        _amend(
            records,
            name,
            provenance={
                "machine": {"cpu": cpu, "cpu_cores": 2},
                "code": {"commit": commit},
                "finished_at": f"{day}T00:00:00+00:00",
            },
        )
    table = write_table("two", records, tables_dir=tables, out_dir=out).with_suffix(".csv")
    assert cell_origin(table, ["pld"], "MAT", tables) == (
        ["Intel Xeon, 2 cores"],
        "Intel Xeon, 2 cores; bbbbbbbbbb; 2026-01-02",
    )
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    headline = "{table: two, row: [pld], column: MAT, claim: pld beats ar, status: reproduced"
    (pipelines / "keep.yaml").write_text(
        f"paper: keep\nstages: [{{table: two}}]\nheadline:\n  - {headline}}}\n  - {headline}, versus: {{row: [ar]}}}}\n"
    )
    plain, versus = [
        line
        for line in summary_page(str(tmp_path), pipelines_dir=pipelines).splitlines()
        if line.startswith("| keep | pld beats ar | reproduced | – | 1.50 | Intel Xeon, 2 cores; ")
    ]
    assert "across machines" not in plain
    assert "; across machines: *pld* on Intel Xeon, 2 cores, *ar* on AMD EPYC, 2 cores |" in versus
    shutil.rmtree(out / "runs")
    assert cell_origin(table, ["pld"], "MAT", tables)[1] == (
        "AMD EPYC, 2 cores; Intel Xeon, 2 cores; aaaaaaaaaa, bbbbbbbbbb; 2026-01-01 to 2026-01-02"
    )


def test_summary_and_dry_run_meet_bad_files_in_one_line(tmp_path):
    """A missing results dir, a headline column no table has and a corrupt stages.json: one line each, no traceback."""
    from specrepro.reproduce import read_measured
    from specrepro.summary import headline_cells
    from specrepro.summary import main as summary_main

    with pytest.raises(SpecReproError, match="missing: no such results directory"):
        summary_main(["--results-dir", str(tmp_path / "missing")])
    (tmp_path / "a_file").write_text("")  # a page that cannot be written, for any user, root too
    with pytest.raises(SpecReproError, match="cannot write .*a_file/SUMMARY.md: .*--out PAGE writes it elsewhere"):
        summary_main(["--results-dir", str(tmp_path), "--out", str(tmp_path / "a_file" / "SUMMARY.md")])
    table = tmp_path / "t.csv"
    table.write_text("Method,MAT (here),runs\npld,1.50,run-1\n# Machine: m\n")
    assert headline_cells(table, ["pld"], "MAT") == ("–", "1.50")
    with pytest.raises(SpecReproError, match="t.csv: no column Speedup"):
        headline_cells(table, ["pld"], "Speedup")
    two = tmp_path / "two.csv"  # a headline naming fewer labels than the table's rows have is no one cell
    two.write_text("Method,Dataset,MAT (here),runs\nsps,gsm8k,1.05,a\nsps,xsum,1.62,b\n")
    assert headline_cells(two, ["sps", "xsum"], "MAT") == ("–", "1.62")
    with pytest.raises(SpecReproError, match="two.csv: 2 rows start sps: name every label of the row"):
        headline_cells(two, ["sps"], "MAT")
    with pytest.raises(SpecReproError, match="two.csv: no row gsm8k"):
        headline_cells(two, ["gsm8k"], "MAT")
    (tmp_path / "stages.json").write_text("{not json")
    assert read_measured(tmp_path / "stages.json") == {} and read_measured(tmp_path / "none.json") == {}


def test_a_smoke_call_keeps_its_minutes_apart_from_the_full_calls(tmp_path):
    """A call with overrides that size the work (`training.loop.steps=2`, `dataset.limit=1`) replaced the full call's
    minutes in stages.json, and --dry-run then estimated the full pipeline from the smoke call (1.24 min to 0.22);
    the threads and the logger change no work, so a call with them reads and writes the full call's figure."""
    from specrepro.reproduce import measured_as, record_minutes, total_time

    train, run = {"train": ["method=sps"]}, {"run": ["method=ar"]}
    path, plain = tmp_path / "stages.json", ["hardware.threads=1", "logger=none"]
    smoke = ["training.loop.steps=2", "dataset.limit=1", *plain]
    assert measured_as(train, plain) == "train method=sps" == measured_as(train, [])
    assert measured_as(train, smoke) == "train method=sps [training.loop.steps=2]"  # what reaches the stage
    assert measured_as(run, smoke) == "run method=ar [dataset.limit=1]"
    record_minutes(path, measured_as(train, plain), {"minutes": 1.24, "reused": []})
    record_minutes(path, measured_as(train, smoke), {"minutes": 0.22, "reused": []})
    measured = json.loads(path.read_text())
    assert total_time([train], measured).startswith("total over all 1 stages: about 1 min")
    assert measured[measured_as(train, smoke)]["minutes"] == 0.22
    assert "1 not timed yet" in total_time([train], measured, overrides=["training.loop.steps=3"])


def test_a_dry_runs_total_counts_every_stage_and_names_the_untimed():
    from specrepro.reproduce import describe, total_time

    stages = [{"train": ["method=sps"]}, {"run": ["method=ar"]}, {"run": ["method=pld"]}, {"table": "tiny_table"}]
    measured = {
        describe(stages[0]): {"minutes": 30.0, "reused": []},
        describe(stages[1]): {"minutes": 2.4, "reused": ["run x"]},
    }
    assert total_time(stages, measured) == (
        "total over all 4 stages: about 32 min for the 2 timed train and run stage(s) (1 timed while reusing what was "
        "made already: longer from nothing cached); 1 not timed yet (not counted); 1 table stage(s), under a "
        "minute each"
    )
    assert total_time(stages[2:], measured, len(stages)).startswith("total over the 2 chosen of 4 stages: about 0 min")
