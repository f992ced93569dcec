"""Which tensor-parallel sizes a model accepts, each rank's shapes and weight bytes, and the flag;
no process is started here."""
import multiprocessing
import shutil

import pytest
import torch

from servelab import LLM
from servelab.config import ParallelConfig, valid_tensor_parallel_sizes
from servelab.specs import ModelSpec
from servelab.distributed.parallel_state import TensorParallelGroup
from servelab.engine_args import EngineArgs
from servelab.entrypoints.cli import build_parser
from servelab.metrics.server_metrics import ServerMetrics
from servelab.model.layers import QKVParallelLinear, VocabParallelEmbedding
from servelab.model.llama import LlamaForCausalLM
from servelab.model.loader import load_model_config


@pytest.fixture(scope="module")
def smollm2_config(default_model_dir) -> ModelSpec:
    config = load_model_config(default_model_dir)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    return config


def test_default_model_accepts_1_and_3(smollm2_config):
    assert valid_tensor_parallel_sizes(smollm2_config) == [1, 3]


def test_tp2_on_the_default_model_is_rejected_before_any_process(tmp_path, default_model_dir):
    # The default model's config.json alone: the size is checked before weights, tokenizer or workers.
    shutil.copy(default_model_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 .* 9 attention heads; valid sizes for it: 1, 3$"):
        LLM(str(tmp_path), dtype="float32", tensor_parallel_size=2)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("heads, kv_heads, mlp, valid", [
    (4, 2, 128, [1, 2, 4]),  # 4: one query head per rank, each KV head copied on 2 ranks
    (12, 4, 96, [1, 2, 4, 12]),  # 3 divides the heads but neither divides nor is a multiple of 4 KV heads
    (8, 8, 36, [1, 2, 4]),  # 8 does not divide the MLP width 36
])
def test_valid_sizes(heads, kv_heads, mlp, valid):
    config = ModelSpec("tiny", "tiny", "LlamaForCausalLM", vocab_size=100, hidden_size=heads * 8, intermediate_size=mlp,
                         num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
                         max_position_embeddings=64)
    assert valid_tensor_parallel_sizes(config) == valid
    with pytest.raises(ValueError, match="valid sizes for it: " + ", ".join(map(str, valid))):
        ParallelConfig(3 if 3 not in valid else 5).verify_with_model(config)


@pytest.mark.parametrize("flag", ["-tp", "--tensor-parallel-size"])
@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"], ["bench", "latency"]])
def test_flag(command, flag):
    args = build_parser().parse_args(command + [flag, "3"])
    assert EngineArgs.from_cli_args(args).parallel_config() == ParallelConfig(3)


def rank_shapes(model: LlamaForCausalLM) -> dict[str, tuple[int, ...]]:
    layer = model.layers[0]
    return {"embedding": tuple(model.embed_tokens.shape), "qkv_proj": tuple(layer.qkv_proj.weight.shape),
            "o_proj": tuple(layer.o_proj.weight.shape), "gate_up_proj": tuple(layer.gate_up_proj.weight.shape),
            "down_proj": tuple(layer.down_proj.weight.shape), "kv_cache": model.kv_cache_shape(10, 16)}


def param_bytes(model: LlamaForCausalLM) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() counts tied weights once


def test_tp3_shapes_and_weight_bytes_of_the_default_model(smollm2_config):
    # Shapes only (torch.empty, nothing loaded, no process group): hidden 576, 9 heads of 64, 3 KV heads, MLP 1536.
    full = LlamaForCausalLM(smollm2_config, torch.float32, max_positions=64)
    assert rank_shapes(full) == {"embedding": (49152, 576), "qkv_proj": (576 + 2 * 192, 576), "o_proj": (576, 576),
                                 "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
                                 "kv_cache": (2, 10, 16, 3, 64)}
    norm_bytes = (2 * smollm2_config.num_hidden_layers + 1) * 576 * 4  # replicated on every rank
    for rank in range(3):
        shard = LlamaForCausalLM(smollm2_config, torch.float32, max_positions=64, tp=TensorParallelGroup(rank, 3))
        assert rank_shapes(shard) == {"embedding": (16384, 576), "qkv_proj": (192 + 2 * 64, 576),
                                      "o_proj": (576, 192), "gate_up_proj": (1024, 576), "down_proj": (576, 512),
                                      "kv_cache": (2, 10, 16, 1, 64)}
        assert param_bytes(shard) == (param_bytes(full) - norm_bytes) // 3 + norm_bytes
    assert (param_bytes(full) - norm_bytes) % 3 == 0


def test_qkv_rows_of_each_rank_with_copied_kv_heads():
    # 4 query heads, 2 KV heads, head_dim 1, over 4 ranks: rank r reads query head r and KV head r // 2.
    q, k, v = torch.arange(4.0), torch.arange(10.0, 12.0), torch.arange(20.0, 22.0)
    for rank in range(4):
        layer = QKVParallelLinear(1, 1, 4, 2, TensorParallelGroup(rank, 4), torch.float32)
        layer.load([q[:, None], k[:, None], v[:, None]])
        assert (layer.num_heads, layer.num_kv_heads) == (1, 1)
        assert layer.weight.flatten().tolist() == [rank, 10 + rank // 2, 20 + rank // 2]


def test_vocab_shards_pad_the_last_rank():
    weight = torch.arange(10.0)[:, None]  # vocab 10 over 3 ranks: 4 rows each, the last 2 of rank 2 zero
    rows = []
    for rank in range(3):
        embedding = VocabParallelEmbedding(10, 1, TensorParallelGroup(rank, 3), torch.float32)
        embedding.load(weight)
        rows.append(embedding.weight.flatten().tolist())
    assert rows == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 0]]


def weight_bytes_series(metrics: ServerMetrics) -> dict[str, float]:
    from prometheus_client import generate_latest

    lines = generate_latest(metrics.registry).decode().splitlines()
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines)
            if name.startswith("servelab:weight_bytes{")}


def test_weight_bytes_metric_has_one_series_per_rank():
    assert weight_bytes_series(ServerMetrics("m", weight_bytes=(30, 20, 20))) == {
        f'servelab:weight_bytes{{device="cpu:{rank}",model_name="m"}}': value
        for rank, value in enumerate((30.0, 20.0, 20.0))}
    single = {'servelab:weight_bytes{device="cpu",model_name="m"}': 30.0}
    assert weight_bytes_series(ServerMetrics("m", weight_bytes=(30,))) == single
    assert weight_bytes_series(ServerMetrics("m", weight_bytes=30)) == single
