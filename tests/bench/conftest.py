"""Fixtures for the load-generator tests (start_server comes from tests/conftest.py)."""
from __future__ import annotations

import pytest

# the peers' offline loops are tested on a real LLMEngine over servelab.testing's stub executor


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from servelab.bench.datasets import load_tokenizer

    return load_tokenizer(default_model_dir)
