"""Qwen3's system block and JSON tool calls, and Qwen3-Next's two official chat templates.

``qwen3_next``: the template of Qwen/Qwen3-Next-80B-A3B-Instruct (a model without reasoning):
Qwen3's (``templates._render_qwen3``) with no think blocks at all. Each assistant message's
content is written as given (an inline ``<think>...</think>`` too) with its tool calls, all of
it loss; a message's ``reasoning_content`` is not in the template and is dropped (counted, as
``enable_thinking: false`` drops are). It takes no chat template kwargs.

``qwen3_next_thinking``: Qwen/Qwen3-Next-80B-A3B-Thinking's: Qwen3's template whose generation
prompt always opens a think block and has no ``enable_thinking`` switch; a training record
renders as Qwen3's does with thinking on, so it is rendered by ``templates._render_qwen3`` and
refuses kwargs.

Both are checked token for token against the official jinja in ``tests/data/test_data_qwen3_5.py``
(the fixtures' provenance is in ``tests/data/fixtures/README.md``).
"""

from __future__ import annotations

import json

from mlir_train.data.qwen3_5 import add_user_or_tool
from mlir_train.data.records import Message, Sample

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
KWARGS: dict[str, dict] = {"qwen3_next": {}, "qwen3_next_thinking": {}}
QWEN3_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
QWEN3_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>" + IM_END + "\n")


def to_json(value) -> str:
    return json.dumps(value, ensure_ascii=False)  # the template's tojson


def qwen3_system(out, sample: Sample) -> None:
    """The system message: with tools, the system prompt (if any) then the tools' signatures."""
    if sample.tools:
        out.add(f"{IM_START}system\n", "system")
        if sample.system is not None:
            out.add(sample.system + "\n\n", "system")
        out.add(QWEN3_TOOLS_HEADER, "system")
        for tool in sample.tools:
            out.add("\n" + to_json(tool), "system")
        out.add(QWEN3_TOOLS_FOOTER, "system")
    elif sample.system is not None:
        out.add(f"{IM_START}system\n{sample.system}{IM_END}\n", "system")


def with_tool_calls(body: str, message: Message, content: str) -> str:
    """``body`` followed by the message's ``<tool_call>`` JSON blocks, as Qwen3's template writes
    them: a newline before each but a first one that follows empty ``content`` (the template's
    ``content`` variable, which may differ from ``body`` by the leading newlines it strips)."""
    for i, call in enumerate(message.tool_calls):
        if i or content:
            body += "\n"
        arguments = call.arguments if isinstance(call.arguments, str) else to_json(call.arguments)
        body += f'<tool_call>\n{{"name": "{call.name}", "arguments": {arguments}}}\n</tool_call>'
    return body


def render_qwen3_next(out, sample: Sample, messages: list[Message]) -> None:
    """The Instruct template (module docstring) into the builder ``out``."""
    qwen3_system(out, sample)
    for index, message in enumerate(messages):
        if add_user_or_tool(out, messages, index, message.content) or message.role != "assistant":
            continue
        out.turn = index
        if message.reasoning:
            out.reasoning_dropped += 1
        out.add(f"{IM_START}assistant\n", "assistant")
        out.add(with_tool_calls(message.content, message, message.content) + IM_END, "assistant", loss=True)
        out.add("\n", "assistant")
