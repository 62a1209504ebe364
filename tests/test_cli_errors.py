"""What the CLI prints when a user's command cannot go on: one line, never a traceback wall."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from specrepro.errors import SpecReproError, as_user_error
from tests.test_config import compose_run
from tests.test_runner import FAST, specrepro


@contextmanager
def read_only(path: Path):
    """`path` and everything under it unwritable, for root too (chmod binds no root: chattr +i does)."""
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "-R", "+i", str(path)], capture_output=True).returncode:
            pytest.skip("running as root where chattr +i is not supported: no directory can be made read-only")
        undo = ["chattr", "-R", "-i", str(path)]
    else:
        subprocess.run(["chmod", "-R", "a-w", str(path)], check=True)
        undo = ["chmod", "-R", "u+w", str(path)]
    try:
        yield
    finally:
        subprocess.run(undo, check=True)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def test_an_unknown_sweep_value_is_one_line_before_any_job_runs(tmp_path):
    proc = specrepro(
        "run", "-m", *FAST, "dataset.limit=1", "logger=none", "method=pld,no_such", cwd=tmp_path, check=False
    )
    assert proc.returncode == 2
    (line,) = error_lines(proc.stderr)
    assert line.startswith("specrepro: error: method/no_such is not a config; method is one of: ") and "pld" in line
    assert not (tmp_path / "results" / "runs").exists()  # pld did not run either


@pytest.mark.parametrize(
    "command, expected, absent",
    [  # Hydra's advice to add a misspelled key with `+` is dropped: the run refuses a key no schema has
        (["run", "decoding.max_new_token=4"], "Key 'max_new_token' not in 'DecodingConfig'", "To append"),
        (["train", "method=pld"], "(a method with no recipe trains nothing: run it)", "Traceback"),
        (["reproduce"], "the following arguments are required: paper", "paper, overrides"),
    ],
)
def test_a_command_that_cannot_start_says_what_to_do_in_one_line(tmp_path, command, expected, absent):
    proc = specrepro(*command, cwd=tmp_path, check=False)
    assert proc.returncode == 2
    (line,) = error_lines(proc.stderr)[-1:]
    assert expected in line and absent not in proc.stderr


def test_a_sweep_over_methods_with_a_key_only_they_have_says_how_to_set_it(tmp_path):
    """Hydra composes a sweep's config first with the default method (`ar`), which has no `window`."""
    sweep = ["run", "-m", *FAST, "dataset.limit=1", "logger=none", "method=lookahead,lookahead_small"]
    proc = specrepro(*sweep, "method.window=3", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    (line,) = error_lines(proc.stderr)
    assert line.endswith("(a sweep composes its config first with the default method, ar: write ++method.window=3)")
    printing = specrepro(*sweep, "++method.window=3", "--cfg", "job", cwd=tmp_path, check=False)  # Hydra: one of them
    assert printing.returncode == 2 and error_lines(printing.stderr)[0].startswith("specrepro: error: Only one of")
    specrepro(*sweep, "++method.window=3", cwd=tmp_path)
    configs = [OmegaConf.load(p) for p in (tmp_path / "results" / "runs").glob("*lookahead*/config.yaml")]
    assert len(configs) == 2 and all(c.method.window == 3 for c in configs)  # both presets ran, with window 3


def test_a_value_of_the_wrong_type_is_one_line(tmp_path):
    proc = specrepro("run", *FAST, "decoding.max_new_tokens=abc", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    (line,) = error_lines(proc.stderr)
    assert "decoding.max_new_tokens=abc" in line and "could not be converted to Integer" in line


def test_help_into_a_closed_pipe_stops_quietly(tmp_path):
    read_end, write_end = os.pipe()
    os.close(read_end)  # as `| head` does once it has its lines
    proc = subprocess.run(
        [sys.executable, "-m", "specrepro.cli", "run", "--help"],
        cwd=tmp_path,
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    os.close(write_end)
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr[-2000:]


def test_ctrl_c_during_a_run_says_how_to_resume_in_one_line(tmp_path):
    args = ["run", *FAST, "decoding.max_new_tokens=32", "dataset.limit=200", "logger=none"]
    env = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specrepro.cli", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # as in a terminal
    generations = tmp_path / "results" / "runs"
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if any(path.stat().st_size for path in generations.glob("*/generations.jsonl")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-2000:]
    last = error_lines(stderr)[-1]
    assert last == (
        "specrepro: interrupted; finished work is kept: run `specrepro run " + " ".join(args[1:]) + "` again to resume"
    )


def test_ctrl_c_while_the_methods_import_is_one_line_too(tmp_path):
    """The methods' modules (torch, transformers) take seconds to import before Hydra starts: Ctrl-C there too."""
    (tmp_path / "slow_methods.py").write_text(
        "import pathlib, time\npathlib.Path('importing').touch()\ntime.sleep(60)\n"
    )
    args = ["run", *FAST, "logger=none"]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specrepro.cli", *args],
        cwd=tmp_path,
        env=env | {"SPECREPRO_PLUGINS": "slow_methods"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # as in a terminal
    deadline = time.monotonic() + 120
    while not (tmp_path / "importing").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "Traceback" not in stderr, stderr[-2000:]
    assert error_lines(stderr)[-1].startswith("specrepro: interrupted; finished work is kept")


def test_ctrl_c_during_a_pipeline_stage_is_one_line_too(tmp_path):
    """`specrepro reproduce` waits for a stage's process: Ctrl-C reaches both, and neither prints a traceback."""
    (tmp_path / "slow_methods.py").write_text(
        "import pathlib, time\npathlib.Path('importing').touch()\ntime.sleep(60)\n"
    )
    (tmp_path / "slow.yaml").write_text(f"paper: slow\nstages:\n  - {{run: [{', '.join(FAST)}, logger=none]}}\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specrepro.cli", "reproduce", "slow.yaml"],
        cwd=tmp_path,
        env=env | {"SPECREPRO_PLUGINS": "slow_methods"},  # the stage's process sleeps as it imports the methods
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "importing").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole foreground group
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "Traceback" not in stderr, stderr[-2000:]
    assert error_lines(stderr)[-1] == (
        "specrepro: interrupted; finished work is kept: run `specrepro reproduce slow.yaml` again to resume"
    )


@pytest.mark.parametrize("full_file", ["generations.jsonl", "metrics.json"])  # as the run starts, as it finishes
def test_a_full_disk_under_results_dir_is_one_line_naming_the_run_directory(tmp_path, monkeypatch, full_file):
    from specrepro import runner, tracking

    write = tracking.atomic_write

    def disk_full_at(path, text):
        if path.name == full_file:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(path, text)

    monkeypatch.setattr(tracking, "atomic_write", disk_full_at)
    cfg = compose_run(*FAST, "dataset.limit=1", "logger=none", f"results_dir={tmp_path}")
    with pytest.raises(SpecReproError) as info:
        runner.run(cfg)
    run_dir = re.fullmatch(r"cannot write the run record to (\S+): No space left on device", str(info.value))[1]
    assert Path(run_dir).parent == tmp_path / "runs"


def test_a_read_only_working_directory_with_results_elsewhere_works(tmp_path):
    workdir, results = tmp_path / "workdir", tmp_path / "elsewhere"
    workdir.mkdir()
    with read_only(workdir):
        specrepro("run", *FAST, "dataset.limit=1", "logger=none", f"results_dir={results}", cwd=workdir)
    assert list(results.glob("runs/*/metrics.json")) and list(results.glob("hydra/*/*/.hydra/config.yaml"))
    assert list(workdir.iterdir()) == []


def test_a_finished_run_in_read_only_results_is_reused_and_tabulated(tmp_path):
    args = ["run", *FAST, "dataset.limit=1", "logger=none"]
    specrepro(*args, cwd=tmp_path)
    spec = tmp_path / "one.yaml"
    spec.write_text(
        "paper: one\ntitle: One\nsource: a test\nrow_header: [Method]\nrows:\n"
        "  - {label: [ar], select: {method: ar}}\ncolumns:\n  - {label: tok/s, key: tokens_per_s}\n"
    )
    with read_only(tmp_path / "results"):
        again = specrepro(*args, cwd=tmp_path)
        assert "tiny_random-ar-" in again.stdout and "Traceback" not in again.stderr
        from specrepro.tables import main as table_main

        unwritable = r"cannot write the table to \S+/results/one: .*; --out-dir DIR writes it elsewhere"
        with pytest.raises(SpecReproError, match=unwritable):
            table_main([str(spec), "--results-dir", str(tmp_path / "results")])
        table_main([str(spec), "--results-dir", str(tmp_path / "results"), "--out-dir", str(tmp_path / "out")])
    assert (tmp_path / "out" / "one.md").is_file()


SMALL_DRAFT = ["method=sps", "training.draft.hidden_size=32", "training.draft.intermediate_size=64"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([*SMALL_DRAFT, "training.draft.hidden_size=128"], "hidden_size=128 is wider than the target's (64)"),
        (
            [*SMALL_DRAFT, "training.draft.num_kv_heads=3"],
            "must split into num_heads=4 heads, and those into num_kv_heads=3 groups",
        ),
        (["method=eesd", "method.num_layers=2"], "eesd num_layers must be in [1, 1] for this 2-layer target, got 2"),
    ],
    ids=["sps-wider", "sps-heads", "eesd-deeper"],
)
def test_an_impossible_shape_is_refused_before_any_data_is_generated(tmp_path, monkeypatch, overrides, message):
    from specrepro.training import distill_data, sps_draft, train

    def no_data(*args, **kwargs):
        raise AssertionError("data was generated for a component that cannot be built")

    monkeypatch.setattr(sps_draft, "continuation_dataset", no_data)
    monkeypatch.setattr(distill_data, "continuation_dataset", no_data)
    cfg = compose_run(
        "model=tiny_random", "logger=none", "hardware.threads=1", *overrides, f"results_dir={tmp_path}", config="train"
    )
    with pytest.raises(SpecReproError, match=re.escape(message)):
        train(cfg)


def test_an_unreachable_wandb_server_is_given_init_timeout_and_no_login_lookup(monkeypatch, tmp_path):
    """wandb.init's login step asked the server for the user's name (to print it) under its own 10 s HTTP timeout,
    outside init_timeout: logger.init_timeout=3 went offline after ~14 s. quiet=True skips that lookup."""
    import types

    from specrepro import tracking

    calls = []

    def init(mode, settings=None, **kwargs):
        calls.append((mode, settings))
        if mode == "online":
            raise RuntimeError("no answer")
        return "an offline run"

    fake = types.SimpleNamespace(init=init, Settings=lambda **settings: settings)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(tracking, "_wandb_unreachable", False)
    cfg = compose_run(*FAST, "logger=wandb", "logger.mode=online", "logger.init_timeout=3")
    assert tracking.wandb_init(cfg, "a-run", tmp_path) == "an offline run"
    assert calls == [("online", {"init_timeout": 3.0, "quiet": True}), ("offline", None)]


def test_a_dependency_missing_from_a_lean_install_is_one_line_and_the_sweep_goes_on(tmp_path):
    """A lent GPU machine's python lacked rouge_score: its summarization job stopped the leaderboard's sweep with a
    traceback wall. A third-party module that is not installed is the user's to install, not a bug."""
    code = "import sys; sys.modules['rouge_score'] = None; from specrepro.cli import main; main()"  # as if absent
    args = ["run", "-m", *FAST, "dataset.limit=1", "logger=none", "method=ar", "dataset=xsum,gsm8k"]
    env = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    expected = f"specrepro: error: job 0: the Python module 'rouge_score' is not installed in {sys.executable}"
    assert expected in proc.stderr
    finished = [json.loads(p.read_text())["dataset"] for p in (tmp_path / "results" / "runs").glob("*/metrics.json")]
    assert finished == ["gsm8k"]  # the next job ran


def test_only_a_third_party_module_that_is_not_installed_is_a_user_error():
    assert as_user_error(ModuleNotFoundError("No module named 'pydivsufsort'", name="pydivsufsort")) is not None
    assert as_user_error(ModuleNotFoundError("No module named 'specrepro.x'", name="specrepro.x")) is None  # a bug
    assert as_user_error(KeyError("x")) is None
    error = SpecReproError("bad input")
    assert as_user_error(error) is error


@pytest.mark.parametrize(
    "module, args",
    [("tables", ["spec_bench"]), ("summary", []), ("compare", ["a", "b"]), ("reproduce", ["cllm", "--dry-run"])],
)
def test_an_empty_results_dir_option_is_refused_not_read_as_the_working_directory(
    module, args, tmp_path, monkeypatch, capsys
):
    """`--results-dir ''` read and wrote the working directory: `summary` wrote a SUMMARY.md there."""
    import importlib

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(f"specrepro.{module}").main([*args, "--results-dir", ""])
    assert stop.value.code == 2 and not list(tmp_path.iterdir())
    assert "argument --results-dir: is empty: name a directory" in capsys.readouterr().err
