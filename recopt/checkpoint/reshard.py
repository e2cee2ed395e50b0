"""Offline resharding: rewrite a checkpoint for another world size or plan, or export it whole.

Works without a process group and streams: each tensor is read alone through DCP (so only
its bytes are in memory), cut into the chunks the target layout wants, and appended to the
output, so peak memory stays near the largest tensor rather than the model. The output is an
ordinary recopt checkpoint (manifest, checksums, atomic rename) that `load` reads at the new
world size; ``export_full`` writes plain tensors as safetensors for inference or other tools.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import struct
import warnings
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from recopt.checkpoint.keys import TABLE_FQN, model_tables, table_of
from recopt.checkpoint.manifest import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    SKELETON_NAME,
    Manifest,
    file_entry,
    fsync_dir,
    read_manifest,
    verify_files,
)
from recopt.checkpoint.reader import SafeFileSystemReader
from recopt.checkpoint.reshard_id_maps import IdMapTable, id_map_tables, map_chunks, place_ids
from recopt.checkpoint.reshard_report import ProgressFn, ReshardReport, Tally, nbytes
from recopt.checkpoint.state import CheckpointError, archive_crc_off
from recopt.modules.config import BaseEmbeddingConfig
from recopt.sharding.id_map_relocate import TableRelocation
from recopt.sharding.plan import ShardingPlan

Rect = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of one chunk


def _open_source(src: Path, dst: Path) -> tuple[Manifest, Metadata, SafeFileSystemReader, Path]:
    """Verifies ``src`` in full, then creates ``dst``'s partial directory to write into."""
    manifest, metadata, reader = _verified(src)
    return manifest, metadata, reader, _fresh_partial(dst)


def _verified(src: Path) -> tuple[Manifest, Metadata, SafeFileSystemReader]:
    """``src``'s manifest and DCP metadata, once every file is verified, and its reader."""
    manifest = read_manifest(src)
    problems = verify_files(src, manifest, sorted(manifest.files))
    if problems:
        raise CheckpointError(f"checkpoint {src} failed verification:\n  " + "\n  ".join(problems))
    metadata = SafeFileSystemReader(src).read_metadata()
    return manifest, metadata, SafeFileSystemReader(src, metadata)


def _read_tensor(
    reader: SafeFileSystemReader, key: str, shape: list[int], dtype: str
) -> torch.Tensor:
    """The full tensor ``key``: DCP reads just the chunks of that key, no process group."""
    full = torch.empty(shape, dtype=getattr(torch, dtype))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load({key: full}, storage_reader=reader, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:
        # DCP's CheckpointException is a BaseException: never let it (or an assert) escape.
        raise CheckpointError(f"cannot read {key!r}: {type(e).__name__}: {e}") from e
    return full


def _even_rows(shape: list[int], world_size: int) -> list[Rect]:
    rows, per = shape[0], -(-shape[0] // world_size)
    rest = tuple(shape[1:])
    return [
        ((start,) + (0,) * len(rest), (min(per, rows - start),) + rest)
        for start in range(0, rows, per)
    ]


def target_chunks(
    key: str,
    shape: list[int],
    plan: ShardingPlan | None,
    world_size: int,
    was_sharded: bool,
    tables: Collection[tuple[str, str]] | None = None,
) -> list[Rect]:
    """The chunks ``key`` is written in: the plan's rectangles for a table's weight and
    element-wise state, its row ranges for row-wise state, otherwise one chunk (replicated
    tensors, scalars) or an even row split over ``world_size`` (sharded tensors, no plan).
    ``tables`` (`model_tables`) resolves optimizer state keyed under a child's name."""
    whole: list[Rect] = [((0,) * len(shape), tuple(shape))]
    if not shape:
        return whole
    table = table_of(key, tables)
    sharding = None
    if plan is not None and table is not None:
        sharding = (plan.get(table[0]) or {}).get(table[1])
    if sharding is None:
        return _even_rows(shape, world_size) if was_sharded else whole
    if sharding.sharding_type.replicated:
        return whole
    rects: list[Rect]
    if len(shape) == 2:
        rects = [((s.row_offset, s.col_offset), (s.num_rows, s.num_cols)) for s in sharding.shards]
    else:
        rows = sorted({(s.row_offset, s.num_rows) for s in sharding.shards})
        rects = [((r0,) + (0,) * (len(shape) - 1), (nr, *shape[1:])) for r0, nr in rows]
    volume = sum(torch.Size(sizes).numel() for _, sizes in rects)
    if volume != torch.Size(shape).numel():
        return _even_rows(shape, world_size)  # not this table's shape (e.g. [dim] state)
    return rects


def _chunk(full: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    view = full
    for dim, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
        view = view.narrow(dim, o, n)
    # torch.save writes a view's whole storage: give it a tensor that owns exactly its bytes.
    if view.is_contiguous() and view.untyped_storage().nbytes() == view.nbytes:
        return view
    return view.clone(memory_format=torch.contiguous_format)


def _units(
    manifest: Manifest, budget: int, mapped: list[IdMapTable]
) -> Iterator[tuple[list[str], IdMapTable | None]]:
    """What is read and written together: each id-mapped table placed for the plan (all its
    tensors, one table in memory at a time), then the other keys grouped so that small
    tensors share a read (a big tensor is read alone)."""
    for table in mapped:
        yield table.keys, table
    taken = {k for table in mapped for k in table.keys}
    batch: list[str] = []
    size = 0
    for key, entry in sorted(manifest.tensors.items()):
        if key in taken:
            continue
        tensor_bytes = nbytes(entry.shape, entry.dtype)
        if batch and size + tensor_bytes > budget:
            yield batch, None
            batch, size = [], 0
        batch.append(key)
        size += tensor_bytes
    if batch:
        yield batch, None


def reshard(
    src: str | Path,
    dst: str | Path,
    *,
    world_size: int,
    plan: ShardingPlan | None = None,
    tables: Sequence[BaseEmbeddingConfig] | None = None,
    progress: ProgressFn | None = None,
    batch_bytes: int = 64 << 20,
) -> ReshardReport:
    """Rewrite checkpoint ``src`` as ``dst`` laid out for ``world_size`` ranks (and ``plan``).

    An id-mapped table that ``plan`` places has each live id (and admission candidate)
    written on the row shard that owns it under the plan, with its weight row, optimizer
    state and counters, as the first forward after a load would move it (`place_ids`: the
    same rule, the same rows; ids a shard has no room for are dropped by its policy, counted
    in the report and warned about). Without ``plan``, or for a table it does not place,
    rows stay at their global rows and that first forward moves the ids.

    Args:
        src: a complete recopt checkpoint (verified in full first).
        dst: the new checkpoint directory; must not exist.
        world_size: the target world size (recorded in the manifest; sets the row split of
            sharded tensors that ``plan`` does not place).
        plan: the target plan; tables it places are chunked by its shards.
        tables: the model's table configs (by name): with them, each id-mapped table ``plan``
            places has its ids written on their owner shards (its ``id_map`` policy and ttl
            decide which ids are live and kept); without (None), such tables keep their rows
            at their global rows, with a warning, and the first forward moves the ids.
        progress: called after every tensor.
        batch_bytes: small tensors are read together up to this many bytes.

    Returns:
        What was done.

    Raises:
        CheckpointError: ``src`` is damaged or ``dst`` exists.
        ValueError: a bad ``world_size``; a plan rank outside it; an id-mapped table placed by
            ``plan`` without a config in ``tables``, or with one the checkpoint does not match.
        PlanError: ``plan`` splits an id-mapped table's columns or replicates it.
    """
    src, dst = Path(src), Path(dst)
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if plan is not None:
        _check_plan_ranks(plan, world_size)
    manifest, metadata, reader = _verified(src)
    owners = model_tables(manifest.tensors)
    if plan is not None:
        _check_plan_tables(plan, owners)
    shapes = {k: e.shape for k, e in manifest.tensors.items()}
    mapped = id_map_tables(shapes, plan, tables, owners)
    partial = _fresh_partial(dst)
    writer = _Writer(_Target(plan, world_size, owners, metadata), Tally(manifest, progress))
    placed: list[TableRelocation] = []
    for file_index, (keys, table) in enumerate(_units(manifest, batch_bytes, mapped)):
        read = {k: _read_tensor(reader, k, shapes[k], manifest.tensors[k].dtype) for k in keys}
        if table is not None:
            placed.append(place_ids(table, read, world_size))
        writer.write_file(partial / f"__{file_index}_0.distcp", keys, read, table)
    _write_metadata(partial, metadata, writer.chunks, writer.storage)
    plan_json = plan.to_json() if plan is not None else manifest.plan
    _finish_copy(src, dst, partial, manifest, world_size, plan_json)
    report = writer.tally.report(world_size)
    for counts in placed:
        report.add_placement(counts)
    return report


@dataclass(frozen=True, slots=True)
class _Target:
    """The layout a rewrite writes for: the target plan and world size."""

    plan: ShardingPlan | None
    world_size: int
    owners: Collection[tuple[str, str]]  # the model's tables (`model_tables`)
    source: Metadata

    def chunks(self, key: str, shape: list[int], table: IdMapTable | None) -> list[Rect]:
        """The chunks ``key`` is written in (a placed table's map: its row shards')."""
        rects = map_chunks(table, key) if table is not None else None
        if rects is None:
            sharded = len(getattr(self.source.state_dict_metadata[key], "chunks", [])) > 1
            rects = target_chunks(key, shape, self.plan, self.world_size, sharded, self.owners)
        return rects


@dataclass(slots=True)
class _Writer:
    """Appends tensors to the output's files as DCP chunks, and keeps their metadata."""

    target: _Target
    tally: Tally
    chunks: dict[str, list[ChunkStorageMetadata]] = field(default_factory=dict)
    storage: dict[MetadataIndex, _StorageInfo] = field(default_factory=dict)

    def write_file(
        self,
        path: Path,
        keys: list[str],
        tensors: dict[str, torch.Tensor],
        table: IdMapTable | None,
    ) -> None:
        """Writes ``keys`` (popped from ``tensors``: each freed once written) to ``path``."""
        with open(path, "wb") as out:
            for key in keys:
                full = tensors.pop(key)
                rects = self.target.chunks(key, list(full.shape), table)
                self.chunks[key] = _append_chunks(out, path.name, key, full, rects, self.storage)
                self.tally.add(key, full.nbytes)
            out.flush()
            os.fsync(out.fileno())


def _append_chunks(
    out: io.BufferedWriter,
    name: str,
    key: str,
    full: torch.Tensor,
    rects: list[Rect],
    storage: dict[MetadataIndex, _StorageInfo],
) -> list[ChunkStorageMetadata]:
    """Append each rectangle of ``full`` to ``out`` as DCP does (one torch.save archive each)."""
    chunks = []
    for offsets, sizes in rects:
        begin = out.tell()
        with archive_crc_off():
            torch.save(_chunk(full, offsets, sizes), out)
        storage[MetadataIndex(key, torch.Size(offsets))] = _StorageInfo(
            name, begin, out.tell() - begin
        )
        chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
    return chunks


def _check_plan_ranks(plan: ShardingPlan, world_size: int) -> None:
    for module, tables in plan.plan.items():
        for table, sharding in tables.items():
            ranks = set(sharding.ranks) | {s.rank for s in sharding.shards}
            if ranks and max(ranks) >= world_size:
                raise ValueError(
                    f"plan places table {table!r} (module {module!r}) on rank {max(ranks)}, "
                    f"but --world-size is {world_size}; give the plan made for that world size"
                )


def _check_plan_tables(plan: ShardingPlan, owners: Collection[tuple[str, str]]) -> None:
    """Refuse a plan that places a table the checkpoint lacks (its tables would otherwise be
    written as if unplanned: an even row split, ids left at their global rows)."""
    missing = sorted(
        (m, t) for m, tables in plan.plan.items() for t in tables if (m, t) not in owners
    )
    if not missing:
        return
    names = ", ".join(f"{m}.{t}" if m else t for m, t in missing)
    modules = sorted({m for m, _ in owners})
    raise ValueError(
        f"the plan places tables the checkpoint does not have: {names} (the plan's modules "
        f"{sorted(plan.plan)}, the checkpoint's {modules}); give the plan made for this model "
        "(recopt-plan --module-path, or [planner] module_path: the module its tables are under)"
    )


def _fresh_partial(dst: Path) -> Path:
    if dst.exists():
        raise CheckpointError(f"{dst} exists; choose a new output directory")
    partial = dst.parent / f".{dst.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def _write_metadata(
    partial: Path,
    source: Metadata,
    chunks: dict[str, list[ChunkStorageMetadata]],
    storage: dict[MetadataIndex, _StorageInfo],
) -> None:
    tensors: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {
        key: dataclasses.replace(md, chunks=chunks[key])
        for key, md in source.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    metadata = dataclasses.replace(
        source, state_dict_metadata=tensors, storage_data=storage, storage_meta=None
    )
    with open(partial / DCP_METADATA_NAME, "wb") as f:
        pickle.dump(metadata, f)


def _finish_copy(
    src: Path, dst: Path, partial: Path, manifest: Manifest, world_size: int, plan: str | None
) -> None:
    """Copy the JSON side files, write the new manifest, rename into place."""
    for name in manifest.files:
        if name == SKELETON_NAME or name.startswith("rank_"):
            shutil.copyfile(src / name, partial / name)
    files = {f.name: file_entry(f) for f in sorted(partial.iterdir()) if f.name != MANIFEST_NAME}
    Manifest(
        world_size=world_size,
        step=manifest.step,
        plan=plan,
        files=files,
        tensors=manifest.tensors,
        finite=manifest.finite,
    ).write(partial)
    fsync_dir(partial)
    partial.rename(dst)
    fsync_dir(dst.parent)


# ---------------------------------------------------------------------------------------------
# Export to safetensors, streamed: the header is computed from the manifest, then each tensor
# is read and appended in turn, so no more than one tensor is ever in memory.

_SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def export_full(
    src: str | Path, dst: str | Path, *, progress: ProgressFn | None = None
) -> ReshardReport:
    """Export ``src`` as unsharded tensors: ``model.safetensors`` (the model's tensors, tables
    as ``<module>.<table>.weight``: `model_export_names`; `read_model_export` gives back the
    state dict) and ``state.safetensors`` (optimizer and extra tensors, by checkpoint path).

    Raises:
        CheckpointError: ``src`` is damaged, ``dst`` exists, or a dtype safetensors lacks.
    """
    src, dst = Path(src), Path(dst)
    manifest, _, reader, partial = _open_source(src, dst)
    tally = Tally(manifest, progress)
    groups = {
        "model.safetensors": [k for k in sorted(manifest.tensors) if k.startswith("model/")],
        "state.safetensors": [k for k in sorted(manifest.tensors) if not k.startswith("model/")],
    }
    for file_name, keys in groups.items():
        names = model_export_names(keys) if file_name == "model.safetensors" else {}
        renamed = {names[k]: k.removeprefix("model/") for k in keys if k in names}
        names = {k: names.get(k, k) for k in keys}
        with open(partial / file_name, "wb") as out:
            out.write(_safetensors_header(manifest, keys, names, renamed))
            for key in keys:
                entry = manifest.tensors[key]
                full = _read_tensor(reader, key, entry.shape, entry.dtype)
                out.write(full.reshape(-1).view(torch.uint8).numpy().data)
                tally.add(key, full.nbytes)
    partial.rename(dst)
    return tally.report(None)


def model_export_names(keys: Iterable[str]) -> dict[str, str]:
    """The ``model.safetensors`` name of each ``model/`` key.

    A table's weight is named ``<module>.<table>.weight`` (``<table>.weight`` at the root):
    the collection's own ``embedding_bags`` / ``embeddings`` dict is left out, so a DLRM's
    ``embedding_bags.embedding_bags.t0.weight`` exports as ``embedding_bags.t0.weight``.
    Other tensors keep their state-dict key; so does a table whose short name another
    tensor already has.
    """
    names = {k: k.removeprefix("model/") for k in keys}
    short: dict[str, str] = {}
    for key in names:
        table = table_of(key)
        if table is not None and TABLE_FQN.fullmatch(key.removeprefix("model/")):
            module, name = table
            short[key] = f"{module}.{name}.weight" if module else f"{name}.weight"
    taken = set(names.values())
    for key, name in short.items():
        if name not in taken and list(short.values()).count(name) == 1:
            names[key] = name
    return names


def read_model_export(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's state dict from an export's ``model.safetensors``, keyed as the model's
    ``state_dict()`` (ready for ``load_state_dict``), from this or an older recopt's export.

    Args:
        path: the export directory or its ``model.safetensors``.
    """
    from safetensors import safe_open

    file = Path(path)
    file = file / "model.safetensors" if file.is_dir() else file
    with safe_open(str(file), "pt") as f:
        renamed = json.loads((f.metadata() or {}).get("state_dict_keys", "{}"))
        return {renamed.get(name, name): f.get_tensor(name) for name in f.keys()}


def _safetensors_header(
    manifest: Manifest, keys: list[str], names: dict[str, str], renamed: dict[str, str]
) -> bytes:
    metadata = {"format": "pt", "source": "recopt", "step": str(manifest.step)}
    if renamed:  # export name -> state-dict key, for read_model_export
        metadata["state_dict_keys"] = json.dumps(renamed, sort_keys=True)
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for key in keys:
        entry = manifest.tensors[key]
        if entry.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{key}: dtype {entry.dtype} has no safetensors equivalent")
        size = nbytes(entry.shape, entry.dtype)
        header[names[key]] = {
            "dtype": _SAFETENSORS_DTYPES[entry.dtype],
            "shape": entry.shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text
