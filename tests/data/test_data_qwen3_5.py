"""--chat-template qwen3_5 / qwen3_6 (and Qwen3-Next's qwen3_next / qwen3_next_thinking) against the official jinja
(tests/data/fixtures), token for token through transformers' apply_chat_template, on the
conversations of the Qwen3 chat tests; loss masks, kwargs, --chat-template auto, bad records."""

import copy
import json
import os
import shutil

import pytest

from mlir_train.data import DataError, load_tokenizer
from mlir_train.data.templates import make_spec
from tests.data.test_data_qwen3 import (CONVERSATIONS, call, document, ids, loss_text, msg,  # noqa: F401
                                        tok)
from tests.data.test_data_qwen3 import build as build_qwen3

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
JINJA = {"qwen3_5": "qwen3_5_chat_template.jinja", "qwen3_6": "qwen3_6_chat_template.jinja",
         "qwen3": "qwen3_chat_template.jinja", "qwen3_next": "qwen3_next_chat_template.jinja",
         "qwen3_next_thinking": "qwen3_next_thinking_chat_template.jinja"}
# Typed arguments: where Qwen3.5 (str()) and Qwen3.6 (JSON) differ, and a nested object.
CONVERSATIONS = dict(CONVERSATIONS, typed_arguments=(
    [msg("user", "  Book it.  "),
     msg("assistant", "\n<think>\nplan\n</think>\n\nBooking.",
         tool_calls=[call("book", {"seats": 2, "window": True, "note": None, "price": 1.5,
                                   "who": ["a", "b"], "meta": {"x": 1}})]),
     msg("tool", " done "), msg("assistant", "Booked.")],
    [{"type": "function", "function": {"name": "book", "parameters": {"type": "object"}}}]))
TEMPLATES = ("qwen3_5", "qwen3_6")


@pytest.fixture(scope="module")
def official(tmp_path_factory, tok):
    """The bundled tokenizer carrying each official chat template."""
    out = {}
    for name, fixture in JINJA.items():
        directory = tmp_path_factory.mktemp(name)
        shutil.copytree(tok.name_or_path, directory, dirs_exist_ok=True)
        shutil.copy(os.path.join(FIXTURES, fixture), directory / "chat_template.jinja")
        out[name] = load_tokenizer(str(directory))
    return out


def oracle_messages(messages):
    """The jinja iterates over arguments with |items, so it takes them as objects: the records'
    JSON-string arguments are given to it parsed (our renderer parses them the same way)."""
    messages = copy.deepcopy(messages)
    for message in messages:
        for tool_call in message.get("tool_calls") or ():
            if isinstance(tool_call["function"]["arguments"], str):
                tool_call["function"]["arguments"] = json.loads(tool_call["function"]["arguments"])
    return messages


def build(tok, tmp_path, records, template, **overrides):
    return build_qwen3(tok, tmp_path, records, chat_template=template,
                       **{"seq_length": 4096, **overrides})


def documents(data):
    """Every row's (tokens, loss); rows are shuffled."""
    return [document(data, row) for row in range(data.train.num_rows)]


def record(name):
    messages, tools = CONVERSATIONS[name]
    return {"messages": messages, **({"tools": tools} if tools else {})}


@pytest.mark.parametrize("template", TEMPLATES)
def test_renders_token_for_token_as_the_official_template(tok, official, tmp_path, template):
    records = [record(name) for name in sorted(CONVERSATIONS)]
    data = build(tok, tmp_path, records, template)
    ours = sorted(tokens for tokens, _ in documents(data))
    expected = []
    for name in sorted(CONVERSATIONS):
        messages, tools = CONVERSATIONS[name]
        expected.append(ids(tok, official[template].apply_chat_template(
            oracle_messages(messages), tools=tools, tokenize=False)))
    assert ours == sorted(expected)


@pytest.mark.parametrize("template", TEMPLATES)
def test_non_thinking_final_answer_follows_the_official_generation_prompt(tok, official, tmp_path,
                                                                         template):
    records = [record(name) for name in sorted(CONVERSATIONS)]
    data = build(tok, tmp_path, records, template,
                 chat_template_kwargs='{"enable_thinking": false}')
    jinja = official[template]
    ours = {tuple(tokens): loss for tokens, loss in documents(data)}
    for name in sorted(CONVERSATIONS):
        messages, tools = CONVERSATIONS[name]
        messages = oracle_messages(messages)
        prompt = jinja.apply_chat_template(messages[:-1], tools=tools, tokenize=False,
                                           add_generation_prompt=True, enable_thinking=False)
        content = messages[-1]["content"]
        final = dict(messages[-1], reasoning_content="",
                     content=content.split("</think>")[-1].lstrip("\n"))
        whole = jinja.apply_chat_template(messages[:-1] + [final], tools=tools, tokenize=False)
        assert whole.startswith(prompt)
        tokens = ids(tok, whole)
        assert tuple(tokens) in ours, name
        loss = ours[tuple(tokens)]
        n_prompt = len(ids(tok, prompt))
        assert loss_text(tok, tokens[n_prompt:], loss[n_prompt:]) == whole[len(prompt):-1]


def test_preserve_thinking_keeps_every_think_block_in_qwen3_6_only(tok, official, tmp_path):
    messages, _ = CONVERSATIONS["reasoning_content"]
    data = build(tok, tmp_path, [record("reasoning_content")], "qwen3_6",
                 chat_template_kwargs='{"preserve_thinking": true}')
    expected = official["qwen3_6"].apply_chat_template(messages, tokenize=False,
                                                       preserve_thinking=True)
    tokens, loss = document(data)
    assert tokens == ids(tok, expected) and "two threes make six" in loss_text(tok, tokens, loss)
    with pytest.raises(DataError, match="'preserve_thinking' is not a kwarg of the qwen3_5"):
        build(tok, tmp_path / "b", [record("reasoning_content")], "qwen3_5",
              chat_template_kwargs='{"preserve_thinking": true}')


def test_loss_covers_think_blocks_answers_and_xml_tool_calls(tok, tmp_path):
    data = build(tok, tmp_path, [record("tools")], "qwen3_5")
    tokens, loss = document(data)
    calls = ("\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=tz>\n"
             "Europe/Paris\n</parameter>\n</function>\n</tool_call>")
    assert loss_text(tok, tokens, loss) == (
        "<think>\ntwo tools needed\n</think>\n\nLet me look." + calls + "<|im_end|>"
        "<think>\ncombine both answers\n</think>\n\nIt is 21 degrees and 14:05 in Paris.<|im_end|>")
    assert set(data.stats.loss_tokens_by_role) == {"assistant", "reasoning"}
    # Every turn after the last query has a think block; an empty one gets no loss.
    data = build(tok, tmp_path / "b", [record("tool_call_only")], "qwen3_5")
    assert data.stats.masking["empty think blocks skipped"] == 2


@pytest.mark.parametrize("arguments, match", [
    ("{not json", r"messages\[1\]: tool call 0: 'arguments' is not JSON"),
    ('["Paris"]', r"messages\[1\]: tool call 0: 'arguments' is a JSON list: expected a JSON object")])
def test_bad_tool_call_arguments_are_an_error_naming_the_record(tok, tmp_path, arguments, match):
    bad = {"messages": [msg("user", "Weather?"),
                        msg("assistant", None, tool_calls=[call("get_weather", arguments)]),
                        msg("tool", "sunny"), msg("assistant", "Sunny.")]}
    with pytest.raises(DataError, match=r"chat\.jsonl:1: " + match):
        build(tok, tmp_path, [bad], "qwen3_5")
    data = build(tok, tmp_path / "skip", [bad, record("multi_turn")], "qwen3_5",
                 skip_bad_records=True)
    assert data.train.num_rows == 1


def test_auto_picks_the_template_from_the_tokenizer_directory(tok, official, tmp_path):
    for name, tokenizer in official.items():
        assert make_spec("auto", tokenizer).name == name
    # The jinja in tokenizer_config.json (older HF directories) instead of chat_template.jinja.
    shutil.copytree(tok.name_or_path, tmp_path / "tok")
    (tmp_path / "tok" / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    config["chat_template"] = open(os.path.join(FIXTURES, JINJA["qwen3_5"])).read()
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    assert make_spec("auto", load_tokenizer(str(tmp_path / "tok"))).name == "qwen3_5"
    assert make_spec("auto", tok).name == "hf"  # the bundled tokenizer's own (non-official) jinja
    assert make_spec("qwen3.5", tok).name == "qwen3_5"  # the model name's spelling
    assert make_spec("qwen3-next", tok).name == "qwen3_next"


def test_a_conversation_without_a_user_query_is_an_error_as_the_template_raises(tok, official,
                                                                                 tmp_path):
    messages = [msg("user", "<tool_response>\nsunny\n</tool_response>"), msg("assistant", "ok")]
    with pytest.raises(Exception, match="No user query found"):
        official["qwen3_5"].apply_chat_template(messages, tokenize=False)
    with pytest.raises(DataError, match=r"chat\.jsonl:1: no user query \(only tool responses\)"):
        build(tok, tmp_path, [{"messages": messages}], "qwen3_5")


@pytest.mark.parametrize("template", ["qwen3_next", "qwen3_next_thinking"])
def test_qwen3_next_renders_token_for_token_as_the_official_template(tok, official, tmp_path, template):
    """Qwen3-Next-80B-A3B-Instruct's and -Thinking's templates on the same conversations (their
    JSON tool calls take the records' arguments as given, strings or objects)."""
    data = build(tok, tmp_path, [record(name) for name in sorted(CONVERSATIONS)], template)
    expected = [ids(tok, official[template].apply_chat_template(CONVERSATIONS[name][0], tools=CONVERSATIONS[name][1],
                                                                 tokenize=False))
                for name in sorted(CONVERSATIONS)]
    assert sorted(tokens for tokens, _ in documents(data)) == sorted(expected)


def test_qwen3_next_instruct_trains_every_answer_as_written_and_counts_dropped_reasoning(tok, tmp_path):
    """No think blocks: an inline one is part of the answer (loss), ``reasoning_content`` is not
    rendered (counted); the template takes no kwargs."""
    data = build(tok, tmp_path / "a", [record("reasoning_content")], "qwen3_next")
    (tokens, loss), = documents(data)
    assert loss_text(tok, tokens, loss) == "6<|im_end|>8<|im_end|>"
    assert data.stats.masking["reasoning dropped (enable_thinking false or qwen3_next)"] == 2
    data = build(tok, tmp_path / "b", [record("inline_think")], "qwen3_next")
    (tokens, loss), = documents(data)
    assert loss_text(tok, tokens, loss) == ("<think>\nrecall geography\n</think>\n\nParis<|im_end|>"
                                            "<think>\nsame kind of question\n</think>\n\nRome<|im_end|>")
    with pytest.raises(DataError, match="'enable_thinking' is not a kwarg of the qwen3_next template"):
        make_spec("qwen3_next", tok, kwargs={"enable_thinking": False})
