"""What makes two runs the same run: the full resolved config, the weights it loads, the data and the code.

A run's name ends in a hash of everything that changes what it computes: the resolved config (without
where results go and how they are logged), the trained artifacts its references resolve to now and the models
it loads from a local directory (each by name and content digest) or from the hub cache (by commit), the
content of the records it decodes, the code it decodes with (`code_fingerprint`) and the record version. A
record is resumed, skipped or used as a reference only under the same hash, so an edited dataset file, a newer
artifact, one retrained under the same name with other weights, a checkpoint saved again at the same path, a
newer download of a hub model, or a fix to the method's code is a new run.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import json
import sys
import textwrap
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import HFValidationError
from omegaconf import DictConfig, OmegaConf

from specrepro import registry
from specrepro.errors import SpecReproError
from specrepro.models.loading import resolve_artifact
from specrepro.provenance import RECORD_VERSION
from specrepro.tracking import config_hash
from specrepro.training.artifacts import METADATA, target_identity

# where results go and how they are logged: not part of what a run computes
NOT_IN_IDENTITY = ("logger", "results_dir", "artifacts_dir", "resume", "run_name", "reference")


def records_fingerprint(records) -> str:
    """A hash of the records' content (ids, turns, references, task fields): what a run decodes."""
    digest = hashlib.sha256()
    for record in records:
        digest.update(json.dumps(dataclasses.asdict(record), sort_keys=True, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:16]


def content_digest(directory: Path) -> str:
    """A hash of the files directly in a model or artifact directory (weights, configs, tokenizer: what
    `from_pretrained` and the decoders read), but an artifact's metadata (`artifact.json`: history, minutes).
    Read once per process while no file's size or time changes (a sweep names the same weights in every job)."""
    files = sorted(p for p in Path(directory).iterdir() if p.is_file() and p.name != METADATA)
    return _digest(tuple((str(f), f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))


@lru_cache(maxsize=64)
def _digest(files: tuple[tuple[str, str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for path, name, size, _ in files:
        digest.update(f"{name}\0{size}\0".encode())
        with open(path, "rb") as handle:
            digest.update(hashlib.file_digest(handle, "sha256").digest())
    return digest.hexdigest()[:16]


def hf_models(cfg: DictConfig) -> dict[str, dict]:
    """Every `source: hf` model config a run config holds, by where it sits (`model`, `method.draft`)."""
    found = {}

    def visit(node, key: str) -> None:
        if isinstance(node, dict):
            if node.get("source") == "hf" and node.get("id"):
                found[key] = node
            for name, value in node.items():
                visit(value, f"{key}.{name}" if key else str(name))

    visit(OmegaConf.to_container(cfg, resolve=True), "")
    return found


def local_checkpoints(cfg: DictConfig) -> dict[str, Path]:
    """The models a config loads from a local directory (a path for `id`): their files, not their path, say which
    weights they hold."""
    paths = {role: Path(str(model["id"])).expanduser() for role, model in hf_models(cfg).items()}
    return {role: path for role, path in paths.items() if path.is_dir()}


def hub_snapshots(cfg: DictConfig) -> dict[str, dict[str, str]]:
    """The hub models a config loads that are in the local Hugging Face cache (where loading looks first), each
    with the commit its revision points to there: a newer download of `main` is a new run. A model not cached yet
    is named by its revision alone until it is."""
    found = {}
    for role, model in hf_models(cfg).items():
        ident = str(model["id"])
        if Path(ident).expanduser().is_dir():
            continue
        try:
            cached = try_to_load_from_cache(ident, "config.json", revision=model.get("revision"))
        except HFValidationError:  # not a hub id: loading it fails in one line of its own
            continue
        if isinstance(cached, str):  # <cache>/models--<org>--<name>/snapshots/<commit>/config.json
            found[role] = {"name": ident, "content_digest": Path(cached).parent.name[:16]}
    return found


def model_artifact(cfg: DictConfig) -> dict[str, Path]:
    """The checkpoint a `model.source=artifact` config resolves to now (its id may be a prefix: the newest)."""
    return {"model": resolve_artifact(cfg.model.id, cfg.artifacts_dir)} if cfg.model.source == "artifact" else {}


def resolved_artifacts(cfg: DictConfig) -> dict[str, Path]:
    """Every trained artifact a run uses (role -> directory), as resolved now: a newer one under the same prefix
    is a new run."""
    registry.load()
    method = registry.METHODS.get(cfg.method.name)
    found = method.decoder.resolve_artifacts(cfg.method, run_target(cfg), cfg.artifacts_dir) if method else {}
    return model_artifact(cfg) | found


def run_target(cfg: DictConfig) -> dict:
    """The identity of a config's target model, as the artifacts trained for it record it: its model config and,
    when that does not say it all, its weights (`weights_key`)."""
    return target_identity(cfg.model) | weights_key(cfg)


def artifact_identities(directories: dict[str, Path]) -> dict[str, dict[str, str]]:
    """Each artifact's or local checkpoint's name and content digest (role -> {name, content_digest}): part of a
    run's identity, and in its record so a table can tell runs made with other weights under one name apart."""
    return {role: {"name": path.name, "content_digest": content_digest(path)} for role, path in directories.items()}


def loaded_weights(cfg: DictConfig, artifacts: dict[str, Path] | None = None) -> dict[str, dict[str, str]]:
    """The identities of every trained artifact (`artifacts`: `resolved_artifacts(cfg)` when the caller has them),
    local checkpoint and cached hub model a run loads."""
    artifacts = resolved_artifacts(cfg) if artifacts is None else artifacts
    return artifact_identities(artifacts | local_checkpoints(cfg)) | hub_snapshots(cfg)


def model_weights(model, artifacts_dir) -> dict[str, dict[str, str]]:
    """The identity of the weights one model config loads: a trained artifact or a local directory by content, a
    cached hub model by commit; {} for the embedded and random models (their config says it all)."""
    node = OmegaConf.create({"model": model, "artifacts_dir": str(artifacts_dir)})
    return loaded_weights(node, model_artifact(node))


def weights_key(cfg: DictConfig) -> dict:
    """`{"weights": ...}` of `cfg.model`, for the names of what is computed from it (components trained on it, its
    cached continuations and hidden states), so a new checkpoint behind the same config makes them anew; {} when
    its config says it all, or its artifact is not trained yet (nothing is computed from it until it is)."""
    try:
        weights = model_weights(cfg.model, cfg.artifacts_dir)
    except SpecReproError:
        return {}
    return {"weights": weights} if weights else {}


def judge_weights(cfg: DictConfig) -> dict[str, dict[str, str]]:
    """The weights a local judge (`judge.model`, a model config) loads, as for a run's own models: part of the key of
    its cached judgments, so a judge checkpoint saved again at its path judges again."""
    if cfg.judge.name != "local" or not isinstance(cfg.judge.model, DictConfig):
        return {}
    return model_weights(cfg.judge.model, cfg.artifacts_dir)


PACKAGE = Path(__file__).resolve().parent  # the `specrepro` package's directory


def code_fingerprint(method: str) -> str:
    """A hash of the code a run of `method` decodes and scores with: the runner and the method's module, every
    module of this package either imports (at any depth; other methods' modules are not among them), and the
    torch and transformers versions. Each module counts as its syntax tree without docstrings, so an edited
    comment, docstring or line wrap is the same code, and a fixed bug in one method re-decodes that method's runs
    (a changed runner or verification, every method's)."""
    registry.load()
    decoder = registry.method(method).decoder
    return _fingerprint_of_modules(decoder.__module__, decoder_source(method, decoder))


def decoder_source(method: str, decoder: type) -> str:
    """The text of the decoder's module, or, for a class defined where no module file is (a notebook cell), of the
    class itself."""
    file = getattr(sys.modules.get(decoder.__module__), "__file__", None)
    if file and Path(file).is_file():
        return Path(file).read_text()
    try:
        return textwrap.dedent(inspect.getsource(decoder))
    except (OSError, TypeError):
        raise SpecReproError(f"method '{method}': the source of {decoder.__qualname__} cannot be read, so its runs "
                             "cannot be named by their code; define it in a module (SPECREPRO_PLUGINS)") from None


@lru_cache(maxsize=None)
def _fingerprint_of_modules(module: str, source: str) -> str:
    digest = hashlib.sha256()
    roots = {"specrepro.runner": (PACKAGE / "runner.py").read_text(), module: source}
    for name, text in sorted(imported_modules(roots).items()):
        digest.update(f"{name}\0{syntax(text)}\0".encode())
    digest.update(f"torch {torch.__version__}, transformers {metadata.version('transformers')}".encode())
    return digest.hexdigest()[:16]


def imported_modules(roots: dict[str, str]) -> dict[str, str]:
    """`roots` (module name -> source text) and every module of this package they import, directly or through
    others, with the packages that hold them (their `__init__` runs too); imports inside functions count."""
    found: dict[str, str] = {}
    todo = [(name, text, False) for name, text in roots.items()]
    while todo:
        name, text, is_package = todo.pop()
        if name in found or text is None:
            continue
        found[name] = text
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        for other in parents + _imports(text, name if is_package else name.rpartition(".")[0]):
            file = None if other in found else _package_file(other)
            if file is not None:
                todo.append((other, file.read_text(), file.name == "__init__.py"))
    return found


def _package_file(module: str) -> Path | None:
    """The file of a module of this package (`specrepro.a.b` -> a/b.py or a/b/__init__.py); None for any other
    module, or for a name that is a function or class imported from a module."""
    if module.split(".")[0] != PACKAGE.name:
        return None
    base = PACKAGE.parent.joinpath(*module.split("."))
    return next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)


def _imports(text: str, package: str) -> list[str]:
    """The modules a module's source imports (`package`: the one relative imports start from), and for
    `from m import x` also `m.x` (x may be a module)."""
    names = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from . import x`, `from ..m import x`
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def syntax(text: str) -> str:
    """A module's code as its syntax tree, without docstrings: what comments, docstrings and layout do not change."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
                and isinstance(node.body[0].value.value, str):
            node.body = node.body[1:] or [ast.Pass()]
    return ast.dump(tree)


def _setting(cfg: DictConfig, data_fingerprint: str, artifacts: dict[str, dict] | None) -> dict:
    """What a run computes but the code: its config (less where results go), weights, data and record version."""
    content = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in NOT_IN_IDENTITY}
    artifacts = loaded_weights(cfg) if artifacts is None else artifacts
    return content | {"artifacts": artifacts, "data": data_fingerprint, "record_version": RECORD_VERSION}


def run_name(cfg: DictConfig, data_fingerprint: str, artifacts: dict[str, dict] | None = None) -> str:
    """`<model>-<method>-<dataset>-<decoding>-<hash of config, weights, data, code and record version>`;
    `artifacts`: the `loaded_weights(cfg)`, when the caller has them already."""
    if cfg.run_name:
        return cfg.run_name
    content = _setting(cfg, data_fingerprint, artifacts) | {"code": code_fingerprint(cfg.method.name)}
    return f"{cfg.model.name}-{cfg.method.name}-{cfg.dataset.name}-{cfg.decoding.name}-{config_hash(content)}"


def setting_key(cfg: DictConfig, data_fingerprint: str, artifacts: dict[str, dict] | None = None) -> str:
    """A hash of what a run computes but the code: complete runs with this key (`metrics.json`) and another name
    were decoded by other code, and are kept but never reused."""
    return config_hash(_setting(cfg, data_fingerprint, artifacts))


def reference_key(cfg: DictConfig, data_fingerprint: str) -> str:
    """Runs with equal keys decode the same prompts on the same weights, hardware and decoding, and their `ar`
    reference with the same code."""
    content = OmegaConf.to_container(cfg, resolve=True)
    key = {k: content[k] for k in ("model", "dataset", "decoding", "hardware")}
    key.update(artifacts=model_weights(cfg.model, cfg.artifacts_dir), data=data_fingerprint,
               code=code_fingerprint("ar"), record_version=RECORD_VERSION)
    return config_hash(key)
