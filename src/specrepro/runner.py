"""The main job, `specrepro run`: decode a dataset with a method, time it, score it, record it and compare it with
its `ar` reference.

`run` names the run and takes its lock; `_run_locked` loads the target and the method, finds (or first runs) the
`ar` reference, decodes each record not yet recorded (`decode_record`: every sample's turns, each timed by
`decode_turn` beside the paired baselines) and records the summary. The functions from `decode_record` down are
the timing protocol, part of every run's name (`identity.DECODING_CODE`); the input checks live in the config
schemas (`config.check_run_config`), the reference in `reference.py`, the summary and the printed table in
`metrics/summary.py`, the model cache in `models/cache.py` and the lock in `locks.py`."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import numpy as np
from omegaconf import DictConfig
from tqdm import tqdm

from specrepro import suspension
from specrepro.config import check_run_config
from specrepro.data import (
    load_records,
    prompt_format,
    prompt_ids,
    reference_response,
    render_prompt,
)
from specrepro.decoding import build_decoder, validate_method_config
from specrepro.decoding.ar import ARDecoder
from specrepro.decoding.sampling import Sampling
from specrepro.decoding.steps import EagerSteps
from specrepro.errors import SpecReproError
from specrepro.identity import (
    code_fingerprint,
    identity_name,
    loaded_weights,
    records_fingerprint,
    reference_key,
    resolved_artifacts,
    run_name,
    scoring_fingerprint,
    setting_key,
)
from specrepro.locks import run_lock
from specrepro.metrics.completions import completion_for_scoring
from specrepro.metrics.divergence import classify_row
from specrepro.metrics.judge import judge_run
from specrepro.metrics.quality import reference_nll, score_sample
from specrepro.metrics.speed import impossible_generation, impossible_metrics
from specrepro.metrics.summary import summarize
from specrepro.models import LoadedModel, ModelLoader
from specrepro.models.cache import load_target
from specrepro.models.kernels import torch_linears
from specrepro.provenance import now, provenance
from specrepro.reference import decoded_by_other_code, find_reference, reference_config, reference_samples
from specrepro.reuse import note_reused
from specrepro.tracking import RunRecord, log_to_wandb
from specrepro.training import cost

log = logging.getLogger(__name__)


def run(cfg: DictConfig, group: str | None = None) -> dict:
    """Run one (model, method, dataset, decoding) job; return its metrics. Resumes and skips finished runs.

    Concurrent jobs (joblib/submitit sweeps, a re-launched sweep) that need the same run are serialised
    by its lock."""
    check_run_config(cfg)  # refuse values that cannot work, before any model is loaded
    validate_method_config(cfg.method)
    records = load_records(cfg.dataset)
    fingerprint = records_fingerprint(records)
    artifacts = resolved_artifacts(cfg)
    identities = loaded_weights(cfg, artifacts)  # once: the name and the record agree
    name = run_name(cfg, fingerprint, identities)
    with run_lock(Path(cfg.results_dir) / "runs" / name):
        return _run_locked(cfg, group, name, records, fingerprint, artifacts, identities)


def check_same_identity(cfg: DictConfig, record: RunRecord, identity: str) -> None:
    """Refuse to resume or reuse a run named by `run_name` that another setting or other code decoded."""
    made_as = record.identity()
    if cfg.resume and made_as is not None and made_as != identity:
        raise SpecReproError(
            f"run_name={record.dir.name} holds a run of another setting or code ({made_as}, this one is "
            f"{identity}): pick another run_name, or resume=false to replace it"
        )


def changed_weights(named: dict[str, dict], now: dict[str, dict]) -> list[str]:
    """The roles whose weights resolve otherwise now (`identity.loaded_weights`, after the models loaded) than when
    the run was named: the decoder may have loaded the newer ones under the older ones' name. A hub model the load
    itself downloaded was named by its revision alone, and stays so."""
    return sorted(role for role, weights in named.items() if now.get(role) != weights)


def lacks_reference(cfg: DictConfig, record: RunRecord) -> bool:
    """A complete method run made with `reference=false` that is now wanted with its `ar` reference."""
    return cfg.reference and cfg.method.name != "ar" and record.metrics().get("reference_run") is None


def _run_locked(
    cfg: DictConfig,
    group: str | None,
    name: str,
    records: list,
    fingerprint: str,
    artifacts: dict[str, Path],
    identities: dict[str, dict],
) -> dict:
    """`run`, holding the run's lock."""
    record = RunRecord(Path(cfg.results_dir) / "runs" / name)
    identity = identity_name(cfg, fingerprint, identities) if cfg.run_name else name
    check_same_identity(cfg, record, identity)
    if cfg.resume and record.complete:
        damage = record.damage()
        if damage is None and lacks_reference(cfg, record):
            log.info("run %s was made with reference=false: summarizing it again over its `ar` reference", name)
        elif damage is None and record.metrics().get("scoring_code") != scoring_fingerprint():
            log.info("run %s was scored by other scoring code: scoring its recorded answers again", name)
        elif damage is None:
            log.info("run %s is already complete; skipping (resume=false to redo it)", name)
            note_reused(f"run {name}")
            return record.metrics()
        else:
            log.warning("run %s is complete but %s: decoding the records it lost again", name, damage)

    loader = ModelLoader.for_hardware(cfg.hardware, cfg.artifacts_dir)
    target = load_target(cfg, loader)
    decoder = build_decoder(cfg.method, target, loader)  # before the reference run: a bad method fails fast
    if changed := changed_weights(identities, loaded_weights(cfg, resolved_artifacts(cfg))):
        raise SpecReproError(
            f"run {name}: the weights of its {', '.join(changed)} changed while it loaded (an artifact published or "
            "a checkpoint saved beside it): run it again, or name the artifacts in full"
        )
    longest = longest_prompt(records, cfg, target)  # every first turn fits, checked before anything is decoded
    written_as = prompt_format(target.tokenizer, cfg.dataset)
    if written_as == "plain transcript":
        log.warning(
            "run %s: model %s has no chat template: chat prompts are a User/Assistant transcript", name, cfg.model.name
        )

    ref_key = reference_key(cfg, fingerprint)
    reference = ar_reference(cfg, ref_key, name, group) if cfg.reference and cfg.method.name != "ar" else None
    reference_rows = reference_samples(reference, records) if reference else None
    diverging_from = {row["id"]: row for row in reference_rows or []}  # greedy outputs that differ get classified

    baselines = paired_baselines(cfg, target, decoder)
    sampling = Sampling.from_config(cfg.decoding)

    rows = record.start(cfg, cfg.resume, loader.device, identity)
    if score_again(rows, records, cfg):
        record.replace_rows(rows)
    started_at = record.started_at()
    done = {row["id"] for row in rows}
    setting = setting_key(cfg, fingerprint, identities)
    if rows:
        note_reused(f"{len(rows)} samples of run {name}")
    elif superseded := decoded_by_other_code(cfg.results_dir, setting, name):
        log.info(
            "run %s: %d record(s) of this setting were decoded by other code (%s); they are kept, not reused",
            name,
            len(superseded),
            ", ".join(superseded),
        )
    todo = [(i, r) for i, r in enumerate(records) if r.id not in done]
    compile_time = 0.0
    if todo:  # untimed: compile every step the run can take, then warm up on the first prompt
        compile_time = compile_steps_for(longest + cfg.decoding.max_new_tokens, [decoder, *baselines.values()])
        warm_up(cfg, target, [decoder, *baselines.values()], records[0], sampling)
    with suspension.watching():
        for index, rec in tqdm(todo, desc=name, unit="sample"):
            row = decode_record(rec, index, cfg, target, decoder, baselines, sampling) | {"session": record.session}
            if compile_time:  # this process's up-front compile, recorded with the first sample it decodes
                row["up_front_compile_time"], compile_time = compile_time, 0.0
            if sampling.greedy and rec.id in diverging_from:
                prompt_after = partial(prompt_ids, rec, target.tokenizer, cfg.dataset)
                classify_row(
                    row, diverging_from[rec.id], target, decoder.max_step_width, prompt_after, decoder.verifies_trees
                )
            record.append(row)
            rows.append(row)
    rows.sort(key=lambda row: row["index"])

    metrics = summarize(rows, reference_rows, sampling.greedy)
    sessions = record.sessions(rows)
    problem = impossible_metrics(metrics)
    if problem:
        raise SpecReproError(
            f"method '{cfg.method.name}' produced impossible metrics ({problem}); the run is not recorded as complete"
        )
    if cfg.dataset.metric == "mt_bench":
        metrics.update(judge_run(cfg, records, rows, loader, record.dir))
    metrics.update(
        run_name=name,
        method=cfg.method.name,
        model=cfg.model.name,
        dataset=cfg.dataset.name,
        decoding=cfg.decoding.name,
        n_samples=len(rows),
        data_fingerprint=fingerprint,
        prompt_format=written_as,  # the tokenizer's chat template, a plain transcript (it has none), or completion
        setting_key=setting,  # all it computes but the code: runs of one key and other names had other code
        code_fingerprint=code_fingerprint(cfg.method.name),  # the code it decoded with (identity.code_fingerprint)
        scoring_code=scoring_fingerprint(),  # the code that scored its answers (identity.SCORING_CODE)
        reference_key=ref_key,
        reference_run=reference.dir.name if reference else None,
        lossless_method=decoder.lossless,
        # seconds compiling the target's steps (hardware.compile), untimed: up front in every process that decoded
        # samples of it, and for later turns outgrowing them
        compile_time=sum(row.get("up_front_compile_time", 0.0) for row in rows)
        + sum(gen.get("compile_time", 0.0) for row in rows for turns in row["samples"] for gen in turns),
        artifacts=identities,  # the trained components and local checkpoints it loaded: names, content digests
        training_minutes=training_minutes(artifacts.values(), decoder),
        trained=cost.artifact_metrics(artifacts.values()),  # what its trained components measured when made
        provenance=provenance(cfg.hardware, loader.device) | {"started_at": started_at, "finished_at": now()},
        sessions=sessions,  # the processes that decoded its samples, each with how many
        # a resumed run's timings come from several processes (other load, other warm-up): said, not hidden
        resumed=f"timings from {len(sessions)} processes" if len(sessions) > 1 else None,
    )
    record.finish(metrics)
    log_to_wandb(cfg, record, name, group, metrics, rows)
    return metrics


def longest_prompt(records: list, cfg: DictConfig, target: LoadedModel) -> int:
    """The longest prompt any turn can have (a later turn's holds the earlier answers, each up to the budget), for
    the compiled steps' static caches; refuses a first-turn prompt that leaves no room for the budget."""
    longest = 0
    for rec in records:
        ids = prompt_ids(rec, target.tokenizer, cfg.dataset, [])
        check_in_vocabulary(ids, cfg, target, rec.id)
        check_fits_context(ids, cfg, target, rec.id)
        answers = len(rec.turns) - 1
        last = prompt_ids(rec, target.tokenizer, cfg.dataset, [""] * answers) if answers else ids
        longest = max(longest, len(last) + answers * cfg.decoding.max_new_tokens)
    return longest


def ar_reference(cfg: DictConfig, ref_key: str, name: str, group: str | None) -> RunRecord | None:
    """The run's `ar` reference: the newest complete one, or one run now (on the same loaded target)."""
    reference = find_reference(cfg, ref_key)
    if reference is None:
        log.info("no `ar` reference run for %s yet: running it first", name)
        run(reference_config(cfg), group)  # the same loaded target (load_target keeps it)
        reference = find_reference(cfg, ref_key)
    return reference


class TorchLinearsAR(ARDecoder):
    """`ar` on torch's own linears (`kernels.torch_linears`), the arm `timing.torch_ar` times beside the paired one:
    on some CPUs torch's one-token forward beats oneDNN's, so a speedup over `ar` on oneDNN overstates one over the
    faster `ar`."""

    def generate(self, *args, **kwargs):
        with torch_linears():
            return super().generate(*args, **kwargs)


def paired_baselines(cfg: DictConfig, target: LoadedModel, decoder) -> dict:
    """`ar` timed beside each turn with `timing.paired`: as the run computes, eager too when that is compiled, and on
    torch's linears too with `timing.torch_ar`."""
    baselines = {}
    if cfg.timing.paired:
        baselines["ar"] = ARDecoder(target.model, target.tokenizer)
        if decoder.steps.compiled:
            baselines["eager_ar"] = ARDecoder(target.model, target.tokenizer, steps=EagerSteps(target.model))
        if cfg.timing.get("torch_ar"):
            baselines["torch_ar"] = TorchLinearsAR(target.model, target.tokenizer)
    return baselines


def training_minutes(artifacts, decoder) -> float | None:
    """What the trained artifacts this run uses cost to make here (training/cost.py): 0 for a method that needs
    none, None when one does not say (trained before costs were recorded) or the extra weights come from elsewhere
    (a hub draft)."""
    if not artifacts:
        return None if decoder.extra_parameters else 0.0
    spent = [cost.artifact_minutes(path) for path in artifacts]
    return None if None in spent else sum(spent)


def reference_after(prompt: str, record) -> str | None:
    """A record's reference answer (`reference_response`) as it reads after its first prompt's text: a completion
    prompt that ends in a word ("Summary:") reads on with a space, as its exemplars' answers do (tokenized alone, an
    answer's first word lost the space: 0.28 nats a token more on XSum)."""
    answer = reference_response(record)
    return " " + answer if answer and prompt and not prompt[-1].isspace() else answer


def decode_record(record, index, cfg, target, decoder, baselines: dict, sampling) -> dict:
    """All samples (each with all turns) of one dataset record, scored."""
    samples, prompts, first_prompt = [], [], []
    for s in range(cfg.decoding.num_samples):
        history: list[str] = []
        turns = []
        for turn in range(len(record.turns)):
            prompt = render_prompt(record, target.tokenizer, cfg.dataset, history)
            ids = prompt_ids(record, target.tokenizer, cfg.dataset, history)
            check_fits_context(ids, cfg, target, record.id)
            decoders, length = [decoder, *baselines.values()], len(ids) + cfg.decoding.max_new_tokens
            # a later turn's prompt holds answers that can outgrow the static caches: compile for it here, untimed
            compiled_s = compile_steps_for(length, decoders) if turn and not holds(length, decoders) else 0.0
            seed = sample_seed(cfg, index, s, turn)
            method_first = method_timed_first(cfg.timing.order, index, s, turn)
            gen, timed_beside = decode_turn(
                decoder, baselines, ids, sampling, cfg.decoding.max_new_tokens, seed, cfg.timing.repeats, method_first
            )
            gen = gen.to_dict()
            problem = impossible_generation(gen)
            if problem:
                raise SpecReproError(
                    f"method '{cfg.method.name}' reported impossible step counts on record "
                    f"{record.id} ({problem}); the run is not recorded as complete"
                )
            gen["prompt_tokens"] = len(ids)
            gen["seed"] = seed
            if compiled_s:
                gen["compile_time"] = compiled_s
            if timed_beside:
                gen["method_timed_first"] = method_first
            for key, ar_gen in timed_beside.items():  # `ar_*`: the paired reference, `eager_ar_*`, `torch_ar_*`: more
                gen[f"{key}_wall_time"], gen[f"{key}_tokens"] = ar_gen.wall_time, len(ar_gen.token_ids)
                gen[f"{key}_token_ids"], gen[f"{key}_prefill_time"] = ar_gen.token_ids, ar_gen.prefill_time
                gen[f"{key}_discarded_steps"] = ar_gen.discarded_steps
            turns.append(gen)
            history.append(gen["text"])
            if s == 0:
                prompts.append(prompt)
                first_prompt = first_prompt or ids  # the first turn's: what the reference answer follows
        samples.append(turns)
    scores = task_scores(record, samples, cfg)
    answer = reference_after(prompts[0], record) if cfg.reference_nll else None
    if answer:  # after the prompt as decoded; the answer's special-token text is text too
        answer_ids = target.tokenizer(answer, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        scores["reference_nll"] = reference_nll(target.model, first_prompt, answer_ids)
    return {
        "id": record.id,
        "index": index,
        "prompts": prompts,
        "samples": samples,
        "scores": scores,
        "scored_with": scoring_fingerprint(),
    }


def task_scores(record, samples: list[list[dict]], cfg: DictConfig) -> dict:
    """The task metric's scores of a record's samples: each sample's last turn is the answer it scores."""
    completions = [completion_for_scoring(record, turns[-1]["text"], cfg.dataset) for turns in samples]
    return score_sample(cfg.dataset.metric, record.reference, completions, record.fields)


def score_again(rows: list[dict], records: list, cfg: DictConfig) -> bool:
    """Score again, from their recorded answers, the rows that other scoring code scored (`scored_with`), keeping
    their reference NLL (the model's, not the scorer's); True if there were any."""
    current, by_id = scoring_fingerprint(), {record.id: record for record in records}
    stale = [row for row in rows if row.get("scored_with") != current]
    for row in stale:
        nll = {key: value for key, value in row["scores"].items() if key == "reference_nll"}
        row.update(scores=task_scores(by_id[row["id"]], row["samples"], cfg) | nll, scored_with=current)
    return bool(stale)


def check_in_vocabulary(ids: list[int], cfg: DictConfig, target: LoadedModel, record_id: str) -> None:
    """Refuse a prompt with a token the model has no embedding for (its tokenizer is another model's)."""
    rows = target.model.get_input_embeddings().num_embeddings
    if ids and max(ids) >= rows:
        raise SpecReproError(
            f"record {record_id}: the tokenizer gives token id {max(ids)}, but model '{cfg.model.name}' embeds only "
            f"{rows} tokens: model.tokenizer must be the model's own"
        )


def check_fits_context(ids: list[int], cfg: DictConfig, target: LoadedModel, record_id: str) -> None:
    """Refuse a prompt that leaves no room for the token budget in the model's context."""
    context = getattr(target.model.config, "max_position_embeddings", None)
    if context is not None and len(ids) + cfg.decoding.max_new_tokens > context:
        raise SpecReproError(
            f"record {record_id}: a {len(ids)}-token prompt plus decoding.max_new_tokens={cfg.decoding.max_new_tokens} "
            f"exceeds model '{cfg.model.name}''s {context}-token context; shorten the prompt or the budget"
        )


def sample_seed(cfg: DictConfig, index: int, sample: int, turn: int = 0) -> int:
    """The seed of one turn of a record's sample, a hash of (decoding.seed, record, sample, turn) by numpy's
    SeedSequence (32 bits: torch's CPU generator reads no more), so no two share a random stream: not two turns
    (the first turn's draws replayed on the next prompt copy its answer), not two `decoding.seed`s (seed + 1000 *
    record + sample had made seed 1's samples seed 0's shifted by one)."""
    return int(np.random.SeedSequence([cfg.decoding.seed, index, sample, turn]).generate_state(1)[0])


METHOD = "method"  # the method's own arm among the baselines' (`ar`, `eager_ar`) in `decode_turn`
SUSPENDED_TIMINGS = 5  # timings of one turn in a row a suspension may spoil before the run stops (`decode_turn`)


def method_timed_first(order: str, index: int, sample: int, turn: int) -> bool:
    """Whether the method is timed before its baselines on this turn: never with "ar_first"; with "alternate" on
    every other turn, so an advantage of being timed second (caches warmed by the arm before) cancels in the mean."""
    return order == "alternate" and (index + sample + turn) % 2 == 1


def decode_turn(
    decoder,
    baselines: dict,
    ids: list[int],
    sampling,
    max_new_tokens: int,
    seed: int,
    repeats: int = 1,
    method_first: bool = False,
):
    """One turn decoded by the method, and by the baselines timed beside it: (its Generation, theirs by key).
    The baselines are timed right before the method, or right after it with `method_first`.
    With `repeats` R > 1 every arm decodes the turn R times, in turn, and keeps its fastest timing, the one least
    disturbed by other work on the machine (timeit's rule); its R decodings must agree token for token (a method
    that carries state from one generation to the next decodes each from what the turns before left). A turn
    during which the process was suspended is decoded again, so that no timing includes the pause; a process
    suspended during SUSPENDED_TIMINGS timings of one turn in a row is stopped in one line (it would never finish)."""
    arms = {METHOD: decoder, **baselines} if method_first else {**baselines, METHOD: decoder}
    carried = decoder.carried()
    for _ in range(SUSPENDED_TIMINGS):
        resumes_before = suspension.resumes()
        fastest = {}
        for _ in range(repeats):
            for key, arm in arms.items():
                if arm is decoder:  # every timing of the turn drafts from what the turns before it left
                    decoder.restore(carried)
                gen = arm.generate(ids, sampling, max_new_tokens, seed)
                best = fastest.setdefault(key, gen)
                if gen.token_ids != best.token_ids:
                    raise SpecReproError(
                        f"the {key} arm decoded one turn differently in two of its timing.repeats "
                        "(nondeterministic kernels?): its timings would not be of one decoding"
                    )
                if gen.wall_time < best.wall_time:
                    fastest[key] = gen
        if suspension.resumes() == resumes_before:
            return fastest.pop(METHOD), fastest
        log.warning("the process was suspended while a turn was timed: timing it again")
    raise SpecReproError(
        f"the process was suspended during {SUSPENDED_TIMINGS} timings of one turn in a row (paused over and over, "
        "as by cpulimit or a scheduler slicing its time): no timing could leave the pauses out"
    )


def holds(length: int, decoders) -> bool:
    """Whether every step a decoder takes, the target's and a draft model's, runs `length` positions compiled."""
    return all(d.steps.holds(length) for d in decoders) and all(
        steps.holds(length) for d in decoders for steps, _, _ in d.draft_model_steps
    )


def compile_steps_for(length: int, decoders) -> float:
    """With `hardware.compile`: size the static caches for `length` positions (the longest prompt any turn can
    have, its earlier answers at the budget, plus the budget) and compile every step width the decoders can take,
    the target's and a draft model's, and their drafters' own steps (a draft head's), outside the timed region;
    returns the seconds it took. Decoders on steps of their own (a bench's arm) get theirs compiled too."""
    seconds = 0.0
    for steps in {id(d.steps): d.steps for d in decoders if d.steps.compiled}.values():
        on_these = [d for d in decoders if d.steps is steps]
        seconds += steps.warm_up(
            max(d.max_step_width for d in on_these),
            length,
            hidden=any(d.reads_hidden_states for d in on_these),
            slices=[piece for d in on_these for piece in d.layer_slices],
            variants=[variant for d in on_these for variant in d.step_variants],
            calls=[call for d in on_these for call in d.drafter_calls],
        )
    for draft_steps, width, hidden in (entry for d in decoders for entry in d.draft_model_steps):
        if draft_steps.compiled:
            seconds += draft_steps.warm_up(width, length, hidden=hidden)
    if seconds:
        log.info("compiled the steps in %.1f s", seconds)
    return seconds


def warm_up(cfg, target, decoders, record, sampling) -> None:
    """Untimed generations on the first prompt, so one-off costs do not land on the first sample."""
    ids = prompt_ids(record, target.tokenizer, cfg.dataset, [])
    carried = [decoder.carried() for decoder in decoders]
    for _ in range(cfg.timing.warmup):
        for decoder in decoders:
            decoder.generate(ids, sampling, cfg.timing.warmup_tokens, seed=cfg.decoding.seed)
    for decoder, state in zip(decoders, carried):  # the first record's prompt: what it taught them of its answer
        decoder.restore(state)
