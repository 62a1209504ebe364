"""Where a number came from: code version, library versions, machine and kernel settings, and when.

Every run record (`metrics.json`), artifact (`artifact.json`) and W&B config carries `provenance()`;
tables print it in their footer.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from specrepro.metrics.sandbox import isolation_layers

if TYPE_CHECKING:
    import torch

RECORD_VERSION = 2  # bump when a record's meaning changes: it enters every run's identity


def now() -> str:
    """The current time, UTC, ISO 8601 to the second."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def checkout_version(source: Path = Path(__file__).resolve().parent) -> dict:
    """The git commit of a source checkout as it is now, and whether its code and configs differ from it: an edited
    or a new file that git does not ignore (what the harness writes under results/, committed tables included, does
    not count); for a copy of a checkout
    without its .git (shipped to a lent GPU or a cluster node), the commit the copier names in SPECREPRO_COMMIT,
    its dirtiness unknown; otherwise none, and the record has the package version that is installed."""

    def git(*args: str) -> str:
        # no optional locks: `status` would otherwise rewrite the index under .git/index.lock, which a run killed
        # mid-call leaves behind, and the user's next `git commit` fails on it
        return subprocess.run(
            ["git", "--no-optional-locks", "-C", str(source), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()

    try:
        top = Path(git("rev-parse", "--show-toplevel"))
        if source.is_relative_to(top):
            changed = git("status", "--porcelain", "--", ":(top,exclude)results")
            return {"commit": git("rev-parse", "HEAD"), "dirty": bool(changed)}
    except (OSError, subprocess.SubprocessError):
        pass
    return {"commit": os.environ.get("SPECREPRO_COMMIT"), "dirty": None}


@lru_cache(maxsize=1)
def code_version() -> dict:
    """`checkout_version()` when this process first asked: the code it imported."""
    return checkout_version()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_description(device: torch.device | str | None = None) -> dict:
    """The CPU (model, cores, the widest vector instructions torch uses on it: one EPYC model name covers CPUs with
    and without AVX-512, whose kernels differ; whether it computes in bfloat16 natively, which AVX-512 alone does
    not say and every bf16 figure on a CPU depends on) and, when the run is on one, the GPU (name, count)."""
    import torch  # here, as below: the commands that only read records (tables, compare) start without torch

    from specrepro.models.kernels import native_bf16

    info = {
        "cpu": cpu_name(),
        "cpu_cores": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_native_bf16": native_bf16(),
    }
    if device is not None and torch.device(device).type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(torch.device(device)), gpu_count=torch.cuda.device_count())
    return info


def machine_label(info: dict) -> str:
    """One line for a table footer: the GPU when there is one, else the CPU (its vector instructions where the
    record has them) and its cores."""
    if info.get("gpu"):
        return f"{info['gpu_count']} x {info['gpu']}"
    capability = f" ({info['cpu_capability']})" if info.get("cpu_capability") else ""
    return f"{info.get('cpu')}{capability}, {info.get('cpu_cores')} cores"


def provenance(hardware=None, device: torch.device | str | None = None) -> dict:
    """What produced a record: code and library versions, the machine, threads and kernel options, the time."""
    import torch

    hardware = dict(hardware or {})
    return {
        "record_version": RECORD_VERSION,
        "code": {**code_version(), "specrepro": _version("specrepro")},
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": _version("transformers"),
        },
        "machine": device_description(device),
        "threads": torch.get_num_threads(),
        "dtype": hardware.get("dtype"),
        "kernels": {k: hardware[k] for k in ("linear_kernel", "linear_min_rows", "row_invariant") if k in hardware},
        "compile": {k: hardware[k] for k in ("compile", "compile_backend", "compile_mode") if k in hardware},
        "sandbox": list(isolation_layers()),  # pass@k's kernel layers here; no "landlock": files not confined
    }
