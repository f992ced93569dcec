"""The input processor (one place that tokenizes and validates) and the output processor (values in,
RequestOutputs and the ids a stop string ended out), alone and in a real LLMEngine over a stub executor."""
import pytest

from servelab.core.engine_io import EngineCoreTimes, EngineLimits
from servelab.engine.core_proc.core_protocol import RequestDelta
from servelab.engine.input_processor import ContextLengthExceeded, child_requests
from servelab.engine.output_processor import OutputProcessor
from servelab.sampling_params import SamplingParams
from servelab.testing.stub_engine import VOCAB, make_engine, tiny_tokenizer, word_id


def test_process_inputs_tokenizes_and_clamps_max_tokens():
    engine = make_engine(num_blocks=16, block_size=4, max_model_len=64)
    process = engine.input_processor.process_inputs
    assert engine.limits == EngineLimits(max_model_len=64, vocab_size=len(VOCAB), num_blocks=16, block_size=4)
    r = process("r", "hi w1", SamplingParams(max_tokens=None), arrival_time=12.5)
    assert (r.request_id, r.prompt, r.prompt_token_ids) == ("r", "hi w1", [VOCAB.index("hi"), word_id(1)])
    assert (r.max_tokens, r.eos_token_ids, r.arrival_time) == (62, (0,), 12.5)
    assert process("r", {"prompt_token_ids": [2, 2, 2]}, SamplingParams(max_tokens=100)).max_tokens == 61
    assert process("r", {"prompt": "hi"}, SamplingParams(max_tokens=5)).max_tokens == 5
    with pytest.raises(ContextLengthExceeded, match=r"requested 102 tokens \(2 in the prompt, 100 for max_tokens\)"):
        process("r", "hi w1", SamplingParams(max_tokens=100), clamp_max_tokens=False)
    with pytest.raises(ContextLengthExceeded, match="the prompt is 64 tokens"):
        process("r", [2] * 64, SamplingParams())


@pytest.mark.parametrize("prompt,max_tokens,message", [
    ("", 1, "empty"),
    ([2, len(VOCAB)], 1, "outside the vocabulary"),
    ([2, -1], 1, "outside the vocabulary"),
    (3.5, 1, "a prompt must be"),
    ({"text": "hi"}, 1, "needs 'prompt' or 'prompt_token_ids'"),
    ([2], 32, "33 tokens of KV cache .* holds 32"),  # 9 blocks of 4 in a pool of 8
])
def test_process_inputs_rejects(prompt, max_tokens, message):
    engine = make_engine(num_blocks=8, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=message):
        engine.input_processor.process_inputs("r", prompt, SamplingParams(max_tokens=max_tokens))
    assert engine.input_processor.process_inputs("r", [2], SamplingParams(max_tokens=31)).max_tokens == 31


def test_child_requests_split_n_samples_with_distinct_seeds():
    engine = make_engine()
    one = engine.input_processor.process_inputs("r", "hi", SamplingParams(max_tokens=3))
    assert child_requests(one) == [one]
    three = engine.input_processor.process_inputs("r", "hi", SamplingParams(n=3, seed=5, max_tokens=3))
    children = child_requests(three)
    assert [c.request_id for c in children] == ["0_r", "1_r", "2_r"]
    assert [(c.sampling_params.n, c.sampling_params.seed) for c in children] == [(1, 5), (1, 6), (1, 7)]
    assert all(c.prompt_token_ids == three.prompt_token_ids and c.max_tokens == 3 for c in children)


def test_output_processor_reports_a_stop_string_instead_of_calling_the_core():
    engine = make_engine()
    request = engine.input_processor.process_inputs("r", "hi", SamplingParams(max_tokens=10, stop=["w1 w2"]),
                                                    arrival_time=1.0)
    processor = OutputProcessor(tiny_tokenizer(), cumulative=True)
    processor.add_request(request, [request])

    def out(position, t):
        times = EngineCoreTimes(1.0, 1.5, 2.0, t, None, 0)
        return RequestDelta("r", [word_id(position)], None, None, times)

    first = processor.process([out(1, 2.0)])
    assert first.stopped_request_ids == [] and first.request_outputs[0].outputs[0].text == ""  # " w1" held back
    second = processor.process([out(2, 3.0)])
    assert second.stopped_request_ids == ["r"]
    final = second.request_outputs[0]
    c = final.outputs[0]
    assert final.finished and (c.text, c.finish_reason, c.stop_reason) == (" ", "stop", "w1 w2")
    assert c.token_ids == [word_id(1), word_id(2)]
    assert (final.metrics.arrival_time, final.metrics.first_token_time, final.metrics.finished_time) == (1.0, 2.0, 3.0)
    assert not processor.has("r") and processor.process([out(3, 4.0)]).request_outputs == []


def test_stop_string_is_retired_in_the_core_after_the_step():
    engine = make_engine()
    process = engine.input_processor.process_inputs
    engine.add_request(process("s", "hi", SamplingParams(max_tokens=20, stop="w2")))
    engine.add_request(process("other", "hi", SamplingParams(max_tokens=20)))
    finished = []
    while not finished:
        finished = [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.outputs[0].finish_reason, o.outputs[0].text) for o in finished] == [("s", "stop", " w1 ")]
    assert finished[0].metrics.finished_time is not None
    state = engine.get_state()
    assert state.num_running == 1 and state.num_free_blocks == state.num_blocks - 1
    engine.step()
    assert engine.executor.plans[-1].finished_request_ids == ["s"]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.is_idle()


def test_n_samples_abort_together():
    engine = make_engine()
    engine.add_request(engine.input_processor.process_inputs("r", "hi", SamplingParams(n=2, max_tokens=50)))
    with pytest.raises(ValueError, match="duplicate request id"):
        engine.add_request(engine.input_processor.process_inputs("r", "hi", SamplingParams(max_tokens=1)))
    for _ in range(3):
        outputs = engine.step()
    assert [len(c.token_ids) for c in outputs[0].outputs] == [3, 3]
    aborted = engine.abort_request("r")
    assert len(aborted) == 1 and aborted[0].finished
    assert [(c.finish_reason, len(c.token_ids)) for c in aborted[0].outputs] == [("abort", 3), ("abort", 3)]
    assert engine.is_idle() and engine.abort_request("r") == []
