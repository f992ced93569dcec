"""LLMEngine: input processor + engine core + output processor. Synchronous; the gateway drives it through
an EngineLoop (engine/core_loop.py) in an engine-core process or a thread, the offline LLM class from a
loop. Requests come in preprocessed (EngineCoreRequest) and state goes out as values (get_state), so
nothing outside reaches into the scheduler or the KV cache."""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from servelab.config import EngineConfig
from servelab.core.block_manager import BlockManager
from servelab.core.clock import WallClock
from servelab.core.engine_core import EngineCore, StepStats
from servelab.core.engine_io import EngineCoreRequest, EngineLimits
from servelab.core.request import Request, RequestStatus
from servelab.core.scheduler import Scheduler
from servelab.core.spec_decode.ngram import NgramProposer
from servelab.engine.input_processor import InputProcessor, child_requests
from servelab.engine.output_processor import OutputProcessor
from servelab.engine_args import EngineArgs
from servelab.executor.model_executor import ModelExecutor
from servelab.metrics.events import EngineState
from servelab.model.auto_quantization import QuantizationChoice, resolve_quantization
from servelab.model.gguf_weights import gguf_file
from servelab.model.loader import DEFAULT_MODEL, load_model_config, resolve_dtype, resolve_model_path
from servelab.model.tokenizer import Tokenizer
from servelab.outputs import RequestOutput
from servelab.structured_output import StructuredOutputManager, ll_tokenizer

if TYPE_CHECKING:
    from servelab.kv_transfer.p2p_connector import KVTransferDone, P2PKVConnector


@dataclass
class KVEvents:
    """What the KV connector finished since the last poll: transfers (both directions) and the decode
    requests whose KV could not arrive (failed, with the reason)."""
    transfers: list["KVTransferDone"]
    failed: list[tuple[str, str]]


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
        self.grammars = StructuredOutputManager(
            lambda: ll_tokenizer(tokenizer.to_json(), config.model.vocab_size, self.eos_token_ids),
            config.model.vocab_size)
        self.core = EngineCore(self._scheduler, executor, WallClock(), stats_sink=self._on_step_stats,
                               grammars=self.grammars)
        self.limits = EngineLimits(config.scheduler.max_model_len, config.model.vocab_size, executor.num_blocks,
                                   config.cache.block_size)
        self.input_processor = InputProcessor(tokenizer, self.limits, self.eos_token_ids)
        self.output_processor = OutputProcessor(tokenizer)
        self.last_step_stats: StepStats | None = None
        self._ids = itertools.count()
        self.kv_connector = kv_connector
        self.kv_role = config.kv_transfer.kv_role if config.kv_transfer is not None else ""
        self._kv_awaited: dict[int, Request] = {}  # decode side: transfer tag -> request whose KV is on its way
        self._kv_arrived: list[tuple[Request, torch.Tensor]] = []  # received, waiting for free blocks
        self._kv_sending: set[str] = set()  # prefill side: held blocks on the wire
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
                              speculative=args.speculative(), quantization=choice.quantization)
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

    def add_request(self, request: EngineCoreRequest) -> None:
        """Enqueue a request the input processor made (its n samples as n engine-core requests)."""
        kv = request.kv_transfer
        if kv is not None and kv.do_remote_prefill:
            self._add_remote_prefilled(request, kv)
            return
        if self.output_processor.has(request.request_id):
            raise ValueError(f"duplicate request id {request.request_id!r}")
        children = child_requests(request)
        for child in children:
            self.core.add_request(Request.from_engine_core_request(child))
        self.output_processor.add_request(request, children)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        awaited = self._take_awaited(request_id)
        if awaited is not None:  # its KV is still on the wire: the staging tensor is dropped when it lands
            awaited.status = RequestStatus.FINISHED_ABORTED
            awaited.times.finished = time.perf_counter()
            return self.output_processor.process([awaited.output([])]).request_outputs
        core_outputs = self.core.abort_requests(self.output_processor.child_ids(request_id))
        return self.output_processor.process(core_outputs).request_outputs

    # ---- disaggregated prefill/decode (the engine's side of the KV connector)
    def send_kv(self, request_id: str, dst: int, tag: int) -> bool:
        """Send a finished prefill's held KV blocks to engine rank dst; they are freed once sent.
        False when none are held (released already: the request was aborted)."""
        if request_id not in self._scheduler.kv_held_ids or request_id in self._kv_sending:
            return False
        self._kv_sending.add(request_id)
        self.kv_connector.start_send(request_id, tag, dst, self._block_manager.get_block_table(request_id))
        return True

    def release_kv(self, request_id: str) -> None:
        """A finished prefill's held blocks are not needed (an abort, or a stop string matched its first
        token); blocks on the wire are freed when the send ends instead."""
        if request_id not in self._kv_sending:
            self._scheduler.release_kv(request_id)

    def shutdown_kv(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def has_pending_kv(self) -> bool:
        return bool(self._kv_arrived) or (self.kv_connector is not None and self.kv_connector.num_pending > 0)

    def poll_kv(self) -> KVEvents:
        """Finish what the connector finished: free sent blocks, admit requests whose KV arrived (their
        blocks are allocated and written now, before any step can read them)."""
        events = KVEvents([], [])
        if self.kv_connector is None:
            return events
        for done in self.kv_connector.poll():
            events.transfers.append(done)
            if done.is_send:
                self._kv_sending.discard(done.request_id)
                self._scheduler.release_kv(done.request_id)
                continue
            request = self._kv_awaited.pop(done.tag, None)
            if request is None:  # aborted (or refused) while on the wire
                continue
            if done.ok:
                self._kv_arrived.append((request, done.staging))
            else:
                request.status = RequestStatus.FINISHED_ABORTED
                self.output_processor.process([request.output([])])  # forgets it; the caller fails it
                events.failed.append((request.request_id, f"its KV did not arrive: {done.error}"))
        while self._kv_arrived:
            request, staging = self._kv_arrived[0]
            block_ids = self._scheduler.add_prefilled(request)
            if block_ids is None:
                break
            self._kv_arrived.pop(0)
            self.kv_connector.write_blocks(staging, block_ids)
        return events

    def _add_remote_prefilled(self, request: EngineCoreRequest, kv) -> None:
        """A decode instance's request: its first token came from the prefill instance, its prompt's KV is
        on its way (the receive is posted first, so the sender is never left waiting, whatever follows)."""
        if self.kv_connector is None:
            raise ValueError("this engine is not part of a disaggregated deployment")
        num_blocks = self._block_manager.num_blocks_for(len(request.prompt_token_ids))
        self.kv_connector.start_recv(request.request_id, kv.tag, kv.remote_engine, num_blocks)
        if self.output_processor.has(request.request_id) or request.request_id in self._scheduler.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.sampling_params.n != 1:
            raise ValueError("a remote-prefilled request has one sample")
        core_request = Request.from_engine_core_request(request)
        core_request.output_token_ids.append(kv.first_token.token_id)
        core_request.num_computed_tokens = len(request.prompt_token_ids)
        times = core_request.times
        times.first_scheduled, times.first_token = kv.first_scheduled_time, kv.first_token_time
        if kv.first_token_time is not None:
            times.token_times.append(kv.first_token_time)
        self.output_processor.add_request(request, [request])
        self.output_processor.process([core_request.output([kv.first_token])])  # text and stop-string state so far
        if request.sampling_params.structured_outputs is not None:  # its matcher goes on from the first token
            self.grammars.add_request(core_request)
        self._kv_awaited[kv.tag] = core_request

    def _take_awaited(self, request_id: str) -> Request | None:
        for tag, request in self._kv_awaited.items():
            if request.request_id == request_id:
                return self._kv_awaited.pop(tag)
        for index, (request, _) in enumerate(self._kv_arrived):
            if request.request_id == request_id:
                return self._kv_arrived.pop(index)[0]
        return None

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        self.last_step_stats = None  # stays None when the step had nothing to run
        step = self.core.step()
        processed = self.output_processor.process(step.outputs)
        if processed.stopped_request_ids:
            self.core.finish_requests(processed.stopped_request_ids, RequestStatus.FINISHED_STOPPED)
            for request_id in processed.stopped_request_ids:  # a prefill whose first token hit a stop string
                self.release_kv(request_id)
        return processed.request_outputs

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

    def _on_step_stats(self, stats: StepStats) -> None:
        self.last_step_stats = stats

