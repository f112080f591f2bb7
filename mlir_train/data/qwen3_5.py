"""Qwen3.5 / Qwen3.6's official chat template, written out (token for token what
``apply_chat_template`` gives with their jinja; ``tests/data/test_data_qwen3_5.py`` checks it).

Source: ``chat_template.jinja`` of the Qwen3.5 and Qwen3.6 tokenizers on the Hugging Face Hub
(Qwen/Qwen3.5-35B-A3B, Qwen/Qwen3.6-35B-A3B; the test oracles in ``tests/data/fixtures`` say which
copies they were taken from). What differs from Qwen3's template (``templates._render_qwen3``):

- every message's text is ``|trim``-med (all surrounding whitespace), system and tool ones too;
- the tools block comes first in the system message, the system prompt after it;
- tool calls are XML: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
  </function>\\n</tool_call>``, one parameter per key of the arguments object (so arguments must
  be a JSON object); a value is JSON when it is an object or a list, otherwise ``str()``-ed
  (Qwen3.5: ``True``, ``None``) or, in Qwen3.6, JSON unless it is a string (``true``, ``null``);
- every assistant turn after the last user query gets a think block, empty or not;
- Qwen3.6's ``preserve_thinking: true`` keeps the think block of every assistant turn;
- a conversation without a real user query is an error (the template raises).

The loss is as in qwen3: each assistant turn's answer, tool calls and ``<|im_end|>``; its think
block per ``reasoning_loss``; ``enable_thinking: false`` drops the final answer's reasoning.
"""

from __future__ import annotations

import json

from mlir_train.data.records import DataError, Message, Sample

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
KWARGS = {"qwen3_5": {"enable_thinking": bool},
          "qwen3_6": {"enable_thinking": bool, "preserve_thinking": bool}}
TOOLS_HEADER = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_FOOTER = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
    "value_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second "
    "parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your "
    "function call in natural language BEFORE the function call, but NOT after\n- If there is no "
    "function call available, answer the question like normal with your current knowledge and "
    "do not tell the user about function calls\n</IMPORTANT>")


def _to_json(value) -> str:
    return json.dumps(value, ensure_ascii=False)  # transformers' tojson


def _is_tool_response(text: str) -> bool:
    return text.startswith("<tool_response>") and text.endswith("</tool_response>")


def render_qwen3_5(sample: Sample, spec, kwargs: dict, where: str, messages: list[Message],
                   out) -> None:
    """Render ``messages`` (the conversation, system aside) into the builder ``out``."""
    _system(out, sample)
    last_query = _last_query(messages, where)
    preserve = kwargs.get("preserve_thinking", False) is True
    for index, message in enumerate(messages):
        content = (message.content or "").strip()
        last = index == len(messages) - 1
        if add_user_or_tool(out, messages, index, content):
            continue
        if message.role == "assistant":
            out.turn = index
            think = preserve or index > last_query
            _assistant(out, message, content, spec, think=think,
                       drop_reasoning=last and kwargs.get("enable_thinking", True) is False)


def add_user_or_tool(out, messages: list[Message], index: int, content: str) -> bool:
    """A user message, or a tool response (consecutive ones share one user turn), as Qwen3's
    and Qwen3.5's templates write them; False for other roles."""
    role = messages[index].role
    if role == "user":
        out.add(f"{IM_START}user\n{content}{IM_END}\n", "user")
    elif role == "tool":
        if index == 0 or messages[index - 1].role != "tool":
            out.add(f"{IM_START}user", "tool")
        out.add(f"\n<tool_response>\n{content}\n</tool_response>", "tool")
        if index == len(messages) - 1 or messages[index + 1].role != "tool":
            out.add(f"{IM_END}\n", "tool")
    return role in ("user", "tool")


def _system(out, sample: Sample) -> None:
    system = None if sample.system is None else sample.system.strip()
    if sample.tools:
        out.add(f"{IM_START}system\n{TOOLS_HEADER}", "system")
        for tool in sample.tools:
            out.add("\n" + _to_json(tool), "system")
        out.add(TOOLS_FOOTER + (f"\n\n{system}" if system else "") + f"{IM_END}\n", "system")
    elif system is not None:
        out.add(f"{IM_START}system\n{system}{IM_END}\n", "system")


def _last_query(messages: list[Message], where: str) -> int:
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if message.role == "user" and not _is_tool_response((message.content or "").strip()):
            return index
    raise DataError(f"{where}: no user query (only tool responses): the Qwen3.5 template "
                    f"needs one user message that is not a <tool_response>",
                    reason="no user query")


def _assistant(out, message: Message, content: str, spec, *, think: bool, drop_reasoning: bool) -> None:
    reasoning = message.reasoning
    if reasoning is None:
        reasoning = ""
        if "</think>" in content:
            head = content.split("</think>")[0].rstrip("\n")
            reasoning = head.split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
    reasoning = reasoning.strip()
    if drop_reasoning and reasoning:
        out.reasoning_dropped += 1  # non-thinking: the answer follows an empty think block
        reasoning = ""
    out.add(f"{IM_START}assistant\n", "assistant")
    if think:
        empty = not reasoning
        loss = spec.reasoning_loss == "all" or (spec.reasoning_loss == "nonempty" and not empty)
        if empty and not loss:
            out.empty_think_skipped += 1
        out.add(f"<think>\n{reasoning}\n</think>\n\n", "reasoning", loss=loss)
    body = content
    for i, call in enumerate(message.tool_calls):
        body += ("\n\n" if content.strip() else "") if i == 0 else "\n"
        body += f"<tool_call>\n<function={call.name}>\n"
        for key, value in _arguments(call).items():
            body += f"<parameter={key}>\n{_argument(value, spec.name)}\n</parameter>\n"
        body += "</function>\n</tool_call>"
    out.add(body + IM_END, "assistant", loss=True)
    out.add("\n", "assistant")


def _arguments(call) -> dict:
    """The call's arguments as the object whose keys become ``<parameter=...>`` tags (records
    checked them on reading: a JSON object, or a string holding one; ``records._arguments``)."""
    return json.loads(call.arguments) if isinstance(call.arguments, str) else call.arguments


def _argument(value, name: str) -> str:
    if isinstance(value, (dict, list)):
        return _to_json(value)
    if name == "qwen3_6":
        return value if isinstance(value, str) else _to_json(value)
    return str(value)  # jinja's |string: Python's str (True, None, 1.5)
