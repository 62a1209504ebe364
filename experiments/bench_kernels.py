"""CPU linear kernels side by side: torch's default vs oneDNN with prepacked weights (`hardware.linear_kernel`).

Prints, for each kernel in one process (interleaved, medians of repeats), the cost of a forward of T new
tokens on a 200-token cache relative to that kernel's own 1-token forward (the "verify cost" every
draft-then-verify method pays), the 1-token forward time ratio between the kernels, and `ar` throughput on
GSM8K prompts with both kernels plus whether their greedy outputs are token-identical.
`compare_settings` is shared with bench_attention.py.

With `--min-rows N` it compares oneDNN as is with oneDNN zero-padding every input of fewer than N rows to N
(`hardware.linear_min_rows`): its kernels for one or two rows stream the weights slower than those for 4-6.

    .venv/bin/python experiments/bench_kernels.py --threads 1 --dtype float32
    .venv/bin/python experiments/bench_kernels.py --threads 1 --min-rows 5

`--json` and `--markdown` also write the figures, with the machine and code that timed them, as a results page
(`results/cpu/kernels_*`: one per CPU and dtype, for the machines the leaderboard's rows were timed on).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from common import gsm8k_prompts, positive_int, provenance_lines
from transformers import DynamicCache

from specrepro.config import ModelConfig
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.models import load_model, resolve_dtype
from specrepro.metrics.speed import ci95
from specrepro.models.kernels import KERNELS, set_linear_kernel
from specrepro.provenance import machine_label, provenance
from specrepro.tracking import atomic_write

LENGTHS = (1, 2, 3, 5, 8, 16, 36)


def forward_ms(model, ids: torch.Tensor, length: int) -> float:
    cache = DynamicCache(config=model.config)
    model(ids[:, :200], cache=cache, logits_to_keep=1)
    start = time.perf_counter()
    model(ids[:, 200 : 200 + length], cache=cache)
    return 1e3 * (time.perf_counter() - start)


def benchmark_args(description: str, dtype: str, configure: Callable | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    if configure:
        configure(parser)
    parser.add_argument("--dtype", default=dtype)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


@torch.inference_mode()
def compare_settings(settings: dict[str, Callable[[torch.nn.Module], None]], args: argparse.Namespace) -> dict:
    """Time the embedded model under each setting (a callable that switches the model to it), interleaved: T-token
    forward costs relative to the setting's own 1-token forward, then `ar` throughput on GSM8K prompts. Prints
    them and returns them as figures (`markdown`'s)."""
    names = list(settings)
    target = load_model(
        ModelConfig(name="smollm2_135m", source="embedded"), torch.device("cpu"), resolve_dtype(args.dtype)
    )
    model = target.model
    ids = torch.randint(100, 20000, (1, 240), generator=torch.Generator().manual_seed(0))

    times = {(name, n): [] for name in names for n in LENGTHS}
    for _ in range(args.repeats):
        for name in names:  # interleaved, so drift on a shared machine hits every setting
            settings[name](model)
            for n in LENGTHS:
                times[name, n].append(forward_ms(model, ids, n))
    median = {key: statistics.median(values) for key, values in times.items()}
    print(f"dtype={args.dtype} threads={torch.get_num_threads()} repeats={args.repeats}")
    print("forward of T tokens / 1-token forward, same setting:")
    print("setting        1-token ms  " + "  ".join(f"T={n:<3}" for n in LENGTHS[1:]))
    for name in names:
        cells = "  ".join(f"{median[name, n] / median[name, 1]:5.2f}" for n in LENGTHS[1:])
        print(f"{name:13}  {median[name, 1]:10.1f}  {cells}")
    first, second = names[:2]
    print(f"1-token forward, {second} / {first}: {median[second, 1] / median[first, 1]:.2f}x")

    prompts = gsm8k_prompts(target.tokenizer, args.prompts)
    ar, greedy = ARDecoder(model, target.tokenizer), Sampling()
    totals = {name: [0, 0.0] for name in names}
    per_prompt: dict[str, list[float]] = {name: [] for name in names}  # tok/s
    outputs: dict[str, list] = {name: [] for name in names}
    for i, prompt in enumerate(prompts):
        for name in names if i % 2 == 0 else names[::-1]:
            settings[name](model)
            ar.generate(prompt, greedy, 2)  # untimed: a switched setting's first forward packs oneDNN's weights
            gen = ar.generate(prompt, greedy, args.max_new_tokens)
            totals[name][0] += len(gen.token_ids)
            totals[name][1] += gen.wall_time
            per_prompt[name].append(len(gen.token_ids) / gen.wall_time)
            outputs[name].append(gen.token_ids)
    rate = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
    ratios = [a / b for a, b in zip(per_prompt[first], per_prompt[second])]
    same = sum(a == b for a, b in zip(outputs[first], outputs[second]))
    print(
        f"ar on {len(prompts)} GSM8K prompts x {args.max_new_tokens} tokens: "
        + ", ".join(f"{name} {rate[name]:.1f} tok/s" for name in names)
        + f", {first} / {second} {rate[first] / rate[second]:.2f}x; token-identical outputs {same}/{len(prompts)}"
    )
    return {
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "one_token_ms": {name: median[name, 1] for name in names},
        "forward_cost": {name: {n: median[name, n] / median[name, 1] for n in LENGTHS[1:]} for name in names},
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "ar_tok_per_s": rate,
        "ar_ratio": {"of": [first, second], "mean": statistics.fmean(ratios), "ci95": ci95(ratios)},
        "identical": same,
    }


def markdown(figures: dict) -> str:
    """The figures as a results page: a row per setting (its `ar` and its forwards), then the provenance."""
    names, rate = list(figures["ar_tok_per_s"]), figures["ar_tok_per_s"]
    fastest = max(names, key=rate.get)
    lengths = list(figures["forward_cost"][names[0]])
    ratio, (first, second) = figures["ar_ratio"], figures["ar_ratio"]["of"]
    if math.isnan(ratio["ci95"]):
        resolved = "(one prompt: no interval)."
    else:
        holds_one = abs(ratio["mean"] - 1) <= ratio["ci95"]
        resolved = f"±{ratio['ci95']:.2f}x (95% interval){', which holds 1.00x: not resolved' if holds_one else ''}."
    native = figures["provenance"]["machine"].get("cpu_native_bf16")
    native_bf16_line = (
        [f"- This CPU computes bfloat16 natively: {'yes' if native else 'no (emulated)'}."]
        if figures["dtype"] == "bfloat16" and native is not None
        else []
    )
    lines = [
        f"# CPU linear kernels: which runs `ar` fastest on {machine_label(figures['provenance']['machine'])}",
        "",
        f"The embedded smollm2_135m in {figures['dtype']}, {figures['threads']} thread(s), each setting timed"
        " interleaved in one process (`hardware.linear_kernel`). `ar` tok/s: greedy on"
        f" {figures['prompts']} GSM8K prompts x {figures['max_new_tokens']} new tokens, the settings alternating"
        f" per prompt. A T-token forward (on a 200-token cache) is over the setting's own 1-token forward, the"
        f" median of {figures['repeats']}: what a verification of T - 1 drafts costs in that setting's `ar` steps."
        " Written by `experiments/bench_kernels.py`.",
        "",
        "| setting | `ar` tok/s | over the fastest `ar` | 1-token forward (ms) | "
        + " | ".join(f"T={n} forward / 1-token" for n in lengths)
        + " |",
        "|---|---|---|---|" + "---|" * len(lengths),
    ]
    for name in names:
        costs = " | ".join(f"{figures['forward_cost'][name][n]:.2f}" for n in lengths)
        lines.append(
            f"| `{name}` | {rate[name]:.1f} | {rate[name] / rate[fastest]:.2f}x | "
            f"{figures['one_token_ms'][name]:.1f} | {costs} |"
        )
    lines += [
        "",
        f"- The fastest `ar` here by tok/s: `{fastest}`. `{first}`'s `ar` over `{second}`'s, prompt by prompt:"
        f" {ratio['mean']:.2f}x {resolved} The settings' greedy outputs were token-identical on"
        f" {figures['identical']} of {figures['prompts']} prompts.",
        *native_bf16_line,
        "",
        *provenance_lines(figures["provenance"], figures["date"]),
    ]
    return "\n".join(lines) + "\n"


def use_onednn(min_rows: int, model: torch.nn.Module) -> None:
    set_linear_kernel(model, "onednn", min_rows)


def kernel_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--min-rows", type=int, default=1, help="compare oneDNN with and without zero-padding to this many rows"
    )
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--markdown", default=None, help="also write them as a results page")


def main() -> None:
    args = benchmark_args(__doc__.splitlines()[0], "float32", kernel_options)
    if args.min_rows > 1:
        settings = {"onednn": partial(use_onednn, 1), f"onednn_min{args.min_rows}": partial(use_onednn, args.min_rows)}
    else:
        settings = {kernel: lambda model, kernel=kernel: set_linear_kernel(model, kernel) for kernel in KERNELS}
    figures = compare_settings(settings, args)
    command = shlex.join(["python", "experiments/bench_kernels.py", *sys.argv[1:]])  # the repo's path, whatever ran it
    figures |= {
        "provenance": provenance({"dtype": args.dtype}, "cpu") | {"command": command},
        "date": time.strftime("%Y-%m-%d"),
    }
    if args.json:
        atomic_write(Path(args.json), json.dumps(figures, indent=1) + "\n")
    if args.markdown:
        atomic_write(Path(args.markdown), markdown(figures))


if __name__ == "__main__":
    main()
