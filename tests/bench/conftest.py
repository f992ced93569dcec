"""Fixtures for the load-generator tests (start_server comes from tests/conftest.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the peers' offline loops are tested on a real LLMEngine over the stub executor in tests/engine/stub_engine.py
sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from servelab.bench.datasets import load_tokenizer

    return load_tokenizer(default_model_dir)
