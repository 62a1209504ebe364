"""Figures drawn from a regenerated table's CSV, written beside it (`<table>_<plot>.png`).

A table spec may list plots; each reads the "(here)" cells of the columns it names, so a figure shows exactly
the committed numbers (notebooks/analysis.ipynb draws the same ones from the same CSV):

    plots:
      - {name: speedup_by_category, kind: bars, columns: [Math speedup, RAG speedup], ylabel: "speedup (x)"}
      - {name: speedup_vs_training, kind: scatter, x: Training minutes, y: Mean speedup}
      - {name: learning_curve, kind: trend, x: Training tokens, columns: [Mean MAT, Mean speedup],
         extrapolate: {"EAGLE's budget": 34000000}}

`bars`: one group per column, one bar per row; `scatter`: one point per row; `trend`: one panel per column of `columns`
against `x` on a log axis, with the least-squares line y = a + b log10(x), the 95% confidence band of that line, and
its value at each `extrapolate` x (95% interval), also written as `<table>_<plot>.md` with the table's provenance;
`targets: {Mean speedup: {csv: results/specbench/spec_bench.csv, row: pld}}` reads that row's cell of the same column
from another committed table, draws it, and gives the x at which the line (and each edge of its band) reaches it.
Every row has a colour of its own (and a scatter point a marker of its own), named in a legend beside the axes: no
two rows look alike and no label covers another. A row is named by its label cells (`label_cells: N`: the first N
only). Rows without a number are left out (and named in the figure's caption line).
"""

from __future__ import annotations

import csv
import math
import textwrap
from pathlib import Path

import matplotlib
import numpy as np
from scipy import optimize, stats

from specrepro.errors import SpecReproError

matplotlib.use("Agg")  # files only: no display on a server or in CI
import matplotlib.pyplot as plt  # noqa: E402

KINDS = {"bars": ("columns",), "scatter": ("x", "y"), "trend": ("x", "columns")}
MARKERS = "osD^vP*Xph<>"


def row_colours(n: int) -> list:
    """`n` colours, no two alike: tab10's, tab20's up to 20, else evenly spaced hues."""
    if n <= 10:
        return [plt.get_cmap("tab10")(i) for i in range(n)]
    if n <= 20:
        return [plt.get_cmap("tab20")(i) for i in range(n)]
    return [plt.get_cmap("hsv")(i / n) for i in range(n)]


def table_rows(text: str) -> list[list[str]]:
    """A table CSV's header and rows, without its `#` provenance footer."""
    return [row for row in csv.reader(line for line in text.splitlines() if not line.startswith("#")) if row]


def read_here(csv_path: Path, row_header: list[str]) -> tuple[list[tuple[str, ...]], dict[str, list[float | None]]]:
    """(each row's label cells, {column label: its "(here)" numbers, None where empty}) of a table's CSV."""
    rows = table_rows(csv_path.read_text())
    header, body = rows[0], rows[1:]
    labels = [tuple(row[: len(row_header)]) for row in body]
    here = {}
    for index, name in enumerate(header):
        if name.endswith(" (here)"):
            here[name.removesuffix(" (here)")] = [number(row[index]) for row in body]
    return labels, here


def number(cell: str) -> float | None:
    """A cell as written by `specrepro table` ("1.23x", "1.23x ±0.05x", "0.98", "–") as a float (its value, not
    its confidence interval); None when it holds no number."""
    try:
        return float(cell.split("±")[0].strip().rstrip("x%"))
    except ValueError:
        return None


def draw(plot, label_cells: list[tuple[str, ...]], here: dict[str, list], title: str) -> plt.Figure:
    """One plot (a spec's `tables.Plot`) of the table's numbers."""
    labels = [" / ".join(cell for cell in cells[: plot.label_cells] if cell) for cells in label_cells]
    if plot.kind == "bars":
        columns = plot.columns
        shown = [i for i in range(len(labels)) if any(here[c][i] is not None for c in columns)]
        figure, axes = plt.subplots(figsize=(max(6.0, 1.1 * len(columns) + 0.15 * len(columns) * len(shown)) + 3, 4.5))
        width = 0.8 / max(1, len(shown))
        for slot, (i, colour) in enumerate(zip(shown, row_colours(len(shown)))):
            values = [here[c][i] if here[c][i] is not None else math.nan for c in columns]  # no bar, not one at 0
            axes.bar(
                [k + slot * width - 0.4 + width / 2 for k in range(len(columns))],
                values,
                width,
                label=labels[i],
                color=colour,
            )
        axes.set_xticks(range(len(columns)), [c.removesuffix(" speedup") for c in columns])
        if plot.reference is not None:
            axes.axhline(plot.reference, color="black", linewidth=0.8, linestyle="--")
        axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        xs, ys = here[plot.x], here[plot.y]
        shown = [i for i in range(len(labels)) if xs[i] is not None and ys[i] is not None]
        figure, axes = plt.subplots(figsize=(10, 4.5))
        for slot, (i, colour) in enumerate(zip(shown, row_colours(len(shown)))):
            axes.scatter(xs[i], ys[i], color=colour, marker=MARKERS[slot % len(MARKERS)], s=40, label=labels[i])
        axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        axes.set_xlabel(plot.x if plot.xlabel is None else plot.xlabel)
        if plot.reference is not None:
            axes.axhline(plot.reference, color="black", linewidth=0.8, linestyle="--")
    axes.set_ylabel(plot.ylabel if plot.ylabel is not None else plot.y or "")
    left_out = [labels[i] for i in range(len(labels)) if i not in shown]
    if plot.kind == "bars":  # a row shown with some cells empty: which
        left_out += [
            f"{labels[i]} / {c.removesuffix(' speedup')}" for i in shown for c in plot.columns if here[c][i] is None
        ]
    line_chars = int(13 * (figure.get_figwidth() - 3))  # what a 9-point line holds across the axes (legend beside)
    caption = textwrap.fill(f"(no number yet: {', '.join(left_out)})", line_chars) if left_out else ""
    axes.set_title(f"{textwrap.fill(title, line_chars)}\n{caption}".strip(), fontsize=9)
    figure.tight_layout()
    return figure


def log_linear_fit(xs: list[float], ys: list[float]) -> dict | None:
    """The least-squares line y = a + b log10(x) through the points (x > 0), with what a 95% interval of its value at
    a new x needs (`predict`); None with fewer than three points (no spread left to estimate) or one x (no slope)."""
    if len(xs) < 3 or len(set(xs)) < 2:
        return None
    u, y = np.log10(np.asarray(xs, dtype=float)), np.asarray(ys, dtype=float)
    slope, intercept = np.polyfit(u, y, 1)
    residual = y - (intercept + slope * u)
    spread = math.sqrt(float(residual @ residual) / (len(u) - 2))
    sxx, t = float(((u - u.mean()) ** 2).sum()), float(stats.t.ppf(0.975, len(u) - 2))

    def predict(x: float) -> tuple[float, float]:
        """The line's value at `x` and the half-width of its 95% confidence interval."""
        at = math.log10(x)
        return intercept + slope * at, t * spread * math.sqrt(1 / len(u) + (at - u.mean()) ** 2 / sxx)

    return {
        "slope": float(slope),
        "intercept": float(intercept),
        "spread": spread,
        "slope_ci95": t * spread / math.sqrt(sxx),
        "predict": predict,
    }


def target_cell(column: str, source: dict) -> float:
    """The number in another committed table's CSV (`source["csv"]`, from the directory the command runs in) at the
    row whose first label cell is `source["row"]` and the "(here)" column labelled `column`."""
    path = Path(source["csv"])
    if not path.is_file():
        raise SpecReproError(f"a trend's target table {path} does not exist (paths are from the repository root)")
    labels, here = read_here(path, ["row"])
    if column not in here:
        raise SpecReproError(f"a trend's target table {path} has no column '{column}'")
    for cells, value in zip(labels, here[column]):
        if cells[0] == source["row"]:
            if value is None:
                raise SpecReproError(f"a trend's target cell {path}: {source['row']} / {column} holds no number")
            return value
    raise SpecReproError(f"a trend's target table {path} has no row '{source['row']}'")


def reaching(fit: dict, target: float, start: float, decades: float = 40.0) -> list[float | None]:
    """The x at which the fitted line reaches `target`, and at which the upper and the lower edge of its 95% band
    first do (the earliest and the latest x the fit allows), searched from `start` up; None where one never does
    within `decades` (the line falls, or its band widens faster than it rises)."""
    grid = np.linspace(math.log10(start), math.log10(start) + decades, 4001)
    found = []
    for edge in (0, 1, -1):

        def gap(u: float, edge=edge) -> float:
            value, half = fit["predict"](10**u)
            return value + edge * half - target

        gaps = [gap(u) for u in grid]
        if gaps[0] >= 0:
            found.append(start)
            continue
        crossing = next((i for i in range(1, len(grid)) if gaps[i] >= 0), None)
        found.append(None if crossing is None else 10 ** optimize.brentq(gap, grid[crossing - 1], grid[crossing]))
    return found


def _budget(x: float | None, start: float) -> str:
    """An x the fit reaches a target at, to two significant figures ("never" past the search, "<= " the start)."""
    if x is None:
        return "never"
    rounded = float(f"{x:.2g}")
    return f"<= {start:,.0f}" if x <= start else f"{rounded:,.0f}"


def draw_trend(plot, here: dict[str, list], title: str) -> tuple[plt.Figure, list[str]]:
    """A trend plot (one panel per column of `columns`) and the lines of its fit's page."""
    columns, extrapolate = plot.columns, plot.extrapolate or {}
    targets = {column: target_cell(column, source) for column, source in (plot.targets or {}).items()}
    reached = []
    figure, panels = plt.subplots(1, len(columns), figsize=(4.2 * len(columns) + 1, 4.2), squeeze=False)
    lines = [
        "| Quantity | points | slope per 10x (95% CI) | " + " | ".join(f"at {k} (95% CI)" for k in extrapolate) + " |",
        "|---|---|---|" + "---|" * len(extrapolate),
    ]
    for axes, column in zip(panels[0], columns):
        points = [(x, y) for x, y in zip(here[plot.x], here[column]) if x is not None and y is not None]
        off_axis = sum(x <= 0 for x, _ in points)  # a log axis has no place for them
        points = [(x, y) for x, y in points if x > 0]
        count = f"{len(points)}" + (f" (and {off_axis} at x <= 0, off the log axis)" if off_axis else "")
        axes.scatter([x for x, _ in points], [y for _, y in points], color="black", s=30, zorder=3, label="measured")
        axes.set_xscale("log")
        axes.set_xlabel(plot.x if plot.xlabel is None else plot.xlabel)
        axes.set_title(column, fontsize=9)
        fit = log_linear_fit([x for x, _ in points], [y for _, y in points])
        if fit is None:
            why = "fewer than 3 points" if len(points) < 3 else "one x value"
            lines.append(f"| {column} | {count} | {why}: no fit |" + " – |" * len(extrapolate))
            continue
        reach = [x for x, _ in points] + list(extrapolate.values())
        grid = np.logspace(math.log10(min(reach)), math.log10(max(reach)), 100)
        centre, half = zip(*(fit["predict"](x) for x in grid))
        axes.plot(grid, centre, color="tab:blue", label="a + b log10(x)")
        axes.fill_between(
            grid,
            np.subtract(centre, half),
            np.add(centre, half),
            color="tab:blue",
            alpha=0.2,
            label="95% CI of the line",
        )
        cells = []
        for slot, (name, x) in enumerate(extrapolate.items()):
            value, margin = fit["predict"](x)
            axes.errorbar(
                [x],
                [value],
                yerr=[margin],
                fmt="D",
                color=row_colours(len(extrapolate))[slot],
                capsize=3,
                label=f"extrapolated: {name}",
            )
            cells.append(f"{value:.3g} ({value - margin:.3g} to {value + margin:.3g})")
        lines.append(
            f"| {column} | {count} | {fit['slope']:+.3g} ({fit['slope'] - fit['slope_ci95']:+.3g} to "
            f"{fit['slope'] + fit['slope_ci95']:+.3g}) | " + " | ".join(cells) + " |"
        )
        if plot.reference is not None:
            axes.axhline(plot.reference, color="black", linewidth=0.8, linestyle="--")
        if column in targets:
            source, value = plot.targets[column], targets[column]
            axes.axhline(value, color="tab:red", linewidth=0.8, linestyle=":", label=f"target: {source['row']}")
            start = min(x for x, _ in points)
            line, early, late = reaching(fit, value, start)
            reached.append(
                f"| {column} | {value:.3g} ({source['row']}, {source['csv']}) | {_budget(line, start)} "
                f"({_budget(early, start)} to {_budget(late, start)}) |"
            )
    panels[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.suptitle(textwrap.fill(title, 150), fontsize=9)
    figure.tight_layout()
    if reached:
        lines += [
            "",
            f"Where the line reaches a target, in {plot.x.lower()} (95% CI: where its band's upper and lower edge do):",
            "",
            f"| Quantity | target | {plot.x.lower()} (95% CI) |",
            "|---|---|---|",
            *reached,
        ]
    return figure, lines


def write_plots(plots: list, csv_path: Path, row_header: list[str], title: str) -> list[Path]:
    """Every plot of a table, as PNG files beside its CSV (and a trend's fit as a page); returns their paths."""
    labels, here = read_here(csv_path, row_header)
    written = []
    for plot in plots:
        if plot.kind == "trend":
            figure, lines = draw_trend(plot, here, title)
            page = csv_path.with_name(f"{csv_path.stem}_{plot.name}.md")
            footer = [f"- {line[2:]}" for line in csv_path.read_text().splitlines() if line.startswith("# ")]
            note = [plot.note.strip(), ""] if plot.note else []
            page.write_text(
                "\n".join(
                    [f"# {title}: fitted trend", "", *note, *lines, "", "Provenance (the table's):", "", *footer, ""]
                )
            )
            written.append(page)
        else:
            figure = draw(plot, labels, here, title)
        path = csv_path.with_name(f"{csv_path.stem}_{plot.name}.png")
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)
    return written
