"""The dataset config: the Hydra structured-config schema behind conf/dataset/*.yaml."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from omegaconf import MISSING

TASKS = (
    "gsm8k",
    "humaneval",
    "xsum",
    "cnn_dm",
    "mt_bench",
    "spec_bench",
    "mbpp",
    "pubmedqa",
    "spider",
    "sql_context",
    "sharegpt",
    "alpaca",
)
PROMPT_STYLES = ("chat", "completion")
METRICS = ("gsm8k_acc", "rouge", "pass_at_k", "mt_bench", "spec_bench", "none")


@dataclass
class DatasetConfig:
    """Where a dataset lives, which records to take, how to prompt for them and how to score."""

    # short label used in run records and tables
    name: str = MISSING
    # bundled path relative to specrepro/data/bundled (".gz" may be left off), an absolute path, or "hf:<hub id>"
    path: str = MISSING
    # Hub config name for "hf:" paths (e.g. "main" for openai/gsm8k); ignored for files
    hf_config: Optional[str] = None
    # Hub split for "hf:" paths; ignored for files
    split: str = "test"
    # record layout and prompt family, one of TASKS
    task: str = MISSING
    # "chat" = the tokenizer's chat template (plain "User:/Assistant:" if it has none); "completion" = raw text
    prompt_style: str = "chat"
    # named prompt variant of the task (see data/prompts.py); null = the task's default
    template: Optional[str] = None
    # number of worked exemplars placed before the query
    few_shot: int = 0
    # exemplars = the first `few_shot` records of this file ("hf:" ids: train split); null = of `path`, then not
    # evaluated
    shots_path: Optional[str] = None
    # evaluate at most this many records; more than the set holds -> clamped to the set size with a warning;
    # <= 0 -> error
    limit: Optional[int] = None
    # if set, shuffle the records with this seed before taking `limit`; null = file order
    seed: Optional[int] = None
    # quality metric, one of METRICS
    metric: str = "none"
    # a prediction is cut at the first of these strings before scoring (e.g. "\nArticle:")
    cut_at: list[str] = field(default_factory=list)
    # keep only records of this category (a Spec-Bench subtask or an MT-Bench category), or of a group of them
    # that category_groups names; null = all
    category: Optional[str] = None
    category_groups: Dict[str, List[str]] = field(default_factory=dict)
    # keep at most this many user turns per record (CLLM's ShareGPT prompts: 1); null = all
    max_turns: Optional[int] = None
    # MT-Bench: the reference-answer file whose turns become fields["reference_turns"]
    reference_path: Optional[str] = None
    # keep only records whose id is a key (or item) of this JSON file, e.g. PubMedQA's 500-id test split
    ids_path: Optional[str] = None
    # system message for chat style; null = none (the chat template's own default, if any)
    system_prompt: Optional[str] = None
