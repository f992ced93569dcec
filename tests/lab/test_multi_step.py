"""Multi-step decode runs are indistinguishable from single steps: same tokens, timestamps, block ids."""
import random

import pytest

from servelab.config import SchedulerConfig
from servelab.core.block_manager import BlockManager
from servelab.core.plan import SampledToken, StepResult
from servelab.core.request import Request, RequestStatus
from servelab.core.scheduler import Scheduler
from servelab.sampling_params import SamplingParams

STEP = 0.01
UNIFORM_TOKEN = 7


def token_for(position: int) -> int:
    return 1000 + position  # the token sampled after computing `position` tokens


def uniform_token(position: int) -> int:
    return UNIFORM_TOKEN  # what advance_decode_run's callers sample (the cost model's dummy token)


def make(policy, num_blocks, block_size, max_num_seqs, budget, spread, seed):
    rng = random.Random(seed)
    scheduler = Scheduler(SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
                          BlockManager(num_blocks, block_size))
    # (arrival step, request)
    arrivals = []
    for i in range(12):
        prompt, out = rng.randint(1, 14), rng.randint(1, 12)
        arrivals.append((rng.randint(0, spread), Request(f"r{i}", list(range(1, prompt + 1)),
                                                     SamplingParams(max_tokens=out, ignore_eos=True), out)))
    return scheduler, sorted(arrivals, key=lambda a: a[0])


def snapshot(scheduler):
    bm = scheduler.block_manager
    bm.check_invariants()
    return ({k: list(v) for k, v in bm.block_tables.items()}, bm._live_free_ids(), scheduler.num_reserved_unused_slots(),
            [r.request_id for r in scheduler.running], [r.request_id for r in scheduler.waiting])


def single_step(scheduler, now, token=token_for):
    plan = scheduler.schedule(now)
    sampled = {s.request_id: SampledToken(token(s.context_len)) for s in plan.scheduled if s.sample}
    scheduler.update_from_output(plan, StepResult(sampled, STEP), now + STEP)
    return not plan.is_empty


def drive(scheduler, arrivals, multi_step, rng, lazy=False):
    """Run to completion; returns {step index: snapshot} at the end of every scheduling decision.
    lazy: take runs with advance_decode_run, every token UNIFORM_TOKEN (single steps sample it too)."""
    token = uniform_token if lazy else token_for
    step, now, pending, snaps, done = 0, 0.0, list(arrivals), {}, {}
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            scheduler.add_request(pending.pop(0)[1])
        for r in list(scheduler.requests.values()):
            done[r.request_id] = r
        limit = (pending[0][0] - step) if pending else 50
        run = scheduler.plan_decode_run(rng.randint(1, max(1, limit))) if multi_step and limit > 0 else None
        if run is not None:
            k = rng.randint(1, run.num_steps)  # any prefix of a run is a run
            plan = scheduler.schedule_decode_run(run, k, now)
            ends = []
            for _ in range(k):
                now += STEP
                ends.append(now)
            if lazy:
                scheduler.advance_decode_run(run, UNIFORM_TOKEN, ends)
            else:
                tokens = {r.request_id: [token_for(r.num_computed_tokens + j) for j in range(1, k + 1)]
                          for r in run.batch}
                scheduler.update_from_decode_run(run, tokens, ends)
            if plan.scheduled:
                sampled = {s.request_id: SampledToken(token(s.context_len)) for s in plan.scheduled if s.sample}
                scheduler.update_from_output(plan, StepResult(sampled, STEP), now)
            step += k
        else:
            single_step(scheduler, now, token)
            now += STEP
            step += 1
        snaps[step] = snapshot(scheduler)
    return snaps, {rid: (r.output_token_ids, r.times.token_times, r.times.first_scheduled, r.num_preemptions,
                         r.status) for rid, r in done.items()}


CASES = [  # policy, num_blocks, block_size, max_num_seqs, budget, arrival spread (steps)
    ("continuous", 64, 4, 8, 64, 30),
    ("continuous", 10, 4, 8, 64, 4),    # tight pool: preemption by recompute
    ("continuous", 16, 2, 16, 64, 8),   # tight pool, small blocks
    ("continuous", 40, 2, 3, 7, 30),    # few slots, chunked prefill
    ("continuous", 24, 4, 16, 16, 10),
    ("static", 64, 4, 4, 64, 30),
    ("serial", 64, 4, 8, 64, 30),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_runs_match_single_steps(case, seed):
    single_snaps, single_out = drive(*make(*case, seed), multi_step=False, rng=random.Random(seed))
    multi_snaps, multi_out = drive(*make(*case, seed), multi_step=True, rng=random.Random(seed))
    assert multi_out == single_out
    assert set(multi_snaps) <= set(single_snaps)
    for step, snap in multi_snaps.items():
        assert snap == single_snaps[step], f"state differs after step {step}"
    assert len(multi_snaps) < len(single_snaps)  # runs did happen


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lazily_written_runs_match_single_steps(case, seed):
    """advance_decode_run writes a request's tokens only when it leaves the batch or a full step is
    planned; the scheduler's state between runs and every finished request are the same."""
    single_snaps, single_out = drive(*make(*case, seed), multi_step=False, rng=random.Random(seed), lazy=True)
    multi_snaps, multi_out = drive(*make(*case, seed), multi_step=True, rng=random.Random(seed), lazy=True)
    assert multi_out == single_out
    assert set(multi_snaps) <= set(single_snaps)
    for step, snap in multi_snaps.items():
        assert snap == single_snaps[step], f"state differs after step {step}"
    assert len(multi_snaps) < len(single_snaps)


def test_lazily_written_tokens_settle_on_abort_and_full_step():
    scheduler = Scheduler(SchedulerConfig(), BlockManager(16, 4))
    requests = [Request(rid, [1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True), 10) for rid in "abc"]
    for r in requests:
        scheduler.add_request(r)
    single_step(scheduler, 0.0, uniform_token)
    run = scheduler.plan_decode_run(4)
    scheduler.schedule_decode_run(run, 4, 0.01)
    assert scheduler.advance_decode_run(run, UNIFORM_TOKEN, [0.02, 0.03, 0.04, 0.05]) == []
    a, b, c = requests
    assert a.num_computed_tokens == 3 and a.output_token_ids == [UNIFORM_TOKEN]  # not written yet
    assert scheduler.num_reserved_unused_slots() == 3 * (8 - 7)
    scheduler.abort_requests(["b"])
    assert b.output_token_ids == [UNIFORM_TOKEN] * 5 and b.times.token_times == [0.01, 0.02, 0.03, 0.04, 0.05]
    single_step(scheduler, 0.05, uniform_token)  # a full schedule() writes the others first
    assert a.output_token_ids == c.output_token_ids == [UNIFORM_TOKEN] * 6
    assert a.num_computed_tokens == c.num_computed_tokens == 8
    assert a.times.token_times == [0.01, 0.02, 0.03, 0.04, 0.05, 0.05 + STEP]
    scheduler.block_manager.check_invariants()


def test_lazily_written_runs_need_requests_no_token_stops():
    scheduler = Scheduler(SchedulerConfig(), BlockManager(16, 4))
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[9]), 10))
    single_step(scheduler, 0.0)
    run = scheduler.plan_decode_run(4)
    scheduler.schedule_decode_run(run, 4, 0.01)
    with pytest.raises(ValueError):
        scheduler.advance_decode_run(run, UNIFORM_TOKEN, [0.02, 0.03, 0.04, 0.05])


def test_stop_token_inside_a_run_retires_the_request_there():
    scheduler = Scheduler(SchedulerConfig(), BlockManager(16, 4))
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[7]), 10)
    scheduler.add_request(r)
    single_step(scheduler, 0.0)
    run = scheduler.plan_decode_run(6)
    assert run.num_steps == 6
    scheduler.schedule_decode_run(run, 6, 0.01)
    scheduler.update_from_decode_run(run, {"a": [5, 6, 7, 8, 9, 10]}, [0.02, 0.03, 0.04, 0.05, 0.06, 0.07])
    assert r.output_token_ids[1:] == [5, 6, 7]
    assert r.status is RequestStatus.FINISHED_STOPPED and r.times.finished == 0.04
    assert scheduler.block_manager.num_free_blocks == 16
    scheduler.block_manager.check_invariants()


def test_no_run_while_someone_prefills_or_the_head_could_join():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=4), BlockManager(16, 4))
    scheduler.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=5), 5))
    assert scheduler.plan_decode_run(8) is None  # nothing running yet
    single_step(scheduler, 0.0)
    assert scheduler.plan_decode_run(8) is None  # mid-prefill (4 of 10 tokens)
    single_step(scheduler, 0.01)
    single_step(scheduler, 0.02)
    assert scheduler.plan_decode_run(8).num_steps == 4  # decoding; finishes on length after 4 more
    scheduler.add_request(Request("b", [1], SamplingParams(max_tokens=2), 2))
    run = scheduler.plan_decode_run(8)
    assert run.num_steps == 1  # b can be admitted next step: a one-step run admits it
    plan = scheduler.schedule_decode_run(run, 1, 0.03)
    assert [r.request_id for r in run.batch] == ["a"] and [s.request_id for s in plan.scheduled] == ["b"]
