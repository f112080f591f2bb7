"""Chat templates: a :class:`Sample` -> rendered text plus the character spans that get loss.

- ``alpaca``: the Stanford Alpaca prompt (with and without ``### Input:``); each response is
  followed by the tokenizer's eos token, which is part of the loss (it teaches the model to stop).
- ``chatml`` / ``qwen``: ``<|im_start|>role\\n...<|im_end|>\\n`` turns, system only when given
  (Qwen3 has no default system prompt); the loss covers each response and its ``<|im_end|>``.
- ``qwen3``: Qwen3's official chat template, written out here (token for token what
  ``tokenizer.apply_chat_template`` gives with Qwen3's jinja; ``tests/data`` checks it): system,
  user, assistant and tool turns, the ``tools`` system block, ``<tool_call>`` JSON, tool responses
  merged into one user turn, ``<think>`` reasoning from ``reasoning_content`` or inline, dropped
  from assistant turns before the last user query, and the empty ``<think>\n\n</think>\n\n``
  the template writes before a final answer without reasoning. The loss covers each assistant
  turn's content, tool calls and ``<|im_end|>``; its think block per ``reasoning_loss``:
  ``nonempty`` (default: reasoning is trained, an empty think block never), ``all``, ``none``.
  ``enable_thinking: false`` (chat template kwargs) drops the final answer's reasoning, which
  leaves the empty think block in the prompt, as the template's generation prompt writes it.
- ``qwen3_5`` / ``qwen3_6`` (also spelled ``qwen3.5`` / ``qwen3.6``): Qwen3.5's and Qwen3.6's
  official template, XML tool calls (``mlir_train/data/qwen3_5.py`` says how it differs).
- ``qwen3_next`` / ``qwen3_next_thinking``: Qwen3-Next-80B-A3B-Instruct's and -Thinking's
  official templates (``mlir_train/data/qwen3_next.py``).
- ``auto``: the template whose official jinja the tokenizer directory carries, else ``hf``.
- ``hf``: the tokenizer's own jinja ``chat_template``; each assistant answer (its text after any
  ``</think>``) is located in the rendered text, and the end-of-turn special token right after
  each one is part of the loss. Tool calls cannot be located this way: use ``qwen3``.

Options for every template (:class:`TemplateSpec`): ``history_mask`` (loss on the last assistant
turn only) and the chat template kwargs (``hf``: passed to the jinja; ``qwen3``:
``enable_thinking``). Every rendering also labels its text by role, so the data summary can say
how many loss tokens each role got.

The text is tokenised once as a whole, so token boundaries are those of the real tokenizer on
the full conversation, and a token is a loss token when its first character lies in a span.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os

from mlir_train.data.qwen3_5 import KWARGS as QWEN3_5_KWARGS
from mlir_train.data.qwen3_5 import add_user_or_tool, render_qwen3_5
from mlir_train.data.qwen3_next import KWARGS as QWEN3_NEXT_KWARGS
from mlir_train.data.qwen3_next import qwen3_system, render_qwen3_next, with_tool_calls
from mlir_train.data.records import DataError, Message, Sample
from mlir_train.runtime.errors import read_text

TEMPLATES = ("alpaca", "qwen", "chatml", "qwen3", "qwen3_5", "qwen3_6", "qwen3_next", "qwen3_next_thinking",
             "hf", "auto")
# LoongForge's names for the same templates, and the model names' spelling.
TEMPLATE_ALIASES = {"qwen3-hf": "qwen3", "qwen3.5": "qwen3_5", "qwen3.6": "qwen3_6", "qwen3-next": "qwen3_next",
                    "qwen3-next-thinking": "qwen3_next_thinking"}
QWEN3_5_TEMPLATES = tuple(QWEN3_5_KWARGS)
QWEN3_TEMPLATES = ("qwen3", *QWEN3_NEXT_KWARGS, *QWEN3_5_TEMPLATES)  # Qwen's own: no bos token
REASONING_LOSS = ("nonempty", "all", "none")
QWEN3_KWARGS = {"enable_thinking": bool}
EMPTY_THINK = "<think>\n\n</think>\n\n"

ALPACA_PREAMBLE = ("Below is an instruction that describes a task. Write a response that "
                   "appropriately completes the request.\n\n")
ALPACA_PREAMBLE_INPUT = ("Below is an instruction that describes a task, paired with an input "
                         "that provides further context. Write a response that appropriately "
                         "completes the request.\n\n")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Tokens that close an assistant turn in common HF chat templates.
END_OF_TURN_TOKENS = (IM_END, "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


@dataclasses.dataclass(frozen=True)
class TemplateSpec:
    """Everything rendering needs from the tokenizer, small and picklable for the workers."""

    name: str
    eos_token: str
    bos_token: str | None = None
    jinja: str | None = None  # hf only
    end_tokens: tuple[str, ...] = ()  # hf only: special tokens that may close a response
    history_mask: bool = False  # loss on the last assistant turn only
    reasoning_loss: str = "nonempty"  # qwen3: which think blocks get loss
    kwargs: tuple[tuple[str, object], ...] = ()  # run-wide chat template kwargs, sorted items
    origin: str = ""  # hf only: the file the template came from, for messages (not in the data cache's key)


def parse_template_kwargs(text: str | dict | None, what: str = "--chat-template-kwargs") -> dict:
    """``--chat-template-kwargs``: a JSON object, or the path of a file holding one."""
    if text is None or text == "":
        return {}
    if isinstance(text, dict):
        return dict(text)
    raw, where = text, f"{what} {text!r}"
    if not text.lstrip().startswith("{"):  # a file's path (JSON objects start with "{")
        if not os.path.isfile(text):
            raise DataError(f"{where}: no such file, nor a JSON object; expected a file holding one, or the object "
                            "itself, e.g. '{\"enable_thinking\": false}'")
        raw, where = read_text(text, DataError, f"{what} {text}"), f"{what} {text}"
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not a JSON object ({e.msg}, line {e.lineno}); expected e.g. "
                        f"'{{\"enable_thinking\": false}}' or a file holding one") from None
    if not isinstance(value, dict):
        raise DataError(f"{what} {text!r}: expected a JSON object, e.g. "
                        f"'{{\"enable_thinking\": false}}'")
    return value


def _check_kwargs(name: str, kwargs: dict, what: str) -> None:
    if not kwargs:
        return
    if name in ("alpaca", "qwen", "chatml"):
        raise DataError(f"{what} {json.dumps(kwargs)}: the {name} template takes no kwargs; they "
                        f"are for --chat-template qwen3 or hf", reason="bad chat_template_kwargs")
    if name in QWEN3_TEMPLATES:
        allowed = QWEN3_KWARGS if name == "qwen3" else {**QWEN3_5_KWARGS, **QWEN3_NEXT_KWARGS}[name]
        for key, value in kwargs.items():
            if key not in allowed:
                raise DataError(f"{what}: {key!r} is not a kwarg of the {name} template; expected "
                                f"{sorted(allowed)}", reason="bad chat_template_kwargs")
            if not isinstance(value, allowed[key]):
                raise DataError(f"{what}: {key!r} is {json.dumps(value)}: expected true or false",
                                reason="bad chat_template_kwargs")


def make_spec(name: str, tokenizer, *, history_mask: bool = False,
              reasoning_loss: str = "nonempty", kwargs: dict | None = None) -> TemplateSpec:
    name = TEMPLATE_ALIASES.get(name, name)
    if name not in TEMPLATES:
        raise DataError(f"--chat-template {name!r}: unknown template; expected one of {TEMPLATES}")
    if name == "auto":
        name = detect_template(tokenizer)
    if reasoning_loss not in REASONING_LOSS:
        raise DataError(f"--reasoning-loss {reasoning_loss!r}: expected one of {REASONING_LOSS}")
    kwargs = dict(kwargs or {})
    _check_kwargs(name, kwargs, "--chat-template-kwargs")
    options = dict(history_mask=history_mask, reasoning_loss=reasoning_loss,
                   kwargs=tuple(sorted(kwargs.items())))
    eos = tokenizer.eos_token
    if not eos:
        raise DataError(f"tokenizer {tokenizer.name_or_path}: has no eos_token, which every "
                        f"template needs to end a response")
    vocab = tokenizer.get_vocab()
    chatml = ("qwen", "chatml", *QWEN3_TEMPLATES)
    if name in chatml and not (IM_START in vocab and IM_END in vocab):
        raise DataError(f"--chat-template {name}: tokenizer {tokenizer.name_or_path} has no "
                        f"{IM_START}/{IM_END} tokens; expected a ChatML (Qwen) tokenizer")
    if name == "hf":
        jinja, origin = tokenizer.chat_template, template_origin(tokenizer)
        if not isinstance(jinja, str) or not jinja.strip():
            raise DataError(f"--chat-template hf: tokenizer {tokenizer.name_or_path} has no chat_template"
                            + (f" ({origin} is empty)" if origin.endswith(".jinja") else " in its config")
                            + "; expected a jinja chat template")
        try:
            _compiled(jinja)
        except Exception as e:  # noqa: BLE001 - jinja2's TemplateSyntaxError and kin: a damaged template
            raise DataError(f"--chat-template hf: {origin}: not a jinja template ({type(e).__name__}: "
                            f"{str(e)[:100]}); the file is damaged") from None
        ends = tuple(t for t in (*END_OF_TURN_TOKENS, eos) if t in vocab)
        return TemplateSpec(name, eos, tokenizer.bos_token, jinja, tuple(dict.fromkeys(ends)),
                            **options, origin=origin)
    # Qwen3's and Qwen3.5's templates write no bos token (Qwen tokenizers have none).
    bos = None if name in QWEN3_TEMPLATES else tokenizer.bos_token
    return TemplateSpec(name, eos, bos, **options)


def template_origin(tokenizer) -> str:
    """The file ``tokenizer``'s chat template came from: its directory's chat_template.jinja, or
    its tokenizer_config.json."""
    path = str(tokenizer.name_or_path)
    jinja = os.path.join(path, "chat_template.jinja")
    return jinja if os.path.isfile(jinja) else os.path.join(path, "tokenizer_config.json")


def detect_template(tokenizer) -> str:
    """``--chat-template auto``: the template whose official jinja the tokenizer carries
    (``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``), else ``hf``."""
    jinja = tokenizer.chat_template
    if not isinstance(jinja, str) or not jinja:
        raise DataError(f"--chat-template auto: tokenizer {tokenizer.name_or_path} has no "
                        f"chat_template (chat_template.jinja or tokenizer_config.json); name "
                        f"one: {', '.join(t for t in TEMPLATES if t not in ('hf', 'auto'))}")
    if "<function=" in jinja and "render_content" in jinja:  # Qwen3.5's XML tool calls
        return "qwen3_6" if "preserve_thinking" in jinja else "qwen3_5"
    if '{\\"name\\": <function-name>' in jinja and "You are Qwen" not in jinja:  # Qwen3's JSON tool calls
        if "reasoning_content" in jinja and "enable_thinking" in jinja:
            return "qwen3"  # the hybrid-thinking template
        if "reasoning_content" in jinja and "'<|im_start|>assistant\\n<think>\\n'" in jinja:
            return "qwen3_next_thinking"  # Qwen3-Next-Thinking's (Qwen3-2507 Thinking's)
        if "reasoning_content" not in jinja and "set content = message.content" in jinja:
            return "qwen3_next"  # Qwen3-Next-Instruct's: no think blocks
    return "hf"


@dataclasses.dataclass
class Rendered:
    """A rendering: the text, its loss spans and role spans (``[start, end)`` characters), and
    what the masking did to it."""

    text: str
    spans: list[tuple[int, int]]
    roles: list[tuple[int, int, str]]  # every character of ``text`` in exactly one span
    empty_think_skipped: int = 0  # empty think blocks rendered without loss
    history_masked: int = 0  # assistant turns with no loss because of history_mask
    reasoning_dropped: int = 0  # final answers whose reasoning enable_thinking=false dropped


def render(sample: Sample, spec: TemplateSpec, where: str = ""
           ) -> tuple[str, list[tuple[int, int]]]:
    """Return (text, loss spans as [start, end) character ranges)."""
    out = render_full(sample, spec, where)
    return out.text, out.spans


def render_full(sample: Sample, spec: TemplateSpec, where: str = "") -> Rendered:
    kwargs = dict(spec.kwargs)
    if sample.template_kwargs:
        record_kwargs = dict(sample.template_kwargs)
        _check_kwargs(spec.name, record_kwargs, f"{where}: chat_template_kwargs")
        kwargs.update(record_kwargs)
    if spec.name in ("qwen3", "qwen3_next_thinking"):
        out = _render_qwen3(sample, spec, kwargs)
    elif spec.name == "qwen3_next":
        out = _Builder()
        render_qwen3_next(out, sample, conversation(sample))
    elif spec.name in QWEN3_5_TEMPLATES:
        out = _Builder()
        render_qwen3_5(sample, spec, kwargs, where, conversation(sample), out)
    elif spec.name == "hf":
        out = _render_hf(sample, spec, where, kwargs)
    else:
        if sample.has_extras or not sample.turns:
            raise DataError(f"{where}: the record has tool calls, tool responses, tools or "
                            f"reasoning_content, which --chat-template {spec.name} cannot render; "
                            f"use --chat-template qwen3 (or qwen3_5, qwen3_6)",
                            reason="needs the qwen3 template")
        out = (_render_alpaca if spec.name == "alpaca" else _render_chatml)(sample, spec)
    if spec.history_mask:
        out.history_masked += out.mask_history()
    return out.result()


class _Builder:
    def __init__(self):
        self.parts: list[str] = []
        self.size = 0
        self.spans: list[tuple[int, int, int]] = []  # start, end, turn
        self.roles: list[tuple[int, int, str]] = []
        self.turn = 0  # the assistant turn a loss span belongs to
        self.empty_think_skipped = self.history_masked = self.reasoning_dropped = 0

    def add(self, text: str, role: str, loss: bool = False) -> None:
        if not text:
            return
        if loss:
            self.spans.append((self.size, self.size + len(text), self.turn))
        if self.roles and self.roles[-1][2] == role and self.roles[-1][1] == self.size:
            self.roles[-1] = (self.roles[-1][0], self.size + len(text), role)
        else:
            self.roles.append((self.size, self.size + len(text), role))
        self.parts.append(text)
        self.size += len(text)

    def mask_history(self) -> int:
        """Keep the loss of the last turn that has any; return how many turns lost theirs."""
        if not self.spans:
            return 0
        last = self.spans[-1][2]
        masked = len({turn for _, _, turn in self.spans if turn != last})
        self.spans = [span for span in self.spans if span[2] == last]
        return masked

    def result(self) -> Rendered:
        return Rendered("".join(self.parts), [(a, b) for a, b, _ in self.spans], self.roles,
                        self.empty_think_skipped, self.history_masked, self.reasoning_dropped)


def _render_alpaca(sample: Sample, spec: TemplateSpec):
    out = _Builder()
    if spec.bos_token:
        out.add(spec.bos_token, "system")
    if sample.system is not None:
        out.add(sample.system + "\n\n", "system")
    else:
        has_input = any(turn.input for turn in sample.turns)
        out.add(ALPACA_PREAMBLE_INPUT if has_input else ALPACA_PREAMBLE, "system")
    for i, turn in enumerate(sample.turns):
        out.turn = i
        if i:
            out.add("\n\n", "user")
        out.add(f"### Instruction:\n{turn.prompt}\n\n", "user")
        if turn.input:
            out.add(f"### Input:\n{turn.input}\n\n", "user")
        out.add("### Response:\n", "user")
        out.add(turn.response + spec.eos_token, "assistant", loss=True)
    return out


def _user_content(turn) -> str:
    return f"{turn.prompt}\n{turn.input}" if turn.input else turn.prompt


def _render_chatml(sample: Sample, spec: TemplateSpec):
    out = _Builder()
    if spec.bos_token:
        out.add(spec.bos_token, "system")
    if sample.system is not None:
        out.add(f"{IM_START}system\n{sample.system}{IM_END}\n", "system")
    for i, turn in enumerate(sample.turns):
        out.turn = i
        out.add(f"{IM_START}user\n{_user_content(turn)}{IM_END}\n", "user")
        out.add(f"{IM_START}assistant\n", "assistant")
        out.add(turn.response + IM_END, "assistant", loss=True)
        out.add("\n", "assistant")
    return out


def conversation(sample: Sample) -> list[Message]:
    """The sample's messages (system aside): as given, or built from its turns (alpaca)."""
    if sample.messages:
        return list(sample.messages)
    messages = []
    for turn in sample.turns:
        messages += [Message("user", _user_content(turn)), Message("assistant", turn.response)]
    return messages


def split_think(content: str) -> tuple[str, str | None]:
    """(answer, inline reasoning or None) as Qwen3's template splits content at ``</think>``."""
    if "</think>" not in content:
        return content, None
    head, answer = content.split("</think>")[0], content.split("</think>")[-1]
    return answer.lstrip("\n"), head.rstrip("\n").split("<think>")[-1].lstrip("\n")


def _is_tool_response(text: str) -> bool:
    return text.startswith("<tool_response>") and text.endswith("</tool_response>")


def _render_qwen3(sample: Sample, spec: TemplateSpec, kwargs: dict) -> _Builder:
    out = _Builder()
    messages = conversation(sample)
    qwen3_system(out, sample)
    last_query = _qwen3_last_query(messages)
    thinking = kwargs.get("enable_thinking", True)
    for index, message in enumerate(messages):
        last = index == len(messages) - 1
        if add_user_or_tool(out, messages, index, message.content):
            continue
        if message.role == "assistant":
            out.turn = index
            _qwen3_assistant(out, message, spec, after_last_query=index > last_query, last=last,
                             thinking=thinking)
    return out


def _qwen3_last_query(messages: list[Message]) -> int:
    """The last real user query (not a tool response in a user message): reasoning before it
    is history and is not rendered."""
    last_query = len(messages) - 1
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if message.role == "user" and not _is_tool_response(message.content):
            last_query = index
            break
    return last_query


def _qwen3_assistant(out: _Builder, message: Message, spec: TemplateSpec, *, after_last_query: bool, last: bool,
                     thinking) -> None:
    """An assistant turn: its think block (after the last user query only, where it has
    reasoning or is the last message; its loss per ``spec.reasoning_loss``), then its answer
    and tool calls, which always get loss."""
    content, reasoning = message.content, message.reasoning
    if reasoning is None:
        content, reasoning = split_think(content)
        reasoning = reasoning or ""
    if last and thinking is False and reasoning:
        out.reasoning_dropped += 1  # non-thinking: the answer follows an empty block
        reasoning = ""
    out.add(f"{IM_START}assistant\n", "assistant")
    body = content
    if after_last_query and (last or reasoning):
        think = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n"
        empty = not reasoning.strip()
        loss = spec.reasoning_loss == "all" or (spec.reasoning_loss == "nonempty"
                                                and not empty)
        if empty and not loss:
            out.empty_think_skipped += 1
        out.add(think, "reasoning", loss=loss)
        body = content.lstrip("\n")
    out.add(with_tool_calls(body, message, content) + IM_END, "assistant", loss=True)
    out.add("\n", "assistant")


def messages_of(sample: Sample) -> list[dict]:
    """The sample as the ``messages`` a jinja chat template reads."""
    messages = [] if sample.system is None else [{"role": "system", "content": sample.system}]
    for message in conversation(sample):
        item = {"role": message.role, "content": message.content}
        if message.reasoning is not None:
            item["reasoning_content"] = message.reasoning
        messages.append(item)
    return messages


@functools.lru_cache(maxsize=4)
def _compiled(jinja: str):
    # The same sandboxed environment settings transformers uses for apply_chat_template, so a
    # worker process renders without importing transformers.
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise DataError(f"chat template raised: {message}", reason="template failed")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, **_: (
        json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
                   sort_keys=sort_keys))
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(jinja)


def render_jinja(spec: TemplateSpec, messages, add_generation_prompt: bool = False,
                 tools=None, **kwargs) -> str:
    return _compiled(spec.jinja).render(messages=messages, tools=tools,
                                        add_generation_prompt=add_generation_prompt,
                                        bos_token=spec.bos_token or "", eos_token=spec.eos_token,
                                        **kwargs)


def _render_hf(sample: Sample, spec: TemplateSpec, where: str, kwargs: dict) -> _Builder:
    if any(m.tool_calls for m in sample.messages):
        raise DataError(f"{where}: the record has tool calls, whose rendering --chat-template hf "
                        f"cannot locate in the text; use --chat-template qwen3",
                        reason="needs the qwen3 template")
    messages = messages_of(sample)
    text = render_jinja(spec, messages, tools=list(sample.tools) or None, **kwargs)
    out, cursor = _Builder(), 0
    for i, message in enumerate(messages):
        content = message["content"]
        if message["role"] == "assistant" and "reasoning_content" not in message:
            content = split_think(content)[0]  # templates may drop or move the reasoning
        content = content.strip()
        if not content:
            continue
        start = text.find(content, cursor)
        if start < 0:
            raise DataError(f"{where}: the tokenizer's chat template ({spec.origin}) does not render message {i} "
                            f"({message['role']}) verbatim, so its loss span cannot be found; "
                            f"use --chat-template qwen3, qwen or alpaca", reason="template failed")
        end = start + len(content)
        role = message["role"]
        out.add(text[cursor:start], role)
        if role == "assistant":
            out.turn = i
            for token in spec.end_tokens:
                if text.startswith(token, end):
                    end += len(token)
                    break
        out.add(text[start:end], role, loss=role == "assistant")
        cursor = end
    out.add(text[cursor:], messages[-1]["role"])
    return out
