"""Every accepted flag is honest: honoured, a listed no-op under XLA, or refused naming itself.

The parser is generated from ``mlir_train.config.flags``; these tests walk it, so a flag added
without a decision fails here.
"""

import dataclasses
import json
import sys
import types

import numpy as np
import pytest

from mlir_train import families
from mlir_train.config import cli
from mlir_train.config import flag_table, flags, sections
from mlir_train.runtime.errors import ConfigError
from mlir_train.train import build
from mlir_train.train.pipeline import Schedule
from mlir_train.config.flag_table import ARCH_IMPLIED_FLAGS, NOOP_FLAGS, NOT_IMPLEMENTED_FLAGS, REFUSED

# A value of each refused flag that must stop the run (None: a switch).
REFUSED_VALUES = {
}


def _field_flags() -> dict[str, str]:
    """Every spelling of every field's flag -> the field's primary flag."""
    return {name: fl.name for _, _, _, fl in sections.section_fields() for name in fl.names}


def test_every_parser_flag_is_in_exactly_one_group():
    parser = cli.build_parser()
    options = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    fields = _field_flags()
    honoured = {o for o in options if o in fields and fields[o] not in REFUSED}
    refused = {o for o in options if o in fields and fields[o] in REFUSED}
    noop = options & (set(NOOP_FLAGS) | set(ARCH_IMPLIED_FLAGS))
    not_implemented = options & set(NOT_IMPLEMENTED_FLAGS)
    unclassified = options - honoured - refused - noop - not_implemented
    assert not (not_implemented & (noop | set(fields))), sorted(not_implemented & (noop | set(fields)))
    assert not unclassified, f"flags in no group: {sorted(unclassified)}"
    assert not (set(NOOP_FLAGS) & set(ARCH_IMPLIED_FLAGS))
    assert not (noop & set(fields)), f"a no-op flag is also a field: {sorted(noop & set(fields))}"
    assert set(REFUSED) <= set(fields.values())
    # The flag table covers the same flags, one row each.
    table = flag_table.flag_table()
    assert len({row[0] for row in table}) == len(table)
    assert {row[0] for row in table} == (set(fields.values()) | set(NOOP_FLAGS) | set(ARCH_IMPLIED_FLAGS)
                                         | set(NOT_IMPLEMENTED_FLAGS))


@pytest.mark.parametrize("flag", sorted(NOT_IMPLEMENTED_FLAGS))
def test_not_implemented_flag_stops_naming_itself(flag, capsys):
    nargs, why = NOT_IMPLEMENTED_FLAGS[flag]
    argv = [flag] + {0: [], 1: ["2"], "+": ["2", "2"]}[nargs]
    with pytest.raises(SystemExit) as e:
        cli.parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and why in err, err


def test_megatrons_moe_and_parallel_flags_are_all_known():
    """Every flag of Megatron-LM core_v0.16.1's MoE / distributed groups and of its
    TransformerConfig's MoE / parallelism fields, as its own parser spells them
    (tests/megatron_moe_parallel_flags.txt, dumped from megatron/training/arguments.py):
    each is honoured, a listed no-op or refused by name here."""
    import os

    path = os.path.join(os.path.dirname(__file__), "megatron_moe_parallel_flags.txt")
    megatron = [line.split()[0] for line in open(path) if line.strip() and not line.startswith("#")]
    assert len(megatron) > 100
    options = {o for a in cli.build_parser()._actions for o in a.option_strings}
    assert [f for f in megatron if f not in options] == []


def test_every_refused_flag_has_a_refusing_value():
    assert set(REFUSED_VALUES) == set(REFUSED)


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_refused_flag_stops_naming_itself(flag, capsys):
    value = REFUSED_VALUES[flag]
    argv = [flag] + ([] if value is None else [value])
    with pytest.raises(SystemExit) as e:
        cli.parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and REFUSED[flag].message in err, err


def test_sinkhorn_in_a_list_refuses(capsys):
    with pytest.raises(SystemExit):
        cli.parse(["--moe-router-load-balancing-type", "aux_loss", "sinkhorn", "--moe-aux-loss-coeff", "0.1", "0.1"])
    assert "--moe-router-load-balancing-type" in capsys.readouterr().err


def test_refusals_accept_the_default_and_megatron_equivalents():
    cfg = cli.parse(["--context-parallel-size", "1", "--tensor-model-parallel-size", "2",
                     "--expert-tensor-parallel-size", "2"])  # ETP = TP is Megatron's default and ours
    assert cfg.parallel.expert_tensor_parallel_size == 2


def test_expert_tensor_parallel_size_reaches_the_layout():
    """MoE parallel folding (ETP != TP) is honoured: the flag is the layout's expert-tensor size."""
    folding = build.layout_of(cli.parse(["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "4",
                                       "--expert-tensor-parallel-size", "1", "--sequence-parallel"]).parallel, 8)
    assert (folding.tensor, folding.expert, folding.etp) == (2, 4, 1)
    assert build.layout_of(cli.parse([]).parallel, 8).etp == 1  # default: = TP


def test_load_balancing_none_drops_the_aux_loss():
    assert cli.parse(["--moe-aux-loss-coeff", "0.01"]).moe.load_balancing().coeff("aux_loss") == 0.01
    none = cli.parse(["--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type", "none"])
    assert none.moe.load_balancing().coeff("aux_loss") == 0.0


def test_pad_expert_input_to_capacity_needs_a_capacity(capsys):
    with pytest.raises(SystemExit):
        cli.parse(["--moe-pad-expert-input-to-capacity"])
    assert "--moe-expert-capacity-factor" in capsys.readouterr().err
    assert cli.parse(["--moe-pad-expert-input-to-capacity", "--moe-expert-capacity-factor", "1.0"]).moe.moe_pad_expert_input_to_capacity


def test_untie_embeddings_gives_a_separate_lm_head():
    tied = cli.parse(["--model-name", "qwen3-0.6b"]).model
    assert families.from_flags(tied, None).tie_word_embeddings
    untied = families.from_flags(cli.parse(["--model-name", "qwen3-0.6b", "--untie-embeddings-and-output-weights"]).model, None)
    assert not untied.tie_word_embeddings
    assert untied.num_params() - families.from_flags(tied, None).num_params() == untied.vocab_size * untied.hidden_size


def test_tokenizer_model_is_the_tokenizer_path():
    assert cli.parse(["--tokenizer-model", "/tok"]).data.tokenizer_path == "/tok"
    assert cli.parse(["--tokenizer-model", "/tok", "--hf-tokenizer-path", "/hf"]).data.tokenizer_path == "/hf"
    flags.require(cli.parse(["--tokenizer-model", "/tok"]), ("--hf-tokenizer-path",))  # satisfied by its alias


def test_missing_required_flags_are_named_in_one_error():
    """Every required flag a run lacks in one error, with the demo to start from instead."""
    with pytest.raises(ConfigError) as e:
        flags.require(cli.parse(["--lora-dim", "8"]))
    assert str(e.value).startswith("missing --model-name --data-path --hf-tokenizer-path --seq-length "
                                   "--micro-batch-size --train-iters --lr (required)")
    assert "--config demo" in str(e.value)
    flags.require(cli.parse(["--config", "demo", "--lora-dim", "8"]))  # the demo has them all
    assert flags.missing_required(cli.parse(["--load", "/ck"]), ("--model-name",)) == []


def _metrics(loss: float) -> dict:
    return {"lm loss": np.float32(loss), "grad-norm": np.float32(1.0), "skipped": np.int32(0),
            "loss-scale": np.float32(1.0), "loss tokens": np.float32(10.0)}


def _logger(tmp_path, **kw):
    from mlir_train.train.metrics import MetricsWriter, StepLogger, Timers

    writer = MetricsWriter(str(tmp_path), wandb_project=kw.pop("wandb_project", ""), wandb_dir=kw.pop("wandb_dir", ""))
    args = dict(train_iters=6, log_interval=1, tensorboard_log_interval=1, check_nan=True, global_batch_size=2,
                seq_length=4, lr_at=lambda i: 1e-3, flops_per_step=1.0, num_devices=1, peak_tflops=None,
                log_timers=False, timers=Timers())
    return writer, StepLogger(writer, **(args | kw))


def test_tensorboard_log_interval_writes_every_n_iterations(tmp_path, capsys):
    writer, logger = _logger(tmp_path, tensorboard_log_interval=4)
    for it in range(1, 7):
        logger.record(it, _metrics(2.0 - it * 0.1))
    writer.close()
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [r["iteration"] for r in lines] == [4, 6]  # every 4th, and the last
    assert sum(l.startswith(" iteration ") for l in capsys.readouterr().out.splitlines()) == 6  # the console still every --log-interval


def test_the_first_logged_loss_is_the_first_console_lines(tmp_path, capsys):
    """--log-interval 5: the run's closing line quotes iteration 5's loss, the first one shown."""
    writer, logger = _logger(tmp_path, log_interval=5)
    for it in range(1, 7):
        logger.record(it, _metrics(2.0 - it * 0.1))
    writer.close()
    assert logger.first_logged == (5, pytest.approx(1.5))
    assert [l.split("|")[0].strip() for l in capsys.readouterr().out.splitlines() if l.startswith(" iteration ")] == [
        "iteration        5/       6", "iteration        6/       6"]


def test_wandb_save_dir_is_wandbs_directory(tmp_path, monkeypatch):
    seen = {}

    class Run:
        def log(self, *a, **k):
            pass

        def finish(self):
            pass

    def init(**kwargs):
        seen.update(kwargs)
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    writer, _ = _logger(tmp_path / "tb", wandb_project="p", wandb_dir=str(tmp_path / "wandb"))
    writer.close()
    assert seen["dir"] == str(tmp_path / "wandb") and seen["project"] == "p"


def test_run_config_is_frozen_and_replace_makes_a_new_one():
    cfg = cli.parse(["--lr", "1e-4"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training.lr = 1.0
    new = cfg.replace(training={"lr": 2e-4})
    assert (cfg.training.lr, new.training.lr) == (1e-4, 2e-4) and new.model == cfg.model


def test_readme_flag_table_is_the_generated_one():
    """README.md's "Every flag" table is ``python -m mlir_train.config.flag_table``'s output
    (``python scripts/update_flag_table.py`` rewrites it when a flag changes)."""
    import os

    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md"), encoding="utf-8").read()
    begin, end = "<!-- flag-table:begin -->\n", "<!-- flag-table:end -->"
    assert begin in readme and end in readme
    table = readme[readme.index(begin) + len(begin):readme.index(end)].strip()
    assert table == flag_table.flag_table_markdown()


def test_num_devices_builds_the_run_on_the_first_n_devices():
    cfg = cli.parse(["--num-devices", "4", "--micro-batch-size", "1", "--seq-length", "16", "--lr", "1e-3",
                     "--train-iters", "1", "--tensor-model-parallel-size", "2"])
    run = build.resolve(cfg, families.from_flags(cfg.model, 256), num_devices=cfg.extras.num_devices)
    assert run.parallel.data_parallel == 2 and run.global_batch_size == 2
    assert run.trainer().mesh.devices.size == 4
    with pytest.raises(ConfigError, match="devices"):
        too_many = cfg.replace(extras={"num_devices": 64})
        build.resolve(too_many, families.from_flags(cfg.model, 256), num_devices=64).trainer()


def test_pipeline_flags_make_the_runs_schedule(capsys):
    """--pipeline-schedule and the uneven-stage flags make the run's one Schedule; the uneven flags
    need PP > 1 (refused naming them), and --pipeline-schedule without PP says it does nothing."""
    from mlir_train.families import get_model_config

    model = get_model_config("qwen3-moe-tiny", num_layers=4)
    cfg = cli.parse(["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe",
                     "--decoder-first-pipeline-num-layers", "1", "--global-batch-size", "4", "--micro-batch-size", "1"])
    schedule = build.resolve(cfg, model, num_devices=2, platform="cpu").schedule
    assert schedule == Schedule(stages=2, kind="gpipe", stage_layers=(1, 3))
    mbs = ["--micro-batch-size", "1"]
    assert build.resolve(cli.parse(["--pipeline-model-parallel-size", "2", *mbs]), model, num_devices=2,
                              platform="cpu").schedule == Schedule(stages=2)  # Megatron's default: 1F1B, even
    with pytest.raises(ConfigError, match="--decoder-first/last-pipeline-num-layers need"):
        build.resolve(cli.parse(["--decoder-last-pipeline-num-layers", "1", *mbs]), model, num_devices=1, platform="cpu")
    with pytest.raises(ConfigError, match="--decoder-first-pipeline-num-layers 5"):
        build.resolve(cli.parse(["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "5", *mbs]),
                           model, num_devices=2, platform="cpu")
    build.resolve(cli.parse(["--pipeline-schedule", "circular", *mbs]), model, num_devices=1, platform="cpu")
    assert "--pipeline-schedule circular has no effect" in capsys.readouterr().out


def test_moe_layer_freq_sets_the_model_layers():
    kinds = families.from_flags(cli.parse(["--num-layers", "4", "--moe-layer-freq", "([0]+[1]*3)"]).model, None).moe_layers()
    assert kinds == (False, True, True, True)
    assert families.from_flags(cli.parse(["--num-layers", "4", "--moe-layer-freq", "2"]).model, None).moe_layers() == (
        True, False, True, False)
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        families.from_flags(cli.parse(["--num-layers", "4", "--moe-layer-freq", "[1,0]"]).model, None)


def test_num_virtual_stages_is_the_other_spelling_of_layers_per_virtual_stage():
    base = ["--micro-batch-size", "1", "--global-batch-size", "8", "--seq-length", "16", "--lr", "1e-3",
            "--train-iters", "1", "--model-name", "qwen3-moe-tiny", "--num-layers", "8",
            "--pipeline-model-parallel-size", "2"]

    def step(*extra):
        cfg = cli.parse(base + list(extra))
        return build.resolve(cfg, families.from_flags(cfg.model, 256), num_devices=8).schedule

    # 8 layers over 2 stages: 2 chunks of 2 layers each, said either way
    assert step("--num-virtual-stages-per-pipeline-rank", "2").virtual == 2
    assert step("--num-virtual-stages-per-pipeline-rank", "2") == step("--num-layers-per-virtual-pipeline-stage", "2")
    assert step("--num-virtual-stages-per-pipeline-rank", "1").virtual == 1
    with pytest.raises(ConfigError, match="mutually exclusive"):
        step("--num-virtual-stages-per-pipeline-rank", "2", "--num-layers-per-virtual-pipeline-stage", "2")
    with pytest.raises(ConfigError, match="--num-virtual-stages-per-pipeline-rank 3"):
        step("--num-virtual-stages-per-pipeline-rank", "3")
