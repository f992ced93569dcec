"""Reasoning text between `<think>` and `</think>` (DeepSeek-R1, Qwen3, SmolLM3 and the like).

DeepSeek-R1's template opens `<think>` in the prompt itself, so with --reasoning-parser deepseek_r1 the output
is reasoning from its start up to `</think>`; with qwen3 (or think) only output that opens `<think>` has any."""
from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
# --reasoning-parser names (vLLM's); they all split on the same tags.
REASONING_PARSERS = ("deepseek_r1", "qwen3", "think")


def _held_back(text: str, tag: str) -> int:
    """Characters at the end of text that may begin tag (kept until the next delta decides)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Splits streamed text into (reasoning, content) deltas. Until a tag is seen the text is undecided only
    while it may still be the opening tag; after `<think>` everything is reasoning up to `</think>`."""

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self.state = "start"
        self._untagged = "reasoning" if starts_in_reasoning else "content"  # what output without <think> is
        self._buffer = ""
        self._after_reasoning = False  # content's leading newlines after </think> are dropped

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self._buffer += text
        reasoning = content = ""
        while True:
            buffer = self._buffer
            if self.state == "start":
                stripped = buffer.lstrip()
                if stripped.startswith(THINK_START):
                    self.state, self._buffer = "reasoning", stripped[len(THINK_START):]
                    continue
                if not final and (THINK_START.startswith(stripped) or not stripped):
                    break  # may still be the opening tag
                self.state = self._untagged
                continue
            if self.state == "reasoning":
                if THINK_END in buffer:
                    head, _, tail = buffer.partition(THINK_END)
                    reasoning += head
                    self.state, self._buffer, self._after_reasoning = "content", tail, True
                    continue
                keep = 0 if final else _held_back(buffer, THINK_END)
                reasoning += buffer[:len(buffer) - keep]
                self._buffer = buffer[len(buffer) - keep:]
                break
            if self._after_reasoning:
                buffer = buffer.lstrip("\n")
                self._after_reasoning = not buffer
            content += buffer
            self._buffer = ""
            break
        return reasoning, content
