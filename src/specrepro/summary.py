"""`specrepro summary`: results/SUMMARY.md, each pipeline's headline cells copied from the committed tables.

A pipeline's `headline` entries (`reproduce.Headline`) each name a cell of a committed table, the claim it bears on
and that claim's status here; the page shows the paper's figure and ours, where ours was measured (the machine,
commit and dates of the runs behind the cell, from the table's committed inputs or its provenance footer), and,
for a claim that compares its cell with one measured on another machine (`versus`), the machine of each."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import yaml

from specrepro.config import results_directory
from specrepro.errors import SpecReproError
from specrepro.plots import table_rows
from specrepro.reproduce import PIPELINES_DIR, Headline, read_headlines
from specrepro.tables import MISSING_CELL, TABLES_DIR, TableSpec, cell_runs, local_runs, runs_origin
from specrepro.tracking import atomic_write, unwritable_in_one_line

SUMMARY_PAGE = "SUMMARY.md"


def headline_cells(table_csv: Path, row: list[str], column: str) -> tuple[str, str]:
    """The (paper, here) cells of one row and column of a committed table's CSV (paper: MISSING_CELL in a table
    without paper columns)."""
    header, *body = table_rows(table_csv.read_text())
    if f"{column} (here)" not in header:
        raise SpecReproError(f"{table_csv}: no column {column}")
    matched = [cells for cells in body if cells[: len(row)] == row]
    if not matched:
        raise SpecReproError(f"{table_csv}: no row {' / '.join(row)}")
    if len(matched) > 1:  # a row named by fewer labels than the table has: not one cell
        raise SpecReproError(f"{table_csv}: {len(matched)} rows start {' / '.join(row)}: name every label of the row")
    (cells,) = matched
    paper = f"{column} (paper)"
    return (cells[header.index(paper)] if paper in header else MISSING_CELL), cells[header.index(f"{column} (here)")]


def origin_text(machines: str, commits: list[str], first: str, last: str) -> str:
    """ "machine; commit; dates" as the summary page shows where a figure was measured."""
    code = ", ".join(commits) if len(commits) <= 2 else f"{len(commits)} commits"
    return f"{machines}; {code}; {first if last in ('', first) else f'{first} to {last}'}"


def footer_origin(table_csv: Path) -> tuple[list[str], str]:
    """(machines, "machine; commit; dates") of a committed table, from its CSV's provenance footer."""
    footer = dict(
        line[2:].split(": ", 1)
        for line in table_csv.read_text().splitlines()
        if line.startswith(("# Machine: ", "# Code: ", "# Dates: "))
    )
    first, _, last = footer.get("Dates", "unknown").partition(" to ")
    machine = footer.get("Machine", "unknown")
    return machine.split("; "), origin_text(
        machine, footer.get("Code", "unknown").split(" (", 1)[0].split(", "), first, last
    )


def cell_origin(table_csv: Path, row: list[str], column: str, tables_dir: Path = TABLES_DIR) -> tuple[list[str], str]:
    """(machines, "machine; commit; dates") of one cell of a committed table: the run behind it, as the table's
    spec selects it among the runs its row names in the committed inputs beside the table (`runs/`); all the row's
    runs where the cell's own cannot be told; the table's footer where no inputs are committed."""
    header, *body = table_rows(table_csv.read_text())
    names = next(set(cells[-1].split(";")) for cells in body if cells[: len(row)] == row)
    runs = (
        [run for run in local_runs(table_csv.parent) if run.name in names]
        if (table_csv.parent / "runs").is_dir()
        else []
    )
    if not runs:
        return footer_origin(table_csv)
    try:
        spec = TableSpec.load(table_csv.stem, tables_dir)
        spec_row = next(spec_row for spec_row in spec.rows if list(spec_row.label) == row)
        spec_column = next(spec_column for spec_column in spec.columns if spec_column.label == column)
        behind = cell_runs(spec, spec_row, spec_column, runs)
    except (SpecReproError, StopIteration):
        behind = [None]
    machines, commits, dates = runs_origin(runs if None in behind else behind)
    return machines or ["unknown"], origin_text(
        "; ".join(machines) or "unknown",
        commits or ["unknown"],
        dates[0][:10] if dates else "unknown",
        dates[-1][:10] if dates else "",
    )


def versus_machines(item: Headline, table_csv: Path, machines: list[str]) -> str:
    """For a headline whose claim compares its cell with one measured on another machine: the machine of each
    side (a speedup is a ratio timed on one machine, but one CPU's ratio need not be another's); else ""."""
    other_csv = table_csv.with_name(f"{item.versus.table or item.table}.csv")
    if not other_csv.is_file():
        return ""
    other, _ = cell_origin(other_csv, item.versus.row, item.versus.column or item.column)
    if set(other) == set(machines):
        return ""
    return (
        f"; across machines: *{' / '.join(item.row)}* on {' and '.join(machines)}, "
        f"*{' / '.join(item.versus.row)}* on {' and '.join(other)}"
    )


def summary_page(
    results_dir: str = "results",
    page_dir: Path | None = None,
    pipelines_dir: Path = PIPELINES_DIR,
    pipeline_file: Path | None = None,
) -> str:
    """The summary page: one row per headline of the pipelines in `pipelines_dir` (and of `pipeline_file`, one kept
    elsewhere), its cells copied from the committed tables under `results_dir` with their origin, the table linked
    relative to `page_dir` (default `results_dir`)."""
    page_dir = Path(page_dir or results_dir)
    pipelines = sorted(pipelines_dir.glob("*.yaml"))
    if pipeline_file is not None and pipeline_file.resolve() not in [path.resolve() for path in pipelines]:
        pipelines.append(pipeline_file)
    lines = [
        "# What the harness found",
        "",
        "Headline cells copied from the committed tables: the paper's figure, ours, and where ours was measured "
        "(machine; commit; dates of the run behind the cell, from its record), with the claim's status here "
        "(reproduced, not reproduced, not testable here: a judgment written beside the claim in "
        "`experiments/reproduce/<paper>.yaml`, argued on the paper's claims page, `<paper>/README.md`). A claim "
        "that compares its cell with one measured on another machine names the machine of each.",
        "",
        "| paper | claim | status | paper | here | measured on | table |",
        "|---|---|---|---|---|---|---|",
    ]
    for path in pipelines:
        spec = yaml.safe_load(path.read_text())
        for item in read_headlines(path, spec):
            table = Path(results_dir) / spec["paper"] / f"{item.table}.csv"
            if table.is_file():
                paper, here = headline_cells(table, item.row, item.column)
                machines, origin = cell_origin(table, item.row, item.column)
                origin += versus_machines(item, table, machines) if item.versus else ""
                link = f"[{item.table}]({Path(os.path.relpath(table.with_suffix('.md'), page_dir)).as_posix()})"
            else:
                paper, here, origin, link = "", "not regenerated yet", "", f"`specrepro reproduce {path.stem}`"
            lines.append(f"| {spec['paper']} | {item.claim} | {item.status} | {paper} | {here} | {origin} | {link} |")
    return "\n".join(lines + ["", "- Regenerate: `specrepro summary` (after `specrepro reproduce <paper>`)", ""])


def main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="specrepro summary", description="Copy each pipeline's headline cells from the committed tables."
    )
    parser.add_argument(
        "--results-dir",
        default="results",
        type=results_directory,
        help="where the tables are (<dir>/<paper>/<table>.csv)",
    )
    parser.add_argument("--out", default=None, help=f"the page to write (default <results dir>/{SUMMARY_PAGE})")
    opts = parser.parse_args(args)
    if not Path(opts.results_dir).is_dir():
        raise SpecReproError(f"{opts.results_dir}: no such results directory")
    out = Path(opts.out or Path(opts.results_dir) / SUMMARY_PAGE)
    page = summary_page(opts.results_dir, out.parent)
    with unwritable_in_one_line(str(out), "--out PAGE writes it elsewhere"):  # read-only (archived) tables
        atomic_write(out, page)
    print(f"wrote {out}")
