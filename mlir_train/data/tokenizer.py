"""``--tokenizer-type HFTokenizer --hf-tokenizer-path DIR``: a local HF tokenizer, offline."""

from __future__ import annotations

import hashlib
import json
import logging
import os

from mlir_train.data.records import DataError
from mlir_train.runtime.errors import json_object_problem, read_text

TOKENIZER_TYPES = ("HFTokenizer",)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
# The JSON files transformers reads from a tokenizer directory, each an object.
_JSON_FILES = (*_TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "chat_template.json")


class _NoTorchNotice(logging.Filter):
    """transformers' "PyTorch was not found" advice on import: we use its tokenizers only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "PyTorch was not found" not in str(record.msg)


def quiet_transformers_import() -> None:
    """Before the first ``import transformers``: drop its advice that PyTorch is missing (the
    ``transformers`` logger is the one it logs with; a filter added now stays when it configures it)."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _NoTorchNotice) for f in logger.filters):
        logger.addFilter(_NoTorchNotice())


def load_tokenizer(cfg_or_path, tokenizer_type: str = "HFTokenizer"):
    """Load ``transformers.AutoTokenizer`` from a local directory (never the network).

    Accepts a ``DataConfig`` or a directory path. Raises :class:`DataError` for an unknown
    tokenizer type, a missing directory, or one without tokenizer files.
    """
    if isinstance(cfg_or_path, (str, os.PathLike)):
        path = os.fspath(cfg_or_path)
    else:
        path, tokenizer_type = cfg_or_path.tokenizer_path, cfg_or_path.tokenizer_type
    if tokenizer_type not in TOKENIZER_TYPES:
        raise DataError(f"--tokenizer-type {tokenizer_type!r}: expected one of {TOKENIZER_TYPES}")
    if not path or not os.path.isdir(path):
        raise DataError(f"--hf-tokenizer-path {path!r}: no such directory; expected a local HF "
                        f"tokenizer directory (with tokenizer.json / tokenizer_config.json)")
    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        raise DataError(f"--hf-tokenizer-path {path}: no tokenizer files; expected one of "
                        f"{_TOKENIZER_FILES}")
    quiet_transformers_import()
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - whatever transformers raises, the user error is the dir
        _name_the_damaged_file(path)  # transformers' own errors do not say which file
        raise DataError(f"--hf-tokenizer-path {path}: cannot load the tokenizer: {e}") from None
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise DataError(f"--hf-tokenizer-path {path}: expected a fast (tokenizers-backed) "
                        f"tokenizer with a tokenizer.json")
    return tokenizer


def _name_the_damaged_file(path: str) -> None:
    """After transformers failed to load ``path``: a DataError naming the first of its files that
    is damaged (a JSON file that is no JSON object, a text file that is no UTF-8 text), if any."""
    for name in _JSON_FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file) and (why := json_object_problem(file)):
            raise DataError(f"--hf-tokenizer-path {path}: {file}: {why}; the file is damaged (restore it from the "
                            "tokenizer's source)")
    for name in ("chat_template.jinja", "merges.txt"):
        if os.path.isfile(os.path.join(path, name)):
            read_text(os.path.join(path, name), DataError, f"--hf-tokenizer-path {path}: {os.path.join(path, name)}")


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of what changes token ids: the tokenizer pipeline, special tokens, chat template."""
    h = hashlib.sha256()
    h.update(tokenizer.backend_tokenizer.to_str().encode())
    h.update(json.dumps([tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token,
                         tokenizer.chat_template if isinstance(tokenizer.chat_template, str)
                         else None]).encode())
    return h.hexdigest()


def pad_id(tokenizer) -> int:
    """Padding id: the tokenizer's pad token, else eos (its value never reaches the loss)."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0
