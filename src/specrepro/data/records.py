"""Records: one evaluation item per dataset row, in the same shape whatever the source layout."""

import dataclasses
import logging
import random
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

from specrepro.data.config import METRICS, PROMPT_STYLES, TASKS
from specrepro.data.files import HF_PREFIX, read_json_document, read_rows, resolve_path
from specrepro.data.prompts import check_template
from specrepro.errors import SpecReproError

log = logging.getLogger(__name__)


@dataclass
class Record:
    """One evaluation item (see DATA.md for each task's `fields`)."""

    id: str  # unique within its dataset
    turns: list[str]  # the raw user turns (templates are applied by render_prompt): 1 for most sets, 2 for MT-Bench
    reference: Optional[str] = None  # the gold answer/summary/solution/SQL the metric compares with, if any
    fields: dict = field(default_factory=dict)  # task extras, e.g. humaneval: prompt, test, entry_point, ...


def reference_response(record: Record) -> Optional[str]:
    """The human-written answer of a record as plain text: GSM8K's worked solution without calculator notes (also
    as Spec-Bench's math_reasoning holds it); for an MT-Bench question, GPT-4's reference answer where the dataset
    attaches one (`reference_turns`), not the hints its file gives the judge."""
    category = record.fields.get("category")
    if "answer" in record.fields or (category == "math_reasoning" and record.reference):
        return re.sub(r"<<[^>]*>>", "", record.fields.get("answer", record.reference))
    if category in MT_BENCH_CATEGORIES:
        return (record.fields.get("reference_turns") or [None])[0]
    return record.reference


def load_records(cfg) -> list[Record]:
    """The records a run evaluates: read, shaped for the task, filtered, exemplars split off, shuffled, limited.

    `cfg` is a DatasetConfig or the Hydra node built from one.
    """
    _check_config(cfg)
    records = _read_records(cfg.path, cfg.task, cfg.hf_config, cfg.split)
    if cfg.task == "spider":
        _attach_spider_schemas(records, cfg.path)
    if cfg.category is not None:
        records = _in_category(records, cfg.category, cfg.path, cfg.category_groups)
    if cfg.ids_path is not None:
        records = _with_listed_ids(records, cfg.ids_path)
    if cfg.reference_path is not None:
        _attach_reference_turns(records, cfg.reference_path)
    if cfg.max_turns is not None:
        for record in records:
            record.turns = record.turns[: cfg.max_turns]
    if cfg.few_shot > 0:
        records = _split_off_shots(records, cfg)
    if not records:
        raise SpecReproError(f"dataset '{cfg.name}' ({cfg.path}) has no records left to evaluate")
    if cfg.seed is not None:
        random.Random(cfg.seed).shuffle(records)
    if cfg.limit is not None:
        if cfg.limit > len(records):
            log.warning(
                "dataset '%s': limit %d is more than its %d records; using all %d",
                cfg.name,
                cfg.limit,
                len(records),
                len(records),
            )
        records = records[: cfg.limit]
    seen = set()
    for record in records:  # a run resumes, and pairs with its `ar` reference, record by record id
        if record.id in seen:
            raise SpecReproError(
                f"dataset '{cfg.name}' ({cfg.path}): record id '{record.id}' appears twice; each record needs an id "
                "of its own"
            )
        seen.add(record.id)
    return records


def gsm8k_final_answer(solution: str) -> str:
    """The number after GSM8K's "####" marker, without thousands separators."""
    return solution.split("####")[-1].strip().replace(",", "")


# ---- one adapter per row layout: row, index in file -> Record (None = skip the row) ----


class NotText(Exception):
    """A row's prompt field holds no text (null, a list, a number): the record cannot be prompted."""


def _text(row: dict, key: str, value=...) -> str:
    """`row[key]` (or `value`, an item of it), which must be a string: a null or a list is not formatted as a prompt."""
    value = row[key] if value is ... else value
    if not isinstance(value, str):
        shown = "null" if value is None else f"a {type(value).__name__} ({str(value)[:40]})"
        raise NotText(f"field '{key}' is {shown}, not text")
    return value


def _gsm8k(row: dict, index: int) -> Record:
    return Record(
        str(index), [_text(row, "question")], gsm8k_final_answer(_text(row, "answer")), {"answer": row["answer"]}
    )


def _humaneval(row: dict, index: int) -> Record:
    """HumanEval, or HumanEval-X, whose test ends by calling check(<entry point>) itself: that call is
    removed so every test only defines check(candidate), as in HumanEval."""
    test, entry_point = _text(row, "test"), row.get("entry_point")
    if entry_point is None:
        call = re.search(r"\ncheck\((\w+)\)\s*$", test)
        if call is None:
            raise KeyError("entry_point")
        test, entry_point = test[: call.start()] + "\n", call[1]
    fields = {
        "prompt": row["prompt"],
        "test": test,
        "entry_point": entry_point,
        "canonical_solution": row["canonical_solution"],
    }
    return Record(str(row["task_id"]), [_text(row, "prompt")], row["canonical_solution"], fields)


def _xsum(row: dict, index: int) -> Record:
    return Record(str(row.get("id", index)), [_text(row, "document")], row["summary"])


def _cnn_dm(row: dict, index: int) -> Record:
    return Record(str(row.get("id", row.get("question_id", index))), [_text(row, "article")], row["highlights"])


def _question_file(row: dict, index: int) -> Record:
    """MT-Bench / Spec-Bench question.jsonl; `reference` holds the first reference when it is a string."""
    references = row.get("reference") or []
    first = references[0] if references and isinstance(references[0], str) and references[0] else None
    fields = {"category": row.get("category"), "references": references}
    if not isinstance(row["turns"], list) or not row["turns"]:
        raise NotText(
            f"field 'turns' is {'null' if row['turns'] is None else repr(row['turns'])[:40]}, not a list of texts"
        )
    return Record(str(row["question_id"]), [_text(row, "turns", turn) for turn in row["turns"]], first, fields)


def _mbpp(row: dict, index: int) -> Record:
    fields = {
        "test_list": row["test_list"],
        "test_setup_code": row.get("test_setup_code", ""),
        "challenge_test_list": row.get("challenge_test_list", []),
    }
    return Record(str(row["task_id"]), [_text(row, "text")], row["code"], fields)


def _pubmedqa(row: dict, index: int) -> Record:
    fields = {"contexts": row["CONTEXTS"], "final_decision": row["final_decision"], "year": row.get("YEAR")}
    return Record(str(row["id"]), [_text(row, "QUESTION")], row["LONG_ANSWER"], fields)


def _spider(row: dict, index: int) -> Record:
    return Record(str(index), [_text(row, "question")], row["query"], {"db_id": row["db_id"], "query": row["query"]})


def _sql_context(row: dict, index: int) -> Record:
    return Record(
        str(index),
        [_text(row, "question")],
        row["answer"],
        {"context": _text(row, "context"), "db_id": row.get("db_id")},
    )


MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
USER_ROLES = {"human", "user"}
ASSISTANT_ROLES = {"gpt", "assistant", "chatgpt", "bard"}


def _conversation(row: dict, index: int) -> Optional[Record]:
    """ShareGPT ({from, value}) or CLLM ({role, content}) conversations. A blank user turn is no prompt: it is left
    out of the turns (the whole conversation stays in `messages`), and rows without a user turn are skipped. The
    reference is the reply to the first turn: a conversation split into chunks may open with the reply that ended
    the chunk before."""
    key = "conversations" if "conversations" in row else "conversation"
    messages = row[key]
    if not isinstance(messages, list):
        raise NotText(f"field '{key}' is {'null' if messages is None else repr(messages)[:40]}, not a list of messages")
    speakers = [(m.get("from", m.get("role")), m.get("value", m.get("content"))) for m in messages]
    asked = [
        (i, turn)
        for i, (who, text) in enumerate(speakers)
        if who in USER_ROLES
        if (turn := _text(row, key, text)).strip()
    ]
    replies = [text for who, text in speakers if who in ASSISTANT_ROLES]
    if not asked:
        return None
    answer = next((text for who, text in speakers[asked[0][0] + 1 :] if who in ASSISTANT_ROLES), None)
    roles = {**dict.fromkeys(USER_ROLES, "user"), **dict.fromkeys(ASSISTANT_ROLES, "assistant"), "system": "system"}
    messages = [{"role": roles[who], "content": text} for who, text in speakers if who in roles]
    fields = {"conversation_id": row.get("id"), "replies": replies, "messages": messages}
    return Record(str(index), [turn for _, turn in asked], answer, fields)


def _alpaca(row: dict, index: int) -> Record:
    return Record(str(row.get("idx", index)), [_text(row, "instruction")], row.get("output"))


ADAPTERS: dict[str, Callable[[dict, int], Optional[Record]]] = {
    "gsm8k": _gsm8k,
    "humaneval": _humaneval,
    "xsum": _xsum,
    "cnn_dm": _cnn_dm,
    "mt_bench": _question_file,
    "spec_bench": _question_file,
    "mbpp": _mbpp,
    "pubmedqa": _pubmedqa,
    "spider": _spider,
    "sql_context": _sql_context,
    "sharegpt": _conversation,
    "alpaca": _alpaca,
}


# ---- steps of load_records ----


def _check_config(cfg) -> None:
    """Reject settings that cannot work, before any file is read."""
    for key, value, allowed in (
        ("task", cfg.task, TASKS),
        ("prompt_style", cfg.prompt_style, PROMPT_STYLES),
        ("metric", cfg.metric, METRICS),
    ):
        if value not in allowed:
            raise SpecReproError(f"dataset '{cfg.name}': {key} '{value}' is not one of {', '.join(allowed)}")
    if cfg.limit is not None and cfg.limit <= 0:
        raise SpecReproError(f"dataset '{cfg.name}': limit must be positive (or null for all), got {cfg.limit}")
    if cfg.few_shot < 0:
        raise SpecReproError(f"dataset '{cfg.name}': few_shot must be 0 or more, got {cfg.few_shot}")
    check_template(cfg.task, cfg.template, cfg.few_shot)


def _read_records(path: str, task: str, hf_config: Optional[str], split: str) -> list[Record]:
    adapt = ADAPTERS[task]
    records = []
    for index, row in enumerate(read_rows(path, hf_config, split)):
        if not isinstance(row, dict):
            raise SpecReproError(f"{path}: record {index} is not a JSON object of fields (got {type(row).__name__})")
        try:
            record = adapt(row, index)
        except KeyError as missing:
            raise SpecReproError(f"{path}: record {index} has no field {missing} that task '{task}' needs") from None
        except NotText as problem:
            raise SpecReproError(f"{path}: record {index}: {problem}; task '{task}' needs it as text") from None
        if record is not None:
            records.append(record)
    return records


def _attach_spider_schemas(records: list[Record], path: str) -> None:
    """fields["schema"] = {table: [columns]} from the tables.json that sits beside Spider's questions."""
    if path.startswith(HF_PREFIX):
        raise SpecReproError(f"spider needs a local questions file with tables.json beside it; got {path}")
    tables = read_json_document(resolve_path(str(resolve_path(path).parent / "tables.json")))
    schemas = {}
    for database in tables:
        columns = {name: [] for name in database["table_names_original"]}
        for table_index, column in database["column_names_original"]:
            if table_index >= 0:
                columns[database["table_names_original"][table_index]].append(column)
        schemas[database["db_id"]] = columns
    for record in records:
        record.fields["schema"] = schemas[record.fields["db_id"]]


def _in_category(records: list[Record], category: str, path: str, groups) -> list[Record]:
    """The records of `category`, or of every category in the group `groups[category]`."""
    wanted = set(groups[category]) if category in groups else {category}
    kept = [record for record in records if record.fields.get("category") in wanted]
    if not kept:
        present = sorted({str(record.fields.get("category")) for record in records}) + sorted(groups)
        raise SpecReproError(f"{path}: no records in category '{category}' (categories: {', '.join(present)})")
    return kept


def _with_listed_ids(records: list[Record], ids_path: str) -> list[Record]:
    """Keep the records whose id is a key (dict) or item (list) of the JSON file `ids_path`."""
    document = read_json_document(resolve_path(ids_path))
    if not isinstance(document, (list, dict)):
        raise SpecReproError(f"{ids_path}: expected a JSON list (or dict) of record ids, got {type(document).__name__}")
    listed = {str(item) for item in document}
    return [record for record in records if record.id in listed]


def _attach_reference_turns(records: list[Record], reference_path: str) -> None:
    """fields["reference_turns"]: the reference answer's turns (FastChat answer format), [] where there is none."""
    try:
        answers = {str(row["question_id"]): row["choices"][0]["turns"] for row in read_rows(reference_path)}
    except (KeyError, IndexError, TypeError) as error:
        raise SpecReproError(
            f"{reference_path}: not a FastChat answer file (question_id, choices[0].turns on every line): "
            f"{type(error).__name__} {error}"
        ) from None
    for record in records:
        record.fields["reference_turns"] = answers.get(record.id, [])


def _split_off_shots(records: list[Record], cfg) -> list[Record]:
    """Attach the exemplars as fields["shots"] (Record dicts) and return the records left to evaluate.

    Exemplars are the first `few_shot` records of `shots_path` (an "hf:" id reads its train split) or,
    without one, of the evaluated file itself, which then loses them.
    """
    if cfg.shots_path is None:
        shots, records = records[: cfg.few_shot], records[cfg.few_shot :]
    else:
        shots = _read_records(cfg.shots_path, cfg.task, cfg.hf_config, "train")[: cfg.few_shot]
    if len(shots) < cfg.few_shot:
        raise SpecReproError(f"dataset '{cfg.name}': few_shot={cfg.few_shot} but only {len(shots)} exemplar(s) exist")
    shot_dicts = [dataclasses.asdict(shot) for shot in shots]
    for record in records:
        record.fields["shots"] = shot_dicts
    return records
