"""The scheduler's side of the KV connector (disaggregated prefill/decode), on exact block ids: a prefill
that finishes after its first token keeps its blocks until release_kv; a decode-side request is admitted
by add_prefilled with blocks for its prompt allocated at once (None while the pool is short) and then
decodes from its first token with num_computed_tokens = prompt length, as any request would."""
from servelab.core.engine_io import KVTransferParams
from servelab.core.request import Request, RequestStatus
from servelab.sampling_params import SamplingParams
from test_scheduler import make_engine, run


def test_a_finished_prefill_holds_its_blocks_until_released():
    engine, executor = make_engine(num_blocks=8, block_size=4)
    scheduler, bm = engine.scheduler, engine.scheduler.block_manager
    prefill = Request("p", list(range(1, 7)), SamplingParams(max_tokens=1), 1,
                      kv_transfer=KVTransferParams(do_remote_decode=True))
    plain = Request("q", [1, 2, 3], SamplingParams(max_tokens=1), 1)
    engine.add_request(prefill)
    engine.add_request(plain)
    outputs = run(engine)
    assert {o.request_id: o.finish_reason for o in outputs} == {"p": "length", "q": "length"}
    assert [t.token_id for o in outputs if o.request_id == "p" for t in o.new_tokens] == [1006]
    assert scheduler.kv_held_ids == {"p"} and bm.get_block_table("p") == [0, 1]
    assert "q" not in bm.block_tables and bm.num_free_blocks == 6 and not engine.has_unfinished_requests()
    assert scheduler.release_kv("p") and not scheduler.release_kv("p")
    assert bm.num_free_blocks == 8 and scheduler.kv_held_ids == set()
    bm.check_invariants()


def test_an_aborted_or_stopped_prefill_frees_at_once():
    engine, _ = make_engine(num_blocks=8, block_size=4)
    scheduler = engine.scheduler
    for rid in ("a", "s"):
        engine.add_request(Request(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=1), 1, eos_token_ids=(1005,),
                                   kv_transfer=KVTransferParams(do_remote_decode=True)))
    engine.abort_requests(["a"])
    outputs = run(engine)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("s", "stop")]  # its first token was EOS
    assert scheduler.kv_held_ids == set() and scheduler.block_manager.num_free_blocks == 8


def test_a_remote_prefilled_request_decodes_from_its_first_token():
    engine, executor = make_engine(num_blocks=4, block_size=4)
    scheduler, bm = engine.scheduler, engine.scheduler.block_manager
    hog = Request("hog", list(range(1, 9)), SamplingParams(max_tokens=1), 1,
                  kv_transfer=KVTransferParams(do_remote_decode=True))
    engine.add_request(hog)
    run(engine)  # holds blocks 0 and 1
    decode = Request("d", list(range(1, 11)), SamplingParams(max_tokens=4), 4)
    decode.output_token_ids.append(1010)  # sampled on the prefill instance
    decode.num_computed_tokens = 10
    assert scheduler.add_prefilled(decode) is None and "d" not in bm.block_tables  # 3 blocks needed, 2 free
    scheduler.release_kv("hog")
    assert scheduler.add_prefilled(decode) == [2, 3, 0]  # the free list: unused blocks first, then freed ones
    assert decode.status is RequestStatus.WAITING and scheduler.num_waiting == 1
    outputs = run(engine)
    first = executor.plans[-3].scheduled[0]
    assert (first.request_id, first.token_ids, first.num_computed_tokens) == ("d", [1010], 10)
    assert first.prompt_token_ids == list(range(1, 11)) and first.output_token_ids == [1010]
    assert [t.token_id for o in outputs for t in o.new_tokens] == [1011, 1012, 1013]
    assert decode.output_token_ids == [1010, 1011, 1012, 1013] and outputs[-1].finish_reason == "length"
    assert bm.num_free_blocks == 4
