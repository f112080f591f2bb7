"""Megatron-LM / AIAK checkpoint files, opened without Megatron: torch pickles and torch DCP regions.

Two on-disk formats, both under ``DIR/latest_checkpointed_iteration.txt`` (an iteration number
or ``release``) and ``DIR/iter_0000500/`` or ``DIR/release/``:

* legacy ``torch`` (``--ckpt-format torch``, AIAK's default): one
  ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per model-parallel rank (``_PPP`` only with
  PP > 1, ``_EEE`` only with EP > 1, as Megatron-LM's ``get_checkpoint_name``), each a pickled
  dict with ``model`` (``model0``, ``model1``... under a virtual pipeline), ``args``,
  ``checkpoint_version``, ``iteration`` and optionally ``optimizer``/``rng_state``;
  :func:`torch_load` opens one, memory-mapped;
* ``torch_dist`` (Megatron-LM's default): ``metadata.json`` (``sharded_backend: torch_dist``),
  ``common.pt`` (args, iteration) and a torch DCP checkpoint (``.metadata`` + ``*.distcp``) of
  *global* tensors; :class:`DistReader` reads any region of one.

Reading never imports Megatron: pickled Megatron classes (``MCoreMetadata``, enums in ``args``)
are replaced by inert stubs. It needs torch (the files are torch pickles); torch is imported
only here, only when a Megatron checkpoint is read or written. Where those files' tensors go
in our model is :mod:`~mlir_train.checkpoint.megatron.load`'s business.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import re
import types
from typing import Any

import numpy as np

from mlir_train.checkpoint.shards import full_index
from mlir_train.runtime.errors import CheckpointError

class MegatronCheckpointError(CheckpointError):
    """A Megatron checkpoint that cannot be read or does not fit this run (names the file)."""


# ----- unpickling without Megatron -------------------------------------------------------------
_STUB_PREFIXES = ("megatron", "transformer_engine", "apex", "nemo", "modelopt", "aiak", "loongforge")


@functools.cache
def _stub_class(module: str, name: str) -> type:
    def __init__(self, *args, **kwargs):
        self._args, self._kwargs = args, kwargs

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self._state = state

    def __repr__(self):
        return f"<{module}.{name} (stub) {getattr(self, '_args', ())!r}>"

    def __call__(self, *a, **k):  # pickled functions (e.g. init methods in args) become stubs too
        return self

    return type(name, (), {"__init__": __init__, "__setstate__": __setstate__, "__repr__": __repr__,
                           "__call__": __call__, "__module__": f"stub:{module}"})


# What a Megatron checkpoint's pickles may name and get for real: containers, argparse's Namespace (args),
# torch's and numpy's tensor / array rebuilders, dtypes and sizes, and torch DCP's metadata classes. Anything
# of Megatron's family becomes an inert stub; anything else under torch (a function in args) too; any other
# global (os.system, builtins.eval, subprocess...) is refused: reading a checkpoint never runs its code.
_SAFE_GLOBALS = {
    "builtins": {"set", "frozenset", "slice", "complex", "bytearray", "range", "object"},
    "collections": {"OrderedDict", "defaultdict", "deque"},
    "argparse": {"Namespace"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # DCP's checkpoint_id
    "datetime": {"datetime", "date", "time", "timedelta", "timezone"},
    "uuid": {"UUID"},
    "_codecs": {"encode"},  # numpy's byte payloads under pickle protocol 2
    "copyreg": {"_reconstructor"},
    "torch": {"Size", "device", "dtype", "layout", "memory_format", "finfo", "iinfo"},
    "torch._utils": {"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
                     "_rebuild_parameter_with_state", "_rebuild_device_tensor_from_numpy", "_rebuild_qtensor"},
    "torch._tensor": {"_rebuild_from_type_v2"},
    "torch.serialization": {"_get_layout"},
    "numpy": {"ndarray", "dtype"},
    "numpy.core.multiarray": {"_reconstruct", "scalar"},
    "numpy._core.multiarray": {"_reconstruct", "scalar"},
    "torch.distributed.checkpoint.metadata": "*",
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
}


def _safe_global(module: str, name: str, found: Any) -> bool:
    allowed = _SAFE_GLOBALS.get(module)
    if allowed == "*" or (allowed and name in allowed):
        return True
    try:  # torch's dtypes (torch.bfloat16), numpy's dtype classes and scalar types: data, not code
        import torch

        if isinstance(found, (torch.dtype, torch.layout, torch.memory_format)) or (
                isinstance(found, type) and issubclass(found, torch.storage._StorageBase | torch.storage.TypedStorage)):
            return True
    except ImportError:
        pass
    return module.split(".")[0] == "numpy" and isinstance(found, type) and (
        issubclass(found, (np.generic, np.dtype)))


class UnsafePickleError(MegatronCheckpointError):
    """A checkpoint's pickle names a global that reading it would run (os.system, eval, ...)."""


class _StubUnpickler(pickle.Unpickler):
    """Megatron (and TE, Apex, ...) classes become stubs, as does anything else under torch that is
    not data (a function stored in args); tensors, arrays and containers unpickle normally
    (:data:`_SAFE_GLOBALS`); any other global is refused (:class:`UnsafePickleError`), so no
    code a checkpoint holds ever runs. ``source`` names the file in the error."""

    source = "the checkpoint"

    def find_class(self, module: str, name: str):
        top = module.split(".")[0]
        if top in _STUB_PREFIXES:
            return _stub_class(module, name)
        if top in ("torch", "numpy", "builtins", "collections", "argparse", "_codecs", "copyreg", "pathlib", "datetime",
                   "uuid"):
            try:
                found = super().find_class(module, name)
            except (ImportError, AttributeError):
                found = None
            if found is not None and _safe_global(module, name, found):
                return found
            if top == "torch":
                return _stub_class(module, name)
        raise UnsafePickleError(
            f"{self.source}: its pickle names {module}.{name}, which reading a Megatron checkpoint never "
            "loads (a checkpoint holds tensors, args and Megatron's own classes; this one would run code). "
            "Refused; if it is a genuine checkpoint, convert it where you trust it, or report the name")


def _unpickler_for(source: str):
    return type("_Unpickler", (_StubUnpickler,), {"source": source})


def import_torch():
    try:
        import torch
    except ImportError:
        raise MegatronCheckpointError(
            "reading or writing Megatron checkpoints needs torch (its files are torch pickles): "
            "pip install torch (the CPU build is enough)") from None
    return torch


def torch_load(path: str, *, mmap: bool = True) -> Any:
    """One torch file of a Megatron checkpoint, through :class:`_StubUnpickler` (never runs its code)."""
    torch = import_torch()
    unpickler = _unpickler_for(path)
    pickle_module = types.SimpleNamespace(Unpickler=unpickler, load=lambda f, **kw: unpickler(f, **kw).load(),
                                          __name__="mlir_train_stub_pickle")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap, pickle_module=pickle_module)
    except UnsafePickleError:
        raise
    except RuntimeError as e:
        if mmap and "mmap" in str(e):  # an old (non-zip) torch.save file cannot be memory-mapped
            return torch_load(path, mmap=False)
        raise MegatronCheckpointError(f"{path}: cannot read it as a torch file ({e})") from e
    except (pickle.UnpicklingError, EOFError, OSError) as e:
        raise MegatronCheckpointError(f"{path}: cannot read it as a torch file ({type(e).__name__}: {e})") from e


# ----- the files ----------------------------------------------------------------------------------
# mp_rank_TT[_PPP][_EEE]: the legacy format's per-rank directories (Megatron-LM's get_checkpoint_name)
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def listing(names: list[str], n: int = 8) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f" ... ({len(names)} entries)" if len(names) > n else "") if names else "nothing"


class DistReader:
    """Region reads from a torch DCP directory on one process, no process group, no Megatron."""

    def __init__(self, directory: str):
        import_torch()
        from torch.distributed.checkpoint import FileSystemReader

        class Reader(FileSystemReader):
            def read_metadata(self, *a, **k):
                with open(os.path.join(directory, ".metadata"), "rb") as f:
                    md = _unpickler_for(os.path.join(directory, ".metadata"))(f).load()
                if getattr(md, "storage_meta", None) is None:
                    from torch.distributed.checkpoint.metadata import StorageMeta

                    md.storage_meta = StorageMeta()
                md.storage_meta.load_id = self.load_id
                return md

        self.directory = directory
        if not os.path.exists(os.path.join(directory, ".metadata")):
            raise MegatronCheckpointError(f"{directory}: no .metadata (torch DCP index) in it")
        self.reader = Reader(directory)
        try:
            self.metadata = self.reader.read_metadata()
        except Exception as e:  # noqa: BLE001 - any unpickling failure: name the file
            if isinstance(e, UnsafePickleError):
                raise
            raise MegatronCheckpointError(f"{directory}/.metadata: cannot read it ({type(e).__name__}: {e})") from e
        self.reader.set_up_storage_reader(self.metadata, True)
        self._check_storage()

    def _check_storage(self) -> None:
        """Every stored item inside its file and starting as ``torch.save`` starts (a zip, or a
        pickle): a cut-short or overwritten data file is named here, before any tensor is read."""
        by_file: dict[str, list] = {}
        for item in self.metadata.storage_data.values():
            by_file.setdefault(os.path.join(self.directory, item.relative_path), []).append(item)
        for path, items in sorted(by_file.items()):
            if not os.path.isfile(path):
                raise MegatronCheckpointError(f"{path}: missing (.metadata lists it)")
            size, end = os.path.getsize(path), max(it.offset + it.length for it in items)
            if end > size:
                raise MegatronCheckpointError(f"{path}: {size} bytes, but .metadata has data up to byte {end}; "
                                              "the file is truncated")
            with open(path, "rb") as f:
                for item in sorted(items, key=lambda it: it.offset):
                    f.seek(item.offset)
                    head = f.read(2)
                    if head != b"PK" and head[:1] != b"\x80":
                        raise MegatronCheckpointError(f"{path}: the item at byte {item.offset} is no torch-saved "
                                                      "data (its first bytes are overwritten); the file is damaged")

    def keys(self) -> list[str]:
        return list(self.metadata.state_dict_metadata)

    def shape(self, key: str) -> tuple[int, ...] | None:
        md = self.metadata.state_dict_metadata.get(key)
        return tuple(md.size) if md is not None and hasattr(md, "size") else None

    def read(self, key: str, index: tuple[slice, ...]) -> np.ndarray:
        torch = import_torch()
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        md = self.metadata.state_dict_metadata[key]
        shape = tuple(md.size)
        index = full_index(index, len(shape))
        starts = [s.indices(n)[0] for s, n in zip(index, shape)]
        sizes = [len(range(*s.indices(n))) for s, n in zip(index, shape)]
        dest = torch.empty(sizes, dtype=md.properties.dtype)
        items = create_read_items_for_chunk_list(
            key, md, [ChunkStorageMetadata(offsets=torch.Size(starts), sizes=torch.Size(sizes))])
        covered = sum(int(np.prod(it.lengths)) for it in items)
        if covered != dest.numel():
            raise MegatronCheckpointError(f"{self.directory}: {key}{list(zip(starts, sizes))} is not fully stored "
                                          f"({covered} of {dest.numel()} values); truncated checkpoint?")

        class Planner(DefaultLoadPlanner):
            def resolve_tensor(self, item):
                return dest[tuple(slice(o, o + n) for o, n in zip(item.dest_offsets, item.lengths))]

            def commit_tensor(self, item, tensor):
                pass

        planner = Planner()
        planner.set_up_planner({}, self.metadata, True)
        plan = self.reader.prepare_local_plan(LoadPlan(items))
        try:
            self.reader.read_data(plan, planner).wait()
        except Exception as e:  # noqa: BLE001 - torch's errors on a damaged data file: name the file
            if isinstance(e, UnsafePickleError):
                raise
            files = sorted({os.path.join(self.directory, self.metadata.storage_data[it.storage_index].relative_path)
                            for it in plan.items if it.storage_index in self.metadata.storage_data})
            raise MegatronCheckpointError(f"{', '.join(files) or self.directory}: cannot read {key} "
                                          f"({type(e).__name__}: {str(e)[:100]}); the file is truncated or "
                                          "damaged") from None
        out = dest.numpy() if dest.dtype in (torch.float32, torch.float64) else dest.float().numpy()
        return out


# ----- one iteration of a checkpoint directory ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MegatronCheckpoint:
    """One iteration of a Megatron checkpoint directory."""

    root: str                 # the --load directory
    directory: str            # iter_XXXXXXX/ or release/
    format: str               # "torch" | "torch_dist"
    iteration: int            # 0 for release
    release: bool
    args: dict[str, Any]      # Megatron's argparse namespace, as a dict (may be empty)
    checkpoint_version: float | None
    has_optimizer: bool
    has_rng: bool

    def describe(self) -> str:
        it = "release" if self.release else f"iteration {self.iteration}"
        return f"Megatron {self.format} checkpoint {self.directory} ({it})"
