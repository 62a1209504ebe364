"""Attention kernels side by side in bf16: SDPA as transformers runs it vs `hardware.row_invariant`'s attention.

The row-invariant attention (models/attention.py) runs every forward after a cache one query row at a time, in
fp32 on the upcast query, keys and values. Prints, in one process (interleaved, medians of repeats), the
1-token forward time of each on a 200-token cache, the cost of a T-token forward relative to each one's own
1-token forward (the verify cost), and `ar` throughput on GSM8K prompts with both (outputs may differ: the two
round differently).

    .venv/bin/python experiments/bench_attention.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench_kernels import LENGTHS, forward_ms
from specrepro.config import ModelConfig
from specrepro.data import DatasetConfig, load_records, render_prompt
from specrepro.decoding import ARDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.models import load_model, resolve_dtype
from specrepro.models.attention import ATTENTIONS, set_attention
from specrepro.models.kernels import set_linear_kernel, set_row_invariant_linear


def use(attention: str) -> None:
    set_attention(attention)
    set_row_invariant_linear(attention == "row_invariant")


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    set_linear_kernel("onednn")
    target = load_model(ModelConfig(name="smollm2_135m", source="embedded"), torch.device("cpu"),
                        resolve_dtype(args.dtype))
    model = target.model
    ids = torch.randint(100, 20000, (1, 240), generator=torch.Generator().manual_seed(0))

    times = {(kind, n): [] for kind in ATTENTIONS for n in LENGTHS}
    for _ in range(args.repeats):
        for kind in ATTENTIONS:  # interleaved, so drift on a shared machine hits both
            use(kind)
            for n in LENGTHS:
                times[kind, n].append(forward_ms(model, ids, n))
    median = {key: statistics.median(values) for key, values in times.items()}
    print(f"dtype={args.dtype} threads={torch.get_num_threads()} repeats={args.repeats}")
    print("forward of T tokens / 1-token forward, same attention:")
    print("attention      1-token ms  " + "  ".join(f"T={n:<3}" for n in LENGTHS[1:]))
    for kind in ATTENTIONS:
        cells = "  ".join(f"{median[kind, n] / median[kind, 1]:5.2f}" for n in LENGTHS[1:])
        print(f"{kind:13}  {median[kind, 1]:10.1f}  {cells}")
    print(f"1-token forward, sdpa / row_invariant: {median['sdpa', 1] / median['row_invariant', 1]:.2f}x")

    dataset = DatasetConfig(name="gsm8k", path="gsm8k/test.jsonl.gz", task="gsm8k", template="hash_answer",
                            limit=args.prompts, metric="gsm8k_acc")
    prompts = [target.tokenizer(render_prompt(r, target.tokenizer, dataset), add_special_tokens=False)["input_ids"]
               for r in load_records(dataset)]
    ar, greedy = ARDecoder(model, target.tokenizer), Sampling()
    totals = {kind: [0, 0.0] for kind in ATTENTIONS}
    outputs: dict[str, list] = {kind: [] for kind in ATTENTIONS}
    for i, prompt in enumerate(prompts):
        for kind in ATTENTIONS if i % 2 == 0 else ATTENTIONS[::-1]:
            use(kind)
            gen = ar.generate(prompt, greedy, args.max_new_tokens)
            totals[kind][0] += len(gen.token_ids)
            totals[kind][1] += gen.wall_time
            outputs[kind].append(gen.token_ids)
    rate = {kind: tokens / seconds for kind, (tokens, seconds) in totals.items()}
    same = sum(a == b for a, b in zip(outputs["sdpa"], outputs["row_invariant"]))
    print(f"ar on {len(prompts)} GSM8K prompts x {args.max_new_tokens} tokens: row_invariant "
          f"{rate['row_invariant']:.1f} tok/s, sdpa {rate['sdpa']:.1f} tok/s, ratio "
          f"{rate['row_invariant'] / rate['sdpa']:.2f}x; identical outputs {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
