"""The wheel works without the checkout: built, installed in a fresh venv and run from an empty directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# source directory -> where pyproject.toml's package-dir puts it in the wheel
PACKAGED = {
    "src/specrepro": "specrepro",
    "conf": "specrepro/conf",
    "experiments/tables": "specrepro/table_specs",
    "experiments/reproduce": "specrepro/pipelines",
}


def sh(*args, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(map(str, args))}:\n{proc.stderr[-3000:]}"
    return proc


def build_wheel(tmp: Path) -> Path:
    """The wheel of a copy of the checkout: a build in the checkout itself would leave build/ there, and files
    deleted since an earlier build would ship from it."""
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in PACKAGED:
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    sh(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", source)
    return next((tmp / "dist").glob("specrepro-*.whl"))


def install(wheel: Path, venv: Path) -> Path:
    """A fresh venv holding the wheel, with this environment's packages for the dependencies (nothing is
    downloaded); returns its python."""
    sh(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    # installed before this environment is visible, so that pip does not see its specrepro
    sh(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel)
    site_packages = sh(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip()
    # A .pth line goes after the venv's own site-packages, and .pth files in the directory it names are not
    # processed: this environment's editable specrepro (its .pth and finder) stays out, the wheel's wins.
    dependencies = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    (Path(site_packages) / "dependencies.pth").write_text("\n".join(dependencies) + "\n")
    return python


def test_wheel_runs_outside_the_checkout(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
    expected = {
        f"{target}/{path.relative_to(REPO / source).as_posix()}"
        for source, target in PACKAGED.items()
        for pattern in ("*.py", "*.yaml")
        for path in (REPO / source).rglob(pattern)
        if "__pycache__" not in path.parts
    }
    assert not expected - shipped, f"missing from the wheel (pyproject.toml's packages?): {sorted(expected - shipped)}"

    venv = tmp_path / "venv"
    python = install(wheel, venv)
    work = tmp_path / "work"
    work.mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "HYDRA_FULL_ERROR": "1",
    }
    package = Path(sh(python, "-c", "import specrepro; print(specrepro.__file__)", cwd=work, env=env).stdout.strip())
    assert package.is_relative_to(venv) and not package.is_relative_to(REPO), package

    specrepro = venv / "bin" / "specrepro"
    sh(
        specrepro,
        "run",
        "model=tiny_random",
        "method=pld",
        "dataset.limit=1",
        "logger=none",
        "decoding.max_new_tokens=8",
        "hardware.threads=1",
        cwd=work,
        env=env,
    )
    records = [json.loads(path.read_text()) for path in work.glob("results/runs/*/metrics.json")]
    assert sorted(r["method"] for r in records if r.get("complete")) == ["ar", "pld"]  # the run and its reference

    assert "cllm: " in sh(specrepro, "reproduce", "all", "--dry-run", cwd=work, env=env).stdout
    sh(specrepro, "table", "specbench_small", cwd=work, env=env)
    assert (work / "results" / "specbench" / "specbench_small.md").is_file()
