"""Where a decoded token's time goes: our compiled `ar` against transformers' static-cache compiled `generate`.

For each arm (our compiled `ar` with its static cache rounded up to each of `--cache-multiples`, with
`--differentiating-guards` each also checking only the guards that tell its graphs apart
(`hardware.compile_guards=differentiating`), with `--freezing` each also on weights folded into its graphs
(`hardware.compile_freezing=true`; with both flags, also both at once), and transformers' `generate`), one
warmed-up greedy generation of `--tokens` new tokens on the longest of bench_gpu.py's five GSM8K prompts (our cache
sized as that bench sizes it): wall milliseconds per token unprofiled, and under torch.profiler wall and device
(kernel) milliseconds and kernel launches per token, host-side aten operators per token and the costliest kernels.
Wall well above kernel time says the arm waits on the host (launches, syncs, Python); kernel time near wall says
the graph's own kernels bound it: `wall_over_kernel`, the unprofiled wall over the kernel time, says which.
Run: python experiments/profile_steps.py [--dtype float32] [--tokens 256] [--differentiating-guards] [--freezing]
     [--json out.json]
(`--device cpu --backend aot_eager` checks the script on a CPU.)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from common import composed, gsm8k_prompts, positive_int, run_script, timed_generate
from torch.profiler import ProfilerActivity, profile

from specrepro.config import HardwareConfig
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.device import device_sync
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.steps import CompiledSteps
from specrepro.models import ModelLoader, load_model
from specrepro.runner import compile_steps_for
from specrepro.tracking import atomic_write


def profiled(fn, device: torch.device, top: int) -> dict:
    """fn() under torch.profiler: per-token wall and kernel milliseconds, and the `top` kernels by total time."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    device_sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        produced = fn()
        device_sync(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    on_device = [e for e in events if e.device_type.name == "CUDA"] if device.type == "cuda" else []
    kernel_us = sum(e.self_device_time_total for e in on_device)
    host_ops = sum(e.count for e in events if e.device_type.name == "CPU" and e.key.startswith("aten::"))
    ranked = sorted(on_device, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    return {
        "tokens": produced,
        "wall_ms_per_token": 1e3 * wall / produced,
        "kernel_ms_per_token": kernel_us / 1e3 / produced,
        "kernels_per_token": sum(e.count for e in on_device) / produced,
        "aten_ops_per_token": host_ops / produced,
        "top_kernels": [
            {
                "name": e.key[:100],
                "calls_per_token": e.count / produced,
                "us_per_token": e.self_device_time_total / produced,
            }
            for e in ranked
        ],
    }


def multiples(value: str) -> list[int]:
    """--cache-multiples: positive integers, comma-separated."""
    return [positive_int(multiple) for multiple in value.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=positive_int, default=256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument(
        "--cache-multiples",
        type=multiples,
        default="64",
        help="our arms' static cache lengths round up to these multiples (one arm each, ar_compiled_c<N>)",
    )
    parser.add_argument(
        "--differentiating-guards",
        action="store_true",
        help="each also checking only the guards that tell its graphs apart (ar_compiled_c<N>_differentiating_guards)",
    )
    parser.add_argument(
        "--freezing",
        action="store_true",
        help="each also on weights folded into its graphs (ar_compiled_c<N>_frozen; hardware.compile_freezing=true)",
    )
    parser.add_argument("--model", default="smollm2_135m", help="a model preset with overrides, as bench_gpu.py takes")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    hardware = HardwareConfig(
        device=args.device,
        dtype=args.dtype,
        linear_kernel="torch",
        compile=True,
        compile_backend=args.backend,
        compile_widths=[1, 16],
    )
    loader = ModelLoader.for_hardware(hardware, "results/artifacts")
    model_cfg = composed("model", args.model)
    target = loader.load_model(model_cfg)
    stock = load_model(model_cfg, loader.device, loader.dtype).model
    ids = max(gsm8k_prompts(target.tokenizer, 5, few_shot=1), key=len)
    mode = "reduce-overhead" if loader.device.type == "cuda" else None
    settings = {  # an arm's name suffix -> its steps' keywords
        "": {},
        **({"_differentiating_guards": {"guards": "differentiating"}} if args.differentiating_guards else {}),
        **({"_frozen": {"freezing": True}} if args.freezing else {}),
        **(
            {"_frozen_differentiating_guards": {"guards": "differentiating", "freezing": True}}
            if args.freezing and args.differentiating_guards
            else {}
        ),
    }
    decoders = {
        f"ar_compiled_c{multiple}{suffix}": ARDecoder(
            target.model,
            target.tokenizer,
            steps=CompiledSteps(target.model, args.backend, mode, hardware.compile_widths, multiple, **setting),
        )
        for multiple in args.cache_multiples
        for suffix, setting in settings.items()
    }
    eos = sorted(next(iter(decoders.values())).eos_ids)

    def ours(decoder):
        return lambda: len(decoder.generate(ids, Sampling(), args.tokens).token_ids)

    def generate():
        return len(timed_generate(stock, ids, args.tokens, eos, static=True, backend=args.backend)[0])

    figures = {
        "device": torch.cuda.get_device_name() if loader.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "prompt_tokens": len(ids),
        "new_tokens": args.tokens,
    }
    arms = {name: ours(decoder) for name, decoder in decoders.items()} | {"generate_compiled": generate}
    for name, fn in arms.items():
        if name in decoders:
            compile_steps_for(len(ids) + args.tokens, [decoders[name]])
            figures[f"{name}_cache_len"] = decoders[name].steps.cache_len
        fn(), fn()  # compile, record the CUDA graphs
        device_sync(loader.device)
        start = time.perf_counter()
        produced = fn()
        device_sync(loader.device)
        unprofiled = 1e3 * (time.perf_counter() - start) / produced
        arm = figures[name] = profiled(fn, loader.device, args.top)
        arm["unprofiled_ms_per_token"] = unprofiled
        # the unprofiled wall over the kernels' time: 1.0 when the kernels bound a token (the profiler adds host time)
        arm["wall_over_kernel"] = unprofiled / arm["kernel_ms_per_token"] if arm["kernel_ms_per_token"] else None
        print(
            f"{name}: {unprofiled:.3f} ms/token unprofiled; profiled: {arm['wall_ms_per_token']:.3f} wall, "
            f"{arm['kernel_ms_per_token']:.3f} kernel in {arm['kernels_per_token']:.0f} launches"
            + (f" (unprofiled wall {arm['wall_over_kernel']:.2f}x kernel)" if arm["wall_over_kernel"] else "")
            + ", "
            f"{arm['aten_ops_per_token']:.1f} aten ops/token on the host ({arm['tokens']} tokens)",
            flush=True,
        )
        for kernel in arm["top_kernels"]:
            print(f"  {kernel['us_per_token']:8.1f} us/token {kernel['calls_per_token']:6.1f} calls  {kernel['name']}")
        if args.json:  # after every arm: a run cut off by a lent machine's limit keeps the arms it profiled
            atomic_write(Path(args.json), json.dumps(figures, indent=1))
    print(
        f"prompt {len(ids)} tokens; our static caches: "
        + ", ".join(f"{name} {figures[f'{name}_cache_len']}" for name in decoders)
    )


if __name__ == "__main__":
    run_script(main)
