"""Packing, preprocessing workers, the cache, and the resumable loader."""

import json
import os

import numpy as np
import pytest

from mlir_train.data import (BatchLoader, DataError, build_datasets, default_data_config,
                             load_tokenizer)
from mlir_train.data import pipeline
from mlir_train.data.packing import pack_best_fit
from mlir_train.data.records import Sample, Turn
from mlir_train.data.templates import make_spec, render


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_data_config())


@pytest.fixture(scope="module")
def subset(tmp_path_factory):
    """600 bundled records plus a few far longer than a 256-token row."""
    with open(default_data_config().data_path[0]) as f:
        records = json.load(f)[:600]
    records += [{"instruction": "Repeat the words.", "input": "",
                 "output": " ".join(["apple river"] * (150 + 30 * i))} for i in range(5)]
    path = tmp_path_factory.mktemp("data") / "subset.json"
    path.write_text(json.dumps(records))
    return str(path), records


def config(tmp_path, path, **overrides):
    values = dict(data_path=(path,), seq_length=256, cache_path=str(tmp_path / "cache"))
    values.update(overrides)
    return default_data_config(**values)


def document_lengths(tok, records):
    """Positions each record takes in a row before truncation (tokens - 1), independently."""
    spec = make_spec("alpaca", tok)
    return [len(tok(render(Sample((Turn(r["instruction"], r["output"], r["input"]),)), spec)[0],
                    add_special_tokens=False)["input_ids"]) - 1 for r in records]


def test_packing_keeps_documents_whole_and_loses_no_tokens(tok, tmp_path, subset):
    path, records = subset
    data = build_datasets(config(tmp_path, path, split="90,5,5"), tok)
    stats = data.stats
    assert stats.records_read == stats.records_kept == len(records)
    assert stats.truncated == 5
    every = [data.train, data.valid, data.test]
    rows = {split.name: split.rows(np.arange(split.num_rows)) for split in every}
    out = sum(int((r["segment_ids"] > 0).sum()) for r in rows.values())
    # tokens in == tokens out + counted truncations
    assert sum(document_lengths(tok, records)) == out + stats.truncated_tokens
    assert out == stats.document_tokens == sum(stats.tokens.values())
    assert sum(int(r["loss_mask"].sum()) for r in rows.values()) == sum(stats.loss_tokens.values())
    seen = []
    for split in every:
        batch = rows[split.name]
        for r in range(split.num_rows):
            segments = batch["segment_ids"][r]
            docs = split.row_documents(r)
            seen += docs.tolist()
            used = segments > 0
            assert not used[np.argmin(used):].any() if not used.all() else True  # padding last
            for k, doc in enumerate(docs, start=1):
                tokens, _ = split.document(doc)
                where = segments == k
                # Each document is whole, contiguous, restarts its positions, and its labels
                # are its own next tokens: nothing crosses into the neighbouring document.
                assert batch["input_ids"][r][where].tolist() == tokens[:-1].tolist()
                assert batch["labels"][r][where].tolist() == tokens[1:].tolist()
                assert batch["positions"][r][where].tolist() == list(range(len(tokens) - 1))
            assert not batch["loss_mask"][r][~used].any()
    assert sorted(seen) == list(range(len(records)))  # every document in exactly one row
    assert data.stats.fill_ratio("train") > 0.9


def test_drop_long_counts_instead_of_truncating(tok, tmp_path, subset):
    path, records = subset
    data = build_datasets(config(tmp_path, path, drop_long=True), tok)
    assert data.stats.dropped == {"longer than seq_length": 5}
    assert data.stats.truncated == 0 and data.stats.records_kept == len(records) - 5
    assert "longer than seq_length" in data.summary()


def test_unpacked_rows_hold_one_document_each(tok, tmp_path, subset):
    path, records = subset
    data = build_datasets(config(tmp_path, path, packing=False), tok)
    assert data.train.num_rows == len(records)
    batch = data.train.rows(np.arange(20))
    assert set(np.unique(batch["segment_ids"]).tolist()) <= {0, 1}


def test_best_fit_fills_alpaca_like_rows():
    rng = np.random.default_rng(0)
    # Alpaca-52k-like: log-normal lengths around 150 tokens, capped at the row.
    lengths = np.minimum(rng.lognormal(np.log(150), 0.7, 52_000).astype(int) + 20, 2048)
    row_offsets, row_docs = pack_best_fit(lengths, 2048)
    assert sorted(row_docs.tolist()) == list(range(len(lengths)))
    per_row = np.add.reduceat(lengths[row_docs], row_offsets[:-1])
    assert per_row.max() <= 2048
    assert lengths.sum() / (2048 * len(per_row)) >= 0.95


def test_workers_give_identical_arrays_and_cache_is_reused(tok, tmp_path, subset):
    path, _ = subset
    one = build_datasets(config(tmp_path, path, cache_path=str(tmp_path / "a")), tok)
    two = build_datasets(config(tmp_path, path, cache_path=str(tmp_path / "b"), num_workers=2), tok)
    assert os.path.basename(one.cache_dir) == os.path.basename(two.cache_dir)
    for name in os.listdir(one.cache_dir):
        if name.endswith(".npy"):
            assert np.array_equal(np.load(os.path.join(one.cache_dir, name)),
                                  np.load(os.path.join(two.cache_dir, name))), name
    again = build_datasets(
        config(tmp_path, path, cache_path=str(tmp_path / "a"), num_workers=2), tok)
    assert again.from_cache and again.cache_dir == one.cache_dir
    assert isinstance(again.train._tokens, np.memmap)


def test_cache_invalidation(tok, tmp_path, subset):
    path, records = subset
    base = build_datasets(config(tmp_path, path), tok)
    keys = {base.cache_dir}
    for change in (dict(seq_length=200), dict(packing=False), dict(chat_template="qwen"),
                   dict(train_on_prompt=True), dict(split="90,10,0"), dict(drop_long=True)):
        data = build_datasets(config(tmp_path, path, **change), tok)
        assert not data.from_cache, change
        keys.add(data.cache_dir)
    assert len(keys) == 7
    copy = tmp_path / "copy.json"
    copy.write_text(json.dumps(records[:-1] + [{**records[-1], "output": "changed"}]))
    assert not build_datasets(config(tmp_path, str(copy)), tok).from_cache
    other_tok = load_tokenizer(tok.name_or_path)
    other_tok.add_tokens(["applepie"])
    assert not build_datasets(config(tmp_path, path), other_tok).from_cache
    assert build_datasets(config(tmp_path, path), tok).from_cache


def test_killed_build_leaves_no_loadable_cache(tok, tmp_path, subset, monkeypatch):
    path, _ = subset
    real_save = np.save
    calls = []

    def dying_save(file, array):
        calls.append(file)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed mid-write")
        real_save(file, array)

    monkeypatch.setattr(pipeline.np, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        build_datasets(config(tmp_path, path), tok)
    monkeypatch.setattr(pipeline.np, "save", real_save)
    root = tmp_path / "cache"
    assert [p for p in os.listdir(root) if not p.startswith(".tmp-")] == []
    # A SIGKILL would also leave a temporary directory behind; it must never be loaded.
    (root / ".tmp-leftover").mkdir()
    data = build_datasets(config(tmp_path, path), tok)
    assert not data.from_cache and data.train.num_rows > 0


def test_loader_is_deterministic_and_resumes_exactly(tok, tmp_path, subset):
    path, _ = subset
    data = build_datasets(config(tmp_path, path), tok)
    rows = data.train.num_rows
    loader = BatchLoader(data.train, 8, seed=3)
    batches = [next(loader) for _ in range(rows // 8 + 5)]  # crosses an epoch boundary
    assert batches[0]["input_ids"].shape == (8, 256)
    state = None
    resumed = BatchLoader(data.train, 8, seed=3)
    for i in range(7):
        next(resumed)
    state = json.loads(json.dumps(resumed.state()))
    fresh = BatchLoader(data.train, 8, seed=3)
    fresh.restore(state)
    for expected in batches[7:]:
        got = next(fresh)
        for key in expected:
            np.testing.assert_array_equal(got[key], expected[key])
    # Every row once per epoch, in a different order each epoch.
    order = BatchLoader(data.train, 1, seed=3)
    epoch0 = [order.next_global_rows()[0] for _ in range(rows)]
    epoch1 = [order.next_global_rows()[0] for _ in range(rows)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(rows)) and epoch0 != epoch1
    assert order.state()["epoch"] == 2
    other_seed = BatchLoader(data.train, 8, seed=4)
    assert not np.array_equal(next(other_seed)["input_ids"], batches[0]["input_ids"])


def test_each_process_reads_its_part_of_the_global_batch(tok, tmp_path, subset):
    path, _ = subset
    data = build_datasets(config(tmp_path, path), tok)
    whole = BatchLoader(data.train, 8, seed=0)
    parts = [BatchLoader(data.train, 8, seed=0, process_index=i, process_count=4)
             for i in range(4)]
    for _ in range(3):
        batch = next(whole)
        pieces = [next(p) for p in parts]
        assert pieces[0]["input_ids"].shape == (2, 256)
        for key in batch:
            np.testing.assert_array_equal(np.concatenate([p[key] for p in pieces]), batch[key])


def test_loader_rejects_empty_split_and_foreign_state(tok, tmp_path, subset):
    path, _ = subset
    data = build_datasets(config(tmp_path, path), tok)
    with pytest.raises(DataError, match="valid split has 0 rows"):
        BatchLoader(data.valid, 8, seed=0)
    loader = BatchLoader(data.train, 8, seed=0)
    with pytest.raises(DataError, match="seed"):
        loader.restore({**loader.state(), "seed": 1})
