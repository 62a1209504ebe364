"""Bundled datasets, their loaders and prompt templates (provenance in DATA.md)."""

from specrepro.data.config import DatasetConfig
from specrepro.data.files import BUNDLED_DIR
from specrepro.data.prompts import prompt_format, prompt_ids, render_prompt
from specrepro.data.records import Record, gsm8k_final_answer, load_records, reference_response

__all__ = [
    "BUNDLED_DIR",
    "DatasetConfig",
    "Record",
    "gsm8k_final_answer",
    "load_records",
    "prompt_format",
    "prompt_ids",
    "reference_response",
    "render_prompt",
]
