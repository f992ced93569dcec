"""The offline API: input forms, sampling features through the whole engine, bad input."""
import subprocess
import sys

import pytest

from servelab import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=256)


def clean(llm):
    state = llm.engine.get_state()
    assert not llm.engine.has_unfinished_requests()
    assert state.num_free_blocks == state.num_blocks
    llm.engine.check_invariants()


def test_outputs_in_input_order_with_per_request_params(llm):
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (5, 1, 9)]
    outs = llm.generate(["hello", {"prompt_token_ids": [5, 6, 7]}, "a longer prompt here"], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 1, 9]
    assert outs[1].prompt_token_ids == [5, 6, 7]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert outs[0].outputs[0].text == llm.get_tokenizer().decode(outs[0].outputs[0].token_ids)
    clean(llm)


def test_seeded_sampling_is_reproducible_regardless_of_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    alone = llm.generate(["the same prompt"], seeded)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=12)
    batch = llm.generate(["other", "the same prompt", "more"], [noise, seeded, noise])
    assert batch[1].outputs[0].token_ids == alone
    different = llm.generate(["the same prompt"], SamplingParams(temperature=1.0, top_p=0.9, seed=99,
                                                                 max_tokens=12))[0].outputs[0].token_ids
    assert different != alone
    clean(llm)


def test_n_samples_and_logprobs(llm):
    out = llm.generate("x y z", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=3))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # distinct seeds per sample
    for c in out.outputs:
        assert len(c.logprobs) == 6
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert lp.token_id == tok and len(lp.top_logprobs) == 3
            assert lp.top_logprobs[0][1] >= lp.logprob - 1e-6
        assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs))
    clean(llm)


def test_stop_token_ids_and_stop_strings(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20)
    ref = llm.generate("stop here", greedy)[0].outputs[0]
    stop_id = ref.token_ids[4]
    first = ref.token_ids.index(stop_id)
    out = llm.generate("stop here", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]))[0]
    c = out.outputs[0]
    assert c.token_ids == ref.token_ids[:first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_id
    # a stop string cut out of the reference text: the output ends right before it
    text = ref.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip()
    c = llm.generate("stop here", SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:text.index(stop)]
    clean(llm)


def test_eos_stops_unless_ignore_eos(default_model_dir):
    llm = LLM(str(default_model_dir), dtype="float32", max_model_len=512, num_kv_blocks=256)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    stopped = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert stopped.token_ids[-1] in llm.engine.eos_token_ids
    assert "Paris" in stopped.text and "<|im_end|>" not in stopped.text
    n = len(stopped.token_ids) + 5
    forced = llm.chat(chat, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0]
    assert forced.finish_reason == "length" and len(forced.token_ids) == n
    assert forced.token_ids[:len(stopped.token_ids)] == stopped.token_ids
    clean(llm)


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=3))[0]
    tok = llm.get_tokenizer()
    expected = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]), add_special_tokens=False)
    assert out.prompt_token_ids == expected
    assert tok.decode(expected, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    clean(llm)


@pytest.mark.parametrize("prompt,params,message", [
    ("", SamplingParams(), "empty"),
    ({"prompt_token_ids": list(range(5, 300))}, SamplingParams(), "context length is 256"),
    ({"prompt_token_ids": [10 ** 7]}, SamplingParams(), "outside the vocabulary"),
])
def test_bad_input_is_a_value_error_and_engine_keeps_serving(llm, prompt, params, message):
    engine = llm.engine
    engine.add_request(engine.input_processor.process_inputs("good", "keep going",
                                                             SamplingParams(temperature=0, max_tokens=4)))
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params)
    with pytest.raises(ValueError, match=message):
        engine.input_processor.process_inputs("bad", prompt, params)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["good"] and len(done[0].outputs[0].token_ids) == 4
    clean(llm)


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_tokens=0), "max_tokens must be >= 1"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(temperature=-1), "temperature"),
    (dict(n=0), "n must be"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))


def test_cli_generate_streams_and_reports_errors(tiny_llama_dir):
    run = lambda *a: subprocess.run([sys.executable, "-m", "servelab.entrypoints.cli", *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=300)
    ok = run("generate", "hello", "--model", str(tiny_llama_dir), "--max-tokens", "5", "--dtype", "float32",
             "--num-kv-blocks", "64")
    assert ok.returncode == 0 and ok.stdout.strip(), ok.stderr
    bad = run("generate", "hello", "--model", "/nonexistent/model")
    assert bad.returncode == 2 and "servelab: error:" in bad.stderr and "Traceback" not in bad.stderr
