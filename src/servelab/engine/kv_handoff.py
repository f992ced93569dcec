"""Disaggregated prefill/decode in one place.

The API server's values: the request a prefill core runs (its first token only, its KV held afterwards) and the
request a decode core gets once that token is out (the token, the times it was scheduled and sampled, and which
core sends the KV under which tag). The engine core's side: KVHandoff, the component beside the engine that
holds, sends, receives and admits KV blocks through the KV connector (servelab/kv_transfer/p2p_connector.py)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from servelab.core.block_manager import BlockManager
from servelab.core.engine_io import EngineCoreRequest, KVTransferParams
from servelab.core.plan import SampledToken
from servelab.core.request import Request, RequestStatus
from servelab.core.scheduler import Scheduler
from servelab.engine.core_proc.core_protocol import RequestDelta

if TYPE_CHECKING:
    import torch

    from servelab.kv_transfer.p2p_connector import KVTransferDone, P2PKVConnector


def prefill_request(request: EngineCoreRequest) -> tuple[EngineCoreRequest, EngineCoreRequest | None]:
    """(what the prefill core runs, what a decode core will get; None when the first token is all of it)."""
    if request.max_tokens <= 1:
        return request, None
    return replace(request, max_tokens=1, kv_transfer=KVTransferParams(do_remote_decode=True)), request


def decode_request(request: EngineCoreRequest, prefilled: RequestDelta, prefill_index: int,
                   tag: int) -> EngineCoreRequest:
    """The decode core's request once the prefill core's request ended with its first token (`prefilled`, the
    prefill's deltas): that token, the times it was scheduled and sampled, and which core sends the KV under
    which tag."""
    logprob = prefilled.new_logprobs[0] if prefilled.new_logprobs else None
    first = SampledToken(prefilled.new_token_ids[0], logprob.logprob if logprob else None,
                         logprob.top_logprobs if logprob else None)
    times = prefilled.times
    params = KVTransferParams(do_remote_prefill=True, remote_engine=prefill_index, tag=tag, first_token=first,
                              first_scheduled_time=times.first_scheduled, first_token_time=times.first_token)
    return replace(request, kv_transfer=params)


@dataclass
class KVEvents:
    """What the KV connector finished since the last poll: transfers (both directions) and the decode
    requests whose KV could not arrive (failed: finished as aborted, with the reason)."""
    transfers: list["KVTransferDone"]
    failed: list[tuple[Request, str]]


class KVHandoff:
    """Disaggregated prefill/decode, the engine core's side of the KV connector: one component beside the
    engine (LLMEngine holds one; without a connector it holds nothing and does nothing).

    Prefill side: a request whose first token is out keeps its blocks (Scheduler.kv_held_ids) until `send`
    has moved them to a decode instance, or `release` drops them. Decode side: `add_remote_prefilled` posts
    the receive of a request's prompt KV; once it arrives, `poll` admits the request with its blocks written
    (num_computed_tokens = prompt length), and the scheduler takes it from there as any request."""

    def __init__(self, connector: "P2PKVConnector | None", scheduler: Scheduler, block_manager: BlockManager) -> None:
        self.connector = connector
        self._scheduler = scheduler
        self._block_manager = block_manager
        self._awaited: dict[int, Request] = {}  # decode side: transfer tag -> request whose KV is on its way
        self._arrived: list[tuple[Request, "torch.Tensor"]] = []  # received, waiting for free blocks
        self._sending: set[str] = set()  # prefill side: held blocks on the wire

    def send(self, request_id: str, dst: int, tag: int) -> bool:
        """Send a finished prefill's held KV blocks to engine rank dst; they are freed once sent.
        False when none are held (released already: the request was aborted)."""
        if request_id not in self._scheduler.kv_held_ids or request_id in self._sending:
            return False
        self._sending.add(request_id)
        self.connector.start_send(request_id, tag, dst, self._block_manager.get_block_table(request_id))
        return True

    def release(self, request_id: str) -> None:
        """A finished prefill's held blocks are not needed (an abort, or a stop string matched its first
        token); blocks on the wire are freed when the send ends instead."""
        if request_id not in self._sending:
            self._scheduler.release_kv(request_id)

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()

    def has_pending(self) -> bool:
        """Transfers on the wire, or received KV waiting for blocks: poll again soon even when idle."""
        return bool(self._arrived) or (self.connector is not None and self.connector.num_pending > 0)

    def poll(self) -> KVEvents:
        """Finish what the connector finished: free sent blocks, admit requests whose KV arrived (their
        blocks are allocated and written now, before any step can read them)."""
        events = KVEvents([], [])
        if self.connector is None:
            return events
        for done in self.connector.poll():
            events.transfers.append(done)
            if done.is_send:
                self._sending.discard(done.request_id)
                self._scheduler.release_kv(done.request_id)
                continue
            request = self._awaited.pop(done.tag, None)
            if request is None:  # aborted (or refused) while on the wire
                continue
            if done.ok:
                self._arrived.append((request, done.staging))
            else:
                request.status = RequestStatus.FINISHED_ABORTED
                events.failed.append((request, f"its KV did not arrive: {done.error}"))
        while self._arrived:
            request, staging = self._arrived[0]
            block_ids = self._scheduler.add_prefilled(request)
            if block_ids is None:
                break
            self._arrived.pop(0)
            self.connector.write_blocks(staging, block_ids)
        return events

    def add_remote_prefilled(self, request: EngineCoreRequest) -> Request:
        """A decode instance's request: its first token came from the prefill instance, its prompt's KV is
        on its way (the receive is posted first, so the sender is never left waiting, whatever follows).
        Returns the core's request, admitted once its KV arrived."""
        kv = request.kv_transfer
        if self.connector is None:
            raise ValueError("this engine is not part of a disaggregated deployment")
        num_blocks = self._block_manager.num_blocks_for(len(request.prompt_token_ids))
        self.connector.start_recv(request.request_id, kv.tag, kv.remote_engine, num_blocks)
        if request.request_id in self._scheduler.requests:
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
        self._awaited[kv.tag] = core_request
        return core_request

    def take_awaited(self, request_id: str) -> Request | None:
        """A decode-side request whose KV has not been admitted yet, no longer awaited (it is being aborted;
        its staging tensor is dropped when it lands)."""
        for tag, request in self._awaited.items():
            if request.request_id == request_id:
                return self._awaited.pop(tag)
        for index, (request, _) in enumerate(self._arrived):
            if request.request_id == request_id:
                return self._arrived.pop(index)[0]
        return None
