"""EngineCore's step function, chosen once, and its StepStats sink."""
import pytest

from servelab.config import SchedulerConfig
from servelab.core.block_manager import BlockManager
from servelab.core.clock import VirtualClock, WallClock
from servelab.core.engine_core import EngineCore
from servelab.core.plan import SampledToken, StepResult
from servelab.core.request import Request
from servelab.core.scheduler import Scheduler
from servelab.sampling_params import SamplingParams


class OneTokenExecutor:
    def execute(self, plan):
        return StepResult({s.request_id: SampledToken(5) for s in plan.scheduled if s.sample}, 0.25)


def scheduler(budget=4):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget), BlockManager(8, 4))


def test_one_step_stats_per_step_to_the_sink():
    sink = []
    engine = EngineCore(scheduler(), OneTokenExecutor(), VirtualClock(), stats_sink=sink.append)
    assert engine.decode_runs is None  # step_fn is step
    assert engine.step().stats is None and sink == []  # nothing to run: no step, no stats
    engine.add_request(Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=2), 2))
    engine.add_request(Request("b", [1], SamplingParams(max_tokens=1), 1))
    outs = []
    while engine.has_unfinished_requests():
        outs.append(engine.step_fn())
    assert [o.stats for o in outs] == sink and all(o.stats is s for o, s in zip(outs, sink))
    # a's prompt in chunks of 4 and 2 (b joins the second step), then a's one decode
    assert [(s.start, s.duration, s.num_scheduled_tokens, s.num_prefill_tokens, s.num_decode_requests, s.num_steps)
            for s in sink] == [(0.0, 0.25, 4, 4, 0, 1), (0.25, 0.25, 3, 3, 0, 1), (0.5, 0.25, 1, 0, 1, 1)]
    assert [(s.num_running, s.num_waiting) for s in sink] == [(1, 1), (1, 0), (0, 0)]
    assert sink[-1].kv_usage == 0 and sink[0].kv_usage == 1 / 8


def test_decode_runs_are_chosen_once_and_need_a_virtual_clock():
    engine = EngineCore(scheduler(), OneTokenExecutor(), VirtualClock(), decode_runs=True)
    assert engine.decode_runs is not None and engine.decode_runs.scheduler is engine.scheduler  # step_fn runs them
    with pytest.raises(ValueError, match="VirtualClock"):
        EngineCore(scheduler(), OneTokenExecutor(), WallClock(), decode_runs=True)
