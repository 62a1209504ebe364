"""`specrepro table NAME`: regenerate a paper's table from run records, "paper" and "here" side by side.

A table spec is a small YAML file, `experiments/tables/<NAME>.yaml` (see the ones there), or any file given as
`specrepro table PATH.yaml`:

    paper: eesd                      # output goes to <results dir>/<paper>/<NAME>.md and .csv
    title: "Table 1: GSM8K and XSum"
    source: "EESD (Liu et al., 2024), Table 1 (LLaMA-2-13B rows)"   # the paper and table the numbers come from
    experiment: eesd_main            # optional: every cell's runs have what conf/experiment/eesd_main.yaml fixes
    select: {model: smollm2_135m}    # ... and match this (its keys add to the experiment's or override them)
    row_header: [Method]             # the row label columns
    rows:                            # label(s) + selector; paper numbers per column label
      - {label: [Vanilla SD], select: {method: sps}, paper: {GSM8K HM: 82.49, GSM8K Speedup: 1.19}}
    columns:                         # label, metric key in metrics.json, optional selector, format, scale
      - {label: GSM8K HM, key: hm, select: {dataset: gsm8k}, fmt: "{:.2f}"}
      - {label: Mean HM, key: hm, mean_over: {dataset: [gsm8k, xsum]}}   # the mean of the cells it names
    plots:                           # optional: figures of the "here" cells, beside the table (specrepro/plots.py)
      - {name: hm, kind: bars, columns: [GSM8K HM, Mean HM], label_cells: 1}   # rows named by their first label cell

paper, title, rows (each with a label) and columns (each with a label and a key) are required; a key not shown
here, a value of the wrong type or a paper number for no column makes the spec invalid (one line naming the place).
The schema is the dataclasses TableSpec, Row, Column and Plot below: their fields' types say what a spec may hold
(yaml_schema.py reads a spec into them), their `check` methods what one field says about another.
`experiment` names the experiment whose runs the table shows (`experiment_selector`): what it fixes for every
run it makes is the base of the table's selector, so the spec restates none of it.
A selector maps keys to wanted values (a list = any of them; null = a record without the key); a key is a
metrics.json key (method, model, dataset, decoding, ...) or a dotted path in the run's config.yaml
(method.num_pred_tokens, dataset.limit, ...). A value written "${NAME}" or "${NAME:-default}" comes from the
environment, so the caller's variables (an artifact, a prompt count) pin the cells to the runs it made; an
unset NAME without a default leaves that key unconstrained. A row label may name such variables too
("SPACE (k = ${K:-5})"). A cell shows the newest complete run matching table,
row and column selectors (with " ±" the half-width of its 95% confidence interval where the run records one:
`speedup_paired_ci95`; a mean over cells shows the interval of the mean, `metrics.speed.mean_ci95`, where each of
its runs records one); the `runs` column names every run behind the row, as footnotes. A compiled run
(`hardware.compile: true`, its speedups over compiled `ar`) fills only cells whose selectors ask for it: a newer
compiled run never takes an eager cell's place.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import io
import json
import logging
import math
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated

import yaml

from specrepro.config import results_directory
from specrepro.errors import SpecReproError, one_line
from specrepro.metrics.speed import mean_ci95
from specrepro.plots import KINDS, table_rows, write_plots
from specrepro.provenance import machine_label
from specrepro.tracking import RunRecord, atomic_write, complete_runs, unwritable_in_one_line, wandb_mode
from specrepro.yaml_schema import Invalid, Label, Labels, build, kind, mapping, one_of, optional

log = logging.getLogger(__name__)

TABLES_DIR = Path(files("specrepro.table_specs"))  # experiments/tables/ in a source checkout
CONF_DIR = Path(files("specrepro.conf"))  # conf/ in a source checkout: its experiment/ holds the experiments
RECORDED_GROUPS = ("model", "method", "dataset", "decoding")  # config groups whose option metrics.json names
MISSING_CELL = "–"


# ---- the spec's schema (yaml_schema.py: each field's type says what its YAML value may be) ----


def _selector(value, where: str) -> dict:
    """Keys to a wanted value or a list of them (strings, numbers, booleans, null); a wanted list value, such as
    a skip set, is written inside a list: `method.attn_skip: [[8, 9]]`."""
    for key, wanted in mapping(value, where).items():
        for one in wanted if isinstance(wanted, list) else [wanted]:
            if isinstance(one, dict) or (isinstance(one, list) and any(isinstance(v, (dict, list)) for v in one)):
                raise Invalid(f"{where}: {key}: expected a value or a list of values, got {kind(one)}")
    return value


def _paper_numbers(value, where: str) -> dict:
    """Column label -> the paper's number (or text, as printed)."""
    numbers = {}
    for key, number in mapping(value, where).items():
        if isinstance(number, (dict, list)):
            raise Invalid(f"{where}: {key}: expected a number or string, got {kind(number)}")
        numbers[str(key)] = number
    return numbers


def _targets(value, where: str) -> dict:
    """A trend's column -> {csv: another table's CSV, row: its row's first label cell}."""
    for column, source in mapping(value, where).items():
        if sorted(mapping(source, f"{where}: {column}")) != ["csv", "row"]:
            raise Invalid(f"{where}: {column}: expected {{csv: <a table's CSV>, row: <its row's label>}}")
    return value


def _positive_numbers(value, where: str) -> dict:
    """Names to positive numbers (a trend's `extrapolate`)."""
    for key, number in mapping(value, where).items():
        if isinstance(number, bool) or not isinstance(number, (int, float)) or number <= 0:
            raise Invalid(f"{where}: {key}: expected a positive number, got {kind(number)}")
    return value


Selector = Annotated[dict, _selector]


@dataclass
class Column:
    label: Label
    key: str
    select: Selector = field(default_factory=dict)
    fmt: str = "{:.2f}"
    scale: float = 1.0  # multiplies our value, e.g. 100 for a fraction the paper prints in percent
    # {key: [values]}: the mean of the cells with each value (all needed)
    mean_over: Selector = field(default_factory=dict)

    def check(self, where: str) -> None:
        try:
            self.fmt.format(1.0)
        except (ValueError, IndexError, KeyError) as exc:
            raise Invalid(f"{where}.fmt: {self.fmt!r} cannot format a number ({one_line(exc)})") from None
        if len(self.mean_over) > 1 or any(not isinstance(v, list) or not v for v in self.mean_over.values()):
            raise Invalid(f"{where}.mean_over: expected one key and a non-empty list of its values")


@dataclass
class Row:
    label: Labels
    select: Selector = field(default_factory=dict)
    paper: Annotated[dict, _paper_numbers] = field(default_factory=dict)  # column label -> the paper's number

    def check(self, where: str, spec: "TableSpec") -> None:
        """Its label fills at most the row_header's columns; its paper numbers name columns."""
        if len(self.label) > len(spec.row_header):
            raise Invalid(f"{where}.label: {len(self.label)} labels, but row_header has {len(spec.row_header)}")
        for key in self.paper:
            if key not in {column.label for column in spec.columns}:
                raise Invalid(f"{where}.paper: no column labelled '{key}'")


@dataclass
class Plot:
    """A figure of the table's "here" cells (plots.py): bars of `columns`, a scatter of column `x` against `y`, or a
    trend of `columns` against `x` (a fitted line, extrapolated to `extrapolate`), each named by its label."""

    name: str
    kind: Annotated[str, one_of(*KINDS)]
    columns: Labels | None = None
    x: Label | None = None
    y: Label | None = None
    xlabel: str | None = None  # default: x
    ylabel: str | None = None  # default: y (bars: none)
    reference: float | None = None  # a dashed line at this value
    label_cells: int | None = None  # a row is named by its first N label cells (default: all)
    extrapolate: Annotated[dict, _positive_numbers] | None = None  # a trend's line at these named x values
    targets: Annotated[dict, _targets] | None = None  # column -> {csv, row}: where a trend's line reaches that cell
    note: str | None = None  # a trend's page says this above its fit

    def check(self, where: str, spec: "TableSpec") -> None:
        for key in KINDS[self.kind]:
            if getattr(self, key) is None:
                raise Invalid(f"{where}: a {self.kind} plot needs '{key}'")
            for name in _as_list(getattr(self, key)):
                if name not in {column.label for column in spec.columns}:
                    raise Invalid(f"{where}.{key}: no column labelled '{name}'")
        if self.label_cells is not None and self.label_cells < 1:
            raise Invalid(f"{where}.label_cells: expected a positive integer, got {self.label_cells!r}")
        for name in self.targets or {}:
            if self.kind != "trend" or name not in self.columns:
                raise Invalid(f"{where}.targets: '{name}' is not a column this trend plots")


@dataclass
class TableSpec:
    name: str
    paper: str
    title: str
    source: str = optional("")  # the paper and table the numbers come from
    row_header: Labels = optional(["Row"])
    rows: list[Row]
    columns: list[Column]
    select: Selector = field(default_factory=dict)  # once loaded: over the experiment's selector
    note: str = ""
    plots: list[Plot] = field(default_factory=list)
    experiment: str | None = None  # conf/experiment/<name>.yaml: its runs are the table's (`experiment_selector`)

    @property
    def has_paper_numbers(self) -> bool:
        """False for a benchmark's own table (the leaderboard): it then has no "(paper)" columns."""
        return any(row.paper for row in self.rows)

    @classmethod
    def load(cls, name: str, tables_dir: Path = TABLES_DIR, conf_dir: Path = CONF_DIR) -> "TableSpec":
        """Spec NAME from `tables_dir`, or the spec file NAME if it ends in .yaml, its experiment from `conf_dir`;
        SpecReproError if it is malformed."""
        path = Path(name) if name.endswith((".yaml", ".yml")) else tables_dir / f"{name}.yaml"
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in tables_dir.glob("*.yaml"))) or "none"
            raise SpecReproError(f"no table spec '{name}' ({path} does not exist; known: {known})")
        try:
            return cls.from_yaml(path.stem, yaml.safe_load(path.read_text()), conf_dir)
        except (OSError, UnicodeDecodeError, yaml.YAMLError, Invalid) as exc:
            raise SpecReproError(f"invalid table spec {path}: {one_line(exc)}") from None

    @classmethod
    def from_yaml(cls, name: str, raw, conf_dir: Path = CONF_DIR) -> "TableSpec":
        """The spec from its parsed YAML, checked against the schema (module docstring), its `select` over its
        experiment's selector; Invalid says what is wrong."""
        spec = build(cls, raw, name=name)
        if spec.experiment is not None:
            spec.select = {**experiment_selector(spec.experiment, conf_dir), **spec.select}
        for i, column in enumerate(spec.columns):
            column.check(f"columns[{i}]")
        for i, row in enumerate(spec.rows):
            row.check(f"rows[{i}]", spec)
        for i, plot in enumerate(spec.plots):
            plot.check(f"plots[{i}]", spec)
        return spec


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def experiment_selector(name: str, conf_dir: Path = CONF_DIR) -> dict:
    """What experiment NAME (`<conf dir>/experiment/<NAME>.yaml`) fixes for every run it makes, as a selector:
    each scalar it sets in a group (dotted: `method.k`; a top-level one, `reference_nll: true`, would be read as
    the metric of that name) and, for each group of RECORDED_GROUPS it overrides, the name a run of that option
    records (`override /dataset: gsm8k_cllm` -> `dataset: gsm8k`); not what its sweeper varies between runs
    (`hydra.sweeper.params`) nor anything else under `hydra`. Invalid if there is no such experiment."""
    path = conf_dir / "experiment" / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml"))) or "none"
        raise Invalid(f"experiment: no experiment '{name}' ({path} does not exist; known: {known})")
    raw = mapping(yaml.safe_load(path.read_text()), f"experiment: {path}")
    select = {}
    for default in raw.get("defaults") or []:
        for key, option in default.items() if isinstance(default, dict) else ():
            group = key.removeprefix("override /")
            if group in RECORDED_GROUPS:
                select[group] = _option_name(conf_dir, group, option)
    groups = {key: value for key, value in raw.items() if isinstance(value, dict) and key not in ("defaults", "hydra")}
    select.update(_scalar_leaves(groups))
    swept = ((raw.get("hydra") or {}).get("sweeper") or {}).get("params") or {}
    return {key: value for key, value in select.items() if key not in swept}


def _scalar_leaves(node: dict, prefix: str = "") -> dict:
    """Each scalar in nested mappings by its dotted key (`{method: {k: 2}}` -> `{method.k: 2}`); lists left out."""
    leaves = {}
    for key, value in node.items():
        if isinstance(value, dict):
            leaves.update(_scalar_leaves(value, f"{prefix}{key}."))
        elif not isinstance(value, list):
            leaves[f"{prefix}{key}"] = value
    return leaves


def _option_name(conf_dir: Path, group: str, option: str) -> str:
    """The name a run of `group`'s `option` records: the option's `name`, else that of the option it extends
    (`defaults: [gsm8k, _self_]`), else its method schema's (`/method_schema_<name>@_here_`)."""
    path = conf_dir / group / f"{option}.yaml"
    if not path.is_file():
        raise Invalid(f"experiment: overrides /{group} with '{option}', but {path} does not exist")
    raw = mapping(yaml.safe_load(path.read_text()), f"experiment: {path}")
    if "name" in raw:
        return raw["name"]
    for parent in raw.get("defaults") or []:
        if isinstance(parent, str) and parent.startswith(f"/{group}_schema_"):
            return parent.removeprefix(f"/{group}_schema_").removesuffix("@_here_")
        if isinstance(parent, str) and parent != "_self_" and not parent.startswith("/"):
            return _option_name(conf_dir, group, parent)
    raise Invalid(f"experiment: {path} names no {group} (no `name`, no option or schema it extends)")


# ---- run records ----


@dataclass
class RunInfo:
    name: str
    metrics: dict
    config: dict
    order: float  # newer runs sort later (file mtime locally, creation time on W&B)
    dir: Path | None = None  # the run's directory (local runs)


def local_runs(*results_dirs: str | Path) -> list[RunInfo]:
    """Complete runs under each `<results dir>/runs/`, newer ones ordered later (by the time a run finished where
    its record says, else by file time: a committed copy's file time is when it was checked out); a record that
    cannot be read is skipped with a warning."""
    runs = []
    for run in (run for results_dir in results_dirs for run in complete_runs(results_dir)):
        config_path = run.dir / "config.yaml"
        try:
            config = _read_config(config_path) if config_path.is_file() else {}
        except ValueError as exc:
            log.warning("skipping a run record: %s", exc)
            continue
        damage = RunRecord(run.dir).damage() if (run.dir / "generations.jsonl").is_file() else None
        if damage:  # a committed copy holds no generations: its metrics.json is what the tables read
            log.warning(
                "skipping run %s: %s (`specrepro run` with its config decodes the lost records again)",
                run.dir.name,
                damage,
            )
            continue
        finished = (run.metrics.get("provenance") or {}).get("finished_at")
        order = dt.datetime.fromisoformat(finished).timestamp() if isinstance(finished, str) else run.mtime
        runs.append(RunInfo(run.dir.name, run.metrics, config, order, run.dir))
    return runs


def write_inputs(out_dir: Path, runs: list[RunInfo]) -> None:
    """Copy these runs' metrics.json and config.yaml into `<out dir>/runs/`, the inputs of the tables there, and
    drop the inputs no table there, nor a comparison page in its `compare/`, names any more: committed, they let
    the tables regenerate from the repository alone (`specrepro table NAME --results-dir <out dir> --out-dir <out
    dir>`). A run timed against `ar` turn by turn also leaves its timed turns (`turns.jsonl`), so that `specrepro
    compare` works on the committed copies."""
    inputs = out_dir / "runs"
    for run in runs:
        metrics = json.dumps(run.metrics, indent=1, sort_keys=True, default=str)
        atomic_write(inputs / run.name / "metrics.json", metrics + "\n")
        atomic_write(inputs / run.name / "config.yaml", yaml.safe_dump(run.config, sort_keys=False))
        if run.dir is not None:
            try:
                turns = RunRecord(run.dir).timed_turns()
            except SpecReproError:  # not timed against ar, or a copy made before turns were kept
                continue
            atomic_write(RunRecord(inputs / run.name).turns_path, "".join(json.dumps(t) + "\n" for t in turns))
    named = {name for table in out_dir.glob("*.csv") for name in _run_names(table)}
    pages = "".join(page.read_text() for page in out_dir.glob("compare/*.md"))  # `specrepro compare --out` pages
    named |= {path.name for path in inputs.glob("*") if path.name in pages}
    for stale in (path for path in inputs.glob("*") if path.is_dir() and path.name not in named):
        shutil.rmtree(stale)


def _run_names(table_csv: Path) -> list[str]:
    """The run names in a table CSV's `runs` column (none if it has no such column)."""
    rows = table_rows(table_csv.read_text())
    if not rows or rows[0][-1:] != ["runs"]:
        return []
    return [name for row in rows[1:] for name in row[-1].split(";") if name]


def _read_config(path: Path) -> dict:
    """The mapping in a run's config.yaml; ValueError naming the file if it holds none."""
    try:
        value = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: {one_line(exc)}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a mapping, got {kind(value)}")
    return value


def wandb_runs(project: str, entity: str | None, group: str | None) -> list[RunInfo]:
    """Finished runs of a W&B project (optionally one sweep group), through the public API."""
    if wandb_mode(SimpleNamespace(mode=None)) != "online":
        raise SpecReproError(
            "--source wandb needs W&B online (wandb login or WANDB_API_KEY); "
            "use --source local for the records under results/runs"
        )
    import wandb

    try:
        api = wandb.Api()
        path = f"{entity or api.default_entity}/{project}"
        found = api.runs(path, filters={"group": group} if group else {})
        runs = []
        for run in found:
            summary = run.summary_metrics  # plain nested dicts (`dict(run.summary)` kept W&B's own below the top)
            if summary.get("complete", True) and "run_name" in summary:
                runs.append(RunInfo(run.name, summary, dict(run.config), float(summary.get("_timestamp", 0))))
    except Exception as exc:  # the API raises many types; the user needs one line
        raise SpecReproError(f"W&B API: {type(exc).__name__}: {exc}".splitlines()[0]) from None
    return runs


def _lookup(run: RunInfo, key: str):
    """A metric (`_metric`), a config value (`method.k`) or a value the record's provenance holds
    (`provenance.machine.cpu`: the machine that timed it)."""
    if (value := _metric(run.metrics, key)) is not None:
        return value
    return _walk(run.metrics if key.startswith("provenance.") else run.config, key)


def _metric(metrics: dict, key: str):
    """A metric a run recorded, or one its trained components measured (`trained.eagle_head.train_tokens`; a list's
    items by position: `trained.eagle_head.heldout_top1_by_depth_after.0`)."""
    return _walk(metrics, key) if key.startswith("trained.") else metrics.get(key)


def _walk(node, key: str):
    """The value at dotted `key` in nested dicts (and lists, by position); None where there is none."""
    for part in key.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


_ENV_REF = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")  # "${NAME}" or "${NAME:-default}"


def _label_from_environment(label: str) -> str:
    """A row label with its "${NAME}" / "${NAME:-default}" parts from the environment (unset: the default or "")."""
    return _ENV_REF.sub(lambda ref: os.environ.get(ref[1], ref[2] or ""), label)


def _from_environment(select: dict) -> dict:
    """The selector with its "${NAME}" / "${NAME:-default}" values read from the environment; unset: key dropped."""
    resolved = {}
    for key, wanted in select.items():
        ref = _ENV_REF.fullmatch(wanted) if isinstance(wanted, str) else None
        if ref:
            wanted = os.environ.get(ref[1], ref[2])
            if wanted is None:
                continue
        resolved[key] = wanted
    return resolved


def _matches(run: RunInfo, select: dict) -> bool:
    return all(
        str(_lookup(run, key)) in {str(v) for v in _as_list(wanted)}
        for key, wanted in _from_environment(select).items()
    )


# ---- the table ----


def _format(value, column: Column, scale: float = 1.0, ci95=None) -> str:
    """A cell's text; with `ci95`, a run's half-width of the 95% confidence interval of the value, "1.35x ±0.06x"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING_CELL
    if not isinstance(value, (int, float)):
        return str(value)  # text as printed (a paper's "1.0×"), or whatever a record holds
    text = column.fmt.format(value * scale)
    if isinstance(ci95, (int, float)) and not math.isnan(ci95):
        text += " ±" + column.fmt.format(ci95 * scale)
    return text


EAGER = {"hardware.compile": [False, None]}  # every selector's default: runs without compiled steps


def cell_runs(spec: TableSpec, row: Row, column: Column, runs: list[RunInfo]) -> list[RunInfo | None]:
    """The run behind a cell (one per value a `mean_over` column averages): the newest complete run matching the
    table's, row's and column's selectors (an eager one unless they select `hardware.compile`), None where none
    does. A mean's runs are all of one machine (of those that timed every value, the one with the newest run): a
    row cut off on one lent GPU and finished on another card is not averaged over both cards."""
    selectors = [{key: v} for key, values in column.mean_over.items() for v in values] or [{}]
    matching = [
        [r for r in runs if _matches(r, {**EAGER, **spec.select, **row.select, **column.select, **extra})]
        for extra in selectors
    ]
    if len(selectors) > 1 and (machines := {timed_on(r) for group in matching for r in group}):
        complete = [m for m in machines if all(any(timed_on(r) == m for r in group) for group in matching)]
        newest = {m: max((r.order, r.name) for group in matching for r in group if timed_on(r) == m) for m in machines}
        machine = max(complete or machines, key=lambda m: newest[m])
        matching = [[r for r in group if timed_on(r) == machine] for group in matching]
    found = []
    for candidates in matching:
        found.append(max(candidates, key=lambda r: (r.order, r.name)) if candidates else None)
        if found[-1] is not None:
            refuse_other_settings(found[-1], candidates, row, column)
    if len(found) > 1 and None not in found:  # a mean's runs: one setting but for the key the mean goes over
        (averaged,) = column.mean_over
        refuse_other_settings(found[0], found[1:], row, column, averaged)
    return found


def timed_on(run: RunInfo) -> str | None:
    """The machine label of a run's provenance (None for a record without one)."""
    machine = (run.metrics.get("provenance") or {}).get("machine")
    return machine_label(machine) if machine else None


SETTING = ("method", "model", "dataset", "decoding", "timing")  # what a cell's candidate runs must share


def setting_of(config: dict, parts: tuple[str, ...] = SETTING) -> dict[str, str]:
    """A run's config as dotted keys, of the parts that make its setting (`SETTING`, or `parts`)."""

    def flat(value, prefix: str) -> dict[str, str]:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}.{key}").items()}
        return {prefix: str(value)}

    return {k: v for part in parts for k, v in flat(config.get(part) or {}, part).items()}


def refuse_other_settings(
    chosen: RunInfo, candidates: list[RunInfo], row: Row, column: Column, averaged: str = ""
) -> None:
    """A cell shows the newest of its matching runs, so these must be runs of one setting (re-runs): one whose
    method option, model, data, decoding or timing differs (an ablation's run, or another budget, matching a row
    that leaves the key open) would put another setting's number in the cell without a word. So must a mean's
    runs, but for the key it averages over (`averaged`, and what lies under it: `dataset` covers `dataset.*`)."""
    mine = setting_of(chosen.config)
    for other in candidates:
        theirs = setting_of(other.config)
        differ = sorted(
            k
            for k in mine.keys() & theirs.keys()
            if mine[k] != theirs[k] and not (averaged and (k == averaged or k.startswith(f"{averaged}.")))
        )
        if differ:
            raise SpecReproError(
                f"row {' / '.join(map(str, row.label))}, column {column.label}: runs {chosen.name} and {other.name} "
                f"both match but differ in {', '.join(differ)}: select the value the row means"
            )


def build_table(spec: TableSpec, runs: list[RunInfo]) -> tuple[list[str], list[list[str]], list[str]]:
    """(header, body rows, footnotes): per column a "paper" and a "here" cell (only "here" when no row has a paper
    number: a benchmark's own table); a `runs` column of footnote marks."""
    with_paper = spec.has_paper_numbers
    header = [*spec.row_header]
    for column in spec.columns:
        header += [f"{column.label} (paper)", f"{column.label} (here)"] if with_paper else [f"{column.label} (here)"]
    header.append("runs")
    footnotes: list[str] = []
    body = []
    for row in spec.rows:
        cells = [_label_from_environment(label) for label in row.label] + [""] * (len(spec.row_header) - len(row.label))
        used: list[str] = []
        for column in spec.columns:
            behind = cell_runs(spec, row, column, runs)
            values = []
            for run in behind:
                value = (
                    _metric(run.metrics, column.key) if run else None
                )  # a metric; a config flag of that name is not one
                if run is not None and value is not None and run.name not in used:
                    used.append(run.name)
                values.append(value)
            missing = any(v is None or not isinstance(v, (int, float)) for v in values)
            value = values[0] if len(values) == 1 else None if missing else sum(values) / len(values)
            # the 95% interval of one run, or of a mean over cells (none when a run was made before `_ci95`)
            if len(behind) == 1:
                ci95 = behind[0].metrics.get(f"{column.key}_ci95") if behind[0] else None
            else:
                ci95 = None if missing else mean_ci95([run.metrics for run in behind], column.key)
            if with_paper:
                cells.append(_format(row.paper.get(column.label), column))
            cells.append(_format(value, column, column.scale, ci95))
        marks = []
        for name in used:
            if name not in footnotes:
                footnotes.append(name)
            marks.append(f"[{footnotes.index(name) + 1}]")
        body.append(cells + [" ".join(marks) or MISSING_CELL])
    return header, body, footnotes


def runs_origin(runs: list[RunInfo]) -> tuple[list[str], list[str], list[str]]:
    """(machines, commits, dates) the runs' provenance records name, each sorted without repeats."""
    origins = [run.metrics.get("provenance") or {} for run in runs]
    machines = sorted({machine_label(o["machine"]) for o in origins if o.get("machine")})
    commits = sorted(
        {
            o["code"]["commit"][:10] + ("+dirty" if o["code"].get("dirty") else "")
            for o in origins
            if (o.get("code") or {}).get("commit")
        }
    )
    dates = sorted({d for o in origins for d in (o.get("started_at"), o.get("finished_at")) if d})
    return machines, commits, dates


def provenance_footer(runs: list[RunInfo], command: str) -> list[str]:
    """Lines saying where the table's numbers come from: machines, code versions, dates, and how to regenerate."""
    machines, commits, dates = runs_origin(runs)
    origins = [run.metrics.get("provenance") or {} for run in runs]
    versions = sorted(
        {
            f"torch {o['versions']['torch']}, transformers {o['versions']['transformers']}"
            for o in origins
            if o.get("versions")
        }
    )
    unknown = sum(not o for o in origins)
    lines = [
        f"- Machine: {'; '.join(machines) or 'unknown'}",
        f"- Code: {', '.join(commits) or 'unknown'} ({'; '.join(versions) or 'library versions unknown'})",
        f"- Dates: {dates[0][:10]} to {dates[-1][:10]}" if dates else "- Dates: unknown",
        f"- Regenerate: `{command}`",
    ]
    if unknown:
        lines.insert(0, f"- {unknown} run(s) predate provenance records (record_version < 2)")
    return lines


def _model_settings(run: RunInfo) -> dict[str, str]:
    """Each string setting of a run's `model` and `method` configs (dotted key -> value): where an artifact
    reference can be."""

    def flat(node, prefix: str):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from flat(value, f"{prefix}.{key}")
        elif isinstance(node, str) and node:
            yield prefix, node

    return {key: value for part in ("model", "method") for key, value in flat(run.config.get(part), part)}


def _names(value: str, artifact: str) -> bool:
    """Whether a setting names a trained artifact: its exact name, the prefix it is found by (`sps_draft` for
    `sps_draft-<model>-<hash>`) or a path to it."""
    return bool(value) and (artifact in (value, Path(value).name) or artifact.startswith(f"{value}-"))


def mixed_inputs(footnotes: list[str], by_name: dict[str, RunInfo]) -> list[str]:
    """A line for each input this table's runs share by name but not by content: a trained artifact or checkpoint
    retrained between them ("Mixed weights"), a dataset whose records changed between them ("Mixed data"), or a
    method whose code changed between them (`code_fingerprint`: "Mixed code"), with which runs had which content:
    their cells do not come from one model, the same prompts, or one decoder. Runs that load
    trained weights but predate records of them ("Unrecorded weights"), beside runs of the same model that recorded
    an artifact their config names with every setting the recording run's did (`method.draft.id=sps_draft` for
    `sps_draft-<model>-<hash>`), get a line too: nothing shows they loaded the same contents (other artifacts'
    weights say nothing)."""
    weights: dict[str, dict[str, list[str]]] = {}  # artifact name -> content digest -> footnote marks
    data: dict[tuple[str, str], dict[str, list[str]]] = {}  # (label, dataset setting) -> records fingerprint -> marks
    unrecorded: list[tuple[str, RunInfo]] = []  # (mark, run) of runs with trained weights and no `artifacts` record
    recorded: dict[tuple[str, tuple[str, ...]], dict[str, list[str]]] = {}  # (model, keys naming it) -> name -> digests
    code: dict[str, dict[str, list[str]]] = {}  # "<method>'s code" -> code fingerprint -> marks
    for mark, run in ((f"[{i}]", by_name[name]) for i, name in enumerate(footnotes, 1) if name in by_name):
        if "artifacts" not in run.metrics and run.metrics.get("training_minutes") != 0:
            unrecorded.append((mark, run))
        for artifact in (run.metrics.get("artifacts") or {}).values():
            weights.setdefault(artifact["name"], {}).setdefault(artifact["content_digest"], []).append(mark)
            keys = tuple(key for key, value in _model_settings(run).items() if _names(value, artifact["name"]))
            digests = recorded.setdefault((str(run.metrics.get("model")), keys), {}).setdefault(artifact["name"], [])
            digests += [artifact["content_digest"]] if artifact["content_digest"] not in digests else []
        dataset = run.config.get("dataset") or {}
        if dataset and run.metrics.get("data_fingerprint"):  # one dataset setting: the same records expected
            label = str(dataset.get("name")) + (f" (limit {dataset['limit']})" if dataset.get("limit") else "")
            setting = (label, json.dumps(dataset, sort_keys=True, default=str))
            data.setdefault(setting, {}).setdefault(run.metrics["data_fingerprint"], []).append(mark)
        if run.metrics.get("code_fingerprint"):  # recorded since runs are named by their code
            method = f"{run.metrics.get('method')}'s code"
            code.setdefault(method, {}).setdefault(run.metrics["code_fingerprint"], []).append(mark)

    def lines(kind: str, found: list[tuple[str, dict[str, list[str]]]], what: str, why: str) -> list[str]:
        return [
            f"- Mixed {kind}: runs {what} {len(by_content)} different contents of {name} ("
            + "; ".join(f"{' '.join(marks)}: {content}" for content, marks in by_content.items())
            + f"): {why}"
            for name, by_content in found
            if len(by_content) > 1
        ]

    def same_references(run: RunInfo) -> dict[str, list[str]]:
        """The recorded artifacts (name -> digests) that `run`'s config names with every setting their runs did."""
        settings, model = _model_settings(run), str(run.metrics.get("model"))
        return {
            name: digests
            for (recorded_model, keys), named in recorded.items()
            if recorded_model == model and keys
            for name, digests in named.items()
            if all(_names(settings.get(key, ""), name) for key in keys)
        }

    suspects = {mark: named for mark, run in unrecorded if (named := same_references(run))}
    others = {name: digests for named in suspects.values() for name, digests in named.items()}
    unverified = (
        [
            f"- Unrecorded weights: runs {' '.join(suspects)} predate records of the "
            "weights a run loads (`artifacts` in metrics.json); nothing shows they loaded the contents runs "
            "naming the same artifacts recorded ("
            + "; ".join(f"{name}: {', '.join(digests)}" for name, digests in others.items())
            + ")"
        ]
        if suspects
        else []
    )
    return (
        lines(
            "weights",
            list(weights.items()),
            "loaded",
            "it was retrained between them; their cells do not come from one model",
        )
        + unverified
        + lines(
            "data",
            [(label, found) for (label, _), found in data.items()],
            "decoded",
            "its records changed between them; their cells do not come from the same prompts",
        )
        + lines(
            "code",
            list(code.items()),
            "decoded with",
            "it changed between them (a fix, a refactor, "
            "another torch or transformers); their cells may not come from one decoder",
        )
    )


def runs_by_machine(footnotes: list[str], by_name: dict[str, RunInfo]) -> list[str]:
    """A line naming which runs each machine timed, when a table's runs come from more than one: tok/s and
    absolute timings then compare only between rows of one machine (each paired speedup and step cost is a ratio
    timed on its own run's machine, though one CPU's ratio need not be another's)."""
    numbers: dict[str, list[int]] = {}
    for i, name in enumerate(footnotes, 1):
        machine = ((by_name[name].metrics.get("provenance") or {}).get("machine")) if name in by_name else None
        if machine:
            numbers.setdefault(machine_label(machine), []).append(i)
    if len(numbers) < 2:
        return []
    by_machine = "; ".join(f"{machine}: {_mark_ranges(runs)}" for machine, runs in sorted(numbers.items()))
    return [f"- Runs by machine: {by_machine} (tok/s compare only between runs of one machine)"]


def _mark_ranges(numbers: list[int]) -> str:
    """Footnote marks with consecutive runs joined: [1] [2] [3] [7] -> "[1]-[3] [7]"."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return " ".join(f"[{a}]" if a == b else f"[{a}]-[{b}]" for a, b in spans)


def render_markdown(spec: TableSpec, header, body, footnotes, footer: list[str]) -> str:
    lines = [f"# {spec.title}", ""]
    if spec.source:
        lines += [f"Paper numbers: {spec.source}.", ""]
    if spec.note:
        lines += [spec.note.strip(), ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    missing = "not in the paper, or no run yet" if spec.has_paper_numbers else "no run yet"
    lines += ["", f"{MISSING_CELL} = no number ({missing}).", "", "Runs:", ""]
    lines += [f"{i}. `{name}`" for i, name in enumerate(footnotes, 1)] or ["(none)"]
    lines += ["", "Provenance:", "", *footer]
    return "\n".join(lines) + "\n"


def render_csv(header, body, footnotes, footer: list[str]) -> str:
    """The table as CSV; the provenance footer follows as `#` comment lines (pandas: `comment="#"`)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    for row in body:
        names = [footnotes[int(mark.strip("[]")) - 1] for mark in row[-1].split() if mark.startswith("[")]
        writer.writerow(row[:-1] + [";".join(names)])
    return out.getvalue() + "".join(f"# {line.removeprefix('- ')}\n" for line in footer)


KEPT_ORIGIN = "# Kept rows' provenance (that of the table they were kept from): "


def row_label(row: list[str], width: int) -> str:
    """A table row's name in messages: its first (at most two) label cells that say something."""
    return " / ".join(cell for cell in row[: min(width, 2)] if cell not in ("", "-", MISSING_CELL))


def emptied_rows(previous: Path, width: int, body: list[list[str]]) -> list[str]:
    """Labels of the rows that have runs in the `previous` table's CSV and none in `body`."""
    rows = table_rows(previous.read_text())
    if not rows or rows[0][-1:] != ["runs"]:
        return []
    had_runs = {tuple(row[:width]) for row in rows[1:] if row[-1]}
    return [row_label(row, width) for row in body if row[-1] == MISSING_CELL and tuple(row[:width]) in had_runs]


def keep_previous_rows(
    previous: Path, width: int, header: list[str], body: list[list[str]], footnotes: list[str]
) -> tuple[list[list[str]], list[str], list[str], list[str]]:
    """(body, footnotes, kept labels, the previous table's provenance): each row of `body` with no run takes
    its cells and runs from the same row (its first `width` label cells) of the `previous` table's CSV, which must
    have the same columns; footnotes are renumbered in row order."""
    text = previous.read_text()
    lines, rows = text.splitlines(), table_rows(text)
    if not rows or rows[0] != header:
        raise SpecReproError(f"{previous}: its columns differ from the spec's; regenerate it without --keep-rows")
    earlier = {tuple(row[:width]): row for row in rows[1:]}
    names_by_row = [[footnotes[int(m.strip("[]")) - 1] for m in row[-1].split() if m.startswith("[")] for row in body]
    kept = []
    for i, row in enumerate(body):
        previous_row = earlier.get(tuple(row[:width]))
        if names_by_row[i] or previous_row is None or not previous_row[-1]:
            continue
        body[i], names_by_row[i] = previous_row[:-1] + [""], previous_row[-1].split(";")
        kept.append(row_label(row, width))
    renumbered: list[str] = []
    for row, names in zip(body, names_by_row):
        renumbered += [name for name in names if name not in renumbered]
        row[-1] = " ".join(f"[{renumbered.index(name) + 1}]" for name in names) or MISSING_CELL
    origin = {
        part
        for line in lines
        if line.startswith(("# Machine:", "# Code:", "# Dates:", KEPT_ORIGIN))
        for part in line.removeprefix(KEPT_ORIGIN).removeprefix("# ").split("; ")
    }
    return body, renumbered, kept, sorted(origin)


def newest_copies(runs: list[RunInfo]) -> list[RunInfo]:
    """One record per run name, the newest: results dirs read together (new records and a table's committed inputs)
    can hold two copies of a run decoded again under its name."""
    newest: dict[str, RunInfo] = {}
    for run in runs:
        if run.name not in newest or run.order > newest[run.name].order:
            newest[run.name] = run
    return list(newest.values())


def table_command(name, results_dirs, source, project, entity, group, out_dir, keep_rows) -> str:
    """The `specrepro table` command that regenerates a table as it was written now, quoted for a shell."""
    parts = ["specrepro", "table", str(name)]
    if source == "wandb":
        parts += ["--source", "wandb", "--project", str(project)]
        parts += [
            word for key, value in (("entity", entity), ("group", group)) if value for word in (f"--{key}", value)
        ]
    else:
        parts += [word for directory in results_dirs for word in ("--results-dir", str(directory))]
    parts += ["--out-dir", str(out_dir)] * (out_dir is not None) + ["--keep-rows"] * keep_rows
    return shlex.join(parts)


def write_table(
    name: str,
    results_dir: str | Path | list = "results",
    source: str = "local",
    project: str = "specrepro",
    entity: str | None = None,
    group: str | None = None,
    tables_dir: Path = TABLES_DIR,
    out_dir: str | Path | None = None,
    command: str | None = None,
    keep_rows: bool = False,
) -> Path:
    """Regenerate table NAME (or spec file NAME.yaml) from the records in `results_dir` (one or a list) into
    `<out dir>/<NAME>.md` and `.csv` (default out dir: `<first results dir>/<paper>`), with a provenance footer
    naming `command` (default: this table's own), and its inputs into `<out dir>/runs/`; return the .md path.
    `keep_rows`: rows with no run here keep their cells and runs from the table already there, and the footer
    names them and carries that table's provenance."""
    spec = TableSpec.load(name, tables_dir)
    results_dirs = results_dir if isinstance(results_dir, list) else [results_dir]
    if source == "local":
        for directory in results_dirs:
            if not (Path(directory) / "runs").is_dir():
                raise SpecReproError(f"no run records in {directory} (no {Path(directory) / 'runs'} directory)")
    runs = local_runs(*results_dirs) if source == "local" else wandb_runs(project, entity, group)
    runs = newest_copies(runs)  # a run re-decoded under its name: its new record, in the cells and the inputs alike
    header, body, footnotes = build_table(spec, runs)
    command = command or table_command(name, results_dirs, source, project, entity, group, out_dir, keep_rows)
    out_dir = Path(out_dir) if out_dir is not None else Path(results_dirs[0]) / spec.paper
    md_path = out_dir / f"{spec.name}.md"
    csv_path = md_path.with_suffix(".csv")
    kept, origin = [], []
    if keep_rows and csv_path.is_file():
        body, footnotes, kept, origin = keep_previous_rows(csv_path, len(spec.row_header), header, body, footnotes)
    elif csv_path.is_file() and (emptied := emptied_rows(csv_path, len(spec.row_header), body)):
        if not footnotes:  # a mistyped --results-dir must not wipe a committed table and its inputs
            raise SpecReproError(
                f"no run in {', '.join(map(str, results_dirs))} fills a cell of {spec.name}: "
                f"not replacing {csv_path.parent}'s table, whose rows have runs "
                "(another --results-dir? --keep-rows keeps rows without runs)"
            )
        log.warning(
            "%s: rows with runs in the previous table and none here are now empty: %s (--keep-rows keeps them)",
            md_path,
            ", ".join(emptied),
        )
    by_name = {run.name: run for run in runs}
    fresh = [by_name[n] for n in footnotes if n in by_name]
    footer = provenance_footer(fresh, command)
    after_machine = next(i for i, line in enumerate(footer) if line.startswith("- Machine:")) + 1
    footer[after_machine:after_machine] = runs_by_machine(footnotes, by_name)  # after any "predate" line too
    if mixed := mixed_inputs(footnotes, by_name):
        log.warning("%s: %s", md_path, " ".join(line.removeprefix("- ") for line in mixed))
        footer[-1:-1] = mixed
    if kept:
        footer = footer if fresh else footer[-1:]  # no run of its own: only the kept rows' provenance
        footer[-1:-1] = [
            f"- Kept rows: {', '.join(kept)} (no run of theirs where this table was regenerated; "
            "cells and runs as in the previous table)",
            f"- {KEPT_ORIGIN.removeprefix('# ')}{'; '.join(origin)}",
        ]
    with unwritable_in_one_line(f"the table to {out_dir}", "--out-dir DIR writes it elsewhere"):  # archived records
        atomic_write(md_path, render_markdown(spec, header, body, footnotes, footer))
        atomic_write(csv_path, render_csv(header, body, footnotes, footer))
        write_inputs(out_dir, [by_name[n] for n in footnotes if n in by_name])
        write_plots(spec.plots, md_path.with_suffix(".csv"), spec.row_header, spec.title)
    return md_path


def main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="specrepro table", description="Regenerate a paper table from run records.")
    parser.add_argument("name", help=f"a table spec in {TABLES_DIR} (without .yaml), or a spec file path.yaml")
    parser.add_argument(
        "--results-dir",
        action="append",
        default=None,
        type=results_directory,
        help="where the run records are (<dir>/runs; repeat it to read several, e.g. new records and "
        "a committed table's inputs) and, for the first, where the table goes (default: results)",
    )
    parser.add_argument(
        "--source",
        choices=("local", "wandb"),
        default="local",
        help="local run records, or W&B runs through its public API (online only)",
    )
    parser.add_argument("--project", default="specrepro", help="W&B project (--source wandb)")
    parser.add_argument("--entity", default=None, help="W&B entity (--source wandb; default: yours)")
    parser.add_argument("--group", default=None, help="W&B group, e.g. one sweep (--source wandb)")
    parser.add_argument("--out-dir", default=None, help="where the table goes (default: <results dir>/<paper>)")
    parser.add_argument("--command", default=None, help="the regenerating command the provenance footer names")
    parser.add_argument(
        "--keep-rows",
        action="store_true",
        help="rows with no run in the results dir keep their cells and runs from the table already in "
        "the out dir (e.g. records made on another machine); the footer names them",
    )
    opts = parser.parse_args(args)
    path = write_table(
        opts.name,
        opts.results_dir or ["results"],
        opts.source,
        opts.project,
        opts.entity,
        opts.group,
        out_dir=opts.out_dir,
        command=opts.command,
        keep_rows=opts.keep_rows,
    )
    print(path.read_text())
    plots = [path.with_name(f"{path.stem}_{plot.name}.png") for plot in TableSpec.load(opts.name).plots]
    print(f"wrote {path} and {path.with_suffix('.csv')}" + "".join(f", {plot}" for plot in plots))
