"""The Qwen3.5 / Qwen3.6 and Qwen3-Next family (gated DeltaNet and gated attention, a shared
expert): its configs (:mod:`.config`), decoder layer (:mod:`.model`) and parameter table
(:mod:`.params`), as one :class:`~mlir_train.families.family.Family`."""

from mlir_train.families.family import Family
from mlir_train.families.qwen3_5 import config, megatron, params
from mlir_train.families.qwen3_5.model import Qwen35

FAMILY = Family(
    name="qwen3_5", config=config.Qwen35Config, models=config.MODELS, hf_model_types=config.HF_MODEL_TYPES,
    from_hf=config.from_hf, to_hf=config.to_hf, model=Qwen35, params=params.TABLE,
    from_megatron=megatron.from_megatron, to_megatron=config.to_megatron, hf_table=params.hf_table,
    # Context parallel with tensor and pipeline parallel is exact (refused until 2026-12-04: the decay
    # gate's float32 gradient noise, shown as such in float64 by benchmarks/float64_reference.py).
)
