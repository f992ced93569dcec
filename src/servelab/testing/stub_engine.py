"""A real LLMEngine (scheduler, block manager, input and output processors, a real `tokenizers` tokenizer)
over a stub executor that needs no model: the sampled token depends only on the position."""
import threading
import time

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from servelab.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from servelab.specs import ModelSpec
from servelab.core.plan import SampledToken, StepPlan, StepResult
from servelab.engine.llm_engine import LLMEngine
from servelab.model.tokenizer import Tokenizer

EOS = "<eos>"
WORDS = [f"w{i}" for i in range(32)]
VOCAB = [EOS, "<unk>", "hi", "hello", *WORDS]
FIRST_WORD_ID = VOCAB.index("w0")
UNK = VOCAB.index("<unk>")


def _zeros(shape):
    import torch

    return torch.zeros(shape)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"


def tiny_tokenizer() -> Tokenizer:
    """Whitespace-split words; decode joins them with spaces. <eos> is special (skipped in text)."""
    backend = BackendTokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([EOS])
    return Tokenizer(backend, {"eos_token": EOS}, {}, CHAT_TEMPLATE, name="tiny")


def word_id(position: int) -> int:
    """The token the stub samples after `position` tokens of context: w{position % 32}."""
    return FIRST_WORD_ID + position % len(WORDS)


class FatalFault(BaseException):
    """Not an Exception: the engine loop cannot recover from it, so the engine core dies (engine_dead)."""


class StubExecutor:
    """Samples word_id(context length) for each request that samples this step (EOS where eos_at_position
    says so); records the plans. Optionally sleeps per step, fails the next step, or fails the first step
    that computes token fail_on_token_id (a trigger that works in an engine-core process too).

    The fault hook (tests only, no user flag): every step that computes token fail_every_token_id raises
    (a client triggers it with that word in its prompt, so it works across processes); the first step that
    computes fatal_on_token_id raises FatalFault, which kills the engine core."""

    weight_bytes = 1000
    weight_bytes_per_rank = (1000,)
    worker_ranks = ()

    def __init__(self, num_blocks: int, step_delay: float = 0.0, eos_at_position: int | None = None,
                 fail_on_token_id: int | None = None, fail_every_token_id: int | None = None,
                 fatal_on_token_id: int | None = None, keep_plans: bool = True,
                 block_size: int | None = None) -> None:
        self.num_blocks = num_blocks
        # With a block size: a real KV cache of one layer, (2, num_blocks, block_size, 1 head, 2). Each step
        # writes (token id, position + 1) at the slots it computes, and a request samples "<unk>" instead of
        # its word when any earlier position of its context is missing (so KV that did not arrive shows).
        self.block_size = block_size
        self.kv_caches = [] if block_size is None else [_zeros((2, num_blocks, block_size, 1, 2))]
        self.eos_at_position = eos_at_position
        self.step_delay = step_delay
        self.fail_next_step = False
        self.fail_on_token_id = fail_on_token_id
        self.fail_every_token_id = fail_every_token_id
        self.fatal_on_token_id = fatal_on_token_id
        self.num_injected_faults = 0
        self.keep_plans = keep_plans  # off for long runs (the soak): every plan kept is memory that grows
        self.plans: list[StepPlan] = []
        self.num_steps = 0

    def shutdown(self) -> None:
        pass

    def execute(self, plan: StepPlan) -> StepResult:
        self.num_steps += 1
        if self.keep_plans:
            self.plans.append(plan)
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        if self.fail_on_token_id is not None and any(self.fail_on_token_id in s.token_ids for s in plan.scheduled):
            self.fail_on_token_id = None
            raise RuntimeError("boom")
        computed = {t for s in plan.scheduled for t in s.token_ids}
        if self.fatal_on_token_id in computed:
            raise FatalFault("injected fatal fault")
        if self.fail_every_token_id in computed:
            self.num_injected_faults += 1
            raise RuntimeError("injected fault")
        if self.kv_caches:
            self._write_kv(plan)
        sampled = {s.request_id: SampledToken(0 if s.context_len == self.eos_at_position else
                                              word_id(s.context_len) if self._kv_complete(s) else UNK)
                   for s in plan.scheduled if s.sample}
        return StepResult(sampled=sampled)

    def _slot(self, s, position: int) -> tuple[int, int]:
        return s.block_ids[position // self.block_size], position % self.block_size

    def _write_kv(self, plan: StepPlan) -> None:
        cache = self.kv_caches[0]
        for s in plan.scheduled:
            for offset, token_id in enumerate(s.token_ids):
                position = s.num_computed_tokens + offset
                block, slot = self._slot(s, position)
                cache[0, block, slot, 0] = float(token_id)
                cache[1, block, slot, 0] = float(position + 1)

    def _kv_complete(self, s) -> bool:
        if not self.kv_caches:
            return True
        cache = self.kv_caches[0]
        known = s.prompt_token_ids + (s.output_token_ids or []) if s.prompt_token_ids is not None else []
        for p in range(s.context_len):
            block, slot = self._slot(s, p)
            if cache[1, block, slot, 0, 0].item() != p + 1:
                return False
            if p < len(known) and cache[0, block, slot, 0, 0].item() != known[p]:
                return False  # a stale block of an earlier request
        return True


class CheckedEngine(LLMEngine):
    """The real LLMEngine, checking the block manager's invariants after every step and recording which
    threads called it."""

    executor: StubExecutor

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.thread_ids: set[int] = set()

    def add_core_request(self, request):
        self.thread_ids.add(threading.get_ident())
        return super().add_core_request(request)

    def step_core(self):
        self.thread_ids.add(threading.get_ident())
        outputs = super().step_core()
        self.check_invariants()
        return outputs

    def is_idle(self) -> bool:
        """Nothing queued or running and every KV block free."""
        state = self.get_state()
        return (not self.has_unfinished_requests() and state.num_running == state.num_waiting == 0
                and state.num_free_blocks == state.num_blocks and state.kv_usage == 0)


def make_engine(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 128, max_num_seqs: int = 8,
                policy: str = "continuous", kv_transfer: KVTransferConfig | None = None,
                **executor_options) -> CheckedEngine:
    """executor_options: StubExecutor's step_delay, eos_at_position, fail_on_token_id. Importable by module
    path, so an engine-core process (spawned) can build it through an EngineFactory."""
    model = ModelSpec("stub", "stub", "LlamaForCausalLM", vocab_size=len(VOCAB), hidden_size=8, intermediate_size=16,
                      num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                      max_position_embeddings=max_model_len)
    config = EngineConfig(model, CacheConfig(block_size=block_size, num_blocks=num_blocks),
                          SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                                          max_model_len=max_model_len), kv_transfer=kv_transfer)
    if kv_transfer is None:
        return CheckedEngine(config, tiny_tokenizer(), StubExecutor(num_blocks, **executor_options), "stub")
    from servelab.kv_transfer.p2p_connector import P2PKVConnector

    executor = StubExecutor(num_blocks, block_size=block_size, **executor_options)
    return CheckedEngine(config, tiny_tokenizer(), executor, "stub",
                         P2PKVConnector.from_config(kv_transfer, executor.kv_caches))
