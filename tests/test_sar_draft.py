"""SAR draft (001) and its head family: lossless greedy decoding, h_q prefix states, artifacts, training via the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from specrepro.decoding import draft_verify
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.sar_draft import VARIANTS, DraftHead, SARDraftConfig, SARDraftDecoder, find_head, head_for
from specrepro.decoding.verify import keep_tree_path
from specrepro.errors import SpecReproError
from specrepro.training.distill_data import target_hidden_states
from specrepro.training.sar_head import anchor_batch, sar_terms
from tests.conftest import tiny_llama
from tests.test_runner import FAST, run_dirs, specrepro

GREEDY = Sampling()
FAMILY = [(v, 1, False) for v in VARIANTS] + [
    ("transformer", 0, False),
    ("transformer", 2, False),
    ("simplified", 1, True),
    ("block", 1, True),
]


def sar(target, variant, k=4, transformer_layers=1, controller="fixed", shared=False, tree_width=1):
    torch.manual_seed(0)
    head = head_for(target, variant, 4, 32, transformer_layers, shared).eval()
    cfg = SARDraftConfig(
        variant=variant,
        k=k,
        k_max=4,
        controller=controller,
        transformer_layers=transformer_layers,
        shared_lm_head=shared,
        tree_width=tree_width,
    )
    return SARDraftDecoder(target, None, head, cfg)


@pytest.mark.parametrize("variant,layers,shared", FAMILY)
def test_greedy_sar_equals_ar_for_every_variant_and_k(variant, layers, shared):
    target = tiny_llama(vocab_size=64, num_layers=2, logit_scale=3.0)
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    reference = ARDecoder(target).generate(prompt, GREEDY, 30).token_ids
    for k, controller in ((1, "fixed"), (3, "fixed"), (4, "fixed"), (2, "heuristic")):
        gen = sar(target, variant, k, layers, controller, shared).generate(prompt, GREEDY, 30)
        assert gen.token_ids == reference, (variant, layers, k, controller)
        assert sum(gen.drafted) > 0
        own = sum(p.numel() for p in head_for(target, variant, 4, 32, layers, shared).parameters())
        assert gen.extra["extra_parameters"] == own  # a shared LM head is the target's, not counted


def test_greedy_sar_with_a_token_tree_equals_ar(monkeypatch):
    target = tiny_llama(vocab_size=64, num_layers=2, logit_scale=3.0)
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    reference = ARDecoder(target).generate(prompt, GREEDY, 40).token_ids
    paths = []
    monkeypatch.setattr(
        draft_verify,
        "keep_tree_path",
        lambda cache, committed, path: paths.append(path) or keep_tree_path(cache, committed, path),
    )
    for variant in ("simplified", "block"):
        for k, width in ((1, 4), (2, 4), (3, 2)):
            gen = sar(target, variant, k, tree_width=width).generate(prompt, GREEDY, 40)
            assert gen.token_ids == reference, (variant, k, width)
            assert max(gen.drafted) > k  # the siblings were verified too
    assert any(path and path[0] != 0 for path in paths)  # a sibling, not the chain, was accepted
    with pytest.raises(SpecReproError, match="tree_width"):
        sar(target, "block", tree_width=0)


def test_each_draft_reads_the_whole_draft_prefix_from_the_last_committed_token():
    """Eq. 5: the j-th draft token's q_0 reads d_1..d_j, d_1 the last committed token (convention A)."""
    target = tiny_llama(vocab_size=64, num_layers=2, logit_scale=3.0)
    decoder, prefixes, rounds = sar(target, "transformer", k=4), [], []
    draft_logits, propose = decoder.next_draft_logits, decoder.propose

    def recorded_propose(state, tokens, *rest):
        rounds.append((tokens[0, -1].item(), propose(state, tokens, *rest)))
        return rounds[-1][1]

    decoder.next_draft_logits = lambda hp, prefix: prefixes.append(prefix.tolist()) or draft_logits(hp, prefix)
    decoder.propose = recorded_propose
    decoder.generate(torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1)), GREEDY, 20)
    expected = [[last] + proposal.drafts[:j].tolist() for last, proposal in rounds for j in range(len(proposal.drafts))]
    assert prefixes == expected and max(map(len, prefixes)) == 4


@pytest.mark.parametrize("tree_width", [1, 4])
def test_h_p_is_the_verified_row_that_produced_the_last_committed_token(tree_width):
    target = tiny_llama(vocab_size=64, num_layers=2, logit_scale=3.0)
    decoder = sar(target, "simplified", k=3, tree_width=tree_width)
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    seen = []
    original = decoder.propose

    def spy(state, tokens, k, sampling, rng, controller):
        seen.append((tokens.clone(), state.hp.clone()))
        return original(state, tokens, k, sampling, rng, controller)

    decoder.propose = spy
    decoder.generate(prompt, GREEDY, 20)
    for tokens, hp in seen:
        with torch.no_grad():
            fresh = target.model(tokens[:, :-1]).last_hidden_state[0, -1]  # the row that predicted tokens[-1]
        assert torch.allclose(hp, fresh, atol=1e-5)


def test_cached_training_hidden_states_and_anchors_follow_convention_a(tmp_path):
    target = tiny_llama(vocab_size=64, num_layers=2)
    rows = [
        {"prompt_ids": [5, 6, 7, 8], "continuation_ids": [9, 10, 11, 12, 13, 14]},
        {"prompt_ids": [3], "continuation_ids": [20, 21, 22]},
    ]
    hidden = target_hidden_states(target, rows, 3, 2, False, tmp_path / "hidden")
    for row, states in zip(rows, hidden):
        seq = row["prompt_ids"][-3:] + row["continuation_ids"]
        with torch.no_grad():  # the row of position t predicts seq[t + 1]: h_p of continuation token i
            fresh = target.model(torch.tensor([seq])).last_hidden_state[
                0, len(seq) - len(row["continuation_ids"]) - 1 : -1
            ]
        assert torch.allclose(states, fresh, atol=1e-5)
    cached = target_hidden_states(None, rows, 3, 2, False, tmp_path / "hidden")  # loaded, not recomputed
    assert all(torch.equal(a, b) for a, b in zip(cached, hidden))
    batch = anchor_batch(rows, hidden, 3, 1000)
    assert len(batch["hp"]) == 5 + 2  # every position whose next-but-one token is a continuation token
    assert batch["inputs"][0].tolist() == [9, 10, 11] and batch["targets"][0].tolist() == [10, 11, 12]
    assert batch["inputs"][6].tolist()[:2] == [21, 22] and batch["valid"][6].tolist() == [True, False, False]
    assert torch.equal(batch["hp"][6], hidden[1][1])
    assert len(anchor_batch(rows, hidden, 3, 4)["hp"]) == 4
    # Eq. 8's p-term: the target's NLL of the continuation token each h_p predicted
    loss_p = sar_terms(head_for(target, "transformer", 3, 32, 1, False), target, batch)[0]
    logp = target.lm_head(batch["hp"]).detach().log_softmax(-1)
    assert float(loss_p) == pytest.approx(-float(logp[range(7), [9, 10, 11, 12, 13, 20, 21]].mean()), rel=1e-5)


def test_a_conversations_anchors_and_targets_stay_inside_its_assistant_turns():
    """A conversation row masks its user turns: an anchor needs an assistant token as its depth-1 target, deeper
    targets outside the mask are not valid, and the target's own top-1 rides along for held-out agreement."""
    ids = [10, 11, 12, 13, 14, 15, 16, 17]
    mask = [False, False, True, True, True, False, True, True]
    row = {"prompt_ids": [], "continuation_ids": ids, "loss_mask": mask, "target_top1": [i + 100 for i in ids]}
    hidden = [torch.arange(8.0)[:, None].expand(8, 4)]
    batch = anchor_batch([row], hidden, 2, 1000)
    # anchor i reads x[i..i+1] and predicts x[i+1..i+2]: i = 1, 2, 3 (targets 12-14), 5 and 6 (targets 16, 17)
    assert batch["hp"][:, 0].tolist() == [1, 2, 3, 5, 6]
    assert batch["inputs"].tolist() == [[11, 12], [12, 13], [13, 14], [15, 16], [16, 17]]
    assert batch["valid"].tolist() == [[True, True], [True, True], [True, False], [True, True], [True, False]]
    assert batch["target_top1"].tolist() == [[112, 113], [113, 114], [114, 115], [116, 117], [117, 0]]
    unmasked = anchor_batch([{"prompt_ids": [], "continuation_ids": ids}], hidden, 2, 1000)
    assert len(unmasked["hp"]) == 7 and "target_top1" not in unmasked


def test_simplified_prefix_states_are_the_alpha_weighted_means():
    head = DraftHead(8, 16, "simplified", k=3, proj_size=4)
    with torch.no_grad():
        head.alpha_logits.copy_(torch.tensor([0.0, 1.0, -2.0]))
    emb = torch.randn(2, 3, 8)
    states, m = head.tlm_states(emb), head.mlp(emb)
    alpha = torch.sigmoid(head.alpha_logits)
    for j in range(1, 4):  # Eq. 6
        expected = (alpha[:j, None] * m[:, :j]).sum(1) / alpha[:j].sum()
        assert torch.allclose(states[:, j - 1], expected, atol=1e-6)


@pytest.mark.parametrize(
    "variant,shared", [("simplified", False), ("simplified", True), ("block", False), ("lstm", True)]
)
def test_greedy_sar_with_a_reduced_draft_vocabulary_equals_ar(variant, shared, tmp_path):
    target = tiny_llama(vocab_size=64, num_layers=2, logit_scale=3.0)
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    reference = ARDecoder(target).generate(prompt, GREEDY, 30).token_ids
    vocab_ids = torch.tensor(sorted(set(reference))[::2] + [63])  # some target tokens cannot be drafted
    torch.manual_seed(0)
    head = head_for(target, variant, 4, 32, 1, shared, vocab_ids).eval()
    cfg = SARDraftConfig(variant=variant, k=3, k_max=4, shared_lm_head=shared, draft_vocab=len(vocab_ids))
    gen = SARDraftDecoder(target, None, head, cfg).generate(prompt, GREEDY, 30)
    assert gen.token_ids == reference and sum(gen.drafted) > 0
    emb, hp = torch.randn(1, 2, target.config.hidden_size), torch.randn(1, target.config.hidden_size)
    logits = head.full_vocab_logits(head.draft_logits(hp, emb))
    assert logits.shape[-1] == 64 and torch.isinf(logits).sum() == 2 * (64 - len(vocab_ids))
    head.save_pretrained(tmp_path)
    loaded = DraftHead.from_pretrained(tmp_path).attach_lm_head(target.lm_head)
    assert torch.equal(loaded.vocab_ids, vocab_ids)
    assert torch.equal(loaded.draft_logits(hp, emb), head.draft_logits(hp, emb))


@pytest.mark.parametrize("variant,layers,shared", FAMILY)
def test_prefix_states_are_causal_and_the_head_round_trips(variant, layers, shared, tmp_path):
    lm_head = torch.nn.Linear(16, 32, bias=False)
    head = DraftHead(16, 32, variant, k=4, proj_size=8, transformer_layers=layers, shared_lm_head=shared).eval()
    head.attach_lm_head(lm_head)
    emb, hp = torch.randn(1, 4, 16), torch.randn(1, 16)
    full = head.draft_logits(hp, emb)
    for j in range(1, 5):  # the logits after a prefix do not depend on later draft tokens
        assert torch.allclose(head.draft_logits(hp, emb[:, :j])[:, -1], full[:, j - 1], atol=1e-5)
    head.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "sar_head.json").read_text())["parameters"] == head.num_parameters()
    assert torch.equal(DraftHead.from_pretrained(tmp_path).attach_lm_head(lm_head).draft_logits(hp, emb), full)
    assert "lm_head" not in " ".join(head.state_dict())


def test_sar_head_has_the_papers_shapes():
    head = DraftHead(576, 100, "simplified", k=4)  # H = 576, P = 1024
    assert head.w_p.weight.shape == (1024, 576) and head.w_q.weight.shape == (1024, 288)
    assert head.w_3.weight.shape == (100, 2048)
    assert head.mlp[0].weight.shape == (288, 576) and head.mlp[2].weight.shape == (288, 288)
    assert DraftHead(576, 100, "lstm").rnn.num_layers == 2


def test_k_beyond_the_heads_positions_and_unknown_variants_are_user_errors():
    target = tiny_llama(vocab_size=64)
    with pytest.raises(SpecReproError):
        SARDraftDecoder(target, None, head_for(target, "simplified", 2, 8, 1), SARDraftConfig(k=3, k_max=2))
    with pytest.raises(SpecReproError):
        DraftHead(16, 32, "medusa2")


def test_sampling_runs_through_speculative_verification():
    target = tiny_llama(vocab_size=64, num_layers=2)
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    gen = sar(target, "lstm", k=3).generate(prompt, Sampling(True, 0.8, 0, 1.0), 24, seed=1)
    assert len(gen.token_ids) == 24 and all(0 <= t < 64 for t in gen.token_ids)


@pytest.mark.embedded
def test_untrained_sar_draft_is_lossless_on_the_embedded_model(embedded):
    """Every head variant, drafting a chain and a tree, on the real architecture (GQA, RoPE): each of the ten pairs
    on one of three prompts in turn (the tiny-model tests above check every variant, k and controller at length)."""
    tok = embedded.tokenizer
    prompts = [
        tok(text, return_tensors="pt").input_ids
        for text in ("The capital of France is", "def fibonacci(n):", "Question: 3 apples plus 4 apples? Answer:")
    ]
    references = [ARDecoder(embedded.model, tok).generate(prompt, GREEDY, 48).token_ids for prompt in prompts]
    pairs = [(variant, tree_width) for variant in VARIANTS for tree_width in (1, 4)]
    for i, (variant, tree_width) in enumerate(pairs):
        torch.manual_seed(0)
        head = head_for(embedded.model, variant, 3, 256, 1).eval()
        cfg = SARDraftConfig(variant=variant, k=3 if tree_width == 1 else 2, k_max=3, tree_width=tree_width)
        prompt, reference = prompts[i % len(prompts)], references[i % len(prompts)]
        assert SARDraftDecoder(embedded.model, tok, head, cfg).generate(prompt, GREEDY, 48).token_ids == reference, (
            variant,
            tree_width,
        )


def test_training_through_the_cli_publishes_a_head_that_decodes_losslessly(tmp_path):
    shape = ["method=sar_draft", "method.variant=lstm", "method.proj_size=32", "method.k=3", "method.k_max=3"]
    specrepro(
        "train",
        "model=tiny_random",
        *shape,
        "training.references.gsm8k.limit=12",
        "training.references.sql.limit=6",
        "+dataset@training.continuations.gsm8k=gsm8k_train",
        "training.continuations.gsm8k.limit=4",
        "training.response_tokens=16",
        "training.loop.steps=4",
        "training.loop.batch_size=2",
        "training.anchors_per_batch=32",
        "hardware.threads=1",
        "logger=none",
        cwd=tmp_path,
    )
    (artifact,) = (tmp_path / "results" / "artifacts").glob("sar_head-tiny_random-*")
    metrics = json.loads((artifact / "artifact.json").read_text())["metrics"]
    assert (
        metrics["variant"] == "lstm"
        and metrics["head_parameters"] == DraftHead.from_pretrained(artifact).num_parameters()
    )
    assert len(metrics["heldout_top1_by_depth_after"]) == 4 and metrics["train_sequences"] >= 16
    assert list((tmp_path / "results" / "artifacts" / ".work").glob("continuations-*"))
    specrepro("run", *FAST, *shape, "dataset=gsm8k", "dataset.limit=2", "logger=none", cwd=tmp_path)
    run = next(p for k, p in run_dirs(tmp_path).items() if k.startswith("sar_draft:"))
    assert json.loads((run / "metrics.json").read_text())["lossless"] == 1.0
    first = json.loads((run / "generations.jsonl").read_text().splitlines()[0])
    assert first["samples"][0][0]["extra"]["extra_parameters"] == metrics["head_parameters"]
    reduced = [*shape, "method.draft_vocab=24"]
    specrepro(
        "train",
        "model=tiny_random",
        *reduced,
        "training.references.gsm8k.limit=12",
        "training.references.sql.limit=6",
        "training.response_tokens=16",
        "training.loop.steps=2",
        "training.loop.batch_size=2",
        "training.anchors_per_batch=32",
        "hardware.threads=1",
        "logger=none",
        cwd=tmp_path,
    )
    specrepro("run", *FAST, *reduced, "dataset=gsm8k", "dataset.limit=2", "logger=none", cwd=tmp_path)
    runs = [
        json.loads((p / "metrics.json").read_text())
        for k, p in run_dirs(tmp_path).items()
        if k.startswith("sar_draft:")
    ]
    assert len(runs) == 2 and all(m["lossless"] == 1.0 for m in runs)
    # joint mode (Eq. 8 with lam < 1): LoRA on the target; the artifact is the merged target with the head beside it
    joint = [*shape, "training.lam=0.25", "training.joint_lora.r=4"]
    specrepro(
        "train",
        "model=tiny_random",
        *joint,
        "training.references.gsm8k.limit=12",
        "training.references.sql.limit=6",
        "training.response_tokens=16",
        "training.loop.steps=2",
        "training.loop.batch_size=2",
        "training.anchors_per_batch=32",
        "hardware.threads=1",
        "logger=none",
        cwd=tmp_path,
    )
    (joint_head,) = [
        p for p in (tmp_path / "results" / "artifacts").glob("sar_head-tiny_random-*") if (p / "config.json").is_file()
    ]
    assert json.loads((joint_head / "artifact.json").read_text())["metrics"]["joint"] is True
    assert (
        find_head("sar_head", tmp_path / "results" / "artifacts", "tiny_random", "lstm", False) == artifact
    )  # not the base's
    specrepro(
        "run",
        *FAST,
        *shape,
        "model.name=tiny_sar_joint",
        "model.source=artifact",
        f"model.id={joint_head.name}",
        f"method.head={joint_head.name}",
        "dataset=gsm8k",
        "dataset.limit=2",
        "logger=none",
        cwd=tmp_path,
    )
    run = next(p for k, p in run_dirs(tmp_path).items() if k.startswith("sar_draft:") and "tiny_sar_joint" in p.name)
    assert json.loads((run / "metrics.json").read_text())["lossless"] == 1.0
    out = specrepro(
        "train",
        "model=tiny_random",
        *shape,
        "training.lam=0.5",
        "hardware.threads=1",
        "logger=none",
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 2 and "joint_lora.r" in out.stderr
    # a head of another variant is not picked up
    out = specrepro(
        "run",
        *FAST,
        "method=sar_draft",
        "method.variant=block",
        "dataset=gsm8k",
        "dataset.limit=1",
        "logger=none",
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 2 and "no sar_draft head artifact" in out.stderr


def test_a_head_on_conversations_reads_eagles_features_and_agrees_with_the_targets_top1(tmp_path):
    """The learning curve's SAR heads train on EAGLE's conversations: h_p is EAGLE's cached feature (one folder for
    both drafters), and held-out agreement compares with the target's own top-1, as EAGLE's does."""
    from specrepro.models import ModelLoader
    from specrepro.training.eagle_data import conversation_rows, features_dir
    from specrepro.training.sar_head import conversation_data, train_sar_head
    from tests.test_config import compose_run
    from tests.test_eagle import tiny_conversations

    data = [*tiny_conversations(tmp_path, 8, 40), "training.loop.bf16_autocast=false"]
    loop = ["training.loop.steps=2", "training.loop.batch_size=2", "training.loop.log_every=1"]
    cfg = compose_run(
        "method=sar_draft_tree", "method.proj_size=16", "training=sar_draft_sharegpt", *data, *loop, config="train"
    )
    eagle = compose_run("method=eagle", "training=eagle", *data, config="train")
    spec = cfg.training
    folder = features_dir(cfg, spec.conversations, spec.max_tokens, False)
    assert folder == features_dir(eagle, eagle.training.conversations, eagle.training.max_tokens, False)
    target = ModelLoader.for_hardware(cfg.hardware, cfg.artifacts_dir).load_model(cfg.model)
    rows, hidden, n_heldout, _ = conversation_data(cfg, target, spec)
    assert n_heldout == 2 and len(rows) > 2 and "target_top1" not in rows[2]
    (first, *_) = conversation_rows(spec.conversations, target.tokenizer, spec.max_tokens)
    with torch.no_grad():
        out = target.model(torch.tensor([first["ids"]]), output_hidden_states=True)
    assert rows[0]["continuation_ids"] == first["ids"][1:] and rows[0]["loss_mask"] == first["loss_mask"][1:]
    assert torch.allclose(hidden[0], out.hidden_states[-1][0, :-1], atol=1e-5)  # the feature that predicts each token
    assert rows[0]["target_top1"] == out.logits[0, :-1].argmax(-1).tolist()
    head, metrics, history = train_sar_head(cfg, target, tmp_path / "work", lambda *a: None, torch.device("cpu"))
    assert len(history) == 2 and metrics["heldout_top1_against"] == "the target's top-1"
    assert metrics["train_sequences"] == len(rows) - 2 and metrics["compute_minutes"] > 0
