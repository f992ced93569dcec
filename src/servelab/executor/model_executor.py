"""Runs a StepPlan on the real model: builds the flattened batch, runs the forward pass over the paged
KV cache, samples. Owns all device state (weights, KV tensors, per-request sampling history).

The single-process engine uses it directly; under tensor parallelism every worker process holds one,
built with its rank's TensorParallelGroup, and only the first rank's samples are returned."""
from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from servelab.config import CacheConfig
from servelab.core.block_manager import num_blocks_for_memory
from servelab.core.plan import SampledToken, ScheduledRequest, StepPlan, StepResult
from servelab.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from servelab.model.attention import AttentionMetadata, PrefillChunk
from servelab.model.llama import LlamaForCausalLM
from servelab.model.gguf_weights import load_gguf_weights
from servelab.model.loader import load_state_dict
from servelab.model.sampler import Sampler, SamplingRow, plain_greedy
from servelab.model.quant.quant_cache import config_hash, entry_path, load_entry, model_content_hash, save_entry
from servelab.model.quant.smooth_quant import CALIBRATION_CHUNK_TOKENS, CALIBRATION_TEXT, SMOOTHQUANT_ALPHA, InputAbsMax
from servelab.model.tokenizer import Tokenizer
from servelab.specs import ModelSpec

logger = logging.getLogger(__name__)


def kv_cache_bytes(cache_config: CacheConfig) -> int:
    memory = cache_config.kv_cache_memory
    if memory < 1:
        return int(memory * os_total_memory())
    return int(memory * (1 << 30))


def os_total_memory() -> int:
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_MATRIX_SUFFIXES = tuple(f"{n}_proj.weight" for n in ("q", "k", "v", "o", "gate", "up", "down"))


def is_matrix_weight(name: str) -> bool:
    """A Hugging Face tensor that --quantization int8 replaces (every linear layer's matrix, the untied LM head)."""
    return name.endswith(_MATRIX_SUFFIXES) or name == "lm_head.weight"


@dataclass
class Int8Entry:
    """Where --quantization int8's calibration and weights for a model folder are cached (model/quant/quant_cache.py)."""
    path: Path
    model_hash: str
    settings_hash: str
    loaded: bool = False

    @classmethod
    def of(cls, folder: Path, dtype: torch.dtype, block_size: int) -> "Int8Entry":
        model_hash = model_content_hash(folder)
        settings = config_hash(text_sha256=hashlib.sha256(CALIBRATION_TEXT.read_bytes()).hexdigest(),
                               alpha=SMOOTHQUANT_ALPHA, chunk_tokens=CALIBRATION_CHUNK_TOKENS,
                               block_size=block_size, dtype=str(dtype))
        return cls(entry_path(model_hash, settings), model_hash, settings)

    def load_into(self, model: LlamaForCausalLM) -> bool:
        """The cached int8 matrices into model (before its float weights load); False where there is no valid
        entry for them."""
        cached = load_entry(self.path, self.model_hash, self.settings_hash)
        self.loaded = cached is not None and model.load_int8(cached)
        if self.loaded:
            logger.info("int8 weights from the cache: %s", self.path)
        return self.loaded


class ModelExecutor:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, cache_dtype: str = "auto") -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        # (2, num_blocks, block_size, this rank's num_kv_heads, head_dim) per layer (int8: head_dim + 4 bytes
        # a row). Zeroed: masked-out slots are still multiplied by a 0 attention weight, and 0 * NaN from
        # uninitialised memory would poison the output.
        self.kv_caches = [torch.zeros(model.kv_cache_shape(num_blocks, block_size, cache_dtype),
                                      dtype=model.kv_cache_dtype(cache_dtype))
                          for _ in range(cfg.num_hidden_layers)]
        self.sampler = Sampler()
        self._rows: dict[str, SamplingRow] = {}

    @classmethod
    def from_pretrained(cls, folder: Path, model_config: ModelSpec, cache_config: CacheConfig,
                        dtype: torch.dtype, max_model_len: int,
                        tp: TensorParallelGroup = SINGLE_RANK, quantization: str | None = None,
                        gguf_path: Path | None = None) -> "ModelExecutor":
        """kv_cache_memory is per rank (as vLLM's memory budget is per device): a rank holding 1/N of
        the KV heads fits N times the blocks. quantization "gguf" reads gguf_path's blocks instead of
        the converted folder's float weights."""
        # int8 calibrates in chunks of CALIBRATION_CHUNK_TOKENS, whatever the context length
        max_positions = max(max_model_len, CALIBRATION_CHUNK_TOKENS) if quantization == "int8" else max_model_len
        model = LlamaForCausalLM(model_config, dtype, max_positions=max_positions, tp=tp, quantization=quantization)
        int8_entry = Int8Entry.of(folder, dtype, cache_config.block_size) if quantization == "int8" else None
        if quantization == "gguf":
            if gguf_path is None:
                raise ValueError("quantization 'gguf' needs the .gguf file")
            model.load_weights(load_gguf_weights(gguf_path, dtype))
        elif int8_entry is not None and int8_entry.load_into(model):
            # every matrix is int8 already: its float weights are not read
            model.load_weights(load_state_dict(folder, dtype, skip=is_matrix_weight))
        else:
            model.load_weights(load_state_dict(folder, dtype))
        model.eval()
        cache_dtype = cache_config.cache_dtype
        kv_bytes_per_token = (model_config.num_hidden_layers * math.prod(model.kv_cache_shape(1, 1, cache_dtype))
                              * model.kv_cache_dtype(cache_dtype).itemsize)
        num_blocks = cache_config.num_blocks or num_blocks_for_memory(
            kv_cache_bytes(cache_config), kv_bytes_per_token, cache_config.block_size)
        if num_blocks < 1:
            raise ValueError("kv_cache_memory is too small to hold a single KV block")
        executor = cls(model, num_blocks, cache_config.block_size, cache_dtype)
        if int8_entry is not None and not int8_entry.loaded:
            executor.quantize_int8(folder, int8_entry)
        return executor

    def quantize_int8(self, folder: Path, entry: "Int8Entry") -> None:
        """SmoothQuant-calibrate the float model, make every matrix int8 and cache both in entry. A
        tensor-parallel rank takes its part of the single-rank result (from a single-rank model it calibrates
        itself), so that every tensor-parallel size runs the same int8 values."""
        model = self.model
        if model.tp.world_size > 1:
            single = ModelExecutor.from_pretrained(
                folder, model.config, CacheConfig(block_size=self.block_size, num_blocks=1), model.dtype,
                CALIBRATION_CHUNK_TOKENS, quantization="int8")
            if not model.load_int8(single.model.int8_state()):
                raise ValueError("the single-rank int8 weights do not fit this rank's shapes")
            return
        started = time.perf_counter()
        calibration_ids = Tokenizer.from_pretrained(folder).encode(CALIBRATION_TEXT.read_text(encoding="utf-8"))
        input_absmax = self.linear_input_absmax(calibration_ids)
        model.quantize_int8(input_absmax)
        tensors = {**{f"absmax.{name}": v for name, v in input_absmax.items()}, **model.int8_state()}
        try:
            save_entry(entry.path, tensors, entry.model_hash, entry.settings_hash)
            logger.info("int8: calibrated on %d tokens and quantized in %.1f s; cached in %s", len(calibration_ids),
                        time.perf_counter() - started, entry.path)
        except OSError as exc:  # a read-only or full cache: the next start calibrates again
            logger.warning("could not cache the int8 weights in %s: %s", entry.path, exc)

    def linear_input_absmax(self, token_ids: list[int]) -> dict[str, torch.Tensor]:
        """max |x| per input channel of every linear layer while the float model prefills token_ids in chunks
        of CALIBRATION_CHUNK_TOKENS, over a KV cache of its own in the model's dtype (so the statistics do not
        depend on the engine's KV cache size or dtype): SmoothQuant's calibration."""
        chunk = min(CALIBRATION_CHUNK_TOKENS, self.model.rope.cos.shape[0])
        num_blocks = -(-chunk // self.block_size)
        kv_caches = [torch.zeros(self.model.kv_cache_shape(num_blocks, self.block_size), dtype=self.model.dtype)
                     for _ in self.kv_caches]
        with InputAbsMax(self.model.named_linear_layers()) as observed, torch.inference_mode():
            for start in range(0, len(token_ids), chunk):
                part = token_ids[start:start + chunk]
                request = ScheduledRequest("calibration", part, 0, list(range(-(-len(part) // self.block_size))),
                                           sample=False, sampling_params=None)
                input_ids, positions, meta = self._prepare([], [request])
                observed.record("head", self.model(input_ids, positions, kv_caches, meta))
        return observed.absmax

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes()

    @property
    def weight_bytes_per_rank(self) -> tuple[int, ...]:
        return (self.weight_bytes,)

    @property
    def worker_ranks(self) -> tuple:
        """No worker process: the model runs in the caller's process."""
        return ()

    def shutdown(self) -> None:
        """Nothing to stop in one process; here so every executor can be shut down alike."""

    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        for request_id in plan.finished_request_ids + plan.preempted_request_ids:
            self._rows.pop(request_id, None)
        for s in plan.scheduled:
            if s.prompt_token_ids is not None:
                self._rows[s.request_id] = SamplingRow(s.sampling_params, s.prompt_token_ids,
                                                       list(s.output_token_ids or ()))
        if not plan.scheduled:
            return StepResult(duration=time.perf_counter() - start)
        decodes = [s for s in plan.scheduled if s.num_new_tokens == 1 and s.num_computed_tokens > 0]
        prefills = [s for s in plan.scheduled if not (s.num_new_tokens == 1 and s.num_computed_tokens > 0)]
        ordered = decodes + prefills
        input_ids, positions, meta = self._prepare(decodes, prefills)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            sample_rows, sampled_reqs, rows, row = [], [], [], 0
            for s in ordered:
                row += s.num_new_tokens
                if s.sample:
                    sampled_reqs.append(s)
                    row_state = self._rows[s.request_id]
                    if s.num_spec_tokens:  # one sample after the last sampled token and after each draft
                        sample_rows += range(row - 1 - s.num_spec_tokens, row)
                        rows += _draft_rows(row_state, s.token_ids[1:])
                    else:
                        sample_rows.append(row - 1)
                        rows.append(row_state)
            bitmask = _grammar_rows(plan, sampled_reqs)
            if bitmask is not None and len(rows) > len(sampled_reqs):  # a grammar row for each draft's sample too
                bitmask = bitmask.repeat_interleave(torch.tensor([1 + s.num_spec_tokens for s in sampled_reqs]), dim=0)
            tokens = self._sample(hidden[sample_rows], rows, bitmask) if rows else []
        sampled, spec_sampled, index = {}, {}, 0
        for s in sampled_reqs if tokens else ():  # no tokens on a rank that gets no logits back
            output_token_ids = self._rows[s.request_id].output_token_ids
            if s.num_spec_tokens:
                accepted = _verify_greedy(s.token_ids[1:], tokens[index:index + 1 + s.num_spec_tokens])
                index += 1 + s.num_spec_tokens
                output_token_ids += [t.token_id for t in accepted]
                spec_sampled[s.request_id] = accepted
            else:
                output_token_ids.append(tokens[index].token_id)
                sampled[s.request_id] = tokens[index]
                index += 1
        return StepResult(sampled=sampled, duration=time.perf_counter() - start, spec_sampled=spec_sampled)

    def _sample(self, hidden: torch.Tensor, rows: list[SamplingRow],
                grammar_bitmask: torch.Tensor | None = None) -> list[SampledToken]:
        """One token per row of hidden; none on a rank that gets no logits back."""
        if plain_greedy(rows):
            tokens = self.model.greedy_tokens(hidden)  # a W8A8 head's argmaxes, without fp32 logits
            if tokens is not None:
                return [SampledToken(t) for t in tokens.tolist()]
        # Every rank computes its vocabulary slice; only the first rank gets logits back, and samples.
        logits = self.model.compute_logits(hidden)
        if logits is None:
            return []
        if grammar_bitmask is not None:
            grammar_bitmask = grammar_bitmask.to(logits.device, non_blocking=True)
        return self.sampler(logits, rows, grammar_bitmask)

    def prompt_logits(self, token_ids: list[int], step_tokens: int | None = None) -> torch.Tensor:
        """(len(token_ids), vocab) fp32 logits at every position of one sequence, prefilled over the
        first KV blocks in one step, or in steps of step_tokens (perplexity of the few-row paths that
        decode steps take). Only for an executor with no requests running."""
        num_blocks = -(-len(token_ids) // self.block_size)
        if num_blocks > self.num_blocks:
            raise ValueError(f"{len(token_ids)} tokens need {num_blocks} KV blocks; the cache has {self.num_blocks}")
        step = step_tokens or len(token_ids)
        logits = []
        for start in range(0, len(token_ids), step):
            request = ScheduledRequest("prompt-logits", list(token_ids[start:start + step]), start,
                                       list(range(num_blocks)), sample=False, sampling_params=None)
            input_ids, positions, meta = self._prepare([], [request])
            with torch.inference_mode():
                hidden = self.model(input_ids, positions, self.kv_caches, meta)
                logits.append(self.model.compute_logits(hidden).float())
        return torch.cat(logits)

    def _prepare(self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest]):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for s in decodes:
            p = s.num_computed_tokens
            ids.append(s.token_ids[0])
            pos.append(p)
            slots.append(s.block_ids[p // bs] * bs + p % bs)
        input_ids = torch.tensor(ids, dtype=torch.long)
        positions = torch.tensor(pos, dtype=torch.long)
        slot_mapping = torch.tensor(slots, dtype=torch.long)
        decode_tables = decode_mask = decode_lens = None
        if decodes:
            max_blocks = max(len(s.block_ids) for s in decodes)
            decode_tables = torch.tensor([s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in decodes])
            decode_lens = positions + 1
            decode_mask = (torch.arange(max_blocks * bs)[None, :] < decode_lens[:, None])[:, None, None, :]
        chunks, id_parts, pos_parts, slot_parts = [], [input_ids], [positions], [slot_mapping]
        row = len(decodes)
        for s in prefills:
            table = torch.tensor(s.block_ids, dtype=torch.long)
            p = torch.arange(s.num_computed_tokens, s.context_len)
            id_parts.append(torch.tensor(s.token_ids, dtype=torch.long))
            pos_parts.append(p)
            slot_parts.append(table[p // bs] * bs + p % bs)
            chunks.append(PrefillChunk(row, s.num_new_tokens, s.num_computed_tokens, table))
            row += s.num_new_tokens
        if prefills:
            input_ids, positions, slot_mapping = (torch.cat(x) for x in (id_parts, pos_parts, slot_parts))
        meta = AttentionMetadata(slot_mapping, len(decodes), decode_tables, decode_mask, decode_lens, chunks)
        return input_ids, positions, meta


def _draft_rows(row: SamplingRow, drafts: list[int]) -> list[SamplingRow]:
    """The sampling state at the last sampled token and after each draft: what the model has seen so far
    differs only for penalties (the drafts count as output once verified)."""
    if not row.params.needs_penalties:
        return [row] * (1 + len(drafts))
    return [row] + [SamplingRow(row.params, row.prompt_token_ids, row.output_token_ids + drafts[:j])
                    for j in range(1, len(drafts) + 1)]


def _verify_greedy(drafts: list[int], samples: list[SampledToken]) -> list[SampledToken]:
    """The drafts the samples agree with, then the first sample that differs (or the one after the last
    draft): greedy verification, whose output is the tokens decoding one at a time would give."""
    for j, draft in enumerate(drafts):
        if samples[j].token_id != draft:
            return samples[:j + 1]
    return samples


def _grammar_rows(plan: StepPlan, sampled: list[ScheduledRequest]) -> torch.Tensor | None:
    """The plan's grammar bitmask laid out as the sampled rows (all tokens allowed where a row has no grammar)."""
    if plan.grammar_bitmask is None:
        return None
    source = torch.from_numpy(plan.grammar_bitmask_now())
    where = {request_id: row for row, request_id in enumerate(plan.grammar_request_ids)}
    bitmask = torch.full((len(sampled), source.shape[1]), -1, dtype=torch.int32)
    for i, s in enumerate(sampled):
        row = where.get(s.request_id)
        if row is not None:
            bitmask[i] = source[row]
    return bitmask
