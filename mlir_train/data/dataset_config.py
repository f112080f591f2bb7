"""``--sft-dataset-config``: which format and column names each data file is read with.

``{name: {format|formatting, columns: {...}, tags: {...}}}`` in JSON or YAML (AIAK/LoongForge's
``sft_dataset_config``; LLaMA-Factory's ``dataset_info.json`` entries read the same). A data file
uses the entry named by its path, file name or file stem, or the one ``--sft-dataset`` names.

What an entry says and this run cannot honour is an error when the entry is used, naming the
key: column or tag names of other modalities (a shared config may describe datasets this run
does not read), and keys such as LLaMA-Factory's ``ranking`` / ``subset`` / ``hf_hub_url``.
LLaMA-Factory's ``file_name`` is read as a check: the files are ``--data-path``'s, so it must
name the same file.
"""

from __future__ import annotations

import dataclasses
import os

from mlir_train.data.records import FORMATS, DataError, DatasetFormat
from mlir_train.runtime.errors import read_text

ENTRY_KEYS = ("format", "formatting", "columns", "tags", "file_name")
_NOT_COLUMNS = {"formatting", "name", "unsupported", "unread_keys", "file_name"}  # DatasetFormat's own fields


def _column_names() -> set[str]:
    return {f.name for f in dataclasses.fields(DatasetFormat)} - _NOT_COLUMNS


def _read(path: str):
    import json

    text = read_text(path, DataError, f"--sft-dataset-config {path}")
    if not text.strip():
        raise DataError(f"--sft-dataset-config {path}: the file is empty; expected a mapping of dataset name to "
                        "its columns")
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml
            return yaml.safe_load(text) or {}
        return json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parser error is the same user error
        raise DataError(f"{path}: cannot parse the dataset config: {e}") from None


def load_dataset_config(path: str | None) -> dict[str, DatasetFormat]:
    """``--sft-dataset-config`` as one :class:`DatasetFormat` per entry (module docstring)."""
    if path is None:
        return {}
    if not os.path.isfile(path):
        raise DataError(f"--sft-dataset-config: {path}: no such file")
    raw = _read(path)
    if not isinstance(raw, dict):
        raise DataError(f"{path}: expected a mapping of dataset name -> description")
    formats = {}
    for name, desc in raw.items():
        if not isinstance(desc, dict):
            raise DataError(f"{path}: dataset {name!r}: expected a mapping with 'format', "
                            f"'columns', 'tags'")
        formatting = desc.get("format") or desc.get("formatting") or "alpaca"
        if formatting not in FORMATS:
            raise DataError(f"{path}: dataset {name!r}: unknown format {formatting!r}; expected "
                            f"one of {FORMATS}")
        names = {**(desc.get("columns") or {}), **(desc.get("tags") or {})}
        # Names we do not know (LoongForge's multimodal 'images', 'videos', ...) make the entry
        # unusable, not the file: a shared config may describe datasets this run does not read.
        unknown = tuple(sorted(set(names) - _column_names()))
        formats[name] = DatasetFormat(
            formatting=formatting, name=str(name), unsupported=unknown,
            unread_keys=tuple(sorted(k for k in map(str, desc) if k not in ENTRY_KEYS)),
            file_name=desc.get("file_name"),
            **{k: v for k, v in names.items() if v is not None and k in _column_names()})
    return formats


def format_for(path: str, formats: dict[str, DatasetFormat], config_path: str | None
               ) -> DatasetFormat:
    if not formats:
        return DatasetFormat()
    base = os.path.basename(path)
    for key in (path, base, os.path.splitext(base)[0]):
        if key in formats:
            return usable(formats[key], config_path, path)
    raise DataError(f"{config_path}: no entry for data file {path}: expected a dataset named "
                    f"{os.path.splitext(base)[0]!r} (have {sorted(formats)})")


def usable(fmt: DatasetFormat, config_path: str | None, data_path: str) -> DatasetFormat:
    """``fmt`` for ``data_path``, unless its config entry says something we cannot honour."""
    where = f"{config_path}: dataset {fmt.name!r}"
    if fmt.unsupported:
        raise DataError(f"{where}: unknown column/tag names {list(fmt.unsupported)} (text-only SFT); expected "
                        f"some of {sorted(_column_names())}")
    if fmt.unread_keys:
        raise DataError(f"{where}: keys {list(fmt.unread_keys)} are not read here (an entry holds "
                        f"{', '.join(ENTRY_KEYS[:-1])}; the files are --data-path's): drop them")
    if fmt.file_name is not None and os.path.basename(str(fmt.file_name)) != os.path.basename(data_path):
        exists = "" if os.path.exists(os.path.join(os.path.dirname(config_path or ""), str(fmt.file_name))) \
            else ", which does not exist beside it"
        raise DataError(f"{where}: file_name {fmt.file_name!r}{exists} is not the --data-path file {data_path} it "
                        "describes: the data files are --data-path's; give that file there, or drop file_name")
    return fmt
