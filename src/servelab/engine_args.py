"""Engine options shared by the Python API (LLM(...)) and every CLI command, with vLLM's names."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from servelab.config import QUANTIZATION_METHODS, SCHEDULE_POLICIES, CacheConfig, ParallelConfig, SchedulerConfig


@dataclass
class EngineArgs:
    model: str | None = None
    dtype: str = "auto"
    schedule: str = "continuous"
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    kv_cache_memory: float = 2.0
    block_size: int = 16
    num_kv_blocks: int | None = None
    num_threads: int | None = None
    tensor_parallel_size: int = 1
    quantization: str | None = None
    # `servelab serve` only: engine-core processes behind the API server, or one engine in a thread of it
    data_parallel_size: int = 1
    engine_in_process: bool = False

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
        if with_model:
            parser.add_argument("--model", default=None,
                                help="Hugging Face model folder or .gguf file (default: SmolLM2-135M-Instruct)")
        parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                            help="weights and activations; auto = bfloat16 where the CPU runs it natively")
        parser.add_argument("--schedule", default="continuous", choices=SCHEDULE_POLICIES,
                            help="serial = one request at a time; static = a batch forms when idle and nobody "
                                 "joins until all finish; continuous = admit and retire every step (paged KV)")
        parser.add_argument("--max-num-seqs", type=int, default=128, help="most requests in one batch")
        parser.add_argument("--max-num-batched-tokens", type=int, default=1024,
                            help="token budget per step; longer prompts are prefilled in chunks")
        parser.add_argument("--max-model-len", type=int, default=None,
                            help="context length (default: the model's, capped at 8192)")
        parser.add_argument("--kv-cache-memory", type=float, default=2.0,
                            help="KV cache size: GiB when >= 1, a fraction of RAM when below 1")
        parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
        parser.add_argument("--num-kv-blocks", type=int, default=None,
                            help="exact KV pool size in blocks (overrides --kv-cache-memory)")
        parser.add_argument("--num-threads", type=int, default=None,
                            help="torch CPU threads per process (default: the cores, shared among the TP ranks)")
        parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                            help="shard the model over this many worker processes (torch.distributed); "
                                 "it must split the attention heads evenly")
        parser.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                            help="gguf = run the .gguf file's own quantized blocks (Q8_0, Q4_0, Q4_1, Q4_K) "
                                 "without de-quantizing them; int8 = W8A8 dynamic (int8 weights per channel, "
                                 "activations per token), for batched steps. Default: float weights (--dtype)")

    @staticmethod
    def add_process_cli_args(parser: argparse.ArgumentParser) -> None:
        """Where the engine runs (servelab serve)."""
        parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                            help="engine-core processes, each a full replica with its own KV cache; the API "
                                 "server sends each request to the least loaded")
        parser.add_argument("--engine-in-process", action="store_true",
                            help="debug: step the engine in a thread of the API server instead of its own process "
                                 "(it then shares the GIL with the event loop)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                           num_blocks=self.num_kv_blocks)

    def parallel_config(self) -> ParallelConfig:
        if self.quantization is not None and self.tensor_parallel_size != 1:
            raise ValueError("--quantization runs on one rank only; use --tensor-parallel-size 1")
        return ParallelConfig(tensor_parallel_size=self.tensor_parallel_size)

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        max_len = self.max_model_len or min(model_max_len, 8192)
        if max_len > model_max_len:
            raise ValueError(f"max_model_len {max_len} exceeds the model's context length {model_max_len}")
        return SchedulerConfig(policy=self.schedule, max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=max_len)
