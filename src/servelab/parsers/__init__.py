"""Parsers of a chat model's output text: reasoning (`<think>...</think>` -> reasoning_content) and tool calls
(Hermes-style `<tool_call>{json}</tool_call>` -> OpenAI tool_calls), both in one pass and streamed
(chat_output.ChatOutputParser), plus the grammars that force a tool call (tool_grammar)."""
from servelab.parsers.chat_output import ChatDelta, ChatOutputParser, ToolCall
from servelab.parsers.reasoning import REASONING_PARSERS
from servelab.parsers.tool_grammar import required_tools_schema

__all__ = ["ChatDelta", "ChatOutputParser", "REASONING_PARSERS", "ToolCall", "required_tools_schema"]
