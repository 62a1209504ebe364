"""Semi-autoregressive (SAR) drafting (paper 001) and the draft-head family it unifies.

Eq. 5: q(d | w_<=i) = prod_j q_0(d_j | h_p(w_<=i), h_q(d_<j)). The target's last-layer (post-norm) hidden
state h_p at the last verified position comes from the verification pass itself (no extra target call); a
tiny model h_q reads only the current round's draft tokens. Index convention A of the note (section 8 A1):
d_1 is the target's own next token (the last committed token), so draft j + 1 is predicted from
(h_p, h_q(d_1..d_j)) and K counts the head-drafted tokens beyond it.

Variants (`variant`), all sharing the target's frozen input embeddings e(.):
- simplified: Eq. 6, h_q = sum_l alpha_l MLP(e(d_l)) / sum_l alpha_l, alpha = sigmoid(learned), size H/2
- lstm: Eq. 7, a 2-layer LSTM of size H/2 over e(d_1..d_j)
- transformer: N standard (pre-norm, causal, draft-tokens-only) layers with learned positions, size H;
  N = 0 is h_q = e(d_j) (the note's "simplified Hydra")
- redrafter: ReDrafter as the paper reads it (footnote 2): a 1-layer tanh RNN of size H/2
- block: Medusa-1 heads on h_p alone (no recent-token dependency), K x (ResBlock + H x V head)
The SAR head q_0 (App. A): W_3^T act(concat(W_p^T h_p, W_q^T h_q)) + b_3, W_p: H x P, W_q: dim(h_q) x P,
W_3: 2P x V with P = 1024 in the paper (`proj_size`); W_p and W_q carry biases too (the paper gives none).
`shared_lm_head` (not in the paper) makes W_3 2P x H followed by the target's frozen LM head (block: the ResBlocks
feed it), for targets whose vocabulary is large
against their size (SmolLM2-135M: a 2P x V W_3 is 75% of the target). `draft_vocab` = V > 0 (not in the paper;
`decoding/draft_vocab.py`) makes the output layer score only the V most frequent tokens of the training data:
W_3 is then 2P x V, or the shared head is the target's V rows, frozen.
Token tree (`tree_width` w > 1, beyond the paper, as Medusa's trees): the head's next w - 1 best tokens at the
first draft position join the chain as siblings of its first node (`DraftVerifyDecoder.with_first_siblings`).
`hardware.compile`: the head's forward runs compiled too (`steps.drafter_step`, a graph per prefix length), but
for lstm and redrafter, whose nn.LSTM / nn.RNN dynamo cannot capture: those heads draft eagerly.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.activations import ACT2FN

from specrepro.decoding import draft_vocab
from specrepro.decoding.controllers import CONTROLLERS, DraftLengthController, build_controller
from specrepro.decoding.draft_verify import DraftVerifyDecoder, Proposal, TargetOutput
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.steps import refuse_other_logits
from specrepro.errors import SpecReproError
from specrepro.models.kernels import onednn_available
from specrepro.registry import MethodConfig, register_method

log = logging.getLogger(__name__)

VARIANTS = ("simplified", "lstm", "transformer", "redrafter", "block")
RECURRENT = ("lstm", "redrafter")  # heads dynamo cannot capture ("Attempted to wrap RNN, GRU, or LSTM")
HEAD_FILES = ("sar_head.json", "sar_head.safetensors")


@dataclass
class SARDraftConfig(MethodConfig):
    name: str = "sar_draft"
    variant: str = "simplified"  # simplified | lstm | transformer | redrafter | block
    k: int = 4  # head-drafted tokens per round (paper: 3-4); at most the head's trained k
    controller: str = "fixed"  # fixed | heuristic
    k_max: int = 4
    head_k: int = 4  # positions the head is built for (alpha / LSTM unroll / Medusa heads)
    proj_size: int = 1024  # P: width of W_p and W_q (App. A: 1024)
    transformer_layers: int = 1  # N for variant=transformer (0 = embedding of the last draft)
    shared_lm_head: bool = False  # W_3 into the target's frozen LM head instead of its own 2P x V output
    draft_vocab: int = 0  # V > 0: the output scores only the V most frequent training tokens (set at training)
    head: str = "sar_head"  # trained head artifact (newest matching the variant); "none": untrained random head
    # w > 1: the head's top-w tokens at the first draft position, verified as a tree (beyond the paper)
    tree_width: int = 1

    def __post_init__(self):
        self.require_one_of("variant", VARIANTS)
        self.require(self.k >= 1, "k", ">= 1")  # k and k_max at most the head's trained k: checked on loading
        self.require_one_of("controller", CONTROLLERS)
        self.require(self.controller != "heuristic" or self.k_max >= self.k, "k_max", f">= k ({self.k})")
        self.require(self.head_k >= 1, "head_k", ">= 1")
        self.require(self.proj_size >= 1, "proj_size", ">= 1")
        self.require(self.transformer_layers >= 0, "transformer_layers", ">= 0")
        self.require(self.draft_vocab >= 0, "draft_vocab", ">= 0 (0: the whole vocabulary)")
        self.require(
            not self.draft_vocab or self.head != "none",
            "draft_vocab",
            "0 with head=none (it is chosen when the head is trained)",
        )
        self.require(self.tree_width >= 1, "tree_width", ">= 1")


class DraftHead(nn.Module):
    """h_q + q_0 of one variant; `draft_logits` predicts every next draft token of a prefix at once."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        variant: str = "simplified",
        k: int = 4,
        proj_size: int = 1024,
        transformer_layers: int = 1,
        num_heads: int = 4,
        activation: str = "silu",
        shared_lm_head: bool = False,
        draft_vocab: int = 0,
    ):
        super().__init__()
        if variant not in VARIANTS:
            raise SpecReproError(f"sar_draft variant '{variant}' is not one of {', '.join(VARIANTS)}")
        self.settings = {
            "hidden_size": hidden_size,
            "vocab_size": vocab_size,
            "variant": variant,
            "k": k,
            "proj_size": proj_size,
            "transformer_layers": transformer_layers,
            "num_heads": num_heads,
            "activation": activation,
            "shared_lm_head": shared_lm_head,
            "draft_vocab": draft_vocab,
        }
        self.variant, self.k, self.act = variant, k, ACT2FN[activation]
        H, half = hidden_size, hidden_size // 2
        self.target_lm_head: list[nn.Module] = []  # the target's LM head when shared (attach_lm_head); not saved
        # the draft vocabulary's token ids: set by `set_draft_vocab` before training, or by load_state_dict
        self.register_buffer("vocab_ids", torch.arange(draft_vocab) if draft_vocab else None)
        scored = draft_vocab or vocab_size
        out_size = H if shared_lm_head else scored
        if variant == "block":  # Eq. 3: head j sees h_p only
            self.res = nn.ModuleList(nn.Linear(H, H) for _ in range(k))
            self.heads = None if shared_lm_head else nn.ModuleList(nn.Linear(H, scored, bias=False) for _ in range(k))
            for layer in self.res:
                nn.init.zeros_(layer.weight)  # Medusa: each ResBlock starts as the identity
            return
        if variant == "simplified":
            self.mlp = nn.Sequential(nn.Linear(H, half), self.act, nn.Linear(half, half))
            self.alpha_logits = nn.Parameter(torch.zeros(k))  # alpha = 0.5: a uniform mean at init
            hq_size = half
        elif variant == "lstm":
            self.rnn, hq_size = nn.LSTM(H, half, num_layers=2, batch_first=True), half
        elif variant == "redrafter":
            self.rnn, hq_size = nn.RNN(H, half, num_layers=1, nonlinearity="tanh", batch_first=True), half
        else:
            hq_size = H
            if transformer_layers > 0:
                self.positions = nn.Embedding(k, H)
                layer = nn.TransformerEncoderLayer(
                    H, num_heads, 2 * H, dropout=0.0, activation=F.silu, batch_first=True, norm_first=True
                )
                self.layers = nn.TransformerEncoder(layer, transformer_layers, enable_nested_tensor=False)
        self.w_p, self.w_q = nn.Linear(H, proj_size), nn.Linear(hq_size, proj_size)
        self.w_3 = nn.Linear(2 * proj_size, out_size)

    def set_draft_vocab(self, vocab_ids: torch.Tensor) -> "DraftHead":
        """The V token ids the output scores (a head built with draft_vocab = V); attach the LM head after this."""
        if self.vocab_ids is None or len(vocab_ids) != len(self.vocab_ids):
            raise SpecReproError(
                f"this sar_draft head scores {self.settings['draft_vocab']} draft tokens, got {len(vocab_ids)}"
            )
        self.vocab_ids.copy_(vocab_ids)
        return self

    def attach_lm_head(self, lm_head: nn.Module) -> "DraftHead":
        """Use the target's (frozen) LM head, or its draft-vocabulary rows, as the output of a shared_lm_head head."""
        if not self.settings["shared_lm_head"]:
            self.target_lm_head = []
        elif self.vocab_ids is None:
            self.target_lm_head = [lm_head]
        else:
            self.target_lm_head = [draft_vocab.head_rows(lm_head, self.vocab_ids).requires_grad_(False)]
        return self

    def full_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Output logits over the target's whole vocabulary (-inf outside the draft vocabulary)."""
        return draft_vocab.full_vocab_logits(self.vocab_ids, logits, self.settings["vocab_size"])

    def output(self, features: torch.Tensor, position: int | None = None) -> torch.Tensor:
        """Vocabulary logits: the shared target LM head, Medusa head `position`, or W_3's own output as is."""
        if self.settings["shared_lm_head"]:
            if not self.target_lm_head:
                raise SpecReproError("this sar_draft head shares the target's LM head: call attach_lm_head first")
            return self.target_lm_head[0](features)
        return features if position is None else self.heads[position](features)

    def tlm_states(self, emb: torch.Tensor) -> torch.Tensor:
        """h_q(d_1..d_j) for every prefix length j of the draft embeddings emb (B, j, H)."""
        if self.variant == "simplified":  # Eq. 6 for all prefixes at once (cumulative sums)
            alpha = torch.sigmoid(self.alpha_logits[: emb.shape[1]])[None, :, None]
            return torch.cumsum(alpha * self.mlp(emb), 1) / torch.cumsum(alpha, 1)
        if self.variant in ("lstm", "redrafter"):  # Eq. 7: the last layer's state after each token
            if emb.device.type == "cpu" and torch.is_autocast_enabled("cpu") and not onednn_available(torch.bfloat16):
                with torch.autocast("cpu", enabled=False):  # oneDNN's bf16 LSTM refuses a CPU without native bf16
                    return self.rnn(emb.float())[0]
            return self.rnn(emb)[0]
        if not hasattr(self, "layers"):
            return emb
        j = emb.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(j, device=emb.device, dtype=emb.dtype)
        return self.layers(emb + self.positions.weight[:j], mask=causal, is_causal=True)

    def draft_logits(self, hp: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """Logits (B, j, V) of the draft token after each prefix d_1..d_j, given h_p (B, H), emb (B, j, H); V is
        the draft vocabulary (`full_vocab_logits` maps them to the target's)."""
        j = emb.shape[1]
        if j > self.k:
            raise SpecReproError(f"this sar_draft head drafts at most {self.k} tokens per round, asked for {j}")
        if self.variant == "block":
            return torch.stack([self.output(hp + self.act(res(hp)), i) for i, res in enumerate(self.res[:j])], 1)
        hq = self.tlm_states(emb)
        joint = torch.cat([self.w_p(hp)[:, None].expand(-1, j, -1), self.w_q(hq)], -1)
        return self.output(self.w_3(self.act(joint)))  # App. A, b_3 read as the output bias

    def num_parameters(self) -> int:
        """Trained parameters, plus the frozen copy of the target's rows a reduced shared head keeps."""
        copied = self.target_lm_head[0].weight.numel() if self.target_lm_head and self.vocab_ids is not None else 0
        return sum(p.numel() for p in self.parameters()) + copied

    def save_pretrained(self, path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(path / HEAD_FILES[1]))
        (path / HEAD_FILES[0]).write_text(json.dumps({**self.settings, "parameters": self.num_parameters()}, indent=1))

    @classmethod
    def from_pretrained(cls, path) -> "DraftHead":
        path = Path(path)
        settings = json.loads((path / HEAD_FILES[0]).read_text())
        settings.pop("parameters", None)
        head = cls(**settings)
        head.load_state_dict(load_file(str(path / HEAD_FILES[1])))
        return head.eval()


def head_for(
    target: nn.Module,
    variant: str,
    k: int,
    proj_size: int,
    transformer_layers: int,
    shared_lm_head: bool = False,
    vocab_ids: torch.Tensor | None = None,
) -> DraftHead:
    """A fresh head shaped for `target` (its hidden size, vocabulary, heads and activation), scoring the
    draft vocabulary `vocab_ids` when given."""
    config = target.config
    head = DraftHead(
        config.hidden_size,
        config.vocab_size,
        variant,
        k,
        proj_size,
        transformer_layers,
        config.num_attention_heads,
        getattr(config, "hidden_act", "silu"),
        shared_lm_head,
        0 if vocab_ids is None else len(vocab_ids),
    )
    if vocab_ids is not None:
        head.set_draft_vocab(vocab_ids)
    return head.attach_lm_head(target.lm_head)


def find_head(ref: str, artifacts_dir, target, variant: str, shared_lm_head: bool, vocab: int = 0) -> Path:
    """The newest complete `<ref>` / `<ref>-<model>-*` artifact trained for `target` (a model's name or identity)
    holding a head of `variant` (and draft vocabulary)."""
    from specrepro.training.artifacts import find_matching_artifact

    def matches(path: Path) -> bool:
        meta = path / HEAD_FILES[0]
        settings = json.loads(meta.read_text()) if meta.is_file() else {}
        # a joint-mode head belongs to the fine-tuned target saved beside it (config.json): taken only when named
        named = path.name == Path(ref).name
        return (
            settings.get("variant") == variant
            and settings.get("shared_lm_head", False) == shared_lm_head
            and settings.get("draft_vocab", 0) == vocab
            and (named or not (path / "config.json").is_file())
        )

    path = find_matching_artifact(ref, artifacts_dir, target, matches)
    if path is not None:
        return path
    model_name = target if isinstance(target, str) else target.get("name")
    raise SpecReproError(
        f"no sar_draft head artifact '{ref}' of variant {variant} (shared_lm_head={shared_lm_head}, "
        f"draft_vocab={vocab}) for model {model_name} under {artifacts_dir}: "
        f"train one with `specrepro train method=sar_draft method.variant={variant} "
        f"method.shared_lm_head={shared_lm_head} method.draft_vocab={vocab}` and this run's model "
        "options, or use method.head=none"
    )


@dataclass
class HeadInput:
    """The draft head's conditioning during one generation: h_p, the target's last-layer row that produced the
    newest committed token."""

    hp: torch.Tensor | None = None


@register_method(SARDraftConfig)
class SARDraftDecoder(DraftVerifyDecoder):
    name = "sar_draft"
    compilable = True
    reads_hidden_states = True
    lossless = True

    def __init__(self, model, tokenizer, head: DraftHead, cfg: SARDraftConfig, steps=None):
        super().__init__(model, tokenizer, steps)
        if not 1 <= cfg.k <= head.k or cfg.k_max > head.k:
            raise SpecReproError(
                f"sar_draft needs 1 <= k, k_max <= {head.k} (the head's trained k), got k={cfg.k}, k_max={cfg.k_max}"
            )
        self.head, self.cfg, self.tree_width = head, cfg, cfg.tree_width
        self.compiled_head = self.steps.compiled and cfg.variant not in RECURRENT
        self.next_draft_logits = self.steps.drafter_step(self.draft_logits) if self.compiled_head else self.draft_logits
        if self.steps.compiled and not self.compiled_head:
            log.info("sar_draft's %s head drafts eagerly: dynamo cannot capture its recurrent layer", cfg.variant)

    def draft_logits(self, hp: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """Eq. 5's q_0 of the draft token after the round's draft prefix d_1..d_j (j,), given h_p (H,): logits over
        the draft vocabulary."""
        return self.head.draft_logits(hp[None], self.model.get_input_embeddings()(prefix)[None])[0, -1]

    @property
    def drafter_calls(self) -> list:
        """The head's compiled step on each prefix length a round can reach (what the runner warms up)."""
        if not self.compiled_head:
            return []
        p = next(self.model.parameters())
        hp = torch.zeros(self.model.config.hidden_size, device=p.device, dtype=p.dtype)
        longest = max(self.cfg.k, self.cfg.k_max if self.cfg.controller == "heuristic" else 0)
        return [
            (self.next_draft_logits, (hp, torch.zeros(j, dtype=torch.long, device=p.device)))
            for j in range(1, longest + 1)
        ]

    @property
    def extra_parameters(self) -> int:
        return self.head.num_parameters()

    @classmethod
    def resolve_artifacts(cls, cfg: SARDraftConfig, target, artifacts_dir) -> dict[str, Path]:
        if cfg.head == "none":
            return {}
        return {"head": find_head(cfg.head, artifacts_dir, target, cfg.variant, cfg.shared_lm_head, cfg.draft_vocab)}

    @classmethod
    def from_config(cls, cfg: SARDraftConfig, target, ctx) -> "SARDraftDecoder":
        refuse_other_logits(target.model, cls.name)  # before a head is attached to the target's
        if cfg.head == "none":
            head = head_for(
                target.model, cfg.variant, cfg.head_k, cfg.proj_size, cfg.transformer_layers, cfg.shared_lm_head
            ).eval()
        else:
            path = find_head(
                cfg.head, ctx.artifacts_dir, target.identity, cfg.variant, cfg.shared_lm_head, cfg.draft_vocab
            )
            head = DraftHead.from_pretrained(path).attach_lm_head(target.model.lm_head)
        p = next(target.model.parameters())
        head = head.to(device=p.device, dtype=p.dtype)
        return cls(target.model, target.tokenizer, ctx.use_kernels(head) if ctx else head, cfg)

    def new_controller(self) -> DraftLengthController:
        return build_controller(self.cfg.controller, self.cfg.k, self.cfg.k_max)

    def target_forward(self, state, input_ids, cache, logits_to_keep: int = 0, tree=None, past=None) -> TargetOutput:
        """The target's forward, keeping its last-layer (post-norm) hidden states for h_p."""
        logits, hidden = self.steps.with_hidden(input_ids, cache, logits_to_keep, tree, past)
        return TargetOutput(logits, hidden={"final": hidden})

    def start(self, prompt_ids, cache, length) -> HeadInput:
        return HeadInput()

    def after_verify(self, state: HeadInput, tokens, output, rows) -> None:
        # h_p: the kept row that produced the newest token (the prompt's last row, the bonus token's row, or in
        # a tree the accepted path's last row)
        state.hp = output.hidden["final"][0, rows[-1]]

    def propose(self, state: HeadInput, tokens, k, sampling: Sampling, rng, controller) -> Proposal:
        prefix, drafts, qs = tokens[0, -1:], [], []  # d_1: the target's own token (convention A)
        for j in range(1, k + 1):
            logits = self.next_draft_logits(state.hp, prefix)  # Eq. 5
            if j == 1:
                first_logits = logits
            token, q, top1 = draft_vocab.choose_draft_token(
                self.head.vocab_ids, logits, self.head.settings["vocab_size"], sampling, rng
            )
            drafts.append(token)
            qs.append(q)
            if j == k or not controller.keep_drafting(top1):
                break
            prefix = torch.cat([prefix, token.view(1)])
        q = None if sampling.greedy else torch.stack(qs)
        return self.with_first_siblings(torch.stack(drafts), q, first_logits, self.head.vocab_ids)
