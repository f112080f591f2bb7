"""The Megatron-compatible command line accepts the user's seed script, flag for flag."""

import json
import os
import re
from types import SimpleNamespace

import pytest

from mlir_train.config import cli


def parse(argv):
    """The parsed run configuration as one flat namespace of Megatron dest names, and the
    accepted no-op flags given."""
    cfg = cli.parse(argv)
    return SimpleNamespace(**cfg.flat()), list(cfg.ignored_flags)

SEED_FILE = os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "shared", "seed", "qwen3_30b_a3b_sft_megatron_aiak.txt"
)
SEED_ARRAYS = {
    "MODEL_ARGS": "model",
    "DATA_ARGS": "data",
    "SFT_ARGS": "sft",
    "TRAINING_ARGS": "training",
    "MOE_ARGS": "moe",
    "MODEL_PARALLEL_ARGS": "model-parallel",
    "LOGGING_ARGS": "logging",
}

# A copy of the seed's arrays (variables expanded to their defaults) so the test runs where
# ../shared is absent. test_seed_copy_matches_seed_file keeps it in sync with the file.
SEED_COPY = {
    "model": "--model-name qwen3-30b-a3b --rotary-base 1000000 --rotary-seq-len-interpolation-factor 1",
    "data": "--tokenizer-type HFTokenizer --hf-tokenizer-path /data/Qwen3-30B-A3B/ "
    "--data-path /data/dataset/alpaca_data_en_52k.json --split 100,0,0",
    "sft": "--chat-template alpaca --sft-num-preprocess-workers 8 --no-check-for-nan-in-loss-and-grad "
    "--packing-sft-data",
    "training": "--training-phase sft --seq-length 2048 --max-position-embeddings 2048 "
    "--init-method-std 0.006 --micro-batch-size 1 --global-batch-size 128 --lr 1.0e-5 --min-lr 1.0e-6 "
    "--clip-grad 1.0 --weight-decay 0.1 --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 "
    "--adam-eps 1e-08 --norm-epsilon 1e-6 --train-iters 50 --lr-decay-iters 5000 "
    "--lr-decay-style cosine --lr-warmup-fraction 0.002 --initial-loss-scale 65536 --bf16 "
    "--load /data/Qwen3_30B_mcore_tp2pp2ep2 --save /data/Qwen3_30B_mcore_tp2pp2ep2_save "
    "--save-interval 500 --eval-interval 100 --eval-iters 10 --no-load-optim --no-load-rng",
    "moe": "--moe-router-load-balancing-type aux_loss --moe-router-topk 8 --moe-aux-loss-coeff 1e-2",
    "model-parallel": "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
    "--expert-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer "
    "--distributed-backend nccl",
    "logging": "--log-interval 1 --tensorboard-dir /data/tensorboard-log/qwen3-30b.sft.xpu "
    "--log-timers-to-tensorboard --wandb-project WANDB_PROJECT --wandb-exp-name WANDB_NAME",
}


def _read_seed(path: str) -> dict[str, str]:
    """The seed's bash arrays as group -> expanded command-line text."""
    text = open(path, encoding="utf-8").read()
    defaults = dict(re.findall(r'^(\w+)=\$\{\w+:-"([^"]*)"\}', text, re.M))

    def expand(tok: str) -> str:
        return re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m.group(1), m.group(1)), tok)

    out: dict[str, list[str]] = {}
    for name, body in re.findall(r"^\s*(\w+)\+?=\(\n(.*?)^\s*\)", text, re.M | re.S):
        if name not in SEED_ARRAYS:
            continue
        for line in body.splitlines():
            line = re.split(r"\s#", " " + line, maxsplit=1)[0]
            out.setdefault(SEED_ARRAYS[name], []).extend(expand(t) for t in line.split())
    return {group: " ".join(toks) for group, toks in out.items()}


def _seed_groups() -> dict[str, str]:
    return _read_seed(SEED_FILE) if os.path.exists(SEED_FILE) else SEED_COPY


def _flags(text: str) -> list[str]:
    return [t for t in text.split() if t.startswith("--")]


@pytest.mark.skipif(not os.path.exists(SEED_FILE), reason="seed script not checked out (../shared)")
def test_seed_copy_matches_seed_file():
    seed = _read_seed(SEED_FILE)
    assert set(seed) == set(SEED_ARRAYS.values())
    assert seed == SEED_COPY


def test_every_seed_flag_is_in_its_seed_group():
    for group, text in _seed_groups().items():
        flags = _flags(text)
        assert flags, group
        missing = [f for f in flags if f not in cli.FLAG_GROUPS[group]]
        assert not missing, f"{group}: {missing}"


def test_seed_command_line_parses():
    argv = " ".join(_seed_groups().values()).split()
    ns, ignored = parse(argv)
    assert ignored == ["--distributed-backend"]
    assert ns.model_name == "qwen3-30b-a3b"
    assert ns.rotary_base == 1_000_000 and ns.rotary_seq_len_interpolation_factor == 1
    assert ns.tokenizer_type == "HFTokenizer" and ns.split == "100,0,0"
    assert ns.data_path == ("/data/dataset/alpaca_data_en_52k.json",)
    assert ns.check_for_nan_in_loss_and_grad is False and ns.packing_sft_data
    assert ns.sft_num_preprocess_workers == 8 and ns.chat_template == "alpaca"
    assert (ns.seq_length, ns.micro_batch_size, ns.global_batch_size) == (2048, 1, 128)
    assert ns.lr == 1e-5 and ns.min_lr == 1e-6 and ns.lr_decay_style == "cosine"
    assert ns.lr_warmup_fraction == 0.002 and ns.lr_decay_iters == 5000 and ns.train_iters == 50
    assert (ns.adam_beta1, ns.adam_beta2, ns.adam_eps, ns.weight_decay) == (0.9, 0.95, 1e-8, 0.1)
    assert ns.bf16 and not ns.fp16 and ns.initial_loss_scale == 65536.0
    assert ns.no_load_optim and ns.no_load_rng and ns.save_interval == 500
    assert ns.moe_router_topk == 8 and ns.moe_aux_loss_coeff == 0.01
    assert (ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size) == (2, 2)
    assert ns.expert_model_parallel_size == 2 and ns.sequence_parallel and ns.use_distributed_optimizer
    assert ns.log_interval == 1 and ns.log_timers_to_tensorboard
    assert ns.tensorboard_dir.endswith("qwen3-30b.sft.xpu")


def test_megatron_defaults():
    ns, ignored = parse([])
    assert ignored == []
    assert ns.weight_decay == 0.01 and ns.adam_beta2 == 0.999 and ns.adam_eps == 1e-8
    assert ns.clip_grad == 1.0 and ns.lr_decay_style == "linear" and ns.lr_warmup_iters == 0
    assert ns.lr_wsd_decay_style == "exponential" and ns.min_lr == 0.0
    assert ns.initial_loss_scale == 2.0**32 and ns.loss_scale_window == 1000 and ns.hysteresis == 2
    assert ns.make_vocab_size_divisible_by == 128 and ns.seed == 1234
    assert ns.eval_interval == 1000 and ns.eval_iters == 100 and ns.log_interval == 100
    assert ns.moe_token_drop_policy == "probs" and ns.moe_router_load_balancing_type == "aux_loss"
    assert ns.check_for_nan_in_loss_and_grad is True and ns.optimizer == "adam"
    # Architecture flags default to None: the model registry fills them, not Megatron's defaults.
    assert ns.moe_router_topk is None and ns.rotary_base is None and ns.norm_epsilon is None


def test_restartable_job_flags():
    ns, ignored = parse(["--exit-interval", "500", "--exit-duration-in-mins", "230.5", "--exit-signal-handler",
                                  "--exit-on-missing-checkpoint"])
    assert ignored == []  # each has an effect (tests/checkpoint/test_checkpoint.py, tests/runtime/test_multihost.py)
    assert (ns.exit_interval, ns.exit_duration_in_mins) == (500, 230.5)
    assert ns.exit_signal_handler and ns.exit_on_missing_checkpoint
    ns, _ = parse([])
    assert ns.exit_interval is None and ns.exit_duration_in_mins is None and not ns.exit_on_missing_checkpoint


def test_unknown_flag_suggests_closest(capsys):
    with pytest.raises(SystemExit) as e:
        parse(["--global-batch-sise", "8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown flag --global-batch-sise" in err and "did you mean --global-batch-size?" in err


# Real flags of peers' scripts that we do not have (Megatron-LM core_v0.16.1 arguments.py and
# TransformerConfig, LoongForge, ms-swift, LoRA): none is a misspelling of one of ours, so none
# may get a "did you mean" (before: --fp8-format -> --ckpt-format, --lora-dim -> --load,
# --fp8-interval -> --log-interval, --batch-size -> --micro-batch-size, ...).
PEER_FLAGS = """
--lora-dim --lora_dim --lora-alpha --lora-rank --lora-dropout --lora-target-modules --load_lora_ckpt_path
--sft-dataset --sft-sort-batch --sft-data-streaming --sft-tokenizer-prompt-format --pretrain-as-fp8
--batch-size --dataset --dataset-path --tokenizer-path --cache-path --format --port --ckpt --output-dir
--virtual-pipeline-model-parallel-size --num-layers-in-first-pipeline-stage --layernorm-epsilon
--overlap-p2p-comm --tp-comm-overlap-ag --apply-rope-fusion --persist-layer-norm --bias-dropout-fusion
--checkpoint-activations --decoder-seq-length --encoder-num-layers --padded-vocab-size --vocab-file
--num-moe-experts --moe-token-dropping --exp-avg-dtype --main-grads-dtype --grad-reduce-in-bf16
--kv-lora-rank --q-lora-rank --multi-latent-attention --rope-scaling-factor --rotary-interleaved
--cpu-offloading --optimizer-cpu-offload --init-method-xavier-uniform --use-kitchen --spec --sft
--eod-mask-loss --reset-position-ids --reset-attention-mask --mock-data --rtol --atol --tp --pp
""".split()


def test_peer_flags_get_no_far_fetched_suggestion():
    known = cli._option_actions(cli.build_parser())
    unknown = [f for f in PEER_FLAGS if f not in known and f.replace("_", "-") not in known]
    assert len(unknown) > 40
    suggested = {f: cli._closest(f, known) for f in unknown}
    assert {f: s for f, s in suggested.items() if s} == {}


@pytest.mark.parametrize("typo,meant", [
    ("--global-batch-sise", "--global-batch-size"), ("--tensor-model-paralel-size", "--tensor-model-parallel-size"),
    ("--moe-router-top-k", "--moe-router-topk"), ("--seq-lenght", "--seq-length"), ("--lr-warmup-iter", "--lr-warmup-iters"),
    ("--moe-aux-loss-coef", "--moe-aux-loss-coeff"), ("--use-distributed-optimiser", "--use-distributed-optimizer"),
    ("--pipline-model-parallel-size", "--pipeline-model-parallel-size"), ("--trian-iters", "--train-iters"),
    ("--svae", "--save"), ("--micro_batch_size", "--micro-batch-size"), ("--Lr", "--lr"),
])
def test_typos_get_the_flag_they_misspell(typo, meant):
    assert cli._closest(typo, cli._option_actions(cli.build_parser())) == meant


@pytest.mark.parametrize("argv,flag", [
    (["--fp8-format", "hybrid"], "--fp8-format"), (["--fp8-amax-history-len", "1024"], "--fp8-amax-history-len"),
    (["--no-fp8-wgrad"], "--no-fp8-wgrad"), (["--fp4-format", "e2m1"], "--fp4-format"),
    (["--fp8_recipe", "delayed"], "--fp8_recipe"), (["--fp8-force-no-requant"], "--fp8-force-no-requant"),
])
def test_fp8_flags_are_refused_naming_fp8(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and "FP8" in err and "did you mean" not in err


def test_underscore_spelling_suggests_dash_flag(capsys):
    with pytest.raises(SystemExit) as e:
        parse(["--micro_batch_size=2"])
    assert e.value.code == 2
    assert "did you mean --micro-batch-size?" in capsys.readouterr().err


def test_no_prefix_abbreviations(capsys):
    with pytest.raises(SystemExit):
        parse(["--lr-warmup", "3"])
    assert "unknown flag --lr-warmup" in capsys.readouterr().err


def test_ignored_flags_with_and_without_values_reported_once():
    ns, ignored = parse(
        ["--use-flash-attn", "--distributed-backend", "gloo", "--transformer-impl", "local",
         "--use-flash-attn", "--overlap-grad-reduce", "--swiglu", "--normalization", "RMSNorm",
         "--lr", "3e-4"]
    )
    assert ignored == ["--use-flash-attn", "--distributed-backend", "--transformer-impl",
                       "--overlap-grad-reduce", "--swiglu", "--normalization"]
    assert ns.lr == 3e-4
    # The ignored flags leave nothing in the namespace (--moe-gemm-backend is a field of our own).
    assert not {"use_flash_attn", "distributed_backend", "transformer_impl", "overlap_grad_reduce"} & set(vars(ns))


def test_architecture_flag_contradicting_qwen3_fails(capsys):
    with pytest.raises(SystemExit) as e:
        parse(["--normalization", "LayerNorm"])
    assert e.value.code == 2
    assert "RMSNorm" in capsys.readouterr().err


def test_config_file_yaml_with_command_line_override(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "training:\n  lr: 1.0e-5\n  global_batch_size: 64\n  bf16: true\n"
        "data-path: [a.json, b.json]\n"
        "no_check_for_nan_in_loss_and_grad: true\n"
        "distributed-backend: nccl\n"
        "lr-decay-style: cosine\n"
    )
    ns, ignored = parse(["--config", str(cfg), "--global-batch-size", "32"])
    assert ns.lr == 1e-5 and ns.bf16 and ns.lr_decay_style == "cosine"
    assert ns.global_batch_size == 32  # the command line wins
    assert ns.data_path == ("a.json", "b.json")
    assert ns.check_for_nan_in_loss_and_grad is False
    assert ignored == ["--distributed-backend"]


def test_config_file_json_and_dest_names(tmp_path):
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"check_for_nan_in_loss_and_grad": False, "train_iters": 7, "fp16": False}))
    ns, _ = parse([f"--config={cfg}"])
    assert ns.check_for_nan_in_loss_and_grad is False and ns.train_iters == 7 and not ns.fp16


def test_config_file_bad_key_names_file_and_closest_flag(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("global_batch_sise: 8\n")
    with pytest.raises(SystemExit) as e:
        parse(["--config", str(cfg)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert str(cfg) in err and "did you mean --global-batch-size?" in err


def test_config_file_bad_value_names_file(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("lr_decay_style: exponential\n")
    with pytest.raises(SystemExit) as e:
        parse(["--config", str(cfg)])
    assert e.value.code == 2
    assert str(cfg) in capsys.readouterr().err


def test_help_groups_flags_like_the_seed(capsys):
    with pytest.raises(SystemExit) as e:
        parse(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    titles = [cli.GROUP_TITLES[g] for g in cli.SEED_GROUPS]
    positions = [out.index(t + ":") for t in titles]
    assert positions == sorted(positions)
    assert "--global-batch-size" in out[positions[3]:positions[4]]
    # No argparse internals, a literal %, and the required flags marked.
    assert "{'" not in out and "about 1% step-time gain" in out
    assert re.search(r"--lr LR\s+(.|\n)*?\(required\)", out) and "bundled" not in out


def test_config_demo_is_the_no_argument_job_and_flags_change_it():
    """--config demo: the no-argument job's flags; a flag after it changes that one flag, and a
    flag the demo's cannot run with (--lr-warmup-iters for its --lr-warmup-fraction) replaces it."""
    from mlir_train import sft
    from mlir_train.config import demo

    assert sft.DEFAULT_ARGV == ["--config", "demo"]
    base = cli.parse(["--config", "demo"])
    lora = cli.parse(["--config", "demo", "--lora-dim", "8"])
    assert lora.training.lora is not None and lora.training.lora.dim == 8
    assert lora.replace(training={"lora_dim": None}) == base
    assert base.data.data_path == (demo.DEFAULT_DATA,) and base.model.model_name == "qwen3-moe-tiny"
    warm = cli.parse(["--config", "demo", "--lr-warmup-iters", "3"])
    assert warm.training.lr_warmup_iters == 3 and warm.training.lr_warmup_fraction is None
    short = cli.parse(["--config", "demo", "--train-iters", "5"])  # the demo's warm-up scales with it
    assert short.training.train_iters == 5 and short.training.lr_warmup_fraction == 0.2
    assert "change it by adding flags" in demo.INTRO and "--config demo --lora-dim 8" in demo.INTRO


def test_config_that_is_no_file_points_at_the_demo(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        parse(["--config", str(tmp_path / "demo.yaml")])
    assert e.value.code == 2 and "--config demo is the no-argument job's flags" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bf16", "--fp16"], "mutually exclusive"),
        (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"], "only one of"),
        (["--lr-decay-style", "WSD"], "--lr-wsd-decay-iters"),
        (["--global-batch-size", "10", "--micro-batch-size", "4"], "not a multiple"),
        (["--hidden-dropout", "0.1"], "dropout"),
    ],
)
def test_megatron_validation(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_recompute_activations_alias():
    assert cli.parse(["--recompute-activations"]).training.remat == "selective"
