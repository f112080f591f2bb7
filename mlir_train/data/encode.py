"""Tokenisation, the pipeline's step between reading and packing: records -> rendered chat text ->
token ids and loss flags per kept document (:class:`Chunk`), inline or in N spawned worker
processes (:func:`tokenize_all`). Every worker count gives the same chunks, in record order.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os

import numpy as np

from mlir_train.data.records import DataError, DatasetFormat, RawRecord, iter_samples
from mlir_train.data.templates import Rendered, TemplateSpec, render_full

_CHUNK = 2048  # records per tokenisation task
MAX_BAD_EXAMPLES = 5

# What masking did, counted over the kept documents (DataStats.masking).
MASKING_COUNTS = ("records with tools", "empty think blocks skipped", "turns masked by history",
                  "reasoning dropped (enable_thinking false or qwen3_next)", "eod tokens masked")


@dataclasses.dataclass(frozen=True)
class TokenizeJob:
    """What a worker needs, picklable: workers never import transformers."""

    tokenizer_json: str
    spec: TemplateSpec
    fmt: DatasetFormat
    seq_length: int
    train_on_prompt: bool
    drop_long: bool
    skip_bad: bool
    eod_mask_ids: tuple[int, ...] = ()  # --eod-mask-loss: token ids that never get loss


@dataclasses.dataclass
class Chunk:
    tokens: np.ndarray  # int32, the kept documents' (possibly truncated) tokens back to back
    loss: np.ndarray  # uint8, 1 where the token is a loss target
    lengths: np.ndarray  # int64 tokens per kept document
    truncated: int
    truncated_tokens: int
    dropped: dict[str, int]
    bad_examples: list[str]
    masking: dict[str, int] = dataclasses.field(default_factory=dict)  # see MASKING_COUNTS
    role_loss: dict[str, int] = dataclasses.field(default_factory=dict)  # role -> loss positions
    # Documents longer than a row, by what became of them ("truncated" or a drop reason): the
    # first few records and the --seq-length that keeps them all whole.
    too_long: dict[str, dict] = dataclasses.field(default_factory=dict)


def note_too_long(too_long: dict[str, dict], what: str, where: str, positions: int) -> None:
    """Count a document of ``positions`` positions at ``where`` under ``what`` in ``too_long``."""
    entry = too_long.setdefault(what, {"records": [], "seq_length": 0})
    if len(entry["records"]) < MAX_BAD_EXAMPLES:
        entry["records"].append(where)
    entry["seq_length"] = max(entry["seq_length"], positions)


def merge_too_long(into: dict[str, dict], other: dict[str, dict]) -> None:
    for what, entry in other.items():
        mine = into.setdefault(what, {"records": [], "seq_length": 0})
        mine["records"] += entry["records"][:MAX_BAD_EXAMPLES - len(mine["records"])]
        mine["seq_length"] = max(mine["seq_length"], entry["seq_length"])


def add_count(counts: dict[str, int], key: str, n: int = 1) -> None:
    if n:
        counts[key] = counts.get(key, 0) + n


_worker: tuple[TokenizeJob, object] | None = None


def _init_worker(job: TokenizeJob) -> None:
    global _worker
    # N processes each running tokenizers' own thread pool would oversubscribe the cores.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer
    _worker = (job, Tokenizer.from_str(job.tokenizer_json))


def _tokenize_in_worker(records: list[RawRecord]) -> Chunk:
    job, tokenizer = _worker
    return tokenize_records(records, job, tokenizer)


def tokenize_records(records: list[RawRecord], job: TokenizeJob, tokenizer) -> Chunk:
    """Render and tokenise ``records``: each kept document's tokens and loss flags (cut to
    ``seq_length + 1`` tokens, or dropped with ``drop_long``), and what was dropped, truncated
    and masked on the way."""
    dropped: dict[str, int] = {}
    bad_examples: list[str] = []
    rendered = _render_records(records, job, dropped, bad_examples)
    encodings = (tokenizer.encode_batch([r.text for r, _, _ in rendered], add_special_tokens=False)
                 if rendered else [])
    limit = job.seq_length + 1  # a row holds n - 1 positions of an n-token document
    eod_ids = np.asarray(job.eod_mask_ids, np.int64)
    token_parts, loss_parts, lengths = [], [], []
    truncated = truncated_tokens = 0
    masking: dict[str, int] = {}
    role_loss: dict[str, int] = {}
    too_long: dict[str, dict] = {}
    for encoding, (out, has_tools, where) in zip(encodings, rendered):
        ids = np.asarray(encoding.ids, np.int64)
        loss, eod_masked = _loss_flags(ids, encoding, out, job.train_on_prompt, eod_ids)
        n = len(ids)
        if n > limit:
            if job.drop_long:
                add_count(dropped, "longer than seq_length")
                note_too_long(too_long, "longer than seq_length", where, n - 1)
                continue
            ids, loss = ids[:limit], loss[:limit]
        if n < 2 or not loss[1:].any():
            add_count(dropped, "response truncated away" if n > limit else "no loss tokens")
            if n > limit:
                note_too_long(too_long, "response truncated away", where, n - 1)
            continue
        if n > limit:
            truncated += 1
            truncated_tokens += n - limit
            note_too_long(too_long, "truncated", where, n - 1)
        _add_role_loss(role_loss, encoding, out, ids, loss)
        add_count(masking, "records with tools", int(has_tools))
        add_count(masking, "empty think blocks skipped", out.empty_think_skipped)
        add_count(masking, "turns masked by history", out.history_masked)
        add_count(masking, "reasoning dropped (enable_thinking false or qwen3_next)", out.reasoning_dropped)
        add_count(masking, "eod tokens masked", eod_masked)
        token_parts.append(ids.astype(np.int32))
        loss_parts.append(loss)
        lengths.append(len(ids))
    return Chunk(
        tokens=np.concatenate(token_parts) if token_parts else np.zeros(0, np.int32),
        loss=np.concatenate(loss_parts) if loss_parts else np.zeros(0, np.uint8),
        lengths=np.asarray(lengths, np.int64),
        truncated=truncated, truncated_tokens=truncated_tokens, dropped=dropped,
        bad_examples=bad_examples, masking=masking, role_loss=role_loss, too_long=too_long)


def _render_records(records: list[RawRecord], job: TokenizeJob, dropped: dict[str, int],
                    bad_examples: list[str]) -> list[tuple[Rendered, bool, str]]:
    """Each good record rendered by the template, with whether it has tools and where it is; with ``skip_bad``
    a bad record is counted in ``dropped`` by reason and its message kept in ``bad_examples``
    (the first few)."""
    rendered = []
    for record, sample in zip(records, iter_samples(records, job.fmt, job.skip_bad, dropped,
                                                    bad_examples)):
        if sample is None:
            continue
        try:
            rendered.append((render_full(sample, job.spec, record.where), bool(sample.tools), record.where))
        except DataError as e:
            if not job.skip_bad:
                raise
            add_count(dropped, e.reason)
            if len(bad_examples) < MAX_BAD_EXAMPLES:
                bad_examples.append(str(e))
    return rendered


def _loss_flags(ids: np.ndarray, encoding, out: Rendered, train_on_prompt: bool,
                eod_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """(1 on the tokens of the rendered loss spans, or on every token with ``train_on_prompt``,
    less the ``eod_ids`` tokens; how many loss targets that took from eod tokens)."""
    loss = np.zeros(len(ids), np.uint8)
    if train_on_prompt:
        loss[:] = 1
    else:
        for start, end in out.spans:
            first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
            if first is not None and last is not None:
                loss[first:last + 1] = 1
    eod_masked = 0
    if len(eod_ids):
        on_eod = np.isin(ids, eod_ids) & (loss == 1)
        eod_masked = int(on_eod[1:].sum())
        loss[on_eod] = 0
    return loss, eod_masked


def _add_role_loss(role_loss: dict[str, int], encoding, out: Rendered, ids: np.ndarray, loss: np.ndarray) -> None:
    """Loss positions by the role of the text each token starts in."""
    starts = np.asarray([o[0] for o in encoding.offsets[:len(ids)]], np.int64)
    for a, b, role in out.roles:
        lo, hi = np.searchsorted(starts, [a, b], side="left")
        add_count(role_loss, role, int(loss[max(lo, 1):max(hi, 1)].sum()))


def tokenize_all(job: TokenizeJob, records: list[RawRecord], num_workers: int) -> list[Chunk]:
    """Tokenise inline (1 worker) or in ``num_workers`` spawned processes, chunks in order."""
    if num_workers <= 1:
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_str(job.tokenizer_json)
        return [tokenize_records(records[i:i + _CHUNK], job, tokenizer)
                for i in range(0, len(records), _CHUNK)]
    size = max(64, min(_CHUNK, -(-len(records) // (4 * num_workers))))
    pieces = [records[i:i + size] for i in range(0, len(records), size)]
    # spawn, not fork: the parent may hold JAX's threads, which fork would copy mid-flight.
    pool = concurrent.futures.ProcessPoolExecutor(
        num_workers, mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker, initargs=(job,))
    try:
        return list(pool.map(_tokenize_in_worker, pieces))
    finally:
        pool.shutdown(cancel_futures=True)
