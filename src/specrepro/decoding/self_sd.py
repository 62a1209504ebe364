"""`self_sd`: Draft & Verify (Zhang et al., ACL 2024; seed 002), self-speculative decoding.

The target drafts for itself by skipping a fixed set of attention and MLP sub-layers (chosen offline by
`specrepro train method=self_sd`, a Bayesian optimisation of tokens/s); the full model verifies the draft in
one forward through the shared loop (greedy: Alg. 2/3; speculative sampling with q = the warped draft
distribution: Alg. 4). Drafting stops early when the draft's top-1 probability falls below an adaptive
threshold gamma (§3.4, Eq. 2-4; `controllers.AdaptiveDraftExit`), or drafts a fixed K (`control=fixed`).

Sub-layers are skipped without copying modeling code: inside `skipped_sublayers` a skipped sub-layer's
`forward` (and its pre-norm's) is replaced by one that leaves the residual stream unchanged, as the
official code does (a skipped sub-layer bypasses its RMSNorm too). Under `hardware.compile` the draft step is
a variant of the target's steps (`variant=`): graphs of its own, traced and run only inside that context.

Token tree (`tree_width` w > 1, beyond the paper): the draft's next w - 1 best tokens at the first draft position
join the chain as siblings of its first node (`DraftVerifyDecoder.with_first_siblings`).

Reduced draft vocabulary (`draft_vocab` V > 0, beyond the paper; FR-Spec): the draft's LM head scores only the V
tokens most frequent in a general corpus plus the prompt's own tokens (`decoding/draft_vocab.py`). On the
embedded model the full head is ~0.16 of a forward, a quarter of a half-skipped draft step. Lossless either way:
the full model verifies over the whole vocabulary.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, List, Optional

import torch

from specrepro.decoding import draft_vocab
from specrepro.decoding.controllers import AdaptiveDraftExit, DraftLengthController, FixedLength
from specrepro.decoding.draft_verify import DraftVerifyDecoder, Proposal
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.verify import crop_cache
from specrepro.errors import SpecReproError
from specrepro.registry import MethodConfig, register_method

SKIP_SET_FILE = "skip_set.json"


@dataclass
class SelfSDConfig(MethodConfig):
    name: str = "self_sd"
    skip_set: Optional[str] = "self_sd_skip_set"  # artifact of `specrepro train method=self_sd` (name, prefix or path)
    attn_skip: List[int] = field(default_factory=list)  # explicit skipped attention sub-layers (0-based blocks);
    mlp_skip: List[int] = field(default_factory=list)  # when either list is given, `skip_set` is not read
    control: str = "adaptive"  # adaptive (draft exit at gamma, §3.4) | fixed (always k drafts, Table 3)
    k: int = 12  # max draft tokens K (adaptive) or the draft length (fixed); Table 6: 12
    gamma0: float = 0.6  # Table 6 / App. B
    alpha: float = 0.9  # target acceptance rate; Table 6: 0.70-0.90 (0.90 for LLaMA-2-13B on CNN/DM)
    epsilon: float = 0.01
    beta1: float = 0.5
    beta2: float = 0.9
    carry_gamma: bool = True  # gamma carries over from one generation to the next (official code, Fig. 5)
    # w > 1: the draft's top-w tokens at the first draft position, verified as a tree (beyond the paper)
    tree_width: int = 1
    draft_vocab: int = 0  # V > 0: the draft scores the V corpus-frequent tokens + the prompt's (beyond the paper)
    draft_vocab_corpus: str = "sharegpt/sharegpt_v3_first1000.json.gz"  # ranks tokens for draft_vocab

    def __post_init__(self):
        for option in ("attn_skip", "mlp_skip"):  # and below the model's depth: checked on loading
            self.require(all(i >= 0 for i in getattr(self, option)), option, "block indices >= 0")
        self.require_one_of("control", ("adaptive", "fixed"))
        self.require(self.k >= 1, "k", ">= 1")
        self.require(0 <= self.gamma0 <= 1, "gamma0", "in [0, 1]")
        self.require(0 < self.alpha <= 1, "alpha", "in (0, 1]")
        self.require(self.epsilon >= 0, "epsilon", ">= 0")
        self.require(0 <= self.beta1 <= 1, "beta1", "in [0, 1]")
        self.require(0 <= self.beta2 <= 1, "beta2", "in [0, 1]")
        self.require(self.tree_width >= 1, "tree_width", ">= 1")
        self.require(self.draft_vocab >= 0, "draft_vocab", ">= 0 (0: the whole vocabulary)")


@dataclass
class SkipSet:
    """Skipped sub-layers of one model, with the search that found them; `save_pretrained` writes skip_set.json."""

    attn_skip: list[int]
    mlp_skip: list[int]
    num_layers: int
    info: dict = field(default_factory=dict)  # search kind, best objective, objective history

    def save_pretrained(self, path) -> None:
        content = {"attn_skip": self.attn_skip, "mlp_skip": self.mlp_skip, "num_layers": self.num_layers, **self.info}
        (Path(path) / SKIP_SET_FILE).write_text(json.dumps(content, indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, path) -> "SkipSet":
        file = Path(path) / SKIP_SET_FILE
        if not file.is_file():
            raise SpecReproError(f"{path} holds no {SKIP_SET_FILE}: not a self_sd skip-set artifact")
        content = json.loads(file.read_text())
        info = {k: v for k, v in content.items() if k not in ("attn_skip", "mlp_skip", "num_layers")}
        return cls(content["attn_skip"], content["mlp_skip"], content["num_layers"], info)


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder blocks of a LLaMA-family model (pre-norm blocks with self_attn and mlp sub-layers)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    parts = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    if layers is None or not all(hasattr(layer, part) for layer in layers for part in parts):
        raise SpecReproError(
            f"self_sd needs a LLaMA-family model (model.layers[i].{{{', '.join(parts)}}}); got {type(model).__name__}"
        )
    return layers


def _unchanged(hidden_states, *args, **kwargs):
    return hidden_states


def _no_attention(hidden_states, *args, **kwargs):
    # LlamaAttention returns (attn_output, attn_weights); the block adds attn_output to the residual
    return torch.zeros_like(hidden_states), None


def _no_mlp(x):
    return torch.zeros_like(x)


@contextmanager
def skipped_sublayers(model, attn_skip, mlp_skip):
    """Run `model` with the given attention / MLP sub-layers as identities on the residual stream.

    A block with both sub-layers skipped returns its input; a skipped attention writes no KV entry. The
    original forwards are restored on exit, also after an exception.
    """
    layers = decoder_layers(model)
    attn_skip, mlp_skip = set(attn_skip), set(mlp_skip)
    patches = []  # (module, its previous instance-level forward or None)

    def patch(module, forward):
        patches.append((module, module.__dict__.get("forward")))
        module.forward = forward

    try:
        for index in sorted(attn_skip | mlp_skip):
            layer = layers[index]
            if index in attn_skip and index in mlp_skip:
                patch(layer, _unchanged)
            elif index in attn_skip:
                patch(layer.input_layernorm, _unchanged)
                patch(layer.self_attn, _no_attention)
            else:
                patch(layer.post_attention_layernorm, _unchanged)
                patch(layer.mlp, _no_mlp)
        yield
    finally:
        for module, previous in reversed(patches):
            del module.forward
            if previous is not None:
                module.forward = previous


@torch.no_grad()
def skips_as_llama(model) -> bool:
    """Whether the model runs with an attention sub-layer and an MLP sub-layer skipped (`skipped_sublayers`): a
    LLaMA's block takes what `_no_attention` returns; GLM-MoE-DSA's unpacks a third value from its attention."""
    ids = (torch.arange(4, device=next(model.parameters()).device) % model.config.vocab_size)[None]
    try:
        with skipped_sublayers(model, [0], [len(decoder_layers(model)) - 1]):
            model(ids)
    except Exception:  # a block that runs otherwise: refused by the caller in one line
        return False
    return True


def check_skip_set(attn_skip, mlp_skip, num_layers: int) -> None:
    for kind, indices in (("attn_skip", attn_skip), ("mlp_skip", mlp_skip)):
        bad = [i for i in indices if not 0 <= i < num_layers]
        if bad:
            raise SpecReproError(f"self_sd {kind} holds {bad}: the model has blocks 0..{num_layers - 1}")


@dataclass
class SkipDraft:
    """The layer-skipping draft during one generation: the target's cache it drafts on (cropped back after each
    draft) and, with a reduced draft vocabulary, this prompt's vocabulary and LM-head rows."""

    cache: Any
    vocab_ids: torch.Tensor | None = None
    draft_head: torch.nn.Linear | None = None


@register_method(SelfSDConfig)
class SelfSDDecoder(DraftVerifyDecoder):
    name = "self_sd"
    compilable = True  # its draft steps run as a variant of the target's steps (`step_variants`)

    def __init__(
        self, model, tokenizer, attn_skip, mlp_skip, cfg: SelfSDConfig, vocab_ranking: torch.Tensor | None = None
    ):
        """`vocab_ranking`: token ids, most frequent first, whose first `cfg.draft_vocab` form the draft vocabulary
        (with the prompt's tokens); by default `cfg.draft_vocab_corpus` ranked with `tokenizer`."""
        super().__init__(model, tokenizer)
        self.num_layers = len(decoder_layers(model))
        check_skip_set(attn_skip, mlp_skip, self.num_layers)
        if model.config._attn_implementation == "eager":
            # with layers holding different lengths, only a kernel that needs no mask for one query works
            raise SpecReproError("self_sd drafting needs sdpa or flash attention, not eager")
        if not skips_as_llama(model):
            raise SpecReproError(
                f"self_sd skips attention and MLP sub-layers as a LLaMA's blocks allow, which "
                f"{model.config.model_type}'s blocks do not (their attention returns what a LLaMA's does not)"
            )
        self.tree_width = cfg.tree_width
        if cfg.draft_vocab and vocab_ranking is None:
            if tokenizer is None:
                raise SpecReproError("self_sd draft_vocab needs a tokenizer to rank its corpus' tokens")
            vocab_ranking = draft_vocab.corpus_ranking(tokenizer, cfg.draft_vocab_corpus)
        self.frequent = vocab_ranking[: cfg.draft_vocab] if cfg.draft_vocab else None
        self.attn_skip, self.mlp_skip = sorted(set(attn_skip)), sorted(set(mlp_skip))
        self.variant = f"skip attention {self.attn_skip} mlp {self.mlp_skip}"  # its drafts' graphs, compiled
        self.cfg = cfg
        self.gamma = cfg.gamma0  # carried across generations when cfg.carry_gamma
        self.controller: DraftLengthController | None = None  # the last generation's, whose gamma is carried

    @property
    def step_variants(self) -> list:
        """Its draft: the target with the skip set's sub-layers skipped, one token a step (compiled steps warm up its
        graphs, traced with the sub-layers skipped)."""
        return [
            (
                self.variant,
                partial(skipped_sublayers, self.model, self.attn_skip, self.mlp_skip),
                self.frequent is not None,
            )
        ]

    @classmethod
    def resolve_artifacts(cls, cfg: SelfSDConfig, target, artifacts_dir) -> dict[str, Path]:
        from specrepro.models.loading import resolve_artifact

        if cfg.attn_skip or cfg.mlp_skip or cfg.skip_set is None:
            return {}
        return {"skip_set": resolve_artifact(cfg.skip_set, artifacts_dir, target)}

    @classmethod
    def read_files(cls, cfg: SelfSDConfig) -> dict[str, str]:
        return draft_vocab.corpus_file(cfg)

    @classmethod
    def from_config(cls, cfg: SelfSDConfig, target, ctx) -> "SelfSDDecoder":
        attn_skip, mlp_skip = list(cfg.attn_skip), list(cfg.mlp_skip)
        if not attn_skip and not mlp_skip:
            if cfg.skip_set is None:
                raise SpecReproError(
                    "self_sd needs a skip set: method.skip_set=<artifact> or "
                    "method.attn_skip=[...] method.mlp_skip=[...]"
                )
            from specrepro.models.loading import resolve_artifact

            skip_set = SkipSet.from_pretrained(resolve_artifact(cfg.skip_set, ctx.artifacts_dir, target.identity))
            if skip_set.num_layers != len(decoder_layers(target.model)):
                raise SpecReproError(
                    f"skip set '{cfg.skip_set}' was searched for {skip_set.num_layers} blocks; "
                    f"model '{target.name}' has {len(decoder_layers(target.model))}"
                )
            attn_skip, mlp_skip = skip_set.attn_skip, skip_set.mlp_skip
        return cls(target.model, target.tokenizer, attn_skip, mlp_skip, cfg)

    def carried(self) -> float | None:
        """The gamma the next generation starts from, with carry_gamma."""
        if not (self.cfg.control == "adaptive" and self.cfg.carry_gamma):
            return None
        return self.controller.gamma if isinstance(self.controller, AdaptiveDraftExit) else self.gamma

    def restore(self, carried: float | None) -> None:
        if carried is not None:
            self.gamma, self.controller = carried, None

    def new_controller(self) -> DraftLengthController:
        if isinstance(self.controller, AdaptiveDraftExit) and self.cfg.carry_gamma:
            self.gamma = self.controller.gamma
        if self.cfg.control == "fixed":
            self.controller = FixedLength(self.cfg.k)
        else:
            c = self.cfg
            self.controller = AdaptiveDraftExit(c.k, self.gamma, c.alpha, c.epsilon, c.beta1, c.beta2)
        return self.controller

    def start(self, prompt_ids, cache, length) -> SkipDraft:
        if self.frequent is None:
            return SkipDraft(cache)
        return SkipDraft(cache, *draft_vocab.prompt_head(self.model.lm_head, self.frequent, prompt_ids))

    def draft_logits(self, state: SkipDraft, step_input, position: int) -> torch.Tensor:
        """The skipped-layer draft's last logits: over the whole vocabulary, or over `vocab_ids` (draft_vocab)."""
        if state.draft_head is None:
            return self.steps(step_input, state.cache, logits_to_keep=1, past=position, variant=self.variant).logits[
                0, -1
            ]
        hidden = self.steps.hidden(step_input, state.cache, past=position, variant=self.variant)
        return state.draft_head(hidden[0, -1])

    def propose(self, state: SkipDraft, tokens, k, sampling: Sampling, rng, controller) -> Proposal:
        # KV cache (note §2.5): the draft reads the full model's K/V of the verified prefix, and its
        # non-skipped attention layers append K/V computed from draft hidden states, which later draft steps
        # attend to; skipped attention layers write nothing, so layers hold different lengths while drafting
        # (positions are therefore given explicitly: get_seq_length() reads layer 0). Those draft K/V are not
        # the full model's, so they must not survive: the cache is cropped back to the verified length after
        # drafting and the verify pass recomputes every layer for [last token, drafts], as the official code
        # does (it drafts on a copy and verifies on the pre-draft cache).
        verified = tokens.shape[1] - 1  # the cache holds every committed token but the last
        step_input = tokens[:, -1:]
        drafts, qs = [], []
        with skipped_sublayers(self.model, self.attn_skip, self.mlp_skip):
            for step in range(k):
                logits = self.draft_logits(state, step_input, verified + step)
                if step == 0:
                    first_logits = logits
                # Alg. 4: q = the warped draft distribution (zero outside a reduced draft vocabulary)
                token, q, top1 = draft_vocab.choose_draft_token(
                    state.vocab_ids, logits, self.model.config.vocab_size, sampling, rng
                )
                if q is not None:
                    qs.append(q)
                drafts.append(token)
                step_input = token.view(1, 1)
                # Alg. 3/4: exit after a token whose max draft probability is below gamma (the token is kept)
                if not controller.keep_drafting(top1):
                    break
        crop_cache(state.cache, verified)
        return self.with_first_siblings(
            torch.stack(drafts), torch.stack(qs) if qs else None, first_logits, state.vocab_ids
        )

    def generation_extras(self, state: SkipDraft) -> dict:
        return {
            "attn_skipped": len(self.attn_skip),
            "mlp_skipped": len(self.mlp_skip),  # which set ran
            "draft_vocab": 0 if state.vocab_ids is None else len(state.vocab_ids),
        }
