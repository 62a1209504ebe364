"""What a metric sees of a generation: the dataset's cut, then a task's program or answer text.

Scoring code (`identity.SCORING_CODE`): a change here scores recorded answers again and decodes nothing again.
"""

import re
from typing import Optional, Sequence

# the Codex paper's stop sequences (Chen et al., 2021): a completion ends at the first top-level statement
CODEX_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
SCRIPT_STOPS = ("\nif __name__", "\nprint(")  # a whole program may define helpers; drop its demo code


def completion_for_scoring(record, text: str, cfg) -> str:
    """What the metric sees of a generation: `text` cut at cfg.cut_at, then per task
    humaneval -> the program to execute (prompt + completion, or the answer's code block);
    mbpp / spider / sql_context -> the code (the first ``` block if there is one); others -> stripped text."""
    text = cut(text, cfg.cut_at)
    if cfg.task == "humaneval":
        return humaneval_program(record, text)
    if cfg.task in ("mbpp", "spider", "sql_context"):
        code = fenced_code(text)
        return (text if code is None else code).strip()
    return text.strip()


def humaneval_program(record, completion: str) -> str:
    """The HumanEval program to run (its test and check(entry_point) are appended by the metric).

    A plain completion continues the prompt and stops at the first top-level class, def, comment, if or print.
    A chat answer's code block is taken as is when it defines the entry point (after the prompt, so the
    prompt's imports hold), else as the body that continues the prompt.
    """
    prompt, entry_point = record.fields["prompt"], record.fields["entry_point"]
    code = fenced_code(completion)
    if code is None:
        return prompt + cut(completion, CODEX_STOPS)
    if re.search(rf"^def {re.escape(entry_point)}\(", code, re.MULTILINE):
        return f"{prompt}\n{cut(code, SCRIPT_STOPS)}"
    return prompt + cut(code, CODEX_STOPS)


def cut(text: str, stops: Sequence[str]) -> str:
    """`text` up to the earliest occurrence of any of `stops`."""
    positions = [text.find(stop) for stop in stops if stop and stop in text]
    return text[: min(positions)] if positions else text


def fenced_code(text: str) -> Optional[str]:
    """The contents of the first ``` code block (an unclosed one runs to the end), or None."""
    match = re.search(r"```[^\n]*\n(.*?)(?:```|$)", text, re.DOTALL)
    return match[1] if match else None
