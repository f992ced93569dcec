"""LLMEngine: input processor + engine core + output processor. Synchronous; the gateway drives it through
an EngineLoop (engine/core_loop.py) in an engine-core process or a thread, the offline LLM class from a
loop. Requests come in preprocessed (EngineCoreRequest) and state goes out as values (get_state), so
nothing outside reaches into the scheduler or the KV cache."""
from __future__ import annotations

import itertools
from pathlib import Path

import torch

from servelab.config import EngineConfig
from servelab.core.block_manager import BlockManager
from servelab.core.clock import WallClock
from servelab.core.engine import EngineCore, StepStats
from servelab.core.messages import EngineCoreRequest, EngineLimits
from servelab.core.request import Request, RequestStatus
from servelab.core.scheduler import Scheduler
from servelab.engine.input_processor import InputProcessor, child_requests
from servelab.engine.output_processor import OutputProcessor
from servelab.engine_args import EngineArgs
from servelab.executor.model_executor import ModelExecutor
from servelab.metrics.events import EngineState
from servelab.model.gguf_weights import gguf_file
from servelab.model.loader import DEFAULT_MODEL, load_model_config, resolve_dtype, resolve_model_path
from servelab.model.tokenizer import Tokenizer
from servelab.outputs import RequestOutput


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, executor: ModelExecutor,
                 model_name: str) -> None:
        self.config = config
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.executor = executor
        self._block_manager = BlockManager(executor.num_blocks, config.cache.block_size)
        self._scheduler = Scheduler(config.scheduler, self._block_manager)
        self.core = EngineCore(self._scheduler, executor, WallClock(), stats_sink=self._on_step_stats)
        self.limits = EngineLimits(config.scheduler.max_model_len, config.model.vocab_size, executor.num_blocks,
                                   config.cache.block_size)
        self.eos_token_ids = tuple(sorted(set(tokenizer.eos_token_ids) | set(config.model.eos_token_ids)))
        self.input_processor = InputProcessor(tokenizer, self.limits, self.eos_token_ids)
        self.output_processor = OutputProcessor(tokenizer)
        self.last_step_stats: StepStats | None = None
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        folder = resolve_model_path(args.model)
        model_config = load_model_config(folder)
        dtype = resolve_dtype(args.dtype)
        cache = args.cache_config()
        sched = args.scheduler_config(model_config.max_position_embeddings)
        # EngineConfig checks the tensor-parallel size against the model's heads before any process starts.
        config = EngineConfig(model=model_config, cache=cache, scheduler=sched, parallel=args.parallel_config(),
                              dtype=str(dtype).removeprefix("torch."))
        tokenizer = Tokenizer.from_pretrained(folder)
        if config.parallel.tensor_parallel_size == 1:
            gguf_path = gguf_file(args.model) if args.quantization == "gguf" else None
            executor = ModelExecutor.from_pretrained(folder, model_config, cache, dtype, sched.max_model_len,
                                                     quantization=args.quantization, gguf_path=gguf_path)
        else:
            from servelab.executor.multiproc_executor import MultiprocExecutor

            executor = MultiprocExecutor.from_pretrained(folder, config, num_threads=args.num_threads)
        return cls(config, tokenizer, executor, Path(args.model).name if args.model else DEFAULT_MODEL)

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(self, request: EngineCoreRequest) -> None:
        """Enqueue a request the input processor made (its n samples as n engine-core requests)."""
        if self.output_processor.has(request.request_id):
            raise ValueError(f"duplicate request id {request.request_id!r}")
        children = child_requests(request)
        for child in children:
            self.core.add_request(Request.from_engine_core_request(child))
        self.output_processor.add_request(request, children)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        core_outputs = self.core.abort_requests(self.output_processor.child_ids(request_id))
        return self.output_processor.process(core_outputs).request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        self.last_step_stats = None  # stays None when the step had nothing to run
        step = self.core.step()
        processed = self.output_processor.process(step.outputs)
        if processed.stopped_request_ids:
            self.core.finish_requests(processed.stopped_request_ids, RequestStatus.FINISHED_STOPPED)
        return processed.request_outputs

    def get_state(self) -> EngineState:
        scheduler, blocks = self._scheduler, self._block_manager
        return EngineState(scheduler.num_running, scheduler.num_waiting, blocks.usage, blocks.num_blocks,
                           blocks.num_free_blocks, blocks.block_size, blocks.num_reserved_unused_slots(),
                           scheduler.max_num_seqs, scheduler.num_preemptions_total)

    def check_invariants(self) -> None:
        """Raises AssertionError when the KV cache's bookkeeping is inconsistent (every block free or
        owned, none twice)."""
        self._block_manager.check_invariants()

    def _on_step_stats(self, stats: StepStats) -> None:
        self.last_step_stats = stats

