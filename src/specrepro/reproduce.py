"""`specrepro reproduce <paper>|all`: train what a paper's tables need, run their sweeps, write the tables.

A paper's pipeline is a short explicit list of stages in `experiments/reproduce/<paper>.yaml`:

    paper: cllm
    stages:
      - {train: [method=cllm, training.stage=trajectories]}   # `specrepro train ...`
      - {run: [-m, +experiment=cllm_table1]}                  # `specrepro run ...`
      - {table: cllm_table1}                                  # `specrepro table ...`
      - {table: cllm_table1, committed_inputs: true}          # ... also reading results/<paper>/runs/

Every run stage records its runs in `<results dir>/reproduce/<paper>/` (one machine, one pipeline), and the tables
go to `<results dir>/<paper>/`. Trained components go to `<results dir>/reproduce/artifacts/`, shared by every
pipeline: an artifact's name carries the hash of its model and training config, so a component two pipelines train
alike (the sps draft of eesd and spec_bench, the SAR heads of sar and eesd) is trained once, and a later pipeline's
stage reuses it (and the data caches it made), "reused" in stages.json (`--dry-run --check-done` names each train
stage's artifact that is made already, and says how many of each run stage's runs are done under their current
names, or which artifact they wait for); what a pipeline trained into its own `<paper>/artifacts/` before is moved
there on its next call. Each stage is resumable on its own (a finished artifact or run is reused, an interrupted one
resumes), so a killed pipeline picks up where it stopped when called again. What each stage took is measured,
not configured: every call records it in
`<results dir>/<paper>/stages.json` beside the tables (minutes, machine, commit, date, command), and `--dry-run`
(which reads only the pipeline, its table specs and stages.json: seconds, no torch) shows it as the stage's expected
time and sums it in one total over every stage. A stage that found something already made (`reuse.py`) is kept there
only where no measurement of that stage exists yet. `--stages 2-3,9` runs only those stages: two lanes of one machine
(or two machines sharing the results dir) each take stages that do not need the other's, with the pipeline's exact
overrides. A table stage with `committed_inputs: true` also reads the inputs committed beside the table
(`results/<paper>/runs/`): a pipeline that adds rows to another pipeline's table (cllm_long to cllm's) then writes the
whole table on a machine that did not run the other one; where both hold a run of one name, the one that finished later
takes its cell. A run stage names an artifact its pipeline trains by the train stage (`method.head=@stage6`): the
stage decodes the artifact that stage makes under the call's overrides, named in full."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Annotated

import yaml

from specrepro.config import results_directory
from specrepro.errors import SpecReproError, one_line
from specrepro.locks import all_free, file_lock, lock_file
from specrepro.provenance import checkout_version, device_description, machine_label, now
from specrepro.reuse import REUSE_LOG
from specrepro.tracking import atomic_write
from specrepro.yaml_schema import Invalid, Label, Labels, build, items, one_of

PIPELINES_DIR = Path(files("specrepro.pipelines"))  # experiments/reproduce/ in a source checkout
STAGE_KINDS = ("train", "run", "table")
TABLE_OPTIONS = ("committed_inputs",)  # what a table stage may set beside its table name
SHARED_ARTIFACTS = "artifacts"  # <results dir>/reproduce/artifacts/: the trained components of every pipeline


def load_pipeline(name: str, pipelines_dir: Path = PIPELINES_DIR) -> tuple[str, list[dict]]:
    """(paper, stages) of a pipeline name or spec file path, checked: one line naming what is wrong."""
    path = Path(name) if name.endswith(".yaml") else pipelines_dir / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in pipelines_dir.glob("*.yaml")))
        raise SpecReproError(f"no reproduce pipeline '{name}' (known: {known}, all)")
    try:
        spec = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SpecReproError(f"{path}: not valid YAML ({one_line(exc)})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("paper"), str) or not isinstance(spec.get("stages"), list):
        raise SpecReproError(f"{path}: needs `paper` (a name) and `stages` (a list)")
    if spec["paper"] == SHARED_ARTIFACTS:
        raise SpecReproError(
            f"{path}: paper '{SHARED_ARTIFACTS}' would share its folder with every pipeline's artifacts"
        )
    for i, stage in enumerate(spec["stages"]):
        kinds = [k for k in STAGE_KINDS if k in (stage if isinstance(stage, dict) else {})]
        options = set(TABLE_OPTIONS) if kinds == ["table"] else set()
        if len(kinds) != 1 or set(stage) - set(STAGE_KINDS) - options:
            raise SpecReproError(
                f"{path}: stage {i + 1} must have exactly one of {', '.join(STAGE_KINDS)} and nothing "
                f"else but a table's {', '.join(TABLE_OPTIONS)} (its minutes are measured into "
                "stages.json, not set)"
            )
        value = stage[kinds[0]]
        if not (isinstance(value, str) if kinds[0] == "table" else isinstance(value, list)):
            raise SpecReproError(
                f"{path}: stage {i + 1}: {kinds[0]} takes "
                f"{'a table name' if kinds[0] == 'table' else 'a list of overrides'}"
            )
        if not isinstance(stage.get("committed_inputs", False), bool):
            raise SpecReproError(f"{path}: stage {i + 1}: committed_inputs takes true or false")
        for source in trained_in(stage):
            if not (1 <= source <= i and "train" in spec["stages"][source - 1]):
                raise SpecReproError(f"{path}: stage {i + 1}: @stage{source} names no train stage before it")
    read_headlines(path, spec)
    return spec["paper"], spec["stages"]


STATUSES = ("reproduced", "not reproduced", "not testable here")


@dataclass
class Versus:
    """The cell a headline's claim compares its own with: `row` of the headline's table (or of `table`), in its
    column (or `column`)."""

    row: Labels
    table: str | None = None
    column: Label | None = None


@dataclass
class Headline:
    """A row of results/SUMMARY.md: a cell of a committed table, the claim it bears on, and a person's judgment of
    that claim here (`status`, as the paper's claims page, results/<paper>/README.md, argues it): not measured."""

    table: str
    row: Labels
    column: Label
    claim: str
    status: Annotated[str, one_of(*STATUSES)]
    versus: Versus | None = None  # the cell the claim compares with: the page names the machine of each


def read_headlines(path: Path, spec: dict) -> list[Headline]:
    """A pipeline's `headline` entries, checked against `Headline`: one line naming the entry and what is wrong."""
    try:
        return [
            build(Headline, item, f"headline[{i}]")
            for i, item in enumerate(items(spec["headline"], "headline") if "headline" in spec else [])
        ]
    except Invalid as exc:
        raise SpecReproError(f"{path}: {exc}") from None


def check_tables(stages: list[dict]) -> None:
    """Every table stage's spec loads, before any stage runs: a table named wrong fails in one line now, not
    after hours of training and decoding (and `--dry-run` finds it)."""
    from specrepro.tables import TableSpec  # matplotlib, not torch: a dry run stays seconds

    for i, stage in enumerate(stages, 1):
        if "table" in stage:
            try:
                TableSpec.load(stage["table"])
            except SpecReproError as exc:
                raise SpecReproError(f"stage {i} ({describe(stage)}): {exc}") from None


def describe(stage: dict) -> str:
    kind = next(k for k in STAGE_KINDS if k in stage)
    if kind == "table":
        return f"table {stage['table']}{' (with its committed inputs)' if stage.get('committed_inputs') else ''}"
    return f"{kind} {' '.join(map(str, stage[kind]))}"


TRAINED_BY = re.compile(r"@stage(\d+)")  # a run stage's `key=@stageN`: the artifact train stage N makes


def trained_in(stage: dict) -> list[int]:
    """The train stages (1-based) whose artifacts a run stage's arguments name by `key=@stageN`."""
    found = (TRAINED_BY.fullmatch(str(arg).partition("=")[2]) for arg in stage.get("run", []))
    return [int(match.group(1)) for match in found if match]


def with_trained(stage: dict, stages: list[dict], work_dir: Path, overrides: list[str]) -> dict:
    """The run stage with each `key=@stageN` made `key=<name in full of the artifact train stage N makes>` under this
    call's overrides: a run decodes what its pipeline just trained, where a name pinned in the file names what its
    own settings train (not what `training.loop.bf16_autocast=false` given to the call trains)."""

    def resolved(arg):
        key, _, value = str(arg).partition("=")
        if not (match := TRAINED_BY.fullmatch(value)):
            return arg
        return f"{key}={trained_artifact(stages[int(match.group(1)) - 1], work_dir, overrides).name}"

    return {"run": [resolved(arg) for arg in stage["run"]]} if trained_in(stage) else stage


UNSIZED = ("hardware.threads", "logger")  # overrides that leave a stage's work as it is


def measured_as(stage: dict, overrides: list[str]) -> str:
    """The `stages.json` key of a train or run stage's minutes: its description and the overrides it takes that
    change its work (`dataset.limit=2`, `training.loop.steps=2`), so that a smoke call keeps the full one's figure."""
    kind = "train" if "train" in stage else "run"
    sized = [o for o in stage_overrides(kind, overrides) if not o.lstrip("+~").startswith(UNSIZED)]
    return f"{describe(stage)} [{' '.join(sized)}]" if sized else describe(stage)


def stage_command(stage: dict, work_dir: Path, out_dir: Path, overrides: list[str], paper_command: str) -> list[str]:
    """The `specrepro ...` command line of one stage, run in a process of its own: its runs in `work_dir`, the
    artifacts it trains or loads in the pipelines' shared folder beside it."""
    cli = [sys.executable, "-m", "specrepro.cli"]
    if "table" in stage:
        committed = stage.get("committed_inputs") and (out_dir / "runs").is_dir()
        committed = ["--results-dir", str(out_dir)] if committed else []
        return [
            *cli,
            "table",
            stage["table"],
            "--results-dir",
            str(work_dir),
            *committed,
            "--out-dir",
            str(out_dir),
            "--command",
            paper_command,
        ]
    kind = "train" if "train" in stage else "run"
    return [
        *cli,
        kind,
        *map(str, stage[kind]),
        f"results_dir={work_dir}",
        f"artifacts_dir={work_dir.parent / SHARED_ARTIFACTS}",
        *stage_overrides(kind, overrides),
    ]


def stage_overrides(kind: str, overrides: list[str]) -> list[str]:
    """The pipeline's overrides a `kind` stage takes: those of a setting only the other kind has are left out
    (`dataset.limit=2` reaches run stages, `training.loop.steps=10` train stages), the rest (model, hardware, a
    Hydra or `+experiment` override) reach both."""
    from specrepro.config import RunConfig, TrainRunConfig

    own, other = (RunConfig, TrainRunConfig) if kind == "run" else (TrainRunConfig, RunConfig)
    own_keys, other_keys = ({field.name for field in fields(schema)} for schema in (own, other))

    def key(override: str) -> str:
        return override.split("=", 1)[0].lstrip("+~").split(".", 1)[0]

    return [o for o in overrides if key(o) in own_keys or key(o) not in other_keys]


def regenerating_command(name: str, results_dir: str | Path, overrides, *options: str) -> str:
    """The `specrepro reproduce` call that makes a pipeline's results again, quoted for a shell: its results
    directory where it is not the default, then `options` and the overrides."""
    where = [] if str(results_dir) == "results" else ["--results-dir", str(results_dir)]
    return shlex.join(["specrepro", "reproduce", name, *where, *options, *overrides])


def read_measured(path: Path) -> dict:
    """Each stage's measurement in `stages.json` (by its description); {} when there is none or it is unreadable
    (then rewritten as the stages run again)."""
    try:
        measured = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        print(f"ignoring {path}: {one_line(exc)}", file=sys.stderr)
        return {}
    return measured if isinstance(measured, dict) else {}


def parse_stages(spec: str, count: int) -> set[int]:
    """The stage numbers `2-3,9` names, each between 1 and `count`; one line naming what is wrong."""
    chosen = set()
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or not (last or first).isdigit():
            raise SpecReproError(f"--stages {spec}: takes stage numbers and ranges, e.g. 2-3,9")
        if int(last or first) < int(first):
            raise SpecReproError(f"--stages {spec}: a range goes from the lower stage up ({last}-{first})")
        chosen.update(range(int(first), int(last or first) + 1))
    if not chosen or min(chosen) < 1 or max(chosen) > count:
        raise SpecReproError(f"--stages {spec}: this pipeline has stages 1-{count}")
    return chosen


def record_minutes(path: Path, stage: str, measurement: dict) -> bool:
    """Put one stage's measurement in `stages.json`, re-read under its lock (lanes running other stages write it
    too), unless it reused something and the stage has a measurement already; whether it was put."""
    with file_lock(lock_file(path), path.name):
        measured = read_measured(path)
        if measurement.get("reused") and stage in measured:
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(measured | {stage: measurement}, indent=2) + "\n")
        return True


def is_measured(measurement) -> bool:
    """Whether a `stages.json` entry holds a stage's minutes (a hand-edited or older file may not)."""
    return isinstance(measurement, dict) and isinstance(measurement.get("minutes"), (int, float))


def expected_time(measurement: dict | None) -> str:
    """How long a stage took where it was measured, for --dry-run and the progress lines."""
    if not is_measured(measurement):
        return "not timed yet"
    reused = measurement.get("reused") or []
    made = f" with {len(reused)} thing{'s' if len(reused) > 1 else ''} already made" if reused else ""
    commit = (measurement.get("commit") or "unknown")[:7] + ("+changes" if measurement.get("dirty") else "")
    return (
        f"{'' if reused else 'about '}{measurement['minutes']:.1f} min{made}: {measurement.get('machine')}, "
        f"{str(measurement.get('date'))[:10]}, commit {commit}"
    )


def total_time(stages: list[dict], measured: dict, pipeline_stages: int | None = None, overrides=()) -> str:
    """One total over every stage of a pipeline (or the `stages` chosen of its `pipeline_stages`): the minutes each
    train and run stage took where it was measured with these `overrides` (those measured while finding things
    already made took less than they would from nothing cached), and how many stages are not timed yet or are
    tables (under a minute each)."""
    timed = [measured.get(measured_as(stage, list(overrides))) for stage in stages if "table" not in stage]
    minutes = [m["minutes"] for m in timed if is_measured(m)]
    reused = sum(1 for m in timed if is_measured(m) and m.get("reused"))
    untimed = len(timed) - len(minutes)
    tables = len(stages) - len(timed)
    parts = [
        f"about {sum(minutes):.0f} min for the {len(minutes)} timed train and run stage(s)"
        + (f" ({reused} timed while reusing what was made already: longer from nothing cached)" if reused else ""),
        f"{untimed} not timed yet" + (" (not counted)" if untimed else ""),
        f"{tables} table stage(s), under a minute each",
    ]
    chosen = (
        f"the {len(stages)} chosen of {pipeline_stages}"
        if (pipeline_stages or len(stages)) != len(stages)
        else f"all {len(stages)}"
    )
    return f"total over {chosen} stages: " + "; ".join(parts)


def stage_device() -> str | None:
    """The GPU a stage's process uses when this machine has one (`hardware.device: auto`), for its machine label."""
    import torch

    return "cuda" if torch.cuda.is_available() else None


def adopt_earlier_artifacts(old: Path, shared: Path) -> int:
    """Move what a pipeline trained into its own `<work dir>/artifacts/` (before pipelines shared one folder) into
    `shared`, so it is reused, not trained again: each artifact and data cache not there yet. Nothing moves while
    a process holds one of the old folder's locks (a lane of an older checkout still training). How many moved."""
    if not old.is_dir():
        return 0
    with all_free([*old.glob(".*.lock"), *old.glob(".work/.*.lock")]) as free:
        if not free:
            print(f"{old} is in use by another process: its artifacts move to {shared} on a later call")
            return 0
        moved = 0
        for entry in sorted([*old.iterdir(), *old.glob(".work/*")]):
            target = shared / entry.relative_to(old)
            if entry.name.endswith(".lock") or entry.name == ".work" or target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            entry.rename(target)
            moved += 1
        left = [p for p in old.rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    if moved:
        print(f"moved {moved} artifacts and caches from {old} to {shared}, the folder every pipeline shares")
    if left:
        print(f"{old} keeps {len(left)} files of artifacts and caches {shared} already has: delete them once unneeded")
    else:
        shutil.rmtree(old)
    return moved


@cache
def schemas_registered() -> None:
    """Hydra's ConfigStore holds the schemas (once a process: a dry run composes every stage's runs)."""
    from specrepro.config import register_configs

    register_configs()


def composed(stage: dict, config_name: str, overrides: list[list[str]], hydra_node: bool = False):
    """Each override list composed as the stage's process composes it (Hydra's `config_name`; `hydra_node`: with
    the `hydra` node, unresolved); one line naming the stage when one does not compose."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from specrepro.cli import CONF_DIR

    schemas_registered()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return [
                compose(config_name=config_name, overrides=job, return_hydra_config=hydra_node) for job in overrides
            ]
    except (HydraException, OmegaConfBaseException) as exc:
        raise SpecReproError(f"{describe(stage)}: {one_line(exc)}") from None


def trained_artifact(stage: dict, work_dir: Path, overrides: list[str]) -> Path:
    """Where a train stage publishes its artifact under these overrides (`training.artifact_path`)."""
    from specrepro.training import artifact_path

    command = stage_command(stage, work_dir, work_dir, overrides, "")
    [cfg] = composed(stage, "train", [command[command.index("train") + 1 :]])
    return artifact_path(cfg)


def made_already(stage: dict, work_dir: Path, overrides: list[str]) -> str | None:
    """The artifact a train stage makes, when a complete one is in the shared folder (its stage will reuse it)."""
    from specrepro.training.artifacts import is_complete

    try:
        path = trained_artifact(stage, work_dir, overrides)
    except SpecReproError:  # what it trains from is not made yet (an earlier stage collects it): nor is it
        return None
    return path.name if is_complete(path) else None


def runs_done(stage: dict, work_dir: Path, overrides: list[str]) -> str:
    """How many of a run stage's runs (its sweep points, as Hydra's basic sweeper expands them: the experiment's
    `hydra.sweeper.params`, then the command line's) have a complete record under their current name in
    `work_dir`, and how many others have one decoded by other code (to be decoded anew), or what they wait for (an
    artifact not trained yet)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from specrepro.data import load_records
    from specrepro.identity import records_fingerprint, run_name, setting_key
    from specrepro.reference import decoded_by_other_code
    from specrepro.tracking import RunRecord

    command = stage_command(stage, work_dir, work_dir, overrides, "")
    arguments = [arg for arg in command[command.index("run") + 1 :] if arg != "-m"]
    parser = OverridesParser.create()
    fixed = [o.input_line for o in parser.parse_overrides(arguments) if not o.is_sweep_override()]
    [base] = composed(stage, "run", [fixed], hydra_node=True)
    params = [f"{key}={value}" for key, value in (base.hydra.sweeper.get("params") or {}).items()]
    [jobs] = BasicSweeper.split_arguments(parser.parse_overrides(params + arguments), None)
    done = superseded = 0
    for cfg in composed(stage, "run", jobs):
        try:
            data = records_fingerprint(load_records(cfg.dataset))
            name = run_name(cfg, data)
        except SpecReproError as exc:  # an artifact it loads is not trained yet (by an earlier stage)
            return f"{len(jobs)} run(s), not startable yet: {one_line(exc).split(' under ')[0]}"
        record = RunRecord(work_dir / "runs" / name)
        complete = record.complete and record.damage() is None  # a cut record is decoded again: not done
        done += complete
        superseded += not complete and bool(decoded_by_other_code(work_dir, setting_key(cfg, data), name))
    other_code = f" ({superseded} more decoded by other code: decoded anew)" if superseded else ""
    return f"{done} of {len(jobs)} run(s) done{other_code}"


def names_a_run(csv_path: Path) -> bool:
    """Whether a table's CSV names a run behind one of its cells (none: a table of dashes)."""
    from specrepro.plots import table_rows  # matplotlib: not imported by a dry run

    header, *body = table_rows(csv_path.read_text())
    return any(row[header.index("runs")] for row in body)


def run_stage(command: list[str], work_dir: Path) -> tuple[int, float, list[str]]:
    """Run one stage's process: its exit status, minutes, and what it reported reusing (`reuse.py`)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("r", dir=work_dir, prefix=".reused-", suffix=".txt") as reused:
        start = time.monotonic()
        proc = subprocess.run(command, env={**os.environ, REUSE_LOG: reused.name})
        minutes = round((time.monotonic() - start) / 60, 2)
        return proc.returncode, minutes, sorted(set(reused.read().splitlines()))


def reproduce(
    name: str,
    results_dir: str = "results",
    overrides: list[str] = (),
    dry_run: bool = False,
    pipelines_dir: Path = PIPELINES_DIR,
    only: str | None = None,
    check_done: bool = False,
) -> None:
    """Run (or, with dry_run, list) every stage of one paper's pipeline, or the stage numbers `only` names. A dry
    run reads only the pipeline, its table specs and its stages.json (no torch: seconds); `check_done` adds what
    each train and run stage has made already, which composes and names every run (its code: the method modules,
    torch)."""
    paper, stages = load_pipeline(name, pipelines_dir)
    check_tables(stages)
    chosen = parse_stages(only, len(stages)) if only else set(range(1, len(stages) + 1))
    work_dir, out_dir = Path(results_dir) / "reproduce" / paper, Path(results_dir) / paper
    shared = work_dir.parent / SHARED_ARTIFACTS
    paper_command = regenerating_command(name, results_dir, overrides)
    measured_path = out_dir / "stages.json"
    measured = read_measured(measured_path)
    print(f"{paper}: {len(stages)} stages; runs in {work_dir}, artifacts in {shared}, tables in {out_dir}")
    print(
        f"{total_time([stage for i, stage in enumerate(stages, 1) if i in chosen], measured, len(stages), overrides)} "
        f"({measured_path})"
    )
    if not dry_run:
        adopt_earlier_artifacts(work_dir / "artifacts", shared)
    for i, stage in enumerate(stages, 1):
        if i not in chosen:
            continue
        key = None if "table" in stage else measured_as(stage, list(overrides))
        expected = "under a minute" if key is None else expected_time(measured.get(key))
        if check_done and "train" in stage and (made := made_already(stage, work_dir, list(overrides))):
            expected += f"; made already: {made}"
        # a run stage's `@stageN` arguments named as this call trains them (not in a plain dry run: that needs torch)
        resolving = "run" in stage and (check_done or not dry_run)
        resolved = with_trained(stage, stages, work_dir, list(overrides)) if resolving else stage
        if check_done and "run" in stage:
            expected += f"; {runs_done(resolved, work_dir, list(overrides))}"
        print(f"[{i}/{len(stages)}] {describe(stage)} ({expected})", flush=True)
        if dry_run:
            continue
        version = checkout_version()  # as the stage starts: a lane outlives a `git pull` beside it
        returncode, minutes, reused = run_stage(
            stage_command(resolved, work_dir, out_dir, list(overrides), paper_command), work_dir
        )
        if returncode != 0:
            raise SpecReproError(
                f"{paper}: stage {i} ({describe(stage)}) failed with exit status {returncode}; "
                f"run `specrepro reproduce {name}` again to resume from it"
            )
        if "table" in stage and not names_a_run(out_dir / f"{Path(stage['table']).stem}.csv"):
            raise SpecReproError(
                f"{paper}: stage {i} ({describe(stage)}): no run in {work_dir} fills a cell of its table (the runs "
                "there have other settings than it selects: an override of one, such as dataset.limit?)"
            )
        kept_earlier = key is not None and not record_minutes(
            measured_path,
            key,
            {
                "minutes": minutes,
                "reused": reused,
                "machine": machine_label(device_description(stage_device())),
                "commit": version["commit"],
                "dirty": version["dirty"],
                "date": now(),
                "command": regenerating_command(name, results_dir, overrides, "--stages", str(i)),
            },
        )
        print(
            f"[{i}/{len(stages)}] done in {minutes:.1f} min"
            f"{f', found already made: {len(reused)}' if reused else ''}"
            f"{f' (the estimate in {measured_path} stays the earlier one)' if kept_earlier else ''}",
            flush=True,
        )
        if "table" in stage:  # the headlines (of every pipeline, and of this one's file) follow the tables
            from specrepro.summary import SUMMARY_PAGE, summary_page  # the table code: not imported by a dry run

            pipeline_file = Path(name) if name.endswith(".yaml") else None
            atomic_write(
                Path(results_dir) / SUMMARY_PAGE, summary_page(results_dir, None, pipelines_dir, pipeline_file)
            )


def main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="specrepro reproduce", description="Train, run and tabulate one paper (or all) from nothing cached."
    )
    parser.add_argument("paper", help=f"a pipeline in {PIPELINES_DIR} (without .yaml), a pipeline file, or all")
    parser.add_argument(
        "overrides",
        nargs="*",
        default=[],
        help="Hydra overrides added to every train and run stage whose config has their setting "
        "(dataset.limit=2: run stages only; training.loop.steps=10: train stages only)",
    )
    parser.add_argument(
        "--results-dir",
        default="results",
        type=results_directory,
        help="runs under <dir>/reproduce/<paper>, artifacts under "
        "<dir>/reproduce/artifacts, "
        "tables under <dir>/<paper>",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="list the stages and their expected time (--check-done: what is made already); run nothing",
    )
    parser.add_argument(
        "--check-done",
        action="store_true",
        help="with --dry-run: also say which artifacts are made and how many runs are done (composes "
        "and names every run: a minute or more)",
    )
    parser.add_argument("--stages", default=None, help="only these stage numbers, e.g. 2-3,9 (see --dry-run)")
    opts = parser.parse_intermixed_args(args)  # options before or after the overrides
    if opts.stages and opts.paper == "all":
        raise SpecReproError("--stages picks stages of one pipeline, not of all")
    if opts.check_done and not opts.dry_run:
        raise SpecReproError("--check-done goes with --dry-run (a run finds what is done as it goes)")
    if opts.paper != "all":
        reproduce(
            opts.paper, opts.results_dir, opts.overrides, opts.dry_run, only=opts.stages, check_done=opts.check_done
        )
        return
    failed = []  # a failed pipeline does not stop the others: each resumes on its own
    names = sorted(p.stem for p in PIPELINES_DIR.glob("*.yaml"))
    for name in names:
        try:
            reproduce(name, opts.results_dir, opts.overrides, opts.dry_run, check_done=opts.check_done)
        except SpecReproError as exc:
            print(f"specrepro: error: {one_line(exc)}", file=sys.stderr, flush=True)
            failed.append(name)
    if failed:
        raise SpecReproError(
            f"{len(failed)} of {len(names)} pipelines failed ({', '.join(failed)}); the others ran: "
            "`specrepro reproduce <pipeline>` resumes each"
        )
