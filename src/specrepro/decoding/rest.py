"""`rest`: REST (He et al., 2024, "REST: Retrieval-Based Speculative Decoding"): draft a token tree from the
continuations that followed the context's longest suffix in a datastore of responses.

Training-free; the datastore is built once (`specrepro train method=rest`, training/rest_datastore.py) and loaded
as an artifact. It is one token array, the documents (responses) one after the other, each followed by a separator
(-1), with its suffix array (section 3.1, the datastore; exact-match retrieval over it as REST's DraftRetriever,
whose Writer.add_entry joins the documents with no separator: there a match or continuation may cross into the next).

Drafting, every step:
- retrieval (section 3.2): the longest suffix of the context, at most `max_suffix` tokens (n_max, REST's 16) and
  at least `min_suffix` (2, where REST's spans end), that occurs in the datastore; its occurrences are one range of
  the suffix array, found by binary search (an occurring suffix's own suffixes occur too, so the longest is also a
  binary search over lengths, where REST tries 16, 15, ... in turn: the same suffix);
- the continuations: the `continuation` tokens (m, REST's 10) after up to `matches` occurrences (REST's 5,000; a
  continuation stops at its document's end);
- the draft (section 3.3): the continuations merged into a trie whose node weight is how many continuations pass
  through it; the `tree_nodes` heaviest nodes (c, REST's 64) are the draft tree (a node weighs at least its
  children, so the heaviest nodes, ties broken shallow first, always form a trie).
The tree is verified (section 3.4) in one forward by the shared `tree_attention` and `tree_verify` (greedy: the
longest path the target's argmax follows; sampling: one speculative stage per child, every node a deterministic
draft), so the output is the target's whatever the datastore holds. Its nodes are placed depth first, the heaviest
child first, so nodes 0, 1, ... are the most frequent continuation (the main chain the step records count).

Beyond the paper, and labelled so in the presets:
- where a suffix has more than `matches` occurrences, REST's retriever reads the first ones in suffix-array order;
  here `matches` occurrences evenly spaced over the range (the same cost; their counts stand for the whole range);
- `prompt_lookup` (the `rest_pld` preset): first look the last n-gram up in the prompt and the output so far, as
  `pld` does (decoding/pld.py's `lookup_ngram`), and draft its continuation as the main chain; the datastore's trie
  fills the rest of the `tree_nodes` (a node that repeats a chain node merges into it), so with no match in the
  context the draft is REST's alone. SAM-Decoding (Hu et al., 2024, "SAM Decoding: Speculative Decoding via Suffix
  Automaton") drafts from such a local source and a corpus alike.

The suffix array is built by pydivsufsort (libdivsufsort's Python binding, MIT, manylinux wheels with no build
step): a well-kept O(n log n) suffix sorter that takes an int32 token array as its alphabet directly, 8M tokens
in about a second here; numpy alone has no suffix sort, and a Python one would take minutes for a datastore.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from specrepro.decoding.device import upload
from specrepro.decoding.controllers import DraftLengthController, FixedLength
from specrepro.decoding.draft_verify import DraftVerifyDecoder, Proposal
from specrepro.decoding.pld import lookup_ngram
from specrepro.decoding.sampling import Sampling
from specrepro.errors import SpecReproError
from specrepro.registry import MethodConfig, register_method

SEPARATOR = -1  # after every document: a continuation stops there, and no match spans two documents
SETTINGS_FILE, TOKENS_FILE, SUFFIXES_FILE = "datastore.json", "tokens.npy", "suffixes.npy"


@dataclass
class RestConfig(MethodConfig):
    name: str = "rest"
    datastore: str = "rest_datastore"  # the datastore artifact (the newest built for the run's model)
    max_suffix: int = 16  # n_max: the longest context suffix looked up (section 3.2)
    min_suffix: int = 2  # the shortest (REST's spans end at 2)
    matches: int = 5000  # occurrences whose continuations are read (REST's retriever: 5,000)
    continuation: int = 10  # m: tokens read after each occurrence, the tree's depth (REST's 10)
    tree_nodes: int = 64  # c: the trie's heaviest nodes drafted (section 3.3; REST's 64)
    prompt_lookup: bool = False  # beyond the paper: pld's chain from prompt + output first, the datastore's trie after
    max_ngram: int = 3  # prompt_lookup's n-grams, longest first (pld's defaults)
    min_ngram: int = 1

    def __post_init__(self):
        self.require(self.min_suffix >= 1, "min_suffix", ">= 1")
        self.require(self.max_suffix >= self.min_suffix, "max_suffix", f">= min_suffix ({self.min_suffix})")
        self.require(self.matches >= 1, "matches", ">= 1")
        self.require(self.continuation >= 1, "continuation", ">= 1")
        self.require(self.tree_nodes >= 1, "tree_nodes", ">= 1")
        self.require(self.max_ngram >= 1, "max_ngram", ">= 1")
        self.require(1 <= self.min_ngram <= self.max_ngram, "min_ngram", f"between 1 and max_ngram ({self.max_ngram})")


class _SuffixPrefixes:
    """The suffix array's suffixes cut to `width` tokens, as lists: a sorted sequence `bisect` can search."""

    def __init__(self, tokens: np.ndarray, suffixes: np.ndarray, width: int):
        self.tokens, self.suffixes, self.width = tokens, suffixes, width

    def __len__(self) -> int:
        return len(self.suffixes)

    def __getitem__(self, index: int) -> list[int]:
        start = int(self.suffixes[index])
        return self.tokens[start : start + self.width].tolist()


class Datastore:
    """REST's datastore: the documents' tokens, separated, and their suffix array (module docstring)."""

    def __init__(self, tokens: np.ndarray, suffixes: np.ndarray, settings: dict):
        self.tokens, self.suffixes, self.settings = tokens, suffixes, settings

    @classmethod
    def build(cls, documents: Iterable[list[int]], settings: dict | None = None) -> "Datastore":
        """The datastore of `documents` (token id lists; empty ones are left out)."""
        from pydivsufsort import divsufsort

        pieces = [np.asarray(doc + [SEPARATOR], dtype=np.int32) for doc in documents if doc]
        if not pieces:
            raise SpecReproError("the datastore's corpus gave no document")
        tokens = np.concatenate(pieces)
        suffixes = divsufsort(tokens).astype(np.int32)
        return cls(tokens, suffixes, {**(settings or {}), "documents": len(pieces), "tokens": int(len(tokens))})

    @property
    def nbytes(self) -> int:
        return int(self.tokens.nbytes + self.suffixes.nbytes)

    def save_pretrained(self, directory: Path) -> None:
        np.save(Path(directory) / TOKENS_FILE, self.tokens)
        np.save(Path(directory) / SUFFIXES_FILE, self.suffixes)
        (Path(directory) / SETTINGS_FILE).write_text(json.dumps(self.settings, indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, directory: Path, vocab_size: int | None = None) -> "Datastore":
        """Load a saved datastore (its arrays memory-mapped); refuse one with tokens outside `vocab_size`."""
        settings = json.loads((Path(directory) / SETTINGS_FILE).read_text())
        if vocab_size is not None and settings.get("vocab_size", 0) > vocab_size:
            raise SpecReproError(
                f"the datastore {Path(directory).name} was built for a vocabulary of "
                f"{settings['vocab_size']} tokens, this target has {vocab_size}"
            )
        # memory-mapped (processes share the pages), as plain arrays: a memmap's indexing costs ten times more
        return cls(
            np.asarray(np.load(Path(directory) / TOKENS_FILE, mmap_mode="r")),
            np.asarray(np.load(Path(directory) / SUFFIXES_FILE, mmap_mode="r")),
            settings,
        )

    def occurrences(self, pattern: list[int]) -> tuple[int, int]:
        """The range [lo, hi) of the suffix array whose suffixes start with `pattern`."""
        import bisect

        prefixes = _SuffixPrefixes(self.tokens, self.suffixes, len(pattern))
        lo = bisect.bisect_left(prefixes, pattern)
        return lo, bisect.bisect_right(prefixes, pattern, lo=lo)

    def longest_suffix(self, context: list[int], max_suffix: int, min_suffix: int) -> tuple[int, int, int]:
        """(n, lo, hi): the longest suffix of `context` of min_suffix..max_suffix tokens that occurs (Sec. 3.2), and
        its occurrences; n = 0 when none does. Binary search over n: an occurring suffix's suffixes occur too."""
        found = (0, 0, 0)
        low, high = min_suffix, min(max_suffix, len(context))
        while low <= high:
            n = (low + high) // 2
            lo, hi = self.occurrences(context[-n:])
            if hi > lo:
                found, low = (n, lo, hi), n + 1
            else:
                high = n - 1
        return found

    def continuations(self, n: int, lo: int, hi: int, matches: int, length: int) -> np.ndarray:
        """(rows, length) the tokens after up to `matches` occurrences of an n-token suffix (suffix-array range lo..hi,
        evenly spaced when more), in suffix-array order; SEPARATOR from a document's end on."""
        picked = (
            self.suffixes[lo:hi]
            if hi - lo <= matches
            else self.suffixes[np.linspace(lo, hi - 1, matches).astype(np.int64)]
        )
        index = np.minimum(picked.astype(np.int64)[:, None] + n + np.arange(length), len(self.tokens) - 1)
        rows = self.tokens[index]
        ended = np.logical_or.accumulate(rows == SEPARATOR, axis=1)  # the last token is a separator: never past it
        rows[ended] = SEPARATOR
        return rows


def frequent_trie(rows: np.ndarray, nodes: int) -> tuple[list[int], list[int]]:
    """The `nodes` heaviest nodes of the trie of `rows` (sorted continuations, SEPARATOR-padded), a node's weight the
    number of rows through it (Sec. 3.3), ties shallow first: (tokens, parents) depth first, heaviest child first."""
    count, width = rows.shape
    if not count or not width:
        return [], []
    # a sorted row starts a new prefix of length d + 1 where it differs from the row above at depth <= d
    starts_here = np.ones((count, width), dtype=bool)
    starts_here[1:] = np.logical_or.accumulate(rows[1:] != rows[:-1], axis=1)
    groups = []  # per depth: (first rows, weights, tokens, index of the parent in the depth above's groups)
    for depth in range(width):
        first = np.flatnonzero(starts_here[:, depth])
        weight = np.diff(np.append(first, count))
        parent = np.searchsorted(groups[-1][0], first, side="right") - 1 if groups else np.full(len(first), -1)
        groups.append((first, weight, rows[first, depth], parent))
    depth_of = np.concatenate([np.full(len(g[0]), d) for d, g in enumerate(groups)])
    weight = np.concatenate([g[1] for g in groups])
    token = np.concatenate([g[2] for g in groups])
    offsets = np.cumsum([0] + [len(g[0]) for g in groups])
    parent = np.concatenate([g[3] + offsets[d - 1] if d else g[3] for d, g in enumerate(groups)])  # global indices
    real = np.flatnonzero(token != SEPARATOR)
    kept = real[np.lexsort((depth_of[real], -weight[real]))[:nodes]]  # heaviest first, ties shallow first
    children: dict[int, list[int]] = {}
    for node in kept.tolist():  # in weight order: each node's children, heaviest first
        children.setdefault(int(parent[node]), []).append(node)
    tokens, parents = [], []
    stack = [(node, -1) for node in reversed(children.get(-1, []))]
    while stack:
        node, drafted_parent = stack.pop()
        parents.append(drafted_parent)
        tokens.append(int(token[node]))
        here = len(tokens) - 1
        stack.extend((child, here) for child in reversed(children.get(node, [])))
    return tokens, parents


def merge_into_trie(chain: list[int], tokens: list[int], parents: list[int], nodes: int) -> tuple[list[int], list[int]]:
    """The `chain` (nodes 0, 1, ...) and then the tree (tokens, parents) as one trie of at most `nodes` nodes: a node
    that repeats one already placed (same parent, same token) merges into it, and a node left out leaves out its
    subtree."""
    placed: dict[tuple[int, int], int] = {}
    merged_tokens: list[int] = []
    merged_parents: list[int] = []

    def place(parent: int | None, token: int) -> int | None:
        if parent is None:
            return None
        if (parent, token) not in placed:
            if len(merged_tokens) == nodes:
                return None
            placed[(parent, token)] = len(merged_tokens)
            merged_tokens.append(token)
            merged_parents.append(parent)
        return placed[(parent, token)]

    node = -1
    for token in chain:
        node = place(node, token)
    where: list[int | None] = []  # each tree node's place in the trie
    for token, parent in zip(tokens, parents):
        where.append(place(-1 if parent < 0 else where[parent], token))
    return merged_tokens, merged_parents


def find_datastore(ref: str, artifacts_dir, target) -> Path:
    """The newest complete `<ref>` / `<ref>-<model>-*` datastore artifact built for `target` (a model's name or
    identity)."""
    from specrepro.training.artifacts import find_matching_artifact

    path = find_matching_artifact(ref, artifacts_dir, target, lambda p: (p / SETTINGS_FILE).is_file())
    if path is None:
        model_name = target if isinstance(target, str) else target.get("name")
        raise SpecReproError(
            f"no REST datastore '{ref}' for model {model_name} under {artifacts_dir}: build one with "
            "`specrepro train method=rest` and this run's model options"
        )
    return path


@register_method(RestConfig)
class RestDecoder(DraftVerifyDecoder):
    name = "rest"
    compilable = True
    code_modules = ("specrepro.decoding.pld",)  # its lookup drafts rest_pld's chain

    def __init__(self, model, tokenizer, datastore: Datastore, cfg: RestConfig, steps=None):
        super().__init__(model, tokenizer, steps)
        self.datastore, self.cfg = datastore, cfg

    @classmethod
    def resolve_artifacts(cls, cfg: RestConfig, target, artifacts_dir) -> dict[str, Path]:
        return {"datastore": find_datastore(cfg.datastore, artifacts_dir, target)}

    @classmethod
    def from_config(cls, cfg: RestConfig, target, ctx) -> "RestDecoder":
        path = find_datastore(cfg.datastore, ctx.artifacts_dir, target.identity)
        vocab = target.model.get_output_embeddings().weight.shape[0]
        return cls(target.model, target.tokenizer, Datastore.from_pretrained(path, vocab), cfg)

    def new_controller(self) -> DraftLengthController:
        return FixedLength(self.cfg.continuation)  # the tree's depth; the loop caps it at the budget

    @property
    def verifies_trees(self) -> bool:
        return True

    @property
    def max_step_width(self) -> int:
        return 1 + self.cfg.tree_nodes

    def propose(self, state, tokens, k, sampling: Sampling, rng, controller) -> Proposal:
        drafts, parents = [], []
        history = tokens[0].cpu().numpy()
        context = history[-self.cfg.max_suffix :].tolist()
        n, lo, hi = self.datastore.longest_suffix(context, self.cfg.max_suffix, self.cfg.min_suffix)  # Sec. 3.2
        if n:
            rows = self.datastore.continuations(n, lo, hi, self.cfg.matches, min(k, self.cfg.continuation))
            drafts, parents = frequent_trie(rows, self.cfg.tree_nodes)  # Sec. 3.3
        if self.cfg.prompt_lookup:  # beyond the paper: the prompt and the output so far first (pld, SAM-Decoding)
            chain = lookup_ngram(
                history, self.cfg.max_ngram, self.cfg.min_ngram, min(k, self.cfg.continuation), "latest"
            )
            drafts, parents = merge_into_trie(chain, drafts, parents, self.cfg.tree_nodes)
        if not drafts:
            return Proposal(tokens.new_empty(0))
        return Proposal(upload(drafts, tokens.device), None, parents)  # deterministic drafts: q is one-hot on each
