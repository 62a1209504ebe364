"""Benchmark on a CPU: our decoding against llama.cpp's, the engine a CPU user runs, on the embedded model.

The embedded SmolLM2-135M-Instruct is a Q4_1 GGUF. `specrepro run` decodes it dequantised to float32 in PyTorch;
llama.cpp runs the GGUF itself (4-bit weights, its own kernels). Arms, interleaved per prompt in one process
(greedy, the same GSM8K prompt token ids, the same thread count):
- `ar`, `pld`: our `ar` and prompt lookup, as `specrepro run` decodes them (hardware defaults);
- `llamacpp_ar`: llama-cpp-python's `Llama.generate` on the GGUF;
- `llamacpp_lookup`: the same with its `LlamaPromptLookupDecoding` draft, given our pld's longest n-gram and
  draft length (it takes the earliest match, so our `pld` arm does too: `method.match=earliest`).
Prints and writes (--json, --markdown) each arm's throughput, llama.cpp's AR over ours (absolute speed), each
lookup's paired speedup over its own engine's AR and its MAT, and which outputs are token-identical: each
lookup to its own AR (lossless), and llama.cpp's AR to ours (4-bit weights times 8-bit activations against
float32: the greedy paths may part, which the shared-prefix figure measures).
Needs llama-cpp-python, which builds llama.cpp from source: `pip install -e '.[cpu-peer]'` (about 20 minutes on
2 cores). A VM whose CPU reports AMX without the hypervisor enabling it kills the native build's first batched
matmul with SIGILL (`tileloadd`); build it for AVX-512 without AMX there: CMAKE_ARGS="-DGGML_NATIVE=OFF
-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON".
Run: python experiments/bench_llamacpp.py [--limit 10] [--max-new-tokens 128] [--threads 1]
     [--json results/cpu/llamacpp.json --markdown results/cpu/llamacpp.md]
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from statistics import fmean, median

import numpy as np
import torch
from common import composed, gsm8k_prompts, positive_int, provenance_lines, run_script
from omegaconf import OmegaConf
from tqdm import tqdm

from specrepro.config import HardwareConfig
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.pld import PLDConfig, PLDDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.steps import EagerSteps
from specrepro.decoding.verify import crop_cache
from specrepro.errors import SpecReproError
from specrepro.models import ModelLoader
from specrepro.models.loading import embedded_gguf_path
from specrepro.provenance import provenance
from specrepro.tracking import atomic_write

ARMS = ("ar", "pld", "llamacpp_ar", "llamacpp_lookup")
REPEATS = 21  # back-to-back pairs of forwards timed for a width's cost; the median counts
LOOKUPS = {"pld": "ar", "llamacpp_lookup": "llamacpp_ar"}  # each lookup arm and its own engine's AR


class LlamaCppArm:
    """Greedy decoding with llama-cpp-python on a GGUF, optionally with its prompt-lookup draft; counts the
    target forwards after the prompt's (one per draft the lookup is asked for)."""

    def __init__(self, gguf: Path, n_ctx: int, threads: int, lookup: PLDConfig | None = None):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.drafts = 0
        draft = None
        if lookup is not None:
            prompt_lookup = LlamaPromptLookupDecoding(
                max_ngram_size=lookup.max_ngram, num_pred_tokens=lookup.num_pred_tokens
            )

            def draft(input_ids, **kwargs):
                self.drafts += 1
                return prompt_lookup(input_ids, **kwargs)

        self.llm = Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            draft_model=draft,
            verbose=False,
        )

    def generate(self, ids: list[int], max_new_tokens: int, eos: set[int]) -> tuple[list[int], float, int]:
        """(new tokens ending with EOS if one came, seconds, target forwards after the prompt's)."""
        self.drafts, tokens = 0, []
        start = time.perf_counter()
        self.llm.reset()  # no reuse of an earlier call's prompt cache
        for token in self.llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0):
            tokens.append(token)
            if token in eos or len(tokens) == max_new_tokens:
                break
        seconds = time.perf_counter() - start
        return tokens, seconds, self.drafts if self.llm.draft_model else len(tokens) - 1

    def forward_timer(self, ids: list[int]):
        """A function timing one forward over `width` tokens after the prompt `ids`, which it evaluates once (all
        rows' logits when the arm keeps them, as a lookup's verification does)."""
        self.llm.reset()
        self.llm.eval(ids)

        def seconds(width: int) -> float:
            self.llm.n_tokens = len(ids)
            self.llm._ctx.kv_cache_seq_rm(-1, len(ids), -1)  # as Llama.generate rolls back a rejected draft
            start = time.perf_counter()
            self.llm.eval(ids[-width:])
            return time.perf_counter() - start

        return seconds

    def batched_mismatches(self, ids: list[int], tokens: list[int]) -> list[float]:
        """Where one batched forward over the prompt and `tokens` (a greedy output) picks another token than
        `tokens` has, that is, where a verification forward disagrees with the one-token steps that chose them:
        the logit by which its pick beats the token the steps chose, per such position. Needs the logits of every
        position (a lookup arm keeps them)."""
        self.llm.reset()
        self.llm.eval(ids + tokens[:-1])
        scores = self.llm.scores[len(ids) - 1 : len(ids) - 1 + len(tokens)]
        chosen = scores[np.arange(len(tokens)), tokens]
        return [float(gap) for gap in scores.max(axis=-1) - chosen if gap > 0]


def our_forward_timer(model, ids: list[int]):
    """A function timing one forward of our model over `width` tokens after the prompt `ids`, every row's logits
    kept (as our verification does), on the eager steps our decoders run; the prompt is evaluated once."""
    steps = EagerSteps(model)
    cache = steps.new_cache(len(ids))
    with torch.inference_mode():
        steps(torch.tensor([ids], device=model.device), cache, logits_to_keep=1)

    def seconds(width: int) -> float:
        tokens = torch.tensor([ids[-width:]], device=model.device)
        with torch.inference_mode():
            start = time.perf_counter()
            steps(tokens, cache, logits_to_keep=width)
            elapsed = time.perf_counter() - start
            crop_cache(cache, len(ids))
        return elapsed

    return seconds


def width_cost(seconds, width: int) -> float:
    """A forward over `width` tokens in one-token forwards: the median over REPEATS pairs timed back to back."""
    return median(seconds(width) / seconds(1) for _ in range(REPEATS))


def mean_accepted(results: list[dict]) -> float:
    """An arm's tokens after the prefill's per step; NaN where it ran no step (a one-token budget)."""
    steps = sum(r["steps"] for r in results)
    return sum(len(r["tokens"]) - 1 for r in results) / steps if steps else math.nan


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def markdown(figures: dict) -> str:
    """The figures as a results page: one row per arm, then the provenance."""
    prov, rate, mismatches = figures["provenance"], figures["tok_per_s"], figures["llamacpp_batched_mismatches"]
    engines = {
        "ar": "specrepro `ar`",
        "pld": "specrepro `pld`",
        "llamacpp_ar": "llama.cpp",
        "llamacpp_lookup": "llama.cpp prompt lookup",
    }
    weights = {"ar": "float32 (the GGUF dequantised)", "llamacpp_ar": "Q4_1 GGUF"}
    lines = [
        "# Our decoding against llama.cpp on a CPU",
        "",
        f"The embedded {figures['model']} on {figures['prompts']} GSM8K prompts x up to {figures['max_new_tokens']}"
        f" new tokens, greedy, {prov['threads']} thread(s), every arm on the same prompt token ids, interleaved per "
        "prompt. Written by `experiments/bench_llamacpp.py` (its docstring defines the arms); speedup = the mean "
        "over prompts of a lookup's tokens/s over its own engine's AR on that prompt; MAT = tokens per target "
        "forward after the prompt's.",
        "",
        "| arm | engine | weights | tok/s | speedup over its engine's AR | MAT | token-identical to |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        base = LOOKUPS.get(arm, "ar" if arm == "llamacpp_ar" else None)
        speedup = f"{figures['lookup_speedup'][arm]:.2f}x" if arm in LOOKUPS else "–"
        identical = f"`{base}`: {figures['identical'][arm]}/{figures['prompts']}" if base else "–"
        lines.append(
            f"| `{arm}` | {engines[arm]} | {weights[LOOKUPS.get(arm, arm)]} | {rate[arm]:.1f} | {speedup} | "
            f"{figures['mat'][arm]:.2f} | {identical} |"
        )
    lines += [
        "",
        f"- llama.cpp's AR over ours (tok/s, paired): {figures['llamacpp_ar_over_ar']:.2f}x.",
        f"- One forward over {figures['verify_width']} tokens (a whole verification: a draft of"
        f" {figures['verify_width'] - 1} and the token before it) costs {figures['verify_cost']['ours']:.2f}"
        f" one-token forwards in ours and {figures['verify_cost']['llamacpp']:.2f} in llama.cpp (the median of"
        f" {figures['verify_cost_pairs']} pairs timed back to back, after the first prompt): a lookup step's cost"
        " when its draft is whole; a shorter draft, or none where no n-gram matches, costs less.",
        f"- Where llama.cpp's and our greedy AR part: on average after {figures['shared_prefix_share']:.0%} of the"
        " shorter output (4-bit weights times 8-bit activations against float32; a lookup is checked against its"
        " own engine's AR).",
        f"- llama.cpp's batched forward, which its lookup verifies drafts with, run once over prompt and llama.cpp's"
        f" AR output, picks another token than its one-token steps did in {sum(map(bool, mismatches))} of"
        f" {len(mismatches)} outputs ({sum(map(len, mismatches))} positions, by at most"
        f" {max((max(m) for m in mismatches if m), default=0):.3f} in logit): its kernels give a batch other logits"
        " than a single token, so where two tokens are that close its lookup follows another greedy path than its"
        " AR. "
        + (
            "Our `pld` equals our `ar` token for token here and in the tests."
            if figures["identical"]["pld"] == figures["prompts"]
            else f"Our `pld` left our `ar`'s tokens on {figures['prompts'] - figures['identical']['pld']} of"
            f" {figures['prompts']} prompts here."
        ),
        "",
        *provenance_lines(prov, figures["date"], versions_extra=f", llama-cpp-python {figures['llama_cpp_python']}"),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="both engines' threads (default: torch's)")
    parser.add_argument(
        "--pld",
        default="pld method.match=earliest",
        help="our pld arm: the pld preset with overrides; llama.cpp's lookup gets its max_ngram and num_pred_tokens",
    )
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--markdown", default=None, help="also write them as a results page")
    args = parser.parse_args()
    pld_cfg = OmegaConf.to_object(composed("method", args.pld))
    if not isinstance(pld_cfg, PLDConfig) or (pld_cfg.match, pld_cfg.min_ngram, pld_cfg.controller) != (
        "earliest",
        1,
        "fixed",
    ):
        raise SpecReproError(
            f"--pld must be a pld preset that drafts as llama.cpp's lookup does (method.match="
            f"earliest, method.min_ngram=1, method.controller=fixed), got: {args.pld}"
        )
    try:
        lookup_version = version("llama-cpp-python")
    except PackageNotFoundError:
        raise SpecReproError(
            "needs llama-cpp-python: pip install -e '.[cpu-peer]' (it builds llama.cpp from source)"
        ) from None
    hardware = HardwareConfig(device="cpu", threads=args.threads)
    loader = ModelLoader.for_hardware(hardware, "results/artifacts")
    model_cfg = composed("model", "smollm2_135m")
    target = loader.load_model(model_cfg)
    prompts = gsm8k_prompts(target.tokenizer, args.limit, few_shot=1)
    threads = torch.get_num_threads()
    n_ctx = max(map(len, prompts)) + args.max_new_tokens + pld_cfg.num_pred_tokens + 8
    gguf = embedded_gguf_path()
    ours = {"ar": ARDecoder(target.model, target.tokenizer), "pld": PLDDecoder(target.model, target.tokenizer, pld_cfg)}
    llama = {
        "llamacpp_ar": LlamaCppArm(gguf, n_ctx, threads),
        "llamacpp_lookup": LlamaCppArm(gguf, n_ctx, threads, lookup=pld_cfg),
    }
    eos, greedy = ours["ar"].eos_ids, Sampling()

    def run(arm: str, ids: list[int], max_new_tokens: int) -> dict:
        if arm in llama:
            tokens, seconds, steps = llama[arm].generate(ids, max_new_tokens, eos)
        else:
            gen = ours[arm].generate(ids, greedy, max_new_tokens)
            tokens, seconds, steps = gen.token_ids, gen.wall_time, gen.steps
        return {"tokens": tokens, "seconds": seconds, "steps": steps}

    for arm in ARMS:  # warm-up
        run(arm, prompts[0], 16)
    width = pld_cfg.num_pred_tokens + 1  # a whole verification: the draft and the token before it
    step_cost = {
        "ours": width_cost(our_forward_timer(target.model, prompts[0]), width),
        "llamacpp": width_cost(llama["llamacpp_lookup"].forward_timer(prompts[0]), width),
    }
    results = {arm: [] for arm in ARMS}

    def paired(arm: str, base: str) -> float:
        return fmean(
            (len(r["tokens"]) / r["seconds"]) / (len(b["tokens"]) / b["seconds"])
            for r, b in zip(results[arm], results[base])
        )

    def summary() -> dict:
        """The figures over the prompts timed so far."""
        done = results["ar"]
        return {
            "provenance": provenance(asdict(hardware), loader.device) | {"command": shlex.join(["python", *sys.argv])},
            "date": time.strftime("%Y-%m-%d"),
            "llama_cpp_python": lookup_version,
            "model": model_cfg.name,
            "prompts": len(done),
            "prompts_asked": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "pld": asdict(pld_cfg),
            "tok_per_s": {
                arm: sum(len(r["tokens"]) for r in results[arm]) / sum(r["seconds"] for r in results[arm])
                for arm in ARMS
            },
            "mat": {arm: mean_accepted(results[arm]) for arm in ARMS},
            "lookup_speedup": {arm: paired(arm, base) for arm, base in LOOKUPS.items()},
            "llamacpp_ar_over_ar": paired("llamacpp_ar", "ar"),
            "identical": {
                arm: sum(r["tokens"] == b["tokens"] for r, b in zip(results[arm], results[base]))
                for arm, base in [*LOOKUPS.items(), ("llamacpp_ar", "ar")]
            },
            "verify_width": width,
            "verify_cost": step_cost,
            "verify_cost_pairs": REPEATS,
            "llamacpp_batched_mismatches": [r["batched_mismatches"] for r in results["llamacpp_ar"]],
            "shared_prefix_share": fmean(
                shared_prefix(r["tokens"], b["tokens"]) / min(len(r["tokens"]), len(b["tokens"]))
                for r, b in zip(results["llamacpp_ar"], done)
            ),
        }

    for i, ids in enumerate(tqdm(prompts, desc="prompts", file=sys.stderr)):
        for arm in ARMS[i % len(ARMS) :] + ARMS[: i % len(ARMS)]:  # rotate the order so drift hits every arm
            results[arm].append(run(arm, ids, args.max_new_tokens))
        last = results["llamacpp_ar"][-1]  # untimed: does llama.cpp's verification forward agree with its steps?
        last["batched_mismatches"] = llama["llamacpp_lookup"].batched_mismatches(ids, last["tokens"])
        if args.json:  # after every prompt: a run cut short keeps the prompts it timed
            atomic_write(Path(args.json), json.dumps(summary(), indent=1) + "\n")

    figures = summary()
    if args.markdown:
        atomic_write(Path(args.markdown), markdown(figures))
    print(markdown(figures))


if __name__ == "__main__":
    run_script(main)
