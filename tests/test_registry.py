"""One registry: a method is its own module plus one yaml file; nothing else in the harness changes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from specrepro import registry
from specrepro.cli import check_method_schemas
from specrepro.errors import SpecReproError
from tests.test_runner import FAST, run_dirs, specrepro

TOY_MODULE = '''
"""A toy method: it drafts the last token k times."""
from dataclasses import dataclass

from specrepro.decoding.controllers import FixedLength
from specrepro.decoding.draft_verify import DraftVerifyDecoder, Proposal
from specrepro.registry import MethodConfig, register_method


@dataclass
class ToyConfig(MethodConfig):
    name: str = "toy"
    k: int = 2


@register_method(ToyConfig)
class ToyDecoder(DraftVerifyDecoder):
    name = "toy"

    def __init__(self, model, tokenizer, k):
        super().__init__(model, tokenizer)
        self.k = k

    @classmethod
    def from_config(cls, cfg, target, ctx):
        return cls(target.model, target.tokenizer, cfg.k)

    def new_controller(self):
        return FixedLength(self.k)

    def propose(self, state, tokens, k, sampling, rng, controller):
        return Proposal(tokens[0, -1:].repeat(k))
'''


def test_a_new_method_is_its_module_and_one_yaml_file(tmp_path, monkeypatch):
    (tmp_path / "toy_method.py").write_text(TOY_MODULE)
    (tmp_path / "my_conf" / "method").mkdir(parents=True)
    (tmp_path / "my_conf" / "method" / "toy.yaml").write_text(
        textwrap.dedent("""\
        defaults:
          - /method_schema_toy@_here_
          - _self_
        k: 3
        """)
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv(registry.PLUGINS_VARIABLE, "toy_method")
    specrepro(
        "run",
        "--config-dir",
        str(tmp_path / "my_conf"),
        *FAST,
        "method=toy",
        "dataset.limit=1",
        "logger=none",
        cwd=tmp_path,
    )
    runs = {key.split(":")[0]: path for key, path in run_dirs(tmp_path).items()}
    metrics = json.loads((runs["toy"] / "metrics.json").read_text())
    assert metrics["complete"] and metrics["lossless"] == 1.0  # against the `ar` reference it ran first
    gens = [
        g
        for line in (runs["toy"] / "generations.jsonl").read_text().splitlines()
        for sample in json.loads(line)["samples"]
        for g in sample
    ]
    assert max(d for g in gens for d in g["drafted"]) == 3  # the yaml's k, over the schema's default of 2


def test_a_plugin_module_that_does_not_import_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.PLUGINS_VARIABLE, "no_such_module_here")
    proc = specrepro("run", *FAST, "method=ar", "dataset.limit=1", "logger=none", cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "SPECREPRO_PLUGINS names module 'no_such_module_here'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_method_yaml_whose_schema_no_module_registers_names_the_plugins_variable(tmp_path):
    """Hydra alone says it cannot load `method_schema_toy`; the CLI says which variable loads the module."""
    (tmp_path / "method").mkdir()
    (tmp_path / "method" / "toy.yaml").write_text("defaults:\n  - /method_schema_toy@_here_\n  - _self_\n")
    registry.load()
    check_method_schemas(["--config-dir", str(tmp_path), "method=pld"])  # a registered one: no complaint
    with pytest.raises(SpecReproError, match="method 'toy' .* extends method_schema_toy.*SPECREPRO_PLUGINS=my_methods"):
        check_method_schemas(["--config-dir", str(tmp_path), "-m", "method=pld,toy"])


def test_loading_every_method_and_trainer_leaves_the_libraries_of_rarer_paths_unimported():
    """Every CLI process registers every method and trainer, so what their modules import, each process (and each
    of the suite's hundreds) pays for: `datasets` (training data, Hub datasets) and `scipy.stats` (one interval of
    alternating-order runs) take most of a second each to import, and are imported only where used."""
    rarer = ("datasets", "scipy.stats", "peft", "matplotlib", "wandb", "evaluate")
    code = "import json, sys; import specrepro.config as c; c.register_configs(); print(json.dumps(list(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert not set(rarer) & set(json.loads(out.stdout))
