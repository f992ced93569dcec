"""A worker killed mid-generation: the driver raises a clear error at the next step instead of
hanging in a collective, and no process of the engine is left."""
import multiprocessing
import os
import signal

import pytest
from tp_helpers import random_prompts

from servelab import LLM, SamplingParams
from servelab.executor.multiproc_executor import WorkerError

MAX_STEPS = 200


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigkilled_worker_raises_and_leaves_no_process(tiny_gqa_dir):
    llm = LLM(str(tiny_gqa_dir), dtype="float32", tensor_parallel_size=2, num_kv_blocks=64)
    engine, pids = llm.engine, llm.engine.executor.worker_pids
    params = SamplingParams(temperature=0, max_tokens=MAX_STEPS, ignore_eos=True)
    try:
        for i, prompt in enumerate(random_prompts((3, 9, 20))):
            engine.add_request(engine.input_processor.process_inputs(f"r{i}", {"prompt_token_ids": prompt}, params))
        outputs = [out for _ in range(4) for out in engine.step()]  # prefill and a few decode steps
        assert outputs and not any(out.finished for out in outputs)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerError, match=rf"rank 1 \(pid {pids[1]}\) was killed by SIGKILL"):
            for _ in range(MAX_STEPS):
                engine.step()
        # The executor stopped every worker before raising; later steps fail at once.
        assert not any(pid_exists(pid) for pid in pids)
        with pytest.raises(WorkerError, match="stopped"):
            engine.step()
    finally:
        llm.shutdown()
    assert multiprocessing.active_children() == []
