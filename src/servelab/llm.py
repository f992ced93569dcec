"""Offline batch generation with vLLM's API: LLM(...).generate(prompts, sampling_params)."""
from __future__ import annotations

from typing import Sequence

from tqdm import tqdm

from servelab.engine.input_processor import PromptType
from servelab.engine.llm_engine import LLMEngine
from servelab.engine_args import EngineArgs
from servelab.outputs import RequestOutput
from servelab.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        """kwargs are EngineArgs fields: dtype, schedule, max_num_seqs, max_num_batched_tokens,
        max_model_len, kv_cache_memory, block_size, num_kv_blocks, enable_prefix_caching, kv_cache_dtype, num_threads,
        tensor_parallel_size, and for ranks on several machines nnodes, master_addr, master_port (this is
        node 0; the others run `servelab serve --headless`). With tensor_parallel_size > 1 the model runs in
        that many spawned worker processes: call shutdown() (or let the LLM be garbage-collected, or the
        interpreter exit) to stop them."""
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any; the LLM cannot generate afterwards."""
        self.engine.executor.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        engine = self.engine
        # Process everything first so a bad prompt leaves nothing half-queued.
        requests = [engine.input_processor.process_inputs(engine.new_request_id(), prompt, p)
                    for prompt, p in zip(prompts, params)]
        for request in requests:
            engine.add_request(request)
        return self._run([r.request_id for r in requests], use_tqdm if use_tqdm is not None else len(prompts) >= 16)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tokenizer.encode(tokenizer.apply_chat_template(c), add_special_tokens=False)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _params_list(sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return params

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for request_id in ids:
                if request_id not in done:
                    self.engine.abort_request(request_id)
        return [done[i] for i in ids]
