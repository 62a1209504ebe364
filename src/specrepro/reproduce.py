"""`specrepro reproduce <paper>|all`: train what a paper's tables need, run their sweeps, write the tables.

A paper's pipeline is a short explicit list of stages in `experiments/reproduce/<paper>.yaml`:

    paper: cllm
    stages:
      - {train: [method=cllm, training.stage=trajectories], minutes: 16}   # `specrepro train ...`
      - {run: [-m, +experiment=cllm_table1], minutes: 10}                  # `specrepro run ...`
      - {table: cllm_table1}                                               # `specrepro table ...`

Every train and run stage works in `<results dir>/reproduce/<paper>/` (its runs and artifacts: one machine, one
pipeline), and the tables go to `<results dir>/<paper>/`. Each stage is resumable on its own (a finished
artifact or run is reused, an interrupted one resumes), so a killed pipeline picks up where it stopped when
called again. `minutes` is the stage's measured time on a 2-core CPU; each call records what it measured in
`<work dir>/stages.json`. `--stages 2-3,9` runs only those stages: two lanes of one machine (or two machines
sharing the results dir) each take stages that do not need the other's, with the pipeline's exact overrides.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from importlib.resources import files
from pathlib import Path

import yaml

from specrepro.errors import SpecReproError, one_line
from specrepro.plots import table_rows
from specrepro.tables import MISSING_CELL
from specrepro.tracking import atomic_write
from specrepro.training.shards import exclusive, lock_file

PIPELINES_DIR = Path(files("specrepro.pipelines"))  # experiments/reproduce/ in a source checkout
STAGE_KINDS = ("train", "run", "table")


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
    for i, stage in enumerate(spec["stages"]):
        kinds = [k for k in STAGE_KINDS if k in (stage if isinstance(stage, dict) else {})]
        if len(kinds) != 1 or set(stage) - {*STAGE_KINDS, "minutes"}:
            raise SpecReproError(f"{path}: stage {i + 1} must have exactly one of {', '.join(STAGE_KINDS)} (and minutes)")
        value = stage[kinds[0]]
        if not (isinstance(value, str) if kinds[0] == "table" else isinstance(value, list)):
            raise SpecReproError(f"{path}: stage {i + 1}: {kinds[0]} takes {'a table name' if kinds[0] == 'table' else 'a list of overrides'}")
    return spec["paper"], spec["stages"]


def describe(stage: dict) -> str:
    kind = next(k for k in STAGE_KINDS if k in stage)
    return f"{kind} {stage[kind]}" if kind == "table" else f"{kind} {' '.join(map(str, stage[kind]))}"


def stage_command(stage: dict, work_dir: Path, out_dir: Path, overrides: list[str], paper_command: str) -> list[str]:
    """The `specrepro ...` command line of one stage, run in a process of its own."""
    cli = [sys.executable, "-m", "specrepro.cli"]
    if "table" in stage:
        return [*cli, "table", stage["table"], "--results-dir", str(work_dir), "--out-dir", str(out_dir),
                "--command", paper_command]
    kind = "train" if "train" in stage else "run"
    return [*cli, kind, *map(str, stage[kind]), f"results_dir={work_dir}", *overrides]


def read_measured(path: Path) -> dict:
    """Each stage's minutes in the work dir's last call (`stages.json`); {} when there is none or it is unreadable
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
        chosen.update(range(int(first), int(last or first) + 1))
    if not chosen or min(chosen) < 1 or max(chosen) > count:
        raise SpecReproError(f"--stages {spec}: this pipeline has stages 1-{count}")
    return chosen


def record_minutes(path: Path, stage: str, minutes: float) -> None:
    """Add one stage's minutes to `stages.json`, re-read under its lock: lanes running other stages write it too."""
    with exclusive(lock_file(path), path.name):
        measured = read_measured(path) | {stage: minutes}
        atomic_write(path, json.dumps(measured, indent=2) + "\n")


def reproduce(name: str, results_dir: str = "results", overrides: list[str] = (), dry_run: bool = False,
              pipelines_dir: Path = PIPELINES_DIR, only: str | None = None) -> None:
    """Run (or, with dry_run, list) every stage of one paper's pipeline, or the stage numbers `only` names."""
    paper, stages = load_pipeline(name, pipelines_dir)
    chosen = parse_stages(only, len(stages)) if only else set(range(1, len(stages) + 1))
    work_dir, out_dir = Path(results_dir) / "reproduce" / paper, Path(results_dir) / paper
    paper_command = " ".join(["specrepro reproduce", name, *overrides])
    measured_path = work_dir / "stages.json"
    measured = read_measured(measured_path)
    total = sum(stage.get("minutes", 0) for stage in stages)
    untimed = sum("minutes" not in stage and "table" not in stage for stage in stages)
    print(f"{paper}: {len(stages)} stages, about {total} min on a 2-core CPU from nothing cached"
          f"{f' plus {untimed} stages not timed yet' if untimed else ''} "
          f"(runs and artifacts in {work_dir}, tables in {out_dir})")
    for i, stage in enumerate(stages, 1):
        if i not in chosen:
            continue
        expected = (f"about {stage['minutes']} min" if "minutes" in stage
                    else "under a minute" if "table" in stage else "not timed yet")
        if describe(stage) in measured:
            expected += f"; {measured[describe(stage)]:.1f} min in this directory's last call"
        print(f"[{i}/{len(stages)}] {describe(stage)} ({expected})", flush=True)
        if dry_run:
            continue
        start = time.monotonic()
        proc = subprocess.run(stage_command(stage, work_dir, out_dir, list(overrides), paper_command))
        if proc.returncode != 0:
            raise SpecReproError(f"{paper}: stage {i} ({describe(stage)}) failed with exit status {proc.returncode}; "
                                 f"run `specrepro reproduce {name}` again to resume from it")
        minutes = round((time.monotonic() - start) / 60, 2)
        record_minutes(measured_path, describe(stage), minutes)
        print(f"[{i}/{len(stages)}] done in {minutes:.1f} min", flush=True)


def summary_main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="specrepro summary",
                                     description="Copy each pipeline's headline cells from the committed tables.")
    parser.add_argument("--results-dir", default="results", help="where the tables are (<dir>/<paper>/<table>.csv)")
    parser.add_argument("--readme", default=None, help="also rewrite this file's summary block (e.g. README.md)")
    opts = parser.parse_args(args)
    print(summary_table(opts.results_dir))
    if opts.readme:
        write_summary(Path(opts.readme), opts.results_dir)


def main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="specrepro reproduce",
                                     description="Train, run and tabulate one paper (or all) from nothing cached.")
    parser.add_argument("paper", help=f"a pipeline in {PIPELINES_DIR} (without .yaml), a pipeline file, or all")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides added to every train and run stage")
    parser.add_argument("--results-dir", default="results", help="runs and artifacts under <dir>/reproduce/<paper>, "
                                                                 "tables under <dir>/<paper>")
    parser.add_argument("--dry-run", action="store_true", help="list the stages and their expected time, run nothing")
    parser.add_argument("--stages", default=None, help="only these stage numbers, e.g. 2-3,9 (see --dry-run)")
    opts = parser.parse_intermixed_args(args)  # options before or after the overrides
    if opts.stages and opts.paper == "all":
        raise SpecReproError("--stages picks stages of one pipeline, not of all")
    names = sorted(p.stem for p in PIPELINES_DIR.glob("*.yaml")) if opts.paper == "all" else [opts.paper]
    for name in names:
        reproduce(name, opts.results_dir, opts.overrides, opts.dry_run, only=opts.stages)


README_START, README_END = "<!-- summary: made by `specrepro summary` -->", "<!-- end of summary -->"


def headline_cells(table_csv: Path, row: list[str], column: str) -> tuple[str, str]:
    """The (paper, here) cells of one row and column of a committed table's CSV (paper: MISSING_CELL in a table
    without paper columns)."""
    header, *body = table_rows(table_csv.read_text())
    if f"{column} (here)" not in header:
        raise SpecReproError(f"{table_csv}: no column {column}")
    for cells in body:
        if cells[: len(row)] == row:
            paper = f"{column} (paper)"
            return (cells[header.index(paper)] if paper in header else MISSING_CELL), cells[header.index(f"{column} (here)")]
    raise SpecReproError(f"{table_csv}: no row {' / '.join(row)}")


def summary_table(results_dir: str = "results", pipelines_dir: Path = PIPELINES_DIR) -> str:
    """One markdown row per pipeline headline, its cells copied from the committed tables under `results_dir`."""
    lines = ["| paper | claim | paper | here | table |", "|---|---|---|---|---|"]
    for path in sorted(pipelines_dir.glob("*.yaml")):
        spec = yaml.safe_load(path.read_text())
        for item in spec.get("headline", []):
            table = Path(results_dir) / spec["paper"] / f"{item['table']}.csv"
            if table.is_file():
                paper, here = headline_cells(table, item["row"], item["column"])
                link = f"[{item['table']}]({table.with_suffix('.md').as_posix()})"
            else:
                paper, here, link = "", "not regenerated yet", f"`specrepro reproduce {path.stem}`"
            lines.append(f"| {spec['paper']} | {item['claim']} | {paper} | {here} | {link} |")
    return "\n".join(lines)


def write_summary(readme: Path, results_dir: str = "results", pipelines_dir: Path = PIPELINES_DIR) -> None:
    """Replace the summary block of `readme` with the headline cells of the committed tables."""
    if not readme.is_file():
        raise SpecReproError(f"{readme}: no such file")
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        raise SpecReproError(f"{readme} has no summary block ({README_START} ... {README_END})")
    head, rest = text.split(README_START, 1)
    tail = rest.split(README_END, 1)[1]
    readme.write_text(f"{head}{README_START}\n{summary_table(results_dir, pipelines_dir)}\n{README_END}{tail}")
