"""Streaming reader of Criteo click logs (TSV: label, 13 integer and 26 hex categorical columns).

Dense columns become log(1 + max(x, 0)) (missing: 0); categoricals are hashed into their
table (missing: id 0, present values: 1..N-1, so "missing" never collides with a value), or,
for id-mapped tables (``raw_ids``), kept whole: ``(column + 1) * 2**32 + value`` (missing: 0),
so no two values collide before the table's id map.
Ranks split by line: each step reads a window of N*B lines and rank r of N takes lines
r, r+N, r+2N, ... of it, so all ranks yield the same number of batches (a final partial
window is dropped by default). Every rank scans the whole stream (cheap next to training);
the state holds the global line position and its byte offset, the same on every rank and
independent of N, so a resume with any number of ranks seeks there and continues the stream.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from typing import Any, BinaryIO

import numpy as np
import torch

from recopt.data.batch import Batch
from recopt.sparse import KeyedJaggedTensor

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_COLUMNS = 1 + NUM_DENSE + NUM_SPARSE
MISSING_ID = 0
_MIX = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: a well-spread multiplier
# Exactly what the format holds: no sign but '-', no spaces, no '0x' or '_' (which Python's
# int() and numpy would accept), so a corrupted file is reported, not silently read.
_DENSE_TOKEN = re.compile(rb"-?[0-9]+")
_HEX_TOKEN = re.compile(rb"[0-9a-fA-F]{1,8}")
_INT64_MAX = 2**63 - 1


def hash_categorical(values: np.ndarray, column: int, num_embeddings: int) -> np.ndarray:
    """Stable hash of parsed 32-bit categorical values into ids 1..num_embeddings-1.

    The same (value, column) always maps to the same id, on any machine and any run
    (no Python ``hash``, which is salted per process).

    Args:
        values: uint64 array of the categorical values (the hex tokens as integers).
        column: categorical column index (0..25): salts the hash per feature.
        num_embeddings: the table's rows; must be >= 2 (row 0 is for missing values).

    Returns:
        int64 ids in ``[1, num_embeddings)``.
    """
    with np.errstate(over="ignore"):
        mixed = (values + np.uint64(column + 1) * np.uint64(0x632BE59BD9B4E019)) * _MIX
    mixed ^= mixed >> np.uint64(29)
    return (mixed % np.uint64(num_embeddings - 1)).astype(np.int64) + 1


def raw_categorical(values: np.ndarray, column: int) -> np.ndarray:
    """Parsed 32-bit categorical values as raw ids for an id-mapped table, without hashing.

    The column is kept in the high bits (``(column + 1) * 2**32 + value``), so the same value
    in two columns stays two ids when columns share one table, every id is above 0 (the id
    of a missing value) and below 2**37, and each value can be read back from its id.

    Args:
        values: uint64 array of the categorical values (the hex tokens as integers).
        column: categorical column index (0..25).

    Returns:
        int64 ids.
    """
    return (values.astype(np.int64) & 0xFFFFFFFF) + ((column + 1) << 32)


class CriteoClickLog:
    """Iterator of batches from Criteo TSV files, this rank's lines only.

    Args:
        paths: TSV files, read one after the other as one stream.
        feature_names: the KJT key of each of the 26 categorical columns.
        num_embeddings: the table size of each categorical column (>= 2).
        batch_size: samples per batch on this rank.
        rank: this rank.
        world_size: number of ranks.
        drop_last: drop this rank's final partial batch (keeps ranks in lockstep).
        epochs: passes over the files; each pass starts again at the first line (a partial
            final window is dropped at the end of each pass when ``drop_last``).
        raw_ids: per column, True to pass its values whole (`raw_categorical`, for an
            id-mapped table; its ``num_embeddings`` is then not used) instead of hashed into
            ``num_embeddings`` rows; None: every column hashed.

    Raises:
        ValueError: on a bad argument; while iterating, on a malformed line (naming the
            file, the line number and the column), or when the files hold fewer samples
            than one batch of all ranks (naming how many they hold).
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        feature_names: Sequence[str],
        num_embeddings: Sequence[int],
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        epochs: int = 1,
        raw_ids: Sequence[bool] | None = None,
    ) -> None:
        if not paths:
            raise ValueError("CriteoClickLog needs at least one file in paths")
        if len(feature_names) != NUM_SPARSE or len(num_embeddings) != NUM_SPARSE:
            raise ValueError(
                f"Criteo has {NUM_SPARSE} categorical columns; got {len(feature_names)} "
                f"feature_names and {len(num_embeddings)} num_embeddings: give one feature name "
                f"and one table size per column, {NUM_SPARSE} of each (the DLRM example's "
                "configs/dlrm_criteo_shape.toml has such 26 tables)"
            )
        raw = [False] * NUM_SPARSE if raw_ids is None else [bool(r) for r in raw_ids]
        if len(raw) != NUM_SPARSE:
            raise ValueError(
                f"raw_ids has {len(raw)} entries; give one per categorical column ({NUM_SPARSE})"
            )
        for name, rows, is_raw in zip(feature_names, num_embeddings, raw, strict=True):
            if rows < 2 and not is_raw:
                raise ValueError(
                    f"feature {name!r}: num_embeddings {rows} is too small for Criteo hashing "
                    "(row 0 holds missing values); use at least 2"
                )
        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need batch_size >= 1 and 0 <= rank < world_size; got batch_size "
                f"{batch_size}, rank {rank}, world_size {world_size}"
            )
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        self.paths = [os.fspath(p) for p in paths]
        self.keys = list(feature_names)
        self.num_embeddings = list(num_embeddings)
        self.raw_ids = raw
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.epochs = epochs
        self._epoch = 0
        self._file_index = 0
        self._byte_offset = 0
        self._line_number = 0  # lines read in the current file, all ranks' included
        self._lines_read = 0  # lines read over all files: decides which rank owns a line
        self._position = 0
        self._handle: BinaryIO | None = None

    def __iter__(self) -> CriteoClickLog:
        return self

    def __next__(self) -> Batch:
        while True:
            rows, complete = self._read_window()
            if rows and (complete or not self.drop_last):
                break
            # The end of a pass: a window cut short is partial on every rank at once.
            self.close()
            if self._position == 0:
                raise self._too_small()
            if self._epoch + 1 >= self.epochs:
                raise StopIteration
            self._rewind()
        self._position += 1
        dense, sparse, labels = self._parse(rows)
        return Batch(dense, sparse, labels, self._position)

    @property
    def epoch(self) -> int:
        """The pass over the files being read (0-based)."""
        return self._epoch

    def _too_small(self) -> ValueError:
        window = self.batch_size * self.world_size
        files = ", ".join(self.paths)
        if self._lines_read == 0:
            return ValueError(f"Criteo data {files} is empty: there is no sample to read")
        return ValueError(
            f"Criteo data {files} holds {self._lines_read} samples, fewer than one batch of "
            f"{window} (batch_size {self.batch_size} x {self.world_size} ranks): no batch can "
            "be made; lower the batch size or add data"
        )

    def _rewind(self) -> None:
        self._epoch += 1
        self._file_index = self._byte_offset = self._line_number = self._lines_read = 0

    def _read_window(self) -> tuple[list[tuple[str, int, bytes]], bool]:
        """This rank's lines of the next window of ``batch_size * world_size`` lines."""
        window = self.batch_size * self.world_size
        rows: list[tuple[str, int, bytes]] = []
        taken = 0  # lines of this window read so far (every window starts on every rank alike)
        while taken < window:
            line = self._next_line()
            if line is None:
                break
            path, number, raw = line
            if taken % self.world_size == self.rank:
                rows.append((path, number, raw.rstrip(b"\r\n")))
            taken += 1
        return rows, taken == window

    def _next_line(self) -> tuple[str, int, bytes] | None:
        """The next line of the concatenated files with its 1-based number in its file."""
        while self._file_index < len(self.paths):
            if self._handle is None:
                self._handle = open(self.paths[self._file_index], "rb")  # noqa: SIM115
                self._handle.seek(self._byte_offset)
            raw = self._handle.readline()
            if raw:
                self._line_number += 1
                self._lines_read += 1
                self._byte_offset += len(raw)
                return self.paths[self._file_index], self._line_number, raw
            self.close()
            self._file_index += 1
            self._byte_offset = 0
            self._line_number = 0
        return None

    def close(self) -> None:
        """Closes the open file (iteration reopens it where it stopped)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def state_dict(self) -> dict[str, Any]:
        """Returns where this rank stopped: file, byte offset, line number and batches yielded."""
        return {
            "position": self._position,
            "epoch": self._epoch,
            "file_index": self._file_index,
            "byte_offset": self._byte_offset,
            "line_number": self._line_number,
            "lines_read": self._lines_read,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues exactly after the batch at which ``state`` was taken.

        The position is a global line (with its byte offset), so the state of a run with any
        number of ranks or batch size resumes the stream at the line where it stopped.
        """
        self.close()
        self._position = int(state["position"])
        self._epoch = int(state.get("epoch", 0))
        self._file_index = int(state["file_index"])
        self._byte_offset = int(state["byte_offset"])
        self._line_number = int(state["line_number"])
        self._lines_read = int(state["lines_read"])

    def _parse(
        self, rows: list[tuple[str, int, bytes]]
    ) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
        try:
            labels, dense, cats, present = _parse_columns_fast([raw for _, _, raw in rows])
        except (ValueError, OverflowError):
            # The line-by-line parser finds the line and column at fault and says so.
            labels, dense, cats, present = _parse_columns_checked(rows)
        batch = len(rows)
        ids = np.full((NUM_SPARSE, batch), MISSING_ID, dtype=np.int64)
        for col, rows_n in enumerate(self.num_embeddings):
            if self.raw_ids[col]:
                hashed = raw_categorical(cats[:, col], col)
            else:
                hashed = hash_categorical(cats[:, col], col, rows_n)
            ids[col] = np.where(present[:, col], hashed, MISSING_ID)
        sparse = KeyedJaggedTensor.from_lengths_sync(
            self.keys,
            torch.from_numpy(ids.reshape(-1)),
            torch.ones(NUM_SPARSE * batch, dtype=torch.int64),
        )
        return torch.from_numpy(dense), sparse, torch.from_numpy(labels)


_Columns = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _parse_columns_fast(lines: list[bytes]) -> _Columns:
    """Labels, dense, categorical values and their presence, parsed by numpy in bulk.

    About 10x the line-by-line parser. Raises ValueError on anything unusual (a wrong
    column count, a bad token, a categorical that is not 8 hex digits) without saying where;
    the caller then re-parses line by line for the message.
    """
    batch = len(lines)
    tokens = b"\t".join(lines).split(b"\t")
    if len(tokens) != batch * NUM_COLUMNS:
        raise ValueError("column count")
    table = np.array(tokens, dtype=np.bytes_).reshape(batch, NUM_COLUMNS)
    if not ((table[:, 0] == b"0") | (table[:, 0] == b"1")).all():
        raise ValueError("label")
    labels = table[:, 0].astype(np.int64)
    ints = table[:, 1 : 1 + NUM_DENSE]
    signed = np.char.startswith(ints, b"-")
    digits = np.where(signed, np.char.replace(ints, b"-", b"", 1), ints)
    if not (np.char.isdigit(digits) | (ints == b"")).all():
        raise ValueError("dense token")  # spaces, '+', '_', a lone '-', ...
    ints = np.where(ints == b"", b"0", ints).astype(np.int64)  # OverflowError past int64
    dense = np.log1p(np.maximum(ints, 0)).astype(np.float32)
    hexes = table[:, 1 + NUM_DENSE :]
    lengths = np.char.str_len(hexes)
    if not ((lengths == 0) | (lengths == 8)).all():
        raise ValueError("categorical width")
    present = lengths == 8
    filled = np.where(present, hexes, b"00000000").astype("S8")
    text = filled.tobytes()
    if re.fullmatch(rb"[0-9a-fA-F]*", text) is None:
        raise ValueError("categorical token")  # '0x', spaces, ...
    raw = bytes.fromhex(text.decode("ascii"))
    cats = np.frombuffer(raw, dtype=">u4").astype(np.uint64).reshape(batch, NUM_SPARSE)
    return labels.astype(np.float32), dense, cats, present


def _parse_columns_checked(rows: list[tuple[str, int, bytes]]) -> _Columns:
    """Line by line; raises naming the file, line, column and token of the first bad field."""
    batch = len(rows)
    labels = np.zeros(batch, dtype=np.float32)
    dense = np.zeros((batch, NUM_DENSE), dtype=np.float32)
    cats = np.zeros((batch, NUM_SPARSE), dtype=np.uint64)
    present = np.zeros((batch, NUM_SPARSE), dtype=bool)
    for i, (path, number, raw) in enumerate(rows):
        fields = raw.split(b"\t")
        if len(fields) != NUM_COLUMNS:
            raise ValueError(
                f"{path}:{number}: expected {NUM_COLUMNS} tab-separated columns (label, "
                f"{NUM_DENSE} integer, {NUM_SPARSE} categorical), found {len(fields)}"
            )
        column = 0
        try:
            labels[i] = _parse_label(fields[0])
            for column in range(1, 1 + NUM_DENSE):
                token = fields[column]
                if token:
                    dense[i, column - 1] = math.log1p(max(_parse_dense(token), 0))
            for column in range(1 + NUM_DENSE, NUM_COLUMNS):
                token = fields[column]
                if token:
                    cats[i, column - 1 - NUM_DENSE] = _parse_hex(token)
                    present[i, column - 1 - NUM_DENSE] = True
        except ValueError as err:
            raise ValueError(
                f"{path}:{number}: column {column} ({_column_name(column)}) holds "
                f"{fields[column]!r}, which does not parse: {err}"
            ) from None
    return labels, dense, cats, present


def _parse_dense(token: bytes) -> int:
    if _DENSE_TOKEN.fullmatch(token) is None:
        raise ValueError("an integer feature must be decimal digits with an optional '-'")
    value = int(token)
    if not -_INT64_MAX - 1 <= value <= _INT64_MAX:
        raise ValueError("an integer feature must fit in 64 bits (|value| < 2**63)")
    return value


def _parse_hex(token: bytes) -> int:
    if _HEX_TOKEN.fullmatch(token) is None:
        raise ValueError(
            "a categorical value must be a 32-bit hex number (up to 8 hex digits, no '0x', "
            "no spaces)"
        )
    return int(token, 16)


def _parse_label(token: bytes) -> float:
    if token not in (b"0", b"1"):
        raise ValueError("a label must be 0 or 1")
    return float(token)


def _column_name(column: int) -> str:
    if column == 0:
        return "label"
    if column <= NUM_DENSE:
        return f"integer feature {column}"
    return f"categorical feature {column - NUM_DENSE}"
