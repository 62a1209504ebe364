"""`model.device_map` (accelerate's big-model inference) on the CPU: a map naming every module loads through
accelerate's dispatch and a drafting method decodes it losslessly (the GPU + CPU split is in tests/test_cuda.py)."""

from __future__ import annotations

import json

import yaml

from tests.test_runner import FAST, run_dirs, specrepro


def test_an_explicit_device_map_loads_and_decodes_losslessly(tmp_path):
    out = specrepro(
        "run",
        *FAST,
        "method=pld",
        "dataset.limit=2",
        "logger=none",
        "model.device_map={model:cpu,lm_head:cpu}",
        cwd=tmp_path,
    )
    [pld] = [path for key, path in run_dirs(tmp_path).items() if key.startswith("pld:")]
    metrics = json.loads((pld / "metrics.json").read_text())
    assert metrics["lossless"] == 1.0 and metrics["mat"] >= 1.0, out.stdout
    config = yaml.safe_load((pld / "config.yaml").read_text())
    assert config["model"]["device_map"] == {"model": "cpu", "lm_head": "cpu"}  # and so is its ar reference's
