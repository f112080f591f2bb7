"""LoongForge's SFT data flags: each honoured (tested here) or refused naming it."""

import json

import pytest

from mlir_train.config import cli
from mlir_train.data import DataConfig, DataError, build_datasets, default_data_config, load_tokenizer
from mlir_train.data.config import DEFAULT_TOKENIZER


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_data_config())


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def alpaca(prefix, n):
    return [{"instruction": f"{prefix} {i}", "output": "ok"} for i in range(n)]


def test_the_flags_reach_the_data_config():
    cfg = cli.parse(["--data-path", "d.jsonl", "--sft-dataset", "qa", "--sft-dataset-config", "cfg.json", "--history-mask-loss",
                     "--chat-template-kwargs", '{"enable_thinking": false}', "--eod-mask-loss",
                     "--sft-data-mix-strategy", "interleave_over", "--packing-buffer-size", "64",
                     "--enable-discard-sample", "--reasoning-loss", "all"])
    data = DataConfig.from_flags(cfg.data, 7)
    assert (data.dataset_names, data.dataset_config, data.history_mask, data.eod_mask_loss) == (
        ("qa",), "cfg.json", True, True)
    assert (data.chat_template_kwargs, data.mix_strategy, data.packing_buffer_size) == (
        '{"enable_thinking": false}', "interleave_over", 64)
    assert data.drop_long and data.reasoning_loss == "all"


@pytest.mark.parametrize("flag,value", [
    ("--sft-train-dataset", "qa"), ("--sft-valid-dataset", "qa"), ("--sft-test-dataset", "qa"),
    ("--is-tokenized-data", None), ("--sft-data-streaming", None), ("--sft-sort-batch", None)])
def test_refused_flags_name_themselves(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse([flag] + ([value] if value else []))
    assert e.value.code == 2
    assert f"{flag}: " in capsys.readouterr().err


def test_noop_flags_are_accepted():
    cli.parse(["--use-fixed-seq-lengths", "--streaming-buffer-size", "16384"])


def test_sft_dataset_names_the_config_entry_of_each_file(tok, tmp_path):
    qa = write(tmp_path / "one.jsonl", [{"q": "Name a fruit.", "a": "apple"}])
    chat = write(tmp_path / "two.jsonl", [{"dialog": [{"who": "me", "text": "hi"},
                                                      {"who": "bot", "text": "hello"}]}])
    config = tmp_path / "sft_dataset_config.json"
    config.write_text(json.dumps({
        "qa": {"format": "alpaca", "columns": {"prompt": "q", "response": "a"}},
        "chat": {"format": "sharegpt", "columns": {"messages": "dialog"},
                 "tags": {"role_tag": "who", "content_tag": "text", "user_tag": "me",
                          "assistant_tag": "bot"}}}))
    base = dict(dataset_config=str(config), cache_path=str(tmp_path / "cache"), packing=False,
                chat_template="qwen3")
    data = build_datasets(default_data_config(data_path=(qa, chat), dataset_names=("qa", "chat"),
                                              **base), tok)
    assert data.stats.records_kept == 2
    one = build_datasets(default_data_config(data_path=(qa,), dataset_names=("qa",), **base), tok)
    assert one.stats.records_kept == 1
    with pytest.raises(DataError, match=r"--sft-dataset qa chat qa: 3 names for 2 --data-path"):
        build_datasets(default_data_config(data_path=(qa, chat), dataset_names=("qa", "chat", "qa"),
                                           **base), tok)
    with pytest.raises(DataError, match=r"--sft-dataset nope: not in .*sft_dataset_config\.json"):
        build_datasets(default_data_config(data_path=(qa,), dataset_names=("nope",), **base), tok)
    with pytest.raises(DataError, match=r"--sft-dataset qa: names entries of --sft-dataset-config"):
        build_datasets(default_data_config(data_path=(qa,), dataset_names=("qa",),
                                           cache_path=str(tmp_path / "cache")), tok)


@pytest.mark.parametrize("strategy,expected", [
    ("concat", [6, 2]), ("interleave_under", [2, 2]), ("interleave_over", [6, 6])])
def test_mix_strategy_sets_each_files_share(tok, tmp_path, strategy, expected):
    a = write(tmp_path / "a.jsonl", alpaca("a", 6))
    b = write(tmp_path / "b.jsonl", alpaca("b", 2))
    data = build_datasets(default_data_config(
        data_path=(a, b), mix_strategy=strategy, packing=False, split="100,0,0",
        cache_path=str(tmp_path / "cache")), tok)
    assert [s["blended"][0] for s in data.stats.sources] == expected
    assert data.train.num_rows == sum(expected)


def test_mix_strategy_and_blend_weights_exclude_each_other(tok, tmp_path):
    a = write(tmp_path / "a.jsonl", alpaca("a", 2))
    with pytest.raises(DataError, match="--sft-data-mix-strategy interleave_under with a weighted"):
        build_datasets(default_data_config(data_path=("1", a, "1", a), mix_strategy="interleave_under",
                                           cache_path=str(tmp_path / "cache")), tok)


def test_packing_buffer_packs_that_many_samples_at_a_time(tok, tmp_path):
    a = write(tmp_path / "a.jsonl", alpaca("a", 12))
    base = dict(data_path=(a,), seq_length=512, split="100,0,0", cache_path=str(tmp_path / "c"))
    whole = build_datasets(default_data_config(**base), tok)
    assert whole.train.num_rows == 1  # twelve short samples fit one row
    buffered = build_datasets(default_data_config(packing_buffer_size=5, **base), tok)
    assert buffered.train.num_rows == 3 and buffered.cache_dir != whole.cache_dir
    rows = [len(buffered.train.row_documents(r)) for r in range(3)]
    assert rows == [5, 5, 2]
    with pytest.raises(DataError, match="--packing-buffer-size 0: expected a positive"):
        build_datasets(default_data_config(packing_buffer_size=0, **base), tok)


def test_a_shared_config_with_multimodal_entries_serves_its_text_entries(tok, tmp_path):
    """LoongForge's own sft_dataset_config.yaml describes multimodal datasets too: their
    'images' columns make only those entries unusable."""
    config = tmp_path / "sft_dataset_config.yaml"
    config.write_text(
        "openai:\n  format: openai\n  columns: {messages: messages, tools: tools}\n"
        "  tags: {role_tag: role, content_tag: content, user_tag: user, assistant_tag: assistant,"
        " system_tag: system, tool_tag: tool}\n"
        "multimodal:\n  format: sharegpt\n  columns: {messages: messages, images: images}\n")
    chat = write(tmp_path / "chat.jsonl", [{"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}])
    base = dict(data_path=(chat,), dataset_config=str(config), cache_path=str(tmp_path / "c"),
                chat_template="qwen3")
    data = build_datasets(default_data_config(dataset_names=("openai",), **base), tok)
    assert data.stats.records_kept == 1
    with pytest.raises(DataError, match=r"sft_dataset_config\.yaml: dataset 'multimodal': unknown "
                                        r"column/tag names \['images'\] \(text-only SFT\)"):
        build_datasets(default_data_config(dataset_names=("multimodal",), **base), tok)


def test_preprocess_takes_a_loongforge_qwen3_command_line(tmp_path, capsys):
    """LoongForge's Qwen3 SFT data flags on one command line: accepted, honoured, summarised."""
    from mlir_train import preprocess

    chat = write(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": "1 + 1?"},
                      {"role": "assistant", "content": "2", "reasoning_content": "add"},
                      {"role": "user", "content": "2 + 2?"},
                      {"role": "assistant", "content": "4", "reasoning_content": "add again"}]}] * 3)
    config = tmp_path / "sft_dataset_config.json"
    config.write_text(json.dumps({"openai": {"format": "openai"}}))
    code = preprocess.main([
        "--data-path", chat, "--data-cache-path", str(tmp_path / "cache"), "--seq-length", "512",
        "--hf-tokenizer-path", DEFAULT_TOKENIZER, "--chat-template", "qwen3-hf", "--sft-dataset-config", str(config), "--sft-dataset", "openai",
        "--history-mask-loss", "--chat-template-kwargs", '{"enable_thinking": true}',
        "--eod-mask-loss", "--sft-data-mix-strategy", "concat", "--packing-sft-data",
        "--packing-buffer-size", "2", "--enable-discard-sample", "--use-fixed-seq-lengths",
        "--split", "100,0,0"])
    out = capsys.readouterr().out
    assert code == 0
    assert "turns masked by history 3" in out and "records kept   3" in out
    assert "loss tokens by role (kept documents): assistant " in out and ", reasoning " in out
    assert "train  rows        2" in out  # packed two samples at a time
