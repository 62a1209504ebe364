"""Run records (local, always) and Weights & Biases (offline by default).

A run directory `results/runs/<run name>/` holds:
- `config.yaml`: the resolved config;
- `generations.jsonl`: one line per finished sample, appended and fsync'ed as each finishes, so an
  interrupted run resumes where it stopped (a torn last line is dropped on resume);
- `provenance.json`: what started the run and when, and one entry per process that decoded samples of it
  (`sessions`: a resumed run's timings come from several processes; each row names its own in `session`);
- `metrics.json`: written atomically (temp file + rename) when the run is complete; its presence with
  `"complete": true` is what marks a run as finished.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from specrepro.errors import SpecReproError, one_line
from specrepro.metrics.speed import paired_ratio
from specrepro.provenance import machine_label, now, provenance

log = logging.getLogger(__name__)


@contextlib.contextmanager
def unwritable_in_one_line(what: str, elsewhere: str = ""):
    """A page writer's OSError (a read-only results dir, a file where a folder of the path should be) as one line:
    "cannot write `what`: why", and `elsewhere`, the option that writes it elsewhere, where there is one."""
    try:
        yield
    except OSError as exc:
        hint = f"; {elsewhere}" if elsewhere else ""
        raise SpecReproError(f"cannot write {what}: {exc.strerror or exc}{hint}") from None


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old or the new file, never a partial one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide the record from the rest of the team
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def config_hash(node) -> str:
    """A short stable hash of a plain (JSON-able) value: a config tree, a prompt, token ids."""
    blob = json.dumps(node, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:8]


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _writing_record(method):
    """A RunRecord method that writes: an OSError (a full disk, a read-only directory) becomes one line naming the
    run's directory."""

    @functools.wraps(method)
    def writing(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except OSError as exc:
            raise SpecReproError(f"cannot write the run record to {self.dir}: {exc.strerror or exc}") from None

    return writing


class RunRecord:
    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.generations_path = self.dir / "generations.jsonl"
        self.metrics_path = self.dir / "metrics.json"
        self.provenance_path = self.dir / "provenance.json"  # what started the run, and when
        # a table's committed copy of a run timed against `ar`: its timed turns (`timed_turns`) without generations
        self.turns_path = self.dir / "turns.jsonl"
        self.session = 0  # this process's index among the run's sessions (set by `start`)

    @property
    def complete(self) -> bool:
        """Finished: `metrics.json` says so. A corrupt one (edited, or a disk fault) is not: the run is redone."""
        if not self.metrics_path.is_file():
            return False
        try:
            return bool(self.metrics().get("complete", False))
        except (ValueError, AttributeError):
            log.warning("%s is corrupt: the run is not complete and will be redone", self.metrics_path)
            return False

    def metrics(self) -> dict:
        return json.loads(self.metrics_path.read_text())

    def started_at(self) -> str:
        """When this run first started (kept across resumes)."""
        return json.loads(self.provenance_path.read_text())["started_at"]

    def identity(self) -> str | None:
        """The `identity.identity_name` of what this run decodes, as it first started (None: not started, or
        recorded before identities were)."""
        if not self.provenance_path.is_file():
            return None
        try:
            return json.loads(self.provenance_path.read_text()).get("identity")
        except (ValueError, AttributeError):
            return None

    @_writing_record
    def start(self, cfg, resume: bool, device=None, identity: str | None = None) -> list[dict]:
        """Prepare the directory; return the rows of finished samples to resume from (none if not resuming).
        `device`: where the run decodes (a GPU's name is its sessions' machine); `identity`: what it decodes
        (`identity.identity_name`), kept from its first start."""
        self.dir.mkdir(parents=True, exist_ok=True)
        probe = self.dir / ".write-test"
        probe.write_text("")
        probe.unlink()
        rows = self.rows() if resume else []
        if not resume:
            self.generations_path.unlink(missing_ok=True)
        self.metrics_path.unlink(missing_ok=True)
        # rewrite without a torn last line, so appends start on a clean line
        atomic_write(self.generations_path, "".join(json.dumps(r) + "\n" for r in rows))
        atomic_write(self.dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        origin = provenance(cfg.hardware, device)
        session = {
            "started_at": now(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "machine": machine_label(origin["machine"]),
        }
        if not rows or not self.provenance_path.is_file():
            started = {"started_at": session["started_at"], "identity": identity, **origin, "sessions": []}
        else:
            started = json.loads(self.provenance_path.read_text())
            started.setdefault("sessions", [{"started_at": started["started_at"]}])  # a record from before sessions
        self.session = len(started["sessions"])  # this process's index: the rows it decodes carry it
        started["sessions"].append(session)
        atomic_write(self.provenance_path, json.dumps(started, indent=2) + "\n")
        return rows

    def sessions(self, rows: list[dict]) -> list[dict]:
        """The processes that decoded `rows` (from provenance.json), each with how many of them it decoded: more than
        one when the run was resumed, its timings then from several processes."""
        recorded = json.loads(self.provenance_path.read_text()).get("sessions", [])
        counts: dict[int, int] = {}
        for row in rows:  # a row from before sessions were kept: the first process's
            counts[row.get("session", 0)] = counts.get(row.get("session", 0), 0) + 1
        return [{**(recorded[i] if i < len(recorded) else {}), "samples": n} for i, n in sorted(counts.items())]

    def timed_turns(self) -> list[dict]:
        """Every decoded turn as `specrepro compare` needs it: its key (record id, a digest of the first prompt,
        sample, turn: a later turn's prompt holds the run's own earlier answer, which sampling runs need not share),
        its paired speedup over the `ar` timed beside it and a digest of its tokens. From the generations, else from
        `turns.jsonl`; SpecReproError for a run not timed against `ar` or a copy without either."""
        if self.generations_path.is_file() and self.complete and (damage := self.damage()):
            raise SpecReproError(
                f"{self.dir.name}: {damage}: `specrepro run` with its config decodes the lost records again"
            )
        if not self.generations_path.is_file():
            if not self.turns_path.is_file():
                raise SpecReproError(
                    f"{self.dir.name}: holds no per-turn timings (neither generations.jsonl nor "
                    f"{self.turns_path.name}: a committed copy made before they were kept)"
                )
            return [json.loads(line) for line in self.turns_path.read_text().splitlines()]
        turns = []
        for row in self.rows():
            for sample, gens in enumerate(row["samples"]):
                for turn, gen in enumerate(gens):
                    if not gen.get("ar_wall_time"):
                        raise SpecReproError(
                            f"{self.dir.name}: record {row['id']} was not timed against ar "
                            "(run it with timing.paired=true)"
                        )
                    turns.append(
                        {
                            "id": row["id"],
                            "prompt": config_hash(row["prompts"][0]),
                            "sample": sample,
                            "turn": turn,
                            "speedup": paired_ratio(gen),
                            "tokens": config_hash(gen["token_ids"]),
                        }
                    )
        return turns

    def damage(self) -> str | None:
        """How a complete run's generations.jsonl does not hold what its metrics.json counts (missing, cut mid-line,
        lines lost or edited), or None: a reused or tabulated run must be whole."""
        if not self.generations_path.is_file():
            return "its generations.jsonl is missing"
        text = self.generations_path.read_text(errors="replace")
        if text and not text.endswith("\n"):
            return "its generations.jsonl was cut mid-line"
        rows = self.rows()
        lines = len(text.splitlines())
        if len(rows) < lines:
            return f"line {len(rows) + 1} of its generations.jsonl is not a record"
        expected = self.metrics().get("n_samples")
        if expected is not None and len(rows) != expected:
            return f"its generations.jsonl holds {len(rows)} records, not the {expected} its metrics.json counts"
        return None

    def rows(self) -> list[dict]:
        """Finished samples; a torn or corrupt trailing line (from a kill mid-write) is ignored."""
        if not self.generations_path.is_file():
            return []
        rows = []
        for line in self.generations_path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
        return rows

    @_writing_record
    def append(self, row: dict) -> None:
        with open(self.generations_path, "a") as handle:
            handle.write(json.dumps(_json_safe(row)) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    @_writing_record
    def replace_rows(self, rows: list[dict]) -> None:
        """Write `rows` in place of the recorded ones (scored again: `runner.score_again`), atomically."""
        atomic_write(self.generations_path, "".join(json.dumps(_json_safe(row)) + "\n" for row in rows))

    @_writing_record
    def finish(self, metrics: dict) -> None:
        atomic_write(self.metrics_path, json.dumps(_json_safe({**metrics, "complete": True}), indent=2) + "\n")


@dataclass
class CompleteRun:
    """A finished run in the record store: its directory, its metrics.json, and when that was written."""

    dir: Path
    metrics: dict
    mtime: float


def complete_runs(results_dir: str | Path) -> list[CompleteRun]:
    """The complete runs under `<results dir>/runs/`, by name; a metrics.json that cannot be read is skipped
    with a one-line warning."""
    runs = []
    for path in sorted(Path(results_dir).glob("runs/*/metrics.json")):
        try:
            metrics, mtime = json.loads(path.read_text()), path.stat().st_mtime
        except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            log.warning("skipping a run record: %s: %s", path, one_line(exc))
            continue
        if not isinstance(metrics, dict):
            log.warning("skipping a run record: %s: expected a JSON object, got %s", path, type(metrics).__name__)
        elif metrics.get("complete"):
            runs.append(CompleteRun(path.parent, metrics, mtime))
    return runs


def wandb_mode(logger_cfg) -> str:
    """online only when asked for or when the user has logged in; offline otherwise."""
    if logger_cfg.mode:
        return logger_cfg.mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = Path.home() / ".netrc"
    logged_in = os.environ.get("WANDB_API_KEY") or (netrc.is_file() and "api.wandb.ai" in netrc.read_text())
    return "online" if logged_in else "offline"


SAMPLE_COLUMNS = ["id", "new_tokens", "tokens_per_s", "accepted", "score"]


_wandb_unreachable = False  # once the server did not answer, later runs of this process go offline at once


def wandb_init(
    cfg,
    name: str,
    run_dir: Path,
    group: str | None = None,
    job_type: str = "decode",
    origin: dict | None = None,
    run_id: str | None = None,
):
    """Start a W&B run for this job (None when logger=none); never raises. An online run whose server does not
    answer within `logger.init_timeout` is logged offline instead (said once per process). `origin` is the
    record's provenance (default: this process's); `run_id`: the W&B run to resume if it exists (a record logged
    again updates its W&B run instead of adding one)."""
    global _wandb_unreachable
    if cfg.logger.name != "wandb":
        return None
    try:
        import wandb

        config = OmegaConf.to_container(cfg, resolve=True) | {"provenance": origin or provenance(cfg.hardware)}
        kwargs = dict(
            project=cfg.logger.project,
            entity=cfg.logger.entity,
            group=cfg.logger.group or group,
            tags=list(cfg.logger.tags),
            name=name,
            job_type=job_type,
            config=config,
            dir=str(run_dir),
            reinit="finish_previous",
        )
        if run_id:
            kwargs |= dict(id=run_id, resume="allow")
        mode = wandb_mode(cfg.logger)
        if mode == "online" and not _wandb_unreachable:
            try:
                # quiet: wandb would look the user's name up to print it, under its own 10 s HTTP timeout
                settings = wandb.Settings(init_timeout=cfg.logger.init_timeout, quiet=True)
                return wandb.init(mode=mode, settings=settings, **kwargs)
            except Exception as exc:
                _wandb_unreachable = True
                log.warning(
                    "W&B did not answer (%s): logging offline under %s; `wandb sync` uploads it later",
                    type(exc).__name__,
                    run_dir,
                )
        return wandb.init(mode="offline" if mode == "online" else mode, **kwargs)
    except Exception as exc:  # W&B must never cost the local record
        log.warning("W&B could not start (%s: %s); results are kept locally in %s", type(exc).__name__, exc, run_dir)
        return None


def wandb_run_id(record: RunRecord) -> str:
    """The W&B run id of a run record: its name and when it first started (what a resume keeps)."""
    return hashlib.sha1(f"{record.dir.name}@{record.started_at()}".encode()).hexdigest()[:16]


def log_to_wandb(cfg, record: RunRecord, run_name: str, group: str | None, metrics: dict, rows: list[dict]) -> None:
    """Log a finished run to W&B: summary metrics and a per-sample table. Failures never touch the record. A record
    summarised again (re-scored, or given its `ar` reference) updates the W&B run it was first logged to; a record
    decoded anew (`resume=false`) is a new W&B run."""
    if cfg.logger.name != "wandb":
        return
    run = wandb_init(cfg, run_name, record.dir, group, origin=metrics.get("provenance"), run_id=wandb_run_id(record))
    if run is None:
        return
    try:
        import wandb

        summary = _json_safe(metrics)
        run.summary.update({k: v for k, v in summary.items() if v is not None})
        for key in (k for k, v in summary.items() if v is None):  # what a run resumed had of it goes
            del run.summary[key]
        table = wandb.Table(columns=SAMPLE_COLUMNS)
        for row in rows:
            for gen in (g for sample in row["samples"] for g in sample):
                rate = len(gen["token_ids"]) / gen["wall_time"] if gen["wall_time"] else None
                table.add_data(
                    row["id"], len(gen["token_ids"]), rate, json.dumps(gen["accepted"]), json.dumps(row["scores"])
                )
        run.log({"samples": table})
        run.finish()
    except Exception as exc:  # W&B must never cost the local record
        log.warning(
            "W&B logging failed (%s: %s); the local record in %s is complete", type(exc).__name__, exc, record.dir
        )
