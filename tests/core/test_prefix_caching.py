"""Prefix caching: the hash chain, shared blocks with reference counts, the LRU free list, and the
scheduler starting requests at their cached prefix (exact block ids throughout)."""
import hashlib
import subprocess
import sys
from array import array

import pytest

from servelab.config import SchedulerConfig
from servelab.core.block_hash import ROOT_BLOCK_HASH, hash_block_tokens, hash_token_blocks, request_block_hashes
from servelab.core.block_manager import BlockManager
from servelab.core.clock import VirtualClock
from servelab.core.engine_core import EngineCore
from servelab.core.request import Request
from servelab.core.scheduler import Scheduler
from servelab.sampling_params import SamplingParams

from tests.core.test_scheduler import PositionExecutor, finished_tokens, run


# ---- the hash chain
def test_hash_chain_is_parent_hash_plus_block_tokens():
    hashes = hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4)
    assert len(hashes) == 2  # the partial third block is not hashed
    first = hashlib.sha256(ROOT_BLOCK_HASH + array("q", [1, 2, 3, 4]).tobytes()).digest()
    assert hashes[0] == first
    assert hashes[1] == hashlib.sha256(first + array("q", [5, 6, 7, 8]).tobytes()).digest()
    # the same block after a different prefix is a different block
    assert hash_token_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)[1] != hashes[1]
    assert hash_block_tokens(ROOT_BLOCK_HASH, [5, 6, 7, 8]) != hashes[1]


def test_hashes_are_the_same_in_another_process():
    code = ("from servelab.core.block_hash import hash_token_blocks;"
            "print(hash_token_blocks(list(range(100, 164)), 16)[-1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == hash_token_blocks(list(range(100, 164)), 16)[-1].hex()


def test_request_hashes_extend_as_tokens_grow():
    r = Request("r", [1, 2, 3, 4, 5, 6], SamplingParams(), 8, cache_prefix=True)
    assert request_block_hashes(r, 4, 1) == hash_token_blocks([1, 2, 3, 4], 4)
    r.output_token_ids += [7, 8, 9]
    assert request_block_hashes(r, 4, 2) == hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)


# ---- the block manager
def cached_manager(num_blocks=8, block_size=4):
    return BlockManager(num_blocks, block_size, enable_caching=True)


def fill(bm, request_id, tokens):
    """Allocate tokens' blocks from its cached prefix (the last token always computed) and cache the full ones."""
    hashes = hash_token_blocks(tokens, bm.block_size)
    hit = bm.get_computed_blocks(hashes[:(len(tokens) - 1) // bm.block_size])
    new = bm.allocate_slots(request_id, len(tokens), hit)
    if new is not None:
        bm.cache_blocks(request_id, hashes, len(tokens) // bm.block_size)
    bm.check_invariants()
    return hit, new


def test_shared_blocks_have_one_reference_per_holder():
    bm = cached_manager()
    prompt = list(range(1, 11))  # 2 full blocks and 2 tokens
    assert fill(bm, "a", prompt) == ([], [0, 1, 2])
    assert fill(bm, "b", prompt) == ([0, 1], [3])
    assert bm.get_block_table("b") == [0, 1, 3]
    assert bm.num_free_blocks == 4
    bm.free("a")  # 0 and 1 are still b's; only a's partial block 2 is free
    assert bm.num_free_blocks == 5
    bm.check_invariants()
    bm.free("b")
    bm.free("b")  # an unknown request: a no-op, never a negative count
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_a_freed_cached_block_is_reused_from_the_middle_of_the_free_list():
    bm = cached_manager()
    prompt = list(range(1, 10))
    fill(bm, "a", prompt)  # [0, 1, 2]
    bm.free("a")  # back of the free list, last block first: 3..7, 2, 1, 0
    assert fill(bm, "b", prompt) == ([0, 1], [3])
    # 0 and 1 left the free list where they stood: the next allocation skips them
    assert bm.allocate_slots("c", 16) == [4, 5, 6, 7]
    assert bm.allocate_slots("d", 4) == [2]
    assert bm.allocate_slots("e", 4) is None
    bm.check_invariants()


def test_eviction_is_least_recently_freed_first_and_only_unreferenced():
    bm = cached_manager(num_blocks=6, block_size=2)
    fill(bm, "a", [1, 2, 3, 4, 5])  # [0, 1, 2]: blocks 0 and 1 cached
    fill(bm, "b", [7, 8, 9])  # [3, 4]: block 3 cached
    bm.free("a")  # free list: 5, 2, 1, 0 (a table's last block first)
    bm.free("b")  # free list: 5, 2, 1, 0, 4, 3
    assert bm.allocate_slots("c", 4) == [5, 2]  # the uncached blocks were at the front
    assert fill(bm, "x", [1, 2, 3, 4, 5]) == ([0, 1], [4])  # 0 and 1 still cached, taken off the list
    bm.free("x")  # free list: 3, 4, 1, 0
    bm.free("c")  # free list: 3, 4, 1, 0, 2, 5
    # the least recently freed cached block goes first: b's prefix (block 3)
    assert bm.allocate_slots("d", 2) == [3]
    assert fill(bm, "f", [7, 8, 9]) == ([], [4, 1])  # b's prefix is gone; x's tail (block 1) goes next
    assert fill(bm, "g", [1, 2, 3, 4, 5]) == ([0], [2, 5])  # the head of a's prefix is left
    bm.check_invariants()


def test_a_referenced_block_is_never_evicted():
    bm = cached_manager(num_blocks=4, block_size=2)
    fill(bm, "a", [1, 2, 3, 4, 5])  # [0, 1, 2]
    assert bm.allocate_slots("b", 4) is None  # one block free: nothing of a's can be taken
    bm.check_invariants()
    assert bm.allocate_slots("b", 2) == [3]
    assert bm.get_block_table("a") == [0, 1, 2]


def test_out_of_blocks_with_hits_allocates_nothing():
    bm = cached_manager(num_blocks=4, block_size=2)
    fill(bm, "a", [1, 2, 3, 4, 5])
    bm.free("a")
    bm.allocate_slots("z", 2)  # takes block 3, the uncached one
    # 2 cached free blocks to take plus 2 new ones: 4 > 3 free
    hit, new = fill(bm, "b", [1, 2, 3, 4, 5, 6, 7, 8])
    assert new is None and "b" not in bm.block_tables
    assert bm.num_free_blocks == 3
    assert fill(bm, "c", [1, 2, 3, 4, 9]) == ([0, 1], [2])


def test_hits_follow_the_chain_and_stop_at_the_first_miss():
    bm = cached_manager(num_blocks=10, block_size=2)
    fill(bm, "a", [1, 2, 3, 4, 5, 6, 7])  # [0, 1, 2, 3]
    assert fill(bm, "b", [1, 2, 3, 4, 9, 9, 5, 6, 7]) == ([0, 1], [4, 5, 6])  # block 2 differs: 5, 6 is no hit
    assert fill(bm, "c", [9, 9, 3, 4]) == ([], [7, 8])
    bm.free("a")
    bm.free("b")
    bm.free("c")
    assert bm.num_free_blocks == 10
    bm.check_invariants()


def test_caching_off_finds_nothing():
    bm = BlockManager(8, 4)
    hashes = hash_token_blocks(list(range(12)), 4)
    bm.allocate_slots("a", 12)
    bm.cache_blocks("a", hashes, 3)
    assert bm.get_computed_blocks(hashes) == []


def test_computed_blocks_only_start_a_table():
    bm = cached_manager()
    fill(bm, "a", list(range(9)))
    with pytest.raises(RuntimeError):
        bm.allocate_slots("a", 12, [0])
    with pytest.raises(RuntimeError):  # nothing left to compute
        bm.allocate_slots("b", 8, [0, 1])


# ---- the scheduler
def make_engine(num_blocks=64, block_size=4, budget=64, max_num_seqs=8):
    bm = BlockManager(num_blocks, block_size, enable_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), bm)
    executor = PositionExecutor()
    return EngineCore(scheduler, executor, VirtualClock()), executor


def req(rid, tokens, max_tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), max_tokens, cache_prefix=True)


def test_second_request_starts_at_its_cached_prefix():
    engine, ex = make_engine()
    engine.add_request(req("a", range(1, 11), 2))
    run(engine)
    engine.add_request(req("b", list(range(1, 10)) + [99, 98, 97], 2))
    outs = run(engine)
    first = next(s for p in ex.plans for s in p.scheduled if s.request_id == "b")
    assert first.num_computed_tokens == 8 and first.token_ids == [9, 99, 98, 97]
    assert first.block_ids[:3] == [0, 1, 3] and first.prompt_token_ids is not None  # (the live table)
    assert finished_tokens(outs) == {"b": [1012, 1013]}  # the same positions as a cold run
    sched = engine.scheduler
    assert (sched.prefix_cache_queries_total, sched.prefix_cache_hits_total) == (10 + 12, 8)
    assert sched.block_manager.num_free_blocks == 64


def test_a_fully_cached_prompt_still_computes_its_last_token():
    engine, ex = make_engine()
    engine.add_request(req("a", range(1, 9), 1))  # 8 tokens: 2 full blocks
    run(engine)
    engine.add_request(req("b", range(1, 9), 1))
    run(engine)
    b = [s for p in ex.plans for s in p.scheduled if s.request_id == "b"]
    # only block 0 is reused: reusing block 1 would leave nothing to compute (and write into a shared block)
    assert [(s.num_computed_tokens, s.token_ids) for s in b] == [(4, [5, 6, 7, 8])]
    assert b[0].block_ids == [0, 2]


def test_chunked_prefill_caches_blocks_as_chunks_complete():
    engine, ex = make_engine(budget=8)
    engine.add_request(req("a", range(1, 15), 2))  # 14 tokens: chunks of 8 and 6
    engine.step()
    engine.add_request(req("b", range(1, 15), 2))
    outs = engine.step().outputs  # a's second chunk; b gets the 2 tokens left, after a's two blocks of step 1
    b = next(s for s in ex.plans[1].scheduled if s.request_id == "b")
    assert (b.num_computed_tokens, b.token_ids, b.block_ids[:3]) == (8, [9, 10], [0, 1, 4])
    outs += run(engine)
    assert finished_tokens(outs) == {"a": [1014, 1015], "b": [1014, 1015]}
    assert engine.scheduler.block_manager.num_free_blocks == 64


def test_preempted_request_comes_back_to_its_own_cached_blocks():
    # 6 blocks of 4 tokens: two requests of 8 prompt + 8 output cannot both hold 16 tokens.
    engine, ex = make_engine(num_blocks=6, block_size=4)
    engine.add_request(req("a", range(1, 9), 8))
    engine.add_request(req("b", range(101, 109), 8))
    outs = run(engine)
    expected = [1000 + n for n in range(8, 16)]
    assert finished_tokens(outs) == {"a": expected, "b": expected}
    assert [rid for p in ex.plans for rid in p.preempted_request_ids] == ["b"]
    again = next(s for p in ex.plans[1:] for s in p.scheduled if s.request_id == "b" and s.prompt_token_ids)
    # its prompt's blocks 2 and 3 were still cached; its third block (block 5) was evicted first, to a
    assert (again.num_computed_tokens, len(again.token_ids), again.block_ids[:2]) == (8, 5, [2, 3])
    # readmissions are not counted as queries (vLLM's counters)
    assert engine.scheduler.prefix_cache_queries_total == 16
    assert engine.scheduler.block_manager.num_free_blocks == 6


def test_abort_of_one_holder_keeps_the_shared_blocks():
    engine, ex = make_engine()
    engine.add_request(req("a", range(1, 14), 100))
    engine.step()
    engine.add_request(req("b", range(1, 14), 100))
    engine.step()
    bm = engine.scheduler.block_manager
    assert bm.get_block_table("b")[:3] == bm.get_block_table("a")[:3]
    engine.abort_requests(["a"])
    bm.check_invariants()
    assert bm.get_block_table("b")[:3] == [0, 1, 2]
    outs = run(engine, limit=200)
    assert [o.finish_reason for o in outs if o.finished] == ["length"]
    assert bm.num_free_blocks == 64 and not bm.block_tables
    bm.check_invariants()


def test_requests_outside_prefix_caching_share_nothing():
    engine, ex = make_engine()
    for rid in "ab":  # the lab's length-only requests: placeholder tokens, all alike
        engine.add_request(Request(rid, [0] * 9, SamplingParams(max_tokens=1), 1))
    run(engine)
    assert [s.num_computed_tokens for p in ex.plans for s in p.scheduled] == [0, 0]
    assert engine.scheduler.prefix_cache_queries_total == 0
