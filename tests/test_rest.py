"""REST: the datastore (suffix array, retrieval), the frequency trie, its build from a corpus and the refusal of
leaderboard text, and losslessness on tiny LLaMAs."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from specrepro import decoding
from specrepro.data import load_records
from specrepro.data.config import DatasetConfig
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.rest import SEPARATOR, Datastore, RestConfig, RestDecoder, frequent_trie, merge_into_trie
from specrepro.decoding.sampling import Sampling
from specrepro.errors import SpecReproError
from specrepro.training.rest_datastore import RestDatastoreConfig, build_rest_datastore, corpus_documents
from tests.test_decoding import prompts
from tests.conftest import greedy_beside_ar
from tests.test_runner import run_dirs, specrepro
from tests.test_lossless_sampling import PROMPT, VOCAB, exact, models, p_value  # noqa: F401  (module fixtures)

GREEDY = Sampling()
# one category keeps the check fast; its questions (news articles) are long enough to quote (data/overlap.py's passages)
QUESTIONS = DatasetConfig(
    name="spec_bench", path="spec_bench/question.jsonl.gz", task="spec_bench", category="summarization"
)


def test_the_suffix_array_finds_every_occurrence_and_the_longest_suffix():
    store = Datastore.build([[1, 2, 3, 4], [1, 2, 3, 5], [], [1, 2, 6], [9, 1, 2, 3, 4, 7]])
    assert store.settings["documents"] == 4 and store.tokens.tolist().count(SEPARATOR) == 4  # the empty one left out
    suffixes = [store.tokens[s:].tolist() for s in store.suffixes]
    assert suffixes == sorted(suffixes)
    lo, hi = store.occurrences([1, 2, 3])
    assert sorted(store.suffixes[lo:hi].tolist()) == [0, 5, 15]
    assert store.longest_suffix([8, 9, 1, 2], 16, 1)[0] == 3  # 9 1 2 occurs; 8 9 1 2 does not
    assert store.longest_suffix([5, 1, 2], 16, 1)[0] == 2 and store.longest_suffix([5, 1, 2], 1, 1)[0] == 1
    assert store.longest_suffix([42], 16, 1) == (0, 0, 0)
    n, lo, hi = store.longest_suffix([0, 1, 2], 16, 1)
    rows = store.continuations(n, lo, hi, matches=100, length=3)  # in suffix order; a document's end stops each
    assert rows.tolist() == [[3, 4, -1], [3, 4, 7], [3, 5, -1], [6, -1, -1]]
    assert len(store.continuations(n, lo, hi, matches=2, length=3)) == 2  # evenly spaced beyond `matches`


def test_the_trie_keeps_the_heaviest_nodes_depth_first_heaviest_child_first():
    rows = np.array([[3, 4, -1], [3, 4, 7], [3, 5, -1], [6, -1, -1]])
    # weights: 3 -> 3, 3 4 -> 2, then 1 each for 6 (depth 1), 3 5 and 3 4 7 (depth 2 and 3): ties shallow first
    assert frequent_trie(rows, 10) == ([3, 4, 7, 5, 6], [-1, 0, 1, 0, -1])
    assert frequent_trie(rows, 3) == ([3, 4, 6], [-1, 0, -1])
    assert frequent_trie(rows, 1) == ([3], [-1])
    assert frequent_trie(np.full((2, 3), SEPARATOR), 5) == ([], [])


def test_the_trie_is_the_continuations_prefixes_whatever_the_budget():
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 4, size=(200, 5))
    rows = rows[np.lexsort(rows.T[::-1])]
    prefixes = {tuple(row[:d]) for row in rows.tolist() for d in range(1, 6)}
    for nodes in (1, 7, 30, 1000):
        tokens, parents = frequent_trie(rows, nodes)
        assert len(tokens) == min(nodes, len(prefixes))
        paths = []
        for token, parent in zip(tokens, parents):
            assert parent < len(paths)  # a parent comes before its children
            paths.append((paths[parent] if parent >= 0 else ()) + (token,))
        assert len(set(paths)) == len(paths) and set(paths) <= prefixes
        weight = {p: sum(tuple(r[: len(p)]) == p for r in rows.tolist()) for p in prefixes}
        left_out = prefixes - set(paths)
        if left_out:  # none left out weighs more than one kept
            assert max(weight[p] for p in left_out) <= min(weight[p] for p in paths)


def test_the_context_chain_comes_first_and_the_trie_fills_the_budget():
    tokens, parents = [3, 4, 7, 5, 6], [-1, 0, 1, 0, -1]  # the trie of the test above
    assert merge_into_trie([3, 5, 9], tokens, parents, 10) == ([3, 5, 9, 4, 7, 6], [-1, 0, 1, 0, 3, -1])
    assert merge_into_trie([8], tokens, parents, 3) == ([8, 3, 4], [-1, -1, 1])  # 7 would be the 4th; 5, 6 too
    assert merge_into_trie([], tokens, parents, 10) == (tokens, parents)
    assert merge_into_trie([1, 2], [], [], 1) == ([1], [-1])


def datastore_for(target, extra=()) -> Datastore:
    """A datastore of random documents plus the tiny target's own greedy continuations of some prompts."""
    ar = ARDecoder(target)
    ar.eos_ids = set()
    rng = torch.Generator().manual_seed(1)
    documents = [torch.randint(3, 64, (30,), generator=rng).tolist() for _ in range(20)]
    documents += [p[-6:] + ar.generate(p, GREEDY, 30).token_ids for p in prompts()[:2]]
    return Datastore.build(documents + list(extra))


# the paper's 64-node trees only over the whole budget: each new verification width costs the tiny model a new kernel
@pytest.mark.parametrize(
    "cfg, stop_at_eos",
    [
        (RestConfig(), False),
        (RestConfig(tree_nodes=15), True),
        (RestConfig(tree_nodes=3, continuation=2), True),
        (RestConfig(tree_nodes=15, prompt_lookup=True), True),
    ],
)
def test_greedy_equals_ar(target, cfg, stop_at_eos):
    decoder, ar = RestDecoder(target, None, datastore_for(target), cfg), ARDecoder(target)
    for gen in greedy_beside_ar(decoder, ar, prompts(), stop_at_eos=stop_at_eos):
        assert max(gen.drafted, default=0) <= cfg.tree_nodes


def test_retrieved_continuations_cut_the_steps(target):
    decoder, ar = RestDecoder(target, None, datastore_for(target), RestConfig(tree_nodes=15)), ARDecoder(target)
    decoder.eos_ids = ar.eos_ids = set()
    prompt = prompts()[0]  # the datastore holds this prompt's continuation
    reference, gen = ar.generate(prompt, GREEDY, 30), decoder.generate(prompt, GREEDY, 30)
    assert gen.token_ids == reference.token_ids and gen.steps < reference.steps / 2


def test_the_proposal_is_a_trie_within_the_budget(target):
    decoder = RestDecoder(target, None, datastore_for(target), RestConfig(tree_nodes=6, continuation=4))
    tokens = torch.tensor([prompts()[0]])
    proposal = decoder.propose(None, tokens, 3, GREEDY, None, decoder.new_controller())
    assert 0 < len(proposal.drafts) <= 6 and proposal.q is None
    depth = []
    for parent in proposal.parents:
        assert parent < len(depth)
        depth.append(1 + (depth[parent] if parent >= 0 else 0))
    assert max(depth) == 3 and proposal.parents[:2] == [-1, 0]  # the main chain first, as deep as k allows


def test_the_config_is_the_papers_setting(target):
    cfg = decoding.validate_method_config({"name": "rest"})
    assert (cfg.max_suffix, cfg.min_suffix, cfg.matches, cfg.continuation, cfg.tree_nodes) == (16, 2, 5000, 10, 64)
    assert not cfg.prompt_lookup
    assert RestDecoder(target, None, datastore_for(target), cfg).max_step_width == 65


@pytest.mark.parametrize(
    "option", [{"min_suffix": 0}, {"max_suffix": 1}, {"matches": 0}, {"continuation": 0}, {"tree_nodes": 0}]
)
def test_a_bad_option_is_refused_in_one_line(option):
    with pytest.raises(SpecReproError, match=f"method.{next(iter(option))}"):
        RestConfig(**option)


def test_sampling_preserves_the_target_distribution(models, exact):  # noqa: F811
    rng = torch.Generator().manual_seed(0)
    documents = [PROMPT[-2:] + torch.randint(0, VOCAB, (4,), generator=rng).tolist() for _ in range(12)]
    decoder = RestDecoder(models[0], None, Datastore.build(documents), RestConfig(tree_nodes=5, continuation=3))
    assert p_value(decoder, exact) > 1e-3


def conversations_file(tmp_path, replies: list[str]):
    rows = [
        {"id": str(i), "conversations": [{"from": "human", "value": "Say something."}, {"from": "gpt", "value": reply}]}
        for i, reply in enumerate(replies)
    ]
    path = tmp_path / "conversations.json"
    path.write_text(json.dumps(rows))
    return DatasetConfig(name="tiny_chat", path=str(path), task="sharegpt")


def recipe(conversations, **values):
    return OmegaConf.structured(RestDatastoreConfig(conversations=conversations, leaderboard=QUESTIONS, **values))


class CharTokenizer:
    """A stand-in tokenizer: one token a character (mod 64)."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) % 64 for c in text] for text in texts]}


def test_the_datastore_is_built_from_the_assistant_turns_and_reads_back(tmp_path, target):
    spec = recipe(conversations_file(tmp_path, ["Hello there, friend.", "Fine, thanks!"]))
    assert [text for _, text in corpus_documents(spec)] == ["Hello there, friend.", "Fine, thanks!"]
    assert len(corpus_documents(recipe(spec.conversations, roles=["user", "assistant"]))) == 4
    cfg = OmegaConf.create({"training": spec})
    store, metrics, history = build_rest_datastore(
        cfg, SimpleNamespace(model=target, tokenizer=CharTokenizer()), tmp_path, None, "cpu"
    )
    assert metrics["documents"] == 2 and metrics["datastore_tokens"] == len("Hello there, friend.Fine, thanks!") + 2
    assert metrics["compute_minutes"] >= 0 and metrics["datastore_mb"] > 0 and history == []
    store.save_pretrained(tmp_path)
    loaded = Datastore.from_pretrained(tmp_path, vocab_size=64)
    assert loaded.tokens.tolist() == store.tokens.tolist() and loaded.suffixes.tolist() == store.suffixes.tolist()
    with pytest.raises(SpecReproError, match="vocabulary of 64"):
        Datastore.from_pretrained(tmp_path, vocab_size=32)


def test_a_corpus_quoting_a_leaderboard_question_is_refused(tmp_path, target):
    question = load_records(QUESTIONS)[3].turns[0]
    spec = recipe(conversations_file(tmp_path, ["An innocent reply.", f"As you asked: {question.upper()} Sure."]))
    cfg = OmegaConf.create({"training": spec})
    with pytest.raises(SpecReproError, match=r"shares a passage with a spec_bench question \(tiny_chat 1\)"):
        build_rest_datastore(cfg, SimpleNamespace(model=target, tokenizer=CharTokenizer()), tmp_path, None, "cpu")
    own = OmegaConf.structured(RestDatastoreConfig(responses={"questions": QUESTIONS}, leaderboard=QUESTIONS))
    with pytest.raises(SpecReproError, match="is the leaderboard's own questions"):
        build_rest_datastore(
            OmegaConf.create({"training": own}),
            SimpleNamespace(model=target, tokenizer=CharTokenizer()),
            tmp_path,
            None,
            "cpu",
        )


@pytest.mark.parametrize("cfg", [RestConfig(tree_nodes=15), RestConfig(tree_nodes=15, prompt_lookup=True)])
def test_the_replay_of_recorded_outputs_takes_the_steps_decoding_takes(target, cfg, monkeypatch):
    """experiments/replay_drafts.py: a model-free drafter replayed on `ar`'s output accepts what verification did."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "experiments"))
    replay = importlib.import_module("replay_drafts").replay
    decoder, ar = RestDecoder(target, None, datastore_for(target), cfg), ARDecoder(target)
    decoder.eos_ids = ar.eos_ids = set()
    for prompt in prompts()[:3]:
        gen = decoder.generate(prompt, GREEDY, 30)
        tokens, steps, rows = replay(decoder, prompt, ar.generate(prompt, GREEDY, 30).token_ids)
        assert (tokens, steps, rows) == (29, gen.steps, gen.steps + sum(gen.drafted))


def test_the_replay_takes_every_turn_of_a_multi_turn_run(tmp_path):
    """replay_drafts.py replays each turn of an MT-Bench `ar` run after its recorded earlier answers, on the harness's
    own prompt ids: its pld MAT is the pld run's (it had replayed each record's first turn only)."""
    setting = ["model=tiny_random", "dataset=mt_bench", "dataset.limit=2", "decoding.max_new_tokens=24"]
    quiet = ["hardware.threads=1", "logger=none"]
    specrepro("run", *setting, "method=pld", "timing.warmup_tokens=4", *quiet, cwd=tmp_path)
    [ar] = [path for key, path in run_dirs(tmp_path).items() if key.startswith("ar:")]
    [pld] = [path for key, path in run_dirs(tmp_path).items() if key.startswith("pld:")]
    script = Path(__file__).parents[1] / "experiments" / "replay_drafts.py"
    overrides = ["--overrides", "hardware.threads=1", "model=tiny_random"]
    proc = subprocess.run(
        [sys.executable, str(script), "pld", "--runs", str(ar), *overrides],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
    )
    replayed = float(re.search(r"mean MAT over 1 runs (\d+\.\d+)", proc.stdout)[1])
    assert replayed == round(json.loads((pld / "metrics.json").read_text())["mat"], 2) > 1.0


def test_the_recipe_checks_the_corpus_against_every_leaderboard_question():
    from hydra import compose, initialize_config_dir

    from specrepro.cli import CONF_DIR
    from specrepro.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        spec = compose("train", overrides=["method=rest"]).training
    assert spec.component == "rest_datastore" and spec.roles == ["assistant"]
    assert spec.conversations.name == "sharegpt_full" and set(spec.responses) == {"gsm8k", "mbpp", "xsum", "pubmedqa"}
    assert spec.leaderboard.name == "spec_bench" and spec.leaderboard.category is None
    assert spec.leaderboard.limit is None and len(load_records(spec.leaderboard)) == 480
