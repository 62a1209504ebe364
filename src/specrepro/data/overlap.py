"""Decontamination: whether a training prompt shares a passage with an evaluation question.

Texts are compared case- and whitespace-folded; a question contributes its passages of `WIDTH` characters every
`WIDTH // 2`, so any shared stretch of 1.5 x WIDTH characters or more is found.

    python -m specrepro.data.overlap TRAIN_PATH TRAIN_TASK EVAL_PATH EVAL_TASK OUT.json

writes the ids of the records of one dataset file that share no passage with another's: the `dataset.ids_path`
that keeps a training set clean (`alpaca_eval/ids_not_in_spec_bench.json` was written so).
"""

from __future__ import annotations

import json
import sys

from specrepro.data import DatasetConfig, load_records
from specrepro.data.records import Record

WIDTH = 60


def folded(text: str) -> str:
    return " ".join(text.lower().split())


def record_text(record: Record) -> str:
    """Everything a record puts in a prompt: its turns and any context passages."""
    return folded(" ".join([*record.turns, *record.fields.get("contexts", [])]))


def passages(records: list[Record]) -> set[str]:
    texts = [folded(turn) for record in records for turn in record.turns]
    return {text[i : i + WIDTH] for text in texts for i in range(0, max(1, len(text) - WIDTH + 1), WIDTH // 2)}


def shares_a_passage(record: Record, known: set[str]) -> bool:
    text = record_text(record)
    return any(text[i : i + WIDTH] in known for i in range(max(1, len(text) - WIDTH + 1)))


def every_passage(records: list[Record]) -> set[str]:
    """Every WIDTH-character passage of the records' text (turns and contexts), at every offset: `quotes` then reads
    a text's passages every WIDTH // 2 characters, a 30th of the lookups `shares_a_passage` makes on a long corpus,
    and finds every shared stretch of 1.5 x WIDTH characters or more as it does."""
    texts = [record_text(record) for record in records]
    return {text[i : i + WIDTH] for text in texts for i in range(max(1, len(text) - WIDTH + 1))}


def quotes(text: str, every: set[str]) -> bool:
    """Whether `text` shares a stretch of 1.5 x WIDTH characters or more with the records of `every_passage`."""
    text = folded(text)
    return any(text[i : i + WIDTH] in every for i in range(0, max(1, len(text) - WIDTH + 1), WIDTH // 2))


def main(args: list[str]) -> None:
    train_path, train_task, eval_path, eval_task, out = args
    known = passages(load_records(DatasetConfig(name="eval", path=eval_path, task=eval_task)))
    records = load_records(DatasetConfig(name="train", path=train_path, task=train_task))
    clean = [record.id for record in records if not shares_a_passage(record, known)]
    with open(out, "w") as handle:
        json.dump(clean, handle)
        handle.write("\n")
    print(f"{len(clean)} of {len(records)} records share no passage with {eval_path}: {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
