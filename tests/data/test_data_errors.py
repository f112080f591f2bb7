"""Bad input: one clear error naming the file, the line or record, and what was expected."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlir_train import preprocess
from mlir_train.data import DataError, build_datasets, default_data_config, load_tokenizer
from mlir_train.data.config import DEFAULT_TOKENIZER

GOOD = {"instruction": "Say hi.", "input": "", "output": "hi"}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_data_config())


def build(tok, tmp_path, path, **overrides):
    values = dict(data_path=(str(path),), seq_length=128, cache_path=str(tmp_path / "cache"))
    values.update(overrides)
    return build_datasets(default_data_config(**values), tok)


def write_jsonl(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line)
                              for line in lines) + "\n")
    return path


BAD_RECORDS = [  # (record, message fragment, skip reason)
    ({"instruction": "x"}, "missing field 'output': expected a string", "missing field"),
    ({"instruction": "x", "output": "  "}, "empty response", "empty response"),
    ({"instruction": "x", "output": 42}, "field 'output' is int: expected a string",
     "non-string field"),
    ({"instruction": ["x"], "output": "y"}, "field 'instruction' is list: expected a string",
     "non-string field"),
]


@pytest.mark.parametrize("record,message,reason", BAD_RECORDS)
def test_bad_record_in_jsonl_names_the_line(tok, tmp_path, record, message, reason):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, record])
    with pytest.raises(DataError) as e:
        build(tok, tmp_path, path)
    assert str(e.value).startswith(f"{path}:3: ") and message in str(e.value)


@pytest.mark.parametrize("record,message,reason", BAD_RECORDS)
def test_bad_record_in_json_list_names_the_record(tok, tmp_path, record, message, reason):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([GOOD, record]))
    with pytest.raises(DataError) as e:
        build(tok, tmp_path, path)
    assert str(e.value).startswith(f"{path} record 1: ") and message in str(e.value)


def test_skip_bad_records_counts_each_reason(tok, tmp_path):
    lines = [GOOD, "{not json", GOOD] + [r for r, _, _ in BAD_RECORDS] + [[1, 2]]
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    data = build(tok, tmp_path, path, skip_bad_records=True)
    assert data.stats.records_read == len(lines) and data.stats.records_kept == 2
    assert data.stats.dropped == {"malformed JSON": 1, "missing field": 1, "empty response": 1,
                                  "non-string field": 2, "record not an object": 1}
    summary = data.summary()
    assert "malformed JSON" in summary and f"{path}:4: missing field" in summary


def test_malformed_jsonl_line(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, '{"instruction": "x", "output": ', GOOD])
    with pytest.raises(DataError, match=r"d\.jsonl:2: malformed JSON line .*expected one JSON "
                                        r"object per line"):
        build(tok, tmp_path, path)


def test_malformed_json_list(tok, tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n {"instruction": "x", "output": "y"},\n {"instruction": }\n]')
    with pytest.raises(DataError, match=r"d\.json:3:18: malformed JSON"):
        build(tok, tmp_path, path)


def test_chat_records_must_alternate_and_end_with_a_response(tok, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [
        {"messages": [{"role": "user", "content": "a"}]}])
    with pytest.raises(DataError, match=r"c\.jsonl:1: conversation must end with an assistant"):
        build(tok, tmp_path, path, chat_template="qwen")
    write_jsonl(path, [{"conversations": [{"from": "human", "value": "a"},
                                          {"from": "tool", "value": "b"}]}])
    with pytest.raises(DataError, match=r"c\.jsonl:1: conversations\[1\]: unknown 'from' "
                                        r"'tool': expected one of \['function_call', 'gpt'"):
        build(tok, tmp_path, path, chat_template="qwen")


def _m(role, content="x", **extra):
    return {"role": role, "content": content, **extra}


_CALL = [{"type": "function", "function": {"name": "f", "arguments": {}}}]
BAD_CONVERSATIONS = [  # (messages, message fragment, reason)
    ([_m("user"), _m("critic")], "messages[1]: unknown 'role' 'critic': expected one of",
     "unknown role"),
    ([_m("user"), _m("tool"), _m("assistant")],
     "messages[1]: tool response without a call", "tool response without a call"),
    ([_m("user"), _m("assistant", tool_calls=_CALL), _m("tool"), _m("tool"), _m("assistant")],
     "messages[3]: tool response without a call", "tool response without a call"),
    ([_m("user"), _m("assistant", None, reasoning_content=" ")],
     "messages[1]: assistant turn with neither content nor reasoning", "empty assistant turn"),
    ([_m("assistant"), _m("user"), _m("assistant")],
     "messages[0]: roles out of order: an assistant message first",
     "roles out of order"),
    ([_m("user"), _m("user"), _m("assistant")], "messages[1]: roles out of order: two user",
     "roles out of order"),
    ([_m("user"), _m("assistant"), _m("assistant")],
     "messages[2]: roles out of order: an assistant message after an assistant message",
     "roles out of order"),
    ([_m("user"), _m("system"), _m("assistant")],
     "messages[1]: roles out of order: a system message is only allowed first",
     "roles out of order"),
    ([_m("user"), _m("assistant", tool_calls=[{"function": {"arguments": {}}}])],
     "messages[1]: tool call 0: expected an object with a string 'name'", "bad tool call"),
]


@pytest.mark.parametrize("messages,message,reason", BAD_CONVERSATIONS)
def test_bad_conversation_names_the_record(tok, tmp_path, messages, message, reason):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [_m("user"), _m("assistant")]},
                                              {"messages": messages}])
    with pytest.raises(DataError) as e:
        build(tok, tmp_path, path, chat_template="qwen3")
    assert str(e.value).startswith(f"{path}:2: ") and message in str(e.value), str(e.value)
    data = build(tok, tmp_path, path, chat_template="qwen3", skip_bad_records=True)
    assert data.stats.records_kept == 1 and data.stats.dropped == {reason: 1}


def test_sharegpt_function_call_and_observation_are_a_tool_call_and_its_response(tok, tmp_path):
    from mlir_train.data.records import DatasetFormat, RawRecord, resolve_format, to_sample
    from mlir_train.data.templates import make_spec, render

    value = {"conversations": [
        {"from": "human", "value": "weather?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Rome"}}'},
        {"from": "observation", "value": "sunny"}, {"from": "gpt", "value": "Sunny."}],
        "tools": '[{"name": "get_weather", "parameters": {}}]'}
    sample = to_sample(RawRecord("r", value), resolve_format(DatasetFormat(), value, "r"))
    assert [m.role for m in sample.messages] == ["user", "assistant", "tool", "assistant"]
    assert sample.messages[1].tool_calls[0].arguments == {"city": "Rome"}
    assert sample.tools == ({"name": "get_weather", "parameters": {}},)
    path = write_jsonl(tmp_path / "s.jsonl", [value])
    with pytest.raises(DataError, match=r"s\.jsonl:1: the record has tool calls.* use "
                                        r"--chat-template qwen3"):
        build(tok, tmp_path, path, chat_template="qwen")
    text, _ = render(sample, make_spec("qwen3", tok))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text


def test_bad_chat_template_kwargs(tok, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [_m("user"), _m("assistant")]}])
    # A missing file is named as one, not misread as bad JSON; bad JSON says where.
    with pytest.raises(DataError, match="--chat-template-kwargs 'enable_thinking': no such file, nor a JSON object"):
        build(tok, tmp_path, path, chat_template="qwen3", chat_template_kwargs="enable_thinking")
    with pytest.raises(DataError, match=r"--chat-template-kwargs '\{enable': not a JSON object \(.*line 1\)"):
        build(tok, tmp_path, path, chat_template="qwen3", chat_template_kwargs="{enable")
    with pytest.raises(DataError, match="'thinking_budget' is not a kwarg of the qwen3 template"):
        build(tok, tmp_path, path, chat_template="qwen3",
              chat_template_kwargs='{"thinking_budget": 3}')
    with pytest.raises(DataError, match="the qwen template takes no kwargs"):
        build(tok, tmp_path, path, chat_template="qwen",
              chat_template_kwargs='{"enable_thinking": false}')
    write_jsonl(path, [{"messages": [_m("user"), _m("assistant")],
                        "chat_template_kwargs": {"enable_thinking": "no"}}])
    with pytest.raises(DataError, match=r"c\.jsonl:1: chat_template_kwargs: 'enable_thinking' is "
                                        r"\"no\": expected true or false"):
        build(tok, tmp_path, path, chat_template="qwen3")


def test_unknown_chat_template(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    with pytest.raises(DataError, match="--chat-template 'vicuna': unknown template; expected "
                                        "one of"):
        build(tok, tmp_path, path, chat_template="vicuna")


def test_unknown_dataset_format(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"d": {"format": "parquet_magic"}}))
    with pytest.raises(DataError, match=r"cfg\.json: dataset 'd': unknown format "
                                        r"'parquet_magic'; expected one of"):
        build(tok, tmp_path, path, dataset_config=str(config))
    config.write_text(json.dumps({"other": {"format": "alpaca"}}))
    with pytest.raises(DataError, match=r"no entry for data file .*d\.jsonl"):
        build(tok, tmp_path, path, dataset_config=str(config))
    undetectable = write_jsonl(tmp_path / "u.jsonl", [{"text": "plain"}])
    with pytest.raises(DataError, match=r"u\.jsonl:1: cannot tell the dataset format"):
        build(tok, tmp_path, undetectable)


def test_missing_tokenizer_directory_and_data_file(tmp_path):
    with pytest.raises(DataError, match="no such directory"):
        load_tokenizer(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no tokenizer files"):
        load_tokenizer(str(tmp_path / "empty"))
    with pytest.raises(DataError, match="--tokenizer-type 'SentencePiece'"):
        load_tokenizer(default_data_config(tokenizer_type="SentencePiece"))
    with pytest.raises(DataError, match="missing.json: no such file"):
        build_datasets(default_data_config(data_path=(str(tmp_path / "missing.json"),)))


def test_cli_prints_the_error_and_exits_nonzero(tmp_path, capsys):
    """One line, status 2: the one error family of every entry point (mlir_train.runtime.errors)."""
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, {"instruction": "x"}])
    code = preprocess.main(["--data-path", str(path), "--data-cache-path", str(tmp_path),
                            "--hf-tokenizer-path", DEFAULT_TOKENIZER, "--seq-length", "64"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"mlir-train: error: {path}:2: missing field 'output': expected a string")
    result = subprocess.run(
        [sys.executable, "-m", "mlir_train.preprocess", "--hf-tokenizer-path",
         str(tmp_path / "nope"), "--data-path", str(path), "--seq-length", "64"], capture_output=True, text=True)
    assert result.returncode == 2 and "no such directory" in result.stderr


def test_preprocess_never_fills_in_the_bundled_files(tmp_path, capsys):
    """Data of one's own without a tokenizer (or a sequence length) is one error naming every
    missing flag and the demo to start from, never the bundled tokenizer at a default length."""
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    code = preprocess.main(["--data-path", str(path), "--data-cache-path", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("error:") == 1
    assert "missing --hf-tokenizer-path --seq-length (required)" in err and "--config demo" in err


def test_cli_summary(tmp_path, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD] * 5)
    code = preprocess.main(["--data-path", str(path), "--data-cache-path", str(tmp_path), "--hf-tokenizer-path",
                            DEFAULT_TOKENIZER, "--seq-length", "64", "--packing-sft-data", "--micro-batch-size", "1"])
    out = capsys.readouterr()
    assert code == 0
    for field in ("records read   5", "records kept   5", "truncated", "dropped", "rows",
                  "loss tokens", "fill"):
        assert field in out.out
    # The training command line's other flags are accepted (it is the same parser as sft's) ...
    assert "error" not in out.err
    # ... and a typo gets the same closest-flag error as training.
    with pytest.raises(SystemExit) as exc:
        preprocess.main(["--data-path", str(path), "--seq-lenght", "64"])
    assert exc.value.code == 2 and "--seq-length" in capsys.readouterr().err


@pytest.mark.parametrize("index, template", [(0, "alpaca"), (1, "qwen3"), (2, "qwen3")])
def test_readme_example_records_train(tok, tmp_path, index, template):
    """README's example record of each format is read, rendered and trained (alpaca, ShareGPT,
    OpenAI messages), each kept with loss tokens, in a file of its own."""
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    block = readme.split("One record of each format")[1].split("```json\n")[1].split("```")[0]
    records = block.strip().splitlines()
    assert len(records) == 3
    path = write_jsonl(tmp_path / f"r{index}.jsonl", [records[index]] * 2)
    data = build(tok, tmp_path, path, chat_template=template, packing=False, seq_length=512)
    assert data.stats.records_kept == 2 and sum(data.stats.loss_tokens.values()) > 0


def test_too_long_records_are_named_with_the_seq_length_that_keeps_them(tok, tmp_path):
    """Documents over a row, counted by what became of them: the first few records (file:line)
    and the --seq-length that keeps them all, in the summary and in the no-usable-records error."""
    long = {"instruction": "Say hi.", "input": "", "output": "hi " * 60}
    long_prompt = {"instruction": "Say hi. " * 40, "input": "", "output": "hi"}
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, long, GOOD, long, long_prompt])
    cut = build(tok, tmp_path, path, seq_length=48, packing=False)
    n = cut.stats.too_long["truncated"]["seq_length"]
    assert cut.stats.too_long["truncated"]["records"] == [f"{path}:2", f"{path}:4"] and n > 48
    assert "truncated      2 documents" in cut.stats.summary()
    assert f": {path}:2, {path}:4 (--seq-length {n} keeps them whole)" in cut.stats.summary()
    m = cut.stats.too_long["response truncated away"]["seq_length"]
    assert f"{'response truncated away':<28} 1: {path}:5 (--seq-length {m} keeps them)" in cut.stats.summary()
    dropped = build(tok, tmp_path, path, seq_length=48, packing=False, drop_long=True)
    assert dropped.stats.dropped == {"longer than seq_length": 3}
    assert (f"{'longer than seq_length':<28} 3: {path}:2, {path}:4, {path}:5 (--seq-length {max(n, m)} keeps them)"
            in dropped.stats.summary())
    only_long = write_jsonl(tmp_path / "long.jsonl", [long])
    with pytest.raises(DataError, match=rf"no usable records .*; --seq-length {n} keeps them$"):
        build(tok, tmp_path, only_long, seq_length=48, packing=False, drop_long=True)
