"""The DCP reader recopt loads with: safe metadata, and tensors read straight into their target.

DCP's ``.metadata`` is a pickle; it is read only after its checksum matched the manifest, and
through an unpickler that admits nothing but DCP's metadata classes. Tensor chunks are
``torch.save`` archives; DCP would load each into a new tensor and copy it into the target.
Where the stored chunk is contiguous and the target region is a contiguous CPU block, the raw
bytes are read directly into the target instead (one pass instead of two, no temporary);
anything else (column slices, strided or GPU targets) is loaded and copied as DCP does.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from recopt.checkpoint.manifest import DCP_METADATA_NAME, checkpoint_file
from recopt.checkpoint.state import CheckpointError

_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch._utils", "_get_layout"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses, torch dtypes and sizes; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise CheckpointError(
            f"DCP metadata refers to {module}.{name}, which is not part of DCP's metadata; "
            "refusing to unpickle it (the checkpoint is not from recopt or was tampered with)"
        )


class _Slice(io.RawIOBase):
    """``length`` bytes of ``file`` from ``offset``, as a seekable stream (for torch.load)."""

    def __init__(self, file: io.FileIO, offset: int, length: int) -> None:
        super().__init__()
        self._file, self._offset, self._length, self._pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[: self._length - self._pos]
        self._file.seek(self._offset + self._pos)
        n = self._file.readinto(view) or 0
        self._pos += n
        return n


class SafeFileSystemReader(FileSystemReader):
    """A DCP ``FileSystemReader`` with a restricted metadata unpickler and direct reads.

    Args:
        path: the checkpoint directory.
        metadata: already read (and verified) metadata to reuse, if any.
    """

    def __init__(self, path: str | Path, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is not None:
            return self._metadata
        path = checkpoint_file(Path(self.path), DCP_METADATA_NAME, str(self.path))
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for relative_path, items in per_file.items():
            where = str(Path(self.path) / DCP_METADATA_NAME)
            with open(
                checkpoint_file(Path(self.path), relative_path, where), "rb", buffering=0
            ) as file:
                for item in items:
                    info: _StorageInfo = self.storage_data[item.storage_index]
                    if info.transform_descriptors or item.type == LoadItemType.BYTE_IO:
                        raise CheckpointError(
                            f"{relative_path}: stream transforms and byte items are not part "
                            "of a recopt checkpoint"
                        )
                    _read_item(file, info, item, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _read_item(file: io.FileIO, info: _StorageInfo, item: ReadItem, planner: LoadPlanner) -> None:
    chunk = _Slice(file, info.offset, info.length)
    # Only the archive's small pickle is read here: storages stay on "meta", with their offset.
    stored = torch.load(cast(IO[bytes], chunk), map_location="meta", weights_only=True)
    target = planner.resolve_tensor(item).detach()
    begin = _contiguous_span(stored, item)
    direct = target.device.type == "cpu" and target.is_contiguous()
    if begin is not None and direct and target.dtype == stored.dtype:
        record = stored.untyped_storage()._checkpoint_offset
        chunk.seek(record + begin)
        view, got = target.reshape(-1).view(torch.uint8).numpy().data, 0
        while got < len(view):
            n = chunk.readinto(view[got:])
            if n == 0:
                raise CheckpointError(f"{file.name}: ends inside tensor {item.storage_index.fqn}")
            got += n
    else:
        chunk.seek(0)
        full = torch.load(cast(IO[bytes], chunk), map_location="cpu", weights_only=True)
        for dim, (offset, length) in enumerate(
            zip(item.storage_offsets, item.lengths, strict=True)
        ):
            full = full.narrow(dim, offset, length)
        target.copy_(full)
    planner.commit_tensor(item, target)


def _contiguous_span(stored: torch.Tensor, item: ReadItem) -> int | None:
    """Byte offset of the item's block in the stored storage, if the block is one run."""
    if not stored.is_contiguous() or stored.storage_offset() != 0:
        return None
    if stored.untyped_storage().nbytes() != stored.nbytes:
        return None
    sizes, offsets, lengths = list(stored.shape), item.storage_offsets, item.lengths
    # Contiguous iff every dimension after the first partial one is taken whole.
    for dim in range(1, len(sizes)):
        if offsets[dim] != 0 or lengths[dim] != sizes[dim]:
            return None
    if not sizes:
        return 0
    return int(offsets[0]) * stored.stride(0) * stored.element_size()
