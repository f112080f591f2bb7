"""Preprocessing: read -> render -> tokenise (N processes: :mod:`mlir_train.data.encode`) -> split
-> blend -> pack -> cache.

The cache is a directory of ``.npy`` arrays (memory-mapped on load) named by a hash of
everything that changes its contents: data file bytes, resolved dataset formats, the tokenizer
(its serialised pipeline, special tokens and chat template), the template, ``seq_length``,
packing, truncation, prompt-loss, split, seed and blend weights. The worker count is not part
of the key: every worker count gives the same arrays. A build writes into a temporary sibling
directory and renames it into place as its last step, so a killed build leaves nothing that
loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time

import numpy as np

from mlir_train.data.config import DataConfig
from mlir_train.data.dataset import SPLITS, DataStats, SFTDataset, SFTDatasets
from mlir_train.data.encode import MASKING_COUNTS, MAX_BAD_EXAMPLES, TokenizeJob, add_count, merge_too_long, tokenize_all
from mlir_train.data.packing import one_per_row, pack_best_fit
from mlir_train.data.dataset_config import format_for, load_dataset_config, usable
from mlir_train.data.records import (DataError, DatasetFormat, parse_data_path, parse_split, read_raw_records,
                                     resolve_format)
from mlir_train.data.templates import TemplateSpec, make_spec, parse_template_kwargs
from mlir_train.data.tokenizer import load_tokenizer, pad_id, tokenizer_fingerprint

CACHE_VERSION = 3  # 2: masking and per-role loss counts in the stats; 3: the too-long records


def cache_key(cfg: DataConfig, sources, formats: list[DatasetFormat], spec: TemplateSpec,
              tokenizer) -> str:
    h = hashlib.sha256()

    def add(value) -> None:
        h.update(json.dumps(value, sort_keys=True, default=str).encode())

    add(["mlir_train.sft_data", CACHE_VERSION])
    for source, fmt in zip(sources, formats):
        with open(source.path, "rb") as f:
            add([hashlib.file_digest(f, "sha256").hexdigest(), source.weight,
                 dataclasses.asdict(fmt)])
    add({k: v for k, v in dataclasses.asdict(spec).items() if k != "origin"})
    add(tokenizer_fingerprint(tokenizer))
    add([cfg.seq_length, cfg.packing, cfg.drop_long, cfg.train_on_prompt, cfg.skip_bad_records,
         parse_split(cfg.split), cfg.seed, cfg.eod_mask_loss, cfg.mix_strategy,
         cfg.packing_buffer_size if cfg.packing else None])
    return h.hexdigest()[:24]


MIX_STRATEGIES = ("concat", "interleave_under", "interleave_over")


def dataset_formats(cfg: DataConfig, sources, named_formats) -> list[DatasetFormat]:
    """Each file's format: the ``--sft-dataset`` entry given for it (one name for every file, or
    one per file), else the ``--sft-dataset-config`` entry named after the file."""
    names = cfg.dataset_names
    if not names:
        return [format_for(source.path, named_formats, cfg.dataset_config) for source in sources]
    if cfg.dataset_config is None:
        raise DataError(f"--sft-dataset {' '.join(names)}: names entries of --sft-dataset-config, "
                        f"which is not given")
    if len(names) not in (1, len(sources)):
        raise DataError(f"--sft-dataset {' '.join(names)}: {len(names)} names for "
                        f"{len(sources)} --data-path files; give one name, or one per file")
    unknown = [n for n in names if n not in named_formats]
    if unknown:
        raise DataError(f"--sft-dataset {' '.join(unknown)}: not in {cfg.dataset_config} "
                        f"(it has {sorted(named_formats)})")
    return [usable(named_formats[names[0] if len(names) == 1 else names[i]], cfg.dataset_config, source.path)
            for i, source in enumerate(sources)]


def _split_bounds(n: int, fractions) -> list[tuple[int, int]]:
    cumulative = np.concatenate([[0.0], np.cumsum(fractions)])
    edges = np.round(cumulative * n).astype(np.int64)
    edges[-1] = n
    return [(int(edges[i]), int(edges[i + 1])) for i in range(3)]


def _blend(doc_lists: list[np.ndarray], weights: list[float | None], rng,
           strategy: str = "concat") -> list[np.ndarray]:
    """Megatron-style weighted blend: source i gets weight_i / sum of the split's documents.

    Sources are repeated whole and then sampled without replacement to reach their share.
    Without weights, ``strategy`` (``--sft-data-mix-strategy``, as LoongForge's interleaving
    decides how many samples each dataset gives): ``concat`` every source contributes all of its
    documents once; ``interleave_under`` each as many as the smallest source has (the rest are
    left out, counted in the summary's per-source blend); ``interleave_over`` each as many as
    the largest has (smaller ones repeated).
    """
    if weights[0] is None:
        if strategy == "concat" or not doc_lists:
            return doc_lists
        sizes = [len(d) for d in doc_lists]
        target = min(sizes) if strategy == "interleave_under" else max(sizes)
        targets = np.full(len(doc_lists), target, np.int64)
    else:
        total = sum(len(d) for d in doc_lists)
        shares = total * np.asarray(weights, np.float64) / sum(weights)
        targets = np.floor(shares).astype(np.int64)
        # Largest remainder, so the blended split keeps exactly the split's document count.
        for i in np.argsort(-(shares - targets), kind="stable")[:total - int(targets.sum())]:
            targets[i] += 1
    blended = []
    for docs, target in zip(doc_lists, targets.tolist()):
        if not len(docs) or not target:
            blended.append(np.zeros(0, np.int64))
            continue
        if target <= len(docs) and weights[0] is None:  # interleave_under: the first documents
            blended.append(docs[:target])
            continue
        repeats, rest = divmod(target, len(docs))
        extra = np.sort(rng.choice(len(docs), rest, replace=False))
        blended.append(np.concatenate([np.tile(docs, repeats), docs[extra]]))
    return blended


@dataclasses.dataclass
class _Documents:
    """Every source's kept documents, tokenised and back to back, and what reading them counted."""
    tokens: np.ndarray  # int32
    loss: np.ndarray  # uint8
    lengths: np.ndarray  # int64 tokens per document
    per_source_docs: list[np.ndarray]  # global doc ids per source
    source_info: list[dict]
    records_read: int
    truncated: int
    truncated_tokens: int
    dropped: dict[str, int]
    bad_examples: list[str]
    masking: dict[str, int]  # what masking did (MASKING_COUNTS)
    role_loss: dict[str, int]  # role -> loss positions of the kept documents
    too_long: dict[str, dict]  # documents over a row: the first few records, the --seq-length keeping them


def _masking_flags(cfg: DataConfig) -> str:
    flags = [name for name, on in (("--history-mask-loss", cfg.history_mask),
                                   ("--eod-mask-loss", cfg.eod_mask_loss)) if on]
    if cfg.reasoning_loss != "nonempty":
        flags.append(f"--reasoning-loss {cfg.reasoning_loss}")
    return f" under {' '.join(flags)}" if flags else ""


def _tokenize_sources(cfg: DataConfig, tokenizer, sources, formats, spec) -> _Documents:
    """Read, render and tokenise every source in order (its format resolved from its first record)."""
    tokenizer_json = tokenizer.backend_tokenizer.to_str()
    token_parts, loss_parts, length_parts = [], [], []
    records_read = truncated = truncated_tokens = 0
    dropped: dict[str, int] = {}
    bad_examples: list[str] = []
    per_source_docs: list[np.ndarray] = []  # global doc ids per source
    source_info = []
    masking = dict.fromkeys(MASKING_COUNTS[:-1] if not cfg.eod_mask_loss else MASKING_COUNTS, 0)
    role_loss: dict[str, int] = {}
    too_long: dict[str, dict] = {}
    next_doc = 0
    eod_ids = tuple(sorted({i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id)
                            if i is not None})) if cfg.eod_mask_loss else ()
    for source, fmt in zip(sources, formats):
        bad: dict[str, int] = {}
        records = read_raw_records(source.path, cfg.skip_bad_records, bad)
        records_read += len(records) + sum(bad.values())
        first = next((r for r in records if isinstance(r.value, dict)), None)
        fmt = resolve_format(fmt, first.value if first else {},
                             first.where if first else source.path)
        job = TokenizeJob(tokenizer_json, spec, fmt, cfg.seq_length, cfg.train_on_prompt,
                          cfg.drop_long, cfg.skip_bad_records, eod_ids)
        chunks = tokenize_all(job, records, cfg.num_workers)
        for reason, count in bad.items():
            dropped[reason] = dropped.get(reason, 0) + count
        for chunk in chunks:
            token_parts.append(chunk.tokens)
            loss_parts.append(chunk.loss)
            length_parts.append(chunk.lengths)
            truncated += chunk.truncated
            truncated_tokens += chunk.truncated_tokens
            for reason, count in chunk.dropped.items():
                dropped[reason] = dropped.get(reason, 0) + count
            bad_examples.extend(chunk.bad_examples[:MAX_BAD_EXAMPLES - len(bad_examples)])
            for key, count in chunk.masking.items():
                add_count(masking, key, count)
            for key, count in chunk.role_loss.items():
                add_count(role_loss, key, count)
            merge_too_long(too_long, chunk.too_long)
        kept = sum(len(c.lengths) for c in chunks)
        no_loss = sum(c.dropped.get("no loss tokens", 0) for c in chunks)
        if records and not kept and no_loss:
            raise DataError(
                f"{source.path}: masking leaves no loss tokens in any of its records ({no_loss} "
                f"with none{_masking_flags(cfg)}); check the roles the file's format names "
                f"(--sft-dataset-config) and the masking flags")
        per_source_docs.append(np.arange(next_doc, next_doc + kept, dtype=np.int64))
        source_info.append(dict(path=source.path, weight=source.weight,
                                records=len(records) + sum(bad.values()), kept=kept))
        next_doc += kept
    return _Documents(
        tokens=np.concatenate(token_parts) if token_parts else np.zeros(0, np.int32),
        loss=np.concatenate(loss_parts) if loss_parts else np.zeros(0, np.uint8),
        lengths=np.concatenate(length_parts) if length_parts else np.zeros(0, np.int64),
        per_source_docs=per_source_docs, source_info=source_info, records_read=records_read, truncated=truncated,
        truncated_tokens=truncated_tokens, dropped=dropped, bad_examples=bad_examples,
        masking=masking, role_loss=role_loss, too_long=too_long)


def _pack(positions: np.ndarray, split_ids: np.ndarray, cfg: DataConfig):
    """Best-fit packing of the split's documents, all at once or (``--packing-buffer-size N``)
    N documents at a time in split order, as LoongForge packs each buffer of N samples."""
    size = cfg.packing_buffer_size or max(len(split_ids), 1)
    offsets, docs = [np.zeros(1, np.int64)], []
    for start in range(0, len(split_ids), size):
        ids = split_ids[start:start + size]
        row_offsets, local = pack_best_fit(positions[ids], cfg.seq_length)
        offsets.append(row_offsets[1:] + sum(len(d) for d in docs))
        docs.append(ids[local])
    return (np.concatenate(offsets),
            np.concatenate(docs) if docs else np.zeros(0, np.int64))


def _split_blend_pack(cfg: DataConfig, fractions, sources, docs: _Documents, doc_offsets, positions):
    """Each split's rows (``<split>_row_offsets`` / ``<split>_row_docs`` arrays) and its row,
    token and loss-token counts; records each source's blended share in ``docs.source_info``.

    Each source is split (shuffled by seed) before blending, so upsampling never copies a
    document into two splits."""
    # Loss positions per document: its flags after the first token (the shift drops it).
    doc_loss = (np.add.reduceat(docs.loss.astype(np.int64), doc_offsets[:-1])
                - docs.loss[doc_offsets[:-1]].astype(np.int64))
    split_docs = [[], [], []]
    for i, source_docs in enumerate(docs.per_source_docs):
        source_docs = source_docs[np.random.default_rng([cfg.seed, i]).permutation(len(source_docs))]
        for s, (start, end) in enumerate(_split_bounds(len(source_docs), fractions)):
            split_docs[s].append(source_docs[start:end])
    arrays, rows, split_tokens, split_loss = {}, {}, {}, {}
    for s, split in enumerate(SPLITS):
        rng = np.random.default_rng([cfg.seed, 1000 + s])
        blended = _blend(split_docs[s], [src.weight for src in sources], rng, cfg.mix_strategy)
        for info, blended_docs in zip(docs.source_info, blended):
            info.setdefault("blended", []).append(len(blended_docs))
        split_ids = np.concatenate(blended) if blended else np.zeros(0, np.int64)
        if cfg.packing:
            row_offsets, row_docs = _pack(positions, split_ids, cfg)
        else:
            row_offsets, row_docs = one_per_row(len(split_ids))
            row_docs = split_ids[row_docs]
        arrays[f"{split}_row_offsets"] = row_offsets
        arrays[f"{split}_row_docs"] = row_docs
        rows[split] = len(row_offsets) - 1
        split_tokens[split] = int(positions[row_docs].sum())
        split_loss[split] = int(doc_loss[row_docs].sum())
    return arrays, rows, split_tokens, split_loss


def _build(cfg: DataConfig, tokenizer, sources, formats, spec, out_dir: str) -> DataStats:
    """Tokenise, split, blend and pack the sources into ``out_dir``'s arrays and ``meta.json``."""
    fractions = parse_split(cfg.split)  # a bad --split fails before any tokenising
    docs = _tokenize_sources(cfg, tokenizer, sources, formats, spec)
    lengths = docs.lengths
    if not len(lengths):
        longest = max((e["seq_length"] for e in docs.too_long.values()), default=0)
        raise DataError(f"--data-path {' '.join(s.path for s in sources)}: no usable records "
                        f"(dropped: {docs.dropped or 'none'})"
                        + (f"; --seq-length {longest} keeps them" if longest > cfg.seq_length else ""))
    doc_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    positions = lengths - 1  # positions a document takes in a row
    row_arrays, rows, split_tokens, split_loss = _split_blend_pack(cfg, fractions, sources, docs, doc_offsets, positions)
    arrays = {"tokens": docs.tokens, "loss": docs.loss, "doc_offsets": doc_offsets, **row_arrays}
    stats = DataStats(
        records_read=docs.records_read, records_kept=int(len(lengths)), truncated=docs.truncated,
        truncated_tokens=docs.truncated_tokens, document_tokens=int(positions.sum()), dropped=docs.dropped,
        rows=rows, tokens=split_tokens, loss_tokens=split_loss, seq_length=cfg.seq_length,
        packing=cfg.packing, sources=tuple(docs.source_info),
        bad_record_examples=tuple(docs.bad_examples), masking=docs.masking,
        loss_tokens_by_role=docs.role_loss, too_long=docs.too_long)
    for name, array in arrays.items():
        np.save(os.path.join(out_dir, f"{name}.npy"), array)
    meta = dict(version=CACHE_VERSION, pad_id=pad_id(tokenizer), stats=stats.as_dict(),
                config=dataclasses.asdict(cfg), created=time.time())
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return stats


def _load(cache_dir: str, from_cache: bool) -> SFTDatasets:
    with open(os.path.join(cache_dir, "meta.json")) as f:
        meta = json.load(f)
    if meta.get("version") != CACHE_VERSION:
        raise DataError(f"{cache_dir}: cache version {meta.get('version')}, expected "
                        f"{CACHE_VERSION}")

    def array(name):
        return np.load(os.path.join(cache_dir, f"{name}.npy"), mmap_mode="r")

    stats = DataStats.from_dict(meta["stats"])
    shared = (array("tokens"), array("loss"), array("doc_offsets"))
    datasets = {split: SFTDataset(split, *shared, array(f"{split}_row_offsets"),
                                  array(f"{split}_row_docs"), stats.seq_length, meta["pad_id"])
                for split in SPLITS}
    return SFTDatasets(**datasets, stats=stats, cache_dir=cache_dir, from_cache=from_cache)


def _is_complete(cache_dir: str) -> bool:
    try:
        with open(os.path.join(cache_dir, "meta.json")) as f:
            return json.load(f).get("version") == CACHE_VERSION
    except (OSError, ValueError):
        return False


def _remove_stale_temporaries(root: str, max_age_s: float = 24 * 3600) -> None:
    now = time.time()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith(".tmp-") and now - os.path.getmtime(path) > max_age_s:
            shutil.rmtree(path, ignore_errors=True)


def build_datasets(cfg: DataConfig, tokenizer=None) -> SFTDatasets:
    """Preprocess (or reuse the cache of) ``cfg``'s data; returns train/valid/test and stats."""
    if cfg.seq_length < 1:
        raise DataError(f"--seq-length {cfg.seq_length}: expected a positive row length")
    parse_split(cfg.split)
    sources = parse_data_path(cfg.data_path)
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg)
    spec = make_spec(cfg.chat_template, tokenizer, history_mask=cfg.history_mask,
                     reasoning_loss=cfg.reasoning_loss,
                     kwargs=parse_template_kwargs(cfg.chat_template_kwargs))
    if cfg.mix_strategy not in MIX_STRATEGIES:
        raise DataError(f"--sft-data-mix-strategy {cfg.mix_strategy!r}: expected one of "
                        f"{MIX_STRATEGIES}")
    if cfg.mix_strategy != "concat" and sources[0].weight is not None:
        raise DataError(f"--sft-data-mix-strategy {cfg.mix_strategy} with a weighted --data-path "
                        f"blend: give either blend weights or a mix strategy, not both")
    if cfg.packing_buffer_size is not None and cfg.packing_buffer_size < 1:
        raise DataError(f"--packing-buffer-size {cfg.packing_buffer_size}: expected a positive "
                        f"number of samples")
    named_formats = load_dataset_config(cfg.dataset_config)
    # Unresolved ("auto") formats go into the cache key: resolution depends only on the file's
    # contents, which the key hashes, so a cache hit never has to parse the data files.
    formats = dataset_formats(cfg, sources, named_formats)

    root = cfg.resolved_cache_path()
    os.makedirs(root, exist_ok=True)
    cache_dir = os.path.join(root, cache_key(cfg, sources, formats, spec, tokenizer))
    if _is_complete(cache_dir):
        return _load(cache_dir, from_cache=True)
    _remove_stale_temporaries(root)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(cache_dir)}-", dir=root)
    try:
        _build(cfg, tokenizer, sources, formats, spec, tmp)
        if os.path.isdir(cache_dir):  # an incomplete leftover under the final name
            shutil.rmtree(cache_dir, ignore_errors=True)
        try:
            os.rename(tmp, cache_dir)  # the commit point
        except OSError:
            if not _is_complete(cache_dir):  # someone else's build won the race otherwise
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _load(cache_dir, from_cache=False)
