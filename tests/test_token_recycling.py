"""Token Recycling: the tree template, the adjacency update, drafting from it, and losslessness on tiny LLaMAs."""

from __future__ import annotations


import pytest
import torch

from specrepro import decoding
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.token_recycling import (
    PAPER_TREE,
    TokenRecyclingConfig,
    TokenRecyclingDecoder,
    draft_tree,
    recycle,
    tree_template,
)
from specrepro.errors import SpecReproError
from tests.test_decoding import prompts
from tests.conftest import greedy_beside_ar, host_reads
from tests.test_lossless_sampling import exact, models, p_value  # noqa: F401  (module fixtures)

GREEDY = Sampling()
SMALL_TREE = [[3], [2, 1, 1], [1, 0, 1, 0]]


def test_the_paper_tree_has_80_nodes_of_depth_at_most_6():
    template = tree_template(PAPER_TREE, 8)
    assert len(template.parents) == 80 and max(template.depths) == 6
    assert template.parents[:8] == [-1] * 8 and template.ranks[:8] == list(range(8))


def test_a_template_lists_parents_ranks_and_depths_breadth_first():
    template = tree_template(SMALL_TREE, 3)
    assert template.parents == [-1, -1, -1, 0, 0, 1, 2, 3, 5]
    assert template.ranks == [0, 1, 2, 0, 1, 0, 0, 0, 0]
    assert template.depths == [1, 1, 1, 2, 2, 2, 2, 3, 3]


@pytest.mark.parametrize("tree", [[[2], [1]], [[4]], [[1], [1], [1, 0]], []])
def test_a_malformed_tree_is_refused_in_one_line(tree):
    with pytest.raises(SpecReproError, match="method.tree"):
        TokenRecyclingConfig(candidates=3, tree=tree)


def test_recycling_writes_each_rows_top_k_under_its_input_token():
    matrix = torch.full((6, 2), -1)
    logits = torch.tensor([[0.0, 5, 4, 0, 0, 0], [9.0, 0, 0, 0, 0, 8], [0.0, 0, 0, 3, 2, 0]])
    recycle(matrix, torch.tensor([1, 4, 0, 2]), logits)  # the last 3 inputs have rows (the first is a prompt's)
    assert matrix.tolist() == [[0, 5], [-1, -1], [3, 4], [-1, -1], [1, 2], [-1, -1]]


def test_drafting_follows_the_matrix_and_skips_unfilled_rows_and_their_subtrees():
    matrix = torch.full((10, 3), -1)
    matrix[1] = torch.tensor([2, 3, 4])
    matrix[2] = torch.tensor([5, 6, -1])
    matrix[3] = torch.tensor([7, 8, 9])  # token 4's row is empty: node 2 has no child
    drafts, parents = draft_tree(matrix, 1, tree_template(SMALL_TREE, 3), max_depth=3)
    # nodes: 2, 3, 4 | 5, 6 (under 2), 7 (under 3) | token 5's row is empty: no grandchild
    assert drafts == [2, 3, 4, 5, 6, 7] and parents == [-1, -1, -1, 0, 0, 1]
    drafts, parents = draft_tree(matrix, 1, tree_template(SMALL_TREE, 3), max_depth=1)
    assert drafts == [2, 3, 4] and parents == [-1, -1, -1]
    assert draft_tree(matrix, 0, tree_template(SMALL_TREE, 3), max_depth=3) == ([], [])


def test_a_left_out_node_renumbers_the_parents_after_it_and_drafts_nothing_below_it():
    matrix = torch.full((10, 3), -1)
    matrix[0] = torch.tensor([9, 9, 9])  # an unfilled node's token (-1) must not read row 0 for its children
    matrix[1] = torch.tensor([2, 3, 4])
    matrix[3] = torch.tensor([5, -1, -1])
    matrix[4] = torch.tensor([6, -1, -1])
    matrix[5] = torch.tensor([7, -1, -1])
    # token 2's row is empty: template nodes 3, 4 (under 2) and 7 (under node 3) are left out
    drafts, parents = draft_tree(matrix, 1, tree_template(SMALL_TREE, 3), max_depth=3)
    assert drafts == [2, 3, 4, 5, 6, 7] and parents == [-1, -1, -1, 1, 2, 3]


def test_every_row_of_a_verification_recycles_its_candidates(target):
    decoder = TokenRecyclingDecoder(target, None, TokenRecyclingConfig(candidates=3, tree=SMALL_TREE, persist=False))
    state = decoder.start(None, None, 0)
    input_ids = torch.tensor([[5, 9, 12, 9, 40]])
    output = decoder.target_forward(state, input_ids, decoder.steps.new_cache(8))
    top3 = output.logits[0].topk(3).indices
    assert state.matrix[[5, 12, 9, 40]].tolist() == top3[[0, 2, 3, 4]].tolist()  # token 9 keeps its last row's


@pytest.mark.parametrize("persist", [True, False])
@pytest.mark.parametrize("tree", [PAPER_TREE, SMALL_TREE])
def test_greedy_equals_ar(target, tree, persist):
    decoder = TokenRecyclingDecoder(target, None, TokenRecyclingConfig(tree=tree, persist=persist))
    for gen in greedy_beside_ar(decoder, ARDecoder(target), prompts(), budgets=(1, 7, 40)):
        assert gen.steps == len(gen.accepted) == len(gen.drafted)


def test_recycled_candidates_cut_the_steps_on_a_repetitive_prompt(target):
    prompt = prompts()[-1]
    decoder = TokenRecyclingDecoder(target, None, TokenRecyclingConfig(persist=False))
    ar = ARDecoder(target).generate(prompt, GREEDY, 40)
    gen = decoder.generate(prompt, GREEDY, 40)
    assert gen.token_ids == ar.token_ids and gen.steps < ar.steps / 2


def test_a_persistent_matrix_carries_over_and_a_fresh_one_does_not(target):
    prompt = prompts()[0]
    persistent = TokenRecyclingDecoder(target, None, TokenRecyclingConfig(persist=True))
    fresh = TokenRecyclingDecoder(target, None, TokenRecyclingConfig(persist=False))
    persistent.eos_ids = fresh.eos_ids = set()  # the whole budget, not a stop at the tiny model's EOS
    first = persistent.generate(prompt, GREEDY, 30)
    assert persistent.generate(prompt, GREEDY, 30).steps < first.steps  # the second run drafts from the first's
    assert fresh.generate(prompt, GREEDY, 30).steps == fresh.generate(prompt, GREEDY, 30).steps == first.steps


def test_restoring_the_carried_matrix_forgets_what_later_generations_taught(target):
    prompt = prompts()[0]
    decoder = TokenRecyclingDecoder(target, None, TokenRecyclingConfig(persist=True))
    decoder.eos_ids = set()
    carried = decoder.carried()
    first = decoder.generate(prompt, GREEDY, 30)
    after_first = decoder.carried()
    decoder.generate(prompt, GREEDY, 30)
    decoder.restore(carried)
    again = decoder.generate(prompt, GREEDY, 30)
    assert (again.steps, again.accepted) == (first.steps, first.accepted)
    assert torch.equal(decoder.carried(), after_first)
    assert TokenRecyclingDecoder(target, None, TokenRecyclingConfig(persist=False)).carried() is None


def test_the_config_builds_the_decoder_with_the_papers_tree(target):
    cfg = decoding.validate_method_config({"name": "token_recycling"})
    assert cfg.tree == PAPER_TREE and cfg.candidates == 8 and cfg.persist
    assert TokenRecyclingDecoder(target, None, cfg).max_step_width == 81


def test_sampling_preserves_the_target_distribution(models, exact):  # noqa: F811
    # every node a deterministic draft (one-hot q); siblings verified one speculative stage each; the matrix
    # carries over from sample to sample, as by default
    cfg = TokenRecyclingConfig(candidates=3, tree=[[3], [2, 1, 0], [1, 0, 0]])
    assert p_value(TokenRecyclingDecoder(models[0], None, cfg), exact) > 1e-3


def test_a_round_reads_the_device_for_its_tree_once_and_for_its_verification(target):
    """The tree is filled on the matrix's device and read once (on a GPU, a read a parent token's row would wait
    for it tens of times a round for the paper's tree); the verification reads once more."""
    decoder = TokenRecyclingDecoder(target, None, TokenRecyclingConfig(persist=False))
    decoder.eos_ids = set()
    rounds = decoder.generate(prompts()[0], GREEDY, 41).steps
    assert host_reads(decoder, prompts()[0], 41) <= 1 + 2 * rounds  # and the prefill's token
