"""The main job end to end through the CLI, on the tiny random LLaMA: records, references, resume, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from specrepro.errors import SpecReproError

FAST = ["model=tiny_random", "decoding.max_new_tokens=8", "timing.warmup_tokens=4", "hardware.threads=1"]


def specrepro(*args, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "specrepro.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def run_dirs(root: Path) -> dict[str, Path]:
    return {
        json.loads((p / "metrics.json").read_text())["method"] + ":" + p.name: p
        for p in (root / "results" / "runs").iterdir()
        if (p / "metrics.json").is_file()
    }


def offline_wandb_records(run_dir: Path):
    """The records of the one offline W&B run under `run_dir/wandb/`, parsed from its transaction log (the
    LevelDB log format after a 7-byte W&B header; wandb has no Python reader for it)."""
    from wandb.proto import wandb_internal_pb2

    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, block, pending = log.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 2:  # FIRST
            pending = payload
        elif kind == 3:  # MIDDLE
            pending += payload
        elif kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload if kind == 1 else pending + payload)
            yield record


def test_method_run_records_everything_and_finds_its_reference(tmp_path):
    out = specrepro("run", *FAST, "method=pld", "dataset=gsm8k", "dataset.limit=3", "logger=none", cwd=tmp_path)
    runs = run_dirs(tmp_path)
    assert len(runs) == 2  # the ar reference was run first
    pld_dir = next(p for k, p in runs.items() if k.startswith("pld:"))
    metrics = json.loads((pld_dir / "metrics.json").read_text())
    assert metrics["complete"] and metrics["n_samples"] == 3
    assert metrics["lossless"] == 1.0
    assert metrics["reference_run"] in {p.name for p in runs.values()}
    assert metrics["prompt_format"] == "chat template"  # the embedded tokenizer's
    for key in ("tokens_per_s", "speedup_mean", "speedup_total", "mat", "accept_rate", "gsm8k_acc"):
        assert key in metrics
    rows = [json.loads(line) for line in (pld_dir / "generations.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert (pld_dir / "config.yaml").is_file()
    assert "speedup_mean" in out.stdout  # the results table


def test_interrupted_run_resumes_from_finished_samples(tmp_path):
    args = ["run", *FAST, "method=ar", "dataset=gsm8k", "dataset.limit=3", "logger=none"]
    specrepro(*args, cwd=tmp_path)
    run_dir = next(iter(run_dirs(tmp_path).values()))
    lines = (run_dir / "generations.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    # simulate a kill mid-write: one finished sample, a torn line, no metrics
    (run_dir / "metrics.json").unlink()
    (run_dir / "generations.jsonl").write_text(lines[0] + "\n" + lines[1][:25])
    specrepro(*args, cwd=tmp_path)
    rows = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert [r["index"] for r in sorted(rows, key=lambda r: r["index"])] == [0, 1, 2]
    assert rows[0] == first  # re-used, not regenerated
    assert json.loads((run_dir / "metrics.json").read_text())["n_samples"] == 3


def test_a_sampled_later_turn_draws_afresh_rather_than_replaying_the_first_turns_draws(tmp_path):
    # near-uniform distributions on both turns: the first turn's noise replayed would copy its answer token for token
    args = ["decoding=sample", "decoding.temperature=100", "decoding.top_p=1.0", "decoding.num_samples=2"]
    specrepro("run", *FAST, "method=ar", "dataset=mt_bench", "dataset.limit=1", "logger=none", *args, cwd=tmp_path)
    (row,) = [json.loads(line) for line in (next(iter(run_dirs(tmp_path).values())) / "generations.jsonl").open()]
    for first, second in row["samples"]:
        assert first["seed"] != second["seed"]
        assert first["token_ids"] != second["token_ids"]


def test_no_two_turns_samples_or_decoding_seeds_share_a_random_stream():
    """seed + 1000 * record + sample had made decoding.seed=1's samples decoding.seed=0's shifted by one, so a
    sweep over seeds shared 9 of every 10 samples."""
    from specrepro.runner import sample_seed

    seeds = [
        sample_seed(OmegaConf.create({"decoding": {"seed": seed}}), index, sample, turn)
        for seed in range(3)
        for index in range(20)
        for sample in range(10)
        for turn in range(2)
    ]
    assert len(set(seeds)) == len(seeds) and all(0 <= seed < 2**32 for seed in seeds)


def test_an_ar_reference_finished_by_a_parallel_job_is_reused_under_resume_false(tmp_path):
    """Two method runs of a parallel sweep with resume=false both find no `ar` reference and run it; the second,
    having waited for the reference's lock, reuses what the first made instead of decoding it again under the
    first method run's finished numbers."""
    import shutil
    import time

    from specrepro.locks import run_lock

    args = ["run", *FAST, "dataset=gsm8k", "dataset.limit=2", "logger=none"]
    made = tmp_path / "made"
    made.mkdir()
    specrepro(*args, "method=ar", cwd=made)
    [ar] = run_dirs(made).values()
    parallel = tmp_path / "parallel"
    waiting = parallel / "results" / "runs" / ar.name
    env = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "0"}
    with run_lock(waiting), open(tmp_path / "log", "w") as log:  # the other job, decoding the reference
        proc = subprocess.Popen(
            [sys.executable, "-m", "specrepro.cli", *args, "method=pld", "resume=false"],
            cwd=parallel,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        while "no `ar` reference run" not in (tmp_path / "log").read_text() and proc.poll() is None:
            time.sleep(0.2)
        shutil.copytree(
            ar, waiting, ignore=shutil.ignore_patterns(".lock"), dirs_exist_ok=True
        )  # the other job's reference, complete
    assert proc.wait(timeout=600) == 0, (tmp_path / "log").read_text()[-3000:]
    assert (waiting / "metrics.json").read_text() == (ar / "metrics.json").read_text()  # not decoded again
    [pld] = [run for key, run in run_dirs(parallel).items() if key.startswith("pld:")]
    assert json.loads((pld / "metrics.json").read_text())["reference_run"] == ar.name


def test_multirun_over_datasets_with_offline_wandb(tmp_path):
    out = specrepro(
        "run", "-m", *FAST, "dataset=gsm8k,humaneval,xsum,mt_bench", "dataset.limit=2", "logger=wandb", cwd=tmp_path
    )
    runs = run_dirs(tmp_path)
    assert len(runs) == 4
    for run_dir in runs.values():
        metrics = json.loads((run_dir / "metrics.json").read_text())
        summary = {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for record in offline_wandb_records(run_dir)
            if record.WhichOneof("record_type") == "summary"
            for item in record.summary.update
        }
        for key in ("tokens_per_s", "mat", "n_samples"):
            assert summary[key] == pytest.approx(metrics[key])
    assert out.stdout.count("smollm2") == 0 and out.stdout.count("tiny_random-ar-") == 4  # one table


@pytest.mark.parametrize(
    "override, message",
    [
        ("decoding.max_new_tokens=0", "max_new_tokens must be positive"),
        ("model=llama2_7b", "meta-llama/Llama-2-7b-hf"),
        ("dataset.path=/nonexistent/data.jsonl", "/nonexistent/data.jsonl"),
        ("results_dir=/proc/specrepro", "cannot write the run record"),
        ("model.name=/tmp/elsewhere/llama", "model.name '/tmp/elsewhere/llama' names run and artifact directories"),
        ("model.random.vocab_size=10", "but model 'tiny_random' embeds only 10 tokens: model.tokenizer must be"),
    ],
)
def test_bad_input_gives_one_line_and_nonzero_exit(tmp_path, override, message):
    proc = specrepro("run", *FAST, "dataset.limit=1", "logger=none", override, cwd=tmp_path, check=False)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("specrepro: error:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("method, message", [("cllm", "consistency-trained weights"), ("space", "no mask token")])
def test_a_method_refusing_the_model_fails_before_its_ar_reference_runs(tmp_path, method, message):
    proc = specrepro("run", *FAST, "dataset.limit=1", "logger=none", f"method={method}", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not list((tmp_path / "results" / "runs").glob("*/generations.jsonl"))  # no ar reference was decoded


def test_per_generation_extras_become_run_metrics_and_step_lists_do_not():
    from specrepro.metrics.summary import run_level_extras

    gens = [
        {"extra": {"extra_memory_pct": 7.0, "block_size": 16, "fast_forwarded": [1, 2], "flag": True}},
        {"extra": {"extra_memory_pct": 7.0, "block_size": 16, "fast_forwarded": [0]}},
        {"extra": {"extra_memory_pct": 5.0}},
    ]
    assert run_level_extras(gens) == {"extra_memory_pct": 19.0 / 3}  # block_size is missing from one generation


def test_the_leaderboard_preset_scores_a_category_with_its_own_metric(tmp_path):
    """Spec-Bench's math questions are scored with GSM8K accuracy (metric=spec_bench), with the reference NLL
    and the cost column beside them; a category without one (qa) gets no score."""
    for category, scored in (("math_reasoning", {"gsm8k_acc", "reference_nll"}), ("qa", set())):
        specrepro(
            "run",
            *FAST,
            "+experiment=spec_bench",
            "method=ar",
            f"dataset.category={category}",
            "dataset.limit=1",
            "logger=none",
            cwd=tmp_path,
        )
        metrics = next(
            json.loads((p / "metrics.json").read_text())
            for p in run_dirs(tmp_path).values()
            if OmegaConf.load(p / "config.yaml").dataset.category == category
        )
        assert scored <= set(metrics) and not ({"gsm8k_acc", "rouge_l"} - scored) & set(metrics)
        assert metrics["training_minutes"] == 0.0 and metrics["lossless_paired"] == 1.0


def test_reference_nll_scores_each_reference_under_the_run_model(tmp_path):
    """`reference_nll=true`: the NLL per token of each GSM8K solution after its prompt, as a teacher-forced
    cross-entropy computed by hand gives it."""
    import torch

    from specrepro.metrics.quality import reference_nll
    from tests.conftest import tiny_llama

    model = tiny_llama(seed=5).eval()
    prompt, answer = [3, 4, 5], [6, 7, 8, 9]
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([prompt + answer])).logits[0].float(), -1)
    by_hand = -sum(float(log_probs[len(prompt) - 1 + i, token]) for i, token in enumerate(answer)) / len(answer)
    assert abs(reference_nll(model, prompt, answer) - by_hand) < 1e-4

    specrepro(
        "run", *FAST, "method=ar", "dataset=gsm8k", "dataset.limit=2", "reference_nll=true", "logger=none", cwd=tmp_path
    )
    [run] = run_dirs(tmp_path).values()
    rows = [json.loads(line) for line in (run / "generations.jsonl").read_text().splitlines()]
    assert all(row["scores"]["reference_nll"] > 0 for row in rows)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["reference_nll"] == sum(row["scores"]["reference_nll"] for row in rows) / 2


def test_a_turn_timed_across_a_suspension_is_timed_again():
    """A process stopped and continued (SIGCONT) while a turn is timed decodes that turn again, so the pause is
    in no recorded wall time; outside `suspension.watching()` a SIGCONT changes nothing."""
    import signal

    from specrepro import suspension
    from specrepro.decoding.ar import ARDecoder
    from specrepro.decoding.sampling import Sampling
    from specrepro.runner import decode_turn
    from tests.conftest import tiny_llama

    class ResumedDuringOddDecodes(ARDecoder):
        calls = 0

        def _decode(self, *args):
            ResumedDuringOddDecodes.calls += 1
            if ResumedDuringOddDecodes.calls % 2:  # every other decode
                os.kill(os.getpid(), signal.SIGCONT)  # what the shell sends on `fg`, a scheduler on resume
            super()._decode(*args)

    model = tiny_llama()
    method, baselines = ResumedDuringOddDecodes(model, None), {"ar": ARDecoder(model, None)}
    greedy = Sampling(do_sample=False)
    with suspension.watching():
        gen, beside = decode_turn(method, baselines, [1, 2, 3], greedy, 8, seed=0)
    assert ResumedDuringOddDecodes.calls == 2 and gen.token_ids == beside["ar"].token_ids
    decode_turn(method, baselines, [1, 2, 3], greedy, 8, seed=0)
    assert ResumedDuringOddDecodes.calls == 3  # not watching: the SIGCONT of the third is not counted


def test_a_process_suspended_during_every_timing_of_a_turn_stops_in_one_line():
    """Paused over and over (cpulimit, a scheduler slicing its time), every timing of a turn holds a pause: the run
    stops with one line instead of timing that turn again forever."""
    import signal

    from specrepro import suspension
    from specrepro.decoding.ar import ARDecoder
    from specrepro.decoding.sampling import Sampling
    from specrepro.runner import SUSPENDED_TIMINGS, decode_turn
    from tests.conftest import tiny_llama

    class AlwaysResumed(ARDecoder):
        calls = 0

        def _decode(self, *args):
            AlwaysResumed.calls += 1
            os.kill(os.getpid(), signal.SIGCONT)
            super()._decode(*args)

    method = AlwaysResumed(tiny_llama(), None)
    with suspension.watching(), pytest.raises(SpecReproError, match="suspended during 5 timings of one turn"):
        decode_turn(method, {}, [1, 2, 3], Sampling(do_sample=False), 4, seed=0)
    assert AlwaysResumed.calls == SUSPENDED_TIMINGS


class ScriptedArm:
    """A decoder stand-in whose successive generations take the given wall times and emit the given tokens."""

    def __init__(self, wall_times, tokens=None):
        self.wall_times, self.tokens, self.calls = list(wall_times), tokens or [[7, 8]] * len(wall_times), 0

    def generate(self, ids, sampling, max_new_tokens, seed):
        from specrepro.decoding.base import Generation

        gen = Generation(token_ids=self.tokens[self.calls], wall_time=self.wall_times[self.calls])
        self.calls += 1
        return gen

    def carried(self):
        return None

    def restore(self, carried):
        pass


def test_timing_repeats_keep_each_arms_fastest_decoding():
    """timing.repeats=R: `ar` and the method each decode the turn R times, in turn, and each keeps its own fastest
    timing (a slow repeat of one arm, disturbed by other load, is not paired with a fast one of the other)."""
    from specrepro.runner import decode_turn

    method, ar = ScriptedArm([0.9, 0.5, 0.7]), ScriptedArm([0.4, 1.2, 0.3])
    gen, beside = decode_turn(method, {"ar": ar}, [1, 2, 3], None, 8, seed=0, repeats=3)
    assert (gen.wall_time, beside["ar"].wall_time) == (0.5, 0.3) and method.calls == ar.calls == 3
    once, _ = decode_turn(ScriptedArm([0.9]), {"ar": ScriptedArm([0.4])}, [1, 2, 3], None, 8, seed=0)
    assert once.wall_time == 0.9  # the default: one timing, as before the option


def test_alternating_order_times_the_method_first_on_every_other_turn():
    """timing.order=alternate: the baselines right after the method on odd turns (record index + sample + turn), right
    before it on the others; "ar_first" (the default) never times the method first."""
    from specrepro.runner import decode_turn, method_timed_first

    order = []

    class LoggedArm(ScriptedArm):
        def __init__(self, name):
            super().__init__([0.5])
            self.name = name

        def generate(self, *args):
            order.append(self.name)
            self.calls = 0
            return super().generate(*args)

    method, arms = LoggedArm("method"), {"ar": LoggedArm("ar"), "eager_ar": LoggedArm("eager_ar")}
    decode_turn(method, arms, [1, 2, 3], None, 8, seed=0, method_first=True)
    decode_turn(method, arms, [1, 2, 3], None, 8, seed=0)
    assert order == ["method", "ar", "eager_ar", "ar", "eager_ar", "method"]
    assert [method_timed_first("alternate", 0, 0, turn) for turn in range(4)] == [False, True, False, True]
    assert [method_timed_first("alternate", 1, 0, turn) for turn in range(2)] == [True, False]
    assert not any(method_timed_first("ar_first", i, 0, t) for i in range(3) for t in range(2))


def test_a_run_in_alternating_order_records_which_arm_went_first_and_the_order_effect(tmp_path):
    """Through the runner: two two-turn records in alternating order time the method first on two of four turns,
    say so in every turn, and the run reports `order_effect_paired` beside `speedup_paired`."""
    specrepro(
        "run",
        *FAST,
        "+experiment=spec_bench",
        "method=ar",
        "dataset.category=multi_turn",
        "dataset.limit=2",
        "timing.order=alternate",
        "logger=none",
        cwd=tmp_path,
    )
    [run] = [
        p for key, p in run_dirs(tmp_path).items() if OmegaConf.load(p / "config.yaml").timing.order == "alternate"
    ]
    rows = [json.loads(line) for line in (run / "generations.jsonl").read_text().splitlines()]
    firsts = [
        turn["method_timed_first"] for row in sorted(rows, key=lambda r: r["index"]) for turn in row["samples"][0]
    ]
    assert firsts == [False, True, True, False]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["order_effect_paired"] > 0 and metrics["order_effect_paired_ci95"] >= 0
    assert metrics["lossless_paired"] == 1.0


def test_timing_repeats_that_decode_differently_are_refused():
    """Repeats of one arm that emit other tokens (nondeterministic kernels) are not one decoding: the run stops."""
    from specrepro.runner import decode_turn

    method = ScriptedArm([0.5, 0.4], tokens=[[7, 8], [7, 9]])
    with pytest.raises(
        SpecReproError, match="the method arm decoded one turn differently in two of its timing.repeats"
    ):
        decode_turn(method, {}, [1, 2, 3], None, 8, seed=0, repeats=2)


def recycling_decoder():
    """Token Recycling with its hot-start matrix carried over (the default) on a tiny LLaMA; no stop at EOS."""
    from specrepro.decoding.token_recycling import TokenRecyclingConfig, TokenRecyclingDecoder
    from tests.conftest import tiny_llama

    decoder = TokenRecyclingDecoder(tiny_llama(), None, TokenRecyclingConfig(persist=True))
    decoder.eos_ids = set()
    return decoder


def test_a_turn_timed_again_drafts_from_what_the_turns_before_it_left(monkeypatch):
    """A turn decoded again (its process suspended while timed, or each of timing.repeats) drafts from the carried
    state as it was before the turn, not from what decoding the turn taught it: a retimed turn of token_recycling
    took 5 steps of 7 accepted tokens where its one timing took 31 of 1 (audit round 4)."""
    from specrepro import suspension
    from specrepro.decoding.sampling import Sampling
    from specrepro.runner import decode_turn

    prompt = list(range(3, 27))
    once = recycling_decoder().generate(prompt, Sampling(), 30)
    resumes = iter([0, 1, 1, 1, 1, 1])  # resumed during the first timing: the turn is timed again
    monkeypatch.setattr(suspension, "resumes", lambda: next(resumes))
    decoder = recycling_decoder()
    gen, _ = decode_turn(decoder, {}, prompt, Sampling(), 30, seed=0, repeats=2)
    assert (gen.steps, gen.accepted) == (once.steps, once.accepted)
    reference = recycling_decoder()
    reference.generate(prompt, Sampling(), 30)
    assert torch.equal(decoder.carried(), reference.carried())  # the next turn drafts from one decoding's matrix


def test_the_warm_up_leaves_no_trace_of_the_first_records_answer(monkeypatch):
    """The untimed warm-up decodes the first record's prompt: a method that carries state would draft its answer
    from it (token_recycling's first record: accepted [7, 7, 2, ...] with the warm-up, [1, 1, 1, ...] without)."""
    from specrepro import runner
    from specrepro.decoding.sampling import Sampling

    prompt = list(range(3, 27))
    monkeypatch.setattr(runner, "prompt_ids", lambda *args: prompt)
    decoder = recycling_decoder()
    cfg = OmegaConf.create({"timing": {"warmup": 2, "warmup_tokens": 16}, "decoding": {"seed": 0}, "dataset": {}})
    runner.warm_up(cfg, SimpleNamespace(tokenizer=None), [decoder], record=None, sampling=Sampling())
    unwarmed = recycling_decoder().generate(prompt, Sampling(), 30)
    assert decoder.generate(prompt, Sampling(), 30).accepted == unwarmed.accepted


def test_training_minutes_leave_out_a_pause_of_the_process():
    """`suspension.clock()` (training and data-generation seconds) stands still while the process is stopped:
    a child stopped for 3 s, 0.6 s into a 2 s sleep, times about 1 s (the pause counts from the last heartbeat),
    where perf_counter says 3.6."""
    import signal
    import subprocess
    import sys
    import time

    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import time; from specrepro import suspension\n"
                "suspension.STALL = 1.0\n"
                "start, wall = suspension.clock(), time.perf_counter()\n"
                "print('timing', flush=True)\n"
                "time.sleep(2.0)\n"
                "print(round(suspension.clock() - start, 1), round(time.perf_counter() - wall, 1), flush=True)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline() == "timing\n"
    time.sleep(0.6)
    child.send_signal(signal.SIGSTOP)
    time.sleep(3.0)
    child.send_signal(signal.SIGCONT)
    measured, wall = map(float, child.stdout.readline().split())
    child.wait(timeout=30)
    assert wall >= 3.4 and measured <= wall - 2.0, (measured, wall)


def test_a_run_on_onednn_linears_also_reports_its_speedup_over_ar_on_torchs(tmp_path):
    """`timing.torch_ar`: `ar` on torch's own linears is timed beside the paired `ar` on oneDNN's, on the same model
    (on an Ice Lake Xeon torch's one-token forward is the faster), and the run reports its speedup over each and
    over the faster of the two, turn by turn (never above either)."""
    specrepro(
        "run",
        *FAST,
        "method=pld",
        "dataset=gsm8k",
        "dataset.limit=2",
        "timing.paired=true",
        "timing.torch_ar=true",
        "hardware.linear_kernel=onednn",
        "logger=none",
        cwd=tmp_path,
    )
    [run] = [path for key, path in run_dirs(tmp_path).items() if key.startswith("pld:")]
    pld = json.loads((run / "metrics.json").read_text())
    rows = [json.loads(line) for line in (run / "generations.jsonl").read_text().splitlines()]
    turns = [turn for row in rows for turn in row["samples"][0]]
    assert all(turn["torch_ar_wall_time"] > 0 and turn["ar_wall_time"] > 0 for turn in turns)
    assert pld["speedup_paired_fastest"] <= min(pld["speedup_paired"], pld["speedup_paired_torch"]) + 1e-12
    assert 0 <= pld["fastest_ar_share_torch"] <= 1 and 0 <= pld["lossless_torch"] <= 1


def test_timing_torch_ar_needs_paired_timing_on_onednn_linears(tmp_path):
    out = specrepro("run", *FAST, "method=pld", "timing.torch_ar=true", "logger=none", cwd=tmp_path, check=False)
    assert out.returncode == 2 and "timing.torch_ar" in out.stderr and "Traceback" not in out.stderr
