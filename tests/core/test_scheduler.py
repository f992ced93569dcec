"""Scheduler policy tests with a deterministic stand-in executor (token = position number)."""
import pytest

from servelab.config import SchedulerConfig
from servelab.core.block_manager import BlockManager
from servelab.core.clock import VirtualClock
from servelab.core.engine_core import EngineCore
from servelab.core.plan import SampledToken, StepResult
from servelab.core.request import Request, RequestStatus
from servelab.core.scheduler import Scheduler
from servelab.sampling_params import SamplingParams


class PositionExecutor:
    """Samples token id = context length, so outputs depend only on positions; records plans."""

    def __init__(self):
        self.plans = []

    def execute(self, plan):
        self.plans.append(plan)
        sampled = {s.request_id: SampledToken(1000 + s.context_len) for s in plan.scheduled if s.sample}
        return StepResult(sampled=sampled, duration=0.01)


def make_engine(policy="continuous", num_blocks=64, block_size=4, max_num_seqs=8, budget=64, mixed_batches=True,
                num_scheduler_steps=1):
    bm = BlockManager(num_blocks, block_size)
    scheduler = Scheduler(SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                          mixed_batches=mixed_batches, num_scheduler_steps=num_scheduler_steps), bm)
    executor = PositionExecutor()
    return EngineCore(scheduler, executor, VirtualClock()), executor


def req(rid, prompt_len, max_tokens, eos=()):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), max_tokens, eos)


def run(engine, limit=1000):
    outputs = []
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return outputs
        outputs += engine.step().outputs
        engine.scheduler.block_manager.check_invariants()
    raise AssertionError("engine did not finish")


def finished_tokens(outputs):
    """Each finished request's tokens, gathered from the outputs (values, as the output processor sees them)."""
    tokens = {}
    for o in outputs:
        tokens.setdefault(o.request_id, []).extend(t.token_id for t in o.new_tokens)
    return {o.request_id: tokens.get(o.request_id, []) for o in outputs if o.finished}


def test_continuous_chunked_prefill_and_decode():
    engine, ex = make_engine(budget=6)
    engine.add_request(req("a", 10, 3))
    outs = run(engine)
    # prefill 10 tokens in chunks of 6 and 4, then 2 decode steps
    assert [s.token_ids for p in ex.plans for s in p.scheduled] == [
        [1, 2, 3, 4, 5, 6], [7, 8, 9, 10], [1010], [1011]]
    assert [s.sample for p in ex.plans for s in p.scheduled] == [False, True, True, True]
    assert finished_tokens(outs) == {"a": [1010, 1011, 1012]}
    assert engine.scheduler.block_manager.num_free_blocks == 64


def test_continuous_admits_while_others_decode():
    engine, ex = make_engine(budget=16)
    engine.add_request(req("a", 4, 5))
    outs = engine.step().outputs
    engine.add_request(req("b", 4, 2))
    outs += engine.step().outputs
    assert [(s.request_id, len(s.token_ids)) for s in ex.plans[1].scheduled] == [("a", 1), ("b", 4)]
    outs += run(engine)
    assert finished_tokens(outs) == {"b": [1004, 1005], "a": [1004, 1005, 1006, 1007, 1008]}


def test_without_mixed_batches_prefills_run_alone_and_decodes_wait():
    engine, ex = make_engine(budget=16, mixed_batches=False)
    engine.add_request(req("a", 4, 5))
    outs = engine.step().outputs
    engine.add_request(req("b", 4, 2))
    engine.add_request(req("c", 14, 2))
    outs += engine.step().outputs  # b's prefill alone: c's whole prompt does not fit beside it, a waits
    outs += engine.step().outputs  # then c's
    outs += engine.step().outputs  # then the three decode together
    assert [[(s.request_id, len(s.token_ids)) for s in p.scheduled] for p in ex.plans] == [
        [("a", 4)], [("b", 4)], [("c", 14)], [("a", 1), ("b", 1), ("c", 1)]]
    outs += run(engine)
    assert finished_tokens(outs) == {"b": [1004, 1005], "c": [1014, 1015], "a": [1004, 1005, 1006, 1007, 1008]}


def test_without_mixed_batches_a_prompt_over_the_budget_is_still_split():
    engine, ex = make_engine(budget=6, mixed_batches=False)
    engine.add_request(req("a", 10, 2))
    engine.add_request(req("b", 3, 1))
    outs = run(engine)
    # a's prompt alone exceeds the budget: chunks of 6 and 4, b waits for a's prompt to finish
    assert [[(s.request_id, len(s.token_ids)) for s in p.scheduled] for p in ex.plans][:3] == [
        [("a", 6)], [("a", 4)], [("b", 3)]]
    assert finished_tokens(outs) == {"a": [1010, 1011], "b": [1003]}


def test_without_mixed_batches_prompts_wait_for_the_multi_step_pass_to_end():
    engine, ex = make_engine(budget=16, mixed_batches=False, num_scheduler_steps=3)
    engine.add_request(req("a", 4, 6))
    engine.step()  # a's prefill, then a pass of 3 decode steps
    engine.step()
    engine.add_request(req("b", 4, 2))
    engine.step()
    engine.step()  # b waits for the pass to end
    engine.step()  # b's prefill
    engine.step()  # the next pass: a and b together
    assert [[(s.request_id, len(s.token_ids)) for s in p.scheduled] for p in ex.plans] == [
        [("a", 4)], [("a", 1)], [("a", 1)], [("a", 1)], [("b", 4)], [("a", 1), ("b", 1)]]


def test_block_tables_are_exact():
    engine, ex = make_engine(block_size=4, budget=64)
    engine.add_request(req("a", 5, 4))
    engine.add_request(req("b", 3, 1))
    engine.step()
    assert [s.block_ids for s in ex.plans[0].scheduled] == [[0, 1], [2]]
    engine.step()  # a decodes position 5 (slot in block 1); b finished after its prefill
    assert engine.scheduler.block_manager.block_tables == {"a": [0, 1]}
    run(engine)
    assert engine.scheduler.block_manager.num_free_blocks == 64


def test_preemption_by_recompute_keeps_outputs():
    # 6 blocks of 4 tokens: two requests of 8 prompt + 8 output cannot both hold 16 tokens.
    engine, ex = make_engine(num_blocks=6, block_size=4, budget=64)
    engine.add_request(req("a", 8, 8))
    engine.add_request(req("b", 8, 8))
    outs = run(engine)
    assert engine.scheduler.num_preemptions_total >= 1
    expected = [1000 + n for n in range(8, 16)]
    assert finished_tokens(outs) == {"a": expected, "b": expected}
    preempted = [rid for p in ex.plans for rid in p.preempted_request_ids]
    assert preempted == ["b"]
    # b comes back with its prompt and outputs so the executor can rebuild its state
    again = next(s for p in ex.plans[1:] for s in p.scheduled if s.request_id == "b" and s.prompt_token_ids)
    assert again.num_computed_tokens == 0 and again.output_token_ids
    assert engine.scheduler.block_manager.num_free_blocks == 6


def test_static_batch_waits_for_all():
    engine, ex = make_engine(policy="static", max_num_seqs=2)
    engine.add_request(req("a", 4, 1))
    engine.add_request(req("b", 4, 3))
    engine.add_request(req("c", 4, 1))
    run(engine)
    ids = [[s.request_id for s in p.scheduled] for p in ex.plans]
    assert ids == [["a", "b"], ["b"], ["b"], ["c"]]


def test_static_reserves_prompt_plus_max_tokens():
    engine, ex = make_engine(policy="static", block_size=4, max_num_seqs=4)
    engine.add_request(req("a", 5, 10))  # 15 tokens -> 4 blocks
    engine.add_request(req("b", 2, 1))   # 3 tokens -> 1 block
    engine.step()
    bm = engine.scheduler.block_manager
    assert bm.block_tables == {"a": [0, 1, 2, 3]}  # b finished after its first token
    assert bm.num_reserved_unused_slots() == 16 - 5
    run(engine)


def test_serial_runs_one_at_a_time():
    engine, ex = make_engine(policy="serial", max_num_seqs=8)
    for rid in "abc":
        engine.add_request(req(rid, 3, 2))
    run(engine)
    assert all(len(p.scheduled) == 1 for p in ex.plans)
    assert [p.scheduled[0].request_id for p in ex.plans] == ["a", "a", "b", "b", "c", "c"]


def test_eos_and_stop_token_ids():
    engine, _ = make_engine()
    engine.add_request(req("eos", 4, 10, eos=(1006,)))
    r = Request("stop", [1, 2, 3, 4], SamplingParams(max_tokens=10, stop_token_ids=[1005]), 10)
    engine.add_request(r)
    outs = run(engine)
    assert finished_tokens(outs) == {"eos": [1004, 1005, 1006], "stop": [1004, 1005]}
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert {o.request_id: o.finish_reason for o in outs if o.finished} == {"eos": "stop", "stop": "stop"}


def test_abort_frees_blocks_and_tells_executor():
    engine, ex = make_engine()
    engine.add_request(req("a", 8, 100))
    engine.add_request(req("w", 8, 100))
    engine.step()
    out = engine.abort_requests(["a", "w", "missing"])
    assert [(o.request_id, o.finish_reason) for o in out] == [("a", "abort"), ("w", "abort")]
    assert engine.scheduler.block_manager.num_free_blocks == 64
    engine.add_request(req("b", 2, 1))
    engine.step()
    assert sorted(ex.plans[-1].finished_request_ids) == ["a", "w"]


def test_request_too_large_for_pool_is_rejected():
    engine, _ = make_engine(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="KV cache"):
        engine.add_request(req("a", 6, 4))
    assert not engine.has_unfinished_requests()
