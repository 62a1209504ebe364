"""EESD's draft head by self-distillation (§3.2), and Cali-TS's calibration predictor (§3.3, Eq. 5).

Head: the early-exit layer, its RMSNorm and LM head (initialised from the target's last layer, final norm
and head) learn next-token cross-entropy on H^N, the target's frozen layer-N hidden states (computed under
no_grad; only the head gets gradients). Data: the target's own greedy continuations of bundled prompts
(ShareGPT, GSM8K train, MBPP; the paper's hybrid greedy + sampling recipe is not used: its switch point and
temperature are not given, and greedy continuations are exactly what greedy verification accepts) mixed
with "plain" open-source text: the datasets' reference responses (ShareGPT's recorded assistant replies,
MBPP's solutions) after the same prompts, and optionally (`labeled`) off-policy rows: human responses
labelled with the target's argmax at every position, which cost one forward instead of a generation.

Predictor (trained after the head, in the same job, stored in the same artifact): on the target's greedy
continuations, the draft run teacher-forced is exactly the free-running draft whenever its earlier drafts
were accepted. For an anchor t (the target row that produced the last committed token) and draft step
i = 1..10, the features are H_t^(T) (the target's final normed hidden) and the draft's normed hidden at
t + i; the label is 1 when drafts 1..i all equal the target's tokens (continuing is worth it only while the
chain is still being accepted).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, List

import torch
import torch.nn.functional as F

from specrepro.data.config import DatasetConfig
from specrepro.decoding import draft_vocab
from specrepro.decoding.eesd import MAX_PREDICTOR_POSITION, CalibrationPredictor, EarlyExitHead, first_layers_hidden
from specrepro.registry import register_component
from specrepro.training import cost
from specrepro.training.distill_data import (
    heldout_count,
    batches,
    continuation_dataset,
    distill_cache_dir,
    frequent_tokens,
    pack_batch,
    reference_rows,
    teacher_labeled_dataset,
)
from specrepro.training.loop import LoopConfig, train_loop


@dataclass
class CalibrationTrainingConfig:
    sequences: int = 48  # training sequences whose (anchor, draft step) pairs train the predictor; 0: no predictor
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(steps=150, batch_size=512, lr=1e-3, warmup_steps=10))


@dataclass
class EESDHeadTrainingConfig:
    component: str = "eesd_head"
    num_layers: int = 3  # conf/training/eesd.yaml takes these three from the method config
    exit_layer: bool = True
    shared_head: bool = False
    draft_vocab: int = 0  # V > 0: the head scores only the V tokens most frequent in the training continuations
    prompts: Dict[str, DatasetConfig] = field(default_factory=dict)  # prompt sets for the target's continuations
    labeled: Dict[str, DatasetConfig] = field(default_factory=dict)  # sets whose human responses get target labels
    labeled_response_tokens: int = 128  # response tokens kept per off-policy example
    labeled_prompt_tokens: int = 64  # prompt tokens of context when labelling
    continuation_tokens: int = 128
    generation_batch_size: int = 16
    teacher_dtype: str = ""  # dtype of the target copy that generates continuations and labels; "": the run's
    max_prompt_tokens: int = 256
    train_prompt_tokens: int = 64
    plain_from: List[str] = field(default_factory=list)  # prompt sets whose reference responses join as plain data
    plain_rows: int = 48  # at most this many plain rows
    heldout_fraction: float = 0.05  # self-generated sequences kept out to measure top-1 agreement
    loop: LoopConfig = field(default_factory=LoopConfig)
    calibration: CalibrationTrainingConfig = field(default_factory=CalibrationTrainingConfig)


def plain_rows(spec, tokenizer, limit: int) -> list[dict]:
    """Rows {prompt_ids, continuation_ids} whose continuation is a dataset's own reference response."""
    datasets = {name: spec.prompts[name] for name in spec.plain_from}
    rows = [
        row
        for row in reference_rows(datasets, tokenizer, spec.max_prompt_tokens, spec.continuation_tokens)
        if len(row["continuation_ids"]) >= 8
    ]
    random.Random(spec.loop.seed).shuffle(rows)
    return rows[:limit]


def head_logits(head: EarlyExitHead, target, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits (over the head's draft vocabulary) at the positions that predict continuation tokens, and
    those tokens (ids in the full vocabulary).

    Right padding under a causal mask never reaches a real position, so no padding mask is needed.
    """
    with torch.no_grad():
        hidden_n = first_layers_hidden(target, batch["input_ids"], head.num_layers)
    hidden = head.hidden(hidden_n)
    mask = batch["target_mask"]
    return head.logits(hidden[mask]), batch["labels"][mask]  # the vocab head only where needed


@torch.inference_mode()
def top1_agreement(head, target, rows, pad_id, device, prompt_tokens, batch_size: int = 8) -> float:
    hits = total = 0
    for start in range(0, len(rows), batch_size):
        logits, labels = head_logits(
            head, target, pack_batch(rows[start : start + batch_size], pad_id, device, prompt_tokens)
        )
        hits += int((head.token_ids(logits.argmax(-1)) == labels).sum())
        total += labels.numel()
    return hits / max(total, 1)


@torch.inference_mode()
def calibration_examples(head, target, rows, pad_id, device, prompt_tokens, batch_size: int = 8) -> dict:
    """(H_t^(T), H_{t+i}^(D), i, label) for every anchor t in a continuation and i = 1..10 (see module doc)."""
    target_hidden, draft_hidden, positions, labels = [], [], [], []
    for start in range(0, len(rows), batch_size):
        batch = pack_batch(rows[start : start + batch_size], pad_id, device, prompt_tokens)
        ids, mask = batch["input_ids"], batch["target_mask"]
        final = target.model(input_ids=ids).last_hidden_state  # after the final norm
        drafted = head.hidden(first_layers_hidden(target, ids, head.num_layers))
        correct = torch.zeros_like(mask)
        correct[:, :-1] = (head.token_ids(head.logits(drafted[:, :-1]).argmax(-1)) == ids[:, 1:]) & mask[:, :-1]
        for row in range(ids.shape[0]):
            valid = mask[row].nonzero().flatten().tolist()  # positions predicting target-generated tokens
            for t in valid:
                alive = True
                for i in range(1, MAX_PREDICTOR_POSITION + 1):
                    if t + i > valid[-1]:
                        break
                    alive = alive and bool(correct[row, t + i])
                    target_hidden.append(final[row, t])
                    draft_hidden.append(drafted[row, t + i])
                    positions.append(i)
                    labels.append(int(alive))
    return {
        "target_hidden": torch.stack(target_hidden),
        "draft_hidden": torch.stack(draft_hidden),
        "position": torch.tensor(positions, device=device),
        "label": torch.tensor(labels, device=device),
    }


def train_calibration(examples: dict, hidden_size: int, loop: LoopConfig, work_dir, log_metrics, device):
    n = len(examples["label"])
    n_heldout = max(1, n // 20)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(loop.seed)).to(device)
    heldout, train = order[:n_heldout], order[n_heldout:]

    def batch_for_step(step: int, micro: int) -> dict:
        picked = train[
            torch.randint(
                len(train),
                (loop.batch_size,),
                generator=torch.Generator().manual_seed(loop.seed * 100003 + step * loop.grad_accum + micro),
            ).to(device)
        ]
        return {k: v[picked] for k, v in examples.items()}

    def loss_fn(model, batch):
        logits = model(batch["target_hidden"], batch["draft_hidden"], batch["position"])
        return F.cross_entropy(logits.float(), batch["label"]), {}

    def accuracy(model) -> float:
        with torch.no_grad():
            held = {k: v[heldout] for k, v in examples.items()}
            return float(
                (model(held["target_hidden"], held["draft_hidden"], held["position"]).argmax(-1) == held["label"])
                .float()
                .mean()
            )

    predictor = CalibrationPredictor(hidden_size).to(device)
    before = accuracy(predictor)
    history = train_loop(predictor, loss_fn, batch_for_step, loop, work_dir, log_metrics, device)
    metrics = {
        "calibration_examples": n,
        "calibration_positive_rate": float(examples["label"].float().mean()),
        "calibration_heldout_accuracy_before": before,
        "calibration_heldout_accuracy_after": accuracy(predictor),
    }
    return predictor.eval(), metrics, history


@register_component("eesd_head", "eesd_head_general", schema=EESDHeadTrainingConfig)
def train_eesd_head(cfg, target, work_dir, log_metrics, device):
    """Self-distil the early-exit head (and the Cali-TS predictor); returns (head, metrics, history)."""
    spec, model = cfg.training, target.model
    EarlyExitHead.check_shape(model, spec.num_layers, spec.shared_head, bool(spec.draft_vocab))  # before data
    for p in model.parameters():
        p.requires_grad_(False)
    cache = distill_cache_dir(
        cfg, "continuations", spec.prompts, spec.continuation_tokens, spec.max_prompt_tokens, spec.teacher_dtype
    )
    data = continuation_dataset(
        target,
        spec.prompts,
        spec.continuation_tokens,
        spec.generation_batch_size,
        spec.max_prompt_tokens,
        cache,
        spec.teacher_dtype,
    )
    generated = [row for row in data if row["continuation_ids"]]
    random.Random(spec.loop.seed).shuffle(generated)
    n_heldout = heldout_count(len(generated), spec.heldout_fraction)
    heldout, generated = generated[:n_heldout], generated[n_heldout:]
    plain = plain_rows(spec, target.tokenizer, spec.plain_rows) if spec.plain_from else []
    labeled, caches = [], [cache]
    if spec.labeled:  # off-policy: human responses with the target's argmax as labels (a forward, not a generation)
        caches.append(
            distill_cache_dir(
                cfg,
                "labels",
                spec.labeled,
                spec.labeled_response_tokens,
                spec.labeled_prompt_tokens,
                spec.teacher_dtype,
            )
        )
        labeled = [
            row
            for row in teacher_labeled_dataset(
                target,
                spec.labeled,
                spec.labeled_response_tokens,
                spec.generation_batch_size,
                spec.labeled_prompt_tokens,
                caches[-1],
                spec.teacher_dtype,
            )
            if row["continuation_ids"]
        ]
    train_rows = generated + plain + labeled
    pad_id = (
        target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else target.tokenizer.eos_token_id
    )

    vocab_ids = frequent_tokens(train_rows, spec.draft_vocab, model.config.vocab_size) if spec.draft_vocab else None
    head = EarlyExitHead(model, spec.num_layers, spec.exit_layer, spec.shared_head, vocab_ids).to(device)
    before = top1_agreement(head, model, heldout, pad_id, device, spec.train_prompt_tokens)

    def loss_fn(head, batch):
        logits, labels = head_logits(head, model, batch)
        agreement = float((head.token_ids(logits.argmax(-1)) == labels).float().mean())
        # tokens outside a reduced draft vocabulary cannot be drafted: they carry no loss (and count as misses)
        loss = F.cross_entropy(logits.float(), head.draft_index(labels), ignore_index=draft_vocab.MISSING)
        return loss, {"top1_agreement": agreement}

    history = train_loop(
        head,
        loss_fn,
        batches(train_rows, spec.loop, pad_id, device, spec.train_prompt_tokens),
        spec.loop,
        work_dir / "head",
        log_metrics,
        device,
    )
    head.eval()
    after = top1_agreement(head, model, heldout, pad_id, device, spec.train_prompt_tokens)
    metrics = {
        "heldout_top1_agreement_before": before,
        "heldout_top1_agreement_after": after,
        "train_sequences_generated": len(generated),
        "train_sequences_plain": len(plain),
        "train_sequences_labeled": len(labeled),
        "train_tokens": sum(len(row["continuation_ids"]) for row in train_rows),
        "heldout_sequences": len(heldout),
        "head_parameters": sum(p.numel() for p in head.parameters()),
    }
    seconds = [cost.loop_seconds(history), *map(cost.recorded, caches)]  # the head's loop and its data
    if vocab_ids is not None:  # the share of held-out target tokens the head can draft at all: its agreement bound
        held = torch.tensor([t for row in heldout for t in row["continuation_ids"]], device=device)
        metrics["heldout_draft_vocab_coverage"] = float((head.draft_index(held) >= 0).float().mean())
    if spec.calibration.sequences > 0:
        examples = calibration_examples(
            head, model, generated[: spec.calibration.sequences], pad_id, device, spec.train_prompt_tokens
        )
        head.calibration, cal_metrics, cal_history = train_calibration(
            examples,
            model.config.hidden_size,
            spec.calibration.loop,
            work_dir / "calibration",
            lambda m, step: log_metrics({f"calibration/{k}": v for k, v in m.items()}, spec.loop.steps + step),
            device,
        )
        metrics.update(cal_metrics)
        seconds.append(cost.loop_seconds(cal_history))
        history += [{"calibration": True, **h} for h in cal_history]
    metrics["compute_minutes"] = cost.minutes(*seconds)
    return head, metrics, history
