"""Fixtures for the load-generator tests (start_server comes from tests/conftest.py)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from servelab.bench.datasets import load_tokenizer

    return load_tokenizer(default_model_dir)
