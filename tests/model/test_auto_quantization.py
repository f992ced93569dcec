"""--quantization auto: the resolve order (explicit flags, Hugging Face folders, kernels, TP, the default model)."""
import pytest

from servelab.engine_args import EngineArgs
from servelab.entrypoints.cli import build_parser
from servelab.model.quant.auto_quantization import MEASURED_FASTEST, resolve_quantization


def choice(**kwargs):
    c = resolve_quantization(EngineArgs(**kwargs))
    return c.quantization, c.kv_cache_dtype


def test_auto_is_the_default_flag():
    args = EngineArgs.from_cli_args(build_parser().parse_args(["serve"]))
    assert args.quantization == "auto"
    assert EngineArgs().quantization == "auto"


def test_the_default_model_runs_the_measured_fastest_mode():
    assert choice() == MEASURED_FASTEST == ("int8", "int8")
    assert choice(model="smollm2-135m") == ("int8", "int8")
    assert "perplexity gate" in resolve_quantization(EngineArgs()).reason


def test_an_explicit_kv_cache_dtype_or_quantization_wins():
    assert choice(quantization="gguf") == ("gguf", "auto")
    assert choice(quantization="none") == (None, "auto")
    assert choice(quantization=None, kv_cache_dtype="int8") == (None, "int8")
    assert choice(quantization="int8") == ("int8", "auto")


def test_an_explicit_dtype_keeps_float_weights():
    c = resolve_quantization(EngineArgs(dtype="float32"))
    assert (c.quantization, c.kv_cache_dtype, c.mode) == (None, "auto", "none")
    assert "--dtype float32" in c.reason


def test_a_hugging_face_folder_keeps_float_weights(tiny_llama_dir):
    c = resolve_quantization(EngineArgs(model=str(tiny_llama_dir)))
    assert c.quantization is None and "Hugging Face" in c.reason


def test_other_gguf_files_keep_float_weights(tmp_path):
    assert choice(model=str(tmp_path / "other.Q8_0.gguf")) == (None, "auto")


def test_tensor_parallelism_takes_int8_but_not_gguf_blocks():
    assert choice(tensor_parallel_size=3) == ("int8", "int8")
    assert EngineArgs(quantization="int8", tensor_parallel_size=3).parallel_config().tensor_parallel_size == 3
    with pytest.raises(ValueError, match="gguf runs on one rank only"):
        EngineArgs(quantization="gguf", tensor_parallel_size=3).parallel_config()


def test_without_the_kernels_float_weights(monkeypatch):
    import servelab.kernels

    monkeypatch.setattr(servelab.kernels, "cpu_ops", lambda: None)
    c = resolve_quantization(EngineArgs())
    assert c.quantization is None and "kernels" in c.reason
