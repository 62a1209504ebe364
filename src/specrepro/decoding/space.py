"""`space`: SPACE auto-correct decoding (Yi et al. 2024, Alg. 1) on a SAR-SFT checkpoint.

Every step feeds one block of (k+1)^2 tokens on the KV cache of the committed prefix (Eq. 5):

    [anchor] [M]*k [c_1] [M]*k ... [c_k] [M]*k

`anchor` is the last committed token (not yet in the cache) and c_1..c_k the previous step's candidates.
A custom attention mask (Eq. 6, read as its prose and Fig. 3 say: a mask sees the real tokens before it
and the earlier masks of its own group only; real tokens see real tokens only) and position ids (Eq. 7:
each group sits right after its anchor) make one forward do two jobs:
- verify: the outputs at the real slots are the target's AR distributions for c_1..c_k and the token
  after them, so the shared verifier accepts a prefix of the candidates plus one target token (Eq. 8-10);
- draft: the k masks after the last accepted real token guess the k tokens after that target token;
  they are the next step's candidates (Sec. 3.2: "commences from the (i*+1)-th mask token group").
Real tokens never see masks, so their keys and values equal plain AR's: after a step the cache keeps the
anchor and the accepted candidates and drops the rest.

The block is stored real slots first, [anchor, c_1..c_k] then the k + 1 mask groups: with the mask and the
position ids carrying the layout, the order of a block's slots changes nothing in what it computes, and this
one makes the keys a real slot sees a prefix of the cache (a view, not a gather, on the
`hardware.row_invariant` one-row path) and the kept cache a crop.

The LM head (LLaMA-family `model.model` + `lm_head`) runs on the k + 1 real slots and the one mask group
used, 2k + 1 rows instead of (k + 1)^2, in two calls; for k <= 3 one call over all (k + 1)^2 is cheaper.
The prefill is ar's (so the first token and the cache are bit for bit ar's), followed by one mask group on
its cache (the training layout), so the first candidates come with the first token and no dummy step is
needed. The k masks of a group see only the earlier masks of that group, so a checkpoint trained with
k_train masks decodes with any k <= k_train.

bf16: with `hardware.row_invariant=true` each real slot attends to its own keys (the cached prefix and the real
slots up to itself) in a one-query SDPA call, bit for bit the ar step at its position, so greedy SPACE stays
token-identical to bf16 ar; without it, near-ties flip. The mask slots need no such care: they share one call.

Sampling: `residual_resample=true` is exact speculative sampling (the token after a rejection comes from
norm(max(p - q, 0))) and preserves the target distribution; `false` is the paper's Alg. 1 line 18 (that
token comes from p), which does not. [M] is never proposed as a candidate (its draft logit is masked);
the target's own distribution is left untouched so greedy SPACE equals greedy `ar` on the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from specrepro.decoding.base import Decoder, GenerationBuilder
from specrepro.decoding.device import upload
from specrepro.decoding.sampling import Sampling, next_token, probs, sample
from specrepro.decoding.verify import crop_cache, speculative_verify
from specrepro.errors import SpecReproError
from specrepro.registry import MethodConfig, register_method

MASK_TOKEN = "[M]"
# Blocks of at most this many slots (k <= 3) run the LM head once over every slot: streaming the head's
# 49k x d weights once for 9-16 rows costs less than twice for the real slots and then the drafting group
# (fp32 k = 2 on this CPU: ~0.1 of an ar step saved). From 25 rows on, the one call's extra rows cost more than
# the second pass it saves.
HEAD_BLOCK_ROWS = 16


@dataclass
class SpaceConfig(MethodConfig):
    name: str = "space"
    k: int = 5  # masks per group = candidates per step (paper default 5; at most the checkpoint's training k)
    # true: exact speculative sampling; false: paper's Alg. 1 (not distribution-preserving)
    residual_resample: bool = True

    def __post_init__(self):
        self.require(self.k >= 1, "k", ">= 1")  # its upper bound, the checkpoint's training k, is checked on loading


def block_layout(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(allow, offsets) of one step's block stored as [anchor, c_1..c_k, group 0's k masks, .., group k's]:
    allow[a, b] = query a may attend key b (Eq. 6); offsets = Eq. 7."""
    index = torch.arange((k + 1) ** 2)
    real = index <= k
    group = torch.where(real, index, (index - k - 1) // k)  # real slot g anchors group g
    slot = torch.where(real, 0, (index - k - 1) % k + 1)  # 0: the real token; j: the group's j-th mask
    sees_real = real[None, :] & (group[None, :] <= group[:, None])  # the real tokens up to its group's anchor
    masks = ~real[:, None] & ~real[None, :]
    same_group_masks = masks & (group[:, None] == group[None, :]) & (slot[None, :] <= slot[:, None])
    return sees_real | same_group_masks, group + slot  # anchor/c_g at offset g; mask j of group g at offset g + j


@register_method(SpaceConfig)
class SpaceDecoder(Decoder):
    name = "space"
    compilable = True
    reads_hidden_states = True  # a block's forward returns hidden states; the LM head runs on the rows it reads

    def __init__(self, model, tokenizer, mask_id: int, k: int = 5, residual_resample: bool = True, steps=None):
        super().__init__(model, tokenizer, steps)
        trained_k = getattr(model.config, "space_k", None)
        if k < 1 or (trained_k is not None and k > trained_k):
            raise SpecReproError(f"method.k must be between 1 and the checkpoint's training k ({trained_k}), got {k}")
        self.mask_id, self.k, self.residual_resample = mask_id, k, residual_resample
        allow, offsets = block_layout(k)
        self.block_allow = allow.to(self.device)
        self.block_offsets = offsets.to(self.device)
        self.real_slots = torch.arange(k + 1, device=self.device)  # anchor, c_1..c_k: the block's first rows
        self.head_on_block = (k + 1) ** 2 <= HEAD_BLOCK_ROWS

    @classmethod
    def from_config(cls, cfg: SpaceConfig, target, ctx) -> "SpaceDecoder":
        mask_id = getattr(target.model.config, "space_mask_token_id", None)
        if mask_id is None:
            raise SpecReproError(
                "method=space decodes a SAR-SFT checkpoint (`specrepro train method=space`), but the run's model has "
                "no mask token: run with model.source=artifact model.id=space (so the ar reference shares the weights)"
            )
        return cls(target.model, target.tokenizer, int(mask_id), cfg.k, cfg.residual_resample)

    @property
    def max_step_width(self) -> int:
        return (self.k + 1) ** 2  # one block

    def _draft(self, mask_logits: torch.Tensor, sampling: Sampling, rng) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Candidates (k,) from one mask group's logits, and their distributions q (k, vocab) when sampling."""
        mask_logits = mask_logits.clone()
        mask_logits[:, self.mask_id] = float("-inf")  # never propose [M]
        if sampling.greedy:
            return mask_logits.argmax(-1), None
        q = probs(mask_logits, sampling)
        return sample(q, rng), q

    def _decode(self, prompt_ids: torch.Tensor, sampling: Sampling, out: GenerationBuilder, rng) -> None:
        k, device = self.k, prompt_ids.device
        cache = self.steps.new_cache(prompt_ids.shape[1] + out.max_new_tokens)
        masks = torch.full((1, k), self.mask_id, device=device)
        with out.timed("prefill"):  # the prompt as ar prefills it, then one mask group after it (the training layout)
            logits = self.steps(prompt_ids, cache, logits_to_keep=1).logits[0, -1]
            out.commit([next_token(logits, sampling, rng)], prefill=True)
            candidates, q = self._draft(self.steps(masks, cache).logits[0], sampling, rng)
        n_cached = prompt_ids.shape[1]
        crop_cache(cache, n_cached)
        accepted_per_position = torch.zeros(k, dtype=torch.long)
        while not out.done:
            anchor = out.gen.token_ids[-1]
            with out.timed("verify"):  # one forward verifies c_1..c_k and drafts from every mask group (Eq. 5-7)
                real = torch.cat([upload([anchor], device), candidates])  # anchor, c_1..c_k
                block = torch.cat([real, masks.repeat(1, k + 1)[0]])[None]  # then k masks for each
                allow = torch.cat(
                    [torch.ones(len(self.block_allow), n_cached, dtype=torch.bool, device=device), self.block_allow], 1
                )
                hidden = self.steps.hidden(
                    block,
                    cache,
                    tree=(allow, n_cached + self.block_offsets),
                    exact_rows=self.real_slots,  # with hardware.row_invariant only these take the one-row path
                    past=n_cached,
                )[0]
                # the head only where it is needed: the real slots, and every mask slot if one pass is cheaper
                logits = self.model.lm_head(hidden if self.head_on_block else hidden[: k + 1])
                # only the candidates the budget can still commit count as drafted (the shared loop's cap)
                usable = min(k, out.remaining - 1)
                tokens, n_accepted = speculative_verify(
                    candidates[:usable],
                    None if q is None else q[:usable],
                    logits[: usable + 1],
                    sampling,
                    rng,
                    self.residual_resample,
                )
            n_cached += n_accepted + 1
            crop_cache(cache, n_cached)  # the anchor and accepted candidates; rejects and masks dropped
            kept = out.commit(tokens, drafted=usable)
            accepted_per_position[: min(n_accepted, len(kept))] += 1  # none past an EOS or the budget
            if out.done:
                break
            with out.timed("draft"):  # the mask group after the last accepted real token guesses past the new token
                group = slice(k + 1 + n_accepted * k, k + 1 + (n_accepted + 1) * k)
                mask_logits = logits[group] if self.head_on_block else self.model.lm_head(hidden[group])
                candidates, q = self._draft(mask_logits, sampling, rng)
        out.gen.extra.update(k=k, accepted_per_position=accepted_per_position.tolist())
