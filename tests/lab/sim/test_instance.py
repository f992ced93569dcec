"""The lab's Instance is the engine on a virtual clock: a workload through a bare EngineCore taking single
steps, and through an Instance (with or without decode runs) with the same cost-model executor, gives
every request the same tokens and timestamps."""
import math

import pytest

from servelab.config import SchedulerConfig
from servelab.core.block_manager import BlockManager
from servelab.core.clock import VirtualClock
from servelab.core.engine_core import EngineCore
from servelab.core.request import Request
from servelab.core.scheduler import Scheduler
from servelab.executor.cost_model_executor import CostModelExecutor
from servelab.lab.catalog import get_device, get_model
from servelab.lab.sim.deployment import Deployment
from servelab.lab.sim.instance import Instance
from servelab.sampling_params import SamplingParams
from servelab.workload import WorkloadConfig, generate_workload

NUM_BLOCKS, BLOCK_SIZE = 400, 16  # tight enough to preempt under the burst below


def requests(rate):
    w = generate_workload(WorkloadConfig(dataset="sharegpt-like", num_prompts=80, request_rate=rate, seed=3))
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    return [Request(str(i), [0] * x.prompt_len, params, x.output_len, (), x.arrival_time) for i, x in enumerate(w)]


def drive(add_request, has_unfinished, step, workload):
    """The simulator's loop for one instance: requests join when the clock reaches their arrival; a step
    starts as soon as the last one ends; step(now, horizon) returns its end."""
    index, now = 0, 0.0
    while index < len(workload) or has_unfinished():
        while index < len(workload) and workload[index].arrival_time <= now:
            add_request(workload[index])
            index += 1
        if not has_unfinished():
            now = workload[index].arrival_time
            continue
        horizon = workload[index].arrival_time if index < len(workload) else math.inf
        now = step(now, horizon)
    return {r.request_id: (r.output_token_ids, r.times.first_scheduled, r.times.token_times, r.times.finished,
                           r.num_preemptions) for r in workload}


@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("decode_runs", [False, True])
@pytest.mark.parametrize("rate", [0.05, 40])  # arrivals join a running batch or an idle one; a burst queues
def test_instance_is_the_engine_core_on_a_virtual_clock(policy, decode_runs, rate):
    d = Deployment(get_model("llama-3.1-8b"), get_device("l4"), num_gpus=1, max_num_seqs=32)
    config = SchedulerConfig(policy=policy, max_num_seqs=32, max_num_batched_tokens=2048)
    cost_model = d.cost_model()
    core = EngineCore(Scheduler(config, BlockManager(NUM_BLOCKS, BLOCK_SIZE)), CostModelExecutor(cost_model),
                      VirtualClock())

    def core_step(now, horizon):
        core.clock.advance_to(now)
        core.step()
        return core.clock.now()

    expected = drive(core.add_request, core.has_unfinished_requests, core_step, requests(rate))

    instance = Instance(0, "mixed", config, NUM_BLOCKS, BLOCK_SIZE, cost_model, multi_step=decode_runs)
    got = drive(instance.add_request, instance.has_unfinished_requests, instance.step, requests(rate))
    assert got == expected
    assert sum(len(v[2]) for v in got.values()) == sum(r.max_tokens for r in requests(rate))
    if policy == "continuous" and rate == 40:
        assert sum(v[4] for v in got.values()) > 0  # the pool ran short: preemption happened
    assert any(s.num_steps > 1 for s in instance.step_stats) == decode_runs
