"""A run is named by the code that determines its tokens and timings (`identity.DECODING_CODE`, the method's
classes' modules, what a decoder declares), not by the harness's messages, labels or unrelated modules."""

from __future__ import annotations

import ast
import importlib
import shutil
import textwrap

import pytest

from specrepro import identity, registry
from specrepro.identity import DECODING_CODE, code_fingerprint, module_source, run_name
from tests.test_config import compose_run
from tests.test_registry import TOY_MODULE

# modules the hashed code imports that cannot change a token or a timing: what they hold reaches a run through
# its resolved config (schemas), its artifacts' content (which artifact) or not at all (messages, the registry)
NOT_DECODING = {
    "specrepro",
    "specrepro.errors",
    "specrepro.registry",
    "specrepro.config",
    "specrepro.training.artifacts",
}


@pytest.fixture
def package_copy(tmp_path, monkeypatch):
    """A copy of the package's source that `code_fingerprint` reads instead: edit it to see what renames runs."""
    copy = tmp_path / "src" / "specrepro"
    shutil.copytree(identity.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(identity, "PACKAGE", copy)
    return copy


def edit(path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} is not in {path.name} any more: update this test"
    path.write_text(text.replace(old, new, 1))


def append(path, line: str) -> None:
    path.write_text(f"{path.read_text()}\n{line}\n")


def test_messages_labels_and_other_modules_keep_the_name_and_the_decoding_core_changes_it(package_copy):
    cfg = compose_run("model=tiny_random", "method=pld")
    name = run_name(cfg, "data")
    pld, ar = code_fingerprint("pld"), code_fingerprint("ar")
    edit(package_copy / "config.py", "must be positive, got", "must be at least 1, got")  # an input check
    edit(
        package_copy / "metrics" / "summary.py", '("tok/s", "tokens_per_s"', '("tokens/s", "tokens_per_s"'
    )  # a table label
    edit(package_copy / "runner.py", "while a turn was timed: timing it again", "mid-turn: again")  # a log line
    append(package_copy / "tables.py", "LABEL = 'Speedup'")
    append(package_copy / "decoding" / "sps.py", "ANOTHER_METHOD = 1")
    assert run_name(cfg, "data") == name and code_fingerprint("pld") == pld and code_fingerprint("ar") == ar

    append(package_copy / "decoding" / "pld.py", "EDITED = 1")  # its own module: pld alone
    assert code_fingerprint("pld") != pld and code_fingerprint("ar") == ar
    pld = code_fingerprint("pld")
    append(package_copy / "decoding" / "verify.py", "EDITED = 1")  # the core: every method
    assert code_fingerprint("pld") != pld and code_fingerprint("ar") != ar
    assert run_name(cfg, "data") != name


def test_the_timing_protocol_counts_function_by_function(package_copy):
    ar = code_fingerprint("ar")
    edit(package_copy / "runner.py", "def training_minutes(", "def training_minutes(unused=None, *, ")  # not hashed
    assert code_fingerprint("ar") == ar
    edit(package_copy / "runner.py", "def decode_turn(", "def decode_turn(unused=None, *, ")
    assert code_fingerprint("ar") != ar


def test_a_plugin_methods_own_module_is_hashed(tmp_path, monkeypatch):
    """A method from outside the package (SPECREPRO_PLUGINS) is named by its module's code as a built-in one."""
    registry.load()
    monkeypatch.setattr(registry, "METHODS", dict(registry.METHODS))  # the toy registers here, not for later tests
    module = tmp_path / "toy_plugin_for_identity.py"
    module.write_text(textwrap.dedent(TOY_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module(module.stem)
    toy, pld = code_fingerprint("toy"), code_fingerprint("pld")
    module.write_text("# a comment\n" + module.read_text())
    assert code_fingerprint("toy") == toy
    module.write_text(module.read_text().replace("FixedLength(self.k)", "FixedLength(self.k + 1)"))
    assert code_fingerprint("toy") != toy and code_fingerprint("pld") == pld


def test_every_module_the_hashed_code_imports_is_hashed_or_cannot_change_tokens():
    """A new import into the decoding code (a helper module a method starts to use) must join DECODING_CODE or the
    decoder's `code_modules`, or be shown here not to change what a run computes."""
    registry.load()
    core = {piece for piece in DECODING_CODE if ":" not in piece}
    for name, method in sorted(registry.METHODS.items()):
        hashed = core | {cls.__module__ for cls in method.decoder.__mro__} | set(method.decoder.code_modules)
        for module in sorted(m for m in hashed if m.startswith("specrepro")):
            missing = imports(module) - hashed - NOT_DECODING
            assert not missing, f"{module} (method {name}) imports {sorted(missing)}, whose code is not hashed"


def imports(module: str) -> set[str]:
    """The modules of this package that `module` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(module_source(module))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if module_source(f"{node.module}.{a.name}")}
    return {name for name in found if name.split(".")[0] == "specrepro"}
