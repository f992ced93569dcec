"""LLMEngine: tokenizer + engine core + output processor. Synchronous; the gateway drives it from
a background thread, the offline LLM class from a loop."""
from __future__ import annotations

import itertools
import time
from pathlib import Path

import torch

from servelab.config import EngineConfig
from servelab.core.block_manager import BlockManager
from servelab.core.clock import WallClock
from servelab.core.engine import EngineCore, StepStats
from servelab.core.request import Request
from servelab.core.scheduler import Scheduler
from servelab.engine_args import EngineArgs
from servelab.executor.model_executor import ModelExecutor
from servelab.model.loader import DEFAULT_MODEL, load_model_config, resolve_dtype, resolve_model_path
from servelab.model.tokenizer import Tokenizer
from servelab.engine.output_processor import OutputProcessor
from servelab.outputs import RequestOutput
from servelab.sampling_params import SamplingParams

PromptType = str | dict | list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, executor: ModelExecutor,
                 model_name: str) -> None:
        self.config = config
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.executor = executor
        self.block_manager = BlockManager(executor.num_blocks, config.cache.block_size)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.core = EngineCore(self.scheduler, executor, WallClock())
        self.output_processor = OutputProcessor(tokenizer, self.core.finish_stopped)
        self.eos_token_ids = tuple(sorted(set(tokenizer.eos_token_ids) | set(config.model.eos_token_ids)))
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
            executor = ModelExecutor.from_pretrained(folder, model_config, cache, dtype, sched.max_model_len)
        else:
            from servelab.executor.multiproc_executor import MultiprocExecutor

            executor = MultiprocExecutor.from_pretrained(folder, config, num_threads=args.num_threads)
        return cls(config, tokenizer, executor, Path(args.model).name if args.model else DEFAULT_MODEL)

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def encode_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list):
            return None, list(prompt)
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a string, a token id list or a dict, not {type(prompt).__name__}")
        return prompt, self.tokenizer.encode(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request before it enters the engine; returns its effective max_tokens."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        vocab = self.config.model.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(f"the prompt is {n} tokens but the model's context length is {self.max_model_len} "
                             "(the prompt plus at least one generated token must fit)")
        room = self.max_model_len - n
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Validate and enqueue; raises ValueError for bad input and leaves the engine untouched."""
        if self.output_processor.has(request_id):
            raise ValueError(f"duplicate request id {request_id!r}")
        text, token_ids = self.encode_prompt(prompt)
        max_tokens = self.validate(token_ids, params)
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        children = [
            Request(request_id if params.n == 1 else f"{i}_{request_id}", token_ids, params.for_child(i),
                    max_tokens, self.eos_token_ids, arrival)
            for i in range(params.n)
        ]
        for child in children:
            self.scheduler.check_fits(child)
        for child in children:
            self.core.add_request(child)
        self.output_processor.add_request(request_id, text, children)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        core_outputs = self.core.abort_requests(self.output_processor.child_ids(request_id))
        return self.output_processor.process(core_outputs)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        step = self.core.step()
        self.last_step_stats = step.stats  # None when the step had nothing to run
        return self.output_processor.process(step.outputs)

