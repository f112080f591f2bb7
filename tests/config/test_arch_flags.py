"""The hybrid-architecture flags of LoongForge's and Megatron-LM's Qwen3.5 / Qwen3-Next scripts:
parsed, checked against the run's model (never applied, never ignored), refused naming
themselves when the model contradicts them."""

import dataclasses

import pytest

from mlir_train.checkpoint.agree import run_model_config
from mlir_train.checkpoint.sources import Scratch
from mlir_train.config import cli
from mlir_train.config.arch_flags import (architecture, check_architecture_flags,
                                          linear_attention_pattern)
from mlir_train.config.models import LayerKind, ModelConfig
from mlir_train.runtime.errors import ConfigError

# The architecture flags megatron-core 0.16's TransformerConfig takes for Qwen3.5-35B-A3B's shape
# (LoongForge configs/models/qwen3.5/qwen3_5_35b_a3b_llm.yaml and
# examples/qwen3.5/finetuning/sft_qwen3_5_35b_a3b.sh at baidu-baige/LoongForge c6275661).
QWEN35_ARCH = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "4",
               "--linear-conv-kernel-dim", "4", "--linear-key-head-dim", "128",
               "--linear-value-head-dim", "128", "--linear-num-key-heads", "16",
               "--linear-num-value-heads", "32", "--attention-output-gate", "--apply-layernorm-1p",
               "--rotary-percent", "0.25", "--kv-channels", "256",
               "--moe-shared-expert-intermediate-size", "512", "--moe-shared-expert-gate"]


# The fields a hybrid family's config carries (Qwen3.5-35B-A3B's values), on a stand-in config
# for checking the flags before that family is on this branch.
HYBRID_FIELDS = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                     linear_num_key_heads=16, linear_num_value_heads=32, partial_rotary_factor=0.25,
                     shared_expert_intermediate_size=512)


def _three_linear_then_attention(self):
    return tuple(LayerKind(moe=True, mixer="attention" if (i + 1) % 4 == 0 else "gated_deltanet")
                 for i in range(self.num_layers))


HybridStandIn = dataclasses.make_dataclass(
    "HybridStandIn", [(k, type(v), v) for k, v in HYBRID_FIELDS.items()], bases=(ModelConfig,),
    frozen=True, namespace={"layer_kinds": _three_linear_then_attention})
HYBRID = HybridStandIn(name="qwen3.5-stand-in", vocab_size=248320, hidden_size=2048, num_layers=8,
                       num_heads=16, num_kv_heads=2, head_dim=256, intermediate_size=0,
                       num_experts=256, moe_intermediate_size=512, top_k=8)


def model_flags(argv):
    return cli.parse(argv).model


def test_the_loongforge_qwen3_5_flags_match_a_hybrid_model():
    check_architecture_flags(model_flags(QWEN35_ARCH), HYBRID)
    pattern = [1, 1, 1, 0, 1, 1, 1, 0]
    assert list(architecture(HYBRID)["--linear-attention-freq"]) == pattern
    assert list(linear_attention_pattern("4", 8)) == pattern
    assert list(linear_attention_pattern("([1]*3+[0])*2", 8)) == pattern
    check_architecture_flags(model_flags(["--linear-attention-freq", "[1,1,1,0,1,1,1,0]"]), HYBRID)


@pytest.mark.parametrize("argv, match", [
    (["--linear-num-value-heads", "48"], r"--linear-num-value-heads 48: the model qwen3.5-stand-in "
                                         r"has 32 \(its gated-DeltaNet layers' linear num value heads\)"),
    (["--linear-attention-freq", "2"], r"--linear-attention-freq \[1, 0, 1, 0, 1, 0, 1, 0\]: .* has "
                                       r"\[1, 1, 1, 0, 1, 1, 1, 0\]"),
    (["--rotary-percent", "1.0"], r"--rotary-percent 1.0: .* has 0.25"),
    (["--moe-shared-expert-intermediate-size", "1024"], r"has 512 \(the shared expert's width\)"),
])
def test_a_flag_the_hybrid_model_contradicts_stops_naming_it(argv, match):
    with pytest.raises(ConfigError, match=match + ".*drop it, or give --model-name an HF config.json"):
        check_architecture_flags(model_flags(argv), HYBRID)


@pytest.mark.parametrize("argv, match", [
    (["--attention-output-gate"], "--attention-output-gate: the model qwen3-moe-tiny has no sigmoid "
                                  "gate on the attention output"),
    (["--apply-layernorm-1p"], "--apply-layernorm-1p: the model qwen3-moe-tiny has no zero-centred"),
    (["--moe-shared-expert-gate"], "--moe-shared-expert-gate: .* has no sigmoid gate on a shared expert"),
    (["--linear-conv-kernel-dim", "4"], "--linear-conv-kernel-dim 4: .* has none"),
    (["--experimental-attention-variant", "gated_delta_net"], "has none"),
    (["--rotary-percent", "0.25"], "--rotary-percent 0.25: the model qwen3-moe-tiny has 1.0"),
])
def test_the_run_refuses_hybrid_flags_on_a_qwen3_model(argv, match):
    """Through the run's model resolution (no checkpoint: --model-name's config)."""
    cfg = cli.parse(["--model-name", "qwen3-moe-tiny", *argv])
    with pytest.raises(ConfigError, match=match):
        run_model_config(cfg, Scratch(), 1000)


def test_qwen3_runs_keep_their_restating_flags():
    cfg = cli.parse(["--model-name", "qwen3-moe-tiny", "--rotary-percent", "1.0",
                     "--linear-attention-freq", "([0]*4)"])
    assert run_model_config(cfg, Scratch(), 1000).name == "qwen3-moe-tiny"


@pytest.mark.parametrize("flag, value, why", [
    ("--config-file", "x.yaml", "LoongForge's model YAML is not read"),
    ("--mtp-standalone", None, "standalone MTP pipeline stage is not built"),
    ("--add-question-in-pretrain", None, "LoongForge's pretraining data option")])
def test_loongforge_qwen3_5_script_flags_we_do_not_implement_stop_naming_themselves(flag, value, why,
                                                                                   capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse([flag] + ([value] if value else []))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and why in err


def test_loongforge_qwen3_5_script_noop_flags_are_accepted():
    cfg = cli.parse(["--moe-shared-expert-overlap", "--cross-entropy-fusion-impl", "te"])
    assert set(cfg.ignored_flags) == {"--moe-shared-expert-overlap", "--cross-entropy-fusion-impl"}
