"""SAR (001) draft head training: Eq. 8 with the target frozen (the paper's "separate" mode, stage 2).

Eq. 8 (maximised): (1 - lambda) E[sum_i log p(w_i | w_<i)] + lambda E[(1/k) sum_i sum_j log q(w_{i+j} | ...)].
Read with the note's convention A (section 8 A1): for an anchor t, q_0 predicts x[t+j+1] from (h_p[t],
h_q(x[t+1..t+j])), j = 1..k; h_p[t] is the target's last-layer (post-norm) hidden state. The target is
frozen, so h_p is computed once for every row and cached (`distill_data.target_hidden_states`, shared by every
head trained on the same rows): a step is the head's forward and backward alone. With the target frozen the
p-term carries no gradient; it is still computed (at the anchors) and logged (paper's stage 2: lam = 1).

Joint mode (lam < 1, the paper's lam = 0.25): LoRA adapters of rank `joint_lora.r` on the target's attention and MLP
projections (peft; Table 4: r_p = 16 on GSM8K) train with the head in one stage, the q-term's gradient reaching
them through h_p, so every step runs the target forward and backward. The p-term is the target's NLL at the same
anchors. The artifact then holds the merged target (a full model: `model.source=artifact`) beside the head, and
`lossless` compares with `ar` on that fine-tuned target.

Data (the paper trains on ground truth, not distillation): the bundled datasets' reference responses after
their prompts (GSM8K train solutions and Spider train SQL by default). Optionally the target's own greedy
continuations of prompt sets (`continuations`), which a frozen, not fine-tuned target accepts more often. Or
(component sar_head_sharegpt, the learning curve's) whole ShareGPT conversations, EAGLE's data: the loss on the
assistant tokens, h_p read from the features EAGLE's trainer caches for the same conversations (one prefill each,
shared by both drafters and every budget), and held-out agreement measured against the target's own top-1.
The head uses the target's frozen input embeddings e(.), which are neither trained nor saved.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from specrepro.data.config import DatasetConfig
from specrepro.decoding import draft_vocab
from specrepro.decoding.sar_draft import DraftHead, head_for
from specrepro.errors import SpecReproError
from specrepro.registry import register_component
from specrepro.training import cost
from specrepro.training.distill_data import (
    heldout_count,
    continuation_dataset,
    continuation_hidden,
    distill_cache_dir,
    frequent_tokens,
    hidden_cache_dir,
    reference_rows,
    target_hidden_states,
)
from specrepro.training.eagle_data import conversation_features
from specrepro.training.loop import LoopConfig, micro_batch_indices, train_loop
from specrepro.training.lora import LoRAConfig, with_lora


@dataclass
class SARHeadTrainingConfig:
    component: str = "sar_head"
    variant: str = "simplified"  # conf/training/sar_draft.yaml takes the head's shape from the method config
    head_k: int = 4
    proj_size: int = 1024
    transformer_layers: int = 1
    shared_lm_head: bool = False
    draft_vocab: int = 0  # V > 0: the output scores only the V tokens most frequent in the training responses
    lam: float = 1.0  # Eq. 8's lambda: 1 = separate mode, stage 2 (target frozen); < 1 = joint mode (paper: 0.25)
    joint_lora: LoRAConfig = field(default_factory=LoRAConfig)  # joint mode: LoRA on the target, r > 0
    references: Dict[str, DatasetConfig] = field(default_factory=dict)  # ground-truth responses after their prompts
    continuations: Dict[str, DatasetConfig] = field(default_factory=dict)  # optional: the target's greedy continuations
    response_tokens: int = 128
    generation_batch_size: int = 16
    teacher_dtype: str = ""  # dtype of the target copy that generates the continuations; "": the run's
    max_prompt_tokens: int = 256
    train_prompt_tokens: int = 64
    anchors_per_batch: int = 256  # anchors t drawn per batch (the k x V logits of every anchor do not fit)
    heldout_fraction: float = 0.05
    loop: LoopConfig = field(default_factory=LoopConfig)


@dataclass
class SARConversationTrainingConfig(SARHeadTrainingConfig):
    """The separate-mode head on whole conversations (conf/training/sar_draft_sharegpt.yaml) in place of
    `references` and `continuations`, with EAGLE's conversation set, cut and held-out set (training/eagle_head.py)."""

    component: str = "sar_head_sharegpt"
    conversations: DatasetConfig = field(default_factory=DatasetConfig)  # whole conversations (task sharegpt)
    heldout_sequences: int = 50  # the first conversations of the shuffled set, as EAGLE's
    max_tokens: int = 512  # a conversation is cut here


def anchor_batch(
    rows: list[dict], hidden: list[torch.Tensor], k: int, anchors: int, generator: torch.Generator | None = None
) -> dict:
    """Up to `anchors` random anchors of `rows` (convention A): for the position t that predicted continuation
    token i, h_p[t] (the row's cached hidden state i), the draft inputs x[t+1..t+k] = continuation[i..i+k-1] and
    their targets x[t+j+1] = continuation[i+j], j = 1..k, valid where that is still a continuation token (and,
    where a row has a `loss_mask`, a masked one: an anchor needs a valid depth-1 target). A row's `target_top1`
    (the target's own top-1 at each token) comes along as the batch's `target_top1`."""
    parts: dict[str, list] = {"hp": [], "windows": [], "valid": [], "target_top1": []}
    steps = torch.arange(k + 1)
    for row, states in zip(rows, hidden):
        n = len(row["continuation_ids"])
        window = torch.arange(n - 1)[:, None] + steps
        mask = torch.tensor(list(row.get("loss_mask", [True] * n)) + [False] * k)
        valid = (window[:, 1:] < n) & mask[window[:, 1:]]
        kept = valid[:, 0]
        parts["hp"].append(states[: n - 1][kept])
        parts["windows"].append(torch.tensor(row["continuation_ids"] + [0] * k)[window][kept])
        parts["valid"].append(valid[kept])
        if "target_top1" in row:
            parts["target_top1"].append(torch.tensor(row["target_top1"] + [0] * k)[window[:, 1:]][kept])
    batch = {name: torch.cat(tensors) for name, tensors in parts.items() if tensors}
    if len(batch["hp"]) > anchors:
        keep = torch.randperm(len(batch["hp"]), generator=generator)[:anchors]
        batch = {name: tensor[keep] for name, tensor in batch.items()}
    windows = batch.pop("windows")
    return {**batch, "inputs": windows[:, :k], "targets": windows[:, 1:]}


def sar_terms(head: DraftHead, target, batch: dict, train_target: bool = False):
    """Eq. 8's two NLL terms at a batch of anchors (`anchor_batch`), and the draft's top-1 hits per depth j (against
    the batch's `target_top1` where it has one, else the targets); the p-term carries a gradient only when
    `train_target` (joint mode)."""
    device = next(head.parameters()).device
    hp, inputs, targets, valid = (batch[name].to(device) for name in ("hp", "inputs", "targets", "valid"))
    hp = hp.to(next(head.parameters()).dtype)
    with torch.no_grad():
        emb = target.get_input_embeddings()(inputs)
    logits = head.draft_logits(hp, emb)  # (N, k, V), V: the draft vocabulary
    vocab, vocab_size = head.vocab_ids, head.settings["vocab_size"]
    # mean over anchors and depths (1/k sum_j); tokens outside a reduced draft vocabulary carry no loss
    loss_q = F.cross_entropy(
        logits[valid].float(),
        draft_vocab.draft_index(vocab, targets[valid], vocab_size),
        ignore_index=draft_vocab.MISSING,
    )
    with torch.set_grad_enabled(train_target):  # the target's own next-token NLL at the anchors: h_p[t] predicts x[t+1]
        loss_p = F.cross_entropy(target.lm_head(hp.to(target.lm_head.weight.dtype)).float(), inputs[:, 0])
    reference = batch["target_top1"].to(device) if "target_top1" in batch else targets
    hits = ((draft_vocab.token_ids(vocab, logits.argmax(-1)) == reference) & valid).sum(0)
    return loss_p, loss_q, hits, valid.sum(0)


@torch.no_grad()
def heldout_accuracy(head, target, rows, hidden, spec) -> list[float]:
    """Teacher-forced top-1 accuracy of draft depth j = 1..k on held-out rows (fixed anchors), against the rows'
    `target_top1` where they have one."""
    hits = total = 0
    generator = torch.Generator().manual_seed(0)
    for start in range(0, len(rows), 4):
        batch = anchor_batch(
            rows[start : start + 4], hidden[start : start + 4], head.k, spec.anchors_per_batch, generator
        )
        *_, h, n = sar_terms(head, target, batch)
        hits, total = hits + h, total + n
    return [round(float(a), 4) for a in (hits / total.clamp(min=1))] if len(rows) else []


class JointSAR(nn.Module):
    """Joint mode: the draft head and the target with its LoRA adapters, trained as one module; saved as the merged
    target (config.json + weights) with the head's files beside it."""

    def __init__(self, head: DraftHead, target: nn.Module):
        super().__init__()
        self.head, self.target = head, target

    def save_pretrained(self, path) -> None:
        self.target.save_pretrained(path)
        self.head.save_pretrained(path)


def task_data(cfg, target, spec, joint: bool):
    """Rows of the reference responses (and the target's continuations), shuffled; their h_p (None in joint mode,
    where the target changes every step); the held-out count; and the seconds the data took."""
    rows = reference_rows(spec.references, target.tokenizer, spec.max_prompt_tokens, spec.response_tokens)
    caches = []
    if spec.continuations:
        caches.append(
            distill_cache_dir(
                cfg,
                "continuations",
                spec.continuations,
                spec.response_tokens,
                spec.max_prompt_tokens,
                spec.teacher_dtype,
            )
        )
        generated = continuation_dataset(
            target,
            spec.continuations,
            spec.response_tokens,
            spec.generation_batch_size,
            spec.max_prompt_tokens,
            caches[0],
            spec.teacher_dtype,
        )
        rows += [{"prompt_ids": r["prompt_ids"], "continuation_ids": r["continuation_ids"]} for r in generated]
    rows = [r for r in rows if len(r["continuation_ids"]) > spec.head_k]
    if not rows:
        raise SpecReproError("sar_draft training found no responses longer than head_k tokens in its data")
    random.Random(spec.loop.seed).shuffle(rows)
    hidden = None
    if not joint:  # h_p of every row, once: a training step is the head's own forward and backward
        caches.append(hidden_cache_dir(cfg, rows, spec.train_prompt_tokens, spec.loop.bf16_autocast))
        hidden = target_hidden_states(
            target.model,
            rows,
            spec.train_prompt_tokens,
            spec.generation_batch_size,
            spec.loop.bf16_autocast,
            caches[-1],
        )
    n_heldout = heldout_count(len(rows), spec.heldout_fraction)
    return rows, hidden, n_heldout, [cost.recorded(cache) for cache in caches]


def conversation_data(cfg, target, spec):
    """Rows of whole conversations (EAGLE's): a conversation's ids[1:] as its continuation, masked to the assistant
    tokens, and its h_p = EAGLE's cached features less the last (the feature at ids[i] predicts ids[i + 1]); the
    held-out rows (the first `heldout_sequences`) carry the target's own top-1 at each token."""
    model = target.model
    conversations, features, seconds = conversation_features(cfg, target, spec, "sar_draft")
    rows = [
        {"prompt_ids": [], "continuation_ids": c["ids"][1:], "loss_mask": c["loss_mask"][1:]} for c in conversations
    ]
    hidden = [f[:-1] for f in features]
    with torch.no_grad():
        for row, states in zip(rows[: spec.heldout_sequences], hidden):
            row["target_top1"] = model.lm_head(states.to(model.lm_head.weight.dtype)).argmax(-1).tolist()
    return rows, hidden, spec.heldout_sequences, [seconds]


@register_component("sar_head", "sar_head_general", schema=SARHeadTrainingConfig)
@register_component("sar_head_sharegpt", schema=SARConversationTrainingConfig)
def train_sar_head(cfg, target, work_dir, log_metrics, device):
    """Train one SAR-family head, on the frozen target or jointly with LoRA on it; returns (head or JointSAR, metrics,
    history)."""
    spec, model = cfg.training, target.model
    joint = spec.lam < 1
    if not 0 < spec.lam <= 1:
        raise SpecReproError(f"sar_draft training needs 0 < lam <= 1 (1: target frozen; < 1: joint), got {spec.lam}")
    if joint and spec.joint_lora.r <= 0:
        raise SpecReproError(
            f"sar_draft joint training (lam = {spec.lam} < 1) trains the target through LoRA: "
            "set training.joint_lora.r > 0 (Table 4: 16 on GSM8K)"
        )
    on_conversations = "conversations" in spec
    if joint and on_conversations:
        raise SpecReproError("sar_draft trains on conversations with the target frozen only: set training.lam=1")
    for p in model.parameters():
        p.requires_grad_(False)
    if on_conversations:
        rows, hidden, n_heldout, data_seconds = conversation_data(cfg, target, spec)
    else:
        rows, hidden, n_heldout, data_seconds = task_data(cfg, target, spec, joint)
    heldout, train_rows = rows[:n_heldout], rows[n_heldout:]
    if not joint:
        train_hidden = hidden[n_heldout:]

    def heldout_hidden() -> list[torch.Tensor]:
        if not joint:
            return hidden[:n_heldout]
        with torch.no_grad():  # joint mode: the target changes every step, so h_p comes from a live forward
            return [
                h
                for i in range(0, len(heldout), 4)
                for h in continuation_hidden(model, heldout[i : i + 4], spec.train_prompt_tokens)
            ]

    torch.manual_seed(spec.loop.seed)
    vocab_ids = frequent_tokens(train_rows, spec.draft_vocab, model.config.vocab_size) if spec.draft_vocab else None
    head = head_for(
        model, spec.variant, spec.head_k, spec.proj_size, spec.transformer_layers, spec.shared_lm_head, vocab_ids
    ).to(device)
    before = heldout_accuracy(head, model, heldout, heldout_hidden(), spec)
    trained: nn.Module = head
    if joint:
        trained = JointSAR(head, with_lora(model, spec.joint_lora))

    def batch_for_step(step: int, micro: int) -> dict:
        picked = micro_batch_indices(step, micro, len(train_rows), spec.loop)
        if joint:
            return {"rows": [train_rows[i] for i in picked]}
        return anchor_batch(
            [train_rows[i] for i in picked], [train_hidden[i] for i in picked], head.k, spec.anchors_per_batch
        )

    def loss_fn(module, batch):
        if joint:  # LoRA injected into `model` in place: its forward is the adapted target's
            batch = anchor_batch(
                batch["rows"],
                continuation_hidden(model, batch["rows"], spec.train_prompt_tokens),
                head.k,
                spec.anchors_per_batch,
            )
        loss_p, loss_q, hits, total = sar_terms(head, model, batch, train_target=joint)
        return (1 - spec.lam) * loss_p + spec.lam * loss_q, {  # Eq. 8 (as a loss to minimise)
            "loss_p": float(loss_p),
            "loss_q": float(loss_q.detach()),
            "top1_depth1": float(hits[0] / total[0].clamp(min=1)),
        }

    history = train_loop(trained, loss_fn, batch_for_step, spec.loop, work_dir / "head", log_metrics, device)
    if joint:
        trained.target = trained.target.merge_and_unload()
        model = trained.target.requires_grad_(False).eval()
    head.eval()
    target_parameters = sum(p.numel() for p in model.parameters())
    metrics = {
        "variant": spec.variant,
        "shared_lm_head": spec.shared_lm_head,
        "draft_vocab": spec.draft_vocab,
        "joint": joint,
        "head_parameters": head.num_parameters(),  # the shared LM head is the target's: not counted
        "target_parameters": target_parameters,
        "extra_memory_pct": 100.0 * head.num_parameters() / target_parameters,  # |theta'| / |theta|
        "heldout_top1_by_depth_before": before,
        "heldout_top1_by_depth_after": heldout_accuracy(head, model, heldout, heldout_hidden(), spec),
        "train_sequences": len(train_rows),
        "train_tokens": sum(len(r["continuation_ids"]) for r in train_rows),
        "heldout_sequences": len(heldout),
        "heldout_top1_against": "the target's top-1" if on_conversations else "the data's tokens",
        "compute_minutes": cost.minutes(cost.loop_seconds(history), *data_seconds),
    }
    return trained, metrics, history
