"""The int8 cache (model/quant/quant_cache.py): an entry is reused only for the same model content and calibration, is
rebuilt when its bytes or hashes differ, and a load from it runs the same model as a calibration."""
import os
import shutil

import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.model.quant import quant_cache
from servelab.model.quant.quant_cache import file_sha256, load_entry, model_content_hash, save_entry

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A quant cache of the test's own (SERVELAB_CACHE_DIR stays: it also holds the compiled kernels)."""
    monkeypatch.setattr(quant_cache, "cache_folder", lambda: tmp_path / "quant")
    return tmp_path / "quant"


def test_file_hash_is_remembered_until_the_file_changes(cache, tmp_path, monkeypatch):
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")
    first = file_sha256(f)
    calls = []
    monkeypatch.setattr(quant_cache, "_file_sha256", lambda p: calls.append(p) or "x")
    assert file_sha256(f) == first and not calls  # (path, size, mtime) unchanged: not read again
    f.write_bytes(b"abcd")
    assert file_sha256(f) == "x" and calls


def test_an_entry_is_refused_when_its_hashes_or_bytes_differ(cache):
    path = cache / "e.safetensors"
    tensors = {"a.qweight": torch.arange(12, dtype=torch.int8).view(3, 4), "a.scale": torch.ones(3)}
    save_entry(path, tensors, "m" * 64, "c" * 64)
    loaded = load_entry(path, "m" * 64, "c" * 64)
    assert loaded is not None and torch.equal(loaded["a.qweight"], tensors["a.qweight"])
    assert load_entry(path, "n" * 64, "c" * 64) is None
    assert load_entry(path, "m" * 64, "d" * 64) is None
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # one bit of a tensor's bytes
    path.write_bytes(bytes(data))
    assert load_entry(path, "m" * 64, "c" * 64) is None
    path.write_bytes(bytes(data[:20]))  # truncated
    assert load_entry(path, "m" * 64, "c" * 64) is None
    assert not list(cache.glob(".*"))  # no temporary file left behind


def _greedy(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_int8_weights_are_cached_reused_and_rebuilt(cache, tiny_llama_dir, tmp_path, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    llm = LLM(str(model), quantization="int8", dtype="bfloat16")
    state = llm.engine.executor.model.int8_state()
    expected = _greedy(llm)
    [entry] = cache.glob("int8-*.safetensors")
    assert entry.name.startswith(f"int8-{model_content_hash(model)[:16]}-")

    from servelab.executor.model_executor import ModelExecutor

    def no_calibration(*_):
        raise AssertionError("calibrated although the cache has the entry")

    calibrate = ModelExecutor.linear_input_absmax
    monkeypatch.setattr(ModelExecutor, "linear_input_absmax", no_calibration)
    warm = LLM(str(model), quantization="int8", dtype="bfloat16")
    assert all(torch.equal(v, warm.engine.executor.model.int8_state()[k]) for k, v in state.items())
    assert _greedy(warm) == expected
    monkeypatch.setattr(ModelExecutor, "linear_input_absmax", calibrate)

    entry.write_bytes(entry.read_bytes()[:-8] + b"\0" * 8)  # corrupted: rebuilt and replaced
    rebuilt = LLM(str(model), quantization="int8", dtype="bfloat16")
    assert _greedy(rebuilt) == expected
    from safetensors import safe_open

    with safe_open(str(entry), framework="pt") as f:
        metadata = f.metadata()
    assert load_entry(entry, metadata["model_sha256"], metadata["config_sha256"]) is not None
    assert all(torch.equal(v, rebuilt.engine.executor.model.int8_state()[k]) for k, v in state.items())

    from safetensors.torch import load_file, save_file

    weights = load_file(model / "model.safetensors")
    name = next(k for k in weights if k.endswith("down_proj.weight"))
    weights[name] = weights[name] * 2  # another model: another entry
    save_file(weights, model / "model.safetensors")
    os.utime(model / "model.safetensors", ns=(1, 1))
    LLM(str(model), quantization="int8", dtype="bfloat16")
    assert len(list(cache.glob("int8-*.safetensors"))) == 2
