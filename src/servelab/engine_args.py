"""Engine options shared by the Python API (LLM(...)) and every CLI command, with vLLM's names."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from servelab.config import (KV_CACHE_DTYPES, QUANTIZATION_CHOICES, SCHEDULE_POLICIES, CacheConfig, KVTransferConfig, ParallelConfig,
                             SchedulerConfig, SpeculativeConfig)


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
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    num_threads: int | None = None
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # QUANTIZATION_CHOICES; None is "none" (float weights in dtype). "auto" is resolved when the engine loads.
    quantization: str | None = "auto"
    # vLLM's --speculative-config: a JSON string (the CLI), a dict (LLM(...)) or a SpeculativeConfig
    speculative_config: str | dict | SpeculativeConfig | None = None
    # `servelab serve` only: engine-core processes behind the API server, or one engine in a thread of it
    data_parallel_size: int = 1
    engine_in_process: bool = False
    # `servelab serve` only: "P:D" prefill and decode instances (the lab's flag)
    disaggregate: str | None = None
    # one instance's role in a disaggregated deployment (set per engine core by the launcher)
    kv_transfer_config: KVTransferConfig | None = None
    headless: bool = False

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
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                            help="reuse the KV of full blocks that earlier requests computed for the same "
                                 "prefix (continuous schedule; --no-enable-prefix-caching turns it off)")
        parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                            help="auto = K and V in the model's dtype (int8 where --quantization auto picks it); "
                                 "int8 = one byte per value with an fp32 "
                                 "scale per token and KV head: half of bf16's bytes per token (twice the blocks "
                                 "in --kv-cache-memory, half the bytes a decode step's attention reads)")
        parser.add_argument("--num-threads", type=int, default=None,
                            help="torch CPU threads per process (default: the cores, shared among the TP ranks)")
        parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                            help="shard the model over this many worker processes (torch.distributed); "
                                 "it must split the attention heads evenly")
        g = parser.add_argument_group("multi-node (torch.distributed rendezvous)")
        g.add_argument("--nnodes", type=int, default=1,
                       help="machines the tensor-parallel ranks are spread over, tensor-parallel-size / nnodes each")
        g.add_argument("--node-rank", type=int, default=0,
                       help="this machine's index: 0 runs the engine core and hosts the rendezvous store, "
                            "the others run `servelab serve --headless`")
        g.add_argument("--master-addr", default="127.0.0.1",
                       help="address of node 0 that every rank connects to (node 0 listens on it)")
        g.add_argument("--master-port", type=int, default=None,
                       help="port of node 0's rendezvous store; required with --nnodes > 1 "
                            "(default: any free port, for one node)")
        parser.add_argument("--quantization", "-q", default="auto", choices=QUANTIZATION_CHOICES,
                            help="auto (default) = the fastest mode measured within the perplexity gate for this "
                                 "model and machine (the default model: int8 with an int8 KV cache; a Hugging Face "
                                 "folder or an explicit --dtype: float weights); none = float weights "
                                 "(--dtype); gguf = run the .gguf file's own quantized blocks (Q8_0, Q4_0, Q4_1, "
                                 "Q4_K) without de-quantizing them; int8 = W8A8 dynamic (int8 weights per channel, "
                                 "activations per token), SmoothQuant-calibrated once and cached")

        parser.add_argument("--speculative-config", default=None, metavar="JSON",
                            help='speculative decoding, as vLLM\'s: {"method": "ngram", "num_speculative_tokens": K, '
                                 '"prompt_lookup_max": N, "prompt_lookup_min": M} proposes up to K tokens by prompt '
                                 "lookup for each greedy request and verifies them in the same batched step")

    @staticmethod
    def add_process_cli_args(parser: argparse.ArgumentParser) -> None:
        """Where the engine runs (servelab serve)."""
        parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                            help="engine-core processes, each a full replica with its own KV cache; the API "
                                 "server sends each request to the least loaded")
        parser.add_argument("--disaggregate", default=None, metavar="P:D",
                            help="P prefill and D decode engine cores: a request is prefilled on one, its KV "
                                 "blocks are sent to the other (torch.distributed send/recv), which decodes")
        parser.add_argument("--engine-in-process", action="store_true",
                            help="debug: step the engine in a thread of the API server instead of its own process "
                                 "(it then shares the GIL with the event loop)")
        parser.add_argument("--headless", action="store_true",
                            help="run only this node's tensor-parallel worker ranks, no API server or engine core "
                                 "(nodes with --node-rank > 0)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def speculative(self) -> SpeculativeConfig | None:
        value = self.speculative_config
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, dict):
            import json
            value = json.dumps(value)
        return SpeculativeConfig.from_json(value)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                           num_blocks=self.num_kv_blocks, enable_prefix_caching=self.enable_prefix_caching,
                           cache_dtype=self.kv_cache_dtype)

    def parallel_config(self) -> ParallelConfig:
        if self.quantization == "gguf" and self.tensor_parallel_size != 1:
            raise ValueError("--quantization gguf runs on one rank only; use --tensor-parallel-size 1, or "
                             "--quantization int8, which runs at every tensor-parallel size")
        return ParallelConfig(tensor_parallel_size=self.tensor_parallel_size, nnodes=self.nnodes,
                              node_rank=self.node_rank, master_addr=self.master_addr, master_port=self.master_port)

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        max_len = self.max_model_len or min(model_max_len, 8192)
        if max_len > model_max_len:
            raise ValueError(f"max_model_len {max_len} exceeds the model's context length {model_max_len}")
        return SchedulerConfig(policy=self.schedule, max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=max_len)
