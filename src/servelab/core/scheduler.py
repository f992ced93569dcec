"""Token-budget scheduler: who runs each step and how many of their tokens.

One rule for every stage: each request has num_tokens and num_computed_tokens, and each step hands
out a token budget so computed catches up with total. A prefill chunk, a decode step, recompute
after preemption and a request admitted with its KV already present are all this rule.
Speculative decoding is too: with a proposer, a decoding greedy request is given 1 + len(drafts) tokens
(its last sampled token and the proposer's drafts, within the budget and its max_tokens); after the step,
num_computed_tokens counts only the drafts the executor accepted, and the blocks that held nothing but
rejected drafts go back to the pool.
Stages differ only in admission and KV allocation (see SchedulerConfig.policy). With prefix caching
(stages 3+), a request starts at num_computed_tokens = the tokens of its longest cached prefix, and
every full block it computes is cached for the requests after it.

Multi-step decode runs (core/decode_runs/planner.py) are composed around the scheduler, not part of it: the
planner reads the public queues and block manager and changes them only through admit() and
finish_request(). The scheduler keeps no state of theirs and calls none of their code; its one
concession is admit(), the part of schedule() after the running requests.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable

from servelab.config import SchedulerConfig
from servelab.core.block_hash import cache_computed_blocks, request_block_hashes
from servelab.core.block_manager import BlockManager
from servelab.core.plan import SampledToken, ScheduledRequest, StepPlan, StepResult
from servelab.core.request import Request, RequestStatus
from servelab.core.spec_decode import Proposer


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, proposer: Proposer | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.proposer = proposer
        # vLLM's speculative-decoding counters: requests that verified drafts (once per step), draft tokens,
        # accepted drafts, and accepted drafts by their position in the draft.
        self.spec_num_drafts_total = 0
        self.spec_num_draft_tokens_total = 0
        self.spec_num_accepted_tokens_total = 0
        self.spec_num_accepted_tokens_per_pos = [0] * (proposer.num_speculative_tokens if proposer else 0)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._known_to_executor: set[str] = set()
        self._finished_ids: list[str] = []
        # finished prefills (disaggregated) whose KV blocks wait to be sent to a decode instance
        self.kv_held_ids: set[str] = set()
        self.num_preemptions_total = 0
        # vLLM's prefix-cache counters, in tokens, over first admissions (not readmissions after preemption):
        # the prompt tokens looked up, and those found cached.
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0
        self.max_num_seqs = config.effective_max_num_seqs
        self.contiguous = config.contiguous
        # Without mixed batches, decode steps come in scheduling passes of this many (multi-step
        # scheduling); _pass_step counts those taken in the current pass, 0 between passes.
        self.pass_length = 1 if config.mixed_batches else config.num_scheduler_steps
        self._pass_step = 0

    # ---- intake
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        bm = self.block_manager
        # A guard against misuse: the input processor turns such requests away with the user-facing error.
        if bm.num_blocks_for(request.max_total_tokens) > bm.num_blocks:
            raise ValueError(f"request {request.request_id!r} needs {request.max_total_tokens} tokens of KV cache; "
                             f"the whole cache holds {bm.num_blocks * bm.block_size}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.finished:
                self.finish_request(request, RequestStatus.FINISHED_ABORTED)
                aborted.append(request)
        return aborted

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Retire a request for any reason; its blocks go back to the pool at once."""
        index = self._running_index(request)
        if index is not None:
            del self.running[index]
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        request.status = status
        kv = request.kv_transfer
        if status is RequestStatus.FINISHED_LENGTH and kv is not None and kv.do_remote_decode:
            self.kv_held_ids.add(request.request_id)  # vLLM's delay_free_blocks: freed by release_kv
        else:
            self.block_manager.free(request.request_id)
        self.requests.pop(request.request_id, None)
        if self.proposer is not None:
            self.proposer.drop(request.request_id)
        if request.request_id in self._known_to_executor:
            self._known_to_executor.discard(request.request_id)
            self._finished_ids.append(request.request_id)

    def release_kv(self, request_id: str) -> bool:
        """Free a finished prefill's held KV blocks (sent, or not needed any more); False when none are held."""
        if request_id not in self.kv_held_ids:
            return False
        self.kv_held_ids.discard(request_id)
        self.block_manager.free(request_id)
        return True

    def add_prefilled(self, request: Request) -> list[int] | None:
        """Admit a request whose first request.num_computed_tokens tokens of KV were computed elsewhere
        (a decode instance): blocks for them are allocated now, for the caller to write the KV into, and
        returned; None (nothing allocated) while the pool is too short. It then waits as any request
        does, with only its last token left to compute."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        block_ids = self.block_manager.allocate_slots(request.request_id, request.num_computed_tokens)
        if block_ids is None:
            return None
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        return block_ids

    def _running_index(self, request: Request) -> int | None:
        try:
            return self.running.index(request)
        except ValueError:
            return None

    # ---- state
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step
    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens

        if self.contiguous:
            if not self.running:
                self._admit_static_batch(now)
        elif (not self.config.mixed_batches and self.waiting and self.between_passes()
              and not self._continues_prefill()):
            self._admit_continuous(plan, budget, now)  # a prefill step of its own; the decodes wait
            if plan.scheduled:
                self._pass_step = 0
                return plan
        budget = self._schedule_running(plan, budget, now)
        if not self.contiguous and not plan.preempted_request_ids and self.config.mixed_batches:
            self._admit_continuous(plan, budget, now)
        if plan.scheduled:
            self.note_decode_steps(1)
        return plan

    def between_passes(self) -> bool:
        """Whether the next step starts a scheduling pass (one may admit waiting prompts)."""
        return self._pass_step == 0 or not self.running

    def steps_to_pass_end(self) -> int:
        """Decode steps left in the current pass, or in the one the next step starts."""
        return self.pass_length - self._pass_step

    def note_decode_steps(self, num_steps: int) -> None:
        """Count decode steps taken (here or by a decode run) towards the scheduling pass."""
        if self.pass_length > 1:
            self._pass_step = (self._pass_step + num_steps) % self.pass_length

    def _continues_prefill(self) -> bool:
        """A running request has prompt tokens left (its prompt alone outgrew the budget): finish it first."""
        return any(r.num_computed_tokens < len(r.prompt_token_ids) for r in self.running)

    def admit(self, now: float, budget: int) -> StepPlan:
        """The rest of a step whose running requests were all planned elsewhere, by a decode run
        (core/decode_runs/planner.py): the ids finished since the last plan, and the waiting requests admitted
        into budget tokens, as schedule() admits them after the running ones (stages 3+ with mixed
        batches only: without, admissions take a step of their own, which a decode run never is)."""
        plan = StepPlan(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        if not self.contiguous and self.config.mixed_batches:
            self._admit_continuous(plan, budget, now)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int, now: float) -> int:
        running = self.running
        allocate = None if self.contiguous else self.block_manager.allocate_slots  # reserved at admission
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            computed = request.num_computed_tokens
            num_new = len(request.prompt_token_ids) + len(request.output_token_ids) - computed
            if num_new > budget:
                num_new = budget
            drafts = self._drafts(request, budget) if num_new == 1 and self.proposer is not None else None
            if drafts and allocate is not None and allocate(request.request_id, computed + 1 + len(drafts)) is None:
                drafts = None  # no room for them: decode one token
            if drafts:
                num_new += len(drafts)
            elif (allocate is not None and allocate(request.request_id, computed + num_new) is None
                    and not self._preempt_until_allocated(request, num_new, plan)):
                break
            self._add_to_plan(plan, request, num_new, now, drafts)
            budget -= num_new
            index += 1
        return budget

    def _drafts(self, request: Request, budget: int) -> list[int] | None:
        """The proposer's drafts for a request about to compute its last sampled token: greedy requests
        only (sampled ones would need rejection sampling), at most budget - 1 of them, and no more than
        its max_tokens leave room for (all accepted, a step gives 1 + len(drafts) tokens)."""
        output, params = request.output_token_ids, request.sampling_params
        if not output or not params.greedy or params.structured_outputs is not None:  # a grammar: one token at a time
            return None
        room = min(budget - 1, request.max_tokens - len(output) - 1)
        return self.proposer.propose(request, room) if room > 0 else None  # type: ignore[union-attr]

    def _preempt_until_allocated(self, request: Request, num_new: int, plan: StepPlan) -> bool:
        """Make room for request's next num_new tokens, preempting from the back of the running
        queue (latest admitted first). False when the request itself had to be preempted."""
        while True:
            victim = self.running.pop()
            self._preempt(victim, plan)
            if victim is request:
                return False
            if self.block_manager.allocate_slots(request.request_id, request.num_computed_tokens + num_new) is not None:
                return True

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)
        if request.request_id in self._known_to_executor:
            self._known_to_executor.discard(request.request_id)
            plan.preempted_request_ids.append(request.request_id)

    def computed_blocks(self, request: Request) -> list[int]:
        """The cached blocks a waiting request would start from if admitted now: its longest cached
        prefix, short of its last token (always computed, for logits to sample from). Empty unless
        caching is on, the request takes part, and none of its KV is present (a request whose KV arrived
        from another instance starts where that KV ends)."""
        bm = self.block_manager
        if not (bm.enable_caching and request.cache_prefix) or request.num_computed_tokens:
            return []
        num_blocks = (request.num_tokens - 1) // bm.block_size
        return bm.get_computed_blocks(request_block_hashes(request, bm.block_size, num_blocks)[:num_blocks])

    def _admit_continuous(self, plan: StepPlan, budget: int, now: float) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            computed_ids = self.computed_blocks(request) if bm.enable_caching else ()
            computed = request.num_computed_tokens + len(computed_ids) * bm.block_size
            num_new = request.num_tokens - computed
            if budget < num_new:
                num_new = budget
            if num_new < request.num_tokens - computed and plan.scheduled and not self.config.mixed_batches:
                break  # without mixed batches a prompt is split only when it alone exceeds the budget
            if bm.allocate_slots(request.request_id, computed + num_new, computed_ids) is None:
                break
            if request.cache_prefix and bm.enable_caching and not request.num_computed_tokens:
                request.num_computed_tokens = computed
                if not request.num_preemptions:
                    self.prefix_cache_queries_total += request.num_tokens
                    self.prefix_cache_hits_total += computed
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_to_plan(plan, request, num_new, now)
            budget -= num_new

    def _admit_static_batch(self, now: float) -> None:
        """Stages 1-2: a batch forms only when the device is idle; each member reserves
        prompt + max_tokens contiguously, so nobody can run out of KV mid-flight."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self.block_manager.reserve_contiguous(request.request_id, request.max_total_tokens) is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _add_to_plan(self, plan: StepPlan, request: Request, num_new: int, now: float,
                     drafts: list[int] | None = None) -> None:
        request_id = request.request_id
        start = request.num_computed_tokens
        end = start + num_new
        new_to_executor = request_id not in self._known_to_executor
        if new_to_executor:
            self._known_to_executor.add(request_id)
        if request.times.first_scheduled is None:
            request.times.first_scheduled = now
        num_prompt = len(request.prompt_token_ids)
        num_spec = 0
        if drafts:
            num_spec = len(drafts)
            end -= num_spec
            token_ids = [request.output_token_ids[-1], *drafts]
        elif start >= num_prompt:
            token_ids = request.output_token_ids[start - num_prompt:end - num_prompt]
        elif start == 0 and end == num_prompt:  # the whole prompt: no copy (nobody writes a plan's token ids)
            token_ids = request.prompt_token_ids
        else:
            token_ids = request.token_ids_slice(start, end)
        plan.scheduled.append(ScheduledRequest(
            request_id, token_ids, start, self.block_manager.block_tables[request_id],
            end == num_prompt + len(request.output_token_ids), request.sampling_params,
            request.prompt_token_ids if new_to_executor else None,
            list(request.output_token_ids) if new_to_executor else None, num_spec,
        ))

    # ---- after the step
    def update_from_output(self, plan: StepPlan, result: StepResult,
                           now: float) -> list[tuple[Request, list[SampledToken]]]:
        """Advance progress, append sampled tokens, retire finished requests. Returns the requests
        that got tokens this step, each with them (several when drafts were accepted: up to the one
        that finished it)."""
        updated = []
        requests = self.requests
        sampled_tokens = result.sampled
        bm = self.block_manager
        record_tokens = bm.record_tokens if self.contiguous else None
        caching = bm.enable_caching
        for scheduled in plan.scheduled:
            request = requests.get(scheduled.request_id)
            if request is None:  # aborted while the step ran
                continue
            request.num_computed_tokens += len(scheduled.token_ids)
            if scheduled.num_spec_tokens:
                new_tokens = result.spec_sampled[request.request_id]
                self._roll_back_rejected(request, scheduled.num_spec_tokens, len(new_tokens) - 1)
            if record_tokens is not None:
                record_tokens(request.request_id, request.num_computed_tokens)
            if caching and request.cache_prefix:
                cache_computed_blocks(bm, request)
            if not scheduled.num_spec_tokens:
                sampled = sampled_tokens.get(request.request_id) if scheduled.sample else None
                if sampled is None:
                    continue
                new_tokens = [sampled]
            times = request.times
            if times.first_token is None:
                times.first_token = now
            for count, token in enumerate(new_tokens, 1):
                request.output_token_ids.append(token.token_id)
                times.token_times.append(now)
                status = self._stop_status(request, token.token_id)
                if status is not None:
                    times.finished = now
                    self.finish_request(request, status)
                    new_tokens = new_tokens[:count]
                    break
            updated.append((request, new_tokens))
        return updated

    def _roll_back_rejected(self, request: Request, num_spec: int, num_accepted: int) -> None:
        """Count a verified draft, and forget the KV of its rejected tokens: they are no longer computed,
        and blocks that held only them go back to the pool (their slots are written again next step)."""
        self.spec_num_drafts_total += 1
        self.spec_num_draft_tokens_total += num_spec
        self.spec_num_accepted_tokens_total += num_accepted
        per_pos = self.spec_num_accepted_tokens_per_pos
        if len(per_pos) < num_spec:
            per_pos += [0] * (num_spec - len(per_pos))
        for pos in range(num_accepted):
            per_pos[pos] += 1
        if num_accepted < num_spec:
            request.num_computed_tokens -= num_spec - num_accepted
            if not self.contiguous:
                self.block_manager.free_excess_slots(request.request_id, request.num_computed_tokens)

    @staticmethod
    def _stop_status(request: Request, token_id: int) -> RequestStatus | None:
        status = Scheduler._stop_token_status(request, token_id)
        if status is None and len(request.output_token_ids) >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return status

    @staticmethod
    def _stop_token_status(request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if params.stop_token_ids and token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        return None
