"""Prompt templates (one function per paper protocol) and prompt rendering.

A template turns a record's first user turn (plus any exemplars in fields["shots"]) into the user text;
later turns (MT-Bench's second question) go to the model as they are. render_prompt then wraps the turns
in the tokenizer's chat template ("chat") or returns the text itself ("completion").
"""

import json
import re
from typing import Callable, Optional, Sequence

from tokenizers import Tokenizer

from specrepro.errors import SpecReproError

Template = Callable[[object, list], str]  # (record, shots as Record dicts) -> user text


# ---- templates ----


def _article_summary(record, shots) -> str:
    """Draft & Verify (002) code: "Article: ...\\nSummary: ...\\n" per exemplar (newlines removed from its summary)."""
    exemplars = "".join(f"Article: {s['turns'][0]}\nSummary: {_without_newlines(s['reference'])}\n" for s in shots)
    return f"{exemplars}Article: {record.turns[0]}\nSummary:"


def _without_newlines(text: str) -> str:
    return text.replace("\n", "")


def _article_summary_eesd(record, shots) -> str:
    """EESD (003) Fig. 6: as Draft & Verify, but a blank line between exemplar and query."""
    exemplars = "".join(f"Article: {s['turns'][0]}\nSummary: {s['reference']}\n\n" for s in shots)
    return f"{exemplars}Article: {record.turns[0]}\nSummary:"


def _space_summary(record, shots) -> str:
    """SPACE (000) paper, XSum: the document, then the instruction."""
    return f"Document: {record.turns[0]}\n Based on the previous text, provide a brief single summary"


def _summarize(record, shots) -> str:
    """Spec-Bench's summarization prompt ("Summarize: " and the article), for chat style."""
    return f"Summarize: {record.turns[0]}"


def _humaneval_completion(record, shots) -> str:
    """Codex / Draft & Verify (002): the raw prompt; the model continues the function body."""
    return record.fields["prompt"]


def _humaneval_space(record, shots) -> str:
    """SPACE (000) paper, HumanEval-X: an instruction line, then the prompt."""
    return (
        "Complete the following python code. Do not give any explanation or testing examples, "
        f"just complete the code.\n {record.fields['prompt']}"
    )


GSM8K_INSTRUCTION = 'Solve the math problem step by step. Write the final answer on the last line as "#### <number>".'


def _gsm8k_hash_answer(record, shots) -> str:
    """Harness default (002 and 003 give no GSM8K format): GSM8K's own "#### N" solution convention,
    exemplars from the train file with the <<calculator>> annotations removed."""
    exemplars = "".join(
        f"Question: {s['turns'][0]}\nAnswer: {re.sub(r'<<[^>]*>>', '', s['fields']['answer'])}\n\n" for s in shots
    )
    return f"{GSM8K_INSTRUCTION}\n\n{exemplars}Question: {record.turns[0]}\nAnswer:"


def _gsm8k_cllm(record, shots) -> str:
    """CLLM (004) eval/gsm8k/acc.py, prompt type "math-single"."""
    return f"Question:\n{record.turns[0]}\nAnswer:\nLet's think step by step.\n"


def _mbpp_tests(record, shots) -> str:
    """MBPP paper (Austin et al. 2021) task + tests prompt; none of 000-004 evaluates MBPP (a CLLM code stand-in)."""
    tests = "\n".join(record.fields["test_list"])
    return (
        f"You are an expert Python programmer, and here is your task: {record.turns[0]} "
        f"Your code should pass these tests:\n\n{tests}\n"
    )


def _pubmedqa_context(record, shots) -> str:
    """Stand-in for SAR (001) ChatDoctor medical QA, whose template is not given: the abstract, then the question."""
    context = "\n".join(record.fields["contexts"])
    return f"Context: {context}\nQuestion: {record.turns[0]}\nAnswer:"


def _spider_cllm(record, shots) -> str:
    """CLLM (004) eval/spider/speedup.py: instruction + schema + question in "### Instruction/### Response"."""
    schema = "".join(
        f"table named {table} with columns {columns}, " for table, columns in record.fields["schema"].items()
    )
    instruction = (
        "Could you translate the following question into SQL. Please only generate SQL, "
        f"don't include explanation in the answer. The SQL database has {schema}Question: {record.turns[0]}"
    )
    return f"### Instruction:\n{instruction}\n### Response:\n"


def _sql_context(record, shots) -> str:
    """Harness format for sql-create-context (SAR, 001, gives none): the CREATE TABLE context, then the question."""
    return (
        f"Tables:\n{record.fields['context']}\n\n"
        f"Write one SQL query that answers this question: {record.turns[0]}\nSQL:"
    )


def _as_is(record, shots) -> str:
    """SPACE (000) "no prompt template"; Spec-Bench/FastChat: the question in the model's chat template."""
    return record.turns[0]


TEMPLATES: dict[str, dict[str, Template]] = {
    "xsum": {
        "article_summary": _article_summary,
        "eesd": _article_summary_eesd,
        "space": _space_summary,
        "summarize": _summarize,
    },
    "cnn_dm": {"article_summary": _article_summary, "eesd": _article_summary_eesd},
    "humaneval": {"completion": _humaneval_completion, "space": _humaneval_space},
    "gsm8k": {"hash_answer": _gsm8k_hash_answer, "cllm": _gsm8k_cllm},
    "mbpp": {"tests": _mbpp_tests},
    "pubmedqa": {"context": _pubmedqa_context},
    "spider": {"cllm": _spider_cllm},
    "sql_context": {"schema": _sql_context},
    "mt_bench": {"as_is": _as_is},
    "spec_bench": {"as_is": _as_is},
    "sharegpt": {"as_is": _as_is},
    "alpaca": {"as_is": _as_is},
}
FEW_SHOT_TEMPLATES = {_article_summary, _article_summary_eesd, _gsm8k_hash_answer}


def check_template(task: str, template: Optional[str], few_shot: int) -> None:
    """Fail early on a template the task lacks, or exemplars the template would silently drop."""
    choices = TEMPLATES[task]
    if template is not None and template not in choices:
        raise SpecReproError(f"task '{task}' has no template '{template}' (choose from {', '.join(choices)})")
    if few_shot > 0 and _template(task, template) not in FEW_SHOT_TEMPLATES:
        name = template or "default"
        raise SpecReproError(f"the '{name}' template of task '{task}' takes no exemplars; set few_shot: 0")


def _template(task: str, template: Optional[str]) -> Template:
    """The named template, or the task's first (default) one."""
    choices = TEMPLATES[task]
    return choices[template] if template is not None else next(iter(choices.values()))


# ---- rendering ----


def render_prompt(record, tokenizer, cfg, history: Sequence[str] = ()) -> str:
    """The text the model continues for user turn len(history); `history` holds its previous answers.

    chat: the tokenizer's chat template (a plain "User: ...\\nAssistant:" transcript if it has none).
    completion: the templated text itself; with history, the plain transcript (raw text has no turns).
    """
    return _render(record, tokenizer, cfg, history, lambda text: text)


LITERAL = "\ue000"  # a private-use character: brackets the index of a special token's string (or its own) in the data


def prompt_ids(record, tokenizer, cfg, history: Sequence[str] = ()) -> list[int]:
    """The token ids of `render_prompt`'s text, the data's text tokenized as text: a special token's string in a
    record or an answer (`<|im_end|>`, `<|im_start|>system`) stays those characters, never a template's turn. Text
    without one tokenizes exactly as the whole rendered prompt does; text with one as the whole prompt would with
    those strings read as text where the data has them (`split_special_tokens`, for the data's alone). A tokenizer
    that begins every text with its BOS (LLaMA's) begins the prompt with it once: a chat template that writes it is
    not given a second."""
    specials = sorted(
        {token.content for token in getattr(tokenizer, "added_tokens_decoder", {}).values() if token.special},
        key=len,
        reverse=True,
    )
    literals: list[str] = []

    def bracket(match) -> str:
        literals.append(match[0])
        return f"{LITERAL}{len(literals) - 1}{LITERAL}"

    pattern = re.compile("|".join(map(re.escape, [*specials, LITERAL])))  # the data's own LITERAL is text too
    text = _render(record, tokenizer, cfg, history, lambda content: pattern.sub(bracket, content))
    if not literals:
        return with_bos(tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer)
    pieces = text.split(LITERAL)  # template text, a literal's index, template text, ...
    if getattr(tokenizer, "is_fast", False):
        return with_bos(_as_text_where_the_data_has_them(tokenizer, pieces, literals), tokenizer)
    ids = []
    for index, piece in enumerate(pieces):  # a slow tokenizer: each piece alone
        literal = index % 2 == 1
        ids += tokenizer(
            literals[int(piece)] if literal else piece, add_special_tokens=False, split_special_tokens=literal
        )["input_ids"]
    return with_bos(ids, tokenizer)


def _as_text_where_the_data_has_them(tokenizer, pieces: list[str], literals: list[str]) -> list[int]:
    """One encoding of the whole prompt by a copy of a fast tokenizer in which each special token the data writes is
    renamed to a character the text lacks: the template's use of it (renamed in the text too) keeps its id, the
    data's reads as text, and every other piece tokenizes as in the whole prompt (no piece tokenized alone, which
    gave a SentencePiece tokenizer a "▁" at each cut)."""
    whole = "".join(literals[int(p)] if i % 2 else p for i, p in enumerate(pieces))
    if not (written := sorted(set(literals) - {LITERAL})):  # only the data's own LITERAL: no special token to read
        return tokenizer(whole, add_special_tokens=False)["input_ids"]
    unused = (chr(c) for c in range(0xE001, 0xF900) if chr(c) not in whole)  # private-use characters
    renamed = {special: next(unused) for special in written}
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    for token in state["added_tokens"]:
        token["content"] = renamed.get(token["content"], token["content"])
    template = re.compile("|".join(map(re.escape, sorted(renamed, key=len, reverse=True))))
    text = "".join(
        literals[int(piece)] if index % 2 else template.sub(lambda m: renamed[m[0]], piece)
        for index, piece in enumerate(pieces)
    )
    copy = Tokenizer.from_str(json.dumps(state))
    ids = {copy.token_to_id(x): tokenizer.convert_tokens_to_ids(special) for special, x in renamed.items()}
    return [ids.get(i, i) for i in copy.encode(text, add_special_tokens=False).ids]  # a renamed token's own id


def with_bos(ids: list[int], tokenizer) -> list[int]:
    """`ids` led by the BOS token where the tokenizer puts one before every text and `ids` do not begin with it."""
    bos = tokenizer.bos_token_id
    if bos is None or ids[:1] == [bos] or tokenizer("")["input_ids"][:1] != [bos]:
        return ids
    return [bos, *ids]


def _render(record, tokenizer, cfg, history: Sequence[str], as_text: Callable[[str], str]) -> str:
    """`render_prompt`'s text, each piece of the data's text (and each answer) passed through `as_text` first."""
    turn = len(history)
    if turn >= len(record.turns):
        raise SpecReproError(f"record {record.id} has {len(record.turns)} turn(s); {turn} previous answers were given")
    first_turn = _template(cfg.task, cfg.template)(record, record.fields.get("shots", []))
    user_texts = [as_text(text) for text in (first_turn, *record.turns[1 : turn + 1])]
    history = [as_text(answer) for answer in history]
    if cfg.prompt_style == "completion" and turn == 0:
        return user_texts[0]
    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    for index, text in enumerate(user_texts):
        messages.append({"role": "user", "content": text})
        if index < turn:
            messages.append({"role": "assistant", "content": history[index]})
    if prompt_format(tokenizer, cfg) == "chat template":
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return plain_transcript(messages)


def prompt_format(tokenizer, cfg) -> str:
    """How a record's first turn is written: "completion" (the templated text), "chat template" (the tokenizer's),
    or "plain transcript" (a chat dataset on a tokenizer without a chat template)."""
    if cfg.prompt_style != "chat":
        return "completion"
    return "chat template" if getattr(tokenizer, "chat_template", None) else "plain transcript"


ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}


def plain_transcript(messages: list[dict]) -> str:
    """A chat without a chat template: "User: ...\\nAssistant: ...\\nUser: ...\\nAssistant:"."""
    lines = [f"{ROLE_NAMES[message['role']]}: {message['content']}" for message in messages]
    return "\n".join(lines + ["Assistant:"])
