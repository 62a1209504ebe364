"""Benchmark: our `ar` against transformers' `generate` (greedy), interleaved in one process.

Prints the throughput ratio (ours / HF) and the fraction of token-identical outputs on the same GSM8K
prompts. Run: .venv/bin/python experiments/bench_ar.py [--limit 20] [--max-new-tokens 128] [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

import torch

from specrepro.config import ModelConfig
from specrepro.data import load_records, render_prompt
from specrepro.data.config import DatasetConfig
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.base import device_sync
from specrepro.decoding.sampling import Sampling
from specrepro.models import load_model, resolve_device, resolve_dtype
from specrepro.models.kernels import set_linear_kernel


def hf_generate(model, ids: list[int], max_new_tokens: int, eos: list[int]) -> tuple[list[int], float]:
    tensor = torch.tensor([ids], device=model.device)
    device_sync(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=max_new_tokens,
                             do_sample=False, temperature=None, top_p=None, top_k=None, eos_token_id=eos)
    device_sync(model.device)
    return out[0, len(ids):].tolist(), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--linear-kernel", default="onednn", help="CPU nn.Linear kernel for both arms: onednn | torch")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    set_linear_kernel(args.linear_kernel)

    target = load_model(ModelConfig(name="smollm2_135m", source="embedded"), resolve_device(args.device),
                        resolve_dtype(args.dtype))
    dataset = DatasetConfig(name="gsm8k", path="gsm8k/test.jsonl.gz", task="gsm8k", template="hash_answer",
                            few_shot=1, shots_path="gsm8k/train.jsonl.gz", limit=args.limit, metric="gsm8k_acc")
    prompts = [target.tokenizer(render_prompt(r, target.tokenizer, dataset), add_special_tokens=False)["input_ids"]
               for r in load_records(dataset)]
    ours = ARDecoder(target.model, target.tokenizer)
    eos = sorted(ours.eos_ids)
    greedy = Sampling()
    ours.generate(prompts[0], greedy, 16)  # warm-up both paths
    hf_generate(target.model, prompts[0], 16, eos)

    totals = {"ours": [0, 0.0], "hf": [0, 0.0]}
    identical = 0
    for i, ids in enumerate(prompts):
        # alternate which arm goes first so drift on a shared machine hits both equally
        arms = ("ours", "hf") if i % 2 == 0 else ("hf", "ours")
        outputs = {}
        for arm in arms:
            if arm == "ours":
                gen = ours.generate(ids, greedy, args.max_new_tokens)
                outputs[arm], seconds = gen.token_ids, gen.wall_time
            else:
                outputs[arm], seconds = hf_generate(target.model, ids, args.max_new_tokens, eos)
            totals[arm][0] += len(outputs[arm])
            totals[arm][1] += seconds
        identical += outputs["ours"] == outputs["hf"]
    rate = {arm: tokens / seconds for arm, (tokens, seconds) in totals.items()}
    print(f"device={target.device} dtype={args.dtype} threads={torch.get_num_threads()} "
          f"linear_kernel={args.linear_kernel} prompts={len(prompts)} "
          f"max_new_tokens={args.max_new_tokens}")
    print(f"ours ar: {rate['ours']:.2f} tok/s   HF generate: {rate['hf']:.2f} tok/s")
    print(f"throughput ratio ours/HF: {rate['ours'] / rate['hf']:.3f}")
    print(f"token-identical outputs: {identical}/{len(prompts)} ({100 * identical / len(prompts):.0f}%)")


if __name__ == "__main__":
    main()
