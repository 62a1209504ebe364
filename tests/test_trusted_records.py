"""No silent wrong numbers: impossible metrics fail the run, a run's identity covers the data it decodes, a failed
sweep job is reported while the others run, bad input gets one line, and records carry their provenance."""

from __future__ import annotations

import json
import math
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specrepro.errors import SpecReproError
from specrepro.metrics.speed import (
    ci95,
    impossible_generation,
    impossible_metrics,
    mean_ci95,
    paired_speedup,
    speed_metrics,
)
from specrepro.models.kernels import native_bf16
from tests.test_runner import FAST, run_dirs, specrepro


def _gen(accepted, drafted, n_tokens=None, steps=None):
    n_tokens = sum(accepted) + 1 if n_tokens is None else n_tokens
    return {
        "token_ids": list(range(n_tokens)),
        "accepted": accepted,
        "drafted": drafted,
        "steps": len(accepted) if steps is None else steps,
        "wall_time": 1.0,
        "draft_time": 0.0,
        "verify_time": 0.0,
    }


def test_possible_step_counts_pass():
    assert impossible_generation(_gen([1, 3, 2], [2, 2, 2])) is None
    assert impossible_generation(_gen([1, 1], [0, 0])) is None
    assert impossible_metrics(speed_metrics([_gen([1, 3, 2], [2, 2, 2])])) is None


def test_a_method_that_times_neither_part_of_a_step_has_no_draft_or_verify_cost():
    """hf_assisted runs transformers' own loop, so it times whole generations only: its draft and verify costs
    are unknown (NaN, "–" in a table), not 0.00; a method timing its verification has a draft cost of 0."""
    untimed = {**_gen([2, 1], [2, 2]), "ar_wall_time": 2.0, "ar_tokens": 4, "ar_prefill_time": 0.5}
    costs = paired_speedup([untimed])
    assert math.isnan(costs["draft_cost_paired"]) and math.isnan(costs["verify_cost_paired"])
    assert math.isnan(speed_metrics([untimed])["verify_ms_per_step"])
    timed = paired_speedup([{**untimed, "verify_time": 0.5}])  # 0.25 s a step; ar: 1.5 s over 3 steps
    assert timed["draft_cost_paired"] == 0.0 and timed["verify_cost_paired"] == 0.5


def test_a_paired_speedup_carries_the_95_percent_confidence_interval_of_its_per_turn_ratios():
    """`speedup_paired_ci95` is Student's t half-width over the turns' throughput ratios: t(0.975, 3) = 3.182 for
    four turns; one turn has no interval; turns that all agree have none wider than 0."""

    def turn(method_wall, ar_wall):  # 4 tokens each; the ratio is ar_wall / method_wall
        return {**_gen([2, 1], [2, 2]), "wall_time": method_wall, "ar_wall_time": ar_wall, "ar_tokens": 4}

    turns = [turn(1.0, ar) for ar in (1.0, 1.2, 1.4, 1.8)]
    paired = paired_speedup(turns)
    ratios = [1.0, 1.2, 1.4, 1.8]
    sd = (sum((r - 1.35) ** 2 for r in ratios) / 3) ** 0.5
    assert paired["speedup_paired"] == pytest.approx(1.35)
    assert paired["speedup_paired_ci95"] == pytest.approx(3.182446 * sd / 2)
    assert math.isnan(paired_speedup(turns[:1])["speedup_paired_ci95"])
    assert paired_speedup([turns[0]] * 3)["speedup_paired_ci95"] == 0.0
    eager = paired_speedup(
        [{**t, "eager_ar_wall_time": t["ar_wall_time"], "eager_ar_tokens": 4} for t in turns], "eager_ar"
    )
    assert eager["speedup_paired_eager_ci95"] == pytest.approx(paired["speedup_paired_ci95"])


def test_a_mean_over_runs_carries_the_interval_of_the_mean_from_the_runs_own_intervals():
    """A table's mean of two runs' speedups: its half-width is a quarter of Welch's interval of their difference (the
    same variance, halved), here recovered from each run's `_ci95` and turn count alone; one run keeps its own; a run
    without an interval, or a key whose interval is not Student's t over turns, gives none."""
    from scipy import stats

    a, b = [1.0, 1.2, 1.4, 1.8], [1.5, 1.6, 1.4, 1.7, 1.9, 1.3]
    runs = [
        {"speedup_paired": sum(x) / len(x), "speedup_paired_ci95": ci95(x), "n_generations": len(x)} for x in (a, b)
    ]
    low, high = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert mean_ci95(runs, "speedup_paired") == pytest.approx((high - low) / 4)
    assert mean_ci95(runs[:1], "speedup_paired") == pytest.approx(ci95(a))
    assert math.isnan(mean_ci95([runs[0], {"speedup_paired": 1.5, "n_generations": 6}], "speedup_paired"))
    assert math.isnan(mean_ci95([runs[0], {"speedup_paired_ci95": None, "n_generations": 1}], "speedup_paired"))
    assert math.isnan(mean_ci95([{**r, "order_effect_paired_ci95": 0.1} for r in runs], "order_effect_paired"))


def test_a_mean_over_runs_of_the_speedup_over_the_faster_ar_carries_its_interval_too():
    """`timing.torch_ar` runs record `speedup_paired_torch_ci95` and `speedup_paired_fastest_ci95`, Student's t over
    their turns as `speedup_paired_ci95` is: a table's mean of such runs shows the interval of that mean as well."""
    a, b = [1.0, 1.2, 1.4, 1.8], [1.5, 1.6, 1.4, 1.7, 1.9, 1.3]
    runs = [{"speedup_paired_ci95": ci95(x), "n_generations": len(x)} for x in (a, b)]
    for key in ("speedup_paired_torch", "speedup_paired_fastest"):
        renamed = [{f"{key}_ci95": r["speedup_paired_ci95"], "n_generations": r["n_generations"]} for r in runs]
        assert mean_ci95(renamed, key) == pytest.approx(mean_ci95(runs, "speedup_paired"))


def test_a_run_timed_in_alternating_order_measures_the_advantage_of_the_arm_timed_second():
    """`order_effect_paired`: half the difference of the mean log speedups of the turns that timed the method second
    and first (Welch's t interval, halved); an arm 10% faster when timed second reads 1.10. Runs that always timed
    `ar` first, or records made before the key, have none."""
    from scipy import stats

    def turn(ratio, method_first):  # 4 tokens each in 1 s; ar's wall time makes the ratio
        return {**_gen([2, 1], [2, 2]), "ar_wall_time": ratio, "ar_tokens": 4, "method_timed_first": method_first}

    second, first = [1.21, 1.1, 1.3, 1.2], [1.0, 0.9, 1.1, 1.0]
    paired = paired_speedup([turn(r, False) for r in second] + [turn(r, True) for r in first])
    logs_second, logs_first = [math.log(r) for r in second], [math.log(r) for r in first]
    difference = sum(logs_second) / 4 - sum(logs_first) / 4
    low, high = stats.ttest_ind(logs_second, logs_first, equal_var=False).confidence_interval(0.95)
    assert (
        paired["order_effect_paired"] == pytest.approx(math.exp(difference / 2))
        and 1.08 < math.exp(difference / 2) < 1.12
    )
    assert paired["order_effect_paired_ci95"] == pytest.approx((math.exp(high / 2) - math.exp(low / 2)) / 2)
    assert "order_effect_paired" not in paired_speedup([turn(r, False) for r in second + first])
    assert "order_effect_paired" not in paired_speedup(
        [{**turn(r, True), "method_timed_first": None} for r in second] + [turn(1.0, True)]
    )


@pytest.mark.parametrize(
    "gen, problem",
    [
        (_gen([31], [3]), "31 tokens from 3 drafts"),  # hf_assisted's collapsed counting on transformers 5.24
        (_gen([3], [1]), "3 tokens from 1 drafts"),  # one more than the drafts and the target's own token
        (_gen([2, 0], [1, 1]), "no token"),
        (_gen([1, 1], [0, 0], steps=1), "1 steps but 2"),
        (_gen([1, 1], [0, 0], n_tokens=9), "9 tokens but the steps committed 2"),
    ],
)
def test_impossible_step_counts_are_named(gen, problem):
    assert problem in impossible_generation(gen)


@pytest.mark.parametrize(
    "metrics, problem",
    [
        ({"accept_rate": 3.0}, "accept_rate 3.00"),
        ({"hm": 142.9}, "hm 142.90"),
        ({"draft_token_share": -0.1}, "draft_token_share"),
        ({"mat": 31.0, "mean_drafted_per_step": 3.0}, "mat 31.00"),
    ],
)
def test_impossible_run_metrics_are_named(metrics, problem):
    assert problem in impossible_metrics(metrics)


def test_a_decoder_reporting_impossible_counts_fails_the_run_and_records_nothing_complete(tmp_path, monkeypatch):
    from specrepro import runner
    from specrepro.decoding.ar import ARDecoder
    from tests.test_config import compose_run

    class Overcounting(ARDecoder):
        def _decode(self, prompt_ids, sampling, out, rng):
            super()._decode(prompt_ids, sampling, out, rng)
            out.gen.steps, out.gen.accepted, out.gen.drafted = 1, [len(out.gen.token_ids) - 1], [3]

    monkeypatch.setattr(
        runner, "build_decoder", lambda method, target, ctx: Overcounting(target.model, target.tokenizer)
    )
    cfg = compose_run(
        *FAST, "method=pld", "dataset.limit=1", "logger=none", "reference=false", f"results_dir={tmp_path}"
    )
    with pytest.raises(SpecReproError, match="impossible step counts"):
        runner.run(cfg)
    assert not list(tmp_path.glob("runs/*/metrics.json"))


def _gsm8k_file(path: Path, questions: list[str]) -> None:
    path.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in questions))


def test_an_edited_dataset_file_is_a_new_run_and_never_reuses_the_old_reference(tmp_path):
    data = tmp_path / "my.jsonl"
    _gsm8k_file(data, ["What is 2 + 2?", "What is 3 + 5?"])
    args = ["run", *FAST, "dataset=gsm8k", f"dataset.path={data}", "logger=none"]
    specrepro(*args, "method=ar", cwd=tmp_path)
    [old_ar] = run_dirs(tmp_path).values()

    _gsm8k_file(data, ["What is 2 + 2?", "What is 7 + 9?"])
    specrepro(*args, "method=pld", cwd=tmp_path)
    runs = run_dirs(tmp_path)
    assert len(runs) == 3  # a new ar reference was decoded for the edited file
    pld = json.loads(next(p for k, p in runs.items() if k.startswith("pld:")).joinpath("metrics.json").read_text())
    assert pld["reference_run"] != old_ar.name and pld["lossless"] == 1.0
    new_ar = json.loads((tmp_path / "results" / "runs" / pld["reference_run"] / "metrics.json").read_text())
    assert (
        new_ar["data_fingerprint"]
        == pld["data_fingerprint"]
        != json.loads((old_ar / "metrics.json").read_text())["data_fingerprint"]
    )

    out = specrepro(*args, "method=ar", cwd=tmp_path)  # the edited file's ar run exists now: reused
    assert "already complete" in out.stdout + out.stderr and len(run_dirs(tmp_path)) == 3


def test_code_counts_as_its_syntax_so_comments_docstrings_and_wrapping_are_the_same_code():
    from specrepro.identity import syntax

    versions = {
        "plain": "def draft(tokens, k):\n    return tokens[-1:] * k\n",
        "commented": '"""Drafts."""\n# why\ndef draft(tokens, k):\n    """The last token, k times."""\n'
        "    return (tokens[-1:]  # the last one\n            * k)\n",
        "fixed": "def draft(tokens, k):\n    return tokens[-2:-1] * k\n",
    }
    forms = {name: syntax(text) for name, text in versions.items()}
    assert forms["plain"] == forms["commented"] != forms["fixed"]


def test_a_decoder_whose_source_cannot_be_read_is_refused_in_one_line(monkeypatch):
    """A run is named by its code: a decoder class defined where no source is kept (exec'd text, a notebook cell on
    Python < 3.13) cannot be, and says so rather than naming runs by nothing."""
    from specrepro import registry
    from specrepro.identity import code_fingerprint

    namespace = {"__name__": "made_in_a_cell"}
    exec("from specrepro.decoding.ar import ARDecoder\nclass CellDecoder(ARDecoder):\n    name = 'cell'\n", namespace)
    registry.load()
    monkeypatch.setitem(registry.METHODS, "cell", registry.Method(namespace["CellDecoder"], registry.MethodConfig))
    with pytest.raises(SpecReproError, match="the source of CellDecoder cannot be read.*define it in a module"):
        code_fingerprint("cell")


def test_a_record_made_by_other_code_is_a_new_run_and_the_unchanged_reference_is_reused(tmp_path, monkeypatch):
    """The EESD bug of 8a0c18f drafted worse yet stayed lossless: its records must not be resumed by the fixed
    code. A toy method drafts the first token (the 'bug'), then the last (the 'fix')."""
    from specrepro import registry
    from tests.test_registry import TOY_MODULE

    module = tmp_path / "toy_method.py"
    module.write_text(TOY_MODULE.replace("tokens[0, -1:]", "tokens[0, :1]"))
    (tmp_path / "my_conf" / "method").mkdir(parents=True)
    (tmp_path / "my_conf" / "method" / "toy.yaml").write_text("defaults:\n  - /method_schema_toy@_here_\n  - _self_\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv(registry.PLUGINS_VARIABLE, "toy_method")
    args = ["run", "--config-dir", str(tmp_path / "my_conf"), *FAST, "method=toy", "dataset.limit=2", "logger=none"]
    specrepro(*args, cwd=tmp_path)
    [old] = [
        json.loads((p / "metrics.json").read_text()) for k, p in run_dirs(tmp_path).items() if k.startswith("toy:")
    ]

    module.write_text("# a comment\n" + TOY_MODULE.replace("tokens[0, -1:]", "tokens[0, :1]"))
    out = specrepro(*args, cwd=tmp_path)  # the same code: the finished run is reused
    assert "already complete" in out.stdout + out.stderr and len(run_dirs(tmp_path)) == 2

    module.write_text(TOY_MODULE)
    out = specrepro(*args, cwd=tmp_path)
    assert f"were decoded by other code ({old['run_name']}); they are kept, not reused" in out.stdout + out.stderr
    runs = run_dirs(tmp_path)
    assert len(runs) == 3  # the fixed method decoded anew; its old record stays, readable, never resumed
    toys = [json.loads((p / "metrics.json").read_text()) for k, p in runs.items() if k.startswith("toy:")]
    [new] = [m for m in toys if m["run_name"] != old["run_name"]]
    assert new["code_fingerprint"] != old["code_fingerprint"] and new["lossless"] == 1.0
    assert new["setting_key"] == old["setting_key"]  # all it computes but the code is the same
    assert new["reference_run"] == old["reference_run"]  # ar's code did not change: its record is reused


def test_a_reference_that_decoded_other_prompts_is_refused():
    from specrepro.metrics.summary import summarize

    row = {"id": "0", "prompts": ["new question"], "scores": {}, "samples": [[{**_gen([1], [0]), "token_ids": [5, 6]}]]}
    stale = {**row, "prompts": ["old question"]}
    with pytest.raises(SpecReproError, match="different prompt for record 0"):
        summarize([row], [stale], greedy=True)
    assert summarize([row], [row], greedy=True)["lossless"] == 1.0


def test_a_failed_sweep_job_is_reported_and_the_others_run(tmp_path):
    proc = specrepro("run", "-m", *FAST, "logger=none", "dataset.limit=1,-1,2", cwd=tmp_path, check=False)
    assert proc.returncode == 1
    assert sorted(
        m["n_samples"] for m in map(lambda p: json.loads((p / "metrics.json").read_text()), run_dirs(tmp_path).values())
    ) == [1, 2]
    failed = [line for line in proc.stdout.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and "dataset.limit=-1" in failed[0] and "limit must be positive" in failed[0]
    assert "Traceback" not in proc.stderr


def test_a_sweep_job_that_hits_a_bug_is_listed_with_its_traceback_logged_and_the_others_run(tmp_path):
    """Hydra's sweeper re-raises a job's exception after the batch, which stopped the sweep table: a bug is now
    logged with its traceback, its job listed as failed, and the command exits non-zero."""
    code = (
        "import specrepro.runner as runner\n"
        "real = runner.run\n"
        "def run(cfg, group=None):\n"
        "    if cfg.dataset.limit == 2:\n"
        "        raise RuntimeError('a bug in this job')\n"
        "    return real(cfg, group)\n"
        "runner.run = run\n"
        "from specrepro.cli import main\n"
        "main()\n"
    )
    args = ["run", "-m", *FAST, "logger=none", "method=ar", "dataset.limit=2,1"]
    env = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 1
    [failed] = [line for line in proc.stdout.splitlines() if "FAILED" in line]
    assert "dataset.limit=2" in failed and "RuntimeError: a bug in this job" in failed
    assert "Traceback" in proc.stdout + proc.stderr  # a bug keeps its traceback, on the console and in the job's log
    assert [
        m["n_samples"] for m in map(lambda p: json.loads((p / "metrics.json").read_text()), run_dirs(tmp_path).values())
    ] == [1]


def test_a_random_model_of_an_impossible_shape_is_refused_in_one_line(tmp_path):
    proc = specrepro(
        "run", *FAST, "dataset.limit=1", "logger=none", "model.random.num_heads=3", cwd=tmp_path, check=False
    )
    assert proc.returncode == 2
    [line] = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith("specrepro: error: model.random: hidden_size=64 must be a multiple of num_heads=3")


def test_a_run_name_is_reused_only_for_what_it_decoded(tmp_path):
    """`run_name=` names a run's directory; it does not turn off its identity: another setting under that name is
    refused in one line (not answered with the first one's numbers), and resume=false replaces it."""
    run = ["run", *FAST, "method=ar", "dataset.limit=1", "logger=none", "run_name=mine"]
    specrepro(*run, cwd=tmp_path)
    again = specrepro(*run, cwd=tmp_path)
    assert "already complete" in again.stdout
    other = specrepro(*run, "decoding.max_new_tokens=4", cwd=tmp_path, check=False)
    assert other.returncode == 2 and "run_name=mine holds a run of another setting or code" in other.stderr
    specrepro(*run, "decoding.max_new_tokens=4", "resume=false", cwd=tmp_path)
    metrics = json.loads((tmp_path / "results" / "runs" / "mine" / "metrics.json").read_text())
    assert metrics["new_tokens"] <= 4


def test_a_run_made_without_its_reference_gets_it_when_it_is_asked_for(tmp_path):
    """`reference` is not part of a run's identity (the tokens are the same): a complete run made with
    reference=false is summarized again over its `ar` reference, which is found or run, without decoding again."""
    run = ["run", *FAST, "method=pld", "dataset.limit=2", "logger=none"]
    specrepro(*run, "reference=false", cwd=tmp_path)
    [pld] = run_dirs(tmp_path).values()
    before = (pld / "generations.jsonl").read_text()
    assert json.loads((pld / "metrics.json").read_text())["reference_run"] is None
    specrepro(*run, cwd=tmp_path)
    metrics = json.loads((pld / "metrics.json").read_text())
    assert metrics["reference_run"] in {p.name for p in run_dirs(tmp_path).values()} and metrics["lossless"] == 1.0
    assert "speedup_mean" in metrics and (pld / "generations.jsonl").read_text() == before


@pytest.mark.parametrize(
    "override, message",
    [
        ("hardware.threads=-1", "hardware.threads must be positive"),
        ("decoding.top_k=-1", "decoding.top_k must be 0 (off) or positive"),
        ("timing.repeats=-1", "timing.repeats must be positive"),
        ("timing.order=-1", "timing.order must be one of ar_first, alternate"),
        ("timing.warmup=-1", "timing.warmup must be 0 or more"),
        ("timing.warmup_tokens=-1", "timing.warmup_tokens must be positive"),
    ],
)
def test_bad_values_are_refused_in_one_line(tmp_path, override, message):
    start = time.monotonic()
    proc = specrepro("run", *FAST, "dataset.limit=1", "logger=none", override, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and time.monotonic() - start < 60
    [line] = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith(f"specrepro: error: {message}") and line.endswith("got -1")
    assert not (tmp_path / "results" / "runs").exists() or not list((tmp_path / "results" / "runs").iterdir())


def test_a_prompt_longer_than_the_context_is_refused_before_decoding(tmp_path):
    data = tmp_path / "long.jsonl"
    _gsm8k_file(data, ["What is 1 + 1?", "word " * 5000])  # the tiny model's context is 4096 tokens
    proc = specrepro(
        "run", *FAST, "method=ar", "dataset=gsm8k", f"dataset.path={data}", "logger=none", cwd=tmp_path, check=False
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("specrepro: error:")]
    assert "record 1" in line and "4096-token context" in line
    assert not list((tmp_path / "results" / "runs").iterdir())  # nothing decoded, no empty run directory left


def test_a_reference_missing_some_samples_is_refused_before_decoding_not_left_out_of_the_metrics(tmp_path):
    args = ["run", *FAST, "dataset=gsm8k", "dataset.limit=2", "logger=none"]
    specrepro(*args, "method=ar", cwd=tmp_path)
    [ar] = run_dirs(tmp_path).values()
    generations = ar / "generations.jsonl"
    generations.write_text(generations.read_text().splitlines()[0] + "\n")  # cut, while metrics.json says complete
    proc = specrepro(*args, "method=pld", cwd=tmp_path, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"the `ar` reference {ar.name} is complete but has no samples for 1 record(s)" in proc.stderr
    assert list(run_dirs(tmp_path)) == [f"ar:{ar.name}"]  # no pld run recorded without its speedup and lossless
    assert not list((tmp_path / "results" / "runs").glob("*-pld-*/generations.jsonl"))  # and nothing decoded


def test_a_corrupt_metrics_file_is_redone_not_a_traceback(tmp_path):
    args = ["run", *FAST, "method=ar", "dataset.limit=1", "logger=none"]
    specrepro(*args, cwd=tmp_path)
    [run_dir] = run_dirs(tmp_path).values()
    (run_dir / "metrics.json").write_text('{"complete": tr')
    proc = specrepro(*args, cwd=tmp_path)
    assert "is corrupt" in proc.stdout + proc.stderr
    assert json.loads((run_dir / "metrics.json").read_text())["complete"] is True


def test_records_carry_provenance_and_are_readable_by_the_team(tmp_path):
    old_umask = os.umask(0o022)
    try:
        specrepro("run", *FAST, "method=ar", "dataset.limit=1", "logger=none", cwd=tmp_path)
    finally:
        os.umask(old_umask)
    [run_dir] = run_dirs(tmp_path).values()
    for name in ("metrics.json", "config.yaml", "generations.jsonl", "provenance.json"):
        assert stat.S_IMODE((run_dir / name).stat().st_mode) == 0o644, name
    origin = json.loads((run_dir / "metrics.json").read_text())["provenance"]
    assert (
        origin["record_version"] >= 2
        and len(origin["code"]["commit"]) == 40
        and origin["code"]["dirty"] in (True, False)
    )
    assert origin["versions"]["torch"] and origin["versions"]["transformers"]
    assert origin["machine"]["cpu"] and origin["machine"]["cpu_cores"] >= 1 and origin["threads"] == 1
    assert origin["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()  # e.g. AVX2, AVX512
    assert origin["machine"]["cpu_native_bf16"] == native_bf16()  # AVX512-BF16 or AMX, not AVX-512 alone
    assert origin["dtype"] == "float32" and origin["kernels"]["linear_kernel"] == "onednn"
    assert origin["started_at"] <= origin["finished_at"]


def test_an_unreachable_wandb_server_costs_at_most_its_timeout_and_logs_offline(tmp_path):
    env = {"WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "x" * 40}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        start = time.monotonic()
        proc = specrepro(
            "run",
            *FAST,
            "method=ar",
            "dataset.limit=1",
            "logger=wandb",
            "logger.mode=online",
            "logger.init_timeout=3",
            cwd=tmp_path,
        )
        elapsed = time.monotonic() - start
    finally:
        for key, value in old.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    [run_dir] = run_dirs(tmp_path).values()
    assert list(run_dir.glob("wandb/offline-run-*"))
    assert (proc.stdout + proc.stderr).count("logging offline") == 1
    assert elapsed < 90  # was ~100 s in wandb.init's own timeout alone


def test_a_record_summarised_again_updates_its_wandb_run_instead_of_adding_one(monkeypatch, tmp_path):
    """A run re-scored, or summarised again over its `ar` reference, was logged as a second W&B run of the same
    name, and W&B tables counted it twice. Its W&B id now comes from the record (its name and first start), so it
    resumes the run it was logged to; a record decoded anew (a new start) is a new W&B run."""
    import types

    from specrepro import tracking
    from tests.test_config import compose_run

    inits = []

    class FakeRun:
        summary: dict = {}

        def log(self, data):
            pass

        def finish(self):
            pass

    def init(mode, **kwargs):
        inits.append(kwargs)
        return FakeRun()

    table = types.SimpleNamespace(add_data=lambda *row: None)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Table=lambda columns: table))
    cfg = compose_run(*FAST, "logger=wandb", "logger.mode=offline")
    record = tracking.RunRecord(tmp_path / "runs" / "a-run")
    record.dir.mkdir(parents=True)
    for started_at in ("2026-12-06T10:00:00+00:00", "2026-12-06T10:00:00+00:00", "2026-12-06T11:00:00+00:00"):
        record.provenance_path.write_text(json.dumps({"started_at": started_at}))
        tracking.log_to_wandb(cfg, record, "a-run", None, {"mat": 1.0}, [])
    assert [kwargs["resume"] for kwargs in inits] == ["allow"] * 3
    assert inits[0]["id"] == inits[1]["id"] != inits[2]["id"]
    record.provenance_path.unlink()  # with logger=none nothing of W&B's is computed, the id included
    tracking.log_to_wandb(compose_run(*FAST, "logger=none"), record, "a-run", None, {"mat": 1.0}, [])
    assert len(inits) == 3


def test_a_metric_a_record_summarised_again_no_longer_has_leaves_its_resumed_wandb_run(monkeypatch, tmp_path):
    """A resumed W&B run keeps the summary it was logged with: a metric that the record summarised again has as None
    was left at its earlier value there (and in a `--source wandb` table). It is removed, so W&B holds what the record
    holds."""
    import types

    from specrepro import tracking
    from tests.test_config import compose_run

    class Summary(dict):
        def __delitem__(self, key):  # W&B's summary sends a removal whether it holds the key here or not
            self.pop(key, None)

    summary = Summary()
    run = types.SimpleNamespace(summary=summary, log=lambda data: None, finish=lambda: None)
    table = types.SimpleNamespace(add_data=lambda *row: None)
    wandb = types.SimpleNamespace(init=lambda mode, **kwargs: run, Table=lambda columns: table)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    cfg = compose_run(*FAST, "logger=wandb", "logger.mode=offline")
    record = tracking.RunRecord(tmp_path / "runs" / "a-run")
    record.dir.mkdir(parents=True)
    record.provenance_path.write_text(json.dumps({"started_at": "2026-12-06T10:00:00+00:00"}))
    tracking.log_to_wandb(cfg, record, "a-run", None, {"mat": 1.5, "judge_score": 7.0}, [])
    tracking.log_to_wandb(cfg, record, "a-run", None, {"mat": 1.5, "judge_score": None}, [])
    assert summary == {"mat": 1.5}


def test_a_footer_tells_cpus_of_one_model_name_apart_by_their_vector_instructions():
    """One EPYC model name covers CPUs with and without AVX-512, whose kernels (and so draft and verify costs)
    differ: the footer names what torch ran on; records made before it say only the model."""
    from specrepro.provenance import machine_label

    assert machine_label({"cpu": "AMD EPYC", "cpu_cores": 2, "cpu_capability": "AVX2"}) == "AMD EPYC (AVX2), 2 cores"
    assert machine_label({"cpu": "AMD EPYC", "cpu_cores": 2}) == "AMD EPYC, 2 cores"
    assert machine_label({"cpu": "x", "cpu_cores": 16, "gpu": "NVIDIA H100", "gpu_count": 1}) == "1 x NVIDIA H100"


def test_a_copy_without_git_records_the_commit_its_copier_names(monkeypatch):
    """A checkout copied without its .git (to a lent GPU, a cluster node) has no commit of its own to read: the
    copier names it in SPECREPRO_COMMIT, and its dirtiness stays unknown rather than claimed clean."""
    import subprocess

    from specrepro import provenance

    def no_git(*args, **kwargs):
        raise subprocess.CalledProcessError(128, "git")

    monkeypatch.setattr(subprocess, "run", no_git)
    monkeypatch.setenv("SPECREPRO_COMMIT", "0123abc")
    provenance.code_version.cache_clear()
    try:
        assert provenance.code_version() == {"commit": "0123abc", "dirty": None}
    finally:
        provenance.code_version.cache_clear()


def test_results_the_harness_writes_do_not_make_the_checkout_dirty(tmp_path):
    """A pipeline rewrites committed files under results/ (tables, stages.json) as it goes: its next stage's
    records must not call the code dirty for that. An edited or a new source file or config does."""
    import subprocess

    from specrepro.provenance import checkout_version

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    package, table = tmp_path / "src" / "specrepro", tmp_path / "results" / "paper" / "table.md"
    package.mkdir(parents=True), table.parent.mkdir(parents=True)
    (package / "provenance.py").write_text("x = 1\n"), table.write_text("| a |\n")
    git("init", "-q"), git("add", "."), git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    assert checkout_version(package)["dirty"] is False and len(checkout_version(package)["commit"]) == 40
    table.write_text("| b |\n")
    assert checkout_version(package)["dirty"] is False
    (package / "provenance.py").write_text("x = 2\n")
    assert checkout_version(package)["dirty"] is True
    git("checkout", "--", "."), (package / "new_method.py").write_text("y = 1\n")  # a new file changes the code too
    assert checkout_version(package)["dirty"] is True
    (package / "new_method.py").unlink(), (tmp_path / "results" / "paper" / "new_table.md").write_text("| c |\n")
    assert checkout_version(package)["dirty"] is False


def test_reading_the_checkout_version_never_writes_the_users_git_index(tmp_path):
    """`git status` refreshes a stale index under .git/index.lock; a run killed while it does so would leave the lock
    and break the user's next commit. The harness reads the checkout without taking git's optional locks."""
    import os
    import subprocess

    from specrepro.provenance import checkout_version

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    package = tmp_path / "src" / "specrepro"
    package.mkdir(parents=True)
    (package / "provenance.py").write_text("x = 1\n")
    git("init", "-q"), git("add", "."), git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    os.utime(package / "provenance.py", ns=(1, 1))  # same content, other stat: git status would refresh the index
    index = tmp_path / ".git" / "index"
    before = index.stat().st_mtime_ns, index.read_bytes()
    assert checkout_version(package)["dirty"] is False
    assert (index.stat().st_mtime_ns, index.read_bytes()) == before


def test_a_last_step_cut_before_its_target_token_took_every_token_it_kept_from_the_draft():
    """A step commits its accepted drafts and then the target's own token; cut at the budget or at an EOS among
    the drafts, all it kept came from the draft, which acceptance and HM count."""
    import torch

    from specrepro.decoding.base import GenerationBuilder

    def decoded(budget, step):
        out = GenerationBuilder(max_new_tokens=budget, eos_ids={99}, device=torch.device("cpu"))
        out.commit([5], prefill=True)
        out.commit(step, drafted=3)  # three drafts, all accepted, then the target's token
        return out.gen.to_dict() | {"wall_time": 1.0}

    for budget, step, kept in ((3, [11, 12, 13, 14], 2), (50, [7, 99, 8, 9], 2), (50, [11, 12, 13, 14], 3)):
        gen = decoded(budget, step)
        assert gen["accepted"] == [kept + (kept == 3)] and gen["last_step_cut"] == (kept < 3)
        metrics = speed_metrics([gen])
        assert metrics["accept_rate"] == pytest.approx(kept / 3)
        assert metrics["draft_token_share"] == pytest.approx(kept / len(gen["token_ids"]))
    old_record = {**_gen([2, 1], [2, 2]), "token_ids": [0, 1, 2]}  # recorded before `last_step_cut`: as then
    assert speed_metrics([old_record])["accept_rate"] == 0.25


def test_a_method_whose_drafts_are_never_accepted_has_an_hm_of_0_and_one_that_drafts_none_has_none():
    assert speed_metrics([_gen([1, 1], [4, 4])])["hm"] == 0.0
    assert math.isnan(speed_metrics([_gen([1, 1], [0, 0])])["hm"])


def test_ar_steps_decoded_past_eos_and_thrown_away_count_in_its_step_time():
    """On a GPU `ar` reads its tokens every 8 steps, so up to 7 forwards after an EOS are run and dropped: they are
    recorded, and `ar`'s time per step divides by the forwards it ran, not by its tokens."""
    from specrepro.decoding.ar import ARDecoder
    from specrepro.decoding.sampling import Sampling
    from tests.conftest import tiny_llama
    from tests.test_decoding import prompts

    model, prompt = tiny_llama(vocab_size=64, seed=1), prompts()[0]
    every = ARDecoder(model, sync_every=1).generate(prompt, Sampling(), 20)
    gen = ARDecoder(model, sync_every=8).generate(prompt, Sampling(), 20)
    assert len(every.token_ids) == 2  # this model's second token is its EOS: the first chunk's 7 steps after it
    assert gen.token_ids == every.token_ids and (gen.steps, gen.discarded_steps) == (1, 7)
    record = gen.to_dict() | {"verify_time": 0.8}
    assert speed_metrics([record])["verify_ms_per_step"] == pytest.approx(100.0)  # 0.8 s over 8 forwards
    turn = {**_gen([1, 1], [0, 0]), "ar_wall_time": 1.0, "ar_prefill_time": 0.2, "ar_tokens": 3}
    assert paired_speedup([turn | {"verify_time": 0.2, "ar_discarded_steps": 6}])["verify_cost_paired"] == (
        pytest.approx(0.1 / (0.8 / 8))
    )


def test_the_paired_step_cost_of_a_run_that_discards_steps_divides_by_the_forwards_it_ran():
    """`ar` on a GPU timed beside itself: both arms ran 8 forwards for 1 kept step, so its paired verify cost is
    1.00, as its unpaired one, not 8.00 (its own time over its kept steps against the paired `ar`'s over all 8)."""
    arm = {**_gen([1], [0]), "verify_time": 0.8, "discarded_steps": 7}
    turn = arm | {"ar_wall_time": 1.0, "ar_prefill_time": 0.2, "ar_tokens": 2, "ar_discarded_steps": 7}
    assert speed_metrics([turn])["verify_ms_per_step"] == pytest.approx(100.0)
    assert paired_speedup([turn])["verify_cost_paired"] == pytest.approx(1.0)


def test_a_run_scored_by_other_scoring_code_is_scored_again_without_decoding(tmp_path):
    """Scoring is not part of a run's identity: a complete run whose answers another version of the scorer scored
    (a fixed GSM8K answer rule) is scored again from its recorded texts, its tokens kept, not decoded again."""
    run = ["run", *FAST, "dataset=gsm8k", "dataset.limit=2", "logger=none"]
    specrepro(*run, cwd=tmp_path)
    [ar] = run_dirs(tmp_path).values()
    rows = [json.loads(line) for line in (ar / "generations.jsonl").read_text().splitlines()]
    truth = json.loads((ar / "metrics.json").read_text())
    assert {row["scored_with"] for row in rows} == {truth["scoring_code"]}
    for row in rows:  # as an older scorer left them: every answer counted right
        row.update(scores={"gsm8k_acc": 1.0}, scored_with="older")
    (ar / "generations.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (ar / "metrics.json").write_text(json.dumps({**truth, "gsm8k_acc": 1.0, "scoring_code": "older"}))
    specrepro(*run, cwd=tmp_path)
    metrics = json.loads((ar / "metrics.json").read_text())
    assert metrics["gsm8k_acc"] == truth["gsm8k_acc"] < 1.0 and metrics["scoring_code"] == truth["scoring_code"]
    again = [json.loads(line) for line in (ar / "generations.jsonl").read_text().splitlines()]
    assert [row["samples"] for row in again] == [row["samples"] for row in rows]
    assert {row["scored_with"] for row in again} == {truth["scoring_code"]}


def test_a_fix_to_a_judges_rating_or_a_summary_scores_complete_runs_again(monkeypatch):
    """A complete run is reused as it is unless other scoring code scored it: a fixed MT-Bench rating parser or a
    fixed speed or summary figure left every complete run's old numbers in place. Those modules are scoring code."""
    from specrepro import identity

    before, real = identity.scoring_fingerprint(), identity.module_source
    for module in ("specrepro.metrics.judge", "specrepro.metrics.speed", "specrepro.metrics.summary"):
        edited = lambda name, module=module: real(name) + ("\nFIXED = 1\n" if name == module else "")  # noqa: E731
        monkeypatch.setattr(identity, "module_source", edited)
        assert identity.scoring_fingerprint() != before, module


def test_every_speed_figure_of_a_run_and_its_speedups_over_ar_are_computed_as_named():
    """Two turns with hand-counted steps against an `ar` reference: each figure a table reports, by its definition."""
    from specrepro.metrics.speed import speedups

    def timed(gen, wall, draft, verify):
        return gen | {"wall_time": wall, "draft_time": draft, "verify_time": verify}

    gens = [timed(_gen([3, 2, 1], [3, 3, 2]), 2.0, 0.3, 0.6), timed(_gen([1, 1], [2, 2]), 0.5, 0.1, 0.2)]
    ar = [timed(_gen([1] * 6, [0] * 6), 3.5, 0.0, 0.6), timed(_gen([1, 1], [0, 0]), 1.0, 0.0, 0.2)]
    metrics = speed_metrics(gens)
    assert metrics["new_tokens"] == 10 and metrics["steps"] == 5
    assert metrics["tokens_per_s"] == pytest.approx((7 / 2.0 + 3 / 0.5) / 2)  # the mean of the turns' rates
    assert metrics["total_tokens_per_s"] == pytest.approx(10 / 2.5)
    assert metrics["mat"] == pytest.approx((6 + 2) / 5)  # tokens committed after the prefill, per step
    assert metrics["accept_rate"] == pytest.approx(3 / 12)  # drafts taken (3: not the target's own) of 12
    assert metrics["draft_token_share"] == pytest.approx(3 / 10)
    assert metrics["hm"] == pytest.approx(100 * 2 * 0.25 * 0.3 / 0.55)
    assert metrics["mean_drafted_per_step"] == pytest.approx(12 / 5)
    assert (metrics["draft_ms_per_step"], metrics["verify_ms_per_step"]) == pytest.approx((80.0, 160.0))
    over_ar = speedups(gens, ar)
    assert over_ar["speedup_mean"] == pytest.approx(4.75 / ((7 / 3.5 + 3 / 1.0) / 2))
    assert over_ar["speedup_total"] == pytest.approx((10 / 2.5) / (10 / 4.5))
    assert (over_ar["draft_cost"], over_ar["verify_cost"]) == pytest.approx((0.8, 1.6))  # ar: 100 ms a step


def test_a_summary_pairs_each_turn_with_its_own_reference_and_averages_a_score_over_the_records_scored():
    """The reference's records in another order still pair by id; a score only some records have (Spec-Bench's
    categories, a reference NLL) is the mean over those records, not over all."""
    from specrepro.metrics.speed import lossless
    from specrepro.metrics.summary import summarize

    def row(rid, tokens, wall, scores):
        gen = {**_gen([1] * (len(tokens) - 1), [0] * (len(tokens) - 1)), "token_ids": tokens, "wall_time": wall}
        return {"id": rid, "prompts": [rid], "scores": scores, "samples": [[gen]]}

    rows = [row("a", [1, 2, 3, 4], 1.0, {"gsm8k_acc": 1.0}), row("b", [5, 6], 1.0, {"rouge_l": 0.5})]
    rows.append(row("c", [8, 9, 2], 1.0, {"rouge_l": 0.25}))  # `ar`'s tokens and one more: not the same output
    reference = [row("c", [8, 9], 1.0, {}), row("b", [5, 7], 0.5, {}), row("a", [1, 2, 3, 4], 2.0, {})]
    metrics = summarize(rows, reference, greedy=True)
    assert metrics["lossless"] == pytest.approx(1 / 3)
    assert metrics["speedup_mean"] == pytest.approx((4 + 2 + 3) / (2 + 4 + 2))
    assert metrics["gsm8k_acc"] == 1.0 and metrics["rouge_l"] == 0.375
    assert math.isnan(lossless([{"token_ids": [1]}] * 2, [{"token_ids": [1]}]))  # unpaired: no fraction
    paired = [
        {**r, "samples": [[{**r["samples"][0][0], "ar_wall_time": 1.0, "ar_tokens": 2, "ar_token_ids": [5, 7]}]]}
        for r in rows
    ]
    assert summarize(paired, None, greedy=True)["lossless_paired"] == 0.0  # against the `ar` timed beside each
