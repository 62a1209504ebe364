"""EAGLE (Li et al., 2024) draft training on the frozen target's features of fixed conversations.

Section 4.1: L_reg = Smooth L1(f_{i+1}, f^_{i+1}) (Eq. 3), p_{i+2} = Softmax(LM_Head(f_{i+1})),
p^_{i+2} = Softmax(LM_Head(f^_{i+1})), L_cls = Cross_Entropy(p_{i+2}, p^_{i+2}) (Eq. 4), L = L_reg + w_cls L_cls
with w_cls = 0.1 (Eq. 5). The draft reads (f_i, e(t_{i+1})) and predicts f^_{i+1}; the target's LM head is frozen
and shared. Data augmentation (section 4.1): uniform noise U(-0.1, 0.1) on the input features, as the paper states
it (their code, train/main.py AddUniformNoise, scales it by 512 / the conversation's length: wider on shorter ones;
not done here)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specrepro.data.config import DatasetConfig
from specrepro.decoding import draft_vocab
from specrepro.decoding.eagle import EagleDraft, check_target
from specrepro.registry import register_component
from specrepro.training import cost
from specrepro.training.distill_data import frequent_tokens
from specrepro.training.eagle_data import conversation_features
from specrepro.training.loop import LoopConfig, micro_batch_indices, train_loop


@dataclass
class EagleHeadTrainingConfig:
    component: str = "eagle_head"
    draft_vocab: int = 0  # V > 0: the LM head's rows of the V most frequent training tokens (beyond the paper)
    conversations: DatasetConfig = field(default_factory=DatasetConfig)  # whole conversations (task sharegpt)
    heldout_sequences: int = 50  # the first conversations of the shuffled set: the same held-out set for every budget
    max_tokens: int = 512  # a conversation is cut here (EAGLE: 2,048 on a 7B target)
    w_cls: float = 0.1  # Eq. 5's w_cls
    feature_noise: float = 0.1  # uniform U(-a, a) on the input features (section 4.1's data augmentation)
    heldout_depths: int = 4  # held-out top-1 agreement at draft depths 0 .. heldout_depths - 1
    loop: LoopConfig = field(default_factory=LoopConfig)


def pack(rows: list[dict], features: list[torch.Tensor]) -> dict:
    """Right-padded ids (B, L), features (B, L, H) and the loss mask (B, L) (assistant tokens, never padding)."""
    width = max(len(r["ids"]) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    feats = features[0].new_zeros((len(rows), width, features[0].shape[-1]))
    for i, (row, f) in enumerate(zip(rows, features)):
        ids[i, : len(row["ids"])] = torch.tensor(row["ids"])
        mask[i, : len(row["ids"])] = torch.tensor(row["loss_mask"])
        feats[i, : len(f)] = f
    return {"ids": ids, "features": feats, "mask": mask}


def draft_pass(draft: EagleDraft, embed: nn.Module, batch: dict, inputs: torch.Tensor | None = None) -> torch.Tensor:
    """Predicted features f^_{i+1} (B, L - 1, H) of the pairs (f_i, e(t_{i+1})), teacher-forced; `inputs`: the
    features f_i to read instead of the target's (B, L - 1, H)."""
    ids = batch["ids"]
    f_in = batch["features"][:, :-1] if inputs is None else inputs
    positions = torch.arange(ids.shape[1] - 1, device=ids.device)[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        token_embeds = embed(ids[:, 1:])
    return draft(f_in.to(draft.fc.weight.dtype), token_embeds, positions)


def eagle_terms(draft: EagleDraft, predicted: torch.Tensor, batch: dict):
    """Eq. 3-4 at the assistant positions: (L_reg, L_cls, top-1 hits, positions). f^_{i+1} against f_{i+1}; the
    draft's distribution against the target's p_{i+2} = Softmax(LM_Head(f_{i+1}))."""
    valid = batch["mask"][:, 1:]
    pred, true = predicted[valid].float(), batch["features"][:, 1:][valid].float()
    loss_reg = F.smooth_l1_loss(pred, true)  # Eq. 3
    with torch.no_grad():
        p = draft.logits(true).float().softmax(-1)
    log_q = draft.logits(pred).float().log_softmax(-1)
    loss_cls = -(p * log_q).sum(-1).mean()  # Eq. 4 (soft cross-entropy against the target's distribution)
    hits = (log_q.argmax(-1) == p.argmax(-1)).sum()
    return loss_reg, loss_cls, hits, valid.sum()


@torch.no_grad()
def heldout_agreement(
    draft: EagleDraft,
    embed: nn.Module,
    lm_head: nn.Module,
    rows: list[dict],
    features: list[torch.Tensor],
    depths: int,
) -> list[float]:
    """Top-1 agreement with the target (its `lm_head` over the whole vocabulary, as decoding accepts a draft) at
    draft depths 0 .. depths - 1 on held-out conversations: depth d reads the draft's own depth d - 1 predictions as
    its input features (f^_i in place of f_i at every position, the context too: a simplification of drafting, where
    the context keeps the target's features)."""
    device = next(draft.parameters()).device
    hits, total = torch.zeros(depths), torch.zeros(depths)
    for start in range(0, len(rows), 4):
        batch = {k: v.to(device) for k, v in pack(rows[start : start + 4], features[start : start + 4]).items()}
        inputs, valid = batch["features"][:, :-1], batch["mask"][:, 1:]
        true = batch["features"][:, 1:][valid]
        target_top1 = lm_head(true.to(lm_head.weight.dtype)).argmax(-1)  # the same at every depth
        for d in range(depths):
            predicted = draft_pass(draft, embed, batch, inputs)
            drafted = draft_vocab.token_ids(draft.vocab_ids, draft.logits(predicted[valid]).argmax(-1))
            hits[d] += (drafted == target_top1).sum()
            total[d] += valid.sum()
            inputs = torch.cat([batch["features"][:, :1], predicted[:, :-1].to(inputs.dtype)], 1)
    return [round(float(a), 4) for a in hits / total.clamp(min=1)]


@register_component("eagle_head", schema=EagleHeadTrainingConfig)
def train_eagle_head(cfg, target, work_dir, log_metrics, device):
    """Train an EAGLE draft on the frozen target's cached features; returns (draft, metrics, history)."""
    spec, model = cfg.training, target.model
    check_target(model)  # refuse a target the draft cannot run on before its features are made
    model.requires_grad_(False)
    rows, features, feature_seconds = conversation_features(cfg, target, spec, "EAGLE")
    held, train_rows = rows[: spec.heldout_sequences], rows[spec.heldout_sequences :]
    held_features, train_features = features[: spec.heldout_sequences], features[spec.heldout_sequences :]
    torch.manual_seed(spec.loop.seed)
    vocab_ids = (
        frequent_tokens(
            [{"prompt_ids": [], "continuation_ids": r["ids"]} for r in train_rows],
            spec.draft_vocab,
            model.config.vocab_size,
        )
        if spec.draft_vocab
        else None
    )
    draft = EagleDraft(model.config, spec.draft_vocab)
    if vocab_ids is not None:
        draft.vocab_ids.copy_(vocab_ids)
    draft = draft.to(device).attach_lm_head(model.lm_head)
    embed = model.get_input_embeddings()
    before = heldout_agreement(draft, embed, model.lm_head, held, held_features, spec.heldout_depths)

    def batch_for_step(step: int, micro: int) -> dict:
        picked = micro_batch_indices(step, micro, len(train_rows), spec.loop)
        batch = pack([train_rows[i] for i in picked], [train_features[i] for i in picked])
        # the noise is a function of the step, so a resumed training draws what an uninterrupted one does
        generator = torch.Generator().manual_seed(spec.loop.seed * 1_000_003 + step * 1_000 + micro)
        shape = batch["features"][:, :-1].shape
        batch["noise"] = (torch.rand(shape, generator=generator) * 2 - 1) * spec.feature_noise
        return batch

    def loss_fn(module, batch):
        batch = {k: v.to(device) for k, v in batch.items()}
        predicted = draft_pass(module, embed, batch, batch["features"][:, :-1].float() + batch["noise"])
        loss_reg, loss_cls, hits, n = eagle_terms(module, predicted, batch)
        return loss_reg + spec.w_cls * loss_cls, {  # Eq. 5
            "loss_reg": float(loss_reg.detach()),
            "loss_cls": float(loss_cls.detach()),
            "top1_depth0": float(hits / n.clamp(min=1)),
        }

    history = train_loop(draft, loss_fn, batch_for_step, spec.loop, work_dir / "draft", log_metrics, device)
    draft.eval()
    target_parameters = sum(p.numel() for p in model.parameters())
    metrics = {
        "draft_vocab": spec.draft_vocab,
        "draft_parameters": draft.num_parameters(),  # the shared LM head is the target's: not counted
        "extra_memory_pct": 100.0 * draft.num_parameters() / target_parameters,
        "heldout_top1_by_depth_before": before,
        "heldout_top1_by_depth_after": heldout_agreement(
            draft, embed, model.lm_head, held, held_features, spec.heldout_depths
        ),
        "train_sequences": len(train_rows),
        "train_tokens": sum(len(r["ids"]) for r in train_rows),
        "heldout_sequences": len(held),
        "feature_minutes": feature_seconds / 60,
        "compute_minutes": cost.minutes(cost.loop_seconds(history), feature_seconds),
    }
    return draft, metrics, history
