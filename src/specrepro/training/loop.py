"""The one training loop every trainable component uses.

AdamW, linear warm-up then cosine decay, gradient accumulation, optional bf16 autocast, a tqdm bar,
losses to W&B, an atomic checkpoint every `checkpoint_every` steps, and resume from that checkpoint.
Batches come from `batch_for_step(step)`, a pure function of the step, so a resumed run sees exactly the
batches the interrupted one would have.
"""

from __future__ import annotations

import logging
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from specrepro.errors import SpecReproError

log = logging.getLogger(__name__)


@dataclass
class LoopConfig:
    steps: int = 300  # optimizer steps
    batch_size: int = 8  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    max_grad_norm: float = 1.0
    bf16_autocast: bool = False
    checkpoint_every: int = 50
    log_every: int = 10
    seed: int = 0


def validate_loop(loop, key: str = "training.loop") -> None:
    """Reject a loop config that would fail (or silently train nothing) only after data preparation."""
    for name in ("steps", "batch_size", "grad_accum", "checkpoint_every", "log_every"):
        if loop[name] <= 0:
            raise SpecReproError(f"{key}.{name} must be positive, got {loop[name]}")
    if loop.lr <= 0:
        raise SpecReproError(f"{key}.lr must be positive, got {loop.lr}")
    if loop.warmup_steps < 0:
        raise SpecReproError(f"{key}.warmup_steps must be >= 0, got {loop.warmup_steps}")
    if not 0 <= loop.min_lr_ratio <= 1:
        raise SpecReproError(f"{key}.min_lr_ratio must be in [0, 1], got {loop.min_lr_ratio}")


def micro_batch_indices(step: int, micro: int, n_rows: int, cfg: LoopConfig) -> list[int]:
    """Row indices of one micro-batch: a pure function of the step (seeded epoch permutations), for exact resume."""
    position = (step * cfg.grad_accum + micro) * cfg.batch_size
    epoch, offset = divmod(position, n_rows)
    order = list(range(n_rows))
    random.Random(cfg.seed * 100003 + epoch).shuffle(order)
    return [order[(offset + j) % n_rows] for j in range(cfg.batch_size)]


def lr_lambda(cfg: LoopConfig) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def save_checkpoint(path: Path, step: int, model, optimizer, scheduler, history: list[dict]) -> None:
    trainable = {k: v for k, v in model.state_dict().items() if k in _trainable_names(model)}
    state = {"step": step, "model": trainable, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "rng": torch.get_rng_state(), "history": history}
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _trainable_names(model) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def train_loop(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, dict], tuple[torch.Tensor, dict]],
    batch_for_step: Callable[[int, int], dict],
    cfg: LoopConfig,
    work_dir: Path,
    log_metrics: Callable[[dict, int], None] = lambda metrics, step: None,
    device: torch.device = torch.device("cpu"),
) -> list[dict]:
    """Train the parameters of `model` that require grad; return the logged history.

    loss_fn(model, batch) -> (loss, extra logs); batch_for_step(step, micro) -> batch (tensors on device).
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    checkpoint = work_dir / "checkpoint.pt"
    start, history = 0, []
    if checkpoint.is_file():
        state = torch.load(checkpoint, map_location=device, weights_only=False)
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        start, history = state["step"], state["history"]
        log.info("resuming training from step %d (%s)", start, checkpoint)
    torch.manual_seed(cfg.seed + start)
    model.train()
    bar = tqdm(range(start, cfg.steps), desc="train", unit="step", initial=start, total=cfg.steps)
    for step in bar:
        optimizer.zero_grad(set_to_none=True)
        logs: dict[str, float] = {}
        for micro in range(cfg.grad_accum):
            batch = batch_for_step(step, micro)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
                loss, extra = loss_fn(model, batch)
            (loss / cfg.grad_accum).backward()
            for key, value in {"loss": float(loss.detach()), **extra}.items():
                logs[key] = logs.get(key, 0.0) + float(value) / cfg.grad_accum
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        logs.update(lr=scheduler.get_last_lr()[0], grad_norm=float(grad_norm), step=step + 1)
        bar.set_postfix(loss=f"{logs['loss']:.3f}")
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            history.append(logs)
            log_metrics(logs, step + 1)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            save_checkpoint(checkpoint, step + 1, model, optimizer, scheduler, history)
    model.eval()
    return history
