"""What makes two runs the same run: the full resolved config, the weights it loads, the data and the code.

A run's name ends in a hash of everything that changes what it computes: the resolved config (without
where results go and how they are logged), the trained artifacts its references resolve to now and the models
it loads from a local directory (each by name and content digest) or from the hub cache (by commit), the
content of the records it decodes, the code that determines its tokens and timings (`code_fingerprint`), the
machine and threads that time it (`timing_machine`, `timing_threads`) and the record version. A record is resumed,
skipped or used as a reference only under the same hash, so an edited dataset file, a newer artifact, one retrained
under the same name with other weights, a checkpoint saved again at the same path, a newer download of a hub model,
a fix to the method's code, another machine (another GPU, or another CPU model, vector width or core count) or
another thread count (`hardware.threads`, or with null OMP_NUM_THREADS) is a new run: never a run whose samples, or
whose `ar` reference, another machine or thread count timed.

The code is a declared set, not whatever the runner imports. What determines a run's tokens: the method's
classes (its module, a method it extends), the Decoder contract, the draft-verify loop, verification, sampling,
the forward steps, draft-length controllers, draft vocabularies, how models are loaded (weights, dtype,
attention implementation, linear kernels) and how a prompt is rendered. What determines its timings besides:
`ar` (timed beside every method), the suspension check and the runner's functions that warm up, compile, decode
and time a turn (`DECODING_CODE`). What does not: input checks and their messages, scoring, the judge's
reading of its judgments and summaries (computed from the recorded generations: a run scored or summarised by
other code, `SCORING_CODE`, is scored and summarised again from its records), tables, W&B logging, training
loops (their artifacts count by content), and other methods. A decoder that relies on another module says so in
`Decoder.code_modules`."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
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
from specrepro.data.files import HF_PREFIX, resolve_path
from specrepro.errors import SpecReproError
from specrepro.models.loading import resolve_artifact
from specrepro.provenance import RECORD_VERSION, device_description, machine_label
from specrepro.tracking import config_hash
from specrepro.training.artifacts import METADATA, read_metadata, target_identity

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


def file_digest(file: Path) -> str:
    """A hash of one file's content (read again only once its size or time changes)."""
    return _digest(((str(file), file.name, file.stat().st_size, file.stat().st_mtime_ns),))


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
            tokenizer = node.get("tokenizer")
            if isinstance(tokenizer, str) and tokenizer not in ("embedded", node.get("id")):  # its own files
                found[f"{key}.tokenizer"] = {"source": "hf", "id": tokenizer}
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
            file = "tokenizer_config.json" if role.endswith(".tokenizer") else "config.json"
            cached = try_to_load_from_cache(ident, file, revision=model.get("revision"))
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


def read_files(cfg: DictConfig) -> dict[str, str]:
    """The content of each file beside the dataset that the run's method reads (`Decoder.read_files`: option ->
    digest; a hub set by its name alone)."""
    registry.load()
    method = registry.METHODS.get(cfg.method.name)
    files = method.decoder.read_files(cfg.method) if method else {}
    return {
        option: path if path.startswith(HF_PREFIX) else file_digest(resolve_path(path))
        for option, path in files.items()
    }


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
    found = artifact_identities(artifacts | local_checkpoints(cfg)) | hub_snapshots(cfg)
    model = artifacts.get("model")
    if model is not None and (model / "adapter_config.json").is_file():  # merged into its base as it is now
        base = read_metadata(model)["config"]["model"]  # (loading.merged_adapter)
        found |= {f"model.base.{role}": w for role, w in model_weights(base, cfg.artifacts_dir).items()}
    return found


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

# The code that determines a run's tokens and timings, whatever its method (`code_fingerprint`): the Decoder
# contract and the shared draft-verify machinery, verification, sampling, the forward steps (eager and compiled),
# draft-length controllers and draft vocabularies (with the corpus reader they rank), `ar` (the reference every
# method is checked against and the baseline timed beside it), how a method is built from its config, how a model
# is loaded (weights, dtype, device, attention implementation, linear kernels), how a prompt is rendered, and the
# timing protocol: the runner's functions that decode and time a record, and the suspension check that retimes a
# turn. A `module:function` entry counts that function alone.
DECODING_CODE = (
    "specrepro.decoding",
    "specrepro.decoding.base",
    "specrepro.decoding.device",
    "specrepro.decoding.draft_verify",
    "specrepro.decoding.verify",
    "specrepro.decoding.sampling",
    "specrepro.decoding.steps",
    "specrepro.decoding.controllers",
    "specrepro.decoding.draft_vocab",
    "specrepro.decoding.ar",
    "specrepro.data.files",
    "specrepro.data.prompts",
    "specrepro.models",
    "specrepro.models.attention",
    "specrepro.models.kernels",
    "specrepro.models.loading",
    "specrepro.suspension",
    "specrepro.runner:sample_seed",
    "specrepro.runner:method_timed_first",
    "specrepro.runner:decode_turn",
    "specrepro.runner:decode_record",
    "specrepro.runner:reference_after",
    "specrepro.data.records:reference_response",
    "specrepro.runner:holds",
    "specrepro.runner:compile_steps_for",
    "specrepro.runner:warm_up",
)


def code_fingerprint(method: str) -> str:
    """A hash of the code that determines the tokens and timings of a run of `method`: `DECODING_CODE`, the modules
    of the decoder's classes (its own, and a method's it extends, inside this package or not), the modules it
    declares in `code_modules`, and the torch and transformers versions.

    Nothing else counts, by design: input checks, the judge, scoring and summaries (computed from the recorded
    generations), tables, W&B logging, training loops (their artifacts count by content: `loaded_weights`) and
    other methods' modules. Each piece counts as its syntax tree without docstrings, and without the text of the
    messages it raises or logs, so an edited comment, docstring, message or line wrap is the same code, and a fixed
    bug in one method re-decodes that method's runs (a changed core, every method's)."""
    registry.load()
    decoder = registry.method(method).decoder
    modules = [cls.__module__ for cls in decoder.__mro__ if cls.__module__ not in ("builtins", "abc")]
    pieces = dict.fromkeys([*DECODING_CODE, *modules, *decoder.code_modules])
    digest = hashlib.sha256()
    for piece in sorted(pieces):
        module, _, function = piece.partition(":")
        source = decoder_source(method, decoder) if module == decoder.__module__ else module_source(module)
        if source is None:
            raise SpecReproError(
                f"method '{method}': the code of module '{module}' cannot be read, so its runs "
                "cannot be named by their code"
            )
        digest.update(f"{piece}\0{_syntax_of(source, function)}\0".encode())
    digest.update(f"torch {torch.__version__}, transformers {metadata.version('transformers')}".encode())
    return digest.hexdigest()[:16]


# the code that scores and summarises a run's recorded answers and timings (task metrics, the code sandbox, the
# reading of a judge's judgments, the speed and summary metrics): not part of a run's identity, so a fixed scorer or
# summary scores old runs again from their records instead of decoding them again (`runner.score_again`)
SCORING_CODE = (
    "specrepro.metrics.completions",
    "specrepro.metrics.quality",
    "specrepro.metrics.sandbox",
    "specrepro.metrics.judge",
    "specrepro.metrics.speed",
    "specrepro.metrics.summary",
)


def scoring_fingerprint() -> str:
    """A hash of `SCORING_CODE` (each module's syntax tree without docstrings or message texts)."""
    digest = hashlib.sha256()
    for module in SCORING_CODE:
        digest.update(f"{module}\0{_syntax_of(module_source(module))}\0".encode())
    return digest.hexdigest()[:16]


def module_source(module: str) -> str | None:
    """The text of a module of this package (read from `PACKAGE`) or of another imported or importable one (a
    plugin's); None where it has no file."""
    if module.split(".")[0] == PACKAGE.name:
        base = PACKAGE.parent.joinpath(*module.split("."))
        file = next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)
        return file.read_text() if file else None
    file = getattr(sys.modules.get(module), "__file__", None)
    if file is None:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):  # `__main__` has no spec
            spec = None
        file = spec.origin if spec else None
    return Path(file).read_text() if file and Path(file).is_file() else None


def decoder_source(method: str, decoder: type) -> str:
    """The text of the decoder's module, or, for a class defined where no module file is (a notebook cell), of the
    class itself."""
    source = module_source(decoder.__module__)
    if source is not None:
        return source
    try:
        return textwrap.dedent(inspect.getsource(decoder))
    except (OSError, TypeError):
        raise SpecReproError(
            f"method '{method}': the source of {decoder.__qualname__} cannot be read, so its runs "
            "cannot be named by their code; define it in a module (SPECREPRO_PLUGINS)"
        ) from None


@lru_cache(maxsize=256)
def _syntax_of(source: str, function: str = "") -> str:
    """`syntax(source)`, or with `function` that of the module's top-level function or class of that name."""
    if not function:
        return syntax(source)
    found = [node for node in ast.parse(source).body if getattr(node, "name", None) == function]
    if not found:
        raise SpecReproError(f"identity.DECODING_CODE names '{function}', which its module no longer defines")
    return syntax(ast.unparse(found[0]))


def syntax(text: str) -> str:
    """A module's code as its syntax tree, without docstrings and without the text of the messages it raises or
    logs: what comments, docstrings, wording and layout do not change."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
            and isinstance(node.body[0].value.value, str)
        ):
            node.body = node.body[1:] or [ast.Pass()]
        call = node.exc if isinstance(node, ast.Raise) else node if _is_log_call(node) else None
        if isinstance(call, ast.Call):
            call.args = [ast.Constant("") if _is_text(arg) else arg for arg in call.args]
    return ast.dump(tree)


def _is_log_call(node: ast.AST) -> bool:
    """`log.info(...)`, `logging.warning(...)` and the like."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in ("log", "logging", "logger")
    )


def _is_text(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))


@lru_cache
def _machine(device: str) -> str:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"{device}, not visible here"  # loading the model refuses it; a dry run only names the run
    return machine_label(device_description(device))


def timing_machine(cfg: DictConfig) -> str:
    """The machine whose timings a run records (its footer label: the GPU, else the CPU, its vector instructions
    and cores): the same config timed on an H100 and an H200, or on two CPUs, is two runs."""
    return _machine(cfg.hardware.device)


def timing_threads(cfg: DictConfig) -> int:
    """The CPU threads a run's torch ops use: `hardware.threads`, or with null torch's default, which
    OMP_NUM_THREADS and the process's CPU affinity set (`taskset -c 0`: 1)."""
    return cfg.hardware.threads or torch.get_num_threads()


def _setting(cfg: DictConfig, data_fingerprint: str, artifacts: dict[str, dict] | None) -> dict:
    """What a run computes but the code: its config (less where results go), weights, data (and the files its
    method reads beside it), the machine and threads that time it and the record version."""
    content = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in NOT_IN_IDENTITY}
    artifacts = loaded_weights(cfg) if artifacts is None else artifacts
    files = read_files(cfg)
    return (
        content
        | {
            "artifacts": artifacts,
            "data": data_fingerprint,
            "machine": timing_machine(cfg),
            "threads": timing_threads(cfg),
            "record_version": RECORD_VERSION,
        }
        | ({"files": files} if files else {})
    )  # only where a method reads one: other runs keep their names


def run_name(cfg: DictConfig, data_fingerprint: str, artifacts: dict[str, dict] | None = None) -> str:
    """`run_name` when the config sets one, else `identity_name`."""
    return cfg.run_name or identity_name(cfg, data_fingerprint, artifacts)


def identity_name(cfg: DictConfig, data_fingerprint: str, artifacts: dict[str, dict] | None = None) -> str:
    """`<model>-<method>-<dataset>-<decoding>-<hash of config, weights, data, code and record version>`;
    `artifacts`: the `loaded_weights(cfg)`, when the caller has them already. A run named by `run_name` records
    it, so that the name is reused only for what it decoded."""
    content = _setting(cfg, data_fingerprint, artifacts) | {"code": code_fingerprint(cfg.method.name)}
    return f"{cfg.model.name}-{cfg.method.name}-{cfg.dataset.name}-{cfg.decoding.name}-{config_hash(content)}"


def setting_key(cfg: DictConfig, data_fingerprint: str, artifacts: dict[str, dict] | None = None) -> str:
    """A hash of what a run computes but the code: complete runs with this key (`metrics.json`) and another name
    were decoded by other code, and are kept but never reused."""
    return config_hash(_setting(cfg, data_fingerprint, artifacts))


REFERENCE_TIMING = ("warmup", "warmup_tokens", "repeats")  # how an `ar` run is timed (`paired`, `order`: beside what)


def reference_key(cfg: DictConfig, data_fingerprint: str) -> str:
    """Runs with equal keys decode the same prompts on the same weights, hardware settings, machine and decoding,
    and their `ar` reference with the same code, timed the same way (warm-up and repeats: an `ar` that kept the
    fastest of three timings is no reference for a run timed once)."""
    content = OmegaConf.to_container(cfg, resolve=True)
    key = {k: content[k] for k in ("model", "dataset", "decoding", "hardware")}
    key.update(
        timing={k: content["timing"][k] for k in REFERENCE_TIMING},
        artifacts=model_weights(cfg.model, cfg.artifacts_dir),
        data=data_fingerprint,
        machine=timing_machine(cfg),
        threads=timing_threads(cfg),
        code=code_fingerprint("ar"),
        record_version=RECORD_VERSION,
    )
    return config_hash(key)
