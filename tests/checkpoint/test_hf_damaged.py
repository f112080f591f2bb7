"""A damaged HF model directory is one error line naming the file (issue 48): a .safetensors file
cut short (a download stopped, a disk filled) ends in a CheckpointError naming it, at open or at
the read of a tensor, never safetensors' own traceback. No torch needed."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from mlir_train.checkpoint.hf_files import Files
from mlir_train.runtime.errors import CheckpointError

QWEN3_MOE_TINY = {"model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
                  "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True}


def _hf_dir(tmp_path, keep: float):
    """A directory of one safetensors file, kept to ``keep`` of its bytes."""
    path = tmp_path / f"hf{keep}"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(QWEN3_MOE_TINY))
    file = path / "model.safetensors"
    save_file({"model.embed_tokens.weight": np.ones((512, 64), np.float32),
               "model.norm.weight": np.ones((64,), np.float32)}, str(file))
    data = file.read_bytes()
    file.write_bytes(data[:int(len(data) * keep)])
    return str(path), str(file)


@pytest.mark.parametrize("keep", [0.001, 0.5, 0.99])  # inside the header, inside the data, the last bytes
def test_truncated_safetensors_is_one_error_naming_the_file(tmp_path, keep):
    path, file = _hf_dir(tmp_path, keep)
    with pytest.raises(CheckpointError, match=rf"^{file}: cannot read .* the file is truncated or damaged"):
        files = Files(path)
        for name in files.names():
            files.read(name)


def test_convert_of_a_truncated_hf_directory_says_it_in_one_line(tmp_path, capsys):
    from mlir_train import convert

    path, file = _hf_dir(tmp_path, 0.5)
    assert convert.main([path, str(tmp_path / "out"), "--to", "mlir-train"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and file in err[0] and "truncated or damaged" in err[0], err
    assert not os.path.exists(tmp_path / "out")
