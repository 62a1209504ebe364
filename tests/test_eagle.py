"""EAGLE drafting with EAGLE-2's dynamic tree: lossless greedy decoding (chain and tree), the tree's construction,
the draft's KV cache after each round, its training data and a training killed and resumed."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from specrepro.decoding import draft_verify
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.draft_verify import TargetOutput
from specrepro.decoding.eagle import DraftTree, EagleConfig, EagleDecoder, EagleDraft, dynamic_tree, rerank
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.verify import tree_attention
from specrepro.errors import SpecReproError
from tests.conftest import tiny_llama

GREEDY = Sampling()


def eagle(target, depth=4, top_k=3, total_tokens=8, vocab_ids=None):
    torch.manual_seed(0)
    draft = EagleDraft(target.config, 0 if vocab_ids is None else len(vocab_ids))
    if vocab_ids is not None:
        draft.vocab_ids.copy_(vocab_ids)
    draft = draft.eval().attach_lm_head(target.lm_head)
    cfg = EagleConfig(depth=depth, top_k=top_k, total_tokens=total_tokens, head="none")
    return EagleDecoder(target, None, draft, cfg)


@pytest.fixture(scope="module")
def sharp():
    return tiny_llama(vocab_size=64, num_layers=2, logit_scale=3.0)


@pytest.mark.parametrize("depth,top_k,total", [(3, 1, 3), (1, 4, 4), (4, 3, 8), (6, 10, 59)])
def test_greedy_eagle_equals_ar_for_chains_and_dynamic_trees(sharp, depth, top_k, total):
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    reference = ARDecoder(sharp).generate(prompt, GREEDY, 40).token_ids
    gen = eagle(sharp, depth, top_k, total).generate(prompt, GREEDY, 40)
    assert gen.token_ids == reference
    assert max(gen.drafted) == min(total, top_k + (depth - 1) * top_k * top_k)


def test_greedy_eagle_with_a_reduced_draft_vocabulary_equals_ar(sharp):
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(2))
    reference = ARDecoder(sharp).generate(prompt, GREEDY, 30).token_ids
    decoder = eagle(sharp, 3, 2, 5, vocab_ids=torch.arange(0, 64, 2))
    gen = decoder.generate(prompt, GREEDY, 30)
    assert gen.token_ids == reference
    assert (
        gen.extra["extra_parameters"]
        == decoder.draft.num_parameters()
        > sum(p.numel() for p in decoder.draft.parameters())
    )


def test_the_dynamic_tree_expands_the_top_k_by_cumulative_confidence(sharp):
    decoder, depth, top_k = eagle(sharp, 4, 3, 8), 4, 3
    state = decoder.start(None, None, 0)
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    output = decoder.target_forward(state, prompt, decoder.steps.new_cache(20))
    decoder.after_verify(state, torch.cat([prompt, prompt[:, :1]], 1), output, list(range(9)))
    tree = dynamic_tree(decoder, state, depth, top_k)
    tokens, values, parents, depths = (x.tolist() for x in (tree.tokens, tree.values, tree.parents, tree.depths))
    root = decoder.scores(state.feature)[0].exp()
    first = [i for i, d in enumerate(depths) if d == 1]
    assert [tokens[i] for i in first] == root.topk(top_k).indices.tolist()
    assert [values[i] for i in first] == pytest.approx(root.topk(top_k).values.tolist())
    assert len(tokens) == top_k + (depth - 1) * top_k * top_k
    for d in range(2, depth + 1):  # the parents of level d are the top-k of level d - 1 by value
        previous = [i for i in range(len(tokens)) if depths[i] == d - 1]
        best = sorted(previous, key=lambda i: -values[i])[:top_k]
        assert {parents[i] for i in range(len(tokens)) if depths[i] == d} == set(best)
    for i, parent in enumerate(parents):  # Eq. 1: a value is the product along its path, so never above its parent's
        assert parent == -1 or (parent < i and values[i] <= values[parent] and depths[i] == depths[parent] + 1)
    kept = rerank(tree, 8).tolist()
    assert sorted((values[i] for i in kept), reverse=True) == sorted(values, reverse=True)[:8]
    assert all(parents[i] == -1 or parents[i] in kept for i in kept)


def test_each_tree_value_is_its_parents_times_the_teacher_forced_draft_probability_of_its_path(sharp):
    """A node at depth d is the pair (its parent's predicted feature, its token) at the position after the committed
    pairs and its d - 1 ancestors, seeing those alone: the draft's teacher-forced pass over that path gives it."""
    decoder = eagle(sharp, 3, 3, 8)
    state = decoder.start(None, None, 0)
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    committed = torch.cat([prompt, prompt[:, :1]], 1)
    output = decoder.target_forward(state, prompt, decoder.steps.new_cache(20))
    decoder.after_verify(state, committed, output, list(range(9)))
    tree = dynamic_tree(decoder, state, 3, 3)
    tokens, values, parents = tree.tokens.tolist(), tree.values.tolist(), tree.parents.tolist()
    for node in (i for i, parent in enumerate(parents) if parent >= 0 and parents[parent] >= 0):  # depth 3
        path = [parents[parents[node]], parents[node], node]
        features = torch.cat([output.hidden["features"], state.feature[:, None]], 1)  # f_0..f_8, then f^_9
        pairs = committed[0, 1:].tolist()
        for ancestor, child in zip(path, path[1:]):
            pairs.append(tokens[ancestor])
            with torch.no_grad():
                f = decoder.draft(features, decoder.embed(torch.tensor([pairs])), torch.arange(len(pairs))[None])
                p = decoder.scores(f[0, -1:])[0].exp()
            assert values[child] == pytest.approx(values[ancestor] * float(p[tokens[child]]), rel=1e-5)
            features = torch.cat([features, f[:, -1:]], 1)


def test_rerank_keeps_the_best_nodes_as_a_tree_and_the_proposal_masks_it(sharp):
    tree = DraftTree(
        torch.tensor([5, 6, 7, 8, 9, 4]),
        torch.tensor([0.6, 0.3, 0.6, 0.1, 0.25, 0.5], dtype=torch.float64),
        torch.tensor([-1, -1, 0, 0, 1, 2]),
        torch.tensor([1, 1, 2, 2, 2, 3]),
    )
    assert rerank(tree, 4).tolist() == [0, 1, 2, 5]  # a tie keeps the parent (created first) before its child
    assert rerank(tree, 2).tolist() == [0, 2]
    decoder = eagle(sharp, 3, 2, 4)
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(4))
    state = decoder.start(None, None, 0)
    output = decoder.target_forward(state, prompt, decoder.steps.new_cache(20))
    decoder.after_verify(state, torch.cat([prompt, prompt[:, :1]], 1), output, list(range(6)))
    proposal = decoder.propose(state, prompt, 3, GREEDY, None, decoder.new_controller())
    assert len(proposal.drafts) == 4 and proposal.q is None
    assert all(-1 <= p < i for i, p in enumerate(proposal.parents))
    allow, positions = tree_attention(proposal.parents, 6)
    for i, parent in enumerate(proposal.parents):  # a node sees its parent's keys and sits one position deeper
        assert allow[i + 1, 6 + parent + 1] and positions[i + 1] == positions[parent + 1] + 1


def test_the_draft_cache_holds_exactly_the_committed_pairs_after_every_round(sharp, monkeypatch):
    decoder = eagle(sharp, 2, 64, 70)  # every token at depth 1: a node off the first branch is accepted every round
    seen = []
    after = EagleDecoder.after_verify
    monkeypatch.setattr(
        EagleDecoder,
        "after_verify",
        lambda self, state, tokens, output, rows: (
            after(self, state, tokens, output, rows),
            seen.append((tokens.clone(), state.cache.layers[0].keys.clone(), state.length, state.feature)),
        ),
    )
    paths = []
    keep = draft_verify.keep_tree_path
    monkeypatch.setattr(
        draft_verify,
        "keep_tree_path",
        lambda cache, committed, path: paths.append(path) or keep(cache, committed, path),
    )
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(5))
    decoder.generate(prompt, GREEDY, 40)
    assert any(path and path != list(range(len(path))) for path in paths)  # a side branch was accepted
    for tokens, keys, length, feature in seen:  # rebuilt from scratch: the target's features of every committed pair
        n = tokens.shape[1] - 1
        with torch.no_grad():
            features = sharp.model(input_ids=tokens[:, :-1]).last_hidden_state
            fresh = decoder.start(None, None, 0)
            after(decoder, fresh, tokens, TargetOutput(None, hidden={"features": features}), list(range(n)))
            teacher_forced = decoder.draft(features, decoder.embed(tokens[:, 1:]), torch.arange(n)[None])
        assert length == keys.shape[2] == n
        torch.testing.assert_close(keys, fresh.cache.layers[0].keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(feature, fresh.feature, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(feature, teacher_forced[:, -1], atol=1e-4, rtol=1e-4)  # training's pass


def test_a_draft_saved_before_the_layer_was_transformers_own_loads_to_the_same_draft(tmp_path, sharp):
    """Drafts trained before the draft layer became transformers' LlamaDecoderLayer saved its weights at the top
    level (`q_proj.weight`, `mlp.up_proj.weight`, ...): they load into the same weights, so every committed EAGLE
    head keeps its content digest and its predictions."""
    from safetensors.torch import load_file, save_file

    draft = eagle(sharp).draft
    draft.save_pretrained(tmp_path)
    weights = load_file(str(tmp_path / "eagle_draft.safetensors"))
    legacy = {k.removeprefix("layer.self_attn.").removeprefix("layer."): v for k, v in weights.items()}
    assert "q_proj.weight" in legacy and "mlp.up_proj.weight" in legacy and len(legacy) == len(weights)
    save_file(legacy, str(tmp_path / "eagle_draft.safetensors"))
    loaded = EagleDraft.from_pretrained(tmp_path, sharp.config)
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_draft_for_another_target_is_refused(tmp_path, sharp):
    draft = EagleDraft(sharp.config)
    draft.save_pretrained(tmp_path)
    other = tiny_llama(vocab_size=80)
    with pytest.raises(SpecReproError, match="vocab_size 64, this target has 80"):
        EagleDraft.from_pretrained(tmp_path, other.config)
    assert EagleDraft.from_pretrained(tmp_path, sharp.config).state_dict().keys() == draft.state_dict().keys()


def test_conversation_tokens_mask_the_assistant_turns():
    from transformers import AutoTokenizer

    from specrepro.models.loading import embedded_checkpoint
    from specrepro.training.eagle_data import conversation_tokens

    tokenizer = AutoTokenizer.from_pretrained(embedded_checkpoint())
    messages = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Add 2 and 2."},
        {"role": "assistant", "content": "4"},
    ]
    ids, mask = conversation_tokens(messages, tokenizer, 512)
    assert (
        ids == tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    )
    assert "Hello! How can I help?" in tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert "Add 2" not in tokenizer.decode([t for t, m in zip(ids, mask) if m])
    short, short_mask = conversation_tokens(messages, tokenizer, 12)
    assert short == ids[:12] and short_mask == mask[:12]


def test_conversation_tokens_of_a_tokenizer_without_a_chat_template_are_the_plain_transcript():
    """A tokenizer without a chat template (Vicuna's) renders conversations as prompts do without one."""
    from transformers import AutoTokenizer

    from specrepro.data.prompts import plain_transcript
    from specrepro.models.loading import embedded_checkpoint
    from specrepro.training.eagle_data import conversation_tokens

    tokenizer = AutoTokenizer.from_pretrained(embedded_checkpoint())
    tokenizer.chat_template = None
    messages = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Add 2 and 2."},
    ]
    ids, mask = conversation_tokens(messages, tokenizer, 512)
    assert tokenizer.decode(ids) == plain_transcript(messages)
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == " Hello! How can I help?"


def test_a_truncated_package_json_keeps_its_complete_records(tmp_path):
    from specrepro.data.files import complete_list_items

    whole = [{"id": str(i), "conversations": [{"from": "human", "value": "x" * i}]} for i in range(5)]
    text = json.dumps(whole, indent=2)
    (tmp_path / "cut.json").write_text(text[: text.index('"id": "4"') + 3])
    assert complete_list_items(tmp_path / "cut.json") == whole[:4]
    with gzip.open(tmp_path / "whole.json.gz", "wt") as handle:
        handle.write(text)
    assert complete_list_items(tmp_path / "whole.json.gz") == whole


def tiny_conversations(tmp_path, limit: int, max_tokens: int) -> list[str]:
    """Training overrides for a conversation-trained draft on the tiny random LLaMA: the bundled ShareGPT sample's
    first `limit` conversations, cut at `max_tokens`, two held out, artifacts under `tmp_path`."""
    return [
        "model=tiny_random",
        "logger=none",
        "hardware.threads=1",
        f"artifacts_dir={tmp_path}",
        "training.conversations.path=sharegpt/sharegpt_v3_first1000.json.gz",
        "training.conversations.ids_path=null",
        f"training.conversations.limit={limit}",
        f"training.max_tokens={max_tokens}",
        "training.heldout_sequences=2",
    ]


def test_eagle_training_killed_part_way_resumes_to_the_same_draft(tmp_path, monkeypatch):
    from specrepro.models import ModelLoader
    from specrepro.training import eagle_head
    from tests.test_config import compose_run

    cfg = compose_run(
        "method=eagle",
        "training=eagle",
        *tiny_conversations(tmp_path, 10, 48),
        "training.loop.steps=4",
        "training.loop.checkpoint_every=2",
        "training.loop.log_every=1",
        "training.loop.batch_size=2",
        config="train",
    )
    target = ModelLoader.for_hardware(cfg.hardware, cfg.artifacts_dir).load_model(cfg.model)
    straight, metrics, history = eagle_head.train_eagle_head(
        cfg, target, tmp_path / "straight", lambda *a: None, torch.device("cpu")
    )
    assert len(history) == 4 and metrics["train_sequences"] >= 4 and len(metrics["heldout_top1_by_depth_after"]) == 4
    for h in history:  # Eq. 5
        assert h["loss"] == pytest.approx(h["loss_reg"] + cfg.training.w_cls * h["loss_cls"], rel=1e-5)
    assert metrics["compute_minutes"] * 60 >= history[-1]["seconds"] > 0
    pack, calls = eagle_head.pack, []

    def killed_at_step_2(rows, features):
        calls.append(1)
        if len(calls) == 4:  # the held-out agreement before training, steps 0 and 1 (checkpointed), then 2
            raise KeyboardInterrupt
        return pack(rows, features)

    monkeypatch.setattr(eagle_head, "pack", killed_at_step_2)
    with pytest.raises(KeyboardInterrupt):
        eagle_head.train_eagle_head(cfg, target, tmp_path / "resumed", lambda *a: None, torch.device("cpu"))
    monkeypatch.setattr(eagle_head, "pack", pack)
    resumed, _, resumed_history = eagle_head.train_eagle_head(
        cfg, target, tmp_path / "resumed", lambda *a: None, torch.device("cpu")
    )
    assert [h["loss"] for h in resumed_history] == pytest.approx([h["loss"] for h in history])
    for a, b in zip(straight.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b)


def learning_curve_heads(curve: str) -> tuple[list[str], list[str], list[str]]:
    """The head names a learning-curve pipeline's train stages make, its run stages decode and its table selects."""
    from specrepro.reproduce import load_pipeline
    from specrepro.tables import TableSpec
    from specrepro.training import artifact_path
    from tests.test_config import compose_run

    _, stages = load_pipeline(curve)
    trained = [artifact_path(compose_run(*stage["train"], config="train")).name for stage in stages if "train" in stage]
    return trained, decoded_heads(stages), [row.select["method.head"] for row in TableSpec.load(curve).rows]


def decoded_heads(stages: list[dict]) -> list[str]:
    """The heads a pipeline's run stages decode, named in full (`method.head=@stageN`: what train stage N makes)."""
    from specrepro.reproduce import with_trained

    return [
        arg.removeprefix("method.head=")
        for stage in stages
        if "run" in stage
        for arg in with_trained(stage, stages, Path("results"), [])["run"]
        if arg.startswith("method.head=")
    ]


@pytest.mark.parametrize("curve", ["eagle_scaling", "sar_scaling"])
def test_the_learning_curve_pins_each_budget_to_the_head_its_preset_trains(curve):
    """The scaling pipelines and tables name each budget's head in full (several heads share a prefix): those names
    must be what the pipeline's own train stages make, or a budget's runs would load another head."""
    trained, decoded, tabled = learning_curve_heads(curve)
    assert len(trained) == 6 and decoded == trained and tabled == trained


def test_the_leaderboard_decodes_the_largest_eagle_budget():
    from specrepro.reproduce import load_pipeline

    trained, _, _ = learning_curve_heads("eagle_scaling")
    _, leaderboard = load_pipeline("spec_bench")
    largest = [head for head in decoded_heads(leaderboard) if head.startswith("eagle")]
    assert largest == [trained[-1]] * 2


def test_the_default_tree_is_eagle2s_and_the_leaderboard_pins_the_60_nodes_it_ran():
    """EAGLE-2's total_token=60 counts the root (its cnets.py drafts total_token - 1 = 59): the default verifies 60
    rows. The committed leaderboard row drafted 60 nodes, so its run stage pins them rather than read the default."""
    from specrepro.reproduce import composed, load_pipeline
    from specrepro.tables import TableSpec

    [default] = composed({"run": []}, "run", [["method=eagle"]])
    assert EagleConfig().total_tokens == default.method.total_tokens == 59
    _, leaderboard = load_pipeline("spec_bench")
    [stage] = [s["run"] for s in leaderboard if "run" in s and "method=eagle" in s["run"]]
    [row] = [row for row in TableSpec.load("spec_bench").rows if row.label[0] == "eagle"]
    assert row.select["method.total_tokens"] == 60 and "method.total_tokens=60" in stage


def test_a_draft_vocabulary_larger_than_the_tokens_seen_is_filled_up_by_id():
    """A small training set may hold fewer distinct tokens than the draft vocabulary (EAGLE's 60-conversation
    budget held 3,995 of 4,096): the seen ones come first, most frequent first, then the unseen ids in order."""
    from specrepro.training.distill_data import frequent_tokens

    rows = [{"prompt_ids": [7], "continuation_ids": [5, 5, 3]}]
    assert frequent_tokens(rows, 6, vocab_size=10).tolist() == [5, 3, 7, 0, 1, 2]
    assert frequent_tokens(rows, 2, vocab_size=10).tolist() == [5, 3]
    with pytest.raises(SpecReproError, match="does not fit the target's 10"):
        frequent_tokens(rows, 11, vocab_size=10)


def test_the_loss_terms_pair_each_feature_with_the_next_token_and_score_the_next_feature(sharp):
    """Training's pass reads (f_i, e(t_{i+1})) at position i; Eq. 3-4 score its output against f_{i+1} and
    p_{i+2} = Softmax(LM_Head(f_{i+1})) where t_{i+1} is an assistant token. An oracle draft (the target's next
    features) has no regression loss, the target's entropy as L_cls and a hit at every position."""
    from specrepro.training.eagle_head import draft_pass, eagle_terms

    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(7))
    mask = torch.tensor([[False] * 4 + [True] * 8])
    with torch.no_grad():
        features = sharp.model(input_ids=ids).last_hidden_state
    draft, seen = eagle(sharp).draft, {}
    draft.forward = lambda f, e, positions: seen.update(f=f, e=e, positions=positions) or features[:, 1:]
    embed = sharp.get_input_embeddings()
    predicted = draft_pass(draft, embed, {"ids": ids, "features": features, "mask": mask})
    torch.testing.assert_close(seen["f"], features[:, :-1])
    torch.testing.assert_close(seen["e"], embed(ids[:, 1:]))
    assert seen["positions"].tolist() == [list(range(11))]
    loss_reg, loss_cls, hits, n = eagle_terms(draft, predicted, {"ids": ids, "features": features, "mask": mask})
    p = sharp.lm_head(features[0, 4:]).detach().float().softmax(-1)  # f_4..f_11: the assistant tokens t_4.. features
    assert loss_reg.item() == 0 and int(hits) == int(n) == 8
    assert loss_cls.item() == pytest.approx(float(-(p * p.log()).sum(-1).mean()), rel=1e-5)


def test_heldout_agreement_is_with_the_targets_top1_over_its_whole_vocabulary(sharp):
    """With a reduced draft vocabulary, a draft that predicts the target's features exactly still misses every
    position whose target top-1 lies outside its vocabulary: decoding rejects those drafts, so the held-out
    agreement counts them as misses (not as hits against the best token of the draft vocabulary)."""
    from specrepro.training.eagle_head import heldout_agreement

    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        features = sharp.model(input_ids=ids).last_hidden_state
    top1 = sharp.lm_head(features[0, 1:]).argmax(-1)
    vocab_ids = torch.tensor([t for t in range(64) if t != int(top1[0])])  # the first position's choice left out
    draft = eagle(sharp, vocab_ids=vocab_ids).draft
    draft.forward = lambda f, e, positions: features[:, 1:]  # an oracle: the target's next features
    rows = [{"ids": ids[0].tolist(), "loss_mask": [True] * 40}]
    agreement = heldout_agreement(draft, sharp.get_input_embeddings(), sharp.lm_head, rows, [features[0]], 1)
    assert agreement == [round(float((top1 != top1[0]).float().mean()), 4)] and agreement[0] < 1
