"""Entry points: `specrepro run ...` (decode + score + record), `specrepro train ...`, `specrepro table NAME`,
`specrepro reproduce PAPER` (train + run + table, from experiments/reproduce/), `specrepro summary`,
`specrepro compare RUN OTHER_RUN`.

`run` and `train` are Hydra apps over the configs in `conf/` (shipped as the package specrepro.conf); every
override, `-m` multirun and `--config-dir DIR` (more config files, e.g. DIR/method/<preset>.yaml) works.
User errors (bad data, unreachable model, bad values, an override that does not compose) print one line and exit
with status 2; Ctrl-C prints one line saying how to resume and exits with status 130.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import shlex
import sys
from importlib.resources import files
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig

from specrepro.errors import SpecReproError, as_user_error, one_line

CONF_MODULE = "specrepro.conf"
CONF_DIR = Path(files(CONF_MODULE))  # conf/ in a source checkout, site-packages/specrepro/conf when installed
USAGE = """usage: specrepro {run,train} [hydra overrides...] | specrepro {table,reproduce,summary,compare} ...

  specrepro run model=smollm2_135m method=pld dataset=gsm8k dataset.limit=20
  specrepro run -m method=ar,sps,pld dataset=gsm8k dataset.limit=20   (a sweep; prints one table)
  specrepro run --help                                               (Hydra's help: groups and options)
  specrepro table specbench_small [--results-dir results] [--source local|wandb]   (a paper table)
  specrepro reproduce cllm [--dry-run] [overrides...]   (train, run and tabulate one paper, or all)
  specrepro summary                                    (results/SUMMARY.md, copied from the tables)
  specrepro compare RUN OTHER_RUN                      (is one run faster than another on the same prompts?)"""
SUBCOMMANDS = {
    "table": "specrepro.tables:main",
    "reproduce": "specrepro.reproduce:main",
    "summary": "specrepro.summary:main",
    "compare": "specrepro.compare:main",
}
POINTER_FILE = "specrepro_run.txt"  # in each Hydra job dir: the run record it wrote
FAILURE_FILE = "specrepro_failed.txt"  # in each Hydra job dir whose job failed: the one-line reason

log = logging.getLogger("specrepro")


def fail(message: str) -> None:
    print(f"specrepro: error: {message}", file=sys.stderr)
    sys.exit(2)


def quiet_closed_stdout() -> None:
    """Stop quietly when stdout was closed early (a pipe into `head`)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own flush at exit fails too
    sys.exit(1)


def hydra_error_line(exc: CompactHydraException) -> str:
    """A Hydra config error on one line: an unknown option with the group's options, a bad value with its key."""
    if isinstance(exc, MissingConfigException) and exc.options:
        group = exc.missing_cfg_file.rsplit("/", 1)[0]
        untrained = " (a method with no recipe trains nothing: run it)" if group == "training" else ""
        return f"{exc.missing_cfg_file} is not a config; {group} is one of: {', '.join(exc.options)}{untrained}"
    cause = f": {one_line(exc.__cause__)}" if exc.__cause__ is not None else ""
    # not Hydra's advice to add a misspelled key with `+`: the run refuses a key no schema has
    return re.sub(r"\. To append to your config use \+\S+", "", one_line(exc)) + cause


def sweep_hint(exc: CompactHydraException, args: list[str]) -> str:
    """Hydra composes a sweep's config once with its overrides but the swept ones, so with the default method
    (`ar`): a key only the swept methods have is refused there (Hydra issues #283, #2888). `++` sets it anyway."""
    key = re.match(r"Could not override '(method\.[\w.]+)'", str(exc))
    if key is None or not {"-m", "--multirun"} & set(args):
        return ""
    value = next((arg.split("=", 1)[1] for arg in args if arg.split("=", 1)[0] == key[1]), "...")
    return f" (a sweep composes its config first with the default method, ar: write ++{key[1]}={value})"


def sweep_group() -> str | None:
    hydra_cfg = HydraConfig.get()
    return Path(hydra_cfg.sweep.dir).name if hydra_cfg.mode == RunMode.MULTIRUN else None


def run_job(cfg: DictConfig) -> None:
    """One `specrepro run` job. In a sweep a failed job leaves its reason in its job dir and the sweep goes on
    (the sweep table lists it, and the command exits non-zero at the end)."""
    from specrepro.metrics.summary import results_table
    from specrepro.runner import run

    output_dir = Path(HydraConfig.get().runtime.output_dir)
    sweeping = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        metrics = run(cfg, group=sweep_group())
    except Exception as exc:
        error = as_user_error(exc)
        if error is None:  # a bug: its traceback; in a sweep, in the log, and the other jobs and the table go on
            if not sweeping:
                raise
            log.exception("job %s failed", HydraConfig.get().job.num)
            (output_dir / FAILURE_FILE).write_text(f"{type(exc).__name__}: {exc}\n".splitlines()[0] + "\n")
            return
        if not sweeping:
            fail(str(error))
        print(f"specrepro: error: job {HydraConfig.get().job.num}: {error}", file=sys.stderr)
        (output_dir / FAILURE_FILE).write_text(f"{error}\n")
        return
    (output_dir / POINTER_FILE).write_text(str(Path(cfg.results_dir) / "runs" / metrics["run_name"]) + "\n")
    if not sweeping:
        print(results_table([metrics]))


def train_job(cfg: DictConfig) -> None:
    from accelerate import PartialState

    from specrepro.training import train

    try:
        path = train(cfg)
    except Exception as exc:
        if (error := as_user_error(exc)) is None:
            raise
        fail(str(error))
    if PartialState().is_main_process:  # once for a launch of several processes
        print(f"artifact: {path}")


def hydra_app(config_name: str, task, args: list[str]) -> None:
    from specrepro.config import register_configs

    try:
        register_configs()
        check_method_schemas(args)
    except SpecReproError as exc:  # a plugin module that does not import, or one not named
        fail(str(exc))
    sys.argv = [f"specrepro {config_name}", *args]
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"  # the user asked for Hydra's own traceback
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing a config error in many lines
    try:
        hydra.main(config_path=f"pkg://{CONF_MODULE}", config_name=config_name, version_base="1.3")(task)()
    except CompactHydraException as exc:  # an override that does not compose (an unknown option, a bad value)
        if full_error:
            raise
        fail(hydra_error_line(exc) + sweep_hint(exc, args))  # in a sweep: checked for every point before any job
    except ValueError as exc:  # Hydra's own flags that do not go together (`-m ... --cfg job`)
        if not str(exc).startswith("Only one of --run, --multirun"):
            raise
        fail(str(exc))
    except BrokenPipeError:  # stdout closed early (`specrepro run --help | head`)
        quiet_closed_stdout()
    finally:
        if not full_error:
            os.environ.pop("HYDRA_FULL_ERROR")
    from specrepro.callbacks import SweepTable

    if SweepTable.failed_jobs:
        sys.exit(1)


def check_method_schemas(args: list[str]) -> None:
    """Refuse a method the overrides select whose yaml extends a schema no loaded module registered, naming
    SPECREPRO_PLUGINS (Hydra says only that it cannot load `method_schema_<name>`)."""
    from specrepro import registry

    dirs = [CONF_DIR] + [Path(value) for flag, value in zip(args, args[1:]) if flag in ("--config-dir", "-cd")]
    dirs += [Path(arg.split("=", 1)[1]) for arg in args if arg.startswith("--config-dir=")]
    names = [
        name.strip()
        for arg in args
        if arg.split("=", 1)[0].lstrip("+~") == "method" and "=" in arg
        for name in arg.split("=", 1)[1].removeprefix("choice(").rstrip(")").split(",")
    ]
    for name, folder in ((name, folder) for name in names for folder in dirs):
        yaml = folder / "method" / f"{name}.yaml"
        wanted = re.findall(r"/method_schema_(\w+)@", yaml.read_text()) if yaml.is_file() else []
        missing = [schema for schema in wanted if schema not in registry.METHODS]
        if missing:
            raise SpecReproError(
                f"method '{name}' ({yaml}) extends method_schema_{missing[0]}, which no loaded module registers: "
                f"name the module that defines it in {registry.PLUGINS_VARIABLE} (e.g. "
                f"{registry.PLUGINS_VARIABLE}=my_methods, with my_methods.py on PYTHONPATH)"
            )


def main() -> None:
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return
    command, rest = args[0], args[1:]
    if command not in ("run", "train", *SUBCOMMANDS):
        fail(f"unknown command '{command}'\n{USAGE}")
    try:
        if command in ("run", "train"):
            hydra_app(command, run_job if command == "run" else train_job, rest)
        else:
            subcommand(command, rest)
    except KeyboardInterrupt:  # also while the methods' modules import (torch, transformers: seconds)
        again = " ".join(["specrepro", command, *map(shlex.quote, rest)])
        print(f"specrepro: interrupted; finished work is kept: run `{again}` again to resume", file=sys.stderr)
        sys.exit(130)


def subcommand(command: str, rest: list[str]) -> None:
    """`specrepro table|reproduce|summary|compare ...`: a user error in one line."""
    module, function = SUBCOMMANDS[command].split(":")
    try:
        getattr(importlib.import_module(module), function)(rest)  # only its own imports: a dry run is seconds
    except BrokenPipeError:  # stdout closed early (`specrepro reproduce all --dry-run | head`)
        quiet_closed_stdout()
    except Exception as exc:
        if (error := as_user_error(exc)) is None:
            raise
        fail(str(error))


if __name__ == "__main__":
    main()
