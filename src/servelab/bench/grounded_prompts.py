"""Prompts whose answers copy spans of the prompt (code edits), where prompt-lookup speculation's drafts hit,
and open-ended ones where they mostly miss. Plain-text completion prompts, built from servelab's own source
(always at hand, the same on every machine): a function, then the start of the same function renamed, so a
model continues by copying the body."""
from __future__ import annotations

import inspect

# (module, function) pairs of self-contained functions 10-40 lines long
_SOURCES = (
    ("servelab.workload", "generate_workload"),
    ("servelab.config", "tensor_parallel_problem"),
    ("servelab.config", "parse_disaggregate"),
    ("servelab.core.block_manager", "num_blocks_for_memory"),
    ("servelab.metrics.server_metrics", "token_buckets"),
    ("servelab.metrics.server_metrics", "weight_bytes_by_device"),
    ("servelab.bench.datasets", "read_jsonl"),
    ("servelab.bench.datasets", "exact_length_text"),
)
_TOPICS = ("a lighthouse keeper", "a city under the sea", "the first day of school", "a robot learning to paint",
           "a storm at harvest time", "an old map", "a lost letter", "a train that never stops")


def code_edit_prompts(num: int) -> list[str]:
    """num prompts (cycling over the functions): the function, an instruction to rename it, and the renamed
    function's first line, for the model to go on from."""
    import importlib

    prompts = []
    for index in range(num):
        module, name = _SOURCES[index % len(_SOURCES)]
        source = inspect.getsource(getattr(importlib.import_module(module), name))
        new_name = f"{name}_v{index // len(_SOURCES) + 2}"
        first, _, _ = source.partition("\n")
        prompts.append(f"Here is a Python function:\n\n```python\n{source}```\n\n"
                       f"The same function renamed to `{new_name}`, otherwise unchanged:\n\n"
                       f"```python\n{first.replace(name, new_name, 1)}\n")
    return prompts


def open_ended_prompts(num: int) -> list[str]:
    """num story prompts: nothing in them to copy."""
    return [f"Write a short story about {_TOPICS[i % len(_TOPICS)]}.\n\nStory:" for i in range(num)]
