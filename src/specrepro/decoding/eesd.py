"""`eesd`: speculative decoding via early exiting with Thompson-sampling draft control (Liu et al., EESD).

Draft = the target's own first N layers (frozen; their KV cache is the target's) + one trainable decoder
layer initialised from the target's last layer + RMSNorm + LM head (Eq. 1). The draft proposes greedy
(or, when the run samples, sampled) tokens one at a time; a controller decides after each token whether to
keep drafting: fixed K, Beta-TS (Alg. 2) or Cali-TS (Alg. 3, with the trained predictor of Eq. 5). The full
target verifies through the shared draft-then-verify loop.

KV sharing: while drafting, layers 0..N-1 run on the target's cache and write KV for the last committed
token and the drafts. Verification REUSES those entries and the layer-N hidden states instead of
cropping and recomputing them: it runs layers 0..N-1 only for the one input they have not seen (the last
draft), then layers N..L-1 over all k+1 inputs. The shared loop's `crop_cache` then drops the rejected
positions in every layer. Reused layer-0..N-1 rows were computed one token at a time, as `ar` computes
them, so greedy output stays identical to `ar`.

`hardware.compile`: the draft's body, the exit layer (on a static cache of its own) and the verification's layers
N..L-1 each run as compiled layer slices (`steps.layers`, one graph per slice and width); the LM heads run
uncompiled on the rows they score.

Token tree (`method.tree_width` w > 1, beyond the paper): the head's next w - 1 best tokens at the first draft
position join the chain as its first node's siblings (`draft_verify.DraftVerifyDecoder.with_first_siblings`).
"""

from __future__ import annotations

import copy
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from specrepro.decoding import draft_vocab
from specrepro.decoding.base import parameters_beside
from specrepro.decoding.controllers import BetaTS, CaliTS, DraftLengthController, FixedLength
from specrepro.decoding.draft_verify import DraftVerifyDecoder, Proposal, TargetOutput
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.steps import EagerSteps, attention_window, decoder_body, refuse_other_logits, run_layers
from specrepro.decoding.verify import crop_cache
from specrepro.errors import SpecReproError
from specrepro.registry import MethodConfig, register_method

CONTROLS = ("fixed", "beta_ts", "cali_ts")
MAX_PREDICTOR_POSITION = 10  # Eq. 5: W^i for i = min(i, 10)


@dataclass
class EESDConfig(MethodConfig):
    name: str = "eesd"
    num_layers: int = 3  # N: the target's first N layers form the draft's body (paper: 5-10% of depth)
    exit_layer: bool = True  # false: the "w/o Early-exiting Layer" ablation (norm + head right after layer N)
    shared_head: bool = False  # true: the target's frozen LM head instead of a trained copy
    draft_vocab: int = 0  # V > 0: the trained head scores only the V tokens most frequent in its training data; 0: all
    head: str = "eesd_head"  # trained head artifact (newest one matching the three fields above); "none": untrained
    control: str = "beta_ts"  # fixed | beta_ts | cali_ts
    k: int = 5  # drafted tokens per round under control=fixed
    k_max: int = 16  # cap on a TS round (the paper caps only at the output length)
    k_min: int = 1  # a TS round drafts at least k_min tokens before the sampler may stop it (beyond the paper)
    beta_alpha0: float = 1.0  # Beta-TS prior Beta(alpha0, beta0): uniform
    beta_beta0: float = 1.0
    beta_counting: str = "literal_R1"  # literal_R1 | literal_R2 | clean (controllers.BetaTS)
    beta_decision: str = "bernoulli"  # bernoulli (the paper) | break_even (one draw a round sets its length)
    beta_break_even: float = 0.2  # break_even: draft while theta^k >= this (a draft token's cost x an AR step's worth)
    sigma_m: float = 0.2  # Cali-TS: the predictor's error (prior std of mu)
    sigma_s: float = 0.5  # Cali-TS: std of one round's sample mean of chi
    theta0: float = 0.5  # Cali-TS: initial theta_hat
    cali_mode: str = "both"  # both | model (w/o Sampling-Prediction) | sampling (w/o Model-Prediction)
    theta_update: str = "successes_only"  # successes_only | literal (Eq. 8 as printed)
    control_seed: int = 0  # seeds each generation's Thompson draws
    # w > 1: the head's top-w tokens at the first draft position, verified as a tree (beyond the paper)
    tree_width: int = 1

    def __post_init__(self):
        self.require(self.num_layers >= 1, "num_layers", ">= 1")  # and below the target's depth: checked on loading
        self.require(self.draft_vocab >= 0, "draft_vocab", ">= 0 (0: the whole vocabulary)")
        self.require(
            not self.draft_vocab or (self.head != "none" and not self.shared_head),
            "draft_vocab",
            "0 without a trained head of its own (head=none or shared_head=true)",
        )
        self.require_one_of("control", CONTROLS)
        self.require(self.k >= 1, "k", ">= 1")
        self.require(self.k_max >= 1, "k_max", ">= 1")
        self.require(1 <= self.k_min <= self.k_max, "k_min", f"between 1 and k_max ({self.k_max})")
        self.require(self.beta_alpha0 > 0, "beta_alpha0", "> 0")
        self.require(self.beta_beta0 > 0, "beta_beta0", "> 0")
        self.require_one_of("beta_counting", ("literal_R1", "literal_R2", "clean"))
        self.require_one_of("beta_decision", ("bernoulli", "break_even"))
        self.require(0 < self.beta_break_even < 1, "beta_break_even", "in (0, 1)")
        self.require(self.sigma_m > 0, "sigma_m", "> 0")
        self.require(self.sigma_s > 0, "sigma_s", "> 0")
        self.require(0 <= self.theta0 <= 1, "theta0", "in [0, 1]")
        self.require_one_of("cali_mode", ("both", "model", "sampling"))
        self.require_one_of("theta_update", ("successes_only", "literal"))
        self.require(self.control_seed >= 0, "control_seed", ">= 0")
        self.require(self.tree_width >= 1, "tree_width", ">= 1")


class CalibrationPredictor(torch.nn.Module):
    """Eq. 5: theta_M = P(keep drafting) = softmax(W_p [W^i H_t^(T); H_{t+i}^(D)])[1], W^i per draft position i."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.position_maps = torch.nn.Parameter(torch.eye(hidden_size).repeat(MAX_PREDICTOR_POSITION, 1, 1))
        self.classifier = torch.nn.Linear(2 * hidden_size, 2)
        torch.nn.init.zeros_(self.classifier.weight)  # untrained: theta_M = 0.5
        torch.nn.init.zeros_(self.classifier.bias)

    def forward(self, target_hidden: torch.Tensor, draft_hidden: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Logits (..., 2); position holds i >= 1 (capped at 10)."""
        every = torch.einsum("pij,...j->...pi", self.position_maps, target_hidden)  # W^p H^(T) for p = 1..10
        index = (position.clamp(1, MAX_PREDICTOR_POSITION) - 1)[..., None, None].expand(
            *every.shape[:-2], 1, every.shape[-1]
        )
        mapped = every.gather(-2, index).squeeze(-2)
        return self.classifier(torch.cat([mapped, draft_hidden], -1))

    def keep_probability(self, target_hidden: torch.Tensor, draft_hidden: torch.Tensor, position: int) -> float:
        logits = self(target_hidden, draft_hidden, torch.tensor(position, device=draft_hidden.device))
        return float(logits.detach().softmax(-1)[1])


class EarlyExitHead(torch.nn.Module):
    """The trainable part of the draft: one decoder layer (own one-layer KV cache) + RMSNorm + LM head.

    With `draft_vocab_ids` (V token ids, most frequent first; `decoding/draft_vocab.py`) the head is a trained
    copy of the target's head rows for those tokens only: on this 49k-token model the full head is half the
    draft's cost.
    """

    @staticmethod
    def check_shape(target: torch.nn.Module, num_layers: int, shared_head: bool, reduced_vocab: bool) -> None:
        """Refuse a head this target cannot have (before any training data is made for it)."""
        body = getattr(target, "model", None)  # its layers run as LlamaModel.forward runs them (steps.run_layers)
        if not all(getattr(body, part, None) is not None for part in ("embed_tokens", "layers", "norm", "rotary_emb")):
            raise SpecReproError(
                f"eesd runs the target's first layers itself, as a LLaMA's (model.embed_tokens, layers, norm, "
                f"rotary_emb): {target.config.model_type} models ({type(target).__name__}) have no such layers"
            )
        if "layer_type" in inspect.signature(body.rotary_emb.forward).parameters:  # Gemma 3: local and global rope
            raise SpecReproError(
                f"eesd runs the target's first layers itself on one rotary embedding, as a LLaMA's: "
                f"{target.config.model_type} models give each layer type its own"
            )
        if not layers_make_the_forward(target):
            raise SpecReproError(
                f"eesd verifies on the target's layers as it runs them itself (embed_tokens, the layers as a "
                f"LLaMA's, norm), which do not make {target.config.model_type} models' forward (Granite multiplies "
                "its embeddings; sparse-attention and multi-stream layers take other inputs), so its verification "
                "would not be the target's: run another method"
            )
        depth = target.config.num_hidden_layers
        if not 1 <= num_layers < depth:
            raise SpecReproError(
                f"eesd num_layers must be in [1, {depth - 1}] for this {depth}-layer target, got {num_layers}"
            )
        if shared_head and reduced_vocab:
            raise SpecReproError("eesd draft_vocab needs a trained head of its own: set method.shared_head=false")

    def __init__(
        self,
        target: torch.nn.Module,
        num_layers: int,
        exit_layer: bool = True,
        shared_head: bool = False,
        draft_vocab_ids: torch.Tensor | None = None,
    ):
        super().__init__()
        self.check_shape(target, num_layers, shared_head, draft_vocab_ids is not None)
        self.num_layers, self.shared_head = num_layers, shared_head
        self.layer = _copy_module(target.model.layers[-1]) if exit_layer else None  # initialised from layer L
        if self.layer is not None:
            self.layer.self_attn.layer_idx = 0  # its own one-layer cache
        self.norm = _copy_module(target.model.norm)
        self.vocab_size = target.config.vocab_size
        if draft_vocab_ids is None:
            self.vocab_ids = None
            self.lm_head = None if shared_head else _copy_module(target.lm_head)
        else:  # the target's head rows of the draft vocabulary, as a trainable copy
            device = target.lm_head.weight.device
            self.register_buffer("vocab_ids", draft_vocab_ids.to(device=device, dtype=torch.long))
            self.lm_head = draft_vocab.head_rows(target.lm_head, self.vocab_ids)
        self._target = [target]  # not a submodule: the frozen target is neither trained nor saved
        self.calibration: CalibrationPredictor | None = None

    @property
    def settings(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "exit_layer": self.layer is not None,
            "shared_head": self.shared_head,
            "draft_vocab": 0 if self.vocab_ids is None else len(self.vocab_ids),
        }

    def hidden(
        self, hidden_n: torch.Tensor, cache=None, steps: EagerSteps | None = None, past: int | None = None
    ) -> torch.Tensor:
        """Eq. 1 up to the head: RMSNorm(Transformer^e(H^N)) for (B, T, d) layer-N hidden states; `steps`: the
        target's (compiled ones run the exit layer compiled, on its own static cache, after `past` rows)."""
        if self.layer is not None:
            hidden_n = (steps or EagerSteps(self._target[0])).layers([self.layer], hidden_n, cache, past=past)
        return self.norm(hidden_n)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (all tokens, or the V of `vocab_ids`)."""
        return (self._target[0].lm_head if self.lm_head is None else self.lm_head)(hidden)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        return draft_vocab.token_ids(self.vocab_ids, index)

    def draft_index(self, tokens: torch.Tensor) -> torch.Tensor:
        return draft_vocab.draft_index(self.vocab_ids, tokens, self.vocab_size)

    def choose(
        self, logits: torch.Tensor, sampling: Sampling, rng
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The draft token for the head's `logits`, its q (None when greedy) and top-1 probability."""
        return draft_vocab.choose_draft_token(self.vocab_ids, logits, self.vocab_size, sampling, rng)

    def save_pretrained(self, path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(path / "eesd_head.safetensors"))
        (path / "eesd_head.json").write_text(json.dumps({**self.settings, "calibration": self.calibration is not None}))

    @classmethod
    def from_pretrained(cls, path, target: torch.nn.Module) -> "EarlyExitHead":
        path = Path(path)
        settings = json.loads((path / "eesd_head.json").read_text())
        vocab = settings.get("draft_vocab", 0)
        head = cls(
            target,
            settings["num_layers"],
            settings["exit_layer"],
            settings["shared_head"],
            torch.zeros(vocab, dtype=torch.long) if vocab else None,
        )  # ids and rows come from the state dict
        if settings["calibration"]:
            head.calibration = CalibrationPredictor(target.config.hidden_size)
        # assign: the copies of an offloaded target layer (model.device_map) hold no data until these replace them
        head.load_state_dict(load_file(str(path / "eesd_head.safetensors")), assign=True)
        p = next(target.parameters())
        return head.to(device=p.device, dtype=p.dtype).eval()


def _copy_module(module: torch.nn.Module) -> torch.nn.Module:
    clone = copy.deepcopy(module)
    for p in clone.parameters():
        p.requires_grad_(True)
    return clone


def first_layers_hidden(
    target, input_ids: torch.Tensor, num_layers: int, cache=None, tree=None, steps: EagerSteps | None = None, past=None
):
    """H^N: the target's residual stream after its first N layers (= output_hidden_states[N]), run by `steps`
    (default: eagerly) after `past` positions of `cache` where the caller knows them."""
    embeds = target.model.embed_tokens(input_ids)
    return (steps or EagerSteps(target)).layers(target.model.layers[:num_layers], embeds, cache, tree, past)


def layers_make_the_forward(target) -> bool:
    """Whether the target's last hidden states are, bit for bit on four tokens, its layers run as `steps.run_layers`
    runs them on embed_tokens' output, then its final norm: Granite multiplies its embeddings in its forward; layers
    that take other inputs (DeepSeek-V3.2's sparse-attention indexer, HunYuan-V4's streams) fail to run so."""
    input_ids = torch.arange(4, device=next(target.parameters()).device)[None] % target.config.vocab_size
    body = target.model
    with torch.inference_mode():
        try:
            ours = body.norm(
                run_layers(
                    target, body.embed_tokens(input_ids), body.layers, None, None, attention_window(target.config)
                )
            )
        except Exception:  # layers that run otherwise than a LLaMA's: refused by the caller in one line
            return False
        return torch.equal(ours, decoder_body(target)(input_ids).last_hidden_state)


def find_head(ref: str, artifacts_dir, target, settings: dict) -> Path:
    """The newest complete `<ref>` / `<ref>-<model>-*` artifact trained for `target` (a model's name or identity)
    whose head has `settings` (N, exit layer, head)."""
    from specrepro.training.artifacts import find_matching_artifact

    def matches(path: Path) -> bool:
        meta = path / "eesd_head.json"
        return meta.is_file() and all(json.loads(meta.read_text()).get(k, 0) == v for k, v in settings.items())

    path = find_matching_artifact(ref, artifacts_dir, target, matches)
    if path is not None:
        return path
    model_name = target if isinstance(target, str) else target.get("name")
    raise SpecReproError(
        f"no eesd head artifact '{ref}' for model {model_name} with {settings} under {artifacts_dir}: train one with "
        f"`specrepro train method=eesd method.num_layers={settings['num_layers']} "
        f"method.exit_layer={settings['exit_layer']} method.shared_head={settings['shared_head']} "
        f"method.draft_vocab={settings['draft_vocab']}` and this run's model options, or use method.head=none"
    )


@dataclass
class ExitState:
    """The early-exit draft during one generation: the target's cache (whose layers 0..N-1 are the draft's
    body), the exit layer's own cache, the layer-N rows it has not consumed yet (ending at the last committed
    position), H_t^(T) of Eq. 5 (the final-layer row that produced the newest token), the layer-N rows of the
    last proposal, which its verification reuses, and the positions the body's layers and the exit layer's
    cache hold (known here, so compiled steps need not read them from the device)."""

    cache: Any
    exit_cache: Any
    pending: torch.Tensor
    target_hidden: torch.Tensor | None = None
    drafted_hidden_n: torch.Tensor | None = None
    body_length: int = 0
    exit_length: int = 0

    def body(self, decoder: "EESDDecoder", input_ids: torch.Tensor, tree=None) -> torch.Tensor:
        """H^N of `input_ids`, which continue the body's layers of the target's cache."""
        past, self.body_length = self.body_length, self.body_length + input_ids.shape[1]
        return first_layers_hidden(
            decoder.model, input_ids, decoder.head.num_layers, self.cache, tree, decoder.steps, past
        )

    def exit_hidden(self, decoder: "EESDDecoder", hidden_n: torch.Tensor) -> torch.Tensor:
        """The exit layer and norm (Eq. 1) on layer-N rows that continue its cache."""
        past, self.exit_length = self.exit_length, self.exit_length + hidden_n.shape[1]
        return decoder.head.hidden(hidden_n, self.exit_cache, decoder.steps, past)


@register_method(EESDConfig)
class EESDDecoder(DraftVerifyDecoder):
    name = "eesd"
    compilable = True  # the draft's layers, the exit layer and the verification's layers run through `steps.layers`

    def __init__(self, model, tokenizer, head: EarlyExitHead, cfg: EESDConfig):
        super().__init__(model, tokenizer)
        refuse_other_logits(model, self.name)  # the verification's logits are lm_head(its own layers' output)
        if cfg.control == "cali_ts" and cfg.cali_mode != "sampling" and head.calibration is None:
            raise SpecReproError(
                "eesd control=cali_ts needs a head artifact trained with its calibration predictor "
                "(training.calibration.sequences > 0), or method.cali_mode=sampling"
            )
        self.head, self.cfg, self.tree_width = head, cfg, cfg.tree_width

    @property
    def extra_parameters(self) -> int:
        return parameters_beside(self.head, self.model)  # the frozen first N layers are the target's

    @property
    def layer_slices(self) -> list[tuple[str, list]]:
        """The draft's body (layers 0..N-1) and the verification's rest (N..L-1) on the target's cache, and the
        exit layer on its own: what compiled steps warm up."""
        layers, n = list(self.model.model.layers), self.head.num_layers
        return [
            ("target", layers[:n]),
            ("target", layers[n:]),
            *([("exit", [self.head.layer])] if self.head.layer is not None else []),
        ]

    @staticmethod
    def head_settings(cfg: EESDConfig) -> dict:
        return {
            "num_layers": cfg.num_layers,
            "exit_layer": cfg.exit_layer,
            "shared_head": cfg.shared_head,
            "draft_vocab": cfg.draft_vocab,
        }

    @classmethod
    def resolve_artifacts(cls, cfg: EESDConfig, target, artifacts_dir) -> dict[str, Path]:
        if cfg.head == "none":
            return {}
        return {"head": find_head(cfg.head, artifacts_dir, target, cls.head_settings(cfg))}

    @classmethod
    def from_config(cls, cfg: EESDConfig, target, ctx) -> "EESDDecoder":
        settings = cls.head_settings(cfg)
        if cfg.head == "none":
            head = EarlyExitHead(target.model, cfg.num_layers, cfg.exit_layer, cfg.shared_head).eval()
            if cfg.control == "cali_ts":
                head.calibration = CalibrationPredictor(target.model.config.hidden_size)  # theta_M = 0.5
            p = next(target.model.parameters())
            head = head.to(device=p.device, dtype=p.dtype)
        else:
            path = find_head(cfg.head, ctx.artifacts_dir, target.identity, settings)
            head = EarlyExitHead.from_pretrained(path, target.model)
        return cls(target.model, target.tokenizer, ctx.use_kernels(head) if ctx else head, cfg)

    def new_controller(self) -> DraftLengthController:
        cfg, rng = self.cfg, np.random.default_rng(self.cfg.control_seed)
        if cfg.control == "fixed":
            return FixedLength(cfg.k)
        if cfg.control == "beta_ts":
            return BetaTS(
                cfg.beta_alpha0,
                cfg.beta_beta0,
                cfg.k_max,
                rng,
                cfg.beta_counting,
                cfg.beta_decision,
                cfg.beta_break_even,
            )
        return CaliTS(cfg.sigma_m, cfg.sigma_s, cfg.theta0, cfg.k_max, rng, cfg.cali_mode, cfg.theta_update)

    def start(self, prompt_ids, cache, length) -> ExitState:
        p = next(self.model.parameters())
        exit_cache = self.steps.new_cache(length, "exit")
        return ExitState(cache, exit_cache, p.new_empty(1, 0, self.model.config.hidden_size))

    def target_forward(
        self, state: ExitState, input_ids, cache, logits_to_keep: int = 0, tree=None, past=None
    ) -> TargetOutput:
        """The full target on [last token, drafts], reusing the layer 0..N-1 rows the draft already computed (its
        first layers hold more than `past` positions then: it reads each layer's own)."""
        n = self.head.num_layers
        verify_start = state.body_length if past is None else past  # the prefill's is 0
        reused = state.body_length - verify_start  # inputs the draft already ran through layers < N
        fresh = state.body(self, input_ids[:, reused:], tree)
        hidden_n = torch.cat([state.drafted_hidden_n, fresh], 1) if reused else fresh
        final = self.model.model.norm(
            self.steps.layers(self.model.model.layers[n:], hidden_n, cache, tree, past=verify_start)
        )
        logits = self.model.lm_head(final[:, -logits_to_keep:] if logits_to_keep else final)
        return TargetOutput(logits, verify_start, {"layer_n": hidden_n, "final": final})

    def propose(self, state: ExitState, tokens, k, sampling: Sampling, rng, controller) -> Proposal:
        x, drafts, qs, rows = tokens[:, -1:], [], [], []
        for i in range(1, k + 1):
            hidden_n = state.body(self, x)
            rows.append(hidden_n)
            exit_input = torch.cat([state.pending, hidden_n], 1)
            state.pending = exit_input[:, :0]
            z = state.exit_hidden(self, exit_input)[0, -1]
            logits = self.head.logits(z)
            token, q, top1 = self.head.choose(logits, sampling, rng)
            if i == 1:
                first_logits = logits
            drafts.append(token)
            qs.append(q)
            if i == k:
                break
            if i < self.cfg.k_min:  # no Thompson draw below the floor
                x = token.view(1, 1)
                continue
            extra = {}
            if isinstance(controller, CaliTS) and controller.needs_model_prediction:
                extra["theta_model"] = self.head.calibration.keep_probability(state.target_hidden, z, i)
            if not controller.keep_drafting(top1, **extra):
                break
            x = token.view(1, 1)
        state.drafted_hidden_n = torch.cat(rows, 1)
        q = None if sampling.greedy else torch.stack(qs)
        return self.with_first_siblings(torch.stack(drafts), q, first_logits, self.head.vocab_ids)

    def after_verify(self, state: ExitState, tokens, output: TargetOutput, rows) -> None:
        committed = tokens.shape[1] - 1  # positions that keep KV; the last committed token is fed next round
        state.body_length = committed  # the loop cropped every layer of the target's cache to it
        exit_len = min(state.exit_length if self.head.layer is not None else committed, committed)
        # the kept rows (a tree's accepted path); the exit layer saw only the main chain's drafts
        hidden_n, final = output.hidden["layer_n"][:, rows], output.hidden["final"][0, rows]
        on_chain = next((j for j, row in enumerate(rows) if row != j), len(rows))
        exit_len = min(exit_len, output.position + on_chain)
        crop_cache(state.exit_cache, exit_len)
        state.exit_length = exit_len
        # layer-N rows known for positions [known_start, ...): unconsumed pending rows, then this forward's
        known = torch.cat([state.pending, hidden_n], 1)
        known_start = output.position - state.pending.shape[1]
        state.pending = known[:, exit_len - known_start : committed - known_start]
        state.target_hidden = final[min(committed - 1 - output.position, len(final) - 1)]
