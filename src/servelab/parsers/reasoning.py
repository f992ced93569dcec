"""Reasoning text between `<think>` and `</think>` (DeepSeek-R1, Qwen3, SmolLM3 and the like).

A template may open `<think>` in the prompt itself (DeepSeek-R1's does), so output that holds `</think>` is
reasoning up to it even without the opening tag; output with neither tag is all content."""
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
        self.state = "reasoning" if starts_in_reasoning else "start"
        self._buffer = ""

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
                if THINK_END in buffer:  # the template opened the tag
                    head, _, tail = buffer.partition(THINK_END)
                    reasoning += head
                    self.state, self._buffer = "content", tail
                    continue
                if not final and (THINK_START.startswith(stripped) or not stripped):
                    break  # may still be the opening tag
                self.state = "content"
                continue
            if self.state == "reasoning":
                if THINK_END in buffer:
                    head, _, tail = buffer.partition(THINK_END)
                    reasoning += head
                    self.state, self._buffer = "content", tail.lstrip("\n")
                    continue
                keep = 0 if final else _held_back(buffer, THINK_END)
                reasoning += buffer[:len(buffer) - keep]
                self._buffer = buffer[len(buffer) - keep:]
                break
            content += buffer
            self._buffer = ""
            break
        return reasoning, content
