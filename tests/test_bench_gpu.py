"""experiments/bench_gpu.py, end to end on the CPU (eager backend, a tiny random LLaMA), gpu_check.sh's refusal
without a GPU and its time budget, and gpu_setup.sh's check of a carry: a lent GPU's minutes are too few to find a
broken script there."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parents[1] / "experiments" / "bench_gpu.py"


def test_bench_runs_every_arm_and_writes_its_figures(tmp_path, monkeypatch):
    out = tmp_path / "bench.json"
    subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--device",
            "cpu",
            "--backend",
            "eager",
            "--dtype",
            "float32",
            "--model",
            "tiny_random model.random.num_layers=2",
            "--methods",
            "jacobi;eesd1=eesd method.head=none method.num_layers=1",
            "--limit",
            "2",
            "--trained-methods",
            "jacobi method.block_size=4;self_sd_tree",
            "--artifacts-dir",
            str(tmp_path),
            "--max-new-tokens",
            "8",
            "--differentiating-guards",
            "--row-invariant",
            "--json",
            str(out),
            "--markdown",
            str(tmp_path / "bench.md"),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    figures = json.loads(out.read_text())
    arms = {
        "ar_eager",
        "ar_compiled",
        "ar_compiled_differentiating_guards",
        "pld_eager",
        "pld_compiled",
        "jacobi_eager",
        "jacobi_compiled",
        "eesd1_eager",
        "eesd1_compiled",
        "generate_eager",
        "generate_compiled",
        "ar_compiled_row_invariant",
        "pld_compiled_row_invariant",
    }  # jacobi and eesd run on compiled steps too
    assert arms <= set(figures["tok_per_s"]) and figures["model"] == "tiny_random"
    assert figures["prompts"] == figures["prompts_asked"] == 2
    # our eager arms, methods' among them, run the attention compiled steps do; `generate` transformers' own
    assert figures["attention"] == {"ours": "specrepro_sdpa", "compiled": "specrepro_sdpa", "generate": "sdpa"}
    assert all(n == 2 for n in figures["identical_to_ar_eager"].values())  # greedy: every arm decodes what ar does
    assert figures["speculative"]["jacobi_eager"]["mat"] >= 1.0
    # compiled drafts commit what eager ones do, round for round (EESD's exit layer once did not)
    assert all(figures["speculative"][f"{arm}_compiled"]["rounds_as_eager"] == 2 for arm in ("pld", "jacobi", "eesd1"))
    assert figures["ar_compiled_over_eager"] > 0 and figures["bound_tok_per_s"] > 0
    assert figures["ar_compiled_differentiating_guards_over_ar_compiled"] > 0
    assert figures["ar_compiled_row_invariant_over_ar_compiled"] > 0
    # pld on one-width steps: held to the `ar` on those steps, its rounds as eager pld's
    row_invariant = figures["speculative"]["pld_compiled_row_invariant"]
    assert row_invariant["identical_to_ar_compiled"] == 2 and row_invariant["rounds_as_eager"] == 2
    # each compiled arm's steps, compiled in turn, with the memory their graphs added
    assert set(figures["compiled_graphs_mb"]) == {
        "ar_compiled pld_compiled jacobi_compiled eesd1_compiled",
        "ar_compiled_differentiating_guards",
        "ar_compiled_row_invariant pld_compiled_row_invariant",
    }
    assert "bench_gpu.py" in figures["provenance"]["command"]  # quoted as a shell takes it back
    assert "--methods 'jacobi;eesd1=eesd method.head=none method.num_layers=1'" in figures["provenance"]["command"]
    assert figures["methods"] == {
        "jacobi": {"spec": "jacobi", "artifacts": {}},  # what each arm ran, which weights
        "eesd1": {"spec": "eesd1=eesd method.head=none method.num_layers=1", "artifacts": {}},
    }
    # --trained-methods: a label --methods names is timed as --methods says; one without its artifacts is left out
    assert list(figures["untrained_methods"]) == ["self_sd_tree"] and "self_sd_tree_eager" not in figures["tok_per_s"]
    # fp32 on the CPU: every compiled arm's output is compiled ar's, nothing to classify
    assert all(
        figures["speculative"][f"{arm}_compiled"]["near_tie_to_ar_compiled"] == 2
        and figures["speculative"][f"{arm}_compiled"]["divergences_from_ar_compiled"] == []
        for arm in ("pld", "jacobi", "eesd1")
    )
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from bench_gpu import markdown

    page = (tmp_path / "bench.md").read_text()
    assert page == markdown(figures) and "| `eesd1_compiled` |" in page and figures["date"] in page
    assert "- `eesd1`: `eesd1=eesd method.head=none method.num_layers=1`, nothing trained" in page
    assert "- Attention: `specrepro_sdpa` in our eager arms, `specrepro_sdpa` in compiled ones, `sdpa` in" in page
    assert (
        "- Compiled `ar` checking after warm-up only the guards that tell its graphs apart"
        " (`hardware.compile_guards=differentiating`) over compiled" in page
    )
    assert "- Memory its compiled graphs added (MB, the process's resident memory" in page
    # Beta-TS drafts up to k_max = 16 tokens: a 17-row verify is past the widest bucket (16), so it runs eagerly
    assert figures["eager_wide_steps"] == {"eesd1_compiled": 17}
    assert "run eagerly: `eesd1_compiled` (up to 17 rows)" in page
    assert "| `eesd1_compiled` |" in page and page.count(" | 2/2 | 2/2 |") == 4  # pld (two), jacobi, eesd1 compiled
    assert "- `pld_compiled_row_invariant` is held to `ar_compiled_row_invariant`" in page
    drafting = {arm: row["draft_ms_per_round"] for arm, row in figures["speculative"].items()}
    assert drafting["eesd1_eager"] > 0 and drafting["eesd1_compiled"] > 0 and drafting["jacobi_eager"] == 0.0
    assert "| MAT | draft ms / round |" in page and f"| {drafting['eesd1_eager']:.2f} |" in page
    assert "| identical or near-tie to compiled `ar` |" in page
    assert "- Not timed, its artifacts not found: `self_sd_tree` (`self_sd_tree`): no trained artifact" in page
    # a divergence, as a bf16 GPU run records them (metrics/divergence.py), is named with its margins
    figures["speculative"]["pld_compiled"]["divergences_from_ar_compiled"] = [
        {
            "prompt": 1,
            "position": 37,
            "token": 5,
            "ar_token": 9,
            "gap": 0.0156,
            "margin": 0.0156,
            "rounding": 0.0312,
            "near_tie": True,
        }
    ]
    assert (
        "- `pld_compiled` left compiled `ar`'s output on prompt 2 at token 37: a near-tie (logit gap 0.0156 "
        "between `ar`'s token and its own, top-2 margin 0.0156, rounding measured there 0.0312)"
    ) in markdown(figures)


def test_two_method_arms_of_one_name_are_refused_in_one_line(tmp_path):
    """`--methods "sar_draft;sar_draft method.k=3"` would time one arm under the other's name: refused, label one."""
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--device",
            "cpu",
            "--backend",
            "eager",
            "--dtype",
            "float32",
            "--model",
            "tiny_random model.random.num_layers=2",
            "--json",
            str(tmp_path / "bench.json"),
            "--methods",
            "jacobi;jacobi method.block_size=4",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "bench_gpu.py: error: --methods names the arm 'jacobi' twice: "
        "label one (e.g. 'jacobi_2=jacobi method.block_size=4')"
    )
    assert not (tmp_path / "bench.json").exists()


COMMITTED_PAGES = [
    *sorted((BENCH.parents[1] / "results" / "cpu").glob("compiled*.json")),
    *sorted((BENCH.parents[1] / "results" / "gpu").glob("bench_gpu_h200_*.json")),
]


@pytest.mark.parametrize("figures_file", COMMITTED_PAGES, ids=lambda path: path.stem)
def test_the_committed_pages_are_the_ones_their_committed_figures_give(monkeypatch, figures_file):
    """Each committed bench page (results/cpu, results/gpu) is the bench's rendering of the JSON beside it, never
    typed, from a whole run on a clean commit, whose regenerating command names no path outside the repo."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from bench_gpu import markdown

    figures = json.loads(figures_file.read_text())
    assert figures_file.with_suffix(".md").read_text() == markdown(figures)
    assert figures["prompts"] == figures["prompts_asked"] and not figures["provenance"]["code"].get("dirty")
    assert all(not word.startswith("/") for word in figures["provenance"]["command"].split())


def test_gpu_check_refuses_a_machine_without_cuda_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    script = Path(__file__).parents[1] / "experiments" / "gpu_check.sh"
    proc = subprocess.run(
        ["bash", str(script), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"gpu_check: no CUDA device visible to {sys.executable}"]
    assert not list((tmp_path / "out").glob("*.json"))  # nothing measured, nothing written


def test_an_unknown_model_preset_is_one_line():
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--device", "cpu", "--model", "no_such_model"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("bench_gpu.py: error: ")
    assert "no_such_model" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("script", "argument", "error"),
    [
        ("bench_gpu.py", ["--widths", "1,4,x"], "--widths takes comma-separated step widths"),
        ("bench_gpu.py", ["--max-new-tokens", "0"], "'0'"),
        ("profile_steps.py", ["--cache-multiples", "64,0"], "'64,0'"),
    ],
)
def test_a_bad_width_or_token_budget_is_refused_without_a_traceback(script, argument, error):
    """A typo in --widths, a budget of no new tokens or a cache multiple of 0 ended in a traceback (int()'s
    ValueError, the first generation's, a ZeroDivisionError sizing the cache) after the model had loaded."""
    proc = subprocess.run(
        [sys.executable, str(BENCH.parent / script), "--device", "cpu", *argument], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"{script}: error: ") and error in proc.stderr


def test_a_one_token_budget_gives_figures_not_a_traceback(tmp_path):
    """With --max-new-tokens 1 every arm commits its token in the prefill and runs no step: MAT was 0 / 0, a
    ZeroDivisionError after the first prompt was timed, before any figure was written."""
    out = tmp_path / "bench.json"
    model = "tiny_random model.random.num_layers=1"
    common = ["--device", "cpu", "--backend", "eager", "--model", model, "--limit", "1", "--widths", "1,4"]
    proc = subprocess.run(
        [sys.executable, str(BENCH), *common, "--max-new-tokens", "1", "--json", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert math.isnan(json.loads(out.read_text())["speculative"]["pld_eager"]["mat"])


def test_gpu_check_keeps_its_steps_within_one_budget_and_returns_one_log(tmp_path):
    """A lent machine's call ends at its limit: past BUDGET_S no step starts, and a step gets what is left."""
    fake_python = tmp_path / "python"  # names a card, and runs each step as a command that outlasts its limit
    fake_python.write_text('#!/bin/bash\nif [ "$1" = -c ]; then echo h200; else echo "ran: $*"; sleep 10; fi\n')
    fake_python.chmod(0o755)
    script = Path(__file__).parents[1] / "experiments" / "gpu_check.sh"
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", str(script), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake_python), "BUDGET_S": "5", "LONG_S": "2", "MIN_S": "2"},
    )
    assert proc.returncode == 1 and time.monotonic() - start < 10
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "gpu_check: bench_bf16 (at most 2 s)" in log
    assert "gpu_check: bench_bf16 exited with 124 (past its limit)" in log
    assert re.search(r"gpu_check: tests_cuda \(at most [23] s\)", log)  # what the budget left, not its 200 s
    assert re.search(r"gpu_check: profile_bf16 skipped: [01] s of BUDGET_S left", log)
    assert re.search(r"gpu_check: bench_fp32 skipped: [01] s of BUDGET_S left", log)
    assert "ran: experiments/bench_gpu.py --json" in log and "ran: -m pytest" in log
    assert "--widths 1,4,16,32 --row-invariant --differentiating-guards --freezing --methods jacobi" in log
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["gpu_check.log"]


def test_gpu_setup_installs_only_a_whole_undamaged_carry(tmp_path):
    """What experiments/gpu_carry.sh splits over a lent machine's calls (a tar of wheels and artifacts, its sha256
    and part count in part 1's manifest) is joined there, checked, and installed; a missing or damaged part is one
    line naming what to carry again."""
    checkout = tmp_path / "checkout"
    (checkout / "experiments").mkdir(parents=True)
    shutil.copy(Path(__file__).parents[1] / "experiments" / "gpu_setup.sh", checkout / "experiments")
    stage = tmp_path / "stage"
    (stage / "wheels").mkdir(parents=True)
    (stage / "wheels" / "hydra_core-1.3.8-py3-none-any.whl").write_bytes(b"wheel")
    (stage / "results" / "artifacts" / "sar_head-x").mkdir(parents=True)
    (stage / "results" / "artifacts" / "sar_head-x" / "head.safetensors").write_bytes(bytes(range(256)) * 40)
    with tarfile.open(tmp_path / "carry.tar", "w") as tar:
        tar.add(stage, arcname=".")
    whole = (tmp_path / "carry.tar").read_bytes()
    carried = checkout / ".gpucarry"
    for index, part in enumerate((whole[:5000], whole[5000:]), start=1):
        (carried / str(index)).mkdir(parents=True)
        (carried / str(index) / "part").write_bytes(part)
    (carried / "1" / "manifest").write_text(f"{hashlib.sha256(whole).hexdigest()} 2\n")
    (carried / "1" / "commit").write_text("0123abc\n")
    fake_python = tmp_path / "python"  # records what it is asked to install
    fake_python.write_text(f'#!/bin/bash\necho "$*" >> {tmp_path}/pip.log\n')
    fake_python.chmod(0o755)

    def setup() -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(checkout / "experiments" / "gpu_setup.sh")],
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake_python)},
        )

    (carried / "2" / "part").rename(tmp_path / "part2")
    proc = setup()
    assert proc.returncode == 1 and proc.stderr.splitlines() == ["gpu_setup: part 2 of 2 is missing: carry .gpucarry/2"]
    (carried / "2" / "part").write_bytes(b"damaged" + (tmp_path / "part2").read_bytes()[7:])
    proc = setup()
    assert proc.returncode == 1 and "do not match their sha256" in proc.stderr
    assert not (tmp_path / "pip.log").exists() and not (checkout / "results").exists()

    (tmp_path / "part2").rename(carried / "2" / "part")
    proc = setup()
    assert proc.returncode == 0 and "commit 0123abc" in proc.stdout, proc.stderr
    installs = (tmp_path / "pip.log").read_text().splitlines()
    assert installs[0].startswith("-m pip install") and installs[0].endswith("hydra_core-1.3.8-py3-none-any.whl")
    assert installs[1].endswith("-e .")
    head = checkout / "results" / "artifacts" / "sar_head-x" / "head.safetensors"
    assert head.read_bytes() == bytes(range(256)) * 40


def test_gpu_check_pages_name_the_path_they_are_committed_at_and_never_return_a_stale_one(tmp_path):
    """gpu_check.sh writes the bench's pages to results/gpu/ (the path their regenerating command names, not a lent
    machine's OUT_DIR) and copies them to OUT_DIR; a bench that fails returns no page, not one left from before,
    and leaves that one (a committed page, say) as it was."""
    checkout, out = tmp_path / "checkout", tmp_path / "out"
    (checkout / "results" / "gpu").mkdir(parents=True)
    (checkout / "experiments").symlink_to(BENCH.parent)
    fake_python = tmp_path / "python"  # a CUDA card named "fake" for gpu_check's probe; the bench runs on the CPU
    fake_python.write_text(f'#!/bin/sh\n[ "$1" = -c ] && echo fake && exit 0\nexec {sys.executable} "$@"\n')
    fake_python.chmod(0o755)
    stale = checkout / "results" / "gpu" / "bench_gpu_fake_bf16.json"

    def gpu_check(*options):
        stale.write_text("{}")
        return subprocess.run(
            [
                "bash",
                "experiments/gpu_check.sh",
                str(out),
                "--device",
                "cpu",
                "--backend",
                "eager",
                "--limit",
                "1",
                "--max-new-tokens",
                "4",
                *options,
            ],
            cwd=checkout,
            capture_output=True,
            text=True,
            # freezing is inductor's: the eager backend times the guards' arm only
            env={
                "PATH": "/usr/bin:/bin",
                "PYTHON": str(fake_python),
                "STEPS": "bench_bf16",
                "MIN_S": "1",
                "AR_SETTINGS": "--differentiating-guards",
            },
        )

    failed = gpu_check("--model", "nosuch")
    assert failed.returncode == 1 and stale.read_text() == "{}" and not list(out.glob("bench_gpu_*"))
    proc = gpu_check("--dtype", "float32", "--model", "tiny_random model.random.num_layers=2")
    assert proc.returncode == 0, proc.stderr
    figures = json.loads((out / "bench_gpu_fake_bf16.json").read_text())
    assert figures["prompts"] == 1 and figures == json.loads(stale.read_text())
    assert figures["provenance"]["command"].startswith(
        "python experiments/bench_gpu.py --json results/gpu/bench_gpu_fake_bf16.json "
        "--markdown results/gpu/bench_gpu_fake_bf16.md"
    )
    assert (out / "bench_gpu_fake_bf16.md").read_text() == (stale.with_suffix(".md")).read_text()


@pytest.mark.parametrize("script", ["bench_gpu.py", "profile_steps.py"])
def test_freezing_on_another_backend_is_refused_in_one_line(script):
    """Freezing is inductor's: the bench refuses it before loading anything, the profile when it builds its steps."""
    proc = subprocess.run(
        [sys.executable, str(BENCH.parent / script), "--device", "cpu", "--backend", "eager", "--freezing"]
        + [
            "--model",
            "tiny_random model.random.num_layers=1",
            "--tokens" if script == "profile_steps.py" else "--limit",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "freez" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()[-1]) < 200


def test_profile_steps_runs_on_a_cpu(tmp_path):
    """experiments/profile_steps.py, as a lent GPU would run it, on a tiny random LLaMA: one arm per cache multiple
    (each also checking only the guards that tell its graphs apart) and transformers' compiled `generate`, each
    with its tokens, times and cache length."""
    script = BENCH.parent / "profile_steps.py"
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            "--device",
            "cpu",
            "--backend",
            "eager",
            "--tokens",
            "4",
            "--model",
            "tiny_random model.random.num_layers=2",
            "--cache-multiples",
            "64,512",
            "--differentiating-guards",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())
    assert figures["ar_compiled_c512_cache_len"] % 512 == 0 and figures["ar_compiled_c64_cache_len"] % 64 == 0
    assert figures["ar_compiled_c64_cache_len"] < figures["ar_compiled_c512_cache_len"]
    for arm in ("ar_compiled_c64", "ar_compiled_c512", "ar_compiled_c64_differentiating_guards", "generate_compiled"):
        assert figures[arm]["tokens"] == 4 and figures[arm]["unprofiled_ms_per_token"] > 0
        assert figures[arm]["wall_over_kernel"] is None  # no kernel time on a CPU


def test_gpu_leaderboard_runs_its_rows_within_the_budget_and_packs_their_runs(tmp_path):
    """experiments/gpu_leaderboard.sh on the CPU (a tiny random LLaMA, one question a category): a row whose artifact
    was not carried fails in its one line, naming where carried artifacts are read, and the next row runs; the runs
    come back as one archive that unpacks where the leaderboard reads them; with too little of the budget left, a row
    (and a REST row's datastore build before it) is skipped and said so."""
    script = Path(__file__).parents[1] / "experiments" / "gpu_leaderboard.sh"
    tiny = "model=tiny_random decoding.max_new_tokens=4 timing.warmup_tokens=2 hardware.threads=1 dataset.limit=1"
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHON": sys.executable,
        "HARDWARE": "default",
        "RESULTS": str(tmp_path / "results"),
        "ARTIFACTS": str(tmp_path / "carried"),
        "ROWS": f"method=eagle_tree_small {tiny};method=pld {tiny}",
        "WANDB_MODE": "offline",
    }

    def leaderboard(out: str, **budget: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(script), str(tmp_path / out)], env=env | budget, capture_output=True, text=True
        )

    proc = leaderboard("out")
    assert proc.returncode == 1, proc.stderr
    log = (tmp_path / "out" / "gpu_leaderboard.log").read_text()
    assert "no EAGLE draft artifact 'eagle_head'" in log and "Traceback" not in log
    assert f"for model tiny_random under {tmp_path / 'carried'}:" in log  # where gpu_setup.sh puts them
    assert "'method=eagle_tree_small" in proc.stderr  # its reason, not the budget's:
    assert "exited with 1 (its error is in gpu_leaderboard.log)" in proc.stderr and "past the budget" not in proc.stderr
    with tarfile.open(tmp_path / "out" / "specbench_gpu_runs.tar.gz") as archive:
        runs = {Path(name).parts[1] for name in archive.getnames() if name.endswith("metrics.json")}
    assert sorted(runs) == sorted(p.name for p in (tmp_path / "results" / "runs").iterdir())
    assert len(runs) == 12 and {name.split("-")[1] for name in runs} == {"ar", "pld"}  # six categories each
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_leaderboard.log", "specbench_gpu_runs.tar.gz"]
    skipped = leaderboard("skipped", BUDGET_S="40", PACK_S="30", ROWS=f"method=pld {tiny};method=rest_pld {tiny}")
    assert skipped.returncode == 1
    assert re.search(r"'method=rest \(REST's datastore\)' skipped: 1?\d s left", skipped.stderr)
    assert re.search(r"'method=pld .*' skipped: 1?\d s left", skipped.stderr)
    assert "no run was written" in skipped.stderr


def test_gpu_leaderboards_default_rows_leave_out_the_trained_rows_whose_artifacts_were_not_carried(tmp_path):
    """Of the default rows, a trained row is run only where its artifact was carried, and the log names the artifact
    each row left out lacks (a budget of 10 s skips every row that is run, so no process starts)."""
    script = Path(__file__).parents[1] / "experiments" / "gpu_leaderboard.sh"
    carried = tmp_path / "carried"
    (carried / "eagle_head-smollm2_135m-2e89ec14").mkdir(parents=True)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "RESULTS": str(tmp_path / "results")}
    proc = subprocess.run(
        ["bash", str(script), str(tmp_path / "out")],
        env=env | {"ARTIFACTS": str(carried), "BUDGET_S": "40", "PACK_S": "30"},
        capture_output=True,
        text=True,
    )
    not_run = re.findall(r"'(method=[^']*)' not run: no (\S+) under (\S+) \(not carried\)", proc.stderr)
    assert [(row, needs) for row, needs, where in not_run] == [
        ("method=sar_draft method.draft_vocab=4096 method.k=2", "sar_head-smollm2_135m-*"),
        ("method=eesd method.draft_vocab=4096", "eesd_head-smollm2_135m-*"),
        ("method=self_sd_tree", "self_sd_skip_set-smollm2_135m-*"),
    ] and {where for *_, where in not_run} == {str(carried)}
    skipped = re.findall(r"'(method=[^']*)' skipped: \d+ s left", proc.stderr)
    assert skipped[-1] == "method=eagle_tree_small method.head=eagle_head-smollm2_135m-2e89ec14"
    assert skipped[0] == "method=pld" and len(skipped) == 6  # the training-free rows, then the carried one
    assert "not carried" in (tmp_path / "out" / "gpu_leaderboard.log").read_text()


@pytest.mark.parametrize("tied", [True, False])
def test_the_weight_reading_bound_counts_an_untied_input_embedding_as_unread(monkeypatch, tied):
    from specrepro.config import RandomArchConfig
    from specrepro.models.loading import random_llama

    monkeypatch.syspath_prepend(str(BENCH.parent))
    from bench_gpu import bytes_read_per_token

    model = random_llama(RandomArchConfig(vocab_size=64, num_layers=1))
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
    every = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    embedding = model.get_input_embeddings().weight
    assert bytes_read_per_token(model) == (every if tied else every - embedding.numel() * embedding.element_size())
