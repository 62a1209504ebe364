"""The Decoder contract every method meets, and the Generation it returns.

A method is a Decoder: given prompt token ids, a sampling config and a budget of new tokens, it returns
a Generation. Speed metrics, acceptance and HM are computed from Generations in one place
(`specrepro.metrics.speed`); no method computes its own speedup.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specrepro.decoding.device import device_sync
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.steps import (
    EagerSteps,
    protocol_problem,
    recurrent_layers,
    refuse_other_logits,
    stepping_problem,
    target_steps,
    tree_problem,
    unknown_layers,
)
from specrepro.errors import SpecReproError


@dataclass
class Generation:
    token_ids: list[int]  # new tokens only, ending with EOS if one was produced
    text: str = ""
    steps: int = 0  # target forward passes after prefill
    accepted: list[int] = field(default_factory=list)  # per step: tokens committed (incl. bonus/correction)
    drafted: list[int] = field(default_factory=list)  # per step: draft tokens proposed
    # the last step was cut (EOS or the budget) before its own target token: all it committed are drafts
    last_step_cut: bool = False
    discarded_steps: int = 0  # target forwards run past EOS and thrown away (`ar`'s chunked reads on a GPU)
    draft_time: float = 0.0
    verify_time: float = 0.0
    prefill_time: float = 0.0
    wall_time: float = 0.0
    extra: dict = field(default_factory=dict)  # method-specific: per-step counter lists, per-generation numbers

    def to_dict(self) -> dict:
        return asdict(self)


class GenerationBuilder:
    """Collects committed tokens step by step; enforces the token budget and stops at EOS."""

    def __init__(self, max_new_tokens: int, eos_ids: set[int], device: torch.device):
        self.max_new_tokens = max_new_tokens
        self.eos_ids = eos_ids
        self.device = device
        self.gen = Generation(token_ids=[])
        self.done = False
        self.spans: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # GPU phase spans not yet read

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.gen.token_ids)

    def commit(self, tokens: list[int], drafted: int = 0, prefill: bool = False) -> list[int]:
        """Append a step's tokens (cut at EOS and at the budget); return what was kept."""
        kept = []
        for tok in tokens[: self.remaining]:
            kept.append(tok)
            if tok in self.eos_ids:
                self.done = True
                break
        self.gen.token_ids.extend(kept)
        if not prefill:
            self.gen.steps += 1
            self.gen.accepted.append(len(kept))
            self.gen.drafted.append(drafted)
            self.gen.last_step_cut = len(kept) < len(tokens)
        if self.remaining <= 0:
            self.done = True
        return kept

    @contextmanager
    def timed(self, phase: str):
        """Add the block's time to `draft_time`, `verify_time` or `prefill_time`: wall time on a synchronous device;
        on a GPU the span between two events queued on its stream, read once the generation is done (`settle`), so
        that timing a phase makes the host wait for nothing."""
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            try:
                yield
            finally:
                end.record(stream)
                self.spans.append((phase, start, end))
            return
        device_sync(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            device_sync(self.device)
            self._add_time(phase, time.perf_counter() - start)

    def settle(self) -> None:
        """Add the GPU phase spans `timed` queued to the phase times; call once the device has run them."""
        for phase, start, end in self.spans:
            self._add_time(phase, start.elapsed_time(end) / 1000)
        self.spans.clear()

    def _add_time(self, phase: str, seconds: float) -> None:
        attr = f"{phase}_time"
        setattr(self.gen, attr, getattr(self.gen, attr) + seconds)


class Decoder(ABC):
    """Base class: subclasses implement `_decode`, which fills a GenerationBuilder."""

    name = "base"
    lossless = True  # greedy output must equal `ar` on the same weights
    compilable = False  # runs every target forward through `self.steps` (so `hardware.compile` applies)
    reads_hidden_states = False  # its target forwards go through `steps.hidden` (or `with_hidden`)
    layer_slices: list = []  # (cache name, layers) it runs through `steps.layers` itself (compiled steps warm them up)
    step_variants: list = []  # (name, state context, reads hidden) of model states it drafts in, one token a step
    # (steps, widest step, reads hidden) of a draft model's own: warmed up beside the target's
    draft_model_steps: list = []
    drafter_calls: list = []  # (drafter step, inputs) of each input shape its `steps.drafter_step`s take: warmed up too
    code_modules: tuple = ()  # other modules whose code shapes its tokens or timings (identity.py)
    rolls_back = True  # rejected drafts are cropped from the target's cache (`steps.rollback_cache`)

    def __init__(self, model: torch.nn.Module, tokenizer=None, steps: EagerSteps | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = _eos_ids(model, tokenizer)
        self.steps = steps or target_steps(model)  # how the target's forwards run: eager, or compiled
        if problem := protocol_problem(model, stepping_problem):
            raise SpecReproError(
                f"{model.config.model_type} does not decode as every method here steps a model: {problem}; no "
                "method runs it, `ar` included"
            )
        if self.rolls_back and (recurrent := recurrent_layers(model.config)):
            raise SpecReproError(
                f"method '{self.name}' rolls rejected drafts back in the target's cache, which {recurrent} of "
                f"{model.config.model_type}'s layers cannot do: their state is recurrent (linear attention or a "
                "convolution); run method=ar"
            )
        if self.rolls_back and (unknown := unknown_layers(model.config)):
            raise SpecReproError(
                f"method '{self.name}' rolls rejected drafts back in the target's cache, whose "
                f"{model.config.model_type} layers ({', '.join(unknown)}) keep state a crop does not roll back; "
                "run method=ar"
            )
        if self.reads_hidden_states:
            refuse_other_logits(model, self.name)
        if self.steps.compiled and not self.compilable:
            raise SpecReproError(
                f"method '{self.name}' does not support hardware.compile (its target's forwards do "
                "not run through the shared steps); run it with hardware.compile=false"
            )

    @property
    def max_step_width(self) -> int:
        """The most tokens one target step after prefill takes (compiled steps are warmed up to it)."""
        return 1

    @property
    def verifies_trees(self) -> bool:
        """Whether a verification can hold a token tree, whose path nodes see keys with siblings between them:
        that rounds otherwise than a chain (`metrics/divergence.py` measures both)."""
        return False

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def extra_parameters(self) -> int:
        """Parameters the method holds beside the target's (a draft model, draft heads): its extra memory."""
        return 0

    def memory_extras(self) -> dict[str, float]:
        """`extra_parameters` and `extra_memory_pct` (|theta'| / |theta|, 001's Table 2), logged for every method."""
        extra = self.extra_parameters
        return {
            "extra_parameters": extra,
            "extra_memory_pct": 100.0 * extra / sum(p.numel() for p in self.model.parameters()),
        }

    def carried(self):
        """A copy of what a generation leaves for the next to draft from (token_recycling's hot-start matrix,
        self_sd's carried gamma), for `restore`; None for a decoder whose generations are independent."""
        return None

    def restore(self, carried) -> None:
        """Draft the next generation from `carried` (what `carried()` copied) again: the runner forgets what an
        untimed warm-up, or a turn it times again, taught the decoder of an answer."""

    @classmethod
    def read_files(cls, cfg) -> dict[str, str]:
        """Files beside the dataset that a method config reads (its option -> path): part of a run's identity by
        content, so an edited corpus is a new run."""
        return {}

    @classmethod
    def resolve_artifacts(cls, cfg, target, artifacts_dir) -> dict[str, Path]:
        """The trained artifacts (role -> directory) a method config resolves to now for `target` (the run's model:
        its name or identity, training/artifacts.py), none trained for another; a reference by prefix names the
        newest match, so these (their names and contents), not the reference, are part of a run's identity."""
        return {}

    @torch.inference_mode()
    def generate(self, prompt_ids, sampling: Sampling, max_new_tokens: int, seed: int = 0) -> Generation:
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if self.verifies_trees and (problem := protocol_problem(self.model, tree_problem)):
            raise SpecReproError(
                f"method '{self.name}' verifies token trees, which {self.model.config.model_type} does not take as "
                f"chains: {problem}; run a method that verifies chains (pld, jacobi, or tree_width=1)"
            )
        ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=self.device).view(1, -1)
        rng = torch.Generator(device=self.device).manual_seed(seed)
        out = GenerationBuilder(max_new_tokens, self.eos_ids, self.device)
        device_sync(self.device)
        start = time.perf_counter()
        self._decode(ids, sampling, out, rng)
        device_sync(self.device)
        out.gen.wall_time = time.perf_counter() - start
        out.settle()
        out.gen.extra.update(self.memory_extras())
        if self.tokenizer is not None:
            out.gen.text = completion_text(self.tokenizer, ids[0].tolist(), out.gen.token_ids)
        return out.gen

    @abstractmethod
    def _decode(self, prompt_ids: torch.Tensor, sampling: Sampling, out: GenerationBuilder, rng) -> None:
        """Decode from `prompt_ids` (1, T), committing tokens to `out` until `out.done`."""


def completion_text(tokenizer, prompt_ids: list[int], token_ids: list[int]) -> str:
    """The completion's text as it reads after the prompt: the prompt and completion decoded together, less the
    prompt's text. Decoded alone, a LLaMA tokenizer drops the first token's leading space (HumanEval's indent)."""
    head = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    whole = tokenizer.decode([*prompt_ids, *token_ids], skip_special_tokens=True)
    if whole.startswith(head):
        return whole[len(head) :]
    return tokenizer.decode(token_ids, skip_special_tokens=True)  # a prompt whose text the completion changes


def parameters_beside(module: torch.nn.Module, model: torch.nn.Module) -> int:
    """Parameters of `module` that are not `model`'s own tensors (a draft that is the target adds none)."""
    shared = {id(p) for p in model.parameters()}
    return sum(p.numel() for p in module.parameters() if id(p) not in shared)


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen_cfg = getattr(model, "generation_config", None)
    for source in (getattr(gen_cfg, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids
