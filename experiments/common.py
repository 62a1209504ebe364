"""What the benchmark scripts share: GSM8K prompts, transformers' `generate` timed as a user calls it, a run
config composed as `specrepro run` composes it, and one-line errors. The scripts run as
`python experiments/<name>.py`, which puts this directory on the import path."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from transformers import CompileConfig

from specrepro.cli import CONF_DIR
from specrepro.config import register_configs
from specrepro.data import DatasetConfig, load_records, prompt_ids
from specrepro.decoding.device import device_sync
from specrepro.errors import SpecReproError, one_line
from specrepro.provenance import machine_label


def gsm8k_prompts(tokenizer, limit: int, few_shot: int = 0) -> list[list[int]]:
    """Token ids of the first `limit` GSM8K test questions, rendered as the gsm8k dataset config renders them."""
    dataset = DatasetConfig(
        name="gsm8k",
        path="gsm8k/test.jsonl.gz",
        task="gsm8k",
        template="hash_answer",
        few_shot=few_shot,
        shots_path="gsm8k/train.jsonl.gz",
        limit=limit,
        metric="gsm8k_acc",
    )
    return [prompt_ids(record, tokenizer, dataset) for record in load_records(dataset)]


def timed_generate(
    model, ids: list[int], max_new_tokens: int, eos: list[int], static: bool = False, backend: str = "inductor"
) -> tuple[list[int], float]:
    """(new tokens, seconds) of transformers' greedy `generate`; `static`: with a static cache, which makes
    transformers compile its forward with `backend` on the first call."""
    tensor = torch.tensor([ids], device=model.device)
    extra = (
        {"cache_implementation": "static", "compile_config": generate_compile_config(model.device, backend)}
        if static
        else {}
    )
    device_sync(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            tensor,
            attention_mask=torch.ones_like(tensor),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=eos,
            **extra,
        )
    device_sync(model.device)
    return out[0, len(ids) :].tolist(), time.perf_counter() - start


def generate_compile_config(device: torch.device, backend: str) -> CompileConfig:
    """How `generate` compiles its forward, as our compiled steps do on `device`: CUDA graphs on CUDA, plain
    `torch.compile` elsewhere. Off CUDA-like devices transformers skips compiling (with one warning) unless its
    config's `_compile_all_devices` flag is set: set here, or a "compiled" arm would time the eager forward."""
    cuda = device.type == "cuda"
    config = CompileConfig(fullgraph=True, backend=backend, mode="reduce-overhead" if cuda else "default")
    config._compile_all_devices = not cuda
    return config


def provenance_lines(prov: dict, date: str, machine_extra: str = "", versions_extra: str = "") -> list[str]:
    """A benchmark page's closing lines from the provenance block of its JSON: machine, versions, commit, date and
    the command that regenerates it; `machine_extra` and `versions_extra` follow the machine and versions."""
    return [
        f"- Machine: {machine_label(prov['machine'])}; threads: {prov['threads']}{machine_extra}",
        f"- Versions: torch {prov['versions']['torch']}, transformers {prov['versions']['transformers']}"
        f"{versions_extra}",
        f"- Commit: {prov['code'].get('commit')}{' (dirty tree)' if prov['code'].get('dirty') else ''}; date: {date}",
        f"- Regenerate: `{prov['command']}`",
    ]


def compose_config(name: str, overrides: list[str]):
    """The `name` config ("run" or "train") with `overrides`, as the specrepro command composes it."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def composed(group: str, spec: str):
    """The `group` config of a preset with overrides, as `specrepro run` composes it: ("method", "eesd
    method.draft_vocab=4096") is the eesd preset with that override."""
    name, *overrides = spec.split()
    return compose_config("run", [f"{group}={name}", *overrides])[group]


def positive_int(value: str) -> int:
    """An argparse type: a positive integer (a budget of new tokens); argparse refuses anything else in its usage
    error, where a budget of 0 would end in a traceback from the first generation."""
    number = int(value)
    if number < 1:
        raise ValueError(value)
    return number


def run_script(main) -> None:
    """Run a script's `main`: a user's mistake (an unknown preset or override, a missing artifact) ends as one
    line on stderr and exit status 2, as the specrepro command's do."""
    try:
        main()
    except (SpecReproError, HydraException) as exc:
        print(f"{Path(sys.argv[0]).name}: error: {one_line(exc)}", file=sys.stderr)
        sys.exit(2)
