"""Tools in the chat prompt. A template that reads `tools` (Qwen2.5, Llama 3.1, Hermes ...) renders them
itself; for one that does not (SmolLM2's), the tools go into the system message in the Hermes format and
earlier calls and tool answers are written as the `<tool_call>` / `<tool_response>` text the model is asked
to produce, so any chat model sees the same conversation."""
from __future__ import annotations

import json

from servelab.parsers.chat_output import TOOL_CALL_END, TOOL_CALL_START

HERMES_SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\nFor each function "
    "call return a json object with function name and arguments within <tool_call></tool_call> XML tags as "
    "follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-dict>}}\n</tool_call>")


def template_reads_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def _call_text(call: dict) -> str:
    function = call["function"]
    body = {"name": function["name"], "arguments": function["arguments"]}
    return f"{TOOL_CALL_START}\n{json.dumps(body)}\n{TOOL_CALL_END}"


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """messages for a template without tool support: the tools in the system message, calls and answers as
    text."""
    out = []
    for message in messages:
        message = dict(message)
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in message.pop("tool_calls"))
            message["content"] = f"{message['content']}\n{calls}" if message["content"] else calls
        elif message["role"] == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
        out.append(message)
    if tools:
        prompt = HERMES_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
