"""Benchmark on a GPU: eager against compiled decoding, ours and transformers', on the embedded model (or any).

Arms, interleaved per prompt in one process (greedy, the same GSM8K prompts):
- `ar_eager`: our `ar` on a DynamicCache in eager PyTorch, on the model as a run loads it without
  `hardware.compile` (our attention; torch's own linears as every arm here: CPU runs elsewhere default to
  `hardware.linear_kernel=onednn`); every eager arm of ours runs on that model;
- `ar_compiled`: our `ar` with `hardware.compile` (static cache, torch.compile, CUDA graphs; decoding/steps.py);
- with `--differentiating-guards`, `ar_compiled_differentiating_guards`: the same on steps of its own that, after
  warm-up, check only the guards that tell their graphs apart (`hardware.compile_guards=differentiating`): what
  dynamo's other guards cost a step;
- with `--freezing`, `ar_compiled_frozen`: the same on steps of its own whose graphs take the weights as constants
  (`hardware.compile_freezing=true`: q/k/v and gate/up each one matmul; on a CPU, prepacked weights); the
  figures give the memory each compiled arm's graphs hold (device memory on a GPU, resident memory on a CPU);
- `generate_eager` / `generate_compiled`: transformers' `generate` on the model as a user loads it, plain and
  with `cache_implementation="static"` (transformers then compiles its forward itself);
- `pld_eager` / `pld_compiled`: prompt lookup on eager and on compiled steps;
- with `--row-invariant`, `ar_compiled_row_invariant` and `pld_compiled_row_invariant`: both on steps of their own
  that run every step at the widest width in one graph (`hardware.row_invariant=true`, decoding/steps.py), so that
  bf16 verification rows round as one-token steps do: what that costs compiled `ar`, and whether `pld` then gives
  its `ar`'s tokens (the pld arm is held to that `ar`: identity, near-ties; its speedup is over `ar_compiled`);
- with `--methods`: other methods, trained drafters from `--artifacts-dir` among them, each a method preset with
  overrides (`jacobi`, `sar_draft_tree`, `"eesd method.draft_vocab=4096"`), labelled where one preset comes twice
  (`"k3=sar_draft method.k=3"`): eager and, where the method supports it, compiled; the figures name the artifacts
  each loaded. `--trained-methods` names more, timed only where their artifacts are found (the figures list the
  others and why: experiments/gpu_check.sh names every trained drafter there, so whatever was carried is timed).
Prints each arm's throughput, the weight-reading bound (weight bytes over the card's copy bandwidth, measured here),
compiled over eager `ar`, our compiled `ar` over transformers' compiled `generate`, each speculative arm's paired
speedup over eager `ar` (a compiled arm also over compiled `ar`), MAT and drafting milliseconds per round (the draft
phase's span on the GPU's stream: what compiling a draft model or head saves shows between an eager and a compiled
arm), and which outputs are token-identical. Where a compiled speculative arm's output differs from compiled `ar`'s,
the first differing position is classified a near-tie or a bug (metrics/divergence.py: `ar`'s top-2 margin and the
gap between the two tokens there against the rounding measured there between one-row and multi-row steps, on the
compiled steps after the prompt is timed). Compile times are reported apart. With --json the figures are written
after every timed prompt (`prompts` says how many), so a run cut off by a lent machine's limit keeps what it
measured; --markdown writes them as a results page. `--device cpu` asks the same of a CPU (inductor compiles C++
there).
Run: python experiments/bench_gpu.py [--limit 5] [--max-new-tokens 256] [--json out.json] [--markdown out.md]
     [--methods "sar_draft_tree;eesd method.draft_vocab=4096" --artifacts-dir results/artifacts]
     [--trained-methods "self_sd_tree;eesd method.draft_vocab=4096"]
     [--model llama2_7b_chat | --model "hf model.id=/path/to/checkpoint"]
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from statistics import fmean

import psutil
import torch
from common import composed, gsm8k_prompts, positive_int, provenance_lines, run_script, timed_generate
from tqdm import tqdm

from specrepro import registry
from specrepro.config import HardwareConfig
from specrepro.decoding import build_decoder
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.device import device_sync
from specrepro.decoding.pld import PLDConfig, PLDDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.steps import CompiledSteps
from specrepro.errors import SpecReproError
from specrepro.identity import artifact_identities, model_weights
from specrepro.metrics.divergence import classify, rounding_widths, tree_rounding_widths
from specrepro.models import LoadedModel, ModelLoader, load_model
from specrepro.provenance import machine_label, provenance
from specrepro.runner import compile_steps_for
from specrepro.tracking import atomic_write

GENERATE_ARMS = ("generate_eager", "generate_compiled")
# compiled `ar` on steps of its own with one compile setting changed: arm -> (its flag, its steps' keywords, the
# setting)
AR_SETTINGS = {
    "ar_compiled_differentiating_guards": (
        "differentiating_guards",
        {"guards": "differentiating"},
        "checking after warm-up only the guards that tell its graphs apart (`hardware.compile_guards=differentiating`)"
        " over compiled `ar` checking all of dynamo's",
    ),
    "ar_compiled_frozen": (
        "freezing",
        {"freezing": True},
        "on weights folded into its graphs (`hardware.compile_freezing=true`) over compiled `ar` reading them as"
        " inputs",
    ),
    "ar_compiled_row_invariant": (
        "row_invariant",
        {"row_invariant": True},
        "with every step at the widest width in one graph (`hardware.row_invariant=true`) over compiled `ar` at"
        " its bucket widths",
    ),
}
COMPILED_SUFFIXES = ("_compiled", "_compiled_row_invariant")  # a compiled speculative arm: `pld` + a suffix


def compiled_twins(arm: str) -> tuple[str, str] | None:
    """(the compiled `ar` a compiled speculative arm is held to, its eager arm), or None for an eager arm."""
    suffix = next((s for s in COMPILED_SUFFIXES if arm.endswith(s)), None)
    return ("ar" + suffix, arm.removesuffix(suffix) + "_eager") if suffix else None


def held_mb(device: torch.device) -> float:
    """Megabytes the process holds: allocated device memory on a GPU, resident memory on a CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 1e6
    return psutil.Process().memory_info().rss / 1e6


def copy_bandwidth(device: torch.device, gib: float = 1.0) -> float:
    """Bytes per second a device-to-device copy moves (read + written), the best of 10."""
    x = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(10):
        device_sync(device)
        start = time.perf_counter()
        y.copy_(x)
        device_sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * x.numel() / best


def bytes_read_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decoding step reads: every parameter once, but an input embedding that is not also the
    output head, of which a step reads only its tokens' rows."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    tied = head is not None and head.weight is embedding
    read = {id(p): p for p in model.parameters() if tied or p is not embedding}
    return sum(p.numel() * p.element_size() for p in read.values())


def method_arms(
    presets: str, target, eager: LoadedModel, loader, if_trained: bool = False, taken=()
) -> tuple[dict, dict, dict]:
    """`<label>_eager` (on `eager`, the model as a run loads it without compile) and, where the method runs its
    target forwards through the shared steps, `<label>_compiled` (on the compiled target), for each `;`-separated
    method preset with overrides, optionally labelled (`k3=sar_draft method.k=3`; the label is the preset's name
    otherwise); and, per label, the spec and the trained artifacts (name, content digest) it loaded from the
    loader's artifacts dir, so the figures say which weights they timed. With `if_trained`, a preset whose artifacts
    are not there is left out (the third dict says why, per label), as is one whose label is `taken`."""
    registry.load()
    arms, specs, missing = {}, {}, {}
    for spec in filter(None, (p.strip() for p in presets.split(";"))):
        first, *overrides = spec.split()
        label, _, preset = first.rpartition("=")  # "k3=sar_draft" -> ("k3", "=", "sar_draft")
        preset = " ".join([preset, *overrides])
        label, method = label or first, composed("method", preset)
        if label in taken:
            continue
        if label in specs or label in missing:
            raise SpecReproError(f"--methods names the arm '{label}' twice: label one (e.g. '{label}_2={preset}')")
        decoder = registry.method(method.name).decoder
        try:
            found = decoder.resolve_artifacts(method, target.identity, loader.artifacts_dir)
        except SpecReproError as exc:
            if not if_trained:
                raise
            missing[label] = {"spec": spec, "why": str(exc).splitlines()[0]}
            continue
        arms[f"{label}_eager"] = build_decoder(method, eager, loader)
        if decoder.compilable:
            arms[f"{label}_compiled"] = build_decoder(method, target, loader)
        specs[label] = {"spec": spec, "artifacts": artifact_identities(found)}
    return arms, specs, missing


def draft_ms_per_round(rows: list[dict]) -> float:
    """Milliseconds an arm spent drafting (its decoder's draft phase, timed by events on a GPU) per verification
    round after the prompt's; 0.0 for a method with no draft phase (Jacobi, SPACE draft inside verification)."""
    rounds = sum(len(r["accepted"] or []) for r in rows)
    return 1e3 * sum(r["draft_seconds"] for r in rows) / rounds if rounds else 0.0


def mat(rows: list[dict]) -> float:
    """Tokens an arm committed per target forward after the prompt's; NaN where it ran none (a budget of one token)."""
    steps = sum(r["steps"] for r in rows)
    return sum(len(r["tokens"]) - 1 for r in rows) / steps if steps else math.nan


def weights(identities: dict) -> str:
    """Trained artifacts or checkpoints (role -> name, content digest) in a line: which weights were timed."""
    return "; ".join(f"{role} `{w['name']}` (content {w['content_digest']})" for role, w in identities.items())


def markdown(figures: dict) -> str:
    """The figures as a results page: one row per arm, the bounds and ratios, then the provenance."""
    prov, rate, speculative = figures["provenance"], figures["tok_per_s"], figures["speculative"]
    drafting = any(row.get("draft_ms_per_round") for row in speculative.values())  # recorded since it was measured
    near_ties = any("near_tie_to_ar_compiled" in row for row in speculative.values())  # since they are classified
    over_eager = {
        "ar_eager": 1.0,
        "ar_compiled": figures["ar_compiled_over_eager"],
        **{arm: figures[f"{arm}_over_eager"] for arm in AR_SETTINGS if f"{arm}_over_eager" in figures},
        **{arm: row["over_ar_eager"] for arm, row in speculative.items()},
    }
    lines = [
        f"# Eager against compiled decoding: {figures['model']} on {machine_label(prov['machine'])}",
        "",
        f"{figures['prompts']} GSM8K prompts x up to {figures['max_new_tokens']} new tokens, greedy,"
        f" {figures['dtype']}, {prov['threads']} thread(s), compiled step widths {figures['widths']}, every arm on"
        " the same prompt token ids, interleaved per prompt. Written by `experiments/bench_gpu.py` (its docstring"
        " defines the arms);"
        " speedups are the mean over prompts of an arm's tokens/s over the baseline's on that prompt; MAT = tokens"
        " per target forward after the prompt's; *rounds as its eager arm's*: prompts on which a compiled arm"
        " committed, round for round, the tokens its eager arm did (lossless either way; a compiled draft that"
        " drafts differently shows here, as can fp32 rounding flipping a near-tied draft token).",
        "",
        "| arm | tok/s | over eager `ar` | over compiled `ar` | MAT |"
        + (" draft ms / round |" if drafting else "")
        + " token-identical to eager `ar` | rounds as its eager arm's |"
        + (" identical or near-tie to compiled `ar` |" if near_ties else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if drafting else "") + ("---|" if near_ties else ""),
    ]
    for arm, tok_s in rate.items():
        row = speculative.get(arm, {})
        cells = [
            f"{over_eager[arm]:.2f}x" if arm in over_eager else "–",
            f"{row['over_ar_compiled']:.2f}x" if "over_ar_compiled" in row else "–",
            f"{row['mat']:.2f}" if "mat" in row else "–",
        ]
        if drafting:
            cells.append(f"{row['draft_ms_per_round']:.2f}" if row.get("draft_ms_per_round") else "–")
        same_rounds = f"{row['rounds_as_eager']}/{figures['prompts']}" if "rounds_as_eager" in row else "–"
        near_tie = f"{row['near_tie_to_ar_compiled']}/{figures['prompts']}" if "near_tie_to_ar_compiled" in row else "–"
        lines.append(
            f"| `{arm}` | {tok_s:.1f} | {' | '.join(cells)} | "
            f"{figures['identical_to_ar_eager'][arm]}/{figures['prompts']} | {same_rounds} |"
            + (f" {near_tie} |" if near_ties else "")
        )
    compile_s = ", ".join(f"{arm} {seconds:.1f}" for arm, seconds in figures["compile_or_first_call_s"].items())
    lines += [
        "",
        f"- Our compiled `ar` over transformers' static-cache compiled `generate` (paired):"
        f" {figures['ar_compiled_over_generate_compiled']:.2f}x.",
        *[
            f"- Compiled `ar` {setting} (paired): {figures[f'{arm}_over_ar_compiled']:.2f}x."
            for arm, (_, _, setting) in AR_SETTINGS.items()
            if f"{arm}_over_ar_compiled" in figures
        ],
        f"- Weight-reading bound: {figures['bound_tok_per_s']:.0f} tok/s ({figures['weight_mb']:.0f} MB of weights at"
        f" a measured {figures['copy_bandwidth_gb_s']:.0f} GB/s copy bandwidth).",
        f"- Seconds compiling (`ours`: every compiled step width, untimed) or in each arm's untimed first call:"
        f" {compile_s}.",
        *(
            [
                "- Memory its compiled graphs added (MB, "
                + ("device memory allocated" if prov["machine"].get("gpu") else "the process's resident memory")
                + ", as each arm's steps were compiled in turn): "
                + ", ".join(f"{arm} {mb:.0f}" for arm, mb in figures["compiled_graphs_mb"].items())
                + "."
            ]
            if figures.get("compiled_graphs_mb")
            else []
        ),
        *[
            f"- `{arm}` is held to `ar_compiled_row_invariant`, on the same one-width steps (its near-ties and"
            f" divergences below are from that `ar`; its speedup is over `ar_compiled`): token-identical to it on"
            f" {row['identical_to_ar_compiled']}/{figures['prompts']} prompts."
            for arm, row in speculative.items()
            if arm.endswith("_compiled_row_invariant")
        ],
        *(
            [
                "- Steps wider than the widest compiled width run eagerly: "
                + ", ".join(f"`{arm}` (up to {rows} rows)" for arm, rows in figures["eager_wide_steps"].items())
                + "; a wider `--widths` bucket compiles them."
            ]
            if figures.get("eager_wide_steps")
            else []
        ),
        *[
            f"- `{label}`: `{arm['spec']}`, {weights(arm['artifacts']) or 'nothing trained'}"
            for label, arm in figures.get("methods", {}).items()
        ],
        *[
            f"- Not timed, its artifacts not found: `{label}` (`{arm['spec']}`): {arm['why']}"
            for label, arm in figures.get("untrained_methods", {}).items()
        ],
        *[
            f"- `{arm}` left compiled `ar`'s output on prompt {d['prompt'] + 1} at token {d['position']}: "
            + (
                f"{'a near-tie' if d['near_tie'] else 'a bug'} (logit gap {d['gap']:.4g} between `ar`'s token and its "
                f"own, top-2 margin {d['margin']:.4g}, rounding measured there {d['rounding']:.4g})"
                if d["gap"] is not None
                else "a bug (one output stopped where the other went on)"
            )
            for arm, row in speculative.items()
            for d in row.get("divergences_from_ar_compiled", [])
        ],
        *([f"- Target: {weights(figures['model_weights'])}"] if figures.get("model_weights") else []),
        *(
            [
                f"- Attention: `{figures['attention']['ours']}` in our eager arms, `{figures['attention']['compiled']}`"
                f" in compiled ones, `{figures['attention']['generate']}` in transformers' `generate`."
            ]
            if "attention" in figures
            else []
        ),
        *(
            []
            if prov["machine"].get("gpu")
            else [
                "- Every arm runs torch's own linear kernels, which compiled steps need; the CPU tables' runs use"
                " oneDNN's (`hardware.linear_kernel=onednn`), so compare the ratios here with each other, not with"
                " theirs."
            ]
        ),
        "",
        *provenance_lines(
            prov,
            figures["date"],
            machine_extra="; kernels: " + ", ".join(f"{key}={value}" for key, value in prov["kernels"].items()),
        ),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--widths",
        default="1,4,16",
        help="hardware.compile_widths: compiled step widths (a narrow step pads up to the next; on a CPU that "
        "costs: give 1,2,4,8,16 for K-token drafters; an EAGLE tree's padded rows must fit the widest)",
    )
    parser.add_argument(
        "--differentiating-guards",
        action="store_true",
        help="also time compiled `ar` checking after warm-up only the guards that tell its graphs apart "
        "(hardware.compile_guards=differentiating)",
    )
    parser.add_argument(
        "--freezing",
        action="store_true",
        help="also time compiled `ar` on weights folded into its graphs (hardware.compile_freezing=true)",
    )
    parser.add_argument(
        "--row-invariant",
        action="store_true",
        help="also time compiled `ar` and `pld` on steps that run every step at the widest width in one graph "
        "(hardware.row_invariant=true: bf16 verification rows round as one-token steps do)",
    )
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--markdown", default=None, help="also write them as a results page")
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's own)")
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of the script (--backend aot_eager)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument(
        "--methods",
        default="",
        help='trained drafters too: ";"-separated method presets with '
        'overrides, each optionally labelled, e.g. "sar_draft_tree;eesd method.draft_vocab=4096;'
        'k3=sar_draft method.k=3"',
    )
    parser.add_argument(
        "--trained-methods",
        default="",
        help="more presets as --methods takes them, each timed only "
        "where its trained artifacts are found in --artifacts-dir (the figures list the others); "
        "a label --methods names too is timed as --methods says",
    )
    parser.add_argument(
        "--artifacts-dir",
        default="results/artifacts",
        help="where --methods find their artifacts (`specrepro train`'s; the pipelines' are in "
        "results/reproduce/artifacts)",
    )
    parser.add_argument(
        "--model",
        default="smollm2_135m",
        help='a model preset with overrides (conf/model/): "llama2_7b_chat", "hf model.id=/path/to/checkpoint"',
    )
    args = parser.parse_args()
    began = time.perf_counter()
    if not all(w.strip().isdigit() for w in args.widths.split(",")):
        raise SpecReproError(f"--widths takes comma-separated step widths (1,4,16), got {args.widths!r}")
    hardware = HardwareConfig(
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        linear_kernel="torch",
        compile=True,
        compile_backend=args.backend,
        compile_widths=[int(w) for w in args.widths.split(",")],
    )
    loader = ModelLoader.for_hardware(hardware, args.artifacts_dir)
    model_cfg = composed("model", args.model)
    target = loader.load_model(model_cfg)  # its steps compiled (hardware.compile)
    stock = load_model(model_cfg, loader.device, loader.dtype).model  # as a user loads it: transformers' arms
    # our eager arms: the attention of the compiled steps (on a CPU, SDPA's own GQA: ~10% of a verification)
    uncompiled = ModelLoader.for_hardware(replace(hardware, compile=False), args.artifacts_dir).load_model(model_cfg)
    prompts = gsm8k_prompts(target.tokenizer, args.limit, few_shot=1)
    model = target.model
    attention = {  # transformers' name of each model's attention: ours on every arm but transformers' own
        "ours": uncompiled.model.config._attn_implementation,
        "compiled": model.config._attn_implementation,
        "generate": stock.config._attn_implementation,
    }
    decoders = {
        "ar_eager": ARDecoder(uncompiled.model, target.tokenizer),
        "ar_compiled": ARDecoder(model, target.tokenizer),
        "pld_eager": PLDDecoder(uncompiled.model, target.tokenizer, PLDConfig()),
        "pld_compiled": PLDDecoder(model, target.tokenizer, PLDConfig()),
    }
    mode = decoders["ar_compiled"].steps.mode  # the loader's: CUDA graphs on a GPU
    for arm, (flag, keywords, _) in AR_SETTINGS.items():
        if getattr(args, flag):
            steps = CompiledSteps(model, args.backend, mode, hardware.compile_widths, **keywords)
            decoders[arm] = ARDecoder(model, target.tokenizer, steps=steps)
    if args.row_invariant:
        decoders["pld_compiled_row_invariant"] = PLDDecoder(
            model, target.tokenizer, PLDConfig(), steps=decoders["ar_compiled_row_invariant"].steps
        )
    trained, method_specs, _ = method_arms(args.methods, target, uncompiled, loader)
    if_trained, if_trained_specs, untrained = method_arms(
        args.trained_methods, target, uncompiled, loader, if_trained=True, taken=method_specs
    )  # --methods' win
    decoders |= trained | if_trained
    method_specs |= if_trained_specs
    target_weights = model_weights(model_cfg, args.artifacts_dir)  # once: the figures are rewritten every prompt
    widest = max(hardware.compile_widths)  # a compiled arm's steps wider than this run eagerly: the page says which
    eager_wide_steps = {
        arm: d.max_step_width for arm, d in decoders.items() if d.steps.compiled and d.max_step_width > widest
    }
    eos, greedy = sorted(decoders["ar_eager"].eos_ids), Sampling()

    def run(arm: str, ids: list[int], max_new_tokens: int):
        if arm in GENERATE_ARMS:
            return (
                *timed_generate(stock, ids, max_new_tokens, eos, arm == "generate_compiled", args.backend),
                None,
                None,
                0.0,
            )
        gen = decoders[arm].generate(ids, greedy, max_new_tokens)
        return gen.token_ids, gen.wall_time, gen.steps, gen.accepted, gen.draft_time

    def progress(message: str) -> None:  # on stderr as it happens: a run cut off by a lent machine's limit shows where
        print(f"[{time.perf_counter() - began:6.0f} s] {message}", file=sys.stderr, flush=True)

    for label, arm in untrained.items():
        progress(f"not timing {label}: {arm['why']}")
    longest = max(prompts, key=len)
    progress("compiling our steps")
    # every width, hidden-state graph and layer slice a compiled arm can take, as `specrepro run` compiles them
    compiled_arms = {arm: d for arm, d in decoders.items() if d.steps.compiled}
    ours_compile, graphs_mb = 0.0, {}
    for steps in {id(d.steps): d.steps for d in compiled_arms.values()}.values():  # each arm's steps in turn
        on_these = {arm: d for arm, d in compiled_arms.items() if d.steps is steps}
        held = held_mb(loader.device)
        ours_compile += compile_steps_for(len(longest) + args.max_new_tokens, list(on_these.values()))
        graphs_mb[" ".join(on_these)] = held_mb(loader.device) - held
    compile_s = {"ours": ours_compile}
    for arm in [*decoders, *GENERATE_ARMS]:  # warm-up: transformers compiles on its first static call
        progress(f"warming up {arm}")
        carried = decoders[arm].carried() if arm in decoders else None
        start = time.perf_counter()
        run(arm, longest, args.max_new_tokens)
        compile_s.setdefault(arm, time.perf_counter() - start)
        if arm in decoders:  # the warm-up's prompt is a timed one: what it taught a method of its answer is forgotten
            decoders[arm].restore(carried)
    arms = [*decoders, *GENERATE_ARMS]
    speculative = [arm for arm in decoders if not arm.startswith("ar_")]
    weight_bytes = bytes_read_per_token(model)
    bandwidth = copy_bandwidth(loader.device)
    results = {arm: [] for arm in arms}

    def rate(arm):
        return sum(len(r["tokens"]) for r in results[arm]) / sum(r["seconds"] for r in results[arm])

    def paired(arm, base):
        return fmean(
            (len(r["tokens"]) / r["seconds"]) / (len(b["tokens"]) / b["seconds"])
            for r, b in zip(results[arm], results[base])
        )

    def identical(arm, base, key="tokens"):
        return sum(r[key] == b[key] for r, b in zip(results[arm], results[base]))

    def summary() -> dict:
        """The figures over the prompts timed so far."""
        return {
            "provenance": provenance(asdict(hardware), loader.device) | {"command": shlex.join(["python", *sys.argv])},
            "date": time.strftime("%Y-%m-%d"),
            "model": model_cfg.name,
            "dtype": args.dtype,
            "model_weights": target_weights,
            "attention": attention,
            "methods": method_specs,
            "untrained_methods": untrained,
            "prompts": len(results["ar_eager"]),
            "prompts_asked": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "widths": args.widths,
            "eager_wide_steps": eager_wide_steps,
            "tok_per_s": {arm: rate(arm) for arm in arms},
            "bound_tok_per_s": bandwidth / weight_bytes,
            "copy_bandwidth_gb_s": bandwidth / 1e9,
            "weight_mb": weight_bytes / 1e6,
            "ar_compiled_over_eager": paired("ar_compiled", "ar_eager"),
            "ar_compiled_over_generate_compiled": paired("ar_compiled", "generate_compiled"),
            **{
                f"{arm}_over_{name}": paired(arm, base)
                for arm in AR_SETTINGS
                if arm in decoders
                for name, base in (("eager", "ar_eager"), ("ar_compiled", "ar_compiled"))
            },
            # every speculative arm: paired speedup over eager ar (and, when compiled, over compiled ar) and its MAT
            "speculative": {
                arm: {
                    "over_ar_eager": paired(arm, "ar_eager"),
                    **(
                        {
                            "over_ar_compiled": paired(arm, "ar_compiled"),
                            # to the compiled `ar` on its steps (`compiled_twins`): identical, or diverging at a
                            # near-tie, and where
                            "identical_to_ar_compiled": identical(arm, compiled_twins(arm)[0]),
                            "near_tie_to_ar_compiled": sum(
                                r["divergence"] is None or r["divergence"]["near_tie"] for r in results[arm]
                            ),
                            "divergences_from_ar_compiled": [
                                {"prompt": i, **r["divergence"]} for i, r in enumerate(results[arm]) if r["divergence"]
                            ],
                            "rounds_as_eager": identical(arm, compiled_twins(arm)[1], "accepted"),
                        }
                        if compiled_twins(arm)
                        else {}
                    ),
                    "mat": mat(results[arm]),
                    "draft_ms_per_round": draft_ms_per_round(results[arm]),
                }
                for arm in speculative
            },
            "identical_to_ar_eager": {arm: identical(arm, "ar_eager") for arm in arms},
            "compile_or_first_call_s": compile_s,
            "compiled_graphs_mb": graphs_mb,
        }

    progress("timing")
    for i, ids in enumerate(tqdm(prompts, desc="prompts", file=sys.stderr)):
        for arm in arms[i % len(arms) :] + arms[: i % len(arms)]:  # rotate the order between prompts
            tokens, seconds, steps, accepted, draft_seconds = run(arm, ids, args.max_new_tokens)
            results[arm].append(
                {
                    "tokens": tokens,
                    "seconds": seconds,
                    "steps": steps,
                    "accepted": accepted,
                    "draft_seconds": draft_seconds,
                }
            )
        for arm in (a for a in speculative if compiled_twins(a)):  # untimed: a near-tie or a bug where it left its
            # compiled `ar`'s output, recomputed on that `ar`'s steps
            ar_arm, decoder = compiled_twins(arm)[0], decoders[arm]
            results[arm][-1]["divergence"] = classify(
                decoders[ar_arm].steps,
                ids,
                results[arm][-1]["tokens"],
                results[ar_arm][-1]["tokens"],
                rounding_widths(decoder.max_step_width),
                tree_rounding_widths(decoder.max_step_width, decoder.verifies_trees),
            )
        if args.json:  # after every prompt: a run cut off by a lent machine's limit keeps the prompts it timed
            atomic_write(Path(args.json), json.dumps(summary(), indent=1) + "\n")

    figures = summary()
    print(json.dumps(figures, indent=1))
    if args.markdown:
        atomic_write(Path(args.markdown), markdown(figures))
    print(
        f"\n{figures['provenance']['machine']}  {model_cfg.name}  {args.dtype}  {len(prompts)} GSM8K prompts"
        f" x {args.max_new_tokens} new tokens"
    )
    print(
        f"weight-reading bound {figures['bound_tok_per_s']:.0f} tok/s ({figures['weight_mb']:.0f} MB of weights "
        f"at a measured {figures['copy_bandwidth_gb_s']:.0f} GB/s copy bandwidth)"
    )
    for arm in arms:
        print(
            f"{arm:26} {rate(arm):8.1f} tok/s   token-identical to ar_eager:"
            f" {identical(arm, 'ar_eager')}/{len(prompts)}"
        )
    for key in ("ar_compiled_over_eager", "ar_compiled_over_generate_compiled"):
        print(f"{key:36} {figures[key]:.2f}x")
    for arm, row in figures["speculative"].items():
        print(
            f"{arm:26} MAT {row['mat']:.2f}  over eager ar {row['over_ar_eager']:.2f}x"
            + (
                f"  over compiled ar {row['over_ar_compiled']:.2f}x  rounds as its eager arm's "
                f"{row['rounds_as_eager']}/{len(prompts)}"
                if "over_ar_compiled" in row
                else ""
            )
            + (f"  drafting {row['draft_ms_per_round']:.2f} ms/round" if row["draft_ms_per_round"] else "")
        )


if __name__ == "__main__":
    run_script(main)
