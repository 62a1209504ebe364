"""The draft model of `sps`: a small LLaMA with the target's tokenizer, distilled from the target.

Data: the target's own greedy continuations of bundled prompts (sequence-level distillation, as in
DistillSpec's on-policy data). Loss: cross-entropy on the continuation tokens (`ce`), or token-level
KL(target || draft) against the target's logits computed on the fly (`kl`, costlier).
Initialisation (`init=pca`): the tied embedding is the target's embedding projected on its top
principal directions, so a narrow draft starts with the target's token geometry.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from specrepro.data.config import DatasetConfig
from specrepro.decoding.steps import decoder_body
from specrepro.errors import SpecReproError
from specrepro.registry import register_component
from specrepro.training import cost
from specrepro.training.distill_data import (
    heldout_count,
    batches,
    continuation_dataset,
    distill_cache_dir,
    pack_batch,
    teacher_labeled_dataset,
)
from specrepro.training.loop import LoopConfig, train_loop


@dataclass
class DraftArchConfig:
    num_layers: int = 4
    hidden_size: int = 256
    intermediate_size: int = 768
    num_heads: int = 4
    num_kv_heads: int = 2
    init: str = "pca"  # pca (target embedding projected to hidden_size) | random


@dataclass
class SPSDraftTrainingConfig:
    component: str = "sps_draft"
    draft: DraftArchConfig = field(default_factory=DraftArchConfig)
    prompts: Dict[str, DatasetConfig] = field(default_factory=dict)  # prompt sets for the target's continuations
    labeled: Dict[str, DatasetConfig] = field(default_factory=dict)  # sets whose human responses get target labels
    labeled_response_tokens: int = 128  # response tokens kept per off-policy example
    labeled_prompt_tokens: int = 64  # prompt tokens of context when labelling (a forward costs per token)
    continuation_tokens: int = 128  # new tokens the target generates per prompt
    generation_batch_size: int = 16
    max_prompt_tokens: int = 256  # longer prompts keep their last tokens when generating
    train_prompt_tokens: int = 64  # prompt tokens kept in front of each continuation for training
    heldout_fraction: float = 0.05  # sequences kept out of training to measure top-1 agreement
    loss: str = "ce"  # ce (on the target's continuations) | kl (against the target's logits)
    loop: LoopConfig = field(default_factory=LoopConfig)


def build_draft(target, arch: DraftArchConfig) -> LlamaForCausalLM:
    """A LLaMA of the given shape sharing the target's vocabulary and special tokens."""
    tc = target.config
    if arch.hidden_size % arch.num_heads or arch.num_heads % arch.num_kv_heads:
        raise SpecReproError(
            f"training.draft: hidden_size={arch.hidden_size} must split into "
            f"num_heads={arch.num_heads} heads, and those into "
            f"num_kv_heads={arch.num_kv_heads} groups"
        )
    config = LlamaConfig(
        vocab_size=tc.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        max_position_embeddings=tc.max_position_embeddings,
        rope_parameters=getattr(tc, "rope_parameters", None),
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),  # LLaMA's default for a target without RMSNorm (GPT-2)
        tie_word_embeddings=True,
        bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id,
        pad_token_id=getattr(tc, "pad_token_id", None),
    )
    draft = LlamaForCausalLM(config)
    if arch.init == "pca" and arch.hidden_size > tc.hidden_size:
        raise SpecReproError(
            f"training.draft.hidden_size={arch.hidden_size} is wider than the target's "
            f"({tc.hidden_size}): init=pca projects the target's embedding onto fewer directions; "
            f"use a smaller width or training.draft.init=random"
        )
    if arch.init == "pca":
        embedding = target.get_input_embeddings().weight.detach().float()
        centered = embedding - embedding.mean(0, keepdim=True)
        _, _, v = torch.linalg.svd(centered, full_matrices=False)
        projected = embedding @ v[: arch.hidden_size].T
        with torch.no_grad():
            draft.get_input_embeddings().weight.copy_(projected / projected.std() * tc.initializer_range * 10)
    elif arch.init != "random":
        raise SpecReproError(f"draft init '{arch.init}' is not one of pca, random")
    return draft


def predicted_logits(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits at the masked positions only (the vocabulary head dominates a small draft's cost) and their labels."""
    body = decoder_body(model)  # the draft's LLaMA body, or a teacher's of another architecture (GPT-2's `transformer`)
    hidden = body(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    mask = batch["target_mask"]
    return model.lm_head(hidden[mask]), batch["labels"][mask]


def loss_fn_for(kind: str, teacher=None):
    """ce: cross-entropy on the target's tokens; kl: KL(target || draft) on the target's logits."""
    if kind not in ("ce", "kl"):
        raise SpecReproError(f"distillation loss '{kind}' is not one of ce, kl")

    def loss_fn(model, batch):
        logits, labels = predicted_logits(model, batch)
        if kind == "ce":
            loss = F.cross_entropy(logits.float(), labels)
        else:
            with torch.no_grad():
                teacher_logits, _ = predicted_logits(teacher, batch)
            loss = F.kl_div(
                logits.float().log_softmax(-1),
                teacher_logits.float().log_softmax(-1),
                log_target=True,
                reduction="batchmean",
            )
        return loss, {"top1_agreement": float((logits.argmax(-1) == labels).float().mean())}

    return loss_fn


@torch.inference_mode()
def top1_agreement(model, rows: list[dict], pad_id: int, device, prompt_tokens: int, batch_size: int = 8) -> float:
    """Share of held-out continuation tokens where the model's argmax equals the target's token."""
    hits = total = 0
    for start in range(0, len(rows), batch_size):
        logits, labels = predicted_logits(
            model, pack_batch(rows[start : start + batch_size], pad_id, device, prompt_tokens)
        )
        hits += int((logits.argmax(-1) == labels).sum())
        total += labels.numel()
    return hits / max(total, 1)


@register_component("sps_draft", "sps_draft_general", schema=SPSDraftTrainingConfig)
def train_sps_draft(cfg, target, work_dir, log_metrics, device):
    """Distil a draft from the target; returns (draft model, metrics for artifact.json)."""
    spec = cfg.training
    torch.manual_seed(spec.loop.seed)
    draft = build_draft(target.model, spec.draft).to(device)  # first: an impossible shape fails before any data
    caches = [distill_cache_dir(cfg, "continuations", spec.prompts, spec.continuation_tokens, spec.max_prompt_tokens)]
    on_policy = continuation_dataset(
        target, spec.prompts, spec.continuation_tokens, spec.generation_batch_size, spec.max_prompt_tokens, caches[0]
    )
    # greedy continuations are the target's own argmax: their labels are the tokens themselves (pack_batch)
    rows = [row for row in on_policy if row["continuation_ids"]]
    random.Random(spec.loop.seed).shuffle(rows)
    # agreement is measured on held-out on-policy continuations: what the draft meets when decoding
    n_heldout = heldout_count(len(rows), spec.heldout_fraction)
    heldout, train_rows = rows[:n_heldout], rows[n_heldout:]
    if spec.labeled:
        caches.append(
            distill_cache_dir(cfg, "labels", spec.labeled, spec.labeled_response_tokens, spec.labeled_prompt_tokens)
        )
        off_policy = teacher_labeled_dataset(
            target,
            spec.labeled,
            spec.labeled_response_tokens,
            spec.generation_batch_size,
            spec.labeled_prompt_tokens,
            caches[-1],
        )
        train_rows += [row for row in off_policy if row["continuation_ids"]]
    pad_id = (
        target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else target.tokenizer.eos_token_id
    )

    before = top1_agreement(draft, heldout, pad_id, device, spec.train_prompt_tokens)
    teacher = target.model if spec.loss == "kl" else None
    history = train_loop(
        draft,
        loss_fn_for(spec.loss, teacher),
        batches(train_rows, spec.loop, pad_id, device, spec.train_prompt_tokens),
        spec.loop,
        work_dir,
        log_metrics,
        device,
    )
    after = top1_agreement(draft, heldout, pad_id, device, spec.train_prompt_tokens)
    metrics = {
        "heldout_top1_agreement_before": before,
        "heldout_top1_agreement_after": after,
        "train_sequences": len(train_rows),
        "heldout_sequences": len(heldout),
        "train_tokens": sum(len(r["continuation_ids"]) for r in train_rows),
        "train_sequences_by_source": {
            s: sum(r["source"] == s for r in train_rows) for s in {r["source"] for r in train_rows}
        },
        "draft_parameters": sum(p.numel() for p in draft.parameters()),
        "target_parameters": sum(p.numel() for p in target.model.parameters()),
        "compute_minutes": cost.minutes(cost.loop_seconds(history), *map(cost.recorded, caches)),
    }
    return draft, metrics, history
