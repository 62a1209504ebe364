"""`specrepro compare RUN RUN`: is one method faster than another on the same prompts, and is that resolved?

A table shows each run's paired speedup with its own interval, and two overlapping intervals do not settle which
run is faster: both hold the spread over prompts that the two runs share. Paired turn by turn, the runs' difference
has an interval of its own (`metrics.speed.relative_speedup`). Each run must have timed `ar` beside every turn
(`timing.paired=true`, as every leaderboard run does) and decoded the same prompts as the other; a run is named by
its directory or by its name under `<results dir>/runs/`. A run's committed copy (a table's inputs under
`results/<paper>/runs/`) holds its timed turns in `turns.jsonl`, so committed runs compare without their generations.
Runs named together, comma-separated, pool their turns: one method over several datasets (each turn counts once,
so a dataset weighs by its number of turns) against another over the same datasets.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import yaml

from specrepro.config import results_directory
from specrepro.errors import SpecReproError
from specrepro.metrics.speed import relative_speedup
from specrepro.provenance import machine_label
from specrepro.tables import RunInfo, provenance_footer, setting_of
from specrepro.tracking import RunRecord, atomic_write, unwritable_in_one_line


# settings whose difference the ratio carries (the methods differ anyway); `hardware`: each run's speedup is over
# the `ar` of its own dtype and compiled or eager steps
COMPARED = ("model", "decoding", "timing", "hardware")


def find_run(name: str, results_dir: str) -> RunRecord:
    """The complete run at path `name`, or named `name` under `results_dir/runs/`."""
    for path in (Path(name), Path(results_dir) / "runs" / name):
        if path.is_dir():
            record = RunRecord(path)
            if not record.complete:
                raise SpecReproError(f"{path}: not a complete run (no finished metrics.json)")
            return record
    raise SpecReproError(f"{name}: no such run directory, nor a run of that name in {Path(results_dir) / 'runs'}")


def find_runs(names: str, results_dir: str) -> list[RunRecord]:
    """The complete runs named in `names`, comma-separated."""
    return [find_run(name, results_dir) for name in names.split(",")]


def label(records: list[RunRecord]) -> str:
    """One run's name, or a group's names in brackets."""
    names = [record.dir.name for record in records]
    return names[0] if len(names) == 1 else f"[{', '.join(names)}]"


def pooled_turns(records: list[RunRecord]) -> dict[tuple, dict]:
    """The timed turns of `records` by key (record id, prompt, sample, turn); a turn that two of them decoded would
    count twice, so it is refused."""
    turns, decoded_by = {}, {}
    for record in records:
        for turn in record.timed_turns():
            key = (turn["id"], turn["prompt"], turn["sample"], turn["turn"])
            if key in turns:
                raise SpecReproError(
                    f"{decoded_by[key]} and {record.dir.name} both decoded record {turn['id']}: "
                    "runs named together must decode different prompts"
                )
            turns[key], decoded_by[key] = turn, record.dir.name
    return turns


def compare(runs: list[RunRecord], others: list[RunRecord]) -> dict:
    """`relative_speedup` of `runs` over `others` on the turns both decoded, which must be the same turns."""
    turns, other_turns = pooled_turns(runs), pooled_turns(others)
    if turns.keys() != other_turns.keys():
        only = sorted({key[0] for key in turns.keys() ^ other_turns.keys()})
        raise SpecReproError(
            f"{label(runs)} and {label(others)} did not decode the same prompts "
            f"(record {only[0]} differs{f', and {len(only) - 1} more' if len(only) > 1 else ''})"
        )
    keys = sorted(turns)
    return relative_speedup([turns[k] for k in keys], [other_turns[k] for k in keys])


def report(runs: list[RunRecord], others: list[RunRecord], result: dict) -> str:
    """What the comparison shows, in a few lines."""

    def line(record: RunRecord) -> str:
        metrics = record.metrics()
        machine = (metrics.get("provenance") or {}).get("machine")  # none in a record made before provenance was
        half = metrics.get("speedup_paired_ci95")  # none in a record made before intervals were
        return (
            f"  {record.dir.name}: {metrics['speedup_paired']:.2f}x{f' ±{half:.2f}x' if half is not None else ''} "
            f"over its own ar ({machine_label(machine) if machine else 'machine unknown'})"
        )

    ratio, low, high = result["ratio"], result["low"], result["high"]
    verdict = "the first is faster" if low > 1 else "the second is faster" if high < 1 else "not resolved"
    interval = f"95% interval {low:.2f}x-{high:.2f}x" if math.isfinite(low) else "no interval from one turn"
    differ = differences(runs, others)
    return "\n".join(
        [
            f"{label(runs)} over {label(others)}, {result['turns']} turns on the same prompts:",
            *map(line, runs + others),
            f"  {ratio:.2f}x ({interval}): {verdict}; the same tokens on {result['same_tokens']:.0%} of the turns",
            "  (the geometric mean over turns of the ratio of the two paired speedups; each turn over the ar timed "
            "beside it in its own run)",
            *(
                [f"  note: the two sides differ in {', '.join(differ)}, not only in their method: so does the ratio"]
                if differ
                else []
            ),
        ]
    )


def differences(runs: list[RunRecord], others: list[RunRecord]) -> list[str]:
    """What differs between the two sides but the method: model, decoding or timing settings, or the machine."""

    def side(records: list[RunRecord]) -> dict[str, set]:
        values: dict[str, set] = {}
        for record in records:
            path = record.dir / "config.yaml"
            config = yaml.safe_load(path.read_text()) if path.is_file() else {}
            setting = setting_of(config or {}, COMPARED)
            machine = (record.metrics().get("provenance") or {}).get("machine")
            for key, value in (setting | {"machine": machine_label(machine) if machine else None}).items():
                values.setdefault(key, set()).add(value)
        return values

    mine, theirs = side(runs), side(others)
    return sorted(key for key in mine.keys() & theirs.keys() if mine[key] != theirs[key])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="specrepro compare", description=__doc__.splitlines()[0])
    parser.add_argument(
        "run",
        help="the run whose speedup is measured (a run directory or a run name; several, "
        "comma-separated, pool their turns: a method over several datasets)",
    )
    parser.add_argument("other", help="the run (or runs) it is measured against, on the same prompts")
    parser.add_argument(
        "--results-dir",
        default="results",
        type=results_directory,
        help="where run names are looked up (default: results)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="also write the comparison to this markdown file, with the runs' "
        "provenance and the command that regenerates it",
    )
    opts = parser.parse_args(argv)
    runs, others = find_runs(opts.run, opts.results_dir), find_runs(opts.other, opts.results_dir)
    text = report(runs, others, compare(runs, others))
    print(text)
    if opts.out:
        command = f"specrepro compare {opts.run} {opts.other} --results-dir {opts.results_dir} --out {opts.out}"
        write_page(opts.out, runs, others, text, command)


def write_page(path: Path, runs: list[RunRecord], others: list[RunRecord], text: str, command: str) -> None:
    """The comparison as a committed page: the report, then where its numbers come from (as a table's footer)."""
    infos = [RunInfo(record.dir.name, record.metrics(), {}, 0.0, record.dir) for record in runs + others]
    lines = [
        f"# {label(runs)} over {label(others)}",
        "",
        "```text",
        text,
        "```",
        "",
        "Provenance:",
        "",
        *provenance_footer(infos, command),
    ]
    with unwritable_in_one_line(f"the comparison to {path}"):
        atomic_write(path, "\n".join(lines) + "\n")
