"""LLMEngine: input processor + engine core + output processor. Synchronous, with two faces:

- the engine core's (add_core_request, abort_core_request, stop_core_requests, step_core): what an EngineLoop
  (engine/core_proc/core_loop.py) drives in an engine-core process or a thread. Values in, EngineCoreOutputs (the
  step's new token per request) out; no text, so the core's loop does only scheduling and the model.
- the offline one (add_request, step, abort_request): the same, plus the output processor in the caller's
  process, detokenizing those outputs into RequestOutputs (the offline LLM class, `servelab generate`).

Requests come in preprocessed (EngineCoreRequest) and state goes out as values (get_state), so nothing outside
reaches into the scheduler or the KV cache."""
from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from servelab.config import EngineConfig
from servelab.core.block_manager import BlockManager
from servelab.core.clock import WallClock
from servelab.core.engine_core import EngineCore, StepStats
from servelab.core.engine_io import EngineCoreOutput, EngineCoreRequest, EngineLimits
from servelab.core.request import Request, RequestStatus
from servelab.core.scheduler import Scheduler
from servelab.core.spec_decode.ngram import NgramProposer
from servelab.engine.core_proc.core_protocol import RequestDelta
from servelab.engine.input_processor import InputProcessor, child_requests
from servelab.engine.kv_handoff import KVEvents, KVHandoff
from servelab.engine.output_processor import OutputProcessor
from servelab.engine_args import EngineArgs
from servelab.executor.model_executor import ModelExecutor
from servelab.metrics.events import EngineState
from servelab.model.quant.auto_quantization import QuantizationChoice, resolve_quantization
from servelab.model.gguf_weights import gguf_file
from servelab.model.loader import DEFAULT_MODEL, load_model_config, resolve_dtype, resolve_model_path
from servelab.model.tokenizer import Tokenizer
from servelab.outputs import RequestOutput
from servelab.structured_output import StructuredOutputManager, ll_tokenizer

if TYPE_CHECKING:
    from servelab.kv_transfer.p2p_connector import P2PKVConnector


class LastStepStats:
    """The engine core's stats sink: the last step's StepStats."""

    __slots__ = ("stats",)

    def __init__(self) -> None:
        self.stats: StepStats | None = None

    def __call__(self, stats: StepStats) -> None:
        self.stats = stats


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, executor: ModelExecutor,
                 model_name: str, kv_connector: "P2PKVConnector | None" = None) -> None:
        self.config = config
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.executor = executor
        self._block_manager = BlockManager(executor.num_blocks, config.cache.block_size, enable_caching=(
            config.cache.enable_prefix_caching and not config.scheduler.contiguous))
        proposer = NgramProposer(config.speculative) if config.speculative is not None else None
        self._scheduler = Scheduler(config.scheduler, self._block_manager, proposer)
        self.eos_token_ids = tuple(sorted(set(tokenizer.eos_token_ids) | set(config.model.eos_token_ids)))
        eos_token_ids, vocab_size = self.eos_token_ids, config.model.vocab_size
        self.grammars = StructuredOutputManager(
            lambda: ll_tokenizer(tokenizer.to_json(), vocab_size, eos_token_ids), vocab_size)
        # Nothing the core holds points back at this engine: a cycle would keep the engine, weights included,
        # alive after its last user until a full garbage collection (tests/engine/test_engine_lifetime.py).
        self._step_stats = LastStepStats()
        self.core = EngineCore(self._scheduler, executor, WallClock(), stats_sink=self._step_stats,
                               grammars=self.grammars)
        self.limits = EngineLimits(config.scheduler.max_model_len, config.model.vocab_size, executor.num_blocks,
                                   config.cache.block_size)
        self.input_processor = InputProcessor(tokenizer, self.limits, self.eos_token_ids)
        self.output_processor = OutputProcessor(tokenizer, cumulative=True)  # the offline face's
        self._samples: dict[str, list[str]] = {}  # request id -> its engine-core requests' ids (n samples)
        self._request_of: dict[str, str] = {}  # engine-core request id -> its request's, until it finished
        self._ids = itertools.count()
        self.kv_role = config.kv_transfer.kv_role if config.kv_transfer is not None else ""
        # disaggregated prefill/decode: the KV connector's side of the engine (inert without a connector)
        self.kv_handoff = KVHandoff(kv_connector, self._scheduler, self._block_manager)
        # what --quantization (auto by default) resolved to, and why (from_engine_args sets it)
        self.quantization_choice = QuantizationChoice(None, config.cache.cache_dtype, "float weights")

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        choice = resolve_quantization(args)
        args = dataclasses.replace(args, quantization=choice.quantization, kv_cache_dtype=choice.kv_cache_dtype)
        folder = resolve_model_path(args.model)
        model_config = load_model_config(folder)
        dtype = resolve_dtype(args.dtype)
        cache = args.cache_config()
        sched = args.scheduler_config(model_config.max_position_embeddings)
        # EngineConfig checks the tensor-parallel size against the model's heads before any process starts.
        config = EngineConfig(model=model_config, cache=cache, scheduler=sched, parallel=args.parallel_config(),
                              dtype=str(dtype).removeprefix("torch."), kv_transfer=args.kv_transfer_config,
                              quantization=choice.quantization, speculative=args.speculative())
        tokenizer = Tokenizer.from_pretrained(folder)
        if config.parallel.tensor_parallel_size == 1:
            gguf_path = gguf_file(args.model) if args.quantization == "gguf" else None
            executor = ModelExecutor.from_pretrained(folder, model_config, cache, dtype, sched.max_model_len,
                                                     quantization=args.quantization, gguf_path=gguf_path)
        else:
            from servelab.executor.multiproc_executor import MultiprocExecutor

            executor = MultiprocExecutor.from_pretrained(folder, config, num_threads=args.num_threads)
        connector = None
        if config.kv_transfer is not None:
            from servelab.kv_transfer.p2p_connector import P2PKVConnector

            connector = P2PKVConnector.from_config(config.kv_transfer, executor.kv_caches)
        engine = cls(config, tokenizer, executor, Path(args.model).name if args.model else DEFAULT_MODEL, connector)
        engine.quantization_choice = choice
        return engine

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    # ---- offline: detokenized RequestOutputs, made here from the engine core's outputs
    def add_request(self, request: EngineCoreRequest) -> None:
        """Enqueue a request the input processor made (its n samples as n engine-core requests)."""
        self.output_processor.add_request(request, self.add_core_request(request))

    def step(self) -> list[RequestOutput]:
        """One step; the (cumulative) output of every request that moved."""
        return self._process(self.step_core())

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        return self._process(self.abort_core_request(request_id))

    def _process(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        processed = self.output_processor.process([RequestDelta.of(o) for o in outputs])
        if processed.stopped_request_ids:
            self.stop_core_requests(processed.stopped_request_ids)
        return processed.request_outputs

    # ---- the engine core's face: values in, EngineCoreOutputs out
    def add_core_request(self, request: EngineCoreRequest) -> list[EngineCoreRequest]:
        """Enqueue a request as its engine-core requests (one per sample), which it returns."""
        if request.request_id in self._samples:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        kv = request.kv_transfer
        if kv is not None and kv.do_remote_prefill:
            core_request = self.kv_handoff.add_remote_prefilled(request)
            if request.sampling_params.structured_outputs is not None:  # its matcher goes on from the first token
                self.grammars.add_request(core_request)
            children = [request]
        else:
            children = child_requests(request)
            for child in children:
                self.core.add_request(Request.from_engine_core_request(child))
        self._samples[request.request_id] = [c.request_id for c in children]
        self._request_of.update((c.request_id, request.request_id) for c in children)
        return children

    def step_core(self) -> list[EngineCoreOutput]:
        self._step_stats.stats = None  # stays None when the step had nothing to run
        return self._retire(self.core.step().outputs)

    def abort_core_request(self, request_id: str) -> list[EngineCoreOutput]:
        """Abort a request (all its samples); their final outputs (finish reason "abort")."""
        awaited = self.kv_handoff.take_awaited(request_id)
        if awaited is not None:  # its KV is still on the wire: the staging tensor is dropped when it lands
            awaited.status = RequestStatus.FINISHED_ABORTED
            awaited.times.finished = time.perf_counter()
            return self._retire([awaited.output([])])
        return self._retire(self.core.abort_requests(self._samples.get(request_id, [])))

    def stop_core_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Retire engine-core requests whose stop string the output processor matched (finish reason "stop");
        a finished prefill's held KV blocks are released."""
        outputs = self._retire(self.core.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED))
        for request_id in request_ids:  # a prefill whose first token hit a stop string
            self.kv_handoff.release(request_id)
        return outputs

    def _retire(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Forget the samples that finished (their request once all of them did)."""
        for out in outputs:
            if out.finish_reason is None:
                continue
            request_id = self._request_of.pop(out.request_id, None)
            if request_id is not None and not any(c in self._request_of for c in self._samples[request_id]):
                del self._samples[request_id]
        return outputs

    def poll_kv(self) -> KVEvents:
        """What the KV hand-off finished (see KVHandoff.poll); requests whose KV failed are forgotten here."""
        events = self.kv_handoff.poll()
        self._retire([request.output([]) for request, _ in events.failed])
        return events

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def failed_step_request_ids(self) -> tuple[str, ...]:
        """After step() raised: the requests of the step that failed (the others were not touched)."""
        return self.core.step_request_ids

    def get_state(self) -> EngineState:
        scheduler, blocks = self._scheduler, self._block_manager
        return EngineState(scheduler.num_running, scheduler.num_waiting, blocks.usage, blocks.num_blocks,
                           blocks.num_free_blocks, blocks.block_size, blocks.num_reserved_unused_slots(),
                           scheduler.max_num_seqs, scheduler.num_preemptions_total,
                           scheduler.prefix_cache_queries_total, scheduler.prefix_cache_hits_total,
                           scheduler.spec_num_drafts_total, scheduler.spec_num_draft_tokens_total,
                           scheduler.spec_num_accepted_tokens_total, tuple(scheduler.spec_num_accepted_tokens_per_pos))

    def check_invariants(self) -> None:
        """Raises AssertionError when the KV cache's bookkeeping is inconsistent (every block free or
        owned, none twice)."""
        self._block_manager.check_invariants()

    @property
    def last_step_stats(self) -> StepStats | None:
        return self._step_stats.stats

