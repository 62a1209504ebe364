"""SPACE (000) semi-autoregressive SFT: `specrepro train method=space` (SFT control: `training=space_sft_control`).

One mask token [M] is added (a new embedding row drawn from N(0, initializer_range); a tied LM head
shares it, an untied one gets its own row) and the model is fine-tuned on instruction data, prompts
masked (Sec. 3.1). Per sample, drawn once when the data are built (as the official code, A8):
- with probability p_ar the plain AR loss on X + Y (Eq. 1);
- otherwise (needs N >= k + 1) cut Y at a random 0-based index m and feed X + y_<m + [M] * (k + 1) with
  labels y_<m + y_m..y_{m+k} (Eq. 2-3): under the usual shift the last real token predicts y_m and mask j
  predicts y_{m+j}; the (k+1)-th mask is the dummy whose prediction is shifted away; tokens after y_{m+k}
  are dropped. y_m is counted once (A2).
Eq. 4 then holds in expectation. The loss is the token mean of the cross-entropy over all labelled tokens,
mask positions weighted by `mask_loss_weight` (official code: 1). p_ar = 1 is plain SFT, the paper's control.

`groups` > 0 (beyond the paper, `training=space_grouped`): a SAR sample keeps all of X + Y with its AR
loss and gets `groups` mask groups, each anchored after a random real token a, laid out exactly as the
decoder lays them out (Eq. 6-7: mask j at position a + j sees the real tokens up to a and the earlier masks
of its group; real tokens never see masks) and trained to predict y_{a+1+j}. One sample then trains
groups * k mask predictions instead of k, for ~groups * k more tokens of compute.
`continuations` (beyond the paper) adds the model's own greedy answers to bundled prompts as responses,
so the masks learn to guess what this model says (self-distillation, as EESD's head).

The checkpoint is saved as a full model (`space-*`; with LoRA the adapter alone, merged when it is
loaded) whose config records the mask id and the training k (`space_mask_token_id`, `space_k`);
`method=space` decodes it with any k <= that k. Before and after training, greedy SPACE decoding on
held-out prompts gives the mean accepted tokens per step.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
import torch.nn.functional as F

from specrepro.data.config import DatasetConfig
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.space import MASK_TOKEN, SpaceDecoder
from specrepro.errors import SpecReproError
from specrepro.registry import register_component
from specrepro.training import cost
from specrepro.training.distill_data import continuation_dataset, distill_cache_dir, reference_rows
from specrepro.training.loop import LoopConfig, micro_batch_indices, train_loop
from specrepro.training.lora import LoRAConfig, with_lora

log = logging.getLogger(__name__)
IGNORE = -100


@dataclass
class SpaceSFTConfig:
    component: str = "space"  # the control publishes `space_sft_control-*`
    k: int = 5  # masks trained per sample; the decoder can use any k up to this
    p_ar: float = 0.5  # probability of the plain AR loss for a sample (1.0 = the SFT control)
    mask_loss_weight: float = 1.0
    mask_init_std: Optional[float] = None  # std of the [M] embedding; null = the model's initializer_range
    groups: int = 0  # 0: the paper's one cut per SAR sample; > 0: that many decoder-layout mask groups per sample
    data: Dict[str, DatasetConfig] = field(default_factory=dict)  # instruction sets with reference responses
    continuations: Dict[str, DatasetConfig] = field(default_factory=dict)  # optional: the model's own greedy answers
    continuation_tokens: int = 128
    generation_batch_size: int = 16
    max_prompt_tokens: int = 192
    max_response_tokens: int = 192
    heldout_prompts: int = 4  # kept out of training; greedy SPACE on them before/after gives held-out MAT
    eval_tokens: int = 64
    seed: int = 0
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)


def add_mask_token(model, tokenizer, std: Optional[float]) -> int:
    """Add [M] to the tokenizer and a normally initialised row for it to the embeddings (and an untied head).

    A SAR-SFT checkpoint (`model.source=artifact`) already has a trained [M]: it is kept, so training
    continues from it."""
    trained_id = getattr(model.config, "space_mask_token_id", None)
    if trained_id is not None:
        return int(trained_id)
    tokenizer.add_tokens([MASK_TOKEN], special_tokens=True)
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    if mask_id >= model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(mask_id + 1, mean_resizing=False)
    std = std if std is not None else getattr(model.config, "initializer_range", 0.02)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for matrix in {
            id(m): m for m in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)
        }.values():
            matrix[mask_id] = torch.randn(matrix.shape[1], generator=generator).to(matrix) * std
    return mask_id


def sar_sample(prompt: list[int], response: list[int], k: int, p_ar: float, mask_id: int, rng: random.Random) -> dict:
    """One training sample {input_ids, labels, is_mask}: plain AR with probability p_ar, else the SAR layout (Eq. 2)."""
    if rng.random() < p_ar or len(response) < k + 1:
        ids, labels, n_masks = prompt + response, [IGNORE] * len(prompt) + response, 0
    else:
        m = rng.randint(0, len(response) - k - 1)  # 0-based cut: targets y_m..y_{m+k} exist
        ids = prompt + response[:m] + [mask_id] * (k + 1)
        labels = [IGNORE] * len(prompt) + response[: m + k + 1]
        n_masks = k + 1
    is_mask = [False] * (len(ids) - n_masks) + [True] * n_masks
    return {"input_ids": ids, "labels": labels, "is_mask": is_mask}


def grouped_sample(
    prompt: list[int], response: list[int], k: int, groups: int, p_ar: float, mask_id: int, rng: random.Random
) -> dict:
    """X + Y with its AR labels plus, with probability 1 - p_ar, up to `groups` decoder-layout mask groups.

    Group anchors are distinct response indices a in [-1, N - k - 2] (-1: the last prompt token, as after
    the prefill); mask j of a group sits at position a + j and predicts y_{a+1+j}. Labels keep the usual
    shift (a slot's label is the previous position's target), so one trailing dummy mask carries the last
    mask's label. `anchor` is -1 for real tokens and the anchor's sequence index for masks.
    """
    n_prompt, n_real = len(prompt), len(prompt) + len(response)
    ids, positions = prompt + response, list(range(n_real))
    targets = [IGNORE] * (n_prompt - 1) + response + [IGNORE]  # what each real position predicts
    anchor, group = [-1] * n_real, [-1] * n_real
    starts = range(-1, len(response) - k - 1)
    chosen = [] if rng.random() < p_ar else sorted(rng.sample(starts, min(groups, len(starts))))
    for g, a in enumerate(chosen):
        for j in range(1, k + 1):
            ids.append(mask_id), positions.append(n_prompt + a + j), targets.append(response[a + 1 + j])
            anchor.append(n_prompt + a), group.append(g)
    if chosen:  # the dummy mask: it only holds the last mask's label
        ids.append(mask_id), positions.append(n_real), targets.append(IGNORE)
        anchor.append(n_real - 1), group.append(len(chosen))
    labels = [IGNORE] + targets[:-1]
    is_mask = [a >= 0 for a in anchor]
    return {
        "input_ids": ids,
        "labels": labels,
        "is_mask": is_mask,
        "anchor": anchor,
        "group": group,
        "position_ids": positions,
    }


def build_samples(rows: list[dict], spec: SpaceSFTConfig, mask_id: int) -> list[dict]:
    rng = random.Random(spec.seed)
    if spec.groups:
        return [
            grouped_sample(r["prompt_ids"], r["continuation_ids"], spec.k, spec.groups, spec.p_ar, mask_id, rng)
            for r in rows
        ]
    return [sar_sample(r["prompt_ids"], r["continuation_ids"], spec.k, spec.p_ar, mask_id, rng) for r in rows]


def grouped_attention(sample: dict, width: int) -> torch.Tensor:
    """(width, width) bool: real tokens see earlier real tokens; a mask sees real tokens up to its anchor and
    the earlier masks of its group (the decoder's Eq. 6 mask); padding sees itself only."""
    anchor, group = torch.tensor(sample["anchor"]), torch.tensor(sample["group"])
    n, index = len(anchor), torch.arange(len(anchor))
    real = anchor < 0
    sees_real = real[None, :] & (index[None, :] <= torch.where(real, index, anchor)[:, None])
    same_group = (
        ~real[:, None] & ~real[None, :] & (group[:, None] == group[None, :]) & (index[None, :] <= index[:, None])
    )
    allow = torch.eye(width, dtype=torch.bool)
    allow[:n, :n] = sees_real | same_group
    return allow


def pad_batch(samples: list[dict], pad_id: int, device) -> dict:
    """Right-padded tensors; grouped samples add their position ids and a (B, 1, L, L) bool attention mask."""
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE, dtype=torch.long)
    is_mask = torch.zeros((len(samples), width), dtype=torch.bool)
    for i, sample in enumerate(samples):
        n = len(sample["input_ids"])
        ids[i, :n], labels[i, :n] = torch.tensor(sample["input_ids"]), torch.tensor(sample["labels"])
        is_mask[i, :n] = torch.tensor(sample["is_mask"])
    batch = {"input_ids": ids.to(device), "labels": labels.to(device), "is_mask": is_mask.to(device)}
    if "anchor" in samples[0]:
        positions = torch.arange(width).repeat(len(samples), 1)
        for i, sample in enumerate(samples):
            positions[i, : len(sample["position_ids"])] = torch.tensor(sample["position_ids"])
        batch["position_ids"] = positions.to(device)
        batch["attention_mask"] = torch.stack([grouped_attention(s, width) for s in samples])[:, None].to(device)
    return batch


def sar_sft_loss(model, batch: dict, mask_loss_weight: float) -> tuple[torch.Tensor, dict]:
    """Token-mean cross-entropy of position t predicting label t + 1 (right padding is never attended)."""
    logits = (
        model(
            input_ids=batch["input_ids"],
            position_ids=batch.get("position_ids"),
            attention_mask=batch.get("attention_mask"),
        )
        .logits[:, :-1]
        .float()
    )
    labels, from_mask = batch["labels"][:, 1:], batch["is_mask"][:, :-1]
    token_loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE, reduction="none")
    labelled = labels != IGNORE
    weights = torch.where(from_mask, mask_loss_weight, 1.0) * labelled
    loss = (token_loss * weights).sum() / weights.sum().clamp_min(1.0)
    mask_labelled = from_mask & labelled
    logs = {"ar_loss": float(token_loss[labelled & ~from_mask].mean().detach())}
    if mask_labelled.any():
        logs["mask_loss"] = float(token_loss[mask_labelled].mean().detach())
        logs["mask_top1"] = float((logits.argmax(-1) == labels)[mask_labelled].float().mean())
    return loss, logs


def heldout_mat(model, tokenizer, prompts: list[list[int]], k: int, max_new_tokens: int) -> float:
    """Mean tokens per step of greedy SPACE on held-out prompts (prefill excluded)."""
    decoder = SpaceDecoder(model, tokenizer, model.config.space_mask_token_id, k)
    tokens = steps = 0
    for prompt in prompts:
        gen = decoder.generate(prompt, Sampling(), max_new_tokens)
        tokens, steps = tokens + sum(gen.accepted), steps + gen.steps
    return tokens / max(steps, 1)


@register_component("space", "space_sft_control", schema=SpaceSFTConfig)
def train_space_sft(cfg, target, work_dir, log_metrics, device):
    spec = cfg.training
    if not 0.0 <= spec.p_ar <= 1.0 or spec.k < 1:
        raise SpecReproError(f"training.p_ar must be in [0, 1] and training.k >= 1 (got {spec.p_ar}, {spec.k})")
    model, tokenizer = target.model, target.tokenizer
    if tokenizer is None:
        raise SpecReproError("SAR-SFT needs the model's tokenizer (to add the [M] token)")
    end_of_turn = tokenizer.eos_token_id
    rows = reference_rows(spec.data, tokenizer, spec.max_prompt_tokens, spec.max_response_tokens, end_of_turn)
    caches = []
    if spec.continuations:  # the base model's own answers, generated before [M] exists (cached, shared with EESD)
        cache = distill_cache_dir(
            cfg, "continuations", spec.continuations, spec.continuation_tokens, spec.max_prompt_tokens
        )
        generated = continuation_dataset(
            target,
            spec.continuations,
            spec.continuation_tokens,
            spec.generation_batch_size,
            spec.max_prompt_tokens,
            cache,
        )
        caches.append(cache)
        rows += [{**row, "source": f"{row['source']}_self"} for row in generated]
    mask_id = add_mask_token(model, tokenizer, spec.mask_init_std)
    model.config.space_mask_token_id, model.config.space_k, model.config.space_p_ar = mask_id, spec.k, spec.p_ar
    random.Random(spec.seed).shuffle(rows)
    heldout, rows = rows[: spec.heldout_prompts], rows[spec.heldout_prompts :]
    if not rows:
        raise SpecReproError("no SAR-SFT samples: training.data needs datasets with reference responses")
    samples = build_samples(rows, spec, mask_id)
    eval_prompts = [r["prompt_ids"] for r in heldout]
    model.eval()
    before = heldout_mat(model, tokenizer, eval_prompts, spec.k, spec.eval_tokens)
    if spec.lora.r:
        # the new [M] row must learn too (and an untied head's row, so the adapter restores it), in the modules
        # as this architecture names them (LLaMA's embed_tokens and lm_head, GPT-2's wte)
        names = {module: name.rsplit(".", 1)[-1] for name, module in model.named_modules()}
        tables = [model.get_input_embeddings()]
        tables += [] if model.config.tie_word_embeddings else [model.get_output_embeddings()]
        model = with_lora(model, spec.lora, trainable_token_indices={names[table]: [mask_id] for table in tables})
    else:
        model.requires_grad_(True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_of_turn

    def batch_for_step(step: int, micro: int) -> dict:
        return pad_batch(
            [samples[i] for i in micro_batch_indices(step, micro, len(samples), spec.loop)], pad_id, device
        )

    torch.manual_seed(spec.loop.seed)
    history = train_loop(
        model,
        lambda m, batch: sar_sft_loss(m, batch, spec.mask_loss_weight),
        batch_for_step,
        spec.loop,
        work_dir,
        log_metrics,
        device,
    )
    model.requires_grad_(False).eval()
    # with LoRA the adapter is what gets saved (merged when loaded); the base model with the adapter
    # layers injected runs the decoder
    after = heldout_mat(
        model.get_base_model() if spec.lora.r else model, tokenizer, eval_prompts, spec.k, spec.eval_tokens
    )
    n_sar = sum(any(s["is_mask"]) for s in samples)
    metrics = {
        "mask_token_id": mask_id,
        "k": spec.k,
        "p_ar": spec.p_ar,
        "train_samples": len(samples),
        "sar_samples": n_sar,
        "train_tokens_per_epoch": sum(len(s["input_ids"]) for s in samples),
        "heldout_prompts": len(eval_prompts),
        "heldout_mat_before": before,
        "heldout_mat_after": after,
        "groups": spec.groups,
        "compute_minutes": cost.minutes(cost.loop_seconds(history), *map(cost.recorded, caches)),
        "samples_by_source": {src: sum(r["source"] == src for r in rows) for src in {r["source"] for r in rows}},
    }
    log_metrics({k: v for k, v in metrics.items() if k != "samples_by_source"}, spec.loop.steps)
    log.info("SAR-SFT done: %s", metrics)
    return model, metrics, history
