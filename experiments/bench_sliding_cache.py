"""What drafting past a sliding window costs: a one-token step on the model's own sliding cache, on the cache a
decoder that rolls back keeps (`steps.rollback_cache`) and on a full-key cache (what that was before), side by side.

transformers' sliding cache layer keeps only the window's keys. A rolling-back decoder's layers record their past
instead: a step's keys stay until the rollback, which trims the layer to its window again (`verify.crop_cache`).
The full-key cache keeps every key and its mask hides the ones past the window: past the window its sliding layers
attend the whole cache. The model is the embedded one's weights in a Mistral, whose every layer slides (`--window`
tokens). Prints, in one process (interleaved, medians of repeats), the per-token time of greedy one-token steps
after contexts below and past the window on each cache (the rolling-back one cropped after each step, as a
decoder's rounds crop it), each one's ratio to the sliding cache, and whether all decoded the same tokens.

    .venv/bin/python experiments/bench_sliding_cache.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM
from transformers.cache_utils import DynamicLayer

from common import run_script
from specrepro.config import ModelConfig
from specrepro.decoding.steps import rollback_cache
from specrepro.decoding.verify import crop_cache
from specrepro.models.loading import load_model


def sliding_copy(model, window: int) -> MistralForCausalLM:
    """`model` (a LLaMA) as a Mistral whose every layer attends `window` past positions: the same weights."""
    config = MistralConfig(**{**model.config.to_dict(), "sliding_window": window, "architectures": None})
    mistral = MistralForCausalLM(config).eval()
    mistral.load_state_dict(model.state_dict())
    return mistral


def full_key_cache(config) -> DynamicCache:
    """A cache whose sliding layers keep every key, the window applied by the mask alone."""
    cache = DynamicCache(config=config)
    cache.layers = [DynamicLayer() for _ in cache.layers]
    return cache


@torch.inference_mode()
def step_ms(model, cache, context: torch.Tensor, tokens: int) -> tuple[float, list[int]]:
    """Milliseconds per greedy one-token step after prefilling `context` into `cache`, and the tokens decoded."""
    token = model(context, cache=cache, logits_to_keep=1).logits.argmax(-1)
    decoded = []
    start = time.perf_counter()
    for _ in range(tokens):
        token = model(token, cache=cache, logits_to_keep=1).logits.argmax(-1)
        crop_cache(cache, context.shape[1] + len(decoded) + 1)  # a round's rollback: nothing rejected
        decoded.append(int(token))
    return 1000 * (time.perf_counter() - start) / tokens, decoded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 2048])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model(ModelConfig(name="smollm2_135m", source="embedded"), torch.device("cpu"), torch.float32)
    model = sliding_copy(target.model, args.window)
    caches = {
        "sliding": lambda: DynamicCache(config=model.config),
        "rollback": lambda: rollback_cache(model.config),
        "full_key": lambda: full_key_cache(model.config),
    }
    generator = torch.Generator().manual_seed(0)
    contexts = {n: torch.randint(100, 20000, (1, n), generator=generator) for n in args.contexts}
    times = {(name, n): [] for name in caches for n in contexts}
    same = {n: True for n in contexts}
    for _ in range(args.repeats):
        for n, context in contexts.items():
            decoded = {}
            for name, new_cache in caches.items():  # interleaved: drift on a shared machine hits both
                ms, decoded[name] = step_ms(model, new_cache(), context, args.tokens)
                times[name, n].append(ms)
            same[n] &= decoded["sliding"] == decoded["rollback"] == decoded["full_key"]
    print(f"window={args.window} threads={torch.get_num_threads()} repeats={args.repeats} tokens={args.tokens}")
    columns = "sliding ms/token  rollback ms/token  full-key ms/token  rollback / sliding  full-key / sliding"
    print(f"context  {columns}  same")
    for n in contexts:
        sliding, rollback, full = (statistics.median(times[name, n]) for name in caches)
        print(
            f"{n:7}  {sliding:16.2f}  {rollback:17.2f}  {full:17.2f}  {rollback / sliding:18.2f}  "
            f"{full / sliding:18.2f}  {same[n]}"
        )


if __name__ == "__main__":
    run_script(main)
