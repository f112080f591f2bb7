"""Readers and chat templates: renderings checked token by token, loss masks included."""

import json

import numpy as np
import pytest

from mlir_train.data import DataConfig, build_datasets, default_data_config, load_tokenizer
from mlir_train.data.records import Sample, Turn, parse_data_path, parse_split
from mlir_train.data.templates import (ALPACA_PREAMBLE, ALPACA_PREAMBLE_INPUT, TemplateSpec,
                                       make_spec, render)

EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_data_config())


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def only_row(tok, tmp_path, records, name="data.json", **overrides):
    """Build an unpacked dataset of ``records`` and return it (one row per record)."""
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    else:
        path.write_text(json.dumps(records))
    values = dict(seq_length=256, packing=False, cache_path=str(tmp_path / "cache"),
                  data_path=(str(path),))
    values.update(overrides)
    return build_datasets(default_data_config(**values), tok)


def expected_row(prompt_parts, tok):
    """Token ids and per-token loss flags for [(text, is_loss), ...] tokenised piecewise."""
    tokens, loss = [], []
    for text, is_loss in prompt_parts:
        piece = ids(tok, text)
        tokens += piece
        loss += [is_loss] * len(piece)
    return tokens, loss


def check_row(data, row, tokens, loss):
    """input_ids/labels are the per-document shift of ``tokens``; loss_mask is loss[1:]."""
    batch = data.train.rows([row])
    n = len(tokens) - 1
    assert batch["input_ids"][0, :n].tolist() == tokens[:-1]
    assert batch["labels"][0, :n].tolist() == tokens[1:]
    assert batch["loss_mask"][0, :n].tolist() == [float(x) for x in loss[1:]]
    assert batch["segment_ids"][0, :n].tolist() == [1] * n
    assert batch["positions"][0, :n].tolist() == list(range(n))
    assert not batch["segment_ids"][0, n:].any() and not batch["loss_mask"][0, n:].any()
    for key in ("input_ids", "labels", "segment_ids", "positions"):
        assert batch[key].dtype == np.int32
    assert batch["loss_mask"].dtype == np.float32


def test_alpaca_without_input_token_by_token(tok, tmp_path):
    record = {"instruction": "Reverse the order of the words.", "input": "",
              "output": "river apple"}
    data = only_row(tok, tmp_path, [record])
    prompt = (f"{ALPACA_PREAMBLE}### Instruction:\nReverse the order of the words.\n\n"
              f"### Response:\n")
    tokens, loss = expected_row([(prompt, 0), ("river apple" + EOS, 1)], tok)
    assert tokens == ids(tok, prompt + "river apple" + EOS)  # piecewise == whole-text tokens
    assert tokens[-1] == tok.eos_token_id
    check_row(data, 0, tokens, loss)
    batch = data.train.rows([0])
    assert tok.decode(batch["labels"][0][batch["loss_mask"][0] == 1]) == "river apple" + EOS


def test_alpaca_with_input_token_by_token(tok, tmp_path):
    record = {"instruction": "Add the two numbers.", "input": "12 + 30", "output": "42"}
    data = only_row(tok, tmp_path, [record])
    prompt = (f"{ALPACA_PREAMBLE_INPUT}### Instruction:\nAdd the two numbers.\n\n"
              f"### Input:\n12 + 30\n\n### Response:\n")
    tokens, loss = expected_row([(prompt, 0), ("42" + EOS, 1)], tok)
    assert tokens == ids(tok, prompt + "42" + EOS)
    check_row(data, 0, tokens, loss)


def test_alpaca_history_and_system(tok, tmp_path):
    record = {"instruction": "And 2 + 2?", "input": "", "output": "4", "system": "Be brief.",
              "history": [["What is 1 + 1?", "2"]]}
    data = only_row(tok, tmp_path, [record])
    tokens, loss = expected_row([
        ("Be brief.\n\n### Instruction:\nWhat is 1 + 1?\n\n### Response:\n", 0), ("2" + EOS, 1),
        ("\n\n### Instruction:\nAnd 2 + 2?\n\n### Response:\n", 0), ("4" + EOS, 1)], tok)
    check_row(data, 0, tokens, loss)


def chatml_expected(tok, system, turns):
    parts = [] if system is None else [(f"<|im_start|>system\n{system}<|im_end|>\n", 0)]
    for user, assistant in turns:
        parts.append((f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n", 0))
        parts.append((assistant + "<|im_end|>", 1))
        parts.append(("\n", 0))
    return expected_row(parts, tok)


@pytest.mark.parametrize("template", ["qwen", "chatml"])
def test_qwen_sharegpt_multi_turn_with_system(tok, tmp_path, template):
    record = {"system": "You add numbers.", "conversations": [
        {"from": "human", "value": "1 + 2"}, {"from": "gpt", "value": "3"},
        {"from": "human", "value": "3 + 4"}, {"from": "gpt", "value": "7"}]}
    data = only_row(tok, tmp_path, [record], chat_template=template)
    tokens, loss = chatml_expected(tok, "You add numbers.", [("1 + 2", "3"), ("3 + 4", "7")])
    check_row(data, 0, tokens, loss)
    batch = data.train.rows([0])
    assert tok.decode(batch["labels"][0][batch["loss_mask"][0] == 1]) == "3<|im_end|>7<|im_end|>"


def test_qwen_openai_messages_without_system_jsonl(tok, tmp_path):
    records = [{"messages": [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "hello"}]}]
    data = only_row(tok, tmp_path, records, name="chat.jsonl", chat_template="qwen")
    check_row(data, 0, *chatml_expected(tok, None, [("hi", "hello")]))


def test_alpaca_record_through_qwen_joins_input(tok, tmp_path):
    data = only_row(tok, tmp_path, [{"instruction": "Sort.", "input": "b a", "output": "a b"}],
                    chat_template="qwen")
    check_row(data, 0, *chatml_expected(tok, None, [("Sort.\nb a", "a b")]))


def test_hf_template_matches_tokenizer_and_qwen_masks(tok, tmp_path):
    record = {"messages": [{"role": "system", "content": "S"},
                           {"role": "user", "content": "u1"},
                           {"role": "assistant", "content": "a1"},
                           {"role": "user", "content": "u2"},
                           {"role": "assistant", "content": "a2"}]}
    hf = only_row(tok, tmp_path, [record], chat_template="hf")
    text = tok.apply_chat_template(record["messages"], tokenize=False)
    tokens, loss = chatml_expected(tok, "S", [("u1", "a1"), ("u2", "a2")])
    assert tokens == ids(tok, text)
    check_row(hf, 0, tokens, loss)


def test_train_on_prompt_masks_everything_but_padding(tok, tmp_path):
    record = {"instruction": "Spell cat backwards.", "input": "", "output": "tac"}
    data = only_row(tok, tmp_path, [record], train_on_prompt=True)
    batch = data.train.rows([0])
    n = int((batch["segment_ids"][0] > 0).sum())
    assert batch["loss_mask"][0, :n].all() and not batch["loss_mask"][0, n:].any()


def test_dataset_config_renames_columns(tok, tmp_path):
    (tmp_path / "qa.json").write_text(json.dumps([{"q": "Name a fruit.", "a": "apple"}]))
    config = tmp_path / "sft_dataset_config.json"
    config.write_text(json.dumps({"qa": {"format": "alpaca",
                                         "columns": {"prompt": "q", "response": "a"}}}))
    data = build_datasets(default_data_config(
        data_path=(str(tmp_path / "qa.json"),), dataset_config=str(config), packing=False,
        cache_path=str(tmp_path / "cache")), tok)
    prompt = f"{ALPACA_PREAMBLE}### Instruction:\nName a fruit.\n\n### Response:\n"
    check_row(data, 0, *expected_row([(prompt, 0), ("apple" + EOS, 1)], tok))


def test_sharegpt_custom_tags_from_yaml_config(tok, tmp_path):
    (tmp_path / "chats.jsonl").write_text(json.dumps(
        {"dialog": [{"speaker": "me", "text": "x"}, {"speaker": "bot", "text": "y"}]}) + "\n")
    config = tmp_path / "cfg.yaml"
    config.write_text("chats:\n  formatting: sharegpt\n  columns: {messages: dialog}\n"
                      "  tags: {role_tag: speaker, content_tag: text, user_tag: me, "
                      "assistant_tag: bot}\n")
    data = build_datasets(default_data_config(
        data_path=(str(tmp_path / "chats.jsonl"),), dataset_config=str(config), packing=False,
        chat_template="chatml", cache_path=str(tmp_path / "cache")), tok)
    check_row(data, 0, *chatml_expected(tok, None, [("x", "y")]))


def test_blend_weights_and_split(tok, tmp_path):
    a = [{"instruction": f"a{i}", "output": "x"} for i in range(40)]
    b = [{"instruction": f"b{i}", "output": "y"} for i in range(10)]
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in b))
    sources = parse_data_path([f"0.5 {tmp_path / 'a.json'}", "0.5", str(tmp_path / "b.jsonl")])
    assert [s.weight for s in sources] == [0.5, 0.5]
    assert parse_split("98,1,1") == pytest.approx((0.98, 0.01, 0.01))
    data = build_datasets(DataConfig(
        data_path=("0.5", str(tmp_path / "a.json"), "0.5", str(tmp_path / "b.jsonl")),
        tokenizer_path=tok.name_or_path, seq_length=64, split="80,10,10",
        cache_path=str(tmp_path / "cache")), tok)
    # Each file is split 80/10/10 first, then the split's documents are shared 50/50.
    assert [s["blended"] for s in data.stats.sources] == [[20, 3, 3], [20, 2, 2]]
    assert (data.train.num_rows, data.valid.num_rows, data.test.num_rows) == (40, 5, 5)


def test_render_spans_cover_response_and_end_token(tok):
    spec = make_spec("qwen", tok)
    text, spans = render(Sample((Turn("p", "r"),)), spec)
    assert [text[a:b] for a, b in spans] == ["r<|im_end|>"]
    text, spans = render(Sample((Turn("p", "r", "i"),)), TemplateSpec("alpaca", EOS))
    assert [text[a:b] for a, b in spans] == ["r" + EOS]


def test_hf_template_that_rewrites_the_last_turn(tok, tmp_path):
    """Like Qwen3's template: an empty think block before the final answer only."""
    import shutil

    tok_dir = tmp_path / "tok"
    shutil.copytree(tok.name_or_path, tok_dir)
    (tok_dir / "chat_template.jinja").write_text(
        "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{%- if m['role'] == 'assistant' and loop.last %}{{ '<think>\\n\\n</think>\\n\\n' }}"
        "{%- endif %}{{ m['content'] + '<|im_end|>\\n' }}{%- endfor %}")
    qwen3_like = load_tokenizer(str(tok_dir))
    record = {"messages": [{"role": "user", "content": "u1"},
                           {"role": "assistant", "content": "a1"},
                           {"role": "user", "content": "u2"},
                           {"role": "assistant", "content": "a2"}]}
    data = only_row(qwen3_like, tmp_path, [record], chat_template="hf")
    tokens, loss = expected_row([
        ("<|im_start|>user\nu1<|im_end|>\n<|im_start|>assistant\n", 0), ("a1<|im_end|>", 1),
        ("\n<|im_start|>user\nu2<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", 0),
        ("a2<|im_end|>", 1), ("\n", 0)], tok)
    assert tokens == ids(tok, qwen3_like.apply_chat_template(record["messages"], tokenize=False))
    check_row(data, 0, tokens, loss)


def test_long_responses_count_every_loss_token(tok, tmp_path):
    record = {"instruction": "Repeat.", "input": "", "output": " ".join(["apple river"] * 300)}
    data = only_row(tok, tmp_path, [record], seq_length=1024)
    batch = data.train.rows([0])
    assert batch["loss_mask"].sum() > 255  # beyond uint8 range of the stored flags
    assert data.stats.loss_tokens["train"] == int(batch["loss_mask"].sum())
