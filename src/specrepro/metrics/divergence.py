"""Why a greedy method's output differs from `ar`'s: a numerical near-tie, or a bug.

A verification scores several rows in one forward; in bf16 (and on a GPU in any dtype) its kernels round
differently from the one-row steps `ar` takes, so where the target's two best tokens are within that rounding
of each other a lossless method can pick the other one, and everything after differs. This module finds, for a
generation whose token ids differ from the `ar` reference's on the same prompt, the first differing position and
recomputes it on the run's target (its steps and dtype, eager or compiled, on the run's device):

- `ar`'s logits there, as `ar` computed them: the prompt's prefill, then one-row steps over `ar`'s tokens;
- the same position's logits as a method verifying w rows at a time computes them (`ar`'s tokens after the
  prefill in w-row forwards, the position the last row of the last; a position with fewer than w tokens before
  it a row of the first, with `ar`'s next tokens after it), for each w of `ROUNDING_WIDTHS` up to the method's
  widest step: the earlier positions' keys and values then come from multi-row forwards too, as in a
  speculative decode;
- for a method whose verifications hold token trees (`Decoder.verifies_trees`), the same with w tokens verified
  as a tree's path with a sibling before each node (`interleaved_step`): a path node's keys then have masked rows
  between them, which sums attention in another order than a chain (row-invariant compiled steps, which make a
  chain's rounding 0, leave this one);
- `rounding`: the largest change of any logit between `ar`'s computation and those: this position's measured
  rounding in this dtype on this machine;
- `gap`: `ar`'s token's logit minus the method's token's logit in `ar`'s computation (>= 0 when it reproduces
  `ar`'s choice), and `margin`, the top-2 logit margin there.

The rule: a divergence is a near-tie when `gap <= rounding` (no more than rounding was seen to move a logit there;
a gap of 0 is a tie either way), and a bug otherwise. Each of the two logits can move by `rounding`, so a flip needs
only `gap <= 2 * rounding`: the rule is the stricter half, as `rounding` is already the largest change over the
whole vocabulary, while a bf16 near-tie's gap is a step or two of bf16's spacing at the logits' magnitude.
A later turn whose prompt holds a diverged answer inherits its first divergence's class. Row-invariant kernels
(`hardware.row_invariant`) measure a rounding of 0: under them only an exact tie is a near-tie.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specrepro.decoding.steps import target_steps
from specrepro.decoding.verify import keep_tree_path, tree_attention

ROUNDING_WIDTHS = (2, 4, 8, 16)  # verification widths the rounding is measured at (up to the method's widest)


def first_difference(tokens: list[int], reference: list[int]) -> int | None:
    """The first position where `tokens` and `reference` differ (the shorter's length if one is the other's
    prefix); None when they are equal."""
    if tokens == reference:
        return None
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


@torch.inference_mode()
def position_logits(
    steps, prompt: list[int], tokens: list[int], width: int, tree: bool = False, ahead: list[int] = ()
) -> torch.Tensor:
    """The fp32 logits for the token after `prompt + tokens`, computed as a method that verifies `width` tokens at
    a time would: the prompt's prefill, then `tokens` and the tokens `ahead` of the position in `width`-token
    forwards (the first one shorter), the position's row the last forward's before `ahead`'s (fewer than
    `width`: a first verification predicts early positions from its first rows); with `tree`, each forward a
    tree's path (`interleaved_step`). Width 1: `ar`'s own computation."""
    device = next(steps.model.parameters()).device
    ids = torch.tensor([prompt + tokens + list(ahead)], device=device)
    cache = steps.new_cache(ids.shape[1])  # a tree's siblings are within a step's spare rows
    logits = steps(ids[:, : len(prompt)], cache, logits_to_keep=1).logits
    start = len(prompt)
    for end in range(len(prompt) + ((len(tokens) + len(ahead)) % width or width), ids.shape[1] + 1, width):
        chunk = ids[:, start:end]
        logits = interleaved_step(steps, chunk, cache, start) if tree else steps(chunk, cache).logits
        start = end
    return logits[0, -1 - len(ahead)].float()


def interleaved_step(steps, chunk: torch.Tensor, cache, past: int) -> torch.Tensor:
    """The logits (1, m, vocab) of `chunk`'s m tokens after `past` cached positions, verified as a tree whose
    accepted path they are, each node after the first with a sibling (its own token) just before it, which the
    path does not see; the cache then keeps the path (`verify.keep_tree_path`), as a tree verification's does."""
    parents, path = [], []
    for _ in range(chunk.shape[1] - 1):
        parent = path[-1] if path else -1
        parents += [parent, parent]  # a sibling, then the path's next node
        path.append(len(parents) - 1)
    allow, positions = tree_attention(parents, past)
    nodes = torch.cat([chunk[0, :1], chunk[0, 1:].repeat_interleave(2)])[None]
    logits = steps(nodes, cache, tree=(allow.to(chunk.device), positions.to(chunk.device)), past=past).logits
    keep_tree_path(cache, past + 1, path)
    return logits[:, [0] + [node + 1 for node in path]]


def ar_logits_and_rounding(
    steps, prompt: list[int], ar_tokens: list[int], position: int, widths, tree_widths=()
) -> tuple[torch.Tensor, float]:
    """(the fp32 logits `ar` computed for its token at `position` after `prompt`, the largest change of any of
    them when the same position is computed in w-token verifications, w in `widths`, and as w-token tree paths, w
    in `tree_widths`: `position_logits`, a w wider than the tokens before the position verifying `ar`'s next
    tokens after it). The prefill's token (position 0) is every method's own prefill: no rounding."""
    before = ar_tokens[:position]
    one_row = position_logits(steps, prompt, before, 1)
    layouts = [(width, False) for width in widths] + [(width, True) for width in tree_widths]
    changes = [  # `ar`'s tokens from the position up to the width: the rows after the position's
        float((position_logits(steps, prompt, before, width, tree, ar_tokens[position:width]) - one_row).abs().max())
        for width, tree in layouts
        if before
    ]
    return one_row, max(changes, default=0.0)


def classify(steps, prompt: list[int], tokens: list[int], ar_tokens: list[int], widths, tree_widths=()) -> dict | None:
    """The first divergence of a greedy generation's `tokens` from `ar_tokens` on `prompt` (None: identical):
    its position, both tokens, `gap`, `margin`, `rounding` (over `widths`, and `tree_widths` for a method that
    verifies trees) and `near_tie` (module doc)."""
    position = first_difference(tokens, ar_tokens)
    if position is None:
        return None
    if position >= min(len(tokens), len(ar_tokens)):  # one stopped where the other went on: not a rounding
        return {
            "position": position,
            "token": None,
            "ar_token": None,
            "gap": None,
            "margin": None,
            "rounding": None,
            "near_tie": False,
        }
    token, ar_token = tokens[position], ar_tokens[position]
    logits, rounding = ar_logits_and_rounding(steps, prompt, ar_tokens, position, widths, tree_widths)
    top2 = logits.topk(2).values
    gap = float(logits[ar_token] - logits[token])
    return {
        "position": position,
        "token": token,
        "ar_token": ar_token,
        "gap": gap,
        "margin": float(top2[0] - top2[1]),
        "rounding": rounding,
        "near_tie": gap <= rounding,
    }


def rounding_widths(max_step_width: int) -> list[int]:
    """The verification widths a method's rounding is measured at: `ROUNDING_WIDTHS` up to its widest step."""
    return sorted({min(width, max_step_width) for width in ROUNDING_WIDTHS} - {1})


def tree_rounding_widths(max_step_width: int, trees: bool) -> list[int]:
    """The path lengths a tree-verifying method's rounding is measured at: those of `rounding_widths` whose
    interleaved tree (a sibling before each node) fits its widest step; none for a method that verifies chains."""
    return [width for width in rounding_widths(max_step_width) if 2 * width - 1 <= max_step_width] if trees else []


def classify_row(
    row: dict,
    reference_row: dict,
    target,
    max_step_width: int,
    prompt_after: Callable[[list[str]], list[int]],
    trees: bool = False,
) -> None:
    """Set `divergence` on each of a decoded record's greedy generations whose token ids differ from its `ar`
    reference's (`reference_row`, the same record): the first differing turn of a sample is classified
    (`classify`; `trees`: the method verifies token trees) after the prompt that turn decoded, `prompt_after` its
    earlier answers (the decoded ids, `data.prompt_ids`: a record's special-token text stays text); a later one,
    whose prompt holds that turn's answer, says so (`after_turn`) and inherits its class."""
    steps, widths = target_steps(target.model), rounding_widths(max_step_width)
    tree_widths = tree_rounding_widths(max_step_width, trees)
    for sample, ref_sample in zip(row["samples"], reference_row["samples"]):
        first = None  # the sample's first diverged turn and its divergence
        for turn, (gen, ref) in enumerate(zip(sample, ref_sample)):
            if gen["token_ids"] == ref["token_ids"]:
                continue
            if first is None:
                prompt = prompt_after([earlier["text"] for earlier in ref_sample[:turn]])
                first = turn, classify(steps, prompt, gen["token_ids"], ref["token_ids"], widths, tree_widths)
                gen["divergence"] = first[1]
            else:
                gen["divergence"] = {"after_turn": first[0], "near_tie": first[1]["near_tie"]}


def near_tie_metrics(gens: list[dict], reference: list[dict]) -> dict[str, float]:
    """`lossless_near_tie`: the fraction of generations identical to the reference's or diverging only at a
    near-tie; `divergences` and `divergence_bugs`: how many first divergences there were and how many were
    bugs; `near_tie_max_gap` and `near_tie_max_rounding`: the largest gap and rounding among the near-ties.
    {} when some generation differs unclassified (a record made before classification)."""
    if len(gens) != len(reference) or not gens:
        return {}
    divergences = []
    for gen, ref in zip(gens, reference):
        if gen["token_ids"] == ref["token_ids"]:
            continue
        if "divergence" not in gen:
            return {}
        divergences.append(gen["divergence"])
    firsts = [d for d in divergences if "after_turn" not in d]
    near_ties = [d for d in firsts if d["near_tie"]]
    metrics = {
        "lossless_near_tie": 1 - sum(not d["near_tie"] for d in divergences) / len(gens),
        "divergences": len(firsts),
        "divergence_bugs": len(firsts) - len(near_ties),
    }
    if near_ties:
        metrics.update(
            near_tie_max_gap=max(d["gap"] for d in near_ties),
            near_tie_max_rounding=max(d["rounding"] for d in near_ties),
        )
    return metrics
