"""Tiny Llama folders whose heads split over 2 ranks, and a time limit per test module that also
kills any worker process a failing test left behind."""
from __future__ import annotations

import multiprocessing
import shutil
import signal
from pathlib import Path

import pytest
import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# A backstop against hangs, not a timing assertion: room for a first build of the CPU kernels on a busy machine.
MODULE_TIME_LIMIT_S = 600


def _save_tiny_llama(folder: Path, default_model_dir: Path, num_kv_heads: int, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=num_kv_heads,
                         intermediate_size=128, vocab_size=49152, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2, tie_word_embeddings=False, dtype="float32")
    model = LlamaForCausalLM(config)
    # Wide weights give peaked logits: no near-ties for greedy parity to trip on (as tests/conftest.py does).
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.02 if "norm" not in name else 0.1).add_(1.0 if "norm" in name else 0.0)
            if "embed" not in name and "norm" not in name:
                param.mul_(8.0)
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_dir / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_gqa_dir(tmp_path_factory, default_model_dir) -> Path:
    """4 query heads, 2 KV heads: at TP 2 each rank holds 2 query heads and 1 KV head."""
    return _save_tiny_llama(tmp_path_factory.mktemp("tiny_gqa"), default_model_dir, num_kv_heads=2, seed=0)


@pytest.fixture(scope="session")
def tiny_mqa_dir(tmp_path_factory, default_model_dir) -> Path:
    """4 query heads, 1 KV head: at TP 2 the KV head is copied on both ranks (vLLM's rule)."""
    return _save_tiny_llama(tmp_path_factory.mktemp("tiny_mqa"), default_model_dir, num_kv_heads=1, seed=1)


class ModuleTimeout(BaseException):
    """A BaseException, like KeyboardInterrupt, so no `except Exception` on the way swallows it."""


@pytest.fixture(scope="module", autouse=True)
def module_time_limit():
    """Bounds each test module (SIGALRM interrupts a hung wait), restores the thread count the
    engines set, and kills any worker process still alive at the end, failing the module if one was."""
    def expire(signum, frame):
        raise ModuleTimeout(f"test module ran past {MODULE_TIME_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(MODULE_TIME_LIMIT_S)
    num_threads = torch.get_num_threads()
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
    torch.set_num_threads(num_threads)
    leftovers = multiprocessing.active_children()
    for process in leftovers:
        process.kill()
        process.join()
    assert not leftovers, f"worker processes outlived their engines: {leftovers}"
