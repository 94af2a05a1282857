# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 1234

.PHONY: install serve test lint pull bench clean browser sandbox

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned exactly: a looser spec would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# instructor pins jiter<0.15, openai 3.57 needs jiter>=0.16; it only calls jiter.from_json,
	# so it goes in without its pins (its runtime deps are in the test extra).
	$(PY) -m pip install --quiet --no-deps instructor==1.17.0
	touch $(STAMP)

install: $(STAMP)

pull: $(STAMP)
	$(VENV)/bin/inferd pull smollm2

serve: pull
	$(VENV)/bin/inferd serve --host $(HOST) --port $(PORT)

lint: $(STAMP)
	$(VENV)/bin/ruff check inferd tests benchmarks examples
	$(VENV)/bin/ruff format --check inferd tests benchmarks examples
	$(VENV)/bin/mypy

# Debian's chromium for the chat page's browser test (tests/server/test_chat_page_live.py), as root
browser:
	command -v chromium || (apt-get update && apt-get install -y chromium chromium-driver)

# Debian's bubblewrap and libseccomp for the code-execution sandbox (tests/agent/test_sandbox.py), as root
sandbox:
	command -v bwrap || (apt-get update && apt-get install -y bubblewrap)
	ldconfig -p | grep -q libseccomp.so.2 || (apt-get update && apt-get install -y libseccomp2)

test: pull lint browser sandbox
	$(VENV)/bin/inferd pull minilm   # the embedding model the tests also exercise
	$(VENV)/bin/inferd pull gemma3   # the second real model (tests/models/*gemma3*)
	# two workers (CI has two cores); --dist loadfile keeps each file's live server in one worker
	$(PY) -m pytest -q -n 2 --dist loadfile --ignore=tests/ray
	# the local Ray cluster alone, in its own process: its driver's threads and replicas would
	# take the cores from the other worker's servers starting up
	$(PY) -m pytest -q tests/ray

# Peers for the side-by-side table; llama-cpp-python builds from source (several minutes).
bench: pull
	$(PY) -m pip install --quiet mistralrs==0.9.5 "llama-cpp-python[server]==0.3.36"
	$(VENV)/bin/inferd bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV)
