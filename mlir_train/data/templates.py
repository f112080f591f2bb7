"""Chat templates: a :class:`Sample` -> rendered text plus the character spans that get loss.

- ``alpaca``: the Stanford Alpaca prompt (with and without ``### Input:``); each response is
  followed by the tokenizer's eos token, which is part of the loss (it teaches the model to stop).
- ``chatml`` / ``qwen``: ``<|im_start|>role\\n...<|im_end|>\\n`` turns, system only when given
  (Qwen3 has no default system prompt); the loss covers each response and its ``<|im_end|>``.
- ``hf``: the tokenizer's own jinja ``chat_template``; responses are located in the rendered
  text, and the end-of-turn special token right after each one is part of the loss.

The text is tokenised once as a whole, so token boundaries are those of the real tokenizer on
the full conversation, and a token is a loss token when its first character lies in a span.
"""

from __future__ import annotations

import dataclasses
import functools
import json

from mlir_train.data.records import DataError, Sample

TEMPLATES = ("alpaca", "qwen", "chatml", "hf")

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


def make_spec(name: str, tokenizer) -> TemplateSpec:
    if name not in TEMPLATES:
        raise DataError(f"--chat-template {name!r}: unknown template; expected one of {TEMPLATES}")
    eos = tokenizer.eos_token
    if not eos:
        raise DataError(f"tokenizer {tokenizer.name_or_path}: has no eos_token, which every "
                        f"template needs to end a response")
    vocab = tokenizer.get_vocab()
    if name in ("qwen", "chatml") and not (IM_START in vocab and IM_END in vocab):
        raise DataError(f"--chat-template {name}: tokenizer {tokenizer.name_or_path} has no "
                        f"{IM_START}/{IM_END} tokens; expected a ChatML (Qwen) tokenizer")
    if name == "hf":
        jinja = tokenizer.chat_template
        if not isinstance(jinja, str) or not jinja:
            raise DataError(f"--chat-template hf: tokenizer {tokenizer.name_or_path} has no "
                            f"chat_template in its config; expected a jinja chat template")
        ends = tuple(t for t in (*END_OF_TURN_TOKENS, eos) if t in vocab)
        return TemplateSpec(name, eos, tokenizer.bos_token, jinja, tuple(dict.fromkeys(ends)))
    return TemplateSpec(name, eos, tokenizer.bos_token)


def render(sample: Sample, spec: TemplateSpec, where: str = ""
           ) -> tuple[str, list[tuple[int, int]]]:
    """Return (text, loss spans as [start, end) character ranges)."""
    if spec.name == "alpaca":
        return _render_alpaca(sample, spec)
    if spec.name in ("qwen", "chatml"):
        return _render_chatml(sample, spec)
    return _render_hf(sample, spec, where)


class _Builder:
    def __init__(self):
        self.parts: list[str] = []
        self.size = 0
        self.spans: list[tuple[int, int]] = []

    def add(self, text: str, loss: bool = False) -> None:
        if loss:
            self.spans.append((self.size, self.size + len(text)))
        self.parts.append(text)
        self.size += len(text)

    def result(self) -> tuple[str, list[tuple[int, int]]]:
        return "".join(self.parts), self.spans


def _render_alpaca(sample: Sample, spec: TemplateSpec):
    out = _Builder()
    if spec.bos_token:
        out.add(spec.bos_token)
    if sample.system is not None:
        out.add(sample.system + "\n\n")
    else:
        has_input = any(turn.input for turn in sample.turns)
        out.add(ALPACA_PREAMBLE_INPUT if has_input else ALPACA_PREAMBLE)
    for i, turn in enumerate(sample.turns):
        if i:
            out.add("\n\n")
        out.add(f"### Instruction:\n{turn.prompt}\n\n")
        if turn.input:
            out.add(f"### Input:\n{turn.input}\n\n")
        out.add("### Response:\n")
        out.add(turn.response + spec.eos_token, loss=True)
    return out.result()


def _user_content(turn) -> str:
    return f"{turn.prompt}\n{turn.input}" if turn.input else turn.prompt


def _render_chatml(sample: Sample, spec: TemplateSpec):
    out = _Builder()
    if spec.bos_token:
        out.add(spec.bos_token)
    if sample.system is not None:
        out.add(f"{IM_START}system\n{sample.system}{IM_END}\n")
    for turn in sample.turns:
        out.add(f"{IM_START}user\n{_user_content(turn)}{IM_END}\n{IM_START}assistant\n")
        out.add(turn.response + IM_END, loss=True)
        out.add("\n")
    return out.result()


def messages_of(sample: Sample) -> list[dict[str, str]]:
    messages = [] if sample.system is None else [{"role": "system", "content": sample.system}]
    for turn in sample.turns:
        messages.append({"role": "user", "content": _user_content(turn)})
        messages.append({"role": "assistant", "content": turn.response})
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
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False,
                                                                   indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(jinja)


def render_jinja(spec: TemplateSpec, messages, add_generation_prompt: bool = False) -> str:
    return _compiled(spec.jinja).render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        bos_token=spec.bos_token or "", eos_token=spec.eos_token)


def _render_hf(sample: Sample, spec: TemplateSpec, where: str):
    messages = messages_of(sample)
    text = render_jinja(spec, messages)
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        content = message["content"].strip()
        start = text.find(content, cursor)
        if start < 0:
            raise DataError(f"{where}: the tokenizer's chat template does not render message {i} "
                            f"({message['role']}) verbatim, so its loss span cannot be found; "
                            f"use --chat-template qwen or alpaca", reason="template failed")
        end = start + len(content)
        if message["role"] == "assistant":
            for token in spec.end_tokens:
                if text.startswith(token, end):
                    end += len(token)
                    break
            spans.append((start, end))
        cursor = end
    return text, spans
