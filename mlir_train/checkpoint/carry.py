"""What an HF directory holds besides the model's weights, carried through untouched.

A release can hold tensors our model does not use: an MTP head, a vision tower, anything else
(exports that lost them are a common complaint: ms-swift #9802, a Qwen3.6 LoRA export without its
MTP weights). Loading reads past them; an HF export of a model that came from such a directory
(``--save-hf`` after full fine-tuning or LoRA, ``convert``) copies each of them byte for byte, and
keeps the source's ``config.json`` fields, ``generation_config.json`` and tokenizer files.

Which tensors are carried: those no parameter reads. A family declares the ones its releases
hold (:attr:`~mlir_train.families.table.Table.carried`, e.g. ``mtp.*``): logged with their count.
Unknown ones are carried too, with a warning that counts and names them. A tensor spelled as one
of the family's own (:meth:`~mlir_train.families.table.Table.spells`) that no parameter reads (a
layer or expert the config does not have) still fails the completeness check: the config and the
weights disagree, and copying it would hide that.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Mapping

from mlir_train.checkpoint import complete
from mlir_train.families.table import Table
from mlir_train.runtime import log

# Files of an HF directory that hold weights or their index (never copied beside an export's own).
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth", ".ckpt",
                   ".gguf", ".h5", ".msgpack")


def unused(where: str, table: Table, unread: Mapping[str, str]) -> dict[str, str | None]:
    """The tensors of an HF directory no parameter reads (``unread``: name -> its shape, said in
    an error), as carried: name -> the table's pattern it matches (None: unknown). One spelled as
    the family's own is an error naming it (the completeness check)."""
    declared = {n: table.carried_pattern(n) for n in unread}
    complete.check(where, unread={n: s for n, s in unread.items() if declared[n] is None and table.spells(n)},
                   hint="; is it a checkpoint of this model (its config.json)?")
    return declared


def say(where: str, table: Table, carried: Mapping[str, str | None], what: str) -> None:
    """The log of ``carried`` tensors (``what``: what happens to them): declared ones counted by
    pattern, unknown ones warned about with their count and first names."""
    declared = Counter(p for p in carried.values() if p is not None)
    unknown = sorted(n for n, p in carried.items() if p is None)
    if declared:
        log.info(f"{where}: {sum(declared.values())} tensors the model does not use ("
                 f"{', '.join(f'{p}: {declared[p]}' for p in table.carried if p in declared)}) {what}")
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        log.warning(f"{where}: {len(unknown)} tensors of no parameter of the {table.family} model ("
                    f"{', '.join(unknown[:3])}{more}) {what}; if they are weights the model should use, its "
                    "config.json does not describe them")


def config_fields(source: str, ours: dict) -> dict:
    """``ours`` (the export's config.json) over the fields of the source's, which it keeps."""
    try:
        with open(os.path.join(source, "config.json")) as f:
            theirs = json.load(f)
    except (OSError, json.JSONDecodeError):
        return ours
    if "dtype" in ours:
        theirs.pop("torch_dtype", None)  # transformers 4's name of the field ours writes as dtype
    return theirs | ours


def side_files(source: str, dst: str) -> list[str]:
    """Copy the source directory's files that are neither weights nor ``config.json`` (generation
    config, tokenizer, chat template, model card) into ``dst``; returns their names."""
    copied = []
    for name in sorted(os.listdir(source)):
        full = os.path.join(source, name)
        if (name.startswith(".") or name == "config.json" or name.endswith(WEIGHT_SUFFIXES)
                or not os.path.isfile(full) or os.path.exists(os.path.join(dst, name))):
            continue
        shutil.copyfile(full, os.path.join(dst, name))
        copied.append(name)
    return copied
