"""--chat-template qwen3 against Qwen3's official chat template (tests/data/fixtures), token for
token through transformers' apply_chat_template; its loss masks; the masking options and what
the data summary says about them."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from mlir_train.data import DataError, build_datasets, default_data_config, load_tokenizer

OFFICIAL = os.path.join(os.path.dirname(__file__), "fixtures", "qwen3_chat_template.jinja")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def msg(role, content=None, **extra):
    return {"role": role, "content": content, **extra}


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# Conversations of our own: (messages, tools). Each ends with an assistant message.
CONVERSATIONS = {
    "multi_turn": ([msg("system", "You add numbers."), msg("user", "1 + 2"), msg("assistant", "3"),
                    msg("user", "3 + 4"), msg("assistant", "7")], None),
    "reasoning_content": ([msg("user", "2 * 3?"),
                           msg("assistant", "6", reasoning_content="two threes make six"),
                           msg("user", "and 2 * 4?"),
                           msg("assistant", "8", reasoning_content="\nfour twos\n")], None),
    "inline_think": ([msg("user", "capital of France?"),
                      msg("assistant", "<think>\nrecall geography\n</think>\n\nParis"),
                      msg("user", "and of Italy?"),
                      msg("assistant", "<think>\nsame kind of question\n</think>\n\nRome")], None),
    "tools": ([msg("system", "Use tools when useful."), msg("user", "Weather and time in Paris?"),
               msg("assistant", "Let me look.", reasoning_content="two tools needed",
                   tool_calls=[call("get_weather", {"city": "Paris"}),
                               call("get_time", '{"tz": "Europe/Paris"}')]),
               msg("tool", '{"temp": 21}'), msg("tool", "14:05"),
               msg("assistant", "It is 21 degrees and 14:05 in Paris.",
                   reasoning_content="combine both answers")], [WEATHER, TIME]),
    "tool_call_only": ([msg("user", "Weather in Rome?"),
                        msg("assistant", None, tool_calls=[call("get_weather", {"city": "Rome"})]),
                        msg("tool", "sunny"), msg("assistant", "Sunny in Rome.")], [WEATHER]),
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_data_config())


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    """The bundled tokenizer carrying Qwen3's official chat template (for apply_chat_template
    and --chat-template hf)."""
    directory = tmp_path_factory.mktemp("qwen3_tok")
    shutil.copytree(load_tokenizer(default_data_config()).name_or_path, directory,
                    dirs_exist_ok=True)
    shutil.copy(OFFICIAL, directory / "chat_template.jinja")
    return load_tokenizer(str(directory))


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def build(tok, tmp_path, records, **overrides):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    values = dict(data_path=(str(path),), seq_length=2048, packing=False, chat_template="qwen3",
                  cache_path=str(tmp_path / "cache"))
    values.update(overrides)
    return build_datasets(default_data_config(**values), tok)


def document(data, row=0):
    doc = int(data.train.row_documents(row)[0])
    tokens, loss = data.train.document(doc)
    return tokens.tolist(), loss


def loss_text(tok, tokens, loss):
    return tok.decode([t for t, l in zip(tokens, loss) if l])


def record(name):
    messages, tools = CONVERSATIONS[name]
    return {"messages": messages, **({"tools": tools} if tools else {})}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_renders_token_for_token_as_the_official_template(tok, official, tmp_path, name):
    messages, tools = CONVERSATIONS[name]
    data = build(tok, tmp_path, [record(name)])
    expected = official.apply_chat_template(messages, tools=tools, tokenize=False)
    tokens, _ = document(data)
    assert tokens == ids(tok, expected)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_non_thinking_final_answer_follows_the_official_generation_prompt(tok, official, tmp_path,
                                                                         name):
    """enable_thinking false: the prompt is the official non-thinking generation prompt (its
    empty think block included), the answer and its tool calls follow; the final reasoning is
    dropped and counted."""
    messages, tools = CONVERSATIONS[name]
    data = build(tok, tmp_path, [record(name)], chat_template_kwargs='{"enable_thinking": false}')
    prompt = official.apply_chat_template(messages[:-1], tools=tools, tokenize=False,
                                          add_generation_prompt=True, enable_thinking=False)
    content = messages[-1]["content"]
    final = dict(messages[-1], reasoning_content="", content=content.split("</think>")[-1].lstrip("\n"))
    whole = official.apply_chat_template(messages[:-1] + [final], tools=tools, tokenize=False)
    assert whole.startswith(prompt)
    tokens, loss = document(data)
    assert tokens == ids(tok, whole)
    # Only the final answer is after the prompt; loss there is the answer and <|im_end|>.
    n_prompt = len(ids(tok, prompt))
    assert ids(tok, prompt) == tokens[:n_prompt]
    assert loss_text(tok, tokens[n_prompt:], loss[n_prompt:]) == whole[len(prompt):-1]
    had_reasoning = "reasoning_content" in messages[-1] or "</think>" in (messages[-1]["content"]
                                                                          or "")
    assert data.stats.masking["reasoning dropped (enable_thinking false or qwen3_next)"] == int(had_reasoning)
    assert data.stats.masking["empty think blocks skipped"] == 1


def test_hf_template_with_the_official_jinja_gives_the_same_tokens(tok, official, tmp_path):
    """--chat-template hf runs the official jinja itself: multi-turn reasoning (stripped from
    the history by the template) now renders, with the same tokens as qwen3."""
    for name in ("multi_turn", "reasoning_content", "inline_think"):
        hf = build(official, tmp_path / name, [record(name)], chat_template="hf")
        ours = build(tok, tmp_path / name, [record(name)])
        assert document(hf)[0] == document(ours)[0]


def test_loss_mask_covers_answers_reasoning_and_tool_calls(tok, tmp_path):
    data = build(tok, tmp_path, [record("tools")])
    tokens, loss = document(data)
    calls = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>')
    assert loss_text(tok, tokens, loss) == (
        "<think>\ntwo tools needed\n</think>\n\nLet me look.\n" + calls + "<|im_end|>"
        "<think>\ncombine both answers\n</think>\n\nIt is 21 degrees and 14:05 in Paris.<|im_end|>")
    stats = data.stats
    assert stats.masking["records with tools"] == 1
    assert set(stats.loss_tokens_by_role) == {"assistant", "reasoning"}
    assert sum(stats.loss_tokens_by_role.values()) == stats.loss_tokens["train"]
    assert stats.loss_tokens_by_role["reasoning"] == len(ids(tok, "<think>\ntwo tools needed\n"
                                                             "</think>\n\n")) + len(
        ids(tok, "<think>\ncombine both answers\n</think>\n\n"))


def test_history_reasoning_is_stripped_and_empty_think_never_trained(tok, tmp_path):
    data = build(tok, tmp_path, [record("reasoning_content"), record("multi_turn")])
    texts = {}
    for row in range(2):
        tokens, loss = document(data, row)
        texts[tok.decode(tokens)] = loss_text(tok, tokens, loss)
    by_first_answer = {k.split("<|im_start|>assistant\n")[1][:1]: v for k, v in texts.items()}
    # The first turn's reasoning is history (before the last user query): not rendered.
    assert by_first_answer["6"] == "6<|im_end|><think>\nfour twos\n</think>\n\n8<|im_end|>"
    # multi_turn's final answer gets the empty think block, without loss.
    assert by_first_answer["3"] == "3<|im_end|>7<|im_end|>"
    assert data.stats.masking["empty think blocks skipped"] == 1


@pytest.mark.parametrize("reasoning_loss,expected", [
    ("all", "3<|im_end|><think>\n\n</think>\n\n7<|im_end|>"),
    ("none", "3<|im_end|>7<|im_end|>")])
def test_reasoning_loss_option(tok, tmp_path, reasoning_loss, expected):
    data = build(tok, tmp_path, [record("multi_turn")], reasoning_loss=reasoning_loss)
    assert loss_text(tok, *document(data)) == expected
    data = build(tok, tmp_path, [record("reasoning_content")], reasoning_loss=reasoning_loss)
    assert ("four twos" in loss_text(tok, *document(data))) == (reasoning_loss == "all")


def test_history_mask_loss_trains_the_last_turn_only(tok, tmp_path):
    data = build(tok, tmp_path, [record("multi_turn"), record("tools")], history_mask=True)
    texts = sorted(loss_text(tok, *document(data, row)) for row in range(2))
    assert texts == ["7<|im_end|>",
                     "<think>\ncombine both answers\n</think>\n\nIt is 21 degrees and 14:05 in "
                     "Paris.<|im_end|>"]
    assert data.stats.masking["turns masked by history"] == 2
    # The other templates honour it too.
    data = build(tok, tmp_path, [record("multi_turn")], history_mask=True, chat_template="qwen")
    assert loss_text(tok, *document(data)) == "7<|im_end|>"


def test_per_record_kwargs_override_the_run(tok, tmp_path):
    own = dict(record("reasoning_content"), chat_template_kwargs={"enable_thinking": True})
    data = build(tok, tmp_path, [own, record("reasoning_content")],
                 chat_template_kwargs='{"enable_thinking": false}')
    kept = sorted("four twos" in loss_text(tok, *document(data, row)) for row in range(2))
    assert kept == [False, True]
    assert data.stats.masking["reasoning dropped (enable_thinking false or qwen3_next)"] == 1


def test_train_on_prompt_counts_every_role(tok, tmp_path):
    data = build(tok, tmp_path, [record("tools")], train_on_prompt=True)
    roles = data.stats.loss_tokens_by_role
    assert set(roles) == {"system", "user", "tool", "assistant", "reasoning"}
    assert sum(roles.values()) == data.stats.loss_tokens["train"]
    summary = data.summary()
    assert "loss tokens by role" in summary and "records with tools 1" in summary


def test_eod_mask_loss_drops_the_eos_targets(tok, tmp_path):
    alpaca = [{"instruction": "Say hi.", "output": "hi"}]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(alpaca))
    cfg = dict(data_path=(str(path),), packing=False, cache_path=str(tmp_path / "c"))
    plain = build_datasets(default_data_config(**cfg), tok)
    masked = build_datasets(default_data_config(eod_mask_loss=True, **cfg), tok)
    assert plain.cache_dir != masked.cache_dir
    tokens, loss = document(plain)
    assert loss_text(tok, tokens, loss) == "hi<|endoftext|>"
    assert loss_text(tok, *document(masked)) == "hi"
    assert masked.stats.masking["eod tokens masked"] == 1


def test_every_option_is_in_the_cache_key(tok, tmp_path):
    dirs = {build(tok, tmp_path, [record("reasoning_content")], **options).cache_dir
            for options in ({}, {"history_mask": True}, {"reasoning_loss": "all"},
                            {"chat_template_kwargs": '{"enable_thinking": false}'},
                            {"train_on_prompt": True})}
    assert len(dirs) == 5


def test_a_file_without_loss_tokens_is_an_error_naming_it(tok, tmp_path):
    """Answers that are end-of-document tokens only, with <|im_end|> as the eos: --eod-mask-loss
    takes out every loss token, and nothing is left to learn in the file."""
    directory = tmp_path / "tok_im_end"
    shutil.copytree(tok.name_or_path, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|im_end|>"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    im_end_eos = load_tokenizer(str(directory))
    records = [{"messages": [msg("user", "q"), msg("assistant", "<|endoftext|>", reasoning_content="r")]}] * 2
    with pytest.raises(DataError, match=r"chat\.jsonl: masking leaves no loss tokens in any of "
                                        r"its records \(2 with none under --eod-mask-loss "
                                        r"--reasoning-loss none\)"):
        build(im_end_eos, tmp_path, records, eod_mask_loss=True, reasoning_loss="none")
    data = build(im_end_eos, tmp_path, records, eod_mask_loss=True)  # the reasoning is trained
    assert data.stats.masking["eod tokens masked"] == 4


@pytest.mark.parametrize("answer", [dict(content="", reasoning_content="r"), dict(content="<think>\nr\n</think>\n\n")])
def test_a_final_turn_that_only_thinks_is_a_bad_record(tok, tmp_path, answer):
    """Thinking and no answer (a cut-off generation) would teach the model to stop after it
    thinks: an error naming the record, or under --sft-skip-bad-records one dropped and counted."""
    records = [{"messages": [msg("user", "q"), msg("assistant", **answer)]}, record(sorted(CONVERSATIONS)[0])]
    with pytest.raises(DataError, match=r"chat\.jsonl:1: messages\[1\]: assistant turn with reasoning only"):
        build(tok, tmp_path, records)
    data = build(tok, tmp_path, records, skip_bad_records=True)
    assert data.stats.dropped == {"thinking only": 1} and data.stats.records_kept == 1


def test_worker_processes_give_the_same_documents_and_counts(tok, tmp_path):
    records = [record(name) for name in sorted(CONVERSATIONS)] * 3
    one = build(tok, tmp_path / "a", records, history_mask=True)
    two = build(tok, tmp_path / "b", records, history_mask=True, num_workers=2)
    assert one.stats.masking == two.stats.masking
    assert one.stats.loss_tokens_by_role == two.stats.loss_tokens_by_role
    assert [document(one, r)[0] for r in range(len(records))] == \
        [document(two, r)[0] for r in range(len(records))]


def test_the_bundled_tokenizer_has_qwen3s_added_tokens(tok):
    """Qwen3's added tokens (<think>, <tool_call>, ...) are single tokens after the trained
    vocabulary, so the qwen3 template's markup is one id each and earlier ids never move."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_assets", Path(__file__).parents[2] / "scripts" / "make_assets.py")
    assets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(assets)
    QWEN3_SPECIAL, QWEN3_ADDED, SPECIAL_TOKENS, VOCAB_SIZE = (assets.QWEN3_SPECIAL, assets.QWEN3_ADDED,
                                                              assets.SPECIAL_TOKENS, assets.VOCAB_SIZE)
    for i, token in enumerate(QWEN3_SPECIAL + QWEN3_ADDED):
        assert tok.convert_tokens_to_ids(token) == VOCAB_SIZE + i
        assert tok(f"a{token}b", add_special_tokens=False)["input_ids"][1] == VOCAB_SIZE + i
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert set(QWEN3_SPECIAL) <= set(tok.all_special_tokens) and "<think>" not in tok.all_special_tokens
