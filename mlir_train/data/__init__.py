"""SFT data: alpaca/sharegpt/openai files -> chat template -> tokens -> packed rows -> batches.

    cfg = DataConfig(data_path=("alpaca_data_en_52k.json",), tokenizer_path="/data/Qwen3-30B-A3B",
                     chat_template="alpaca", seq_length=2048, packing=True, num_workers=8)
    data = build_datasets(cfg)            # cached under cfg.cache_path, reused when unchanged
    print(data.summary())
    loader = BatchLoader(data.train, global_batch_size=128, seed=cfg.seed,
                         process_index=jax.process_index(), process_count=jax.process_count())
    batch = next(loader)                  # this process's rows of the next global batch

Batch keys, each ``[rows, seq_length]``: ``input_ids`` int32; ``labels`` int32, the next token at
each position (shifted per document, so never across a document boundary); ``loss_mask``
float32, 1 on response tokens and the token that ends each response (qwen3: tool calls too, and
reasoning per ``reasoning_loss``; the last turn only with ``history_mask``; no eos/pad targets
with ``eod_mask_loss``; all tokens with train_on_prompt), 0 on prompts and padding; ``segment_ids`` int32, 1, 2, ... per document in the
row and 0 on padding; ``positions`` int32, restarting at 0 for each document.
"""

from mlir_train.data.config import DataConfig, default_data_config
from mlir_train.data.dataset import BATCH_KEYS, SPLITS, DataStats, SFTDataset, SFTDatasets
from mlir_train.data.loader import BatchLoader
from mlir_train.data.pipeline import build_datasets
from mlir_train.data.records import DataError
from mlir_train.data.tokenizer import load_tokenizer

__all__ = [
    "BATCH_KEYS", "SPLITS", "BatchLoader", "DataConfig", "DataError", "DataStats", "SFTDataset",
    "SFTDatasets", "build_datasets", "default_data_config", "load_tokenizer",
]
