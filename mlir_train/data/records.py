"""Reading SFT records from local files into one normalised form.

Formats (AIAK/LoongForge ``sft_dataset_config`` names):

- ``alpaca``: ``{instruction, input?, output, system?, history?: [[prompt, response], ...]}``,
  as a JSON list or JSON Lines.
- ``sharegpt``: ``{conversations: [{from, value}, ...], system?}``.
- ``openai``: ``{messages: [{role, content, reasoning_content?, tool_calls?}, ...], tools?,
  chat_template_kwargs?}``, roles ``system`` (first only), ``user``, ``assistant``, ``tool``.
  ShareGPT's ``function_call`` / ``observation`` turns are an assistant's tool call and the
  tool's response.

Every record becomes a :class:`Sample`: an optional system prompt, the user/assistant turns the
turn templates (alpaca, chatml) render, and for chat formats the conversation as given
(:class:`Message`: reasoning, tool calls, tool responses) that the ``qwen3`` template renders.
Errors name the file, the JSONL line or the record index, and what was expected; each carries a
countable ``reason`` (``unknown role``, ``roles out of order``, ``tool response without a call``,
``empty assistant turn``, ...) under which ``--sft-skip-bad-records`` counts the records it drops.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator

from mlir_train.runtime.errors import DataError


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Any  # a string is rendered verbatim, anything else as JSON


@dataclasses.dataclass(frozen=True)
class Message:
    """One message of a chat record, as given (the template decides what of it is rendered)."""

    role: str  # system | user | assistant | tool
    content: str = ""
    reasoning: str | None = None  # reasoning_content; None: not given (may be inline <think>)
    tool_calls: tuple[ToolCall, ...] = ()


@dataclasses.dataclass(frozen=True)
class Turn:
    prompt: str
    response: str
    input: str = ""  # alpaca's optional context; the alpaca template renders it as its own section


@dataclasses.dataclass(frozen=True)
class Sample:
    turns: tuple[Turn, ...]  # () when the conversation is more than user/assistant text
    system: str | None = None
    messages: tuple[Message, ...] = ()  # chat formats: the conversation as given
    tools: tuple = ()  # the record's tool schemas (JSON objects)
    template_kwargs: tuple[tuple[str, Any], ...] = ()  # the record's chat_template_kwargs

    @property
    def has_extras(self) -> bool:
        """Tool calls, tool responses, tools or reasoning_content: only qwen3/hf render them."""
        return bool(self.tools) or any(m.role == "tool" or m.tool_calls or m.reasoning is not None
                                       for m in self.messages)


@dataclasses.dataclass(frozen=True)
class DatasetFormat:
    """How to read one dataset: its format name plus column and tag names (sft_dataset_config)."""

    formatting: str = "auto"  # auto | alpaca | sharegpt | openai
    prompt: str = "instruction"
    query: str = "input"
    response: str = "output"
    system: str = "system"
    history: str = "history"
    messages: str = ""  # "" -> "conversations" for sharegpt, "messages" for openai
    role_tag: str = ""  # "" -> "from" for sharegpt, "role" for openai
    content_tag: str = ""  # "" -> "value" for sharegpt, "content" for openai
    user_tag: str = ""
    assistant_tag: str = ""
    system_tag: str = "system"
    tool_tag: str = ""  # "" -> "observation" for sharegpt, "tool" for openai
    function_tag: str = ""  # "" -> "function_call" for sharegpt (an assistant's tool call)
    tools: str = "tools"  # the record's tool schemas: a list, or that list as a JSON string
    reasoning: str = "reasoning_content"  # an assistant message's reasoning
    tool_calls: str = "tool_calls"  # an assistant message's calls (OpenAI form)
    template_kwargs: str = "chat_template_kwargs"  # per-record template options
    name: str = ""  # the --sft-dataset-config entry, for errors
    unsupported: tuple[str, ...] = ()  # config column/tag names we cannot honour (an error if used)
    unread_keys: tuple[str, ...] = ()  # config entry keys we do not read (an error if used)
    file_name: str | None = None  # LLaMA-Factory's file_name: must be the --data-path file


FORMATS = ("alpaca", "sharegpt", "openai")
_SHAREGPT_DEFAULTS = dict(messages="conversations", role_tag="from", content_tag="value",
                          user_tag="human", assistant_tag="gpt", tool_tag="observation",
                          function_tag="function_call")
_OPENAI_DEFAULTS = dict(messages="messages", role_tag="role", content_tag="content",
                        user_tag="user", assistant_tag="assistant", tool_tag="tool")


def resolve_format(fmt: DatasetFormat, first_record: Any, where: str) -> DatasetFormat:
    """Fill in ``auto`` from the first record and the per-format default column names."""
    name = fmt.formatting
    if name == "auto":
        keys = first_record.keys() if isinstance(first_record, dict) else ()
        if "conversations" in keys:
            name = "sharegpt"
        elif "messages" in keys:
            name = "openai"
        elif fmt.prompt in keys or fmt.response in keys:
            name = "alpaca"
        else:
            raise DataError(
                f"{where}: cannot tell the dataset format from keys {sorted(keys)}: expected "
                f"'instruction'/'output' (alpaca), 'conversations' (sharegpt) or 'messages' "
                f"(openai); name the format in --sft-dataset-config")
    if name not in FORMATS:
        raise DataError(f"{where}: unknown dataset format {name!r}; expected one of {FORMATS}")
    defaults = {"sharegpt": _SHAREGPT_DEFAULTS, "openai": _OPENAI_DEFAULTS}.get(name, {})
    filled = {k: v for k, v in defaults.items() if not getattr(fmt, k)}
    return dataclasses.replace(fmt, formatting=name, **filled)


# ---------------------------------------------------------------------------- data paths

@dataclasses.dataclass(frozen=True)
class Source:
    path: str
    weight: float | None  # None: no blend weights given, every file contributes its natural size


def parse_data_path(tokens: tuple[str, ...] | list[str] | str) -> tuple[Source, ...]:
    """Megatron's ``--data-path``: ``p1 [p2 ...]`` or the weighted blend ``w1 p1 w2 p2 ...``."""
    if isinstance(tokens, str):
        tokens = [tokens]
    flat = [t for token in tokens for t in token.split()]
    if not flat:
        raise DataError("--data-path is empty: expected one or more files, or 'w1 path1 w2 path2'")

    def is_number(text: str) -> bool:
        try:
            float(text)
        except ValueError:
            return False
        return True

    if is_number(flat[0]):
        if len(flat) % 2 or not all(is_number(w) for w in flat[0::2]):
            raise DataError(f"--data-path {' '.join(flat)!r}: a weighted blend must alternate "
                            f"'weight path' pairs")
        sources = tuple(Source(p, float(w)) for w, p in zip(flat[0::2], flat[1::2]))
        if any(s.weight < 0 for s in sources) or sum(s.weight for s in sources) <= 0:
            raise DataError(f"--data-path {' '.join(flat)!r}: blend weights must be >= 0 and "
                            f"not all zero")
    else:
        sources = tuple(Source(p, None) for p in flat)
    for source in sources:
        if not os.path.isfile(source.path):
            raise DataError(f"--data-path: {source.path}: no such file")
    return sources


def parse_split(split: str) -> tuple[float, float, float]:
    """Megatron's ``--split 98,1,1`` (or ``98/1/1``): normalised train/valid/test fractions."""
    parts = [p for p in split.replace("/", ",").split(",") if p.strip()]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise DataError(f"--split {split!r}: expected up to three non-negative weights like "
                        f"'98,1,1'")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return tuple(w / total for w in weights)


# ------------------------------------------------------------------------------ reading

@dataclasses.dataclass(frozen=True)
class RawRecord:
    where: str  # "file:line N" (JSONL) or "file record N" (JSON list), for error messages
    value: Any


def read_raw_records(path: str, skip_bad: bool, bad: dict[str, int]) -> list[RawRecord]:
    """Parse a JSON list or JSON Lines file; malformed lines raise (or are counted in ``bad``)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}): expected JSON or JSON Lines"
                        ) from None
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}:{e.colno}: malformed JSON: {e.msg}") from None
        return [RawRecord(f"{path} record {i}", v) for i, v in enumerate(values)]
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            if not skip_bad:
                raise DataError(f"{path}:{lineno}: malformed JSON line (column {e.colno}): "
                                f"{e.msg}; expected one JSON object per line") from None
            bad["malformed JSON"] = bad.get("malformed JSON", 0) + 1
            continue
        records.append(RawRecord(f"{path}:{lineno}", value))
    return records


def _string(record: dict, key: str, where: str, *, required: bool) -> str:
    if key not in record or record[key] is None:
        if required:
            raise DataError(f"{where}: missing field {key!r}: expected a string",
                            reason="missing field")
        return ""
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r} is {type(value).__name__}: expected a string",
                        reason="non-string field")
    return value


def _nonempty(text: str, what: str, where: str) -> str:
    if not text.strip():
        raise DataError(f"{where}: empty {what}: expected non-empty text",
                        reason=f"empty {what.split()[-1]}")
    return text


def to_sample(record: RawRecord, fmt: DatasetFormat) -> Sample:
    """Validate one raw record and normalise it; raises :class:`DataError` naming the record."""
    where, value = record.where, record.value
    if not isinstance(value, dict):
        raise DataError(f"{where}: record is {type(value).__name__}: expected a JSON object",
                        reason="record not an object")
    if fmt.formatting == "alpaca":
        return _alpaca_sample(value, fmt, where)
    return _chat_sample(value, fmt, where)


def _alpaca_sample(value: dict, fmt: DatasetFormat, where: str) -> Sample:
    prompt = _nonempty(_string(value, fmt.prompt, where, required=True), "instruction", where)
    query = _string(value, fmt.query, where, required=False)
    response = _nonempty(_string(value, fmt.response, where, required=True), "response", where)
    system = _string(value, fmt.system, where, required=False) or None
    turns = []
    history = value.get(fmt.history) or []
    if not isinstance(history, list):
        raise DataError(f"{where}: field {fmt.history!r} is {type(history).__name__}: expected a "
                        f"list of [prompt, response] pairs", reason="bad history")
    for i, pair in enumerate(history):
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                or not all(isinstance(x, str) for x in pair)):
            raise DataError(f"{where}: {fmt.history}[{i}]: expected a [prompt, response] pair "
                            f"of strings", reason="bad history")
        turns.append(Turn(_nonempty(pair[0], f"{fmt.history}[{i}] prompt", where),
                          _nonempty(pair[1], f"{fmt.history}[{i}] response", where)))
    turns.append(Turn(prompt, response, query))
    return Sample(tuple(turns), system)


def _tool_calls(value: Any, at: str) -> tuple[ToolCall, ...]:
    """OpenAI ``[{type, function: {name, arguments}}]`` or bare ``{name, arguments}`` items."""
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise DataError(f"{at}: tool calls are {type(value).__name__}: expected a list of "
                        f"{{name, arguments}} objects", reason="bad tool call")
    calls = []
    for i, call in enumerate(value):
        if isinstance(call, dict) and isinstance(call.get("function"), dict):
            call = call["function"]
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            raise DataError(f"{at}: tool call {i}: expected an object with a string 'name' and "
                            f"'arguments'", reason="bad tool call")
        calls.append(ToolCall(call["name"], _arguments(call.get("arguments", {}), f"{at}: tool call {i}")))
    return tuple(calls)


def _arguments(value: Any, at: str) -> Any:
    """A tool call's arguments: a JSON object, or (OpenAI's form) a string holding one, which
    is rendered verbatim; anything else would teach the model calls no tool parser reads."""
    parsed = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"{at}: 'arguments' is not JSON ({e.msg}): expected a JSON object, or a string "
                            "holding one", reason="bad tool call") from None
    if not isinstance(parsed, dict):
        raise DataError(f"{at}: 'arguments' is a JSON {type(parsed).__name__}: expected a JSON object "
                        "(name -> value)", reason="bad tool call")
    return value


def _json_field(value: dict, key: str, kind: type, where: str, reason: str):
    raw = value.get(key)
    if raw is None:
        return kind()
    if isinstance(raw, str) and kind is list:  # LLaMA-Factory keeps tools as a JSON string
        try:
            raw = json.loads(raw) if raw.strip() else []
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: field {key!r} is not valid JSON ({e.msg})",
                            reason=reason) from None
    if not isinstance(raw, kind):
        raise DataError(f"{where}: field {key!r} is {type(raw).__name__}: expected a JSON "
                        f"{'list' if kind is list else 'object'}", reason=reason)
    return raw


def _chat_sample(value: dict, fmt: DatasetFormat, where: str) -> Sample:
    raw_messages = value.get(fmt.messages)
    if not isinstance(raw_messages, list) or not raw_messages:
        raise DataError(f"{where}: field {fmt.messages!r} is "
                        f"{'missing' if raw_messages is None else type(raw_messages).__name__}: "
                        f"expected a non-empty list of {{{fmt.role_tag}, {fmt.content_tag}}} "
                        f"messages", reason="missing messages")
    system = _string(value, fmt.system, where, required=False) or None
    roles = {fmt.user_tag: "user", fmt.assistant_tag: "assistant", fmt.system_tag: "system",
             fmt.tool_tag: "tool", fmt.function_tag: "function"}
    roles.pop("", None)
    messages: list[Message] = []
    pending_calls = 0  # calls of the last assistant message not yet answered by a tool message
    for i, message in enumerate(raw_messages):
        at = f"{where}: {fmt.messages}[{i}]"
        role = _message_role(message, roles, fmt, at)
        previous = messages[-1].role if messages else None
        if role == "system":
            if i != 0:
                raise DataError(f"{at}: roles out of order: a system message is only allowed "
                                f"first", reason="roles out of order")
            system = _string(message, fmt.content_tag, at, required=True) or None
        elif role == "user":
            if previous == "user":
                raise DataError(f"{at}: roles out of order: two user messages in a row: expected "
                                f"user/assistant to alternate", reason="roles out of order")
            messages.append(Message("user", _nonempty(
                _string(message, fmt.content_tag, at, required=True), "user message", at)))
        elif role == "tool":
            if pending_calls == 0:
                raise DataError(f"{at}: tool response without a call: expected an assistant "
                                f"message with tool calls before it (one response per call)",
                                reason="tool response without a call")
            pending_calls -= 1
            messages.append(Message("tool", _string(message, fmt.content_tag, at,
                                                    required=True)))
        else:  # assistant, or sharegpt's function_call (an assistant turn that calls tools)
            messages.append(_assistant_message(message, role, previous, fmt, at))
            pending_calls = len(messages[-1].tool_calls)
    if not messages or messages[-1].role != "assistant":
        raise DataError(f"{where}: conversation must end with an assistant message",
                        reason="no final response")
    tools = _json_field(value, fmt.tools, list, where, "bad tools")
    kwargs = _json_field(value, fmt.template_kwargs, dict, where, "bad chat_template_kwargs")
    turns = ()
    plain = not tools and all(m.role in ("user", "assistant") and not m.tool_calls
                              and m.reasoning is None for m in messages)
    if plain:  # strictly user/assistant alternation (checked above): the turn templates' form
        turns = tuple(Turn(u.content, a.content) for u, a in zip(messages[::2], messages[1::2]))
    return Sample(turns, system, tuple(messages), tuple(tools), tuple(sorted(kwargs.items())))


def _message_role(message, roles: dict[str, str], fmt: DatasetFormat, at: str) -> str:
    """A chat message's role (system, user, assistant, tool, or function: a sharegpt tool call),
    from its ``fmt.role_tag`` as the dataset spells it."""
    if not isinstance(message, dict):
        raise DataError(f"{at}: expected an object with {fmt.role_tag!r} and "
                        f"{fmt.content_tag!r}", reason="bad message")
    role = roles.get(message.get(fmt.role_tag))
    if role is None:
        raise DataError(f"{at}: unknown {fmt.role_tag!r} {message.get(fmt.role_tag)!r}: "
                        f"expected one of {sorted(roles)}", reason="unknown role")
    return role


def _assistant_message(message: dict, role: str, previous: str | None, fmt: DatasetFormat, at: str) -> Message:
    """An assistant turn after a user or tool message: its content, reasoning and tool calls, or
    (``role == "function"``, sharegpt) only the calls, given as JSON in its content."""
    if previous not in ("user", "tool"):
        what = "first" if previous is None else f"after an {previous} message"
        raise DataError(f"{at}: roles out of order: an assistant message {what}: "
                        f"expected it after a user or tool message",
                        reason="roles out of order")
    if role == "function":
        text = _string(message, fmt.content_tag, at, required=True)
        try:
            calls = _tool_calls(json.loads(text), at)
        except json.JSONDecodeError as e:
            raise DataError(f"{at}: a {fmt.function_tag!r} message must hold the call as "
                            f"JSON ({e.msg})", reason="bad tool call") from None
        content, reasoning = "", None
    else:
        content = _string(message, fmt.content_tag, at, required=False)
        reasoning = message.get(fmt.reasoning)
        if reasoning is not None and not isinstance(reasoning, str):
            raise DataError(f"{at}: field {fmt.reasoning!r} is "
                            f"{type(reasoning).__name__}: expected a string",
                            reason="non-string field")
        raw_calls = message.get(fmt.tool_calls)
        calls = _tool_calls(raw_calls, at) if raw_calls else ()
    if not (content.strip() or (reasoning or "").strip() or calls):
        raise DataError(f"{at}: assistant turn with neither content nor reasoning "
                        f"(nor tool calls): expected non-empty text",
                        reason="empty assistant turn")
    answer = content.split("</think>")[-1] if reasoning is None else content
    if not (answer.strip() or calls):
        raise DataError(f"{at}: assistant turn with reasoning only: no answer after the thinking and no tool "
                        "calls; expected the answer in its content", reason="thinking only")
    return Message("assistant", content, reasoning, calls)


def iter_samples(records: list[RawRecord], fmt: DatasetFormat, skip_bad: bool,
                 bad: dict[str, int], examples: list[str], max_examples: int = 5
                 ) -> Iterator[Sample | None]:
    """One Sample per record, or None for a skipped bad record (counted in ``bad`` by reason,
    its message kept in ``examples`` up to ``max_examples``)."""
    for record in records:
        try:
            yield to_sample(record, fmt)
        except DataError as e:
            if not skip_bad:
                raise
            reason = e.reason
            bad[reason] = bad.get(reason, 0) + 1
            if len(examples) < max_examples:
                examples.append(str(e))
            yield None
