"""The checkpoint manifest: what a complete checkpoint holds, and how to prove a copy is intact.

``manifest.json`` is written last (before the directory is renamed into place). It lists every
file with its size and CRC-32, every tensor with its global shape and dtype, the world size,
step, plan and versions, and carries a CRC-32 of itself. Loading checks all of it before any
byte reaches the model.
"""

from __future__ import annotations

import io
import json
import os
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystem

import recopt
from recopt.checkpoint.state import CheckpointError

MANIFEST_NAME = "manifest.json"
SKELETON_NAME = "objects.json"
DCP_METADATA_NAME = ".metadata"
FORMAT = "recopt-checkpoint"
FORMAT_VERSION = 1
_CHUNK = 8 << 20


def rank_file_name(rank: int) -> str:
    """The per-rank JSON file (RNG states) of ``rank``."""
    return f"rank_{rank}.json"


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a checkpoint: its size in bytes and CRC-32 (8 hex digits)."""

    size: int
    crc32: str


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a checkpoint: global shape and dtype name (``float32``)."""

    shape: list[int]
    dtype: str


@dataclass(kw_only=True, slots=True)
class Manifest:
    """Everything a reader needs to check a checkpoint before loading it.

    Args:
        world_size: ranks that wrote the checkpoint.
        step: the training step, if the writer gave one.
        plan: the sharding plan's JSON (``ShardingPlan.to_json``), if any.
        files: relative file name -> `FileEntry`, for every file but the manifest.
        tensors: flat state key -> `TensorEntry`.
        finite: every floating-point tensor was free of NaN and inf when saved (None: not
            recorded, a checkpoint of an older recopt).
        recopt_version: writer's recopt version.
        torch_version: writer's torch version.
    """

    world_size: int
    step: int | None = None
    plan: str | None = None
    files: dict[str, FileEntry] = field(default_factory=dict)
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    finite: bool | None = None
    recopt_version: str = recopt.__version__
    torch_version: str = torch.__version__

    def to_json(self) -> str:
        """Serialize with a CRC-32 over the body, so a damaged manifest is detected too."""
        body = {"format": FORMAT, "version": FORMAT_VERSION, **asdict(self)}
        text = json.dumps(body, sort_keys=True)
        return json.dumps({"body": body, "crc32": _crc_hex(text.encode())}, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST_NAME) -> Manifest:
        """Parse and check `to_json` output.

        Raises:
            CheckpointError: not JSON, wrong format or version, or its checksum does not match.
        """
        try:
            doc = json.loads(text)
            body = doc["body"]
            expected = doc["crc32"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{where} is truncated or not a recopt manifest ({e}); the checkpoint is "
                "incomplete or damaged: use an older one"
            ) from e
        actual = _crc_hex(json.dumps(body, sort_keys=True).encode())
        if actual != expected:
            raise CheckpointError(
                f"{where} is corrupt: checksum {actual} but it records {expected}; use an "
                "older checkpoint"
            )
        if body.get("format") != FORMAT or body.get("version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{where}: format {body.get('format')!r} version {body.get('version')!r}; this "
                f"recopt reads {FORMAT!r} version {FORMAT_VERSION}"
            )
        try:
            manifest = cls(
                world_size=body["world_size"],
                step=body["step"],
                plan=body["plan"],
                files={k: FileEntry(**v) for k, v in body["files"].items()},
                tensors={k: TensorEntry(**v) for k, v in body["tensors"].items()},
                finite=body.get("finite"),
                recopt_version=body["recopt_version"],
                torch_version=body["torch_version"],
            )
            _check_fields(manifest, where)
            check_sizes(manifest, where)
            for name in manifest.files:
                plain_file_name(name, where)
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{where} is malformed ({type(e).__name__}: {e})") from e
        return manifest

    def write(self, directory: Path) -> None:
        """Write ``manifest.json`` into ``directory`` and flush it to disk."""
        write_durably(directory / MANIFEST_NAME, self.to_json().encode())


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fields(manifest: Manifest, where: str) -> None:
    """The manifest's scalar fields and file entries have the types recopt writes.

    Raises:
        CheckpointError: naming the first field of a wrong type or value.
    """
    checks = [
        ("world_size", _is_int(manifest.world_size) and manifest.world_size >= 1),
        ("step", manifest.step is None or _is_int(manifest.step)),
        ("plan", manifest.plan is None or isinstance(manifest.plan, str)),
        ("finite", manifest.finite is None or isinstance(manifest.finite, bool)),
        ("recopt_version", isinstance(manifest.recopt_version, str)),
        ("torch_version", isinstance(manifest.torch_version, str)),
    ]
    checks += [
        (f"files[{name!r}]", _is_int(e.size) and e.size >= 0 and isinstance(e.crc32, str))
        for name, e in manifest.files.items()
    ]
    for field_name, ok in checks:
        if not ok:
            value = getattr(manifest, field_name, None) if "[" not in field_name else "entry"
            raise CheckpointError(
                f"{where}: field {field_name} ({value!r}) is not of the type recopt writes; "
                "the manifest is forged or damaged: use another checkpoint"
            )


def tensor_bytes(entry: TensorEntry) -> int:
    """Bytes of one tensor of the manifest (its global shape times its element size)."""
    numel = 1
    for size in entry.shape:
        numel *= size
    return numel * getattr(torch, entry.dtype).itemsize


def check_sizes(manifest: Manifest, where: str = MANIFEST_NAME) -> None:
    """Check the manifest's tensors against its files before anything is allocated for them.

    Every tensor is stored once in the ``.distcp`` data files, so the tensors' bytes cannot
    exceed those files' sizes (themselves checked against the disk before loading): a forged
    shape asking for terabytes fails here, fast.

    Raises:
        CheckpointError: a malformed shape or dtype, or more tensor bytes than data bytes.
    """
    problems, total = [], 0
    for key, entry in manifest.tensors.items():
        shape_ok = isinstance(entry.shape, list) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in entry.shape
        )
        dtype_ok = isinstance(entry.dtype, str) and isinstance(
            getattr(torch, entry.dtype, None), torch.dtype
        )
        if not (shape_ok and dtype_ok):
            problems.append(f"{key}: invalid shape {entry.shape!r} or dtype {entry.dtype!r}")
            continue
        total += tensor_bytes(entry)
    data = sum(e.size for name, e in manifest.files.items() if name.endswith(".distcp"))
    if not problems and total > data:
        problems.append(f"its tensors need {total} bytes but its data files hold only {data} bytes")
    if problems:
        raise CheckpointError(
            f"{where} is inconsistent (forged or damaged): " + "; ".join(problems[:5])
        )


def plain_file_name(name: object, where: str) -> str:
    """``name`` if it is a plain file name (a checkpoint is one flat folder), else raise.

    Raises:
        CheckpointError: ``name`` is not a str, is empty, ``.``/``..``, absolute, or holds a
            path separator or NUL (it would name a file outside the checkpoint folder).
    """
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or any(c in name for c in "/\\\0")
        or os.path.isabs(name)
    ):
        raise CheckpointError(
            f"{where} names the file {name!r}, which is not a plain file name inside the "
            "checkpoint folder; refusing to read it (the checkpoint was forged or damaged)"
        )
    return name


def checkpoint_file(directory: Path, name: object, where: str) -> Path:
    """The file ``name`` of the checkpoint ``directory``, refused if it leaves the directory.

    The name must be plain (`plain_file_name`), and the path it resolves to (symbolic links
    followed) must still lie directly in ``directory`` (itself resolved).

    Raises:
        CheckpointError: naming the file, where it leads, and ``where`` it was named.
    """
    file = directory / plain_file_name(name, where)
    target = file.resolve()
    if target.parent != directory.resolve():
        raise CheckpointError(
            f"{file} (named in {where}) leads to {target}, outside the checkpoint folder "
            f"{directory}; refusing to read it (replace the link with the file itself)"
        )
    return file


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and check the manifest of the checkpoint directory ``path``.

    Raises:
        CheckpointError: no checkpoint there, or its manifest is damaged.
    """
    file = Path(path) / MANIFEST_NAME
    try:
        if file.is_symlink():
            checkpoint_file(Path(path), MANIFEST_NAME, str(path))
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise CheckpointError(_no_manifest(Path(path), file)) from e
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file} is corrupt (not UTF-8): {e}") from e
    return Manifest.from_json(text, str(file))


def _no_manifest(path: Path, file: Path) -> str:
    """Why ``path`` has no manifest: a folder of checkpoints (listed), or no checkpoint."""
    folders = sorted(p.parent.name for p in path.glob(f"*/{MANIFEST_NAME}"))
    if folders:
        older = f" (and {len(folders) - 5} older)" if len(folders) > 5 else ""
        shown = ", ".join(folders[-5:]) + older
        return (
            f"{path} is a folder of checkpoints, not one checkpoint: it holds {shown}; give "
            f"one of them, e.g. {path / folders[-1]} (the newest by name)"
        )
    if not path.is_dir():
        return f"{path} does not exist or is not a directory: give a recopt checkpoint directory"
    return (
        f"{file} does not exist: {path} is not a complete recopt checkpoint (an "
        "interrupted save leaves only a '.partial' directory)"
    )


def _crc_hex(data: bytes | memoryview) -> str:
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def file_entry(path: Path) -> FileEntry:
    """Size and CRC-32 of one file, read in 8 MiB chunks."""
    crc = 0
    size = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return FileEntry(size=size, crc32=f"{crc & 0xFFFFFFFF:08x}")


def verify_files(directory: Path, manifest: Manifest, names: Iterable[str]) -> list[str]:
    """Check the named files of ``manifest`` against the disk.

    Returns:
        One human-readable problem per bad file (missing, wrong size, wrong checksum).
    """
    problems = []
    for name in names:
        expected = manifest.files[name]
        try:
            file = checkpoint_file(directory, name, str(directory / MANIFEST_NAME))
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if not file.is_file():
            problems.append(f"{file}: missing (expected {expected.size} bytes)")
            continue
        actual_size = file.stat().st_size
        if actual_size != expected.size:
            what = "truncated" if actual_size < expected.size else "wrong size"
            problems.append(f"{file}: {what}: {actual_size} bytes, expected {expected.size}")
            continue
        actual = file_entry(file)
        if actual.crc32 != expected.crc32:
            problems.append(f"{file}: corrupt: crc32 {actual.crc32}, expected {expected.crc32}")
    return problems


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it, so a crash cannot leave a half-written file."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (a rename or a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _SummingFile(io.RawIOBase):
    """A write-only file that keeps the CRC-32 and size of everything written through it."""

    def __init__(self, file: io.BufferedWriter) -> None:
        super().__init__()
        self._file = file
        self.crc = 0
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = self._file.write(data)
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view[:n], self.crc)
        self.size += n
        return n

    def tell(self) -> int:
        return self._file.tell()

    def fileno(self) -> int:
        return self._file.fileno()

    def flush(self) -> None:
        self._file.flush()


class SummingFileSystem(FileSystem):
    """DCP's local file system, summing every file as it is written (no read-back pass).

    ``sums`` maps each written file's name to its `FileEntry`. DCP only appends to its
    streams (``torch.save`` writes archives front to back), so the running CRC is the file's.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, FileEntry] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, "wb") as file:
            summing = _SummingFile(file)
            yield summing
            file.flush()
            self.sums[Path(path).name] = FileEntry(
                size=summing.size, crc32=f"{summing.crc & 0xFFFFFFFF:08x}"
            )
