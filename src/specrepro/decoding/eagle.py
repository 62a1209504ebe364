"""EAGLE drafting (Li et al., 2024) with EAGLE-2's dynamic draft tree (Li et al., 2024b).

EAGLE ("Speculative Sampling Requires Rethinking Feature Uncertainty") drafts at the feature level: the feature f_i
is the target's second-to-top-layer output, i.e. the last hidden state before the LM head (post-norm, as
transformers returns it). The draft (section 4.1, Fig. 6) reads the features advanced by one token,
    f^_{i+1} = Decoder_layer(FC(concat(f_i, e(t_{i+1}))))   (FC: 2H -> H; ONE LLaMA decoder layer, which in the
                                                             authors' code has no input norm),
    p^_{i+2} = Softmax(LM_Head(f^_{i+1}))                    (the target's frozen LM head; no extra norm: the
                                                             features are already post-norm),
and runs autoregressively on its own predicted features. Its KV cache holds one row per committed position, made
from the target's true features (each verification supplies them); the rows drafted during a round live only in
that round (`propose`), so rolling back to the accepted path is keeping the committed rows. The decoder layer is
transformers' own, run through the target's steps (`steps.layers`) on a cache of its own: under `hardware.compile`
the draft layer is compiled per padded width on a static cache, as the target's verification is.

EAGLE-2 ("Faster Inference of Language Models with Dynamic Draft Trees", section 4): the draft's confidence
approximates the acceptance rate, so a node's value is the product of the draft probabilities along its path
(Eq. 1: V_i = prod_{j in Path(root, i)} p_j). Expansion: from the root, at each of `depth` levels expand the top-k
nodes of the newest level by value, each into its top-k children (one draft forward for the k nodes, tree mask);
reranking: keep the `total_tokens` drafted nodes of highest value (an ancestor's value is never below its child's,
so the kept nodes form a tree), verified in one target forward with a tree mask. The nodes are deterministic top-k
choices, so speculative sampling runs `tree_verify` with one-hot q and stays lossless. Both phases run on the device
(stable sorts keep the order ties had on the host); a round reads the chosen tree's shape once, not every level.

`draft_vocab` = V > 0 (beyond the paper, as EAGLE-3/FR-Spec; decoding/draft_vocab.py): the LM head's rows of the V
most frequent training tokens score the drafts.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from specrepro.decoding import draft_vocab
from specrepro.decoding.controllers import FixedLength
from specrepro.decoding.draft_verify import DraftVerifyDecoder, Proposal, TargetOutput
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.steps import decoder_body
from specrepro.decoding.verify import additive_mask, crop_cache
from specrepro.errors import SpecReproError
from specrepro.registry import MethodConfig, register_method

DRAFT_FILES = ("eagle_draft.json", "eagle_draft.safetensors")
DRAFT_CACHE = "eagle_draft"  # the name of the draft layer's cache among the steps' caches


@dataclass
class EagleConfig(MethodConfig):
    name: str = "eagle"
    depth: int = 6  # EAGLE-2: expansion levels (the most tokens a round can accept before the bonus token)
    top_k: int = 10  # EAGLE-2: nodes expanded per level, and children per expanded node
    total_tokens: int = 59  # drafted nodes kept after reranking, verified with the root (EAGLE-2's total_token=60)
    draft_vocab: int = 0  # V > 0: the draft scores only V frequent tokens (chosen at training; beyond the paper)
    head: str = "eagle_head"  # trained draft artifact (newest matching); "none": an untrained random draft

    def __post_init__(self):
        self.require(self.depth >= 1, "depth", ">= 1")
        self.require(self.top_k >= 1, "top_k", ">= 1")
        self.require(self.total_tokens >= 1, "total_tokens", ">= 1")
        self.require(self.draft_vocab >= 0, "draft_vocab", ">= 0 (0: the whole vocabulary)")
        self.require(
            not self.draft_vocab or self.head != "none",
            "draft_vocab",
            "0 with head=none (it is chosen when the draft is trained)",
        )


class EagleDraft(nn.Module):
    """FC + one LLaMA decoder layer (transformers', without its input norm) over (feature, next-token embedding)
    pairs; the target's LM head (or its draft-vocabulary rows) is attached, frozen and not saved."""

    def __init__(self, config, draft_vocab_size: int = 0):
        super().__init__()
        H = config.hidden_size
        self.settings = {
            "hidden_size": H,
            "vocab_size": config.vocab_size,
            "draft_vocab": draft_vocab_size,
            "config": config.to_dict(),
        }
        config = llama_layer_config(type(config).from_dict(self.settings["config"]))
        config._attn_implementation = "sdpa"
        self.fc = nn.Linear(2 * H, H)  # FC(concat(f_i, e(t_{i+1}))): 2H -> H
        self.layer = LlamaDecoderLayer(config, layer_idx=0)  # index 0 of the draft's own cache
        self.layer.input_layernorm = nn.Identity()  # the authors' draft layer has no input norm
        self.rotary = LlamaRotaryEmbedding(config)  # training's; decoding uses the target's (steps.layers), same config
        self.register_buffer("vocab_ids", torch.arange(draft_vocab_size) if draft_vocab_size else None)
        self.lm_head: list[nn.Module] = []  # the target's (frozen, shared): `attach_lm_head`
        self.register_load_state_dict_pre_hook(_layer_keys)

    def attach_lm_head(self, lm_head: nn.Module) -> "EagleDraft":
        """Score with the target's LM head, or its draft-vocabulary rows."""
        if self.vocab_ids is None:
            self.lm_head = [lm_head]
        else:
            self.lm_head = [draft_vocab.head_rows(lm_head, self.vocab_ids).requires_grad_(False)]
        return self

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """p^'s logits (over the draft vocabulary when reduced) of predicted features."""
        if not self.lm_head:
            raise SpecReproError("the EAGLE draft scores with the target's LM head: call attach_lm_head first")
        return self.lm_head[0](features.to(self.lm_head[0].weight.dtype))

    def layer_input(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """FC(concat(f_i, e(t_{i+1}))) of (B, n, H) pairs: the decoder layer's input."""
        return self.fc(torch.cat([features, token_embeds], -1).to(self.fc.weight.dtype))

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Predicted features (B, n, H) of n pairs (f_i, e(t_{i+1})) (B, n, H) each at `positions` (B, n), each pair
        seeing itself and the pairs before it, without a cache: training's teacher-forced pass."""
        x = self.layer_input(features, token_embeds)
        n = x.shape[1]
        causal = additive_mask(torch.ones(n, n, dtype=torch.bool, device=x.device).tril(), x.dtype)
        return self.layer(x, attention_mask=causal, position_embeddings=self.rotary(x, positions))

    def num_parameters(self) -> int:
        """Trained parameters, plus the frozen copy of the target's rows a reduced vocabulary keeps."""
        copied = self.lm_head[0].weight.numel() if self.lm_head and self.vocab_ids is not None else 0
        return sum(p.numel() for p in self.parameters()) + copied

    def save_pretrained(self, path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(path / DRAFT_FILES[1]))
        (path / DRAFT_FILES[0]).write_text(json.dumps({**self.settings, "parameters": self.num_parameters()}))

    @classmethod
    def from_pretrained(cls, path, target_config) -> "EagleDraft":
        """The saved draft; refuses one trained for a target of another shape."""
        path = Path(path)
        settings = json.loads((path / DRAFT_FILES[0]).read_text())
        for key in ("hidden_size", "vocab_size"):
            if settings[key] != getattr(target_config, key):
                raise SpecReproError(
                    f"the EAGLE draft {path.name} was trained for a target with {key} "
                    f"{settings[key]}, this target has {getattr(target_config, key)}"
                )
        draft = cls(type(target_config).from_dict(settings["config"]), settings["draft_vocab"])
        draft.load_state_dict(load_file(str(path / DRAFT_FILES[1])))
        return draft.eval()


def llama_layer_config(config) -> LlamaConfig:
    """The draft layer's config: the target's, or for another LLaMA-like target (Qwen2, Mistral) a LLaMA config of
    its shape, as the authors' draft is a LLaMA layer whatever the target (LlamaDecoderLayer reads attributes, such as
    attention_bias, that other architectures' configs lack). A target with no rotary LLaMA-style layers is refused."""
    if isinstance(config, LlamaConfig):
        return config
    shape = ("num_key_value_heads", "rms_norm_eps", "rope_parameters", "hidden_act", "intermediate_size")
    if missing := [name for name in shape if getattr(config, name, None) is None]:
        raise SpecReproError(
            f"eagle drafts with a LLaMA decoder layer on the target's rotary embeddings: {config.model_type} models "
            f"are not LLaMA-like (their config has no {', '.join(missing)})"
        )
    names = ("hidden_size", "num_attention_heads", "head_dim", "max_position_embeddings", "vocab_size", *shape)
    return LlamaConfig(**{name: getattr(config, name, None) for name in names})


def check_target(model) -> None:
    """Refuse a target the draft cannot run on before anything is made for it: one without LLaMA-like layers
    (`llama_layer_config`), or whose rotary embedding, which the draft layer attends on while drafting, is not the
    LLaMA one of its shape that training gives the layer (gpt-oss's covers half a head; Gemma 3 keeps one per layer
    type). Compared at positions 0 and 1, within a half-precision copy's rounding of the frequencies."""
    config = llama_layer_config(model.config)
    rotary = getattr(decoder_body(model), "rotary_emb", None)
    p = next(model.parameters())
    x, positions = p.new_zeros(1, 2, config.hidden_size), torch.arange(2, device=p.device)[None]
    ours = LlamaRotaryEmbedding(config).to(p.device)(x.float(), positions)
    per_layer_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
    theirs = rotary(x, positions) if rotary is not None and not per_layer_type else ()
    if len(theirs) != 2 or any(
        a.shape != b.shape or not torch.allclose(a.float(), b, atol=1e-2) for a, b in zip(theirs, ours)
    ):
        raise SpecReproError(
            f"eagle drafts with a LLaMA decoder layer on the target's rotary embeddings, but {model.config.model_type} "
            "models' rotary embedding is not a LLaMA one of their shape: run another method"
        )


LAYER_KEYS = ("q_proj.", "k_proj.", "v_proj.", "o_proj.")  # saved before the layer was transformers' own


def _layer_keys(module, state_dict, prefix, *args) -> None:
    """Load a draft saved with the layer's weights at the top level (every draft trained before 2026-12-05)."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        name = key[len(prefix) :]
        if name.startswith(LAYER_KEYS):
            state_dict[f"{prefix}layer.self_attn.{name}"] = state_dict.pop(key)
        elif name.startswith(("mlp.", "post_attention_layernorm.")):
            state_dict[f"{prefix}layer.{name}"] = state_dict.pop(key)


def find_draft(ref: str, artifacts_dir, target, vocab: int) -> Path:
    """The newest complete `<ref>` / `<ref>-<model>-*` artifact trained for `target` (a model's name or identity)
    holding an EAGLE draft of draft vocabulary `vocab`."""
    from specrepro.training.artifacts import find_matching_artifact

    def matches(path: Path) -> bool:
        meta = path / DRAFT_FILES[0]
        return meta.is_file() and json.loads(meta.read_text()).get("draft_vocab", 0) == vocab

    path = find_matching_artifact(ref, artifacts_dir, target, matches)
    if path is None:
        model_name = target if isinstance(target, str) else target.get("name")
        raise SpecReproError(
            f"no EAGLE draft artifact '{ref}' (draft_vocab={vocab}) for model {model_name} under "
            f"{artifacts_dir}: train one with `specrepro train method=eagle training=eagle_<N>"
            f" method.draft_vocab={vocab}` and this run's model options, or use method.head=none"
        )
    return path


@dataclass
class DraftCache:
    """One generation's draft state: the draft layer's cache, whose first `length` rows are the committed pairs
    (f_i, t_{i+1}) (a round's expanded nodes follow them until the round ends), and the draft's predicted feature
    after the last pair (f^ of the newest committed token's position)."""

    cache: Any
    length: int = 0
    feature: torch.Tensor | None = None


@dataclass
class DraftTree:
    """A round's drafted nodes, parents before children, on the draft's device: token ids (n,), values (n,) (Eq. 1:
    the product of the draft probabilities along the path from the root, in float64 as Python's floats multiply),
    parents (n,) (-1: the root, the newest committed token) and depths (n,)."""

    tokens: torch.Tensor
    values: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor


@register_method(EagleConfig)
class EagleDecoder(DraftVerifyDecoder):
    name = "eagle"
    reads_hidden_states = True
    lossless = True
    compilable = True  # the target's steps and the draft layer (`steps.layers`) compile; FC and scoring run eagerly

    def __init__(self, model, tokenizer, draft: EagleDraft, cfg: EagleConfig, steps=None):
        super().__init__(model, tokenizer, steps)
        check_target(model)
        self.draft, self.cfg = draft, cfg
        if self.steps.compiled:  # a round's expanded rows follow the committed pairs, its last level padded
            rows = (cfg.depth - 2) * cfg.top_k + (self.steps.bucket(cfg.top_k) or cfg.top_k)
            if rows > self.steps.spare:
                raise SpecReproError(
                    f"eagle with depth {cfg.depth} and top_k {cfg.top_k} writes up to {rows} draft rows a round "
                    f"past the committed ones, more than the static cache's spare {self.steps.spare}: add a "
                    "wider hardware.compile_widths entry, or run with hardware.compile=false"
                )

    @property
    def layer_slices(self) -> list[tuple[str, list]]:
        """The draft's decoder layer, on its own cache: what compiled steps warm up."""
        return [(DRAFT_CACHE, [self.draft.layer])]

    @classmethod
    def resolve_artifacts(cls, cfg: EagleConfig, target, artifacts_dir) -> dict[str, Path]:
        return {} if cfg.head == "none" else {"head": find_draft(cfg.head, artifacts_dir, target, cfg.draft_vocab)}

    @classmethod
    def from_config(cls, cfg: EagleConfig, target, ctx) -> "EagleDecoder":
        if cfg.head == "none":
            draft = EagleDraft(target.model.config).eval()
        else:
            path = find_draft(cfg.head, ctx.artifacts_dir, target.identity, cfg.draft_vocab)
            draft = EagleDraft.from_pretrained(path, target.model.config)
        p = next(target.model.parameters())
        draft = draft.to(device=p.device, dtype=p.dtype).attach_lm_head(target.model.lm_head)
        return cls(target.model, target.tokenizer, ctx.use_kernels(draft) if ctx else draft, cfg)

    @property
    def extra_parameters(self) -> int:
        return self.draft.num_parameters()

    @property
    def max_step_width(self) -> int:
        return 1 + self.cfg.total_tokens

    @property
    def verifies_trees(self) -> bool:
        return self.cfg.top_k > 1  # top-1 expands one chain

    def new_controller(self) -> FixedLength:
        return FixedLength(self.cfg.depth)

    def start(self, prompt_ids, cache, length) -> DraftCache:
        return DraftCache(self.steps.new_cache(length, DRAFT_CACHE))

    def target_forward(self, state, input_ids, cache, logits_to_keep: int = 0, tree=None, past=None) -> TargetOutput:
        """The target's forward, keeping its last-layer (post-norm) hidden states: the features f."""
        logits, hidden = self.steps.with_hidden(input_ids, cache, logits_to_keep, tree, past)
        return TargetOutput(logits, hidden={"features": hidden})

    def after_verify(self, state: DraftCache, tokens, output, rows) -> None:
        # The kept rows hold the true features f_i of the positions whose next tokens t_{i+1} are now committed
        # (the last len(rows) committed tokens): their pairs join the draft's cache, and the last pair's output is
        # f^ of the newest token's position, where the next round's drafting starts.
        n, device = len(rows), tokens.device
        allow = torch.ones(n, state.length + n, dtype=torch.bool, device=device).tril(state.length)
        positions = torch.arange(state.length, state.length + n, device=device)
        predicted = self.draft_step(
            state, output.hidden["features"][:, rows], tokens[:, -n:], allow, positions, state.length
        )
        state.length += n
        state.feature = predicted[:, -1]

    def draft_step(self, state: DraftCache, features, tokens, allow, positions, rows: int) -> torch.Tensor:
        """The draft's predicted features (1, n, H) of n pairs (features (1, n, H), next tokens (1, n)) appended to
        its cache of `rows` rows, each pair at `positions` (n,) seeing the cache rows and pairs `allow` (n, rows + n)
        says."""
        x = self.draft.layer_input(features, self.embed(tokens))
        return self.steps.layers([self.draft.layer], x, state.cache, (allow, positions), past=rows)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(tokens)

    def scores(self, features: torch.Tensor) -> torch.Tensor:
        """log p^ (rows, draft vocabulary) of predicted features (rows, H)."""
        return self.draft.logits(features).float().log_softmax(-1)

    def propose(self, state: DraftCache, tokens, k, sampling: Sampling, rng, controller) -> Proposal:
        tree = dynamic_tree(self, state, min(k, self.cfg.depth), self.cfg.top_k)
        kept = rerank(tree, self.cfg.total_tokens)
        index = torch.full_like(tree.parents, -1)
        index[kept] = torch.arange(len(kept), device=kept.device)
        parents = tree.parents[kept]
        parents = torch.where(parents >= 0, index[parents.clamp_min(0)], -1).tolist()  # the round's one read
        return Proposal(tree.tokens[kept], None, parents)  # deterministic top-k drafts: one-hot q (tree_verify)


def top_children(decoder: EagleDecoder, features: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities in float64, token ids), (rows, top_k) each, of the draft's top-k next tokens after each
    predicted feature row (rows, H)."""
    logp, index = decoder.scores(features).topk(min(top_k, decoder.draft.lm_head[0].out_features), -1)
    return logp.exp().double(), draft_vocab.token_ids(decoder.draft.vocab_ids, index)


def dynamic_tree(decoder: EagleDecoder, state: DraftCache, depth: int, top_k: int) -> DraftTree:
    """EAGLE-2's expansion phase: every drafted node, parents before children. Level 1 is the root's top-k; each
    further level expands the previous level's top-k nodes by value (a stable sort: ties keep creation order), all
    in one draft forward under a tree mask. Built on the device: a round reads nothing until its tree is chosen."""
    probs, ids = top_children(decoder, state.feature, top_k)
    device = probs.device
    values, tokens = probs[0], ids[0]  # the newest level
    parents = torch.full_like(tokens, -1)  # each level node's parent, as a node index
    slots = torch.full_like(tokens, -1)  # each level node's parent, as an expanded node (a draft cache row)
    levels = [(tokens, values, parents)]
    seen = torch.zeros(0, 0, dtype=torch.bool, device=device)  # the expanded nodes each expanded node sees
    features = state.feature.new_empty(0, state.feature.shape[-1])  # the draft's predicted feature of each
    offset = 0  # the newest level's first node index
    for level in range(1, depth):
        chosen = torch.sort(-values, stable=True).indices[:top_k]  # the top-k of the newest level by value
        n, expanded = len(chosen), len(features)
        parent_slots = slots[chosen]
        ancestors = seen[parent_slots] if level > 1 else seen.new_zeros(n, 0)  # the root's children: none
        sees = torch.cat([ancestors, torch.eye(n, dtype=torch.bool, device=device)], 1)  # and each node itself
        seen = torch.cat([nn.functional.pad(seen, (0, n)), sees])
        rows = state.length + expanded
        allow = torch.cat([torch.ones(n, state.length, dtype=torch.bool, device=device), sees], 1)
        parent_features = state.feature.expand(n, -1) if level == 1 else features[parent_slots]
        positions = torch.full((n,), state.length + level - 1, device=device)
        predicted = decoder.draft_step(state, parent_features[None], tokens[chosen][None], allow, positions, rows)
        features = torch.cat([features, predicted[0]])
        probs, ids = top_children(decoder, predicted[0], top_k)
        values = (values[chosen, None] * probs).flatten()  # Eq. 1
        tokens = ids.flatten()
        parents = (offset + chosen).repeat_interleave(probs.shape[1])
        slots = torch.arange(expanded, expanded + n, device=device).repeat_interleave(probs.shape[1])
        offset += len(levels[-1][0])
        levels.append((tokens, values, parents))
    crop_cache(state.cache, state.length)  # the expanded nodes' rows live only in this round
    return DraftTree(
        *(torch.cat([nodes[i] for nodes in levels]) for i in range(3)),
        torch.cat([torch.full_like(nodes[0], d) for d, nodes in enumerate(levels, 1)]),
    )


def rerank(tree: DraftTree, total_tokens: int) -> torch.Tensor:
    """EAGLE-2's reranking: the indices of the `total_tokens` nodes of highest value, in creation order (parents
    first). A child's value is at most its parent's and ties keep creation order (a stable sort), so the kept nodes
    form a tree."""
    return torch.sort(-tree.values, stable=True).indices[:total_tokens].sort().values
