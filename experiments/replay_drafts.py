"""A model-free drafter's greedy mean accepted tokens (MAT), replayed on recorded `ar` runs: no target forward.

Greedy verification accepts the longest drafted path the target's argmax follows, and the target's greedy output is
the `ar` run's, so a drafter that reads only the committed tokens (`pld`, `rest`: not one that reads the target's
logits or hidden states) has the MAT the replay gives: each step it drafts after the tokens committed so far, the
longest drafted path the recorded output follows is accepted, plus the target's token. A prompt's ids are the
harness's own (`prompt_ids` of the run's records), each turn of a multi-turn record after its recorded earlier
answers. Prints, per `ar` run (its dataset category), the MAT and the mean rows a step verifies (the drafts and the
last token), then their mean over the runs: a way to compare presets before timing them.

    .venv/bin/python experiments/replay_drafts.py "rest_pld" "pld" --runs 'results/runs/*-ar-spec_bench-greedy-*'
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

import torch
from common import compose_config, run_script
from omegaconf import OmegaConf

from specrepro.data import load_records, prompt_ids
from specrepro.decoding import build_decoder
from specrepro.decoding.draft_verify import DraftVerifyDecoder, main_chain
from specrepro.errors import SpecReproError
from specrepro.models import ModelLoader


def accepted_path(drafts: list[int], parents: list[int], truth: list[int]) -> list[int]:
    """The nodes of the longest path of the draft tree (parents: -1 the root) that `truth` follows from its start."""
    paths: dict[int, list[int]] = {-1: []}
    best: list[int] = []
    for node, (token, parent) in enumerate(zip(drafts, parents)):
        if parent in paths and len(paths[parent]) < len(truth) and truth[len(paths[parent])] == token:
            paths[node] = paths[parent] + [node]
            best = max(best, paths[node], key=len)
    return best


def replay(decoder, prompt: list[int], output: list[int]) -> tuple[int, int, int]:
    """(tokens after the prefill's, steps, rows verified) of greedy decoding that commits `output`."""
    controller = decoder.new_controller()
    committed, steps, rows = 1, 0, 0  # the prefill commits output[0]
    while committed < len(output):
        k = max(0, min(controller.next_length(), len(output) - committed - 1))
        tokens = torch.tensor([prompt + output[:committed]])
        proposal = decoder.propose(None, tokens, k, None, None, controller) if k else None
        drafts = proposal.drafts.tolist() if proposal else []
        parents = proposal.parents if proposal and proposal.parents is not None else list(range(-1, len(drafts) - 1))
        path = accepted_path(drafts, parents, output[committed:])
        controller.update(
            *main_chain(
                proposal.parents if proposal else None, len(drafts), len(path), [0] + [node + 1 for node in path]
            )
        )
        committed, steps, rows = committed + len(path) + 1, steps + 1, rows + len(drafts) + 1
    return len(output) - 1, steps, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="+", help='method presets with overrides, e.g. "rest method.tree_nodes=8"')
    parser.add_argument("--runs", default="results/runs/*-ar-spec_bench-greedy-*", help="glob of `ar` run folders")
    parser.add_argument("--overrides", nargs="*", default=["hardware.threads=1"], help="run config overrides")
    args = parser.parse_args()
    runs = [Path(p) for p in sorted(glob.glob(args.runs)) if (Path(p) / "generations.jsonl").is_file()]
    if not runs:
        raise SpecReproError(f"no run folder with generations.jsonl matches {args.runs}")
    for spec in args.methods:
        name, *method_overrides = spec.split()
        cfg = compose_config("run", [f"method={name}", *method_overrides, *args.overrides])
        loader = ModelLoader.for_hardware(cfg.hardware, cfg.artifacts_dir)
        target = loader.load_model(cfg.model)
        decoder = build_decoder(cfg.method, target, loader)
        hooks = ("start", "target_forward", "after_verify")
        if not isinstance(decoder, DraftVerifyDecoder) or any(
            getattr(type(decoder), hook) is not getattr(DraftVerifyDecoder, hook) for hook in hooks
        ):
            raise SpecReproError(f"method '{name}' drafts from the target's forwards: a replay cannot draft as it does")
        mats = []
        for run in runs:
            dataset = OmegaConf.load(run / "config.yaml").dataset
            category, records = dataset.get("category"), {record.id: record for record in load_records(dataset)}
            totals = [0, 0, 0]
            for line in (run / "generations.jsonl").read_text().splitlines():
                row = json.loads(line)
                history = []
                for turn in row["samples"][0]:  # greedy: the one sample, every turn after its earlier answers
                    ids = prompt_ids(records[row["id"]], target.tokenizer, dataset, history)
                    totals = [a + b for a, b in zip(totals, replay(decoder, ids, turn["token_ids"]))]
                    history.append(turn["text"])
            tokens, steps, rows = totals
            mats.append(tokens / max(steps, 1))
            print(
                f"{spec}: {run.name} ({category or 'all'}): MAT {mats[-1]:.2f}, rows a step {rows / max(steps, 1):.1f}"
            )
        print(f"{spec}: mean MAT over {len(runs)} runs {sum(mats) / len(mats):.2f}")


if __name__ == "__main__":
    run_script(main)
