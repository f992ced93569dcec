"""A scripted stand-in for LLMEngine: one token per request per step, no model."""
import threading
import time
from types import SimpleNamespace

from servelab.core.engine import StepStats
from servelab.outputs import CompletionOutput, RequestMetrics, RequestOutput


class FakeEngine:
    """One token per request per step; a request finishes after params.max_tokens tokens."""

    def __init__(self) -> None:
        self.requests: dict[str, list] = {}
        self.num_steps = 0
        self.fail_next_step = False
        self.step_delay = 0.0
        self.last_step_stats = None
        self.scheduler = SimpleNamespace(num_waiting=0, max_num_seqs=8, num_preemptions_total=0)
        self.block_manager = SimpleNamespace(num_blocks=10, num_free_blocks=10, block_size=16,
                                             num_reserved_unused_slots=lambda: 0, check_invariants=lambda: None)
        self.thread_ids = set()

    @property
    def usage(self):
        return len(self.requests) / 10

    def add_request(self, request_id, prompt, params, arrival_time=None):
        self.thread_ids.add(threading.get_ident())
        if prompt == "bad":
            raise ValueError("bad prompt")
        self.requests[request_id] = [params, [], arrival_time]
        self._sync()

    def abort_request(self, request_id):
        entry = self.requests.pop(request_id, None)
        self._sync()
        return [] if entry is None else [self._output(request_id, entry, "abort")]

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.thread_ids.add(threading.get_ident())
        self.num_steps += 1
        time.sleep(self.step_delay)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        outputs = []
        for request_id, entry in list(self.requests.items()):
            entry[1].append(len(entry[1]))
            done = len(entry[1]) >= entry[0].max_tokens
            if done:
                del self.requests[request_id]
            outputs.append(self._output(request_id, entry, "length" if done else None))
        self.last_step_stats = StepStats(0.0, 0.001, len(outputs), 0, len(outputs), len(self.requests), 0, 0,
                                         self.usage, 0)
        self._sync()
        return outputs

    def _sync(self):
        self.scheduler.num_running = len(self.requests)
        self.block_manager.usage = self.usage
        self.block_manager.num_free_blocks = 10 - len(self.requests)

    @staticmethod
    def _output(request_id, entry, finish_reason):
        params, tokens, arrival = entry
        completion = CompletionOutput(0, "".join(f"t{t} " for t in tokens), list(tokens), finish_reason=finish_reason)
        return RequestOutput(request_id, None, [1, 2, 3], [completion], finish_reason is not None,
                             RequestMetrics(arrival or 0.0, arrival, arrival, None))


class FakeTokenizer:
    eos_token_ids = (0,)

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"t{i} " for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(m["content"] for m in messages)


class FakeLLMEngine(FakeEngine):
    """FakeEngine plus what the gateway reads from an LLMEngine."""

    max_model_len = 64

    def __init__(self) -> None:
        super().__init__()
        self.tokenizer = FakeTokenizer()
        self.executor = SimpleNamespace(weight_bytes=100)

    def encode_prompt(self, prompt):
        return (None, list(prompt)) if isinstance(prompt, list) else (prompt, self.tokenizer.encode(prompt))

    def validate(self, token_ids, params):
        if not token_ids:
            raise ValueError("the prompt is empty")
        return params.max_tokens
