"""How a decoder runs its target's forwards: eagerly on a DynamicCache, or compiled on a static cache.

`hardware.compile` (gpt-fast's recipe, through transformers' own StaticCache): the KV cache is allocated once
with room for the longest prompt plus the budget and reused by every generation; each decoding step's input is
padded to a bucket width (`hardware.compile_widths`) and run through `torch.compile`d forward, one graph per
width (with CUDA graphs under `mode="reduce-overhead"`). Every step passes its attention mask and positions as
inputs, so a chain step and a token tree's custom mask share one graph. Rolling the cache back is a
write-position reset (`verify.crop_cache`): stale rows past it are masked out and later overwritten (a static
cache's `get_seq_length` is that live position tensor: copy it, `int(...)`, to keep a length). Prefill,
and any step wider than the largest bucket, run the same forward uncompiled on the same cache.

`hardware.row_invariant` with `hardware.compile` (lossless bf16 on a GPU): a verification's rows must round as
`ar`'s one-token steps do, and a matmul of 1 row and one of k rows run different kernels. So every step runs at
one width, the widest of `compile_widths`, through one graph that returns logits and hidden states: the same
kernels at the same shapes for every step, each row computed from its own inputs alone. A chain's rows then equal
`ar`'s bit for bit (`tests/test_compiled.py`); a tree's attention sums its keys in another order (siblings
interleave), so a tree method can still meet a near-tie (`metrics/divergence.py` classifies it), as can a method
that finishes its forward outside that graph (EESD's layer slices, SPACE's LM head on its real slots). A step
wider than that width is refused at warm-up rather than run uncompiled.

A drafter that runs some of the target's layers, or a decoder layer of its own, itself (EESD's early exit) runs
them through `steps.layers`: compiled steps compile one graph per such slice and width too, on the target's static
cache or on a static cache of the drafter's own (`new_cache(length, name)`), and warm up the slices a decoder
declares (`Decoder.layer_slices`). A drafter that runs the target in another state (Draft & Verify's skipped
sub-layers) names it (`variant=`): that state gets graphs of its own (`Decoder.step_variants`). A drafter's own
module (a SAR draft head) runs through `steps.drafter_step(fn)`: compiled steps compile it, a graph per input shape,
warmed up on the inputs a decoder declares (`Decoder.drafter_calls`).

Decoders ask `target_steps(model)` for the steps object the loader attached (`use_hardware`), or eager steps.
"""

from __future__ import annotations

import logging
import time
import types
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import (
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    StaticLayer,
)
from transformers.masking_utils import (
    create_causal_mask,
    create_chunked_causal_mask,
    create_sliding_window_causal_mask,
)

from specrepro.decoding.device import device_sync
from specrepro.decoding.verify import additive_mask, crop_cache, tree_attention
from specrepro.errors import SpecReproError

log = logging.getLogger(__name__)

STEPS_ATTRIBUTE = "specrepro_steps"  # where `use_hardware` leaves a model's compiled steps
DEFAULT_WIDTHS = (1, 2, 4, 8, 16, 32, 64)
BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")
# `hardware.compile_freezing`: inductor's freezing, with linears that read one input concatenated on a CPU too
# (on a GPU inductor does that by default)
FREEZING_OPTIONS = {"freezing": True, "cpp.enable_concat_linear": True}


class StepOutput(NamedTuple):
    """A step's output: the logits of its rows (a model's output object costs a compiled step tens of microseconds
    of host time to build)."""

    logits: torch.Tensor


class EagerSteps:
    """The target's forwards as a user runs them: a new DynamicCache per generation, no padding, no compile."""

    compiled = False

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.window = attention_window(model.config)

    def new_cache(self, length: int, name: str = "target", rolls_back: bool = True):
        """A cache for one generation of up to `length` positions: the target's, or (`name`) one a drafter keeps for
        layers of its own. One that `rolls_back` rejected rows keeps every key (`rollback_cache`)."""
        return rollback_cache(self.model.config) if rolls_back else DynamicCache(config=self.model.config)

    def holds(self, length: int) -> bool:
        """Whether a generation of `length` positions runs without compiling anything new (eager: always)."""
        return True

    def __call__(
        self,
        input_ids: torch.Tensor,
        cache,
        logits_to_keep: int = 0,
        tree=None,
        past: int | None = None,
        variant: str | None = None,
    ):
        """One forward appending `input_ids` (1, n) to `cache`; `tree`: (allowed keys, positions) of a token
        tree (`verify.tree_attention`), None for a causal chain. `past`: the length the chain continues, for a
        cache whose first layer holds another (a draft that skips attention layers writes only the others');
        `variant`: the name of a model state the caller has set (`Decoder.step_variants`), which compiled steps
        compile graphs of their own for. Returns the rows' logits (`StepOutput`)."""
        return StepOutput(
            self.model(
                input_ids, cache=cache, logits_to_keep=logits_to_keep, **self.mask_inputs(input_ids, tree, past, cache)
            ).logits
        )

    def hidden(
        self,
        input_ids: torch.Tensor,
        cache,
        tree=None,
        exact_rows: torch.Tensor | None = None,
        past: int | None = None,
        variant: str | None = None,
    ):
        """The same forward without the LM head: the last-layer hidden states after the final norm of every row,
        for a decoder that runs the head only on the rows it reads. `exact_rows`: the rows that must equal a
        one-row step bit for bit under `hardware.row_invariant` (models/attention.py)."""
        rows = {} if exact_rows is None else {"exact_rows": exact_rows}
        return decoder_body(self.model)(
            input_ids, cache=cache, **self.mask_inputs(input_ids, tree, past, cache), **rows
        ).last_hidden_state

    def mask_inputs(self, input_ids: torch.Tensor, tree, past: int | None, cache=None) -> dict:
        """A tree's mask and positions (`tree_inputs`), a chain's positions after `past`, or {} to let the model
        count them."""
        if tree is not None or past is None:
            return self.tree_inputs(tree, cache)
        return {"position_ids": torch.arange(past, past + input_ids.shape[1], device=input_ids.device)[None]}

    def with_hidden(self, input_ids: torch.Tensor, cache, logits_to_keep: int = 0, tree=None, past: int | None = None):
        """The forward returning (logits, last-layer hidden states after the final norm) of every row: what
        drafters conditioned on the target's hidden state read. `past` as in `__call__`."""
        hidden = self.hidden(input_ids, cache, tree, past=past)
        return self.model.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden), hidden

    def layers(
        self, layers: Sequence[torch.nn.Module], hidden: torch.Tensor, cache, tree=None, past: int | None = None
    ) -> torch.Tensor:
        """Decoder `layers` of the target's architecture on (1, n, d) hidden states that continue `cache`; `tree` as
        in `__call__` (its last n rows are these); `past`: the length the slice's first layer holds in `cache`, where
        the caller knows it (compiled steps read it from the device otherwise). Returns their output hidden states."""
        return run_layers(self.model, hidden, layers, cache, tree, self.window)

    def drafter_step(self, fn):
        """`fn`, a drafter's own computation of tensors into one tensor (a draft head's forward), as it runs on
        these steps: as is here; compiled (a graph per input shape) on compiled steps."""
        return fn

    def tree_inputs(self, tree, cache=None) -> dict:
        """The model's attention mask and position ids for a tree verification's `tree` on `cache`; {} for a chain."""
        if tree is None:
            return {}
        allow, positions = tree
        mask = tree_mask(self.model.config, allow, positions, self.window, self.model.dtype, cache)
        return {"attention_mask": mask, "position_ids": positions[None]}


class CompiledSteps(EagerSteps):
    """The target's steps on one reused StaticCache, padded to bucket widths and compiled once per width."""

    compiled = True

    def __init__(
        self,
        model: torch.nn.Module,
        backend: str = "inductor",
        mode: str | None = None,
        widths=DEFAULT_WIDTHS,
        cache_multiple: int = 64,
        guards: str = "all",
        freezing: bool = False,
        row_invariant: bool = False,
    ):
        super().__init__(model)
        if freezing and backend != "inductor":
            raise SpecReproError(f"freezing is inductor's: compiled steps on the {backend} backend cannot freeze")
        # row_invariant: one width, the widest, and one graph for logits and hidden states (module doc)
        self.widths = (max(widths),) if row_invariant else tuple(sorted(widths))
        self.row_invariant = row_invariant
        # positions a cache keeps past the last real one: a padded step writes up to a width there; row-invariant
        # steps leave a drafter that writes ahead (EAGLE's levels, each padded to the width) a width more
        self.spare = self.widths[-1] * (2 if row_invariant else 1)
        self.widest = 0  # the widest step `warm_up` was told of: one past the buckets runs uncompiled on the cache too
        # cache lengths round up to a multiple of this. Every step attends the whole cache under a mask: in fp32 on
        # an H200, a 1024-position cache (a multiple of 512) cost 5.9 ms a token where 576 positions cost 4.7
        self.cache_multiple = cache_multiple
        self.caches: dict[str, StaticCache] = {}  # the target's, and any a drafter keeps for layers of its own
        self.cache_len = 0
        self.options = dict(backend=backend, fullgraph=True, dynamic=False, **({"mode": mode} if mode else {}))
        if freezing:  # torch.compile takes a mode or options, not both: the mode's options join freezing's
            self.options.pop("mode", None)
            self.options["options"] = (torch._inductor.list_mode_options(mode) if mode else {}) | FREEZING_OPTIONS
        self.mode, self.guards, self.freezing = mode, guards, freezing
        self.warmed = False  # every graph a decoding step takes is compiled (`warm_up`)
        # code objects of these steps' own: dynamo counts its recompile limit per code object, and another steps
        # object (a draft model's, a bench arm's) compiles its widths too
        self.forward, self.forward_hidden = self.new_graphs()
        self.variant_graphs: dict[str, tuple] = {}  # a model state's name -> its (forward, forward_hidden)
        self.layer_graphs: dict[tuple[int, ...], tuple] = {}  # a layer slice's ids -> (its layers, its graph)
        self.cudagraphs = mode is not None and "reduce-overhead" in mode

    def compile(self, fn):
        """`fn` under torch.compile with these steps' options. With `guards="differentiating"`, once `warm_up` has
        compiled its graphs a call checks only the guards that tell them apart (torch's `skip_guard_eval_unsafe`
        stance), and a call that would need a graph of its own raises instead of compiling one. With `freezing`,
        the graphs `warm_up` compiles take the weights they read as constants (inductor's freezing, scoped to those
        calls: dynamo then guards on each weight's identity): inductor folds them, so linears reading one input
        (q/k/v, gate/up) run as one matmul and a CPU's weights are prepacked. Each graph keeps its own folded copy
        of the weights, and a weight changed after compiling is not seen."""
        graph = torch.compile(fn, **self.options)
        if self.guards == "all" and not self.freezing:
            return graph

        def call(*inputs):
            if not self.warmed:
                with torch._inductor.config.patch(freezing=self.freezing):
                    return graph(*inputs)
            if self.guards == "all":
                return graph(*inputs)
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return graph(*inputs)

        return call

    def new_graphs(self) -> tuple:
        """A (forward, forward_hidden) pair of compiled graphs; row-invariant steps' forward returns the hidden
        states beside the logits, so `with_hidden` runs the very graph `ar`'s steps do."""
        forward = self._forward_with_hidden if self.row_invariant else self._forward
        return self.compile(own_code(forward)), self.compile(own_code(self._forward_hidden))

    def _forward(self, input_ids, mask, positions, cache):
        return (
            self.model(input_ids, attention_mask=mask, position_ids=positions, logits_to_keep=0, cache=cache).logits,
        )

    def _forward_with_hidden(self, input_ids, mask, positions, cache):
        hidden = self._forward_hidden(input_ids, mask, positions, cache)[0]
        return self.model.lm_head(hidden), hidden

    def _forward_hidden(self, input_ids, mask, positions, cache):
        return (
            decoder_body(self.model)(
                input_ids, attention_mask=mask, position_ids=positions, cache=cache
            ).last_hidden_state,
        )

    def new_cache(self, length: int, name: str = "target", rolls_back: bool = True) -> StaticCache:
        """The static cache of that name, emptied. Every cache has one size, reallocated (new graphs) only when
        `length` outgrows it: a drafter's own cache, asked for after the target's, is as long as the target's. Its
        layers all keep every key (`static_cache`), whether or not the caller rolls back."""
        needed = length + self.room
        if self.cache_len < needed:
            if self.caches:
                log.warning("the static cache grows past %d positions: its graphs are compiled again", self.cache_len)
            self.cache_len, self.caches = self.cache_multiple * -(-needed // self.cache_multiple), {}
            self.warmed = False
            # graphs on fresh code objects: dynamo's recompile limit (8 graphs) counts per code object, and a second
            # graph for each of the 7 default widths on the old ones broke it (a hard failure under fullgraph)
            self.forward, self.forward_hidden = self.new_graphs()
            self.variant_graphs.clear()
            self.layer_graphs.clear()
            p = next(self.model.parameters())
            self.key_positions = torch.arange(self.cache_len, device=p.device)  # what a step's mask compares against
            dtype = self.model.dtype  # the mask's values where allowed and where masked, as `additive_mask` makes them
            self.mask_values = (p.new_zeros((), dtype=dtype), p.new_full((), torch.finfo(dtype).min, dtype=dtype))
        if name in self.caches:
            crop_cache(self.caches[name], 0)  # a write-position reset: stale rows stay masked until overwritten
        else:  # its layers are allocated when first written: a drafter's one-layer cache holds one
            self.caches[name] = static_cache(self.model.config, self.cache_len)
        return self.caches[name]

    def holds(self, length: int) -> bool:
        return bool(self.caches) and length + self.room <= self.cache_len

    @property
    def room(self) -> int:
        """Positions a cache keeps past a generation's length: for the spare and for the widest step's rows."""
        return max(self.spare, self.widest)

    def tree_inputs(self, tree, cache=None) -> dict:
        """An uncompiled tree step's mask, widened to the static cache's length (its keys are all of its rows)."""
        if tree is None:
            return {}
        allow, positions = tree
        wide = allow.new_zeros(allow.shape[0], self.cache_len)
        wide[:, : allow.shape[1]] = allow
        return super().tree_inputs((wide, positions), cache)

    def layers(self, layers, hidden, cache, tree=None, past=None):
        """The slice's compiled graph for the bucket of n rows (hidden states padded with their last row), or, for
        a cache's first rows or a width past the largest bucket, the same layers uncompiled; either way with the
        mask and positions as inputs and only the slice's own layers of `cache` written."""
        layers = tuple(layers)
        indices = [layer.self_attn.layer_idx for layer in layers]
        past = int(cache.get_seq_length(indices[0])) if past is None else past
        n = hidden.shape[1]
        tree = None if tree is None else (tree[0][-n:], tree[1][-n:])
        width = self.bucket(n) if past else None
        if width is None:
            mask, positions = self.padded_mask(past, n, n, tree)
            return apply_layers(self.model, hidden, layers, cache, mask, positions)
        key = tuple(map(id, layers))
        if key not in self.layer_graphs:

            def graph(hidden, mask, positions, cache):
                return (apply_layers(self.model, hidden, layers, cache, mask, positions),)

            self.layer_graphs[key] = (layers, self.compile(own_code(graph)))
        mask, positions = self.padded_mask(past, n, width, tree)
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        out = self.layer_graphs[key][1](pad_rows(hidden, width), mask, positions, cache)[0][:, :n].clone()
        if width > n:  # the padding rows are not part of the sequence
            for index in indices:
                cache.layers[index].crop(n - width)
        return out

    def drafter_step(self, fn):
        """`fn` compiled on a code object of its own (a graph per input shape: a draft head's prefix lengths), under
        CUDA graphs on a GPU; its output is cloned, as CUDA graphs reuse theirs. Warm it up through
        `Decoder.drafter_calls`."""
        graph = self.compile(own_code(fn))

        def step(*inputs: torch.Tensor) -> torch.Tensor:
            if self.cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            return graph(*inputs).clone()

        return step

    def bucket(self, n: int) -> int | None:
        return next((w for w in self.widths if w >= n), None)

    def graphs(self, variant: str | None) -> tuple:
        """(forward, forward_hidden) of the target as it is, or of a model state a caller sets (`variant`): each
        state compiles graphs of its own, traced and run only while it is set."""
        if variant is None:
            return self.forward, self.forward_hidden
        if variant not in self.variant_graphs:
            self.variant_graphs[variant] = self.new_graphs()
        return self.variant_graphs[variant]

    def __call__(self, input_ids, cache, logits_to_keep: int = 0, tree=None, past=None, variant=None):
        outputs = self.padded_step(self.graphs(variant)[0], input_ids, cache, tree, past)
        if outputs is None:  # prefill, or an unbucketed width: uncompiled
            return super().__call__(input_ids, cache, logits_to_keep, tree, past)
        logits = outputs[0]
        return StepOutput(logits[:, -logits_to_keep:] if logits_to_keep else logits)

    def hidden(self, input_ids, cache, tree=None, exact_rows=None, past=None, variant=None):
        """The compiled hidden states (`exact_rows` has no use here: row-invariant compiled steps pad every row);
        the LM head then runs, uncompiled, on the rows a caller reads."""
        outputs = self.padded_step(self.graphs(variant)[1], input_ids, cache, tree, past)
        return super().hidden(input_ids, cache, tree, past=past) if outputs is None else outputs[0]

    def with_hidden(self, input_ids, cache, logits_to_keep: int = 0, tree=None, past=None):
        """Row-invariant: logits and hidden states from the one graph `ar`'s steps run; else as eager steps
        (compiled hidden states, the LM head uncompiled)."""
        outputs = self.padded_step(self.forward, input_ids, cache, tree, past) if self.row_invariant else None
        if outputs is None:
            return super().with_hidden(input_ids, cache, logits_to_keep, tree, past)
        logits, hidden = outputs
        return (logits[:, -logits_to_keep:] if logits_to_keep else logits), hidden

    def padded_step(self, forward, input_ids, cache, tree, past: int | None = None) -> tuple | None:
        """The compiled `forward`'s outputs for the rows of `input_ids`, run padded to a bucket on the static
        cache after `past` positions (default: the first layer's length); None for a prefill (an empty cache) or
        a width past the largest bucket."""
        past = int(cache.get_seq_length()) if past is None else past
        n = input_ids.shape[1]
        width = self.bucket(n)
        if past == 0 or width is None:
            return None
        ids, mask, positions = self.padded_inputs(input_ids, past, width, tree)
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        outputs = tuple(out[:, :n].clone() for out in forward(ids, mask, positions, cache))  # CUDA graphs reuse theirs
        if width > n:  # the padding rows are not part of the sequence
            crop_cache(cache, past + n)
        return outputs

    def padded_inputs(self, input_ids, past: int, width: int, tree):
        """Inputs padded to `width` rows (the last token repeated), with their mask and positions (`padded_mask`)."""
        n = input_ids.shape[1]
        return pad_rows(input_ids, width), *self.padded_mask(past, n, width, tree)

    def padded_mask(self, past: int, n: int, width: int, tree):
        """The (1, 1, width, cache) additive mask and the positions of n rows padded to `width` after `past`
        cached ones: real rows see what they would eagerly (the prefix and, in a tree, their ancestors), padding
        rows continue the sequence causally. A model's sliding layers get a mask of their own that also hides the
        keys a window or more behind a row (`local_masks`)."""
        # three ops for a chain step (a view into key_positions would save one, but dynamo specializes a graph input
        # on its storage offset: a graph per position)
        positions = self.key_positions[:width] + past
        allow = self.key_positions[None] <= positions[:, None]
        if tree is not None:
            tree_allow, tree_positions = tree
            allow[:n, : tree_allow.shape[1]] = tree_allow
            allow[:n, tree_allow.shape[1] :] = False
            positions = torch.cat([tree_positions, positions[n:]])
        mask = torch.where(allow, *self.mask_values)[None, None]
        if self.window is not None:  # a key's position is its index: a step's own rows are nearer than the window

            def to_mask(seen):
                return torch.where(seen, *self.mask_values)[None, None]

            mask = local_masks(self.model.config, allow, positions, self.key_positions, to_mask)
        return mask, positions[None]

    def check_head(self, input_ids: torch.Tensor) -> None:
        """Row-invariant steps read logits as the LM head of the last hidden states: refuse a model whose own
        forward computes them otherwise (a soft-cap, a scale), which would change every method's output unseen."""
        if not logits_are_head_of_hidden(self.model, input_ids):
            raise SpecReproError(
                f"hardware.row_invariant on compiled steps needs logits = lm_head(last hidden states); "
                f"{type(self.model).__name__} computes them otherwise: set hardware.row_invariant=false"
            )

    def warm_up(self, max_width: int, length: int, hidden: bool = False, slices=(), variants=(), calls=()) -> float:
        """Compile every bucket up to `max_width` rows (and, with `hidden`, the forward that returns hidden
        states instead of logits; for each (cache name, layers) of `slices`, that layer slice; for each (name,
        state, hidden) of `variants`, the one-token step in that model state; for each (drafter step, inputs) of
        `calls`, that step on those inputs) on caches of `length` positions, outside any timed region; returns
        the seconds it took (the record's `compile_time`)."""
        start = time.perf_counter()
        self.warmed = False
        self.widest = max(self.widest, max_width)
        cache = self.new_cache(length)
        device = next(self.model.parameters()).device
        if self.window is not None and self.window <= self.room:
            raise SpecReproError(
                f"compiled steps take a key's cache index for its position, which a step's {self.room} spare rows "
                f"could move past {self.model.config.model_type}'s attention window of {self.window}: run with "
                "hardware.compile=false"
            )
        if self.row_invariant and max_width > self.widths[-1]:
            raise SpecReproError(
                f"hardware.row_invariant pads every compiled step to one width, {self.widths[-1]}, but this method's "
                f"steps take up to {max_width} rows: give hardware.compile_widths=[{max_width}] (or wider)"
            )
        largest = self.bucket(max_width) or self.widths[-1]  # wider steps run uncompiled
        widths = [w for w in self.widths if w <= largest]
        with torch.inference_mode():
            super().__call__(torch.zeros(1, 1, dtype=torch.long, device=device), cache, 1)  # eager prefill
            if self.row_invariant:
                self.check_head(torch.zeros(1, 1, dtype=torch.long, device=device))
            for step in (self, self.hidden) if hidden else (self,):
                for width in widths:
                    for _ in range(2):  # CUDA graphs record on the second call
                        step(torch.zeros(1, width, dtype=torch.long, device=device), cache)
                        crop_cache(cache, 1)
            rows = torch.zeros(1, 1, self.model.config.hidden_size, dtype=self.model.dtype, device=device)
            for name, layers in slices:  # every cache keeps one row until the end: the steps after it are compiled
                own = cache if name == "target" else self.new_cache(length, name)
                if not int(own.get_seq_length(layers[0].self_attn.layer_idx)):
                    self.layers(layers, rows, own)  # uncompiled: a first row for the others to follow
                for width in widths:
                    for _ in range(2):
                        self.layers(layers, rows.expand(1, width, -1), own)
                        crop_cache(own, 1)
            for name, state, reads_hidden in variants:  # drafts in a model state of their own: one token a step
                step = self.hidden if reads_hidden else self
                with state():
                    for _ in range(2):
                        step(torch.zeros(1, 1, dtype=torch.long, device=device), cache, variant=name)
                        crop_cache(cache, 1)
            for (
                step,
                inputs,
            ) in calls:  # a drafter's own graphs, one per input shape, on inference tensors as decoding's
                for _ in range(2):
                    step(*(x.clone() for x in inputs))
            for own in self.caches.values():
                crop_cache(own, 0)
        self.warmed = True
        device_sync(self.model.device)  # the warm-up's last kernels ran: its seconds are all of it
        return time.perf_counter() - start


def attention_window(config) -> int | None:
    """The fewest past positions a layer of the model may attend (a sliding window: Mistral's, Gemma's local layers;
    or Llama 4's attention chunks), None where every layer attends them all."""
    layers = DynamicCache(config=config).layers
    return min((layer.sliding_window for layer in layers if isinstance(layer, DynamicSlidingWindowLayer)), default=None)


def rollback_cache(config) -> DynamicCache:
    """A DynamicCache a decoder can crop rejected drafts off. transformers' sliding-window layer (Mistral's, Gemma's
    local layers, Llama 4's chunked ones) keeps only the last keys its window reaches, which a rollback can need back;
    here each one records its past (`activate_past_recording`): a step's keys stay until `verify.crop_cache` drops the
    rejected ones and trims the layer to its window again. Such a layer gives a step only the keys its window reaches
    (and transformers' chain masks only their columns); a tree's mask keeps only theirs too (`held_columns`)."""
    cache = DynamicCache(config=config)
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.activate_past_recording()
    return cache


def layer_kinds(config) -> list[str]:
    """Each layer's attention type, as transformers' caches read them: the config's `layer_types`, else every layer
    sliding where the config has a window (Mistral's), else full."""
    if types := getattr(config, "layer_types", None):
        return list(types)
    kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    return [kind] * config.num_hidden_layers


def layer_kind(config, layer) -> str:
    """Decoder `layer`'s attention type: its attention's own (Qwen2's, Gemma's, which a copy of the layer keeps), else
    the model's for its index."""
    return getattr(layer.self_attn, "layer_type", None) or layer_kinds(config)[layer.self_attn.layer_idx]


def local_masks(config, allow: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, to_mask):
    """`to_mask(allowed keys)` for each layer type of the model: a sliding layer hides the keys a window or more
    positions before a row (`sliding_window`), a chunked one (Llama 4's) those in another chunk of its
    `attention_chunk_size` positions. `allow` (rows, keys) holds what every layer may see, `rows` and `keys` their
    positions. One mask where every layer is of one type (Mistral's), else one per type (a dict, as Qwen2, Gemma and
    Llama 4 take it)."""
    kinds = layer_kinds(config)
    masks = {}
    for kind in dict.fromkeys(kinds):
        seen = allow
        if kind == "sliding_attention":
            seen = allow & (rows[:, None] - keys[None] < config.sliding_window)
        elif kind == "chunked_attention":
            chunk = config.attention_chunk_size
            seen = allow & (rows[:, None] // chunk == keys[None] // chunk)
        masks[kind] = to_mask(seen)
    return masks if getattr(config, "layer_types", None) else masks[kinds[0]]


def tree_mask(config, allow: torch.Tensor, positions: torch.Tensor, window: int | None, dtype, cache=None, rows=None):
    """transformers' attention_mask for the rows of a tree step: `allow` (rows, keys), the keys each row sees
    (`verify.tree_attention`: the cache's, then the rows'), `positions` (rows,) theirs. On a model with local layers
    (a `window`: sliding or chunked), those layers see only the keys their window leaves (`local_masks`), and their
    masks only the columns of the keys `cache` gives the forward (`held_columns`); `rows`: how many of the last rows
    the forward runs (default: all)."""
    if window is None:
        return additive_mask(allow, dtype)
    keys = torch.cat([torch.arange(allow.shape[1] - len(positions), device=positions.device), positions])
    masks = local_masks(config, allow, positions, keys, lambda seen: additive_mask(seen, dtype))
    return held_columns(config, masks, allow.shape[1] - (len(positions) if rows is None else rows), cache)


def held_columns(config, masks, past: int, cache):
    """Each local layer type's mask (`local_masks`) cut to the keys its layers of `cache` give a forward after `past`
    cached positions, where they are transformers' sliding layers (`rollback_cache`'s, not a static cache's full
    ones): the last window - 1 (as its `get_mask_sizes` counts them), then the forward's own. A row at position p or
    more sees no key before p - window + 1, in a window or in a chunk."""
    sizes = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}
    layers = cache.layers if cache is not None else ()
    held = {kind for kind, layer in zip(layer_kinds(config), layers) if isinstance(layer, DynamicSlidingWindowLayer)}

    def cut(kind: str, mask: torch.Tensor) -> torch.Tensor:
        size = getattr(config, sizes[kind]) if kind in held else None
        return mask[..., max(past - size + 1, 0) :] if size else mask

    if isinstance(masks, dict):
        return {kind: cut(kind, mask) for kind, mask in masks.items()}
    return cut(layer_kinds(config)[0], masks)


def decoder_body(model):
    """The model's decoder without its LM head, whose output's `last_hidden_state` the head reads: its `base_model`,
    or its `model` where that names the model itself (Llama 4's text model, whose prefix names the multimodal one's
    language model)."""
    body = model.base_model
    return getattr(model, "model", body) if body is model else body


def logits_are_head_of_hidden(model, input_ids: torch.Tensor | None = None) -> bool:
    """Whether the model's logits are its LM head on its last hidden states, bit for bit, on `input_ids` (default:
    four tokens). Gemma 2 soft-caps them, Granite and Cohere scale them: the argmax stays, the probabilities move."""
    if input_ids is None:
        input_ids = torch.arange(4, device=next(model.parameters()).device)[None] % model.config.vocab_size
    with torch.inference_mode():
        return torch.equal(model.lm_head(decoder_body(model)(input_ids).last_hidden_state), model(input_ids).logits)


def refuse_other_logits(model, method: str) -> None:
    """Refuse `method`, which verifies on the LM head of the target's hidden states, for a model whose logits are
    computed otherwise: its speculative sampling would keep another distribution than the target's, or that names
    its head otherwise (BioGPT's `output_projection`)."""
    if not isinstance(getattr(model, "lm_head", None), torch.nn.Module):
        raise SpecReproError(
            f"method '{method}' verifies drafts on the target's `lm_head`, which {model.config.model_type} models "
            "do not have: run another method"
        )
    if not logits_are_head_of_hidden(model):
        raise SpecReproError(
            f"method '{method}' verifies drafts on lm_head(the target's last hidden states), but "
            f"{model.config.model_type} models compute their logits otherwise (a soft-cap or a scale), so its "
            "probabilities would not be the target's: run another method"
        )


def recurrent_layers(config) -> int:
    """How many of the model's layers keep a recurrent state (linear attention or a convolution: LFM2's, Qwen3-Next's),
    which cropping the cache does not roll back: a rejected draft would stay in it."""
    return sum(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in DynamicCache(config=config).layers)


ROLLED_BACK_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, DynamicIndexedLayer)  # what `verify` rolls back


def unknown_layers(config) -> list[str]:
    """The classes of the model's cache layers, other than recurrent ones, that `verify.crop_cache` and
    `verify.keep_tree_path` do not know how to roll back: a subclass with state of its own (DeepSeek-V4's compressed
    keys, which kept rejected drafts: its lookahead and jacobi diverged from `ar`)."""
    layers = DynamicCache(config=config).layers
    return sorted(
        {
            type(layer).__name__
            for layer in layers
            if type(layer) not in ROLLED_BACK_LAYERS and not isinstance(layer, LinearAttentionCacheLayerMixin)
        }
    )


def probe_ids(model) -> torch.Tensor:
    """Four token ids for a protocol probe, on the model's device."""
    return (torch.tensor([[3, 7, 11, 5]]) % model.config.vocab_size).to(next(model.parameters()).device)


def agree(logits: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether two forwards' logits of one row agree within their dtype's rounding (a relative 1e-3 of the largest in
    float32, 5e-2 in half precision: a row computed beside others rounds otherwise than alone)."""
    tolerance = 1e-3 if expected.dtype == torch.float32 else 5e-2
    expected = expected.float()
    return bool((logits.float() - expected).abs().max() <= tolerance * expected.abs().max().clamp_min(1e-6))


@torch.no_grad()
def stepping_problem(model) -> str | None:
    """Why `model` does not decode as every decoder steps it, or None: a forward of three tokens on a DynamicCache, then
    one of the fourth, must give the fourth's logits of one forward of all four. RWKV keeps its state in an argument
    of its own and ignores the cache (`ar` decoded every step without its context), CPM-Ant takes its whole input at
    every step, MiniMax and xLSTM need caches of their own."""
    ids = probe_ids(model)
    try:
        expected = model(ids).logits[0, -1]
        cache = DynamicCache(config=model.config)
        model(ids[:, :3], cache=cache)
        stepped = model(ids[:, 3:], cache=cache).logits[0, -1]
    except Exception as exc:  # any failure here is every decoder's: said in one line by the caller
        return f"a step on a DynamicCache stopped in {type(exc).__name__}"
    if not agree(stepped, expected):
        return "a step on a DynamicCache does not give the logits of one forward over the same tokens"
    return None


@torch.no_grad()
def tree_problem(model) -> str | None:
    """Why `model` does not verify a token tree as it would a chain, or None: two sibling rows at one position after
    the last committed token (`verify.tree_attention`), each seeing the cache and that token, must give the logits
    the second gets in a chain. MPT and BLOOM place a key by its slot in the cache (ALiBi), not by the position a
    tree gives it (MPT's trees diverged from `ar`), and openai-gpt takes no 4-D mask."""
    ids = probe_ids(model)
    sibling = (ids[:, 3:] + 1) % model.config.vocab_size
    try:
        expected = model(ids).logits[0, -1]
        cache = rollback_cache(model.config)
        model(ids[:, :2], cache=cache)
        allow, positions = tree_attention([-1, -1], 2)
        rows = torch.cat([ids[:, 2:3], sibling, ids[:, 3:]], dim=1)
        tree = EagerSteps(model)(rows, cache, tree=(allow.to(ids.device), positions.to(ids.device))).logits[0, -1]
    except Exception as exc:  # any failure here is every tree's: said in one line by the caller
        return f"a tree step stopped in {type(exc).__name__}"
    if not agree(tree, expected):
        return "a tree node's logits differ from a chain's at its position (its keys are placed by cache slot)"
    return None


_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {probe: its problem or None}


def protocol_problem(model, probe) -> str | None:
    """`probe(model)`, found once per model (`stepping_problem`, `tree_problem`)."""
    found = _PROBED.setdefault(model, {})
    if probe.__name__ not in found:
        found[probe.__name__] = probe(model)
    return found[probe.__name__]


def static_cache(config, length: int) -> StaticCache:
    """A StaticCache of `length` positions whose layers are all full ones. transformers' static sliding-window layer
    (Mistral's, Gemma's local ones) keeps its length as a Python int, which a compiled graph guards on: a graph per
    position, until dynamo's recompile limit stops the run; and it drops keys a rollback returns to. The steps' masks
    apply the window instead (`CompiledSteps.padded_mask`). They take a key's cache index for its position, which a
    tree's rows can carry across a chunk's edge: a chunked layer (Llama 4's) shorter than the cache is refused."""
    cache = StaticCache(config=config, max_cache_len=length)
    for index, (layer, kind) in enumerate(zip(cache.layers, layer_kinds(config))):
        if getattr(layer, "is_sliding", False):
            if kind == "chunked_attention" and config.attention_chunk_size < length:
                raise SpecReproError(
                    f"hardware.compile's static cache of {length} positions (the longest prompt and the budget, "
                    f"rounded up) is longer than {config.model_type}'s attention chunks of "
                    f"{config.attention_chunk_size} tokens, which compiled steps cannot mask: run with "
                    "hardware.compile=false"
                )
            cache.layers[index] = StaticLayer(max_cache_len=length)
    return cache


def own_code(fn):
    """`fn` (a function or bound method) with a code object of its own: dynamo allows `recompile_limit` graphs
    (one per width) per code object, so each family of graphs (a layer slice, a model state) gets its own."""
    func = getattr(fn, "__func__", fn)
    copy = types.FunctionType(
        func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__, func.__closure__
    )
    return types.MethodType(copy, fn.__self__) if hasattr(fn, "__self__") else copy


def pad_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """(1, n, ...) token ids or hidden states padded to `width` rows by repeating the last, in a tensor of their own
    (a graph's input: dynamo specializes on its strides, which a caller's slice would carry)."""
    return torch.cat([x, x[:, -1:].expand(-1, width - x.shape[1], *x.shape[2:])], dim=1)


def run_layers(model, hidden: torch.Tensor, layers, cache, tree=None, window: int | None = None) -> torch.Tensor:
    """Run decoder `layers` of `model`'s architecture on (1, T, d) hidden states that continue `cache`, eagerly.

    What LlamaModel.forward does for its layers: positions follow the cache length of the first layer's cache
    slot (`layer_idx`), the causal mask is sized against that layer (layers may hold different lengths: a drafter
    that runs only the first layers writes only theirs), and rotary embeddings come from the model's `rotary_emb`.
    `tree` (allowed keys, positions) of a tree verification (`verify.tree_attention`) replaces the causal mask and
    positions; its last T rows are these. `window`: the model's `attention_window`, where its local layers' masks
    (`local_masks`) hide keys.
    """
    rows = hidden.shape[1]
    if tree is not None:
        allow, positions = tree
        mask = tree_mask(model.config, allow, positions, window, hidden.dtype, cache, rows)
        mask = {kind: m[..., -rows:, :] for kind, m in mask.items()} if isinstance(mask, dict) else mask[..., -rows:, :]
        return apply_layers(model, hidden, layers, cache, mask, positions[-rows:].unsqueeze(0))
    first = layers[0].self_attn.layer_idx
    past = cache.get_seq_length(first) if cache is not None else 0
    position_ids = torch.arange(past, past + rows, device=hidden.device).unsqueeze(0)
    masks = dict(
        config=model.config,
        inputs_embeds=hidden,
        attention_mask=None,
        cache=cache,
        position_ids=position_ids,
    )
    if window is None:
        return apply_layers(model, hidden, layers, cache, create_causal_mask(**masks, layer_idx=first), position_ids)
    made = {"sliding_attention": create_sliding_window_causal_mask, "chunked_attention": create_chunked_causal_mask}
    firsts = {}  # each layer type's first layer here, whose cache sizes its mask (a local layer's holds its window)
    for layer in layers:
        firsts.setdefault(layer_kind(model.config, layer), layer.self_attn.layer_idx)
    mask = {kind: made.get(kind, create_causal_mask)(**masks, layer_idx=index) for kind, index in firsts.items()}
    return apply_layers(model, hidden, layers, cache, mask, position_ids)


def apply_layers(model, hidden: torch.Tensor, layers, cache, mask, position_ids) -> torch.Tensor:
    """Decoder `layers` on `hidden` with a given attention mask (or one per layer type: `tree_mask`) and positions
    (the loop of LlamaModel.forward)."""
    rope = model.model.rotary_emb(hidden, position_ids=position_ids)
    for layer in layers:
        hidden = layer(
            hidden,
            attention_mask=mask[layer_kind(model.config, layer)] if isinstance(mask, dict) else mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=rope,
        )
    return hidden


def target_steps(model: torch.nn.Module) -> EagerSteps:
    """The steps a decoder runs `model`'s forwards with: compiled ones if the loader attached them, else eager."""
    return getattr(model, STEPS_ATTRIBUTE, None) or EagerSteps(model)


def compile_steps(model: torch.nn.Module, hardware) -> None:
    """Attach compiled steps for `hardware.compile` to `model` (and to no other model)."""
    mode = hardware.compile_mode or ("reduce-overhead" if next(model.parameters()).device.type == "cuda" else None)
    steps = CompiledSteps(
        model,
        hardware.compile_backend,
        mode,
        hardware.compile_widths,
        guards=hardware.compile_guards,
        freezing=hardware.compile_freezing,
        row_invariant=hardware.row_invariant,
    )
    setattr(model, STEPS_ATTRIBUTE, steps)
