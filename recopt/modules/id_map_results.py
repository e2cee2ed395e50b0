"""What an id map's remap returns: the rows, its stats, and its undo record.

Kept apart from `recopt.modules.id_map` (which re-exports them) so that the native remap
(`id_map_native`) builds them without importing the map itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch


@dataclass(slots=True)
class RemapStats:
    """What one training batch did to a table's map (`IdMap.last_stats`).

    ``occupancy``: live rows / rows after the batch; ``new_ids``: ids given a row;
    ``evictions``: live ids evicted by the policy; ``expired``: rows freed by ``ttl_steps``;
    ``admissions``: candidates admitted (``admit_after``); ``zero_row_ids``: distinct ids that
    read the zero row (not admitted yet, or more new ids than rows).
    """

    step: int = 0
    occupancy: float = 0.0
    new_ids: int = 0
    evictions: int = 0
    expired: int = 0
    admissions: int = 0
    zero_row_ids: int = 0

    def as_dict(self) -> dict[str, float]:
        """The counters by name."""
        return {name: float(getattr(self, name)) for name in self.__slots__}


@dataclass(slots=True)
class FreshBlock:
    """The fresh rows and ids of one native step of several maps (`id_map_native`), in one
    int64 buffer by offsets: map i's ``counts[i]`` rows from ``out[total + starts[i]]``, its
    ids from ``out[2 * total + starts[i]]``; and once made (`id_map_rows.fresh_values`), their
    initial weights: map i's ``[counts[i], dims[i]]`` float32 from ``values[value_starts[i]]``
    (-1: none made). Its `Remapped` results (`Remapped.in_block`) make their views only when
    read: the worker's reset plan takes addresses (`rows_at`), no tensor a table."""

    out: torch.Tensor
    total: int
    starts: list[int]
    counts: list[int]
    values: torch.Tensor | None = None
    value_starts: list[int] = field(default_factory=list)
    dims: list[int] = field(default_factory=list)

    def rows_at(self, i: int) -> tuple[int, int]:
        """The addresses of map i's fresh rows and ids."""
        at = self.out.data_ptr() + 8 * self.starts[i]
        return at + 8 * self.total, at + 16 * self.total

    def values_at(self, i: int, dim: int) -> int | None:
        """The address of map i's initial weights if made for rows of width ``dim``."""
        if self.values is None or self.value_starts[i] < 0 or self.dims[i] != dim:
            return None
        return self.values.data_ptr() + 4 * self.value_starts[i]

    def views(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, count = self.total + self.starts[i], self.counts[i]
        return self.out[start : start + count], self.out[start + self.total :][:count]

    def values_view(self, i: int) -> torch.Tensor | None:
        if self.values is None or self.value_starts[i] < 0:
            return None
        start, count, dim = self.value_starts[i], self.counts[i], self.dims[i]
        return self.values[start : start + count * dim].view(count, dim)


@dataclass(slots=True)
class Remapped:
    """The rows of one batch: ``rows_M`` (-1: the zero row) and the rows to re-initialise.

    ``fresh_rows`` got a new id this batch (their weights and optimizer state must be reset
    before the lookup); ``fresh_ids`` are those ids, in the same order. ``fresh_values``: their
    initial weights ``[K, D]`` float32 when made ahead (a pipeline's worker), else None.
    ``block``: where a native step left those three (`FreshBlock`, this map's index), their
    tensors made at first read (`in_block`); else None.
    """

    rows_M: torch.Tensor
    fresh_rows: torch.Tensor
    fresh_ids: torch.Tensor
    stats: RemapStats = field(default_factory=RemapStats)
    undo: MapUndo | None = None
    fresh_values: torch.Tensor | None = None
    zero_row: bool | None = None  # whether an id reads the zero row, when the host knows it
    block: tuple[FreshBlock, int] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def in_block(
        cls, rows_M: torch.Tensor, stats: RemapStats, zero_row: bool, block: FreshBlock, i: int
    ) -> Remapped:
        """Map ``i``'s result of a native step whose fresh rows are in ``block``."""
        result = cls.__new__(cls)
        result.rows_M, result.stats, result.undo, result.zero_row = rows_M, stats, None, zero_row
        result.block = (block, i)
        return result

    def num_fresh(self) -> int:
        """How many fresh rows (without making their tensor)."""
        return self.block[0].counts[self.block[1]] if self.block else self.fresh_rows.numel()

    if not TYPE_CHECKING:  # typed as the fields above; only a result `in_block` comes here

        def __getattr__(self, name: str) -> Any:
            block = object.__getattribute__(self, "block") if name in _IN_BLOCK else None
            if block is None:
                raise AttributeError(name)
            source, i = block
            if name == "fresh_values":
                self.fresh_values = source.values_view(i)
            else:
                self.fresh_rows, self.fresh_ids = source.views(i)
            return object.__getattribute__(self, name)

    def reads_zero_row(self) -> bool:
        """Whether an id reads the zero row: ``zero_row`` when known (a native step counts
        it), else read from the rows (on a device: a sync)."""
        if self.zero_row is not None:
            return self.zero_row
        return bool(self.rows_M.numel() and (self.rows_M < 0).any())

    def to(self, device: torch.device) -> Remapped:
        """The rows on ``device`` (where the batch's ids are): `results_to` of this one."""
        return results_to({"": self}, device)[""]


def results_to(results: Mapping[str, Remapped], device: torch.device) -> dict[str, Remapped]:
    """``results`` with their rows (and any ``fresh_values``) on ``device``, moved in one copy
    each (the maps of a CUDA table live on the host: `recopt.modules.id_map.map_device`);
    the undo records stay with the maps, and ``zero_row`` (unless known already: a native
    step counts it) is read before the rows leave.
    From host to a GPU the copies go through page-locked memory without waiting: they queue
    behind the device's work instead of making the caller wait for it (a pipeline's worker
    runs beside the previous step)."""
    if all(r.rows_M.device == device for r in results.values()):
        return dict(results)
    parts = [t for r in results.values() for t in (r.rows_M, r.fresh_rows, r.fresh_ids)]
    moved = iter(to_device(torch.cat(parts), device).split([t.numel() for t in parts]))
    out = {
        name: Remapped(next(moved), next(moved), next(moved), r.stats, r.undo)
        for name, r in results.items()
    }
    for name, r in results.items():  # known here without reading the device later
        out[name].zero_row = r.zero_row if r.zero_row is not None else bool((r.rows_M < 0).any())
    values = {n: r.fresh_values for n, r in results.items() if r.fresh_values is not None}
    if values:
        flat = to_device(torch.cat([v.reshape(-1) for v in values.values()]), device)
        pieces = flat.split([v.numel() for v in values.values()])
        for (name, value), piece in zip(values.items(), pieces, strict=True):
            out[name].fresh_values = piece.view(value.shape)
    return out


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; host to GPU without waiting for the GPU (page-locked)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


ROW_BUFFERS = ("row_ids", "occupied", "last_seen", "frequency")
CANDIDATE_BUFFERS = ("candidate_ids", "candidate_used", "candidate_count", "candidate_last_seen")


class UndoSource(Protocol):
    """Where a deferred `MapUndo`'s tensors come from (a native step's logs)."""

    def fill(self) -> None:
        """Set the tensors of every record of the step (raises if they were released)."""

    def release(self) -> None:
        """One record of the step will not be read."""


class _Released:
    """The source of a released record: reading it is a bug, reported as such."""

    def fill(self) -> None:
        raise RuntimeError("id map: an undo record was read after its release()")

    def release(self) -> None:
        pass


_RELEASED = _Released()
_IN_BLOCK = frozenset(("fresh_rows", "fresh_ids", "fresh_values"))
_DEFERRED = frozenset(("rows", "row_values", "candidate_slots", "candidate_values"))


@dataclass(slots=True)
class MapUndo:
    """What one training remap changed, to put the map back (`IdMap.apply_undo`).

    ``step`` and ``stats`` are the values before the remap; ``rows`` [K] the row slots whose
    buffers it changed and ``row_values`` their old values, by buffer name (``row_ids``,
    ``occupied``, ``last_seen``, ``frequency``); likewise ``candidate_slots`` and
    ``candidate_values`` (``candidate_ids``, ``candidate_used``, ``candidate_count``,
    ``candidate_last_seen``) when admission is on (else empty).

    A native step's records are *deferred* (`deferred`): their tensors stay in the native
    side's log until first read, or until the map steps again (copied out then), and
    `release` lets a record that will not be read go uncopied (a pipeline's step once its
    forward took it): most steps are never undone (the copy: ~0.4 ms a step for 26 maps of
    2,048 ids on a 2-vCPU EPYC VM).
    """

    step: int
    stats: RemapStats
    rows: torch.Tensor
    row_values: dict[str, torch.Tensor]
    candidate_slots: torch.Tensor
    candidate_values: dict[str, torch.Tensor] = field(default_factory=dict)
    source: UndoSource | None = field(default=None, repr=False, compare=False)

    @classmethod
    def deferred(cls, step: int, stats: RemapStats, source: UndoSource) -> MapUndo:
        """A record whose tensors ``source.fill()`` sets when one is first read."""
        undo = cls.__new__(cls)
        undo.step, undo.stats, undo.source = step, stats, source
        return undo

    def __reduce__(self) -> tuple[type[MapUndo], tuple[Any, ...]]:
        """A copy or pickle holds the tensors (a deferred record's copied out), no source."""
        fields = (self.rows, self.row_values, self.candidate_slots, self.candidate_values)
        return MapUndo, (self.step, self.stats, *fields)

    def release(self) -> None:
        """Say that this record will not be read (a deferred one is then not copied)."""
        if self.source is not None:
            self.source.release()
            self.source = _RELEASED

    if not TYPE_CHECKING:  # typed as the fields above; only a deferred record comes here

        def __getattr__(self, name: str) -> Any:
            source = object.__getattribute__(self, "source") if name != "source" else None
            if source is None or name not in _DEFERRED:
                raise AttributeError(name)
            source.fill()
            return object.__getattribute__(self, name)

    def write_into(self, buffers: Mapping[str, torch.Tensor]) -> None:
        """Write the old values back into a map's ``buffers`` (by name: ``step`` and those of
        `ROW_BUFFERS` and `CANDIDATE_BUFFERS`): the map's own (`IdMap.apply_undo`) or copies."""
        with torch.no_grad():
            buffers["step"].fill_(self.step)
            for name, old in self.row_values.items():
                buffers[name][self.rows] = old
            for name, old in self.candidate_values.items():
                buffers[name][self.candidate_slots] = old
