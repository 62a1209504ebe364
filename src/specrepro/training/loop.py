"""The one training loop every trainable component uses.

AdamW, linear warm-up then cosine decay, gradient accumulation, optional bf16 mixed precision, a tqdm bar,
losses to W&B, a checkpoint every `checkpoint_every` steps and resume from it, all through 🤗 Accelerate: the
same loop runs in one process or under `accelerate launch` with DDP, FSDP or DeepSpeed (conf/accelerate/).
Batches come from `batch_for_step(step, micro)`, a pure function of the step, so a resumed run sees exactly
the batches the interrupted one would have.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import random
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from tqdm import tqdm

from specrepro import suspension
from specrepro.errors import SpecReproError
from specrepro.models.kernels import warn_if_bf16_is_slow
from specrepro.reuse import note_reused
from specrepro.tracking import atomic_write
from specrepro.training.shards import BATCHES_SUFFIX

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
    """This process's row indices of one micro-batch. The micro-batch (`batch_size` rows) is a pure function of
    the step (seeded epoch permutations), for exact resume; under `accelerate launch` each of the N processes
    takes every N-th of its rows, so the global batch is the same whatever N is, and a resume may change N."""
    state = PartialState()
    if cfg.batch_size % state.num_processes:
        raise SpecReproError(
            f"training.loop.batch_size={cfg.batch_size} does not split over {state.num_processes} processes"
        )
    if not n_rows:
        raise SpecReproError("no training rows: the recipe's data is empty after its limits and held-out split")
    start = (step * cfg.grad_accum + micro) * cfg.batch_size
    rows = [
        _epoch_order(cfg.seed, epoch, n_rows)[offset]
        for epoch, offset in (divmod(position, n_rows) for position in range(start, start + cfg.batch_size))
    ]
    return rows[state.process_index :: state.num_processes]


@lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n_rows: int) -> tuple[int, ...]:
    """Epoch `epoch`'s permutation of the rows: each epoch shows every row once, a micro-batch that crosses into
    the next epoch included."""
    order = list(range(n_rows))
    random.Random(seed * 100003 + epoch).shuffle(order)
    return tuple(order)


def lr_lambda(cfg: LoopConfig) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


class _Progress:
    """The loop's own state in a checkpoint (next step, logged history, seconds spent up to that step), saved by the
    accelerator beside the rest."""

    def __init__(self):
        self.step, self.history, self.seconds = 0, [], 0.0

    def state_dict(self) -> dict:
        return {"step": self.step, "history": self.history, "seconds": self.seconds}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.history, self.seconds = state["step"], state["history"], state.get("seconds")


class _LossModule(torch.nn.Module):
    """`loss_fn(model, batch)` as the module's forward, so DDP / FSDP / DeepSpeed see every forward it makes
    (a loss may call the model's parts, e.g. a draft's trunk and its LM head on a few positions)."""

    def __init__(self, model: torch.nn.Module, loss_fn):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, batch: dict):
        return self.loss_fn(self.model, batch)


LATEST = "latest"  # the file naming the newest complete checkpoint folder under a work dir


def clear_checkpoints(work_dir: Path) -> None:
    """Forget every checkpoint under `work_dir` (and its sub-folders: a component may train several loops), and
    the batches of data generation saved there (`shards.map_batches`)."""
    for pointer in work_dir.rglob(LATEST):
        pointer.unlink()
    for saved in work_dir.rglob(f"*{BATCHES_SUFFIX}"):
        shutil.rmtree(saved)


def _save(accelerator: Accelerator, work_dir: Path, step: int) -> None:
    """accelerator.save_state into `checkpoint-<step>/`, then point `latest` at it (atomically) and drop the older
    folder: a kill at any moment leaves `latest` naming a complete checkpoint."""
    folder = work_dir / f"checkpoint-{step}"
    accelerator.save_state(str(folder))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        previous = (work_dir / LATEST).read_text().strip() if (work_dir / LATEST).is_file() else None
        atomic_write(work_dir / LATEST, folder.name + "\n")
        if previous and previous != folder.name:
            shutil.rmtree(work_dir / previous, ignore_errors=True)
    accelerator.wait_for_everyone()


def _accelerator(cfg: LoopConfig, device: torch.device) -> Accelerator:
    """The process's accelerator with this loop's mixed precision. The launch (`accelerate launch`, torchrun, or
    none: one process) picks DDP / FSDP / DeepSpeed; a component whose loops differ in precision (EESD's head in
    bf16, its calibration in fp32) gets a fresh accelerator state per loop, the process group kept."""
    precision = "bf16" if cfg.bf16_autocast else "no"
    if cfg.bf16_autocast and device.type == "cpu":
        warn_if_bf16_is_slow("training.loop.bf16_autocast")
    if AcceleratorState._shared_state and AcceleratorState().mixed_precision != precision:
        AcceleratorState._reset_state()
    return Accelerator(mixed_precision=precision, cpu=device.type == "cpu")


def train_loop(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, dict], tuple[torch.Tensor, dict]],
    batch_for_step: Callable[[int, int], dict],
    cfg: LoopConfig,
    work_dir: Path,
    log_metrics: Callable[[dict, int], None] = lambda metrics, step: None,
    device: torch.device = torch.device("cpu"),
) -> list[dict]:
    """Train the parameters of `model` that require grad on 🤗 Accelerate; return the logged history.

    loss_fn(model, batch) -> (loss, extra logs); batch_for_step(step, micro) -> this process's share of the
    micro-batch (see `micro_batch_indices`), tensors on device. In one process this is plain training; under
    `accelerate launch` gradients are averaged over processes: the global batch (batch_size x grad_accum) does not
    depend on the process count, but each process's loss is a mean over its share's tokens, so N processes train
    as one whose micro-batches are those shares. Only the main process logs.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    accelerator = _accelerator(cfg, device)
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    # FSDP and DeepSpeed rewrite the module they wrap: they train a copy, whose weights come back at the end
    trained = _LossModule(copy.deepcopy(model) if sharded else model, loss_fn)
    optimizer = torch.optim.AdamW(
        [p for p in trained.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))  # one step per optimizer step
    trained, optimizer = accelerator.prepare(trained, optimizer)
    progress = _Progress()
    accelerator.register_for_checkpointing(scheduler, progress)
    latest = work_dir / LATEST
    torch.manual_seed(cfg.seed)  # a resume then restores the generators as they were at its checkpoint (dropout)
    if latest.is_file():
        accelerator.load_state(str(work_dir / latest.read_text().strip()))
        log.info("resuming training from step %d (%s)", progress.step, work_dir)
        note_reused(f"training steps 1-{progress.step} of {work_dir.name}")
    start, resumed_seconds, clock = progress.step, progress.seconds, suspension.clock()
    trained.train()
    bar = tqdm(
        range(start, cfg.steps),
        desc="train",
        unit="step",
        initial=start,
        total=cfg.steps,
        disable=not accelerator.is_main_process,
    )
    for step in bar:
        logs: dict[str, float] = {}
        for micro in range(cfg.grad_accum):
            batch = batch_for_step(step, micro)
            # gradients are averaged across processes once per optimizer step, on its last micro-batch
            with accelerator.no_sync(trained) if micro + 1 < cfg.grad_accum else contextlib.nullcontext():
                loss, extra = trained(batch)
                accelerator.backward(loss / cfg.grad_accum)
            for key, value in {"loss": loss.detach(), **extra}.items():
                logs[key] = logs.get(key, 0.0) + float(value) / cfg.grad_accum
        logs = {
            key: float(accelerator.reduce(torch.tensor(value, device=accelerator.device), "mean"))
            for key, value in logs.items()
        }
        grad_norm = accelerator.clip_grad_norm_(trained.parameters(), cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # seconds of this loop so far, across resumes (None under a checkpoint from before they were counted)
        seconds = None if resumed_seconds is None else resumed_seconds + suspension.clock() - clock
        logs.update(lr=scheduler.get_last_lr()[0], grad_norm=float(grad_norm), step=step + 1, seconds=seconds)
        bar.set_postfix(loss=f"{logs['loss']:.3f}")
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            progress.history.append(logs)
            if accelerator.is_main_process:
                log_metrics(logs, step + 1)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            progress.step, progress.seconds = step + 1, seconds
            _save(accelerator, work_dir, step + 1)
    if sharded:  # the full weights, gathered from the shards, back into the caller's module
        state = accelerator.get_state_dict(trained)
        model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    accelerator.free_memory()
    model.eval()
    return progress.history
