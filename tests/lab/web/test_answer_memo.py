"""The lab server keeps its last answers: the same input answers at once, with the bytes the worker gave, without
taking the lane (a second job in a busy lane would be a 429); a new local-cpu profile, another input or the
"measured" command (its result files change) run again; the oldest answer goes first."""
import asyncio
import json
import os

import pytest

from servelab.errors import OpenAIError
from servelab.lab import api
from servelab.lab.web.params import lab_request
from servelab.lab.web.routes import AnswerMemo, LabOutcome, LabRunner

SMALL = {"model": "llama-3.1-8b", "gpu": "h100", "num_prompts": 20, "input_len": 128, "output_len": 16}


def test_a_repeated_input_is_answered_from_the_memo_without_the_lane(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path))
    runner = LabRunner()
    try:
        first = asyncio.run(runner.run("simulate", lab_request("simulate", SMALL), "en"))
        assert json.loads(first.text) == json.loads(api.format_json(api.simulate(lab_request("simulate", SMALL))
                                                                    .to_json()))
        runner.running_by_lane["interactive"] = "simulate"  # the lane is busy: only the memo can answer
        again = asyncio.run(runner.run("simulate", lab_request("simulate", dict(reversed(SMALL.items()))), "en"))
        assert again.text == first.text
        with pytest.raises(OpenAIError) as busy:  # another input needs the lane
            asyncio.run(runner.run("simulate", lab_request("simulate", {**SMALL, "output_len": 17}), "en"))
        assert (busy.value.status, busy.value.code) == (429, "lab_busy")
        profile = tmp_path / "lab" / "local-cpu.json"  # a new profile changes what local-cpu answers
        profile.parent.mkdir(parents=True)
        profile.write_text("{}")
        with pytest.raises(OpenAIError) as busy:
            asyncio.run(runner.run("simulate", lab_request("simulate", SMALL), "en"))
        assert busy.value.code == "lab_busy"
        del runner.running_by_lane["interactive"]
    finally:
        runner.close()


def test_the_memo_keeps_the_newest_answers_and_never_errors_or_measured_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path))
    memo = AnswerMemo(size=2)
    keys = [memo.key("advise", n) for n in range(3)]
    for n, key in enumerate(keys):
        memo.put(key, LabOutcome(text=str(n)))
    assert memo.get(keys[0]) is None and memo.get(keys[2]).text == "2"
    memo.get(keys[1])  # used: now the newest, so the next put evicts keys[2]
    memo.put(memo.key("advise", 3), LabOutcome(text="3"))
    assert memo.get(keys[1]).text == "1" and memo.get(keys[2]) is None
    assert memo.key("measured", 0) is None
    failed = memo.key("simulate", "bad")
    memo.put(failed, LabOutcome(error=ValueError("bad")))
    assert memo.get(failed) is None
    os.makedirs(tmp_path / "lab")
    (tmp_path / "lab" / "local-cpu.json").write_text("{}")
    assert memo.key("advise", 1) != keys[1]
