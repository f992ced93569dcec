"""Speculative decoding in the core: the n-gram proposer, the scheduler's draft slots, and the rollback of
rejected drafts' KV (exact block ids), with a stand-in model whose greedy tokens follow a fixed rule."""
import pytest

from servelab.config import SchedulerConfig, SpeculativeConfig
from servelab.core.block_manager import BlockManager
from servelab.core.clock import VirtualClock
from servelab.core.engine_core import EngineCore
from servelab.core.plan import SampledToken, StepResult
from servelab.core.request import Request
from servelab.core.scheduler import Scheduler
from servelab.core.spec_decode.ngram import NgramProposer
from servelab.sampling_params import SamplingParams


def proposer(k=3, min_n=1, max_n=3):
    return NgramProposer(SpeculativeConfig("ngram", k, max_n, min_n))


def request(tokens, max_tokens=10, rid="r", eos=()):
    return Request(rid, list(tokens), SamplingParams(temperature=0, max_tokens=max_tokens), max_tokens, eos)


def test_ngram_proposes_what_followed_the_longest_earliest_match():
    # vLLM's example: [4, 2, 3] has no earlier match, [2, 3] has one, followed by 4, 2, 3 (fewer than k)
    assert proposer(k=4, min_n=2, max_n=3).propose(request([1, 2, 3, 4, 2, 3]), 4) == [4, 2, 3]
    # the longest n-gram ([9, 1, 5] at 4) wins over a shorter one's earlier match ([5] at 2)
    assert proposer(k=2).propose(request([7, 1, 5, 8, 9, 1, 5, 6, 8, 9, 1, 5]), 2) == [6, 8]
    assert proposer(k=2, max_n=1).propose(request([7, 1, 5, 8, 9, 1, 5, 6, 8, 9, 1, 5]), 2) == [8, 9]
    assert proposer(min_n=2).propose(request([1, 2, 3, 4, 5, 3]), 3) == []  # no bigram repeats
    assert proposer().propose(request([1, 2, 1]), 0) == []


def test_ngram_index_grows_with_the_request():
    p, r = proposer(k=3), request([5, 6, 7, 8])
    assert p.propose(r, 3) == []
    r.output_token_ids += [5, 6]
    assert p.propose(r, 3) == [7, 8, 5]
    r.output_token_ids += [9]
    assert p.propose(r, 3) == []
    p.drop("r")
    assert p.propose(r, 2) == []


@pytest.mark.parametrize("text, problem", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', ">= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "min <= max"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}', "unknown keys"),
    ('{"method": "ngram", "num_speculative_tokens": "2"}', "integer"),
    ("[1]", "JSON object"),
    ("{", "not valid JSON"),
])
def test_speculative_config_errors(text, problem):
    with pytest.raises(ValueError, match=problem):
        SpeculativeConfig.from_json(text)


def test_speculative_config_defaults_as_vllm():
    assert SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 2}') == SpeculativeConfig("ngram", 2, 5, 5)
    assert SpeculativeConfig.from_json('{"num_speculative_tokens": 2, "prompt_lookup_max": 3}') == SpeculativeConfig("ngram", 2, 3, 3)


def rule(prev, position, exceptions):
    """The stand-in model's greedy token at `position` after token `prev`: counts 1..4 round, except where told."""
    return exceptions.get(position, prev % 4 + 1)


class RuleExecutor:
    """Greedy tokens by rule(); verifies drafts greedily as ModelExecutor does. Records plans."""

    def __init__(self, exceptions):
        self.exceptions, self.plans = exceptions, []

    def execute(self, plan):
        self.plans.append(plan)
        result = StepResult(duration=0.01)
        for s in plan.scheduled:
            if not s.sample:
                continue
            start = s.context_len - 1 - s.num_spec_tokens  # row of the last sampled token
            samples = [SampledToken(rule(s.token_ids[j], s.num_computed_tokens + j + 1, self.exceptions))
                       for j in range(start - s.num_computed_tokens, len(s.token_ids))]
            if not s.num_spec_tokens:
                result.sampled[s.request_id] = samples[0]
                continue
            drafts, kept = s.token_ids[1:], samples
            for j, draft in enumerate(drafts):
                if samples[j].token_id != draft:
                    kept = samples[:j + 1]
                    break
            result.spec_sampled[s.request_id] = kept
        return result


def make_engine(spec, exceptions, budget=64, num_blocks=16, policy="continuous"):
    bm = BlockManager(num_blocks, 4)
    scheduler = Scheduler(SchedulerConfig(policy=policy, max_num_batched_tokens=budget), bm,
                          proposer(k=3) if spec else None)
    executor = RuleExecutor(exceptions)
    return EngineCore(scheduler, executor, VirtualClock()), executor


def run(engine, requests):
    for r in requests:
        engine.add_request(r)
    tokens, finish = {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step().outputs:
            tokens.setdefault(o.request_id, []).extend(t.token_id for t in o.new_tokens)
            if o.finished:
                finish[o.request_id] = o.finish_reason
        engine.scheduler.block_manager.check_invariants()
    return tokens, finish


def test_rejected_draft_rolls_back_its_slots_and_block():
    engine, executor = make_engine(True, {8: 9})
    scheduler, bm = engine.scheduler, engine.scheduler.block_manager
    r = request([1, 2, 3, 4, 1, 2, 3], max_tokens=10)
    engine.add_request(r)
    engine.step()  # prefill 7 tokens in blocks 0, 1; samples 4
    assert r.output_token_ids == [4] and bm.get_block_table("r") == [0, 1]
    engine.step()  # [2, 3, 4] matched at 1: drafts 1, 2, 3 at positions 8..10 need block 2
    s = executor.plans[-1].scheduled[0]
    assert (s.token_ids, s.num_computed_tokens, s.num_spec_tokens, s.block_ids) == ([4, 1, 2, 3], 7, 3, [0, 1])
    # the model says 9 at position 8: no draft kept, block 2 held only rejected drafts and is free again
    assert r.output_token_ids == [4, 9] and r.num_computed_tokens == 8
    assert bm.get_block_table("r") == [0, 1] and bm._live_free_ids()[-1] == 2
    assert (scheduler.spec_num_drafts_total, scheduler.spec_num_draft_tokens_total,
            scheduler.spec_num_accepted_tokens_total, scheduler.spec_num_accepted_tokens_per_pos) == (1, 3, 0, [0, 0, 0])
    engine.step()  # 9 occurs nowhere before: a plain decode, its slot in the next free block (3)
    s = executor.plans[-1].scheduled[0]
    assert (s.token_ids, s.num_spec_tokens) == ([9], 0) and bm.get_block_table("r") == [0, 1, 3]
    assert r.output_token_ids == [4, 9, 2]
    engine.step()  # [2] first at 1: drafts 3, 4, 1, all kept, and the sample after them
    s = executor.plans[-1].scheduled[0]
    assert (s.token_ids, s.num_computed_tokens) == ([2, 3, 4, 1], 9)
    assert r.output_token_ids == [4, 9, 2, 3, 4, 1, 2] and r.num_computed_tokens == 13
    assert bm.get_block_table("r") == [0, 1, 3, 4]
    assert (scheduler.spec_num_drafts_total, scheduler.spec_num_accepted_tokens_total,
            scheduler.spec_num_accepted_tokens_per_pos) == (2, 3, [1, 1, 1])


@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("budget", [64, 3])
def test_outputs_identical_with_and_without_speculation(policy, budget):
    exceptions = {9: 7, 14: 2, 15: 2, 23: 5}
    requests = lambda: [request([1, 2, 3, 4] * 3, 16, "a"), request([2, 3, 1, 2, 3], 9, "b"),  # noqa: E731
                        request([4, 4, 4, 1, 2], 12, "c", eos=(7,)), request([3, 4, 1, 2, 3, 4], 1, "d")]
    plain, _ = make_engine(False, exceptions, budget, policy=policy)
    spec, executor = make_engine(True, exceptions, budget, policy=policy)
    expected = run(plain, requests())
    assert run(spec, requests()) == expected
    assert expected[1] == {"a": "length", "b": "length", "c": "stop", "d": "length"}
    assert spec.scheduler.spec_num_accepted_tokens_total > 0
    assert spec.scheduler.block_manager.num_free_blocks == 16
    for plan in executor.plans:
        assert sum(len(s.token_ids) for s in plan.scheduled) <= budget


def test_eos_inside_accepted_drafts_stops_there():
    # prompt 1 2 3 4 1 2; after 3 the drafts are 4 1 2, all correct, but 1 is EOS: the output ends at it
    engine, executor = make_engine(True, {})
    r = request([1, 2, 3, 4, 1, 2], 10, eos=(1,))
    tokens, finish = run(engine, [r])
    assert tokens == {"r": [3, 4, 1]} and finish == {"r": "stop"}
    assert executor.plans[-1].scheduled[0].num_spec_tokens == 3


def test_sampled_requests_do_not_speculate():
    engine, executor = make_engine(True, {})
    r = Request("r", [1, 2, 3, 4, 1, 2], SamplingParams(temperature=0.8, max_tokens=5), 5)
    run(engine, [r])
    assert all(s.num_spec_tokens == 0 for plan in executor.plans for s in plan.scheduled)


def spec_lengths(executor, rid):
    """The draft tokens the request verified at each of its decode steps (0: decoded one token)."""
    return [s.num_spec_tokens for plan in executor.plans for s in plan.scheduled
            if s.request_id == rid and s.sample and s.num_computed_tokens > 0 and len(s.token_ids) == 1 + s.num_spec_tokens]


def test_adaptive_drafting_backs_off_after_misses_and_resumes_when_lookups_hit():
    # prompt 1 2 3 4 1 2 3; the model counts 1..4 round but says 9 at 8 and 7 at 10: the first two drafts miss
    engine, executor = make_engine(True, {8: 9, 10: 7})
    r = request([1, 2, 3, 4, 1, 2, 3], max_tokens=14)
    run(engine, [r])
    assert r.output_token_ids == [4, 9, 2, 7, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1]
    # step by step (p = the chance estimates of positions 1..3, from 1.0, halfway towards each outcome):
    #  3: [1 2 3] after 2 3 4, wrong at once -> p .5 .5 .5;  0: 9 has no earlier match;
    #  3: [3 4 1] after 2 (p still >= .5), wrong at once -> p .25 .25 .25;  0: 7 has no earlier match;
    #  0: [1 2 3] after 4 is looked up but not drafted (p < .5); the model then says 1: p .625 .25 .25;
    #  1: [2] of [2 3 4] after 4 1, accepted with the sample after it, 3: the followed [1 2 3] was right -> p .625 x3;
    #  3: all right; 1: the one draft max_tokens leaves room for
    assert spec_lengths(executor, "r") == [3, 0, 3, 0, 0, 1, 3, 1]
    assert engine.scheduler.proposer.draft_length("r") == 3


def test_adaptive_drafting_is_per_request():
    # the rule's exceptions are by position: "b" (positions < 19) copies its prompt; "a" (a prompt of 20) is told a
    # new token at every other position after it, so every lookup of its misses at the first token
    engine, executor = make_engine(True, {pos: 100 + pos for pos in range(21, 40, 2)}, budget=64, num_blocks=32)
    a, b = request([1, 2, 3, 4] * 5, max_tokens=12, rid="a"), request([1, 2, 3, 4, 1, 2, 3], 12, "b")
    run(engine, [a, b])
    assert spec_lengths(executor, "b") == [3, 3, 2]  # every draft right: full length (the last: max_tokens)
    # "a": two drafts of 3 (p 1 -> .5 -> .25), then none; its lookups after 1, 2 or 3 keep missing (p -> 0)
    assert spec_lengths(executor, "a") == [3, 0, 3] + [0] * 8
    assert (engine.scheduler.spec_num_drafts_total, engine.scheduler.spec_num_draft_tokens_total) == (5, 14)


def test_adaptive_drafting_off_drafts_every_match_in_full():
    p = NgramProposer(SpeculativeConfig("ngram", 3, 3, 1, draft_min_acceptance=0))
    r = request([1, 2, 3, 4, 1, 2, 3])
    r.output_token_ids += [4]
    for wrong in (9, 8, 7):
        assert len(p.propose(r, 3)) == 3
        r.output_token_ids += [wrong, 1, 2, 3, 4]  # the draft 1 2 3 was wrong
    assert p.draft_length("r") == 3


def test_draft_min_acceptance_config():
    assert SpeculativeConfig.from_json('{"num_speculative_tokens": 2, "draft_min_acceptance": 0}').draft_min_acceptance == 0
    assert SpeculativeConfig.from_json('{"num_speculative_tokens": 2}').draft_min_acceptance == 0.5
    for bad, problem in (("1.5", "within 0 and 1"), ('"high"', "a number"), ("true", "a number")):
        with pytest.raises(ValueError, match=problem):
            SpeculativeConfig.from_json('{"num_speculative_tokens": 2, "draft_min_acceptance": %s}' % bad)
