"""One simulated instance as the router sees it: an EngineCore (servelab's own Scheduler and BlockManager,
a CostModelExecutor, a VirtualClock), its role, the requests routed to it and when its step in flight
ends. Its StepStats, one per step or decode run, kept as columns (step_log.py), are what the meters read."""
from __future__ import annotations

import math

from servelab.config import SchedulerConfig, SpeculativeConfig
from servelab.core.block_manager import BlockManager
from servelab.core.clock import VirtualClock
from servelab.core.engine_core import EngineCore
from servelab.core.request import Request
from servelab.core.scheduler import Scheduler
from servelab.core.spec_decode.simulated import SimulatedProposer
from servelab.executor.cost_model import CostModel
from servelab.executor.cost_model_executor import CostModelExecutor
from servelab.lab.sim.step_log import StepLog


class Instance:
    def __init__(self, index: int, role: str, scheduler_config: SchedulerConfig, num_blocks: int, block_size: int,
                 cost_model: CostModel, multi_step: bool = True, started_at: float = 0.0,
                 enable_prefix_caching: bool = False, speculative: SpeculativeConfig | None = None,
                 spec_acceptance_rate: float | None = None) -> None:
        """speculative: each decode step drafts and verifies (SimulatedProposer, accepted at spec_acceptance_rate);
        its steps are priced one by one (a decode run's steps each give one token)."""
        self.index = index
        self.role = role  # "mixed", "prefill" or "decode"
        multi_step = multi_step and speculative is None
        self.multi_step = multi_step
        self.step_stats = StepLog()
        self.clock = VirtualClock()
        block_manager = BlockManager(num_blocks, block_size,
                                     enable_caching=enable_prefix_caching and not scheduler_config.contiguous)
        proposer = SimulatedProposer(speculative.num_speculative_tokens) if speculative is not None else None
        self.core = EngineCore(Scheduler(scheduler_config, block_manager, proposer),
                                 CostModelExecutor(cost_model, spec_acceptance_rate if speculative else None, seed=index),
                                 self.clock,
                                 stats_sink=self.step_stats.append,
                                 decode_runs=multi_step)
        self.num_outstanding = 0  # routed here and not finished, as the router sees it
        self.busy = False
        self.next_step_time = math.inf
        self.pending_finished: list[Request] = []  # finished by the step in flight, visible at its end
        self._requests: dict[str, Request] = {}  # routed here and not finished (outputs carry ids, not requests)
        # Autoscaling: when the instance took its GPUs, and gave them back after draining (None: at the end).
        self.started_at = started_at
        self.stopped_at: float | None = None
        self.draining_since: float | None = None  # when it left the router

    def add_request(self, request: Request) -> None:
        self.core.add_request(request)
        self._requests[request.request_id] = request
        self.num_outstanding += 1

    def admit_handed_over(self, request: Request) -> None:
        """A request whose KV landed from a prefill instance (counted as outstanding when it was routed)."""
        self.core.add_request(request)
        self._requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return self.core.scheduler.has_unfinished_requests()

    def step(self, now: float, horizon: float) -> float | None:
        """Run the engine's next step (or decode run, whose later steps all start before horizon: the
        earliest time anything from outside can reach this instance) from now. Returns its end time, or
        None when the scheduler had nothing to run."""
        core = self.core
        self.clock.advance_to(now)
        out = core.step_fn(horizon)
        if out.stats is None:
            return None
        requests = self._requests
        self.pending_finished = ([requests.pop(o.request_id) for o in out.outputs if o.finish_reason is not None]
                                 if out.outputs else [])
        return out.stats.step_ends[-1]  # the clock's time now
