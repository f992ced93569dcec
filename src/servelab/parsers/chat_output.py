"""One choice's output text as OpenAI's chat message parts: reasoning_content, content and tool_calls, from
the whole text or delta by delta as it streams.

Tool modes: "auto" parses Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks out
of free text (text outside them stays content); "named" is a tool_choice naming one function, whose output
is that call's arguments (constrained to its schema); "required" is a JSON list of
{"name", "parameters"} calls (constrained by tool_grammar.required_tools_schema)."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from servelab.parsers.reasoning import ReasoningSplitter, _held_back

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self, index: int) -> dict:
        return {"index": index, **self.message()}


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI tool_calls delta entries


def _hermes_call(text: str) -> ToolCall | None:
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return ToolCall(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


class ChatOutputParser:
    def __init__(self, reasoning: str | None = None, tool_mode: str | None = None, tool_name: str | None = None) -> None:
        """reasoning: the --reasoning-parser that splits `<think>` text out, or None. tool_mode: None, "auto",
        "named" (with tool_name) or "required"."""
        self._reasoning = ReasoningSplitter(starts_in_reasoning=reasoning == "deepseek_r1") if reasoning else None
        self.tool_mode = tool_mode
        self.tool_name = tool_name
        self.reasoning_text = ""
        self.content_text = ""
        self.tool_calls: list[ToolCall] = []
        self._pending = ""  # content not yet decided (a tag may be starting, or a call is open)
        self._in_call = False

    def feed(self, text: str, final: bool = False) -> ChatDelta:
        delta = ChatDelta()
        if self._reasoning is not None:
            delta.reasoning, text = self._reasoning.feed(text, final)
            self.reasoning_text += delta.reasoning
        mode = self.tool_mode
        if mode == "auto":
            self._feed_hermes(text, final, delta)
        elif mode == "named":
            if not self.tool_calls:
                self.tool_calls.append(ToolCall(self.tool_name or "", ""))
                delta.tool_calls.append(self.tool_calls[0].delta(0))
            call = self.tool_calls[0]
            call.arguments += text
            if text:
                delta.tool_calls.append({"index": 0, "function": {"arguments": text}})
        elif mode == "required":
            self._pending += text
            if final:
                self._parse_required(delta)
        else:
            delta.content = text
        self.content_text += delta.content
        return delta

    def _feed_hermes(self, text: str, final: bool, delta: ChatDelta) -> None:
        self._pending += text
        while True:
            pending = self._pending
            if not self._in_call:
                start = pending.find(TOOL_CALL_START)
                if start < 0:
                    keep = 0 if final else _held_back(pending, TOOL_CALL_START)
                    delta.content += pending[:len(pending) - keep]
                    self._pending = pending[len(pending) - keep:]
                    return
                delta.content += pending[:start]
                self._pending, self._in_call = pending[start + len(TOOL_CALL_START):], True
                continue
            end = pending.find(TOOL_CALL_END)
            if end < 0 and not final:
                return
            body = pending if end < 0 else pending[:end]
            self._pending = "" if end < 0 else pending[end + len(TOOL_CALL_END):]
            self._in_call = False
            call = _hermes_call(body.strip())
            if call is None:  # not a call after all: the text stays content
                delta.content += TOOL_CALL_START + body + ("" if end < 0 else TOOL_CALL_END)
            else:
                delta.tool_calls.append(call.delta(len(self.tool_calls)))
                self.tool_calls.append(call)
            if end < 0:
                return

    def _parse_required(self, delta: ChatDelta) -> None:
        try:
            calls = json.loads(self._pending)
        except ValueError:
            calls = None
        if not isinstance(calls, list):  # cut short (max_tokens): what there is stays content
            delta.content += self._pending
            return
        for call in calls:
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                parsed = ToolCall(call["name"], json.dumps(call.get("parameters", {})))
                delta.tool_calls.append(parsed.delta(len(self.tool_calls)))
                self.tool_calls.append(parsed)

    def message(self) -> dict:
        """The whole choice as an OpenAI assistant message (after the final feed)."""
        message: dict = {"role": "assistant", "content": self.content_text or (None if self.tool_calls else "")}
        if self._reasoning is not None:
            message["reasoning_content"] = self.reasoning_text or None
        if self.tool_calls:
            message["tool_calls"] = [c.message() for c in self.tool_calls]
        return message
