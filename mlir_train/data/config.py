"""``DataConfig``: the Megatron/AIAK data and SFT flags the pipeline reads."""

from __future__ import annotations

import dataclasses
import os

from mlir_train.config.demo import ASSETS, DEFAULT_DATA, DEFAULT_TOKENIZER  # noqa: F401 - the bundled files


@dataclasses.dataclass(frozen=True)
class DataConfig:
    data_path: tuple[str, ...]  # --data-path, incl. the blend syntax "w1 p1 w2 p2"
    tokenizer_path: str  # --hf-tokenizer-path
    tokenizer_type: str = "HFTokenizer"  # --tokenizer-type
    chat_template: str = "alpaca"  # --chat-template: one of templates.TEMPLATES
    seq_length: int = 2048  # --seq-length
    packing: bool = False  # --packing-sft-data
    num_workers: int = 1  # --sft-num-preprocess-workers
    # --data-cache-path; None -> $XDG_CACHE_HOME/mlir_train/sft_data (~/.cache/mlir_train/sft_data)
    cache_path: str | None = None
    dataset_config: str | None = None  # --sft-dataset-config
    split: str = "100,0,0"  # --split
    train_on_prompt: bool = False  # --train-on-prompt
    drop_long: bool = False  # --sft-drop-long-samples: drop (not truncate) samples over a row
    skip_bad_records: bool = False  # --sft-skip-bad-records
    seed: int = 1234  # --seed: split assignment, blend sampling (the loader takes its own seed)
    history_mask: bool = False  # --history-mask-loss: loss on the last assistant turn only
    reasoning_loss: str = "nonempty"  # --reasoning-loss: which <think> blocks get loss (qwen3)
    chat_template_kwargs: str | None = None  # --chat-template-kwargs: JSON object or a file of one
    eod_mask_loss: bool = False  # --eod-mask-loss: no loss on eos/pad tokens
    dataset_names: tuple[str, ...] = ()  # --sft-dataset: the --sft-dataset-config entry per file
    mix_strategy: str = "concat"  # --sft-data-mix-strategy: concat | interleave_under | _over
    packing_buffer_size: int | None = None  # --packing-buffer-size: documents packed together

    @classmethod
    def from_flags(cls, flags, seed: int) -> "DataConfig":
        """From the data flags (:class:`mlir_train.config.sections.DataFlags`) and ``--seed``:
        sft and preprocess share it, so both find the same cache."""
        return cls(
            data_path=tuple(flags.data_path), tokenizer_path=flags.tokenizer_path,
            tokenizer_type=flags.tokenizer_type or "HFTokenizer", chat_template=flags.chat_template or "alpaca",
            seq_length=flags.seq_length, packing=flags.packing_sft_data,
            num_workers=flags.sft_num_preprocess_workers or 1, cache_path=flags.data_cache_path,
            dataset_config=flags.sft_dataset_config, split=flags.split, train_on_prompt=flags.train_on_prompt,
            drop_long=flags.drop_long_samples, skip_bad_records=flags.sft_skip_bad_records, seed=seed,
            history_mask=flags.history_mask_loss, reasoning_loss=flags.reasoning_loss,
            chat_template_kwargs=flags.chat_template_kwargs, eod_mask_loss=flags.eod_mask_loss,
            dataset_names=tuple(flags.sft_dataset or ()), mix_strategy=flags.sft_data_mix_strategy,
            packing_buffer_size=flags.packing_buffer_size,
        )

    def resolved_cache_path(self) -> str:
        if self.cache_path:
            return self.cache_path
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "mlir_train", "sft_data")


def default_data_config(seq_length: int = 256, **overrides) -> DataConfig:
    """The bundled generated alpaca tasks and BPE tokenizer, packed as the seed run packs."""
    values = dict(data_path=(DEFAULT_DATA,), tokenizer_path=DEFAULT_TOKENIZER,
                  chat_template="alpaca", seq_length=seq_length, packing=True)
    values.update(overrides)
    return DataConfig(**values)
