"""Decode runs (EngineCore.step_with_decode_runs) are indistinguishable from single steps: same tokens,
timestamps, block ids and pool state, and the block manager's reserved-unused count is exact after every run."""
import math
import random
from itertools import accumulate

from servelab.config import SchedulerConfig
from servelab.core.block_manager import BlockManager
from servelab.core.clock import VirtualClock
from servelab.core.engine_core import EngineCore
from servelab.core.plan import SampledToken, StepResult
from servelab.core.request import Request, RequestStatus
from servelab.core.scheduler import Scheduler
from servelab.sampling_params import SamplingParams

import pytest

STEP = 0.01
TOKEN = 7


class StubExecutor:
    """Every step takes STEP seconds and samples TOKEN, priced one at a time or as a decode run."""

    run_token_id = TOKEN

    def __init__(self):
        self.num_executed = 0
        self.priced = []  # DecodeRunPlans priced
        self.with_run = []  # (DecodeRunPlan, StepPlan) of one-step runs that admitted someone

    def execute(self, plan):
        self.num_executed += 1
        return self._result(plan)

    def price_decode_run(self, run, within=math.inf):
        self.priced.append(run)
        return [STEP] * run.num_steps, [(run.num_steps, run.batch_size)]

    def execute_with_decode_run(self, run, plan):
        self.with_run.append((run, plan))
        return self._result(plan)

    @staticmethod
    def _result(plan):
        return StepResult({s.request_id: SampledToken(TOKEN) for s in plan.scheduled if s.sample}, STEP)


def make_engine(config=SchedulerConfig(), num_blocks=16, block_size=4, decode_runs=True, enable_caching=False):
    stats = []
    engine = EngineCore(Scheduler(config, BlockManager(num_blocks, block_size, enable_caching)), StubExecutor(),
                        VirtualClock(), stats_sink=stats.append, decode_runs=decode_runs)
    return engine, stats


def make(policy, num_blocks, block_size, max_num_seqs, budget, spread, seed, decode_runs, shared_prefixes=False,
         mixed_batches=True, num_scheduler_steps=1):
    """shared_prefixes: prefix caching on, and each prompt one of 3 prefixes then a suffix of its own.
    mixed_batches=False: prefills in steps of their own, admitted between passes of num_scheduler_steps
    decode steps (SchedulerConfig)."""
    rng = random.Random(seed)
    config = SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             mixed_batches=mixed_batches, num_scheduler_steps=num_scheduler_steps)
    arrivals = []  # (arrival step, request)
    for i in range(12):
        prompt, out = rng.randint(1, 14), rng.randint(1, 12)
        if shared_prefixes:
            tokens = [100 + rng.randint(0, 2)] * rng.randint(0, 9) + [-1 - i] * prompt
        else:
            tokens = list(range(1, prompt + 1))
        arrivals.append((rng.randint(0, spread), Request(f"r{i}", tokens, SamplingParams(max_tokens=out, ignore_eos=True),
                                                     out, cache_prefix=shared_prefixes)))
    engine = make_engine(config, num_blocks, block_size, decode_runs, enable_caching=shared_prefixes)
    return engine, sorted(arrivals, key=lambda a: a[0])


def snapshot(engine):
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    return ({k: list(v) for k, v in bm.block_tables.items()}, bm._live_free_ids(), bm.num_reserved_unused_slots(),
            [r.request_id for r in engine.scheduler.running], [r.request_id for r in engine.scheduler.waiting],
            engine.scheduler.prefix_cache_hits_total)


def drive(engine_and_stats, arrivals, rng):
    """Run to completion; returns {step index: snapshot} after every step function call. With decode
    runs, each call's horizon cuts its run at a random step before the next arrival (any prefix of a
    run is a run)."""
    (engine, stats), pending = engine_and_stats, list(arrivals)
    step, snaps, done = 0, {}, {}
    bm = engine.scheduler.block_manager
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            engine.add_request(pending.pop(0)[1])
        for r in list(engine.scheduler.requests.values()):
            done[r.request_id] = r
        limit = (pending[0][0] - step) if pending else 50
        num_stats = len(stats)
        out = engine.step_fn(engine.clock.now() + (rng.randint(1, limit) - 0.5) * STEP)
        assert len(stats) == num_stats + (out.stats is not None)  # one StepStats per step or run
        if out.stats is None:  # idle until the next arrival
            engine.clock.advance(STEP)
            step += 1
        else:
            assert out.stats is stats[-1]
            assert out.stats.num_reserved_unused_slots == bm.num_reserved_unused_slots()
            step += out.stats.num_steps
        snaps[step] = snapshot(engine)
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


@pytest.mark.parametrize("mixed_batches, num_scheduler_steps", [(True, 1), (False, 1), (False, 3)],
                         ids=["", "prefill-steps-alone", "prefill-steps-alone-3-step-passes"])
@pytest.mark.parametrize("shared_prefixes", [False, True], ids=["", "prefix-caching"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_runs_match_single_steps(case, seed, shared_prefixes, mixed_batches, num_scheduler_steps):
    """Also: after every run the block manager's reserved-unused count is the single steps' one, and
    the StepStats the engine emits carries it. With prefix caching, the same blocks are found cached."""
    if (shared_prefixes or not mixed_batches) and case[0] != "continuous":
        pytest.skip("prefix caching and mixed batches are for paged allocation")
    flags = dict(shared_prefixes=shared_prefixes, mixed_batches=mixed_batches,
                 num_scheduler_steps=num_scheduler_steps)
    single_snaps, single_out = drive(*make(*case, seed, decode_runs=False, **flags), rng=random.Random(seed))
    (engine, stats), arrivals = make(*case, seed, decode_runs=True, **flags)
    multi_snaps, multi_out = drive((engine, stats), arrivals, rng=random.Random(seed))
    assert multi_out == single_out
    assert set(multi_snaps) <= set(single_snaps)
    for step, snap in multi_snaps.items():
        assert snap == single_snaps[step], f"state differs after step {step}"
    assert max(multi_snaps) == max(single_snaps)
    assert any(s.num_steps > 1 for s in stats)  # runs did happen
    if shared_prefixes:
        assert engine.scheduler.prefix_cache_hits_total > 0


def test_lazily_written_tokens_settle_on_abort_and_full_step():
    engine, stats = make_engine()
    requests = [Request(rid, [1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True), 10) for rid in "abc"]
    for r in requests:
        engine.add_request(r)
    engine.step_fn()  # nobody running yet: a plain step prefills all three
    out = engine.step_fn(STEP + 3.5 * STEP)  # a run of four decode steps, the last starting before the horizon
    assert stats[-1].num_steps == 4 and out.outputs == []
    a, b, c = requests
    assert a.num_computed_tokens == 3 and a.output_token_ids == [TOKEN]  # not written yet
    bm = engine.scheduler.block_manager
    assert bm.num_reserved_unused_slots() == stats[-1].num_reserved_unused_slots == 3 * (8 - 7)
    bm.check_invariants()
    engine.abort_requests(["b"])
    ends = list(accumulate([STEP] * 6))
    assert b.output_token_ids == [TOKEN] * 5 and b.times.token_times == ends[:5]
    engine.step()  # a full schedule() writes the others first
    assert a.output_token_ids == c.output_token_ids == [TOKEN] * 6
    assert a.num_computed_tokens == c.num_computed_tokens == 8
    assert a.times.token_times == ends
    bm.check_invariants()


def test_requests_a_token_could_stop_take_single_steps():
    engine, stats = make_engine()
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=6), 6, eos_token_ids=(TOKEN + 1,))
    engine.add_request(r)
    while engine.has_unfinished_requests():
        engine.step_fn()
    assert r.output_token_ids == [TOKEN] * 6 and r.status is RequestStatus.FINISHED_LENGTH
    assert [s.num_steps for s in stats] == [1] * 6 and engine.executor.priced == []
    engine, stats = make_engine()
    engine.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True), 6,
                               eos_token_ids=(TOKEN + 1,)))
    while engine.has_unfinished_requests():
        engine.step_fn()
    assert [s.num_steps for s in stats] == [1, 5]


def test_no_run_while_someone_prefills_or_the_head_could_join():
    engine, _ = make_engine(SchedulerConfig(max_num_batched_tokens=4))
    planner = engine.decode_runs
    engine.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=5), 5))
    assert planner.plan(8) is None  # nothing running yet
    engine.step_fn()
    assert planner.plan(8) is None  # mid-prefill (4 of 10 tokens)
    engine.step_fn()
    engine.step_fn()
    assert planner.plan(8).num_steps == 4  # decoding; finishes on length after 4 more
    engine.add_request(Request("b", [1], SamplingParams(max_tokens=2), 2))
    assert planner.plan(8).num_steps == 1  # b can be admitted next step: a one-step run admits it
    engine.step_fn()
    [(run, plan)] = engine.executor.with_run
    assert run.batch_size == 1 and [s.request_id for s in plan.scheduled] == ["b"]


@pytest.mark.parametrize("case", [CASES[0]])
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_trimmed_step_ends_change_nothing(case, seed, monkeypatch):
    """A batch that never empties drops the step ends its members no longer need (DecodeBatch.add_steps);
    trimmed every few steps, tokens and timestamps are still those of single steps."""
    from servelab.core.decode_runs import batch as decode_batch

    monkeypatch.setattr(decode_batch, "_TRIM_STEPS", 2)
    bases = []
    add_steps = decode_batch.DecodeBatch.add_steps

    def add_steps_seen(batch, step_end_times):
        add_steps(batch, step_end_times)
        bases.append(batch.base)

    monkeypatch.setattr(decode_batch.DecodeBatch, "add_steps", add_steps_seen)
    _, single_out = drive(*make(*case, seed, decode_runs=False), rng=random.Random(seed))
    multi_snaps, multi_out = drive(*make(*case, seed, decode_runs=True), rng=random.Random(seed))
    assert multi_out == single_out
    assert max(bases) > 0  # step ends were dropped
