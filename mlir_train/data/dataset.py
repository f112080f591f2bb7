"""Preprocessed SFT data: memory-mapped documents grouped into rows of ``seq_length`` tokens.

A document is stored unshifted (its ``n`` tokens and a per-token loss flag). Inside a row it
occupies ``n - 1`` positions: ``input_ids = tokens[:-1]``, ``labels = tokens[1:]``, so the
next-token shift happens per document and a label never comes from the next document.
"""

from __future__ import annotations

import dataclasses

import numpy as np

SPLITS = ("train", "valid", "test")
BATCH_KEYS = ("input_ids", "labels", "loss_mask", "segment_ids", "positions")


class SFTDataset:
    """Rows of one split; ``rows(indices)`` materialises them as a batch of numpy arrays."""

    def __init__(self, name: str, tokens: np.ndarray, loss: np.ndarray, doc_offsets: np.ndarray,
                 row_offsets: np.ndarray, row_docs: np.ndarray, seq_length: int, pad_id: int):
        self.name = name
        self.seq_length = seq_length
        self.pad_id = pad_id
        self._tokens, self._loss, self._doc_offsets = tokens, loss, doc_offsets
        self._row_offsets, self._row_docs = row_offsets, row_docs

    @property
    def num_rows(self) -> int:
        return len(self._row_offsets) - 1

    def __len__(self) -> int:
        return self.num_rows

    def row_documents(self, row: int) -> np.ndarray:
        return np.asarray(self._row_docs[self._row_offsets[row]:self._row_offsets[row + 1]])

    def document(self, doc: int) -> tuple[np.ndarray, np.ndarray]:
        """A document's unshifted tokens and loss flags."""
        start, end = self._doc_offsets[doc], self._doc_offsets[doc + 1]
        return np.asarray(self._tokens[start:end]), np.asarray(self._loss[start:end])

    def rows(self, indices) -> dict[str, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        shape = (len(indices), self.seq_length)
        batch = {
            "input_ids": np.full(shape, self.pad_id, np.int32),
            "labels": np.zeros(shape, np.int32),
            "loss_mask": np.zeros(shape, np.float32),
            "segment_ids": np.zeros(shape, np.int32),
            "positions": np.zeros(shape, np.int32),
        }
        for out_row, row in enumerate(indices.tolist()):
            if not 0 <= row < self.num_rows:
                raise IndexError(f"row {row} out of range for {self.name} ({self.num_rows} rows)")
            at = 0
            for segment, doc in enumerate(self.row_documents(row).tolist(), start=1):
                tokens, loss = self.document(doc)
                n = len(tokens) - 1
                batch["input_ids"][out_row, at:at + n] = tokens[:-1]
                batch["labels"][out_row, at:at + n] = tokens[1:]
                batch["loss_mask"][out_row, at:at + n] = loss[1:]
                batch["segment_ids"][out_row, at:at + n] = segment
                batch["positions"][out_row, at:at + n] = np.arange(n)
                at += n
        return batch

    def __getitem__(self, row: int) -> dict[str, np.ndarray]:
        return {k: v[0] for k, v in self.rows([row]).items()}


@dataclasses.dataclass(frozen=True)
class DataStats:
    """What preprocessing did; nothing is dropped or cut without being counted here."""

    records_read: int
    records_kept: int  # documents after bad records and drops (before blending)
    truncated: int  # documents cut to fit a row
    truncated_tokens: int  # positions lost to truncation
    document_tokens: int  # positions of the kept documents, after truncation
    dropped: dict[str, int]  # reason -> count (bad records, too long, nothing left to learn)
    rows: dict[str, int]  # split -> rows
    tokens: dict[str, int]  # split -> non-padding positions
    loss_tokens: dict[str, int]  # split -> positions with loss_mask 1
    seq_length: int
    packing: bool
    sources: tuple[dict, ...] = ()  # per data file: path, weight, records, kept, blended per split
    bad_record_examples: tuple[str, ...] = ()  # the first few skipped-record messages
    # What masking did over the kept documents: records with tools, empty think blocks
    # skipped, turns masked by history, reasoning dropped (enable_thinking false or qwen3_next), eod tokens
    # masked; and loss positions per role (system, user, tool, assistant, reasoning).
    masking: dict[str, int] = dataclasses.field(default_factory=dict)
    loss_tokens_by_role: dict[str, int] = dataclasses.field(default_factory=dict)
    # Documents longer than a row, by what became of them ("truncated" or the drop reason): the
    # first few records ("file:line") and the --seq-length that keeps every one of them whole.
    too_long: dict[str, dict] = dataclasses.field(default_factory=dict)

    def fill_ratio(self, split: str = "train") -> float:
        capacity = self.rows[split] * self.seq_length
        return self.tokens[split] / capacity if capacity else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["fill_ratio"] = {split: self.fill_ratio(split) for split in SPLITS}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DataStats":
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        d["sources"] = tuple(d.get("sources", ()))
        d["bad_record_examples"] = tuple(d.get("bad_record_examples", ()))
        return cls(**d)

    def _too_long(self, what: str, keeps: str) -> str:
        """``: file:3, file:8, ... (--seq-length N keeps them)`` for documents over a row."""
        entry = self.too_long.get(what)
        if not entry:
            return ""
        count = self.truncated if what == "truncated" else self.dropped[what]
        more = ", ..." if len(entry["records"]) < count else ""
        return f": {', '.join(entry['records'])}{more} (--seq-length {entry['seq_length']} {keeps})"

    def summary(self) -> str:
        dropped = sum(self.dropped.values())
        reasons = "".join(f"\n  {reason:<28} {count}{self._too_long(reason, 'keeps them')}"
                          for reason, count in sorted(self.dropped.items()))
        layout = "packed" if self.packing else "one sample per row"
        lines = [
            f"records read   {self.records_read}",
            f"records kept   {self.records_kept}",
            f"truncated      {self.truncated} documents ({self.truncated_tokens} tokens cut)"
            + self._too_long("truncated", "keeps them whole"),
            f"dropped        {dropped}{reasons}",
            f"rows of {self.seq_length} tokens ({layout}):",
        ]
        for split in SPLITS:
            lines.append(f"  {split:<6} rows {self.rows[split]:>8}  "
                         f"tokens {self.tokens[split]:>10}  "
                         f"loss tokens {self.loss_tokens[split]:>10}  "
                         f"fill {100 * self.fill_ratio(split):6.2f}%")
        if self.loss_tokens_by_role:
            lines.append("loss tokens by role (kept documents): " + ", ".join(
                f"{role} {count}" for role, count in sorted(self.loss_tokens_by_role.items())))
        if self.masking:
            lines.append("masking: " + ", ".join(
                f"{what} {count}" for what, count in self.masking.items()))
        for source in self.sources:
            lines.append(f"  source {source['path']} weight {source['weight']}: "
                         f"{source['kept']}/{source['records']} kept, "
                         f"blended train/valid/test {source['blended']}")
        for example in self.bad_record_examples:
            lines.append(f"  skipped: {example}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class SFTDatasets:
    train: SFTDataset
    valid: SFTDataset
    test: SFTDataset
    stats: DataStats
    cache_dir: str
    from_cache: bool  # True when an existing cache was reused

    def summary(self) -> str:
        origin = "reused" if self.from_cache else "built"
        return f"SFT data cache {self.cache_dir} ({origin})\n{self.stats.summary()}"
