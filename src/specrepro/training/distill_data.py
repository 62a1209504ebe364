"""Distillation data: what the target model itself predicts, on bundled prompts.

Shared by every component trained to imitate the target (the sps draft, EESD's draft head, ...):
- on-policy: the target's own greedy continuations, generated in left-padded batches with
  transformers' `generate`;
- off-policy: human responses (GSM8K solutions, ShareGPT replies) labelled with the target's argmax
  at every position by one teacher-forced forward.
Both are cached as `datasets` datasets under the artifacts dir, keyed by the target and the settings; a cache is
made by one job at a time (`shards.exclusive`: another job needing it waits, then loads it).
Both can come from a bf16 copy of an fp32 target (`training.teacher_dtype`): ~2x the tokens per CPU second here (onednn
kernel, generation batch 16: 330-370 against ~180 tok/s), at the price of continuations and labels that
leave the fp32 target's greedy choice wherever bf16 rounding flips an argmax.
Features: the frozen target's last-layer hidden states at every response position of such rows, computed once
and shared by every head trained on the same rows (`target_hidden_states`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import shutil
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from specrepro import suspension
from specrepro.config import weights_identity
from specrepro.data import load_records, prompt_ids, reference_response, render_prompt
from specrepro.decoding.hf_assisted import run_settings_only
from specrepro.decoding.steps import decoder_body
from specrepro.errors import SpecReproError
from specrepro.identity import weights_key
from specrepro.models import resolve_dtype
from specrepro.models.kernels import warn_if_bf16_is_slow
from specrepro.reuse import note_reused
from specrepro.tracking import config_hash
from specrepro.training import cost
from specrepro.training.loop import LoopConfig, micro_batch_indices
from specrepro.training.shards import making_cache, map_batches, write_once

if TYPE_CHECKING:
    from datasets import Dataset

log = logging.getLogger(__name__)


def prompt_texts(prompt_sets: dict, tokenizer) -> list[tuple[str, str, list[int]]]:
    """(source, rendered first-turn prompt, its ids: `prompt_ids`) for every record of every configured prompt set."""
    texts = []
    for name, dataset_cfg in prompt_sets.items():
        for record in load_records(dataset_cfg):
            texts.append(
                (
                    name,
                    render_prompt(record, tokenizer, dataset_cfg, []),
                    prompt_ids(record, tokenizer, dataset_cfg, []),
                )
            )
    return texts


@torch.inference_mode()
def generate_continuations(
    model,
    tokenizer,
    prompts: list[tuple[str, list[int]]],
    max_new_tokens: int,
    batch_size: int,
    max_prompt_tokens: int,
    saved_in: Path | None = None,
):
    """Greedy continuations of `prompts` (text, ids): (prompt ids, continuation ids) per prompt, padding removed;
    and the seconds of the batches loaded from `saved_in` (`shards.map_batches`)."""
    texts = [text for text, _ in prompts]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop_ids = {pad_id, tokenizer.eos_token_id}
    device = next(model.parameters()).device
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # similar lengths batch with little padding

    def continue_batch(indices: list[int]) -> list[tuple[list[int], list[int]]]:
        encoded = [prompts[i][1][-max_prompt_tokens:] for i in indices]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in encoded], device=device)
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded], device=device)
        with run_settings_only(model):  # greedy as decoding's: no repetition penalty from generation_config.json
            output = model.generate(
                input_ids,
                attention_mask=attention,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        pairs = []
        for ids, row in zip(encoded, output[:, width:].tolist()):
            stops = [i for i, tok in enumerate(row) if tok in stop_ids]
            if stops:  # finished early: keep up to and including the first EOS, drop the padding
                row = row[: stops[0] + 1]
            pairs.append((ids, row))
        return pairs

    batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    results, earlier_seconds = map_batches(batches, continue_batch, "target continuations", saved_in)
    unsorted = [None] * len(texts)
    for position, index in enumerate(order):
        unsorted[index] = results[position]
    return unsorted, earlier_seconds


def heldout_count(n_rows: int, fraction: float) -> int:
    """How many of `n_rows` generated sequences `training.heldout_fraction` keeps out of training to measure the
    draft's agreement on: at least one, and at least one left to train on."""
    if not 0 < fraction < 1:
        raise SpecReproError(f"training.heldout_fraction must be between 0 and 1, got {fraction}")
    held = max(1, int(n_rows * fraction))
    if held >= n_rows:
        raise SpecReproError(
            f"training.heldout_fraction={fraction} of {n_rows} generated sequence(s) leaves none to train on: "
            "give the recipe more prompts"
        )
    return held


def distill_cache_dir(cfg, kind: str, prompt_sets, tokens: int, max_prompt_tokens, dtype: str = "") -> Path:
    """`<artifacts_dir>/.work/<kind>-<hash>`: cached target outputs (`continuations`, `labels`) depend on the
    target (its config, and its weights where they are an artifact or a checkpoint), the prompt sets (their
    settings and their records' content), the lengths and the dtype that computed them (`dtype`, default the
    run's) only, so every trainer asking for the same ones shares them."""
    from specrepro.identity import records_fingerprint

    key = config_hash(
        OmegaConf.to_container(
            OmegaConf.create(
                {
                    "model": weights_identity(cfg.model),
                    "prompts": prompt_sets,
                    "records": {name: records_fingerprint(load_records(each)) for name, each in prompt_sets.items()},
                    "tokens": tokens,
                    "max_prompt_tokens": max_prompt_tokens,
                    "dtype": dtype or cfg.hardware.dtype,
                    **weights_key(cfg),
                }
            ),
            resolve=True,
        )
    )
    return Path(cfg.artifacts_dir) / ".work" / f"{kind}-{key}"


def teacher_copy(model, dtype: str = ""):
    """`model` itself, or a copy cast to `dtype` (`training.teacher_dtype`; casting the target in place and back
    would round it)."""
    cast = resolve_dtype(dtype, "training.teacher_dtype") if dtype else None
    if cast == torch.bfloat16 and next(model.parameters()).device.type == "cpu":
        warn_if_bf16_is_slow("training.teacher_dtype")
    return model if cast is None or cast == next(model.parameters()).dtype else copy.deepcopy(model).to(cast)


def continuation_dataset(
    target,
    prompt_sets: dict,
    max_new_tokens: int,
    batch_size: int,
    max_prompt_tokens: int,
    cache_dir: Path,
    dtype: str = "",
) -> Dataset:
    """Rows {source, prompt_ids, continuation_ids}; generated once (by a copy of the target cast to `dtype`
    when that differs from the target's own), then loaded from `cache_dir`; a generation killed part-way resumes
    at its batch."""
    from datasets import Dataset, load_from_disk  # slow to import: only where it is used

    with making_cache(cache_dir, "the target continuations") as saved:
        if (cache_dir / "dataset_info.json").is_file():
            log.info("re-using target continuations from %s", cache_dir)
            note_reused(f"target continuations {cache_dir.name}")
            return load_from_disk(str(cache_dir))
        clock = suspension.clock()
        sources_and_texts = prompt_texts(prompt_sets, target.tokenizer)
        pairs, earlier_seconds = generate_continuations(
            teacher_copy(target.model, dtype),
            target.tokenizer,
            [(t, ids) for _, t, ids in sources_and_texts],
            max_new_tokens,
            batch_size,
            max_prompt_tokens,
            saved,
        )
        dataset = Dataset.from_dict(
            {
                "source": [s for s, _, _ in sources_and_texts],
                "prompt_ids": [p for p, _ in pairs],
                "continuation_ids": [c for _, c in pairs],
            }
        )

        def write() -> None:
            staging = cache_dir.with_name(f".{cache_dir.name}.staging")
            dataset.save_to_disk(str(staging))
            cost.record(staging, suspension.clock() - clock + earlier_seconds)
            (staging / "settings.json").write_text(
                json.dumps(
                    OmegaConf.to_container(
                        OmegaConf.create({"max_new_tokens": max_new_tokens, "prompt_sets": list(prompt_sets)})
                    )
                )
            )
            staging.rename(cache_dir)

        write_once(write)
        return load_from_disk(str(cache_dir))


def reference_rows(
    datasets: dict, tokenizer, max_prompt_tokens: int, response_tokens: int, end_token: int | None = None
) -> list[dict]:
    """Rows {source, prompt_ids, continuation_ids}: each record's own reference response after its prompt.

    `end_token` (e.g. the chat's end-of-turn id) is appended before truncation, so a model fine-tuned on the
    rows learns to stop where a response ends and never where one was cut.
    """
    rows = []
    for name, dataset_cfg in datasets.items():
        for record in load_records(dataset_cfg):
            response = reference_response(record)  # GSM8K: the worked solution, not just the final answer
            if response:
                prompt = prompt_ids(record, tokenizer, dataset_cfg, [])
                reply = tokenizer(response, add_special_tokens=False)["input_ids"]
                reply = (reply + ([end_token] if end_token is not None else []))[:response_tokens]
                rows.append({"source": name, "prompt_ids": prompt[-max_prompt_tokens:], "continuation_ids": reply})
    return rows


@torch.inference_mode()
def target_argmax_labels(
    model, rows: list[tuple[list[int], list[int]]], batch_size: int, saved_in: Path | None = None
) -> tuple[list[list[int]], float]:
    """The target's greedy prediction at every response position, teacher-forced on (prompt, response) pairs; and
    the seconds of the batches loaded from `saved_in` (`shards.map_batches`)."""
    device = next(model.parameters()).device

    def label_batch(batch: list[tuple[list[int], list[int]]]) -> list[list[int]]:
        width = max(len(p) + len(r) for p, r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (prompt, response) in enumerate(batch):
            ids[i, : len(prompt) + len(response)] = torch.tensor(prompt + response)
            attention[i, : len(prompt) + len(response)] = 1
        hidden = decoder_body(model)(input_ids=ids.to(device), attention_mask=attention.to(device)).last_hidden_state
        # position t predicts token t + 1: the positions from the prompt's last token to the response's last but one
        return [
            model.lm_head(hidden[i, len(prompt) - 1 : len(prompt) + len(response) - 1]).argmax(-1).tolist()
            for i, (prompt, response) in enumerate(batch)
        ]

    return map_batches(
        [rows[start : start + batch_size] for start in range(0, len(rows), batch_size)],
        label_batch,
        "target labels",
        saved_in,
    )


def teacher_labeled_dataset(
    target,
    prompt_sets: dict,
    max_response_tokens: int,
    batch_size: int,
    max_prompt_tokens: int,
    cache_dir: Path,
    dtype: str = "",
) -> Dataset:
    """Rows {source, prompt_ids, continuation_ids, label_ids}: human responses labelled with the target's argmax
    (of a copy cast to `dtype`, when given).

    Off-policy distillation data (DistillSpec): one batched teacher-forced forward per sequence gives a
    label for every response token, far cheaper than generating the same number of tokens.
    """
    from datasets import Dataset, load_from_disk  # slow to import: only where it is used

    with making_cache(cache_dir, "the target labels") as saved:
        if (cache_dir / "dataset_info.json").is_file():
            log.info("re-using target labels from %s", cache_dir)
            note_reused(f"target labels {cache_dir.name}")
            return load_from_disk(str(cache_dir))
        clock = suspension.clock()
        tokenizer = target.tokenizer
        sources, pairs = [], []
        for name, dataset_cfg in prompt_sets.items():
            for record in load_records(dataset_cfg):
                response = reference_response(record)
                if not response:
                    continue
                prompt = prompt_ids(record, tokenizer, dataset_cfg, [])
                response_ids = tokenizer(response, add_special_tokens=False)["input_ids"][:max_response_tokens]
                sources.append(name)
                pairs.append((prompt[-max_prompt_tokens:], response_ids))
        labels, earlier_seconds = target_argmax_labels(teacher_copy(target.model, dtype), pairs, batch_size, saved)
        dataset = Dataset.from_dict(
            {
                "source": sources,
                "prompt_ids": [p for p, _ in pairs],
                "continuation_ids": [r for _, r in pairs],
                "label_ids": labels,
            }
        )

        def write() -> None:
            staging = cache_dir.with_name(f".{cache_dir.name}.staging")
            dataset.save_to_disk(str(staging))
            cost.record(staging, suspension.clock() - clock + earlier_seconds)
            staging.rename(cache_dir)

        write_once(write)
        return load_from_disk(str(cache_dir))


def frequent_tokens(rows: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """A draft vocabulary (`decoding/draft_vocab.py`): the `size` token ids most frequent among the tokens the
    rows teach (`label_ids` where a row has them, else its continuation), most frequent first; prompt-token
    counts rank the rest, then the id; ids the rows never hold (a small training set) fill it up by id."""
    if not 0 < size <= vocab_size:
        raise SpecReproError(f"a draft vocabulary of {size} tokens does not fit the target's {vocab_size}")
    outputs = Counter(t for row in rows for t in (row.get("label_ids") or row["continuation_ids"]))
    inputs = Counter(t for row in rows for t in row["prompt_ids"])
    ranked = sorted(outputs | inputs, key=lambda t: (-outputs[t], -inputs[t], t))[:size]
    seen = set(ranked)
    unseen = (t for t in range(vocab_size) if t not in seen)
    return torch.tensor(ranked + [next(unseen) for _ in range(size - len(ranked))], dtype=torch.long)


def hidden_cache_dir(cfg, rows: list[dict], prompt_tokens: int, autocast: bool) -> Path:
    """`<artifacts_dir>/.work/hidden-<hash>`: the target's hidden states depend on the target, the rows' tokens, the
    prompt context and the precision of the forward only."""
    digest = hashlib.sha256(
        json.dumps([[r["prompt_ids"][-prompt_tokens:], r["continuation_ids"]] for r in rows]).encode()
    ).hexdigest()
    key = config_hash(
        {
            "model": weights_identity(cfg.model),
            "rows": digest,
            "dtype": "bf16_autocast" if autocast else cfg.hardware.dtype,
            **weights_key(cfg),
        }
    )
    return Path(cfg.artifacts_dir) / ".work" / f"hidden-{key}"


def continuation_hidden(model, rows: list[dict], prompt_tokens: int) -> list[torch.Tensor]:
    """Per row, the target's last-layer (post-norm) hidden states at the positions that predict its continuation
    tokens, (len(continuation), H), teacher-forced on [last `prompt_tokens` prompt tokens + continuation]
    (with gradients where the caller enables them)."""
    device = next(model.parameters()).device
    prompts = [r["prompt_ids"][-prompt_tokens:] for r in rows]
    seqs = [p + r["continuation_ids"] for p, r in zip(prompts, rows)]
    ids = torch.zeros((len(seqs), max(map(len, seqs))), dtype=torch.long)
    for i, seq in enumerate(seqs):  # right padding: a causal mask keeps it away from real positions
        ids[i, : len(seq)] = torch.tensor(seq)
    hidden = decoder_body(model)(input_ids=ids.to(device)).last_hidden_state
    # position t predicts token t + 1: from the prompt's last token to the continuation's last but one
    return [hidden[i, len(p) - 1 : len(s) - 1] for i, (p, s) in enumerate(zip(prompts, seqs))]


@torch.no_grad()
def target_hidden_states(
    model, rows: list[dict], prompt_tokens: int, batch_size: int, autocast: bool, cache_dir: Path
) -> list[torch.Tensor]:
    """`continuation_hidden` of every row under bf16 autocast when `autocast`, stored in the forward's dtype (bf16
    under autocast).

    A head trained on a frozen target needs them at every step; computing them once turns each training step
    into the head's own forward and backward. Cached in `cache_dir` (written atomically); a computation killed
    part-way resumes at its batch."""
    with making_cache(cache_dir, "the target hidden states") as saved:
        path = cache_dir / "hidden.safetensors"
        if path.is_file():
            log.info("re-using target hidden states from %s", cache_dir)
            note_reused(f"target hidden states {cache_dir.name}")
            stored = load_file(str(path))
            return list(torch.split(stored["hidden"], stored["lengths"].tolist()))
        clock = suspension.clock()
        device = next(model.parameters()).device
        order = sorted(
            range(len(rows)),
            key=lambda i: len(rows[i]["prompt_ids"][-prompt_tokens:]) + len(rows[i]["continuation_ids"]),
        )

        def hidden_batch(indices: list[int]) -> list[torch.Tensor]:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                return [h.cpu() for h in continuation_hidden(model, [rows[i] for i in indices], prompt_tokens)]

        batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
        states, earlier_seconds = map_batches(batches, hidden_batch, "target hidden states", saved)
        by_row = [None] * len(rows)
        for position, index in enumerate(order):
            by_row[index] = states[position]

        def write() -> None:
            staging = cache_dir.with_name(f".{cache_dir.name}.staging")
            staging.mkdir(parents=True, exist_ok=True)
            save_file(
                {"hidden": torch.cat(by_row).contiguous(), "lengths": torch.tensor([len(h) for h in by_row])},
                str(staging / path.name),
            )
            cost.record(staging, suspension.clock() - clock + earlier_seconds)
            shutil.rmtree(cache_dir, ignore_errors=True)
            staging.rename(cache_dir)

        write_once(write)
        return by_row


def pack_batch(rows: list[dict], pad_id: int, device, prompt_tokens: int | None = None) -> dict:
    """Right-padded [prompt + continuation] ids and their attention mask, a mask of the positions that predict
    continuation tokens (position t predicts token t + 1) and the target's token at each: a row's `label_ids`
    (its argmax over a human response) where it has them, else the continuation itself (its own greedy text).
    `prompt_tokens` keeps only the end of each prompt: a drafter learns from local context, and the sequences
    stay short enough to train on a CPU."""
    prompts = [r["prompt_ids"][-prompt_tokens:] if prompt_tokens else r["prompt_ids"] for r in rows]
    seqs = [p + r["continuation_ids"] for p, r in zip(prompts, rows)]
    ids = torch.full((len(seqs), max(map(len, seqs))), pad_id, dtype=torch.long)
    attention, labels = torch.zeros_like(ids), torch.zeros_like(ids)
    target_mask = torch.zeros(ids.shape, dtype=torch.bool)
    for i, (prompt, seq, row) in enumerate(zip(prompts, seqs, rows)):
        ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        labels[i, len(prompt) - 1 : len(seq) - 1] = torch.tensor(row.get("label_ids") or row["continuation_ids"])
        target_mask[i, len(prompt) - 1 : len(seq) - 1] = True
    return {
        "input_ids": ids.to(device),
        "attention_mask": attention.to(device),
        "labels": labels.to(device),
        "target_mask": target_mask.to(device),
    }


def batches(rows: list[dict], loop: LoopConfig, pad_id: int, device, prompt_tokens: int | None):
    """batch_for_step(step, micro) for the shared training loop: the packed rows of that micro-batch."""

    def batch_for_step(step: int, micro: int) -> dict:
        return pack_batch(
            [rows[i] for i in micro_batch_indices(step, micro, len(rows), loop)], pad_id, device, prompt_tokens
        )

    return batch_for_step
