"""CLLMs (Kou et al. 2024): Jacobi trajectory collection and consistency training, two stages of `specrepro train`.

Stage `trajectories` (Alg. 1): for every bundled prompt, Jacobi-decode the target block by block; each
n-token block gives one trajectory {y^(0), ..., y*} paired with the prefix before the block; the next
block's prefix is prefix + y*. y^(0) is drawn uniformly with replacement from the prompt's tokens, the
state is re-fed whole every iteration on the prefix's KV cache, and iteration stops at y^(j+1) = y^(j).
Options: the paper's augmentation (randomly correct wrong tokens; the official rule: skip the last two
states, correct floor(#wrong/2) wrong positions drawn with replacement, never the first wrong one) and
a repetition filter after the official one: drop a prompt whose output, up to its EOS, has a run of
`repeat_run` identical tokens (the official code drops each block whose prefix, prompt included, has such a
run: the blocks before the repetition are kept there); the drop counts go to the artifact's metrics.
Published as a `datasets` dataset (`cllm_trajectories-*`).

Stage `train` (Alg. 2): full fine-tune (or LoRA) of the target on those trajectories with
L = L_consistency + w * L_AR (Eq. 7):
- global consistency (Eq. 4): D(q_θ⁻(.|y*_<i, x) || q_θ(.|y_<i, x)) for y uniform over the states but y*;
  local (Eq. 5, the ablation): y^(j+1) replaces y* as the target state;
- θ⁻ = stopgrad(θ): the current model on the target state, detached (one forward gives it and L_AR);
- D: forward KL (the paper's main choice), reverse KL or JSD; mean over the block positions from the
  first position where the state differs from the target state on (official code);
- L_AR (Eq. 6): label-smoothed cross-entropy on the target's generation (prompt tokens masked), or on the
  dataset's ground-truth answer (`ar_target=gt`); w = 10 and smoothing 0.1 as in the official code.
Published as a full model (`cllm-*`), loaded for decoding with `model.source=artifact model.id=cllm`.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Dict

import torch
import torch.nn.functional as F

from specrepro import suspension
from specrepro.data import load_records, prompt_ids, reference_response
from specrepro.data.config import DatasetConfig
from specrepro.decoding.base import _eos_ids
from specrepro.decoding.jacobi import JacobiDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.steps import rollback_cache
from specrepro.decoding.verify import crop_cache
from specrepro.errors import SpecReproError
from specrepro.registry import register_component
from specrepro.training import cost
from specrepro.training.artifacts import find_matching_artifact, read_metadata
from specrepro.training.loop import LoopConfig, micro_batch_indices, train_loop
from specrepro.training.shards import BATCHES_SUFFIX, map_batches
from specrepro.training.lora import LoRAConfig, with_lora

if TYPE_CHECKING:
    from datasets import Dataset

log = logging.getLogger(__name__)


@dataclass
class CLLMLossConfig:
    consistency: str = "global"  # global (Eq. 4) | local (Eq. 5)
    distance: str = "fkl"  # fkl | rkl | jsd
    ar_weight: float = 10.0  # w in Eq. 7 (official code)
    label_smoothing: float = 0.1  # on the AR cross-entropy (official code)
    ar_target: str = "teacher"  # teacher (the target's generation, Eq. 6) | gt (the dataset's answer)


@dataclass
class CLLMTrainingConfig:
    stage: str = "train"  # trajectories | train
    components: Dict[str, str] = field(default_factory=lambda: {"trajectories": "cllm_trajectories", "train": "cllm"})
    component: str = "cllm"  # the artifact prefix; conf/training/cllm.yaml derives it from `stage`
    # stage trajectories
    prompts: Dict[str, DatasetConfig] = field(default_factory=dict)
    block_size: int = 16  # n
    max_new_tokens: int = 128  # N: response tokens per prompt (official code: 512)
    max_prompt_tokens: int = 256  # longer prompts keep their last tokens
    augment: bool = True
    repeat_run: int = 10  # drop prompts whose output repeats one token this many times in a row; 0 = off
    seed: int = 0
    # stage train
    trajectories: str = "cllm_trajectories"  # artifact name, prefix or path
    train_prefix_tokens: int = 128  # prefix tokens kept in front of each block when training
    heldout_prompts: int = 4  # prompts kept out of training; Jacobi on them before/after is the speed metric
    eval_tokens: int = 64
    loss: CLLMLossConfig = field(default_factory=CLLMLossConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)


# ---------------------------------------------------------------- stage 1: Jacobi trajectories


@torch.inference_mode()
def jacobi_trajectories(
    model, prompt_ids: list[int], n: int, max_new_tokens: int, eos_ids: set[int], rng: random.Random
) -> list[dict]:
    """One trajectory per n-token block: {prefix_ids, states y^(0..k-1), fixed_point y*} (Alg. 1)."""
    device = next(model.parameters()).device
    cache = rollback_cache(model.config)  # cropped after each iteration: past a sliding window too
    if len(prompt_ids) > 1:
        model(torch.tensor([prompt_ids[:-1]], device=device), cache=cache)
    prefix, rows = list(prompt_ids), []
    while len(prefix) - len(prompt_ids) < max_new_tokens:
        past = len(prefix) - 1
        state, states = rng.choices(prompt_ids, k=n), []
        while True:  # Eq. 3 until y^(j+1) = y^(j)
            logits = model(torch.tensor([[prefix[-1], *state]], device=device), cache=cache).logits[0]
            update = logits[:n].argmax(-1).tolist()
            if update == state:
                break
            crop_cache(cache, past)
            states.append(state)
            state = update
        crop_cache(cache, past + n)  # the KV of [last prefix token, y*[:-1]] is exact: keep it
        rows.append({"prefix_ids": list(prefix), "states": states, "fixed_point": state})
        prefix += state
        if eos_ids & set(state):
            break
    return rows


def augment_states(states: list[list[int]], fixed_point: list[int], rng: random.Random) -> list[list[int]]:
    """Correct floor(#wrong/2) wrong tokens (drawn with replacement, never the first wrong one) in all states but
    the last."""
    augmented = [list(s) for s in states]
    for state in augmented[:-1]:  # with y* excluded, skipping the last two states of {y^(0), ..., y*}
        wrong = [i for i, (a, b) in enumerate(zip(state, fixed_point)) if a != b]
        if len(wrong) > 1:
            for i in rng.choices(wrong[1:], k=len(wrong) // 2):
                state[i] = fixed_point[i]
    return augmented


def longest_run(tokens: list[int], stop: set[int] = frozenset()) -> int:
    """The longest run of one repeated token before the first `stop` token (the output ends there)."""
    best = run = 0
    for i, tok in enumerate(tokens):
        if tok in stop:
            break
        run = run + 1 if i and tok == tokens[i - 1] else 1
        best = max(best, run)
    return best


class TrajectoryDataset:
    """The stage-1 component: a `datasets` dataset written under `<artifact>/trajectories`."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def save_pretrained(self, path) -> None:
        self.dataset.save_to_disk(str(Path(path) / "trajectories"))


def collect_trajectories(cfg, target, work_dir, log_metrics, device):
    """Jacobi trajectories of every prompt (Alg. 1), split over the processes of a launch (training/shards.py):
    each prompt draws its random initial states from its own seeded generator, so the dataset is the same
    whatever the number of processes."""
    spec = cfg.training
    clock = suspension.clock()
    tokenizer, model = target.tokenizer, target.model
    eos_ids = _eos_ids(model, tokenizer)
    prompts = []  # (source, prompt ids, reference ids)
    for source, dataset_cfg in spec.prompts.items():
        for record in load_records(dataset_cfg):
            prompt = prompt_ids(record, tokenizer, dataset_cfg, [])
            answer = reference_response(record)
            prompts.append(
                (
                    source,
                    prompt[-spec.max_prompt_tokens :],
                    tokenizer(answer, add_special_tokens=False)["input_ids"] if answer else [],
                )
            )

    def trajectories(positions: list[int]) -> list[list[dict]]:
        found = []
        for position in positions:
            rng = random.Random(spec.seed * 1_000_003 + position)
            rows = jacobi_trajectories(model, prompts[position][1], spec.block_size, spec.max_new_tokens, eos_ids, rng)
            for row in rows:
                row["states"] = (
                    augment_states(row["states"], row["fixed_point"], rng) if spec.augment else row["states"]
                )
            found.append(rows)
        return found

    saved = work_dir / f"trajectories{BATCHES_SUFFIX}"  # a collection killed part-way resumes at its prompt
    per_prompt, earlier_seconds = map_batches(
        [[position] for position in range(len(prompts))], trajectories, "Jacobi trajectories", saved
    )
    columns = {
        k: [] for k in ("source", "prompt_index", "prompt_len", "prefix_ids", "states", "fixed_point", "reference_ids")
    }
    dropped_prompts = dropped_rows = prompt_index = 0
    for (source, prompt, reference), rows in zip(prompts, per_prompt):
        output = [tok for row in rows for tok in row["fixed_point"]]
        if spec.repeat_run and longest_run(output, eos_ids) >= spec.repeat_run:
            dropped_prompts, dropped_rows = dropped_prompts + 1, dropped_rows + len(rows)
            continue
        for row in rows:
            for key, value in (
                ("source", source),
                ("prompt_index", prompt_index),
                ("prompt_len", len(prompt)),
                ("prefix_ids", row["prefix_ids"]),
                ("states", row["states"]),
                ("fixed_point", row["fixed_point"]),
                ("reference_ids", reference),
            ):
                columns[key].append(value)
        prompt_index += 1
    if not columns["source"]:
        raise SpecReproError("no Jacobi trajectories were kept: add prompts or relax training.repeat_run")
    from datasets import Dataset  # slow to import: only where it is used

    dataset = Dataset.from_dict(columns)
    iterations = [len(s) for s in columns["states"]]
    metrics = {
        "prompts": prompt_index,
        "trajectories": len(dataset),
        "block_size": spec.block_size,
        "dropped_prompts_repetition": dropped_prompts,
        "dropped_trajectories_repetition": dropped_rows,
        "mean_iterations_per_block": sum(iterations) / len(iterations),
        "tokens_per_forward": spec.block_size * len(iterations) / max(1, sum(iterations) + len(iterations)),
        "trajectories_by_source": {s: columns["source"].count(s) for s in set(columns["source"])},
        "compute_minutes": cost.minutes(suspension.clock() - clock + earlier_seconds),
    }
    log_metrics(metrics | {"trajectories_by_source": None}, 0)
    log.info("collected %s", metrics)
    return TrajectoryDataset(dataset), metrics, []


# ---------------------------------------------------------------- stage 2: consistency training


def distance(target_logits: torch.Tensor, student_logits: torch.Tensor, kind: str) -> torch.Tensor:
    """D(P || Q) per position, P = stop-grad target, Q = student."""
    log_p, log_q = target_logits.float().log_softmax(-1), student_logits.float().log_softmax(-1)
    if kind == "fkl":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if kind == "rkl":
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    if kind == "jsd":
        log_m = torch.logsumexp(torch.stack([log_p, log_q]), 0) - torch.log(torch.tensor(2.0))
        return 0.5 * ((log_p.exp() * (log_p - log_m)).sum(-1) + (log_q.exp() * (log_q - log_m)).sum(-1))
    raise SpecReproError(f"training.loss.distance={kind} is not one of fkl, rkl, jsd")


def pick_states(row: dict, consistency: str, rng: random.Random) -> tuple[list[int], list[int]]:
    """(student state, target state): y ~ J and y* (global), or y^(j) and y^(j+1) (local)."""
    chain = row["states"] + [row["fixed_point"]]
    j = rng.randrange(len(chain) - 1) if len(chain) > 1 else 0
    if consistency == "global":
        return chain[j], row["fixed_point"]
    if consistency == "local":
        return chain[j], chain[min(j + 1, len(chain) - 1)]
    raise SpecReproError(f"training.loss.consistency={consistency} is not one of global, local")


def row_losses(model, row: dict, spec, rng: random.Random, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(consistency loss, AR loss) of one trajectory."""
    loss_cfg, n = spec.loss, spec.block_size
    prefix = row["prefix_ids"][-spec.train_prefix_tokens :]
    response_start = max(
        0, row["prompt_len"] - (len(row["prefix_ids"]) - len(prefix))
    )  # first response token in prefix
    student_state, target_state = pick_states(row, loss_cfg.consistency, rng)
    block = slice(len(prefix) - 1, len(prefix) - 1 + n)  # logits predicting the block's n tokens
    target_ids = torch.tensor([prefix + target_state], device=device)
    target_logits = model(target_ids).logits[0]
    differs = [i for i, (a, b) in enumerate(zip(student_state, target_state)) if a != b]
    if differs:  # official masking: positions predicting tokens before the first difference are left out
        student_logits = model(torch.tensor([prefix + student_state], device=device)).logits[0, block]
        keep = slice(differs[0], n)
        consistency = distance(target_logits[block][keep].detach(), student_logits[keep], loss_cfg.distance).mean()
    else:
        consistency = target_logits.sum() * 0.0
    if loss_cfg.ar_target == "teacher":  # Eq. 6 on the target's generation in the window: prompt masked
        if target_state != row["fixed_point"]:
            target_ids = torch.tensor([prefix + row["fixed_point"]], device=device)
            target_logits = model(target_ids).logits[0]
        start = max(response_start, 1)
        ar = F.cross_entropy(
            target_logits[start - 1 : -1].float(), target_ids[0, start:], label_smoothing=loss_cfg.label_smoothing
        )
    elif loss_cfg.ar_target == "gt":
        prompt = row["prefix_ids"][: row["prompt_len"]][-spec.train_prefix_tokens :]
        answer = row["reference_ids"][: spec.train_prefix_tokens]
        if not answer:
            raise SpecReproError("training.loss.ar_target=gt needs prompt sets with reference answers")
        ids = torch.tensor([prompt + answer], device=device)
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
        ar = F.cross_entropy(logits.float(), ids[0, len(prompt) :], label_smoothing=loss_cfg.label_smoothing)
    else:
        raise SpecReproError(f"training.loss.ar_target={loss_cfg.ar_target} is not one of teacher, gt")
    return consistency, ar


def consistency_loss_fn(spec, rows: list[dict], device):
    """loss_fn(model, batch) for the shared loop: batch = indices of trajectories."""

    def loss_fn(model, batch):
        rng = random.Random(batch["seed"])
        pairs = [row_losses(model, rows[i], spec, rng, device) for i in batch["indices"]]
        consistency = torch.stack([c for c, _ in pairs]).mean()
        ar = torch.stack([a for _, a in pairs]).mean()
        return consistency + spec.loss.ar_weight * ar, {
            "consistency_loss": float(consistency.detach()),
            "ar_loss": float(ar.detach()),
        }

    return loss_fn


def batches(n_rows: int, loop: LoopConfig):
    """batch_for_step(step, micro): the shared seeded sampler's indices plus a seed for the state draws."""

    def batch_for_step(step: int, micro: int) -> dict:
        position = (step * loop.grad_accum + micro) * loop.batch_size
        return {"indices": micro_batch_indices(step, micro, n_rows, loop), "seed": loop.seed * 100003 + position}

    return batch_for_step


def jacobi_speed(model, tokenizer, prompts: list[list[int]], block_size: int, max_new_tokens: int) -> dict:
    """Greedy Jacobi on held-out prompts: tokens per iteration (prefill excluded) and stationary tokens per
    iteration, for the paper's block and for the sliding window (`_sliding`)."""
    speed = {}
    for sliding, suffix in ((False, ""), (True, "_sliding")):
        decoder = JacobiDecoder(model, tokenizer, block_size, sliding)
        tokens = steps = stationary = 0
        for seed, prompt in enumerate(prompts):
            gen = decoder.generate(prompt, Sampling(), max_new_tokens, seed=seed)
            tokens, steps = tokens + sum(gen.accepted), steps + gen.steps
            stationary += sum(gen.extra["stationary"])
        speed |= {
            f"tokens_per_iteration{suffix}": tokens / max(steps, 1),
            f"stationary_per_iteration{suffix}": stationary / max(steps, 1),
        }
    return speed


def find_trajectories(cfg) -> Path:
    """The trajectories `training.trajectories` names exactly, else the newest complete `<ref>-*` collected with n =
    `training.block_size` from this run's target (its config and weights: the ref names the model already)."""
    from specrepro.identity import run_target

    ref, artifacts_dir, block_size = cfg.training.trajectories, cfg.artifacts_dir, cfg.training.block_size
    target = {key: value for key, value in run_target(cfg).items() if key != "name"}
    path = find_matching_artifact(
        ref,
        artifacts_dir,
        target,
        lambda p: read_metadata(p)["metrics"]["block_size"] == block_size,
    )
    if path is None:
        raise SpecReproError(
            f"no Jacobi trajectories '{ref}' with block_size {block_size} under {artifacts_dir}: collect them with "
            f"`specrepro train method=cllm training.stage=trajectories training.block_size={block_size}`"
        )
    return path


def trajectories_input(cfg) -> dict:
    """The trajectories consistency training reads, by name and content (none for the collecting stage)."""
    from specrepro.identity import content_digest

    if cfg.training.stage != "train":
        return {}
    path = find_trajectories(cfg)
    return {"trajectories": {"name": path.name, "content_digest": content_digest(path / "trajectories")}}


def train_consistency(cfg, target, work_dir, log_metrics, device):
    spec = cfg.training
    source = find_trajectories(cfg) / "trajectories"
    trajectory_minutes = cost.artifact_minutes(source.parent)
    from datasets import load_from_disk

    dataset = load_from_disk(str(source))
    held = set(range(spec.heldout_prompts))
    heldout = [r for r in dataset if r["prompt_index"] in held and len(r["prefix_ids"]) == r["prompt_len"]]
    rows = [r for r in dataset if r["prompt_index"] not in held]
    if not rows:
        raise SpecReproError(f"{source} has no trajectories left after holding out {spec.heldout_prompts} prompts")
    eval_prompts = [r["prefix_ids"] for r in heldout]
    model = target.model
    before = jacobi_speed(model, target.tokenizer, eval_prompts, spec.block_size, spec.eval_tokens)
    if spec.lora.r:
        model = with_lora(model, spec.lora)
    else:
        model.requires_grad_(True)
    torch.manual_seed(spec.loop.seed)
    history = train_loop(
        model,
        consistency_loss_fn(spec, rows, device),
        batches(len(rows), spec.loop),
        spec.loop,
        work_dir,
        log_metrics,
        device,
    )
    if spec.lora.r:
        model = model.merge_and_unload()
    model.requires_grad_(False)
    after = jacobi_speed(model, target.tokenizer, eval_prompts, spec.block_size, spec.eval_tokens)
    metrics = {
        "trajectories": str(source.parent),
        "train_trajectories": len(rows),
        "heldout_prompts": len(eval_prompts),
        **{f"heldout_{k}_before": v for k, v in before.items()},
        **{f"heldout_{k}_after": v for k, v in after.items()},
        "compute_minutes": cost.minutes(
            cost.loop_seconds(history), None if trajectory_minutes is None else trajectory_minutes * 60
        ),
    }
    return model, metrics, history


@register_component("cllm_trajectories", "cllm", schema=CLLMTrainingConfig, inputs=trajectories_input)
def train_cllm(cfg, target, work_dir, log_metrics, device):
    """`specrepro train method=cllm training.stage=trajectories|train`."""
    stage = cfg.training.stage
    if stage == "trajectories":
        return collect_trajectories(cfg, target, work_dir, log_metrics, device)
    if stage == "train":
        return train_consistency(cfg, target, work_dir, log_metrics, device)
    raise SpecReproError(f"training.stage={stage} is not one of trajectories, train")
