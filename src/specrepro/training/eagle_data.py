"""EAGLE's training data: fixed conversations, teacher-forced, and the frozen target's features on them.

EAGLE (Li et al., 2024, section 4.1 "Training") trains on fixed ShareGPT conversations, not on the target's own
generations: a sequence is one conversation (the target's chat template applied, cut at `max_tokens`), and its
features are the target's second-to-top-layer features, i.e. the last hidden state before the LM head (post-norm,
as transformers returns `hidden_states[-1]`), from one prefill. EAGLE's loss covers the assistant turns only
(`loss_mask`).

The features are computed once per sequence and kept one sequence per file (`shards.map_batches`) in a folder
keyed by the target, the conversation set without its `limit`, `max_tokens` and the forward's precision: a budget
of N conversations is the first N of the same shuffled list, so every smaller budget is a prefix of a larger one
and reads the files the larger one made. A computation killed part-way resumes at its sequence.

    python -m specrepro.training.eagle_data training=eagle_4000 hardware.threads=1

computes (or completes) the features of a recipe's conversations without training, e.g. as a background job ahead
of the training runs of every budget.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from specrepro import suspension
from specrepro.config import weights_identity
from specrepro.data import load_records
from specrepro.data.prompts import plain_transcript
from specrepro.errors import SpecReproError
from specrepro.identity import weights_key
from specrepro.tracking import config_hash
from specrepro.training.shards import map_batches

MESSAGE_CHARS = 16_000  # a message is cut to this many characters before tokenizing (longer ones exceed any budget)


def conversation_tokens(messages: list[dict], tokenizer, max_tokens: int) -> tuple[list[int], list[bool]]:
    """One conversation's token ids under the tokenizer's chat template (without one, the plain transcript prompts
    use), cut at `max_tokens`, and a mask of the tokens inside assistant turns (EAGLE's loss mask). Each message's
    tokens are those the template adds for it (the template rendered up to it less the template rendered up to the
    one before)."""
    ids, mask, rendered = [], [], ""
    for end, message in enumerate(messages, start=1):
        shown = [{"role": m["role"], "content": m["content"][:MESSAGE_CHARS]} for m in messages[:end]]
        text = render(shown, tokenizer)
        if not text.startswith(rendered):
            raise SpecReproError(
                "the chat template renders a conversation's prefix differently from the whole; "
                "EAGLE's data needs a template that only appends each message"
            )
        piece = tokenizer(text[len(rendered) :], add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [message["role"] == "assistant"] * len(piece)
        rendered = text
        if len(ids) >= max_tokens:
            break
    return ids[:max_tokens], mask[:max_tokens]


def render(messages: list[dict], tokenizer) -> str:
    """Messages as text: the tokenizer's chat template, or the plain transcript prompts use without one (its
    closing "Assistant:" cue is the next reply's start, so a transcript ending on a reply leaves it out)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    text = plain_transcript(messages)
    return text.removesuffix("\nAssistant:") if messages[-1]["role"] == "assistant" else text


def conversation_rows(conversations, tokenizer, max_tokens: int) -> list[dict]:
    """Rows {ids, loss_mask} of the conversation set `conversations` (a DatasetConfig), in its (seeded) order;
    conversations with fewer than two assistant tokens are skipped."""
    rows = []
    for record in load_records(conversations):
        messages = record.fields.get("messages")
        if messages is None:
            raise SpecReproError(f"dataset '{conversations.name}' has no whole conversations (task sharegpt has them)")
        ids, mask = conversation_tokens(messages, tokenizer, max_tokens)
        if sum(mask[1:]) >= 2:
            rows.append({"ids": ids, "loss_mask": mask})
    return rows


def features_dir(cfg, conversations, max_tokens: int, autocast: bool) -> Path:
    """`<artifacts_dir>/.work/eagle-features-<hash>`: one file per sequence, shared by every budget (the
    conversation set's `limit` is left out of the key)."""
    data = {
        k: v for k, v in OmegaConf.to_container(OmegaConf.create(conversations), resolve=True).items() if k != "limit"
    }
    key = config_hash(
        {
            "model": weights_identity(cfg.model),
            "conversations": data,
            "max_tokens": max_tokens,
            "dtype": "bf16_autocast" if autocast else cfg.hardware.dtype,
            **weights_key(cfg),
        }
    )
    return Path(cfg.artifacts_dir) / ".work" / f"eagle-features-{key}"


@torch.no_grad()
def target_features(model, rows: list[dict], autocast: bool, folder: Path) -> tuple[list[torch.Tensor], float]:
    """Each row's target features (len(ids), H), stored in the forward's dtype (bf16 under autocast), one prefill
    per row; and the seconds they took (those loaded from `folder` as recorded when they were made)."""
    device = next(model.parameters()).device
    clock = suspension.clock()

    def features(batch: list[dict]) -> list[dict]:
        ids = torch.tensor([batch[0]["ids"]], device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            hidden = model.model(input_ids=ids).last_hidden_state[0]
        return [{"ids": ids[0].int().cpu(), "hidden": hidden.cpu()}]

    done, earlier = map_batches([[row] for row in rows], features, "EAGLE target features", folder)
    for row, item in zip(rows, done):
        if item["ids"].tolist() != row["ids"]:
            raise SpecReproError(f"{folder} holds features of other sequences than these: delete it and run again")
    new_seconds = suspension.clock() - clock
    return [item["hidden"] for item in done], earlier + new_seconds


def conversation_features(cfg, target, spec, trainer: str) -> tuple[list[dict], list[torch.Tensor], float]:
    """A recipe's conversation rows (more than its `heldout_sequences`: `trainer` names the recipe in the error),
    the frozen target's features of each (the folder every budget and both drafters share) and their seconds."""
    if spec.heldout_sequences < 1:
        raise SpecReproError(
            f"training.heldout_sequences must be at least 1 (the agreement is measured on them), got "
            f"{spec.heldout_sequences}"
        )
    rows = conversation_rows(spec.conversations, target.tokenizer, spec.max_tokens)
    if len(rows) <= spec.heldout_sequences:
        raise SpecReproError(
            f"{trainer} training needs more than training.heldout_sequences={spec.heldout_sequences} "
            f"conversations; training.conversations gives {len(rows)}"
        )
    autocast = spec.loop.bf16_autocast
    folder = features_dir(cfg, spec.conversations, spec.max_tokens, autocast)
    features, seconds = target_features(target.model, rows, autocast, folder)
    return rows, features, seconds


def main(overrides: list[str]) -> None:
    """Compute the features a training recipe's conversations need (`specrepro train` would, before training)."""
    from hydra import compose, initialize_config_dir

    from specrepro.cli import CONF_DIR
    from specrepro.config import register_configs
    from specrepro.models import ModelLoader

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["method=ar", "logger=none", *overrides])
    target = ModelLoader.for_hardware(cfg.hardware, cfg.artifacts_dir).load_model(cfg.model)
    rows, _, seconds = conversation_features(cfg, target, cfg.training, "EAGLE")
    folder = features_dir(cfg, cfg.training.conversations, cfg.training.max_tokens, cfg.training.loop.bf16_autocast)
    print(f"{len(rows)} sequences' features in {folder} ({seconds / 60:.1f} compute minutes)")


if __name__ == "__main__":
    main(sys.argv[1:])
