"""What token-tree verification would buy a trained sar_draft head: MAT of chains vs trees, simulated exactly.

Greedy verification accepts the longest path of the draft tree that matches the target's own greedy tokens, so
on a finished greedy run (its generations.jsonl) the accepted length of every step follows from the head alone:
one target forward over prompt + output gives h_p at every position, and the head's top-w children at each tree
node (depth d, width widths[d]; SAR variants condition on the node's path) are matched against the output.
A tree of n nodes is verified by an (n + 1)-token forward; its cost relative to a 1-token step is timed on the
first prompt's cache (fp32, oneDNN linear, a 4-D mask as a tree needs, medians of 9), and MAT / cost is the
speedup bound before drafting costs (`bench_attention.py` times the bf16 row-invariant path).

    .venv/bin/python experiments/sar_tree_bound.py smollm2_135m-sar_draft-gsm8k-greedy-4b491a42 \
        sar_head-smollm2_135m-c863ad31
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from specrepro.config import ModelConfig
from specrepro.decoding.sar_draft import DraftHead
from specrepro.decoding.verify import additive_mask, crop_cache
from specrepro.models import load_model
from specrepro.models.kernels import set_linear_kernel

REPEATS = 9
SHAPES = ([1], [1, 1], [1, 1, 1], [2], [3], [5], [2, 1], [3, 1], [3, 2], [4, 2], [5, 2], [3, 2, 1], [4, 2, 1])


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a greedy sar_draft (or ar) run under results/runs")
    parser.add_argument("head", help="a sar_head artifact under results/artifacts")
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    set_linear_kernel("onednn")
    results = Path(args.results_dir)
    target = load_model(ModelConfig(name="smollm2_135m", source="embedded"), torch.device("cpu"), torch.float32)
    model, tokenizer = target.model, target.tokenizer
    head = DraftHead.from_pretrained(results / "artifacts" / args.head).attach_lm_head(model.lm_head)
    embed = model.get_input_embeddings()
    sequences, prompts = [], []  # (output tokens, h_p rows: row i produced output token i), prompt ids
    for line in (results / "runs" / args.run / "generations.jsonl").read_text().splitlines():
        record = json.loads(line)
        prompt = tokenizer(record["prompts"][0], return_tensors="pt", add_special_tokens=False).input_ids[0]
        output = record["samples"][0][0]["token_ids"]
        hidden = model.model(torch.cat([prompt, torch.tensor(output)])[None]).last_hidden_state[0]
        sequences.append((output, hidden[len(prompt) - 1:]))
        prompts.append(prompt)
    ranked: dict[tuple, list[int]] = {}

    def children(seq: int, t: int, path: list[int], width: int) -> list[int]:
        key = (seq, t, tuple(path))
        if key not in ranked:
            hp = sequences[seq][1][t]
            logits = head.draft_logits(hp[None], embed(torch.tensor(path))[None])[0, -1]
            ranked[key] = head.full_vocab_logits(logits).topk(max(w for s in SHAPES for w in s)).indices.tolist()
        return ranked[key][:width]

    prompt = prompts[0][None]  # verifications are timed on the first prompt's cache
    cache = DynamicCache(config=model.config)
    model(prompt, past_key_values=cache)

    def forward_s(tokens: int) -> float:
        allow = torch.ones(tokens, prompt.shape[1] + tokens, dtype=torch.bool).tril(prompt.shape[1])
        start = time.perf_counter()
        model(prompt[:, :tokens], past_key_values=cache, attention_mask=additive_mask(allow, model.dtype),
              position_ids=torch.arange(prompt.shape[1], prompt.shape[1] + tokens)[None])
        elapsed = time.perf_counter() - start
        crop_cache(cache, prompt.shape[1])
        return elapsed

    one_token = statistics.median(forward_s(1) for _ in range(REPEATS))
    for widths in SHAPES:
        steps = tokens = 0
        for seq, (output, _) in enumerate(sequences):
            t = 0  # output[t] is the last committed token; the tree's root
            while t < len(output) - 1:
                path = [output[t]]
                for depth, width in enumerate(widths):
                    nxt = t + 1 + depth
                    if nxt >= len(output) or output[nxt] not in children(seq, t, path, width):
                        break
                    path.append(output[nxt])
                t += len(path)
                steps += 1
                tokens += len(path)
        nodes = sum(math.prod(widths[: d + 1]) for d in range(len(widths)))
        cost = statistics.median(forward_s(nodes + 1) for _ in range(REPEATS)) / one_token
        print(f"tree {widths}: {nodes} nodes, MAT {tokens / steps:.3f}, a {nodes + 1}-token verification costs "
              f"{cost:.2f} AR steps, MAT / cost {tokens / steps / cost:.2f}", flush=True)


if __name__ == "__main__":
    main()
