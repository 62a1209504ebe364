"""What token-tree verification would buy a trained sar_draft head: MAT of chains vs trees, simulated exactly.

Greedy verification accepts the longest path of the draft tree that matches the target's own greedy tokens, so
on a finished greedy run (its generations.jsonl) the accepted length of every step follows from the head alone:
one target forward over prompt + output gives h_p at every position, and the head's top-w children at each tree
node (depth d, width widths[d]; SAR variants condition on the node's path) are matched against the output.
Prints MAT and the number of tree nodes for each shape; a tree of n nodes is verified by an (n + 1)-token
forward, whose cost relative to a 1-token step `experiments/bench_kernels.py` / `bench_attention.py` measure.

    .venv/bin/python experiments/sar_tree_bound.py smollm2_135m-sar_draft-gsm8k-greedy-4b491a42 \
        sar_head-smollm2_135m-c863ad31
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specrepro.config import ModelConfig
from specrepro.decoding.sar_draft import DraftHead
from specrepro.models import load_model

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
    results = Path(args.results_dir)
    target = load_model(ModelConfig(name="smollm2_135m", source="embedded"), torch.device("cpu"), torch.float32)
    model, tokenizer = target.model, target.tokenizer
    head = DraftHead.from_pretrained(results / "artifacts" / args.head).attach_lm_head(model.lm_head)
    embed = model.get_input_embeddings()
    sequences = []  # (output tokens, h_p rows: row i produced output token i)
    for line in (results / "runs" / args.run / "generations.jsonl").read_text().splitlines():
        record = json.loads(line)
        prompt = tokenizer(record["prompts"][0], return_tensors="pt", add_special_tokens=False).input_ids[0]
        output = record["samples"][0][0]["token_ids"]
        hidden = model.model(torch.cat([prompt, torch.tensor(output)])[None]).last_hidden_state[0]
        sequences.append((output, hidden[len(prompt) - 1:]))
    ranked: dict[tuple, list[int]] = {}

    def children(seq: int, t: int, path: list[int], width: int) -> list[int]:
        key = (seq, t, tuple(path))
        if key not in ranked:
            hp = sequences[seq][1][t]
            logits = head.draft_logits(hp[None], embed(torch.tensor(path))[None])[0, -1]
            ranked[key] = head.full_vocab_logits(logits).topk(max(w for s in SHAPES for w in s)).indices.tolist()
        return ranked[key][:width]

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
        nodes = sum(int(torch.tensor(widths[: d + 1]).prod()) for d in range(len(widths)))
        print(f"tree {widths}: {nodes} nodes (a {nodes + 1}-token verification), MAT {tokens / steps:.3f}", flush=True)


if __name__ == "__main__":
    main()
