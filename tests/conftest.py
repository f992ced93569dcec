from __future__ import annotations

import os
import shutil
from pathlib import Path

# The suite tests the sources as Python, also where `make compiled` built the simulator's compiled modules
# (SERVELAB_COMPILED=1 runs it compiled); tests/compiled/test_compiled.py reruns the golden checks compiled.
os.environ.setdefault("SERVELAB_COMPILED", "0")
# Tests that point SERVELAB_CACHE_DIR at a folder of their own (an empty quant or lab cache) still load the one
# build of the C++ kernels instead of compiling them again (about a minute each) in their folder.
import pytest  # noqa: E402
import torch  # noqa: E402

from servelab.kernels import kernels_root  # noqa: E402

os.environ.setdefault("SERVELAB_KERNELS_DIR", str(kernels_root()))

from servelab.model.loader import resolve_model_path  # noqa: E402

# servelab.testing runs a real `servelab serve`; the gateway and the load generator tests both start servers
# through the start_server fixture below.
from servelab.testing.server import ServerProcess  # noqa: E402

# Under pytest-xdist (make test: one test process per core) each process computes on its share of the cores,
# as the servers the tests start do (--num-threads 1), instead of every process spinning a thread on every core.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TINY_DIMS = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
    vocab_size=49152, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct converted from its GGUF (once per cache, then reused)."""
    return resolve_model_path(None)


def _save_tiny(model, folder: Path, default_model_dir: Path) -> Path:
    # Wider-than-default weights give peaked logits (no near-ties for greedy parity to trip on) and
    # non-zero biases (HF initialises them to zero, which would leave the QKV-bias path untested).
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
def tiny_llama_dir(tmp_path_factory, default_model_dir) -> Path:
    """Random 2-layer Llama (GQA, untied lm_head, llama3 rope scaling) with SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**TINY_DIMS, tie_word_embeddings=False, rope_scaling=dict(LLAMA3_ROPE_SCALING),
                         dtype="float32")
    return _save_tiny(LlamaForCausalLM(config), tmp_path_factory.mktemp("tiny_llama"), default_model_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, default_model_dir) -> Path:
    """Random 2-layer Qwen2 (GQA, QKV bias) with SmolLM2's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(**TINY_DIMS, tie_word_embeddings=False, dtype="float32")
    return _save_tiny(Qwen2ForCausalLM(config), tmp_path_factory.mktemp("tiny_qwen2"), default_model_dir)


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    """start_server(model, *flags, env=None) -> a ready ServerProcess, killed when the module's tests end
    (or earlier by the test), so no server outlives the tests that use it."""
    servers: list[ServerProcess] = []

    def start(model: str | Path | None, *flags: str, env: dict | None = None) -> ServerProcess:
        log_path = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(str(model) if model else None, flags, log_path, env)
        servers.append(server)
        try:
            return server.wait_ready()
        except Exception:
            server.stop()
            raise

    yield start
    for server in servers:
        server.stop()
