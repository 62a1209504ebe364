"""Benchmark: our `ar` against transformers' `generate` (greedy), interleaved in one process.

`generate` runs twice: on the model as a user loads it (`from_pretrained`: torch's linears, transformers' sdpa)
and on the model as our loader gives it to `ar` (`hardware.*` kernels: oneDNN linears, our CPU attention).
Prints each arm's throughput, our `ar` over each `generate`, and the fraction of outputs token-identical to `ar`
on the same GSM8K prompts. Run: .venv/bin/python experiments/bench_ar.py [--limit 20] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse

import torch
from common import gsm8k_prompts, positive_int, run_script, timed_generate

from specrepro.config import HardwareConfig, ModelConfig
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.models import ModelLoader, load_model

ARMS = ("ar", "generate_ours", "generate_stock")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--linear-kernel", default="onednn", help="hardware.linear_kernel of our model: onednn | torch")
    args = parser.parse_args()
    hardware = HardwareConfig(
        device=args.device, dtype=args.dtype, threads=args.threads, linear_kernel=args.linear_kernel
    )
    loader = ModelLoader.for_hardware(hardware, "results/artifacts")
    model_cfg = ModelConfig(name="smollm2_135m", source="embedded")
    target = loader.load_model(model_cfg)
    stock = load_model(model_cfg, loader.device, loader.dtype).model
    prompts = gsm8k_prompts(target.tokenizer, args.limit, few_shot=1)
    ours = ARDecoder(target.model, target.tokenizer)
    eos, greedy = sorted(ours.eos_ids), Sampling()

    def run(arm: str, ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        if arm == "ar":
            gen = ours.generate(ids, greedy, max_new_tokens)
            return gen.token_ids, gen.wall_time
        return timed_generate(target.model if arm == "generate_ours" else stock, ids, max_new_tokens, eos)

    for arm in ARMS:  # warm-up
        run(arm, prompts[0], 16)
    totals = {arm: [0, 0.0] for arm in ARMS}
    identical = {arm: 0 for arm in ARMS[1:]}
    for i, ids in enumerate(prompts):
        outputs = {}
        for arm in ARMS[i % 3 :] + ARMS[: i % 3]:  # rotate the order so drift on a shared machine hits every arm
            outputs[arm], seconds = run(arm, ids, args.max_new_tokens)
            totals[arm][0] += len(outputs[arm])
            totals[arm][1] += seconds
        for arm in ARMS[1:]:
            identical[arm] += outputs[arm] == outputs["ar"]
    rate = {arm: tokens / seconds for arm, (tokens, seconds) in totals.items()}
    print(
        f"device={loader.device} dtype={args.dtype} threads={torch.get_num_threads()} "
        f"linear_kernel={args.linear_kernel} prompts={len(prompts)} max_new_tokens={args.max_new_tokens}"
    )
    print(f"ar              {rate['ar']:8.2f} tok/s")
    for arm in ARMS[1:]:
        print(
            f"{arm:15} {rate[arm]:8.2f} tok/s   ar / {arm}: {rate['ar'] / rate[arm]:.3f}   "
            f"token-identical to ar: {identical[arm]}/{len(prompts)}"
        )


if __name__ == "__main__":
    run_script(main)
