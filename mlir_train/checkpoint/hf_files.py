"""HF directories' files: memory-mapped safetensors reads (one file or sharded with
``model.safetensors.index.json``) and sharded writes with their index, as
``transformers``' ``save_pretrained`` lays them out. What the tensors mean is the family's
parameter table's business (:mod:`mlir_train.checkpoint.hf`)."""

from __future__ import annotations

import functools
import json
import os
import struct
from typing import NamedTuple

import jax
import numpy as np

from mlir_train.checkpoint import complete
from mlir_train.runtime.errors import CheckpointError, read_json_object


class Files:
    """Lazy, memory-mapped access to the tensors of an HF checkpoint directory."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            weight_map = read_json_object(index, CheckpointError, "a safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise CheckpointError(f"{index}: not a safetensors index (no weight_map of tensor names to file "
                                      "names); the file is damaged")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"{path}: no *.safetensors files and no model.safetensors.index.json")
            weight_map = None
        self.handles = {}
        self.where: dict[str, str] = {}
        for file in files:
            full = os.path.join(path, file)
            if not os.path.exists(full):
                raise CheckpointError(f"{index}: lists {file}, which does not exist in {path}")
            handle = _open(safe_open, full)
            self.handles[file] = handle
            for name in handle.keys():
                self.where[name] = file
        if weight_map is not None:
            missing = [n for n, f in weight_map.items() if n not in self.where]
            if missing:
                raise CheckpointError(f"{index}: tensor {missing[0]} is listed but not found in {weight_map[missing[0]]}")

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return list(self.where)

    def check(self, name: str, want: tuple[int, ...]) -> None:
        """``name`` is there with shape ``want``, or an error naming it."""
        if name not in self:
            complete.check(self.path, missing={name: f"(expected shape {tuple(want)})"})
        got = self.shape(name)
        if got != tuple(want):
            raise CheckpointError(f"{self.location(name)}: tensor {name} has shape {got}, expected {tuple(want)}")

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[self.where[name]].get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...] | int | None = None) -> np.ndarray:
        handle = self.handles[self.where[name]]
        try:
            if index is None:
                return handle.get_tensor(name)
            return handle.get_slice(name)[index]
        except Exception as e:  # noqa: BLE001 - safetensors' errors: a damaged file, named in one line
            raise _damaged(self.location(name), e, f"tensor {name}") from None

    def location(self, name: str) -> str:
        return os.path.join(self.path, self.where[name])

    def raw(self, name: str) -> "Raw":
        """The tensor as its file stores it: dtype, shape and bytes, untouched (any dtype)."""
        header, start = _header(self.location(name))
        info = header[name]
        begin, end = info["data_offsets"]
        with open(self.location(name), "rb") as f:
            f.seek(start + begin)
            return Raw(info["dtype"], tuple(info["shape"]), f.read(end - begin))


def _damaged(file: str, e: Exception, what: str = "its header") -> CheckpointError:
    return CheckpointError(f"{file}: cannot read {what} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}): "
                           "the file is truncated or damaged; copy or download it again")


def _open(safe_open, file: str):
    """``safe_open`` of one safetensors file, or one error naming it (a truncated or damaged file:
    safetensors raises its own SafetensorError, a traceback otherwise)."""
    try:
        return safe_open(file, framework="np")
    except Exception as e:  # noqa: BLE001 - safetensors' errors are not one class across versions
        raise _damaged(file, e) from None


class Raw(NamedTuple):
    """A safetensors tensor as stored: its dtype's name (``BF16``, ``F8_E4M3``...), shape and bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


def _header(file: str) -> tuple[dict, int]:
    """A safetensors file's header and where its data starts."""
    stat = os.stat(file)
    return _read_header(file, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _read_header(file: str, mtime_ns: int, size: int) -> tuple[dict, int]:
    with open(file, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(size)), 8 + size


def write_raw(file: str, tensors: dict[str, Raw], metadata: dict[str, str]) -> None:
    """A safetensors file of ``tensors`` as stored (the format: an 8-byte little-endian header
    length, the JSON header padded to 8 bytes, then the data in header order)."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(t.data)]}
        offset += len(t.data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for t in tensors.values():
            f.write(t.data)


def to_numpy(x: jax.Array) -> np.ndarray:
    """Gather one parameter to host (one tensor at a time, never the whole model)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def usual_mode(path: str) -> None:
    """Give a written file the mode ``open()`` would (0644 under umask 022): safetensors writes
    0600, which other users of a shared model directory could not read."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


class ShardWriter:
    def __init__(self, path: str, max_bytes: int, save_file, enabled: bool):
        self.path, self.max_bytes, self.save_file, self.enabled = path, max_bytes, save_file, enabled
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes = 0
        self.raw: dict[str, Raw] = {}  # tensors copied as stored, in files of their own
        self.raw_bytes = 0
        self.files: list[dict[str, np.ndarray]] = []
        self.weight_map: dict[str, int] = {}
        self.written: list[str] = []
        if enabled:
            os.makedirs(path, exist_ok=True)

    def add(self, name: str, arr: np.ndarray) -> None:
        if not self.enabled:
            return
        if self.pending and self.pending_bytes + arr.nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = np.ascontiguousarray(arr)
        self.pending_bytes += arr.nbytes

    def add_raw(self, name: str, tensor: Raw) -> None:
        """A tensor written exactly as ``tensor`` stores it (a carried one: byte-identical)."""
        if not self.enabled:
            return
        if self.raw and self.raw_bytes + len(tensor.data) > self.max_bytes:
            self._flush_raw()
        self.raw[name] = tensor
        self.raw_bytes += len(tensor.data)

    def _flush_raw(self) -> None:
        name = f"model-{len(self.written) + 1:05d}.safetensors"
        write_raw(os.path.join(self.path, name), self.raw, {"format": "pt"})
        for k in self.raw:
            self.weight_map[k] = len(self.written)
        self.written.append(name)
        self.raw, self.raw_bytes = {}, 0

    def _flush(self) -> None:
        name = f"model-{len(self.written) + 1:05d}.safetensors"
        self.save_file(self.pending, os.path.join(self.path, name), metadata={"format": "pt"})
        usual_mode(os.path.join(self.path, name))
        for k in self.pending:
            self.weight_map[k] = len(self.written)
        self.written.append(name)
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if not self.enabled:
            return
        if self.pending or not self.written:
            self._flush()
        if self.raw:
            self._flush_raw()
        if len(self.written) == 1:
            os.replace(os.path.join(self.path, self.written[0]), os.path.join(self.path, "model.safetensors"))
            return
        total = len(self.written)
        final = [f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i in range(total)]
        for old, new in zip(self.written, final):
            os.replace(os.path.join(self.path, old), os.path.join(self.path, new))
        index = {"metadata": {}, "weight_map": {k: final[i] for k, i in sorted(self.weight_map.items())}}
        with open(os.path.join(self.path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
