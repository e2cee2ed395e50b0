"""Atomic, verified checkpoint save and load on ``torch.distributed.checkpoint`` (DCP).

`save` writes into ``.<name>.partial`` next to the target, and rank 0 renames it into place only
after every rank finished and the manifest is on disk, so a crash never leaves a half checkpoint
under the real name. `load` checks checksums and keys on all ranks before DCP copies any byte,
then lets DCP reshard: any plan and world size can read a checkpoint of any other.
"""

from __future__ import annotations

import datetime
import json
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from recopt import comm
from recopt.checkpoint.guards import Backup, all_finite, write_failure
from recopt.checkpoint.load_steps import (
    Optimizers,
    apply_trees,
    compare_names,
    compare_tensors,
    decode_trees,
    empty_tensor,
    init_optimizer_state,
)
from recopt.checkpoint.manifest import (
    DCP_METADATA_NAME,
    SKELETON_NAME,
    FileEntry,
    Manifest,
    SummingFileSystem,
    TensorEntry,
    file_entry,
    fsync_dir,
    rank_file_name,
    read_manifest,
    verify_files,
    write_durably,
)
from recopt.checkpoint.reader import SafeFileSystemReader
from recopt.checkpoint.state import (
    CheckpointError,
    Stateful,
    TensorLike,
    archive_crc_off,
    capture_rng,
    check_rank_state,
    check_skeleton,
    dtype_name,
    encode_tree,
    optimizer_state_dict,
    subtree,
)
from recopt.kernels.contract import flush_kernel_caches
from recopt.modules.id_map_lookup import rewind_ahead_steps

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


class _Group:
    """The ranks of one save or load: a gloo group whose every collective has ``timeout``."""

    def __init__(self, timeout: datetime.timedelta) -> None:
        self.pg: dist.ProcessGroup | None = None
        self.rank, self.world_size = 0, 1
        if dist.is_available() and dist.is_initialized():
            # A dedicated gloo group: object collectives work whatever the default backend, and
            # a dead rank surfaces as a timeout error here instead of a hang.
            self.pg = comm.new_group(None, timeout, backend="gloo")
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def all_gather(self, obj: Any) -> list[Any]:
        if self.pg is None:
            return [obj]
        return comm.all_gather_object(obj, self.pg)

    def agree(self, problems: list[str], what: str) -> None:
        """Raise the same `CheckpointError` on every rank if any rank found a problem."""
        every = [p for rank_problems in self.all_gather(problems) for p in rank_problems]
        if every:
            unique = list(dict.fromkeys(every))
            raise CheckpointError(f"{what}:\n  " + "\n  ".join(unique))


@contextmanager
def _ranks(timeout: datetime.timedelta) -> Iterator[_Group]:
    group = _Group(timeout)
    try:
        yield group
    finally:
        if group.pg is not None:
            dist.destroy_process_group(group.pg)


@contextmanager
def _dcp_quietly() -> Iterator[None]:
    # Without a process group DCP warns that it assumes one process, which is what we mean.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def _optimizer_tree(optimizer: Optimizers, model: torch.nn.Module) -> dict[str, Any]:
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer_state_dict(optimizer, model)
    return {name: optimizer_state_dict(opt, model) for name, opt in optimizer.items()}


def _extra_tree(extra: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in extra.items()}


def save(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: Optimizers | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    step: int | None = None,
    plan_json: str | None = None,
    overwrite: bool = False,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> Path:
    """Save a checkpoint atomically; call on every rank (or in one process without a group).

    Args:
        path: the checkpoint directory to create.
        model: its ``state_dict()`` is saved (ShardedTensors as shards, replicated tensors once).
        optimizer: an optimizer, or name -> optimizer; index-keyed state is saved by name.
        extra: name -> value. Objects with ``state_dict``/``load_state_dict`` (LR schedulers,
            data loaders, warmup) are saved by their state dict; other values (tensors,
            numbers, strings, lists, dicts) as they are. Rank 0's values are kept: give
            global positions, not per-rank ones.
        step: the training step, recorded in the manifest.
        plan_json: the sharding plan (``ShardingPlan.to_json()``), recorded in the manifest.
        overwrite: replace an existing checkpoint at ``path`` (after the new one is complete).
        timeout: limit for every collective of the save.

    Returns:
        ``path`` as a `Path`.

    Raises:
        CheckpointError: ``path`` exists and ``overwrite`` is false, or a value cannot be saved.
    """
    final = Path(path)
    partial = final.parent / f".{final.name}.partial"
    try:
        return _save(final, partial, model, optimizer, extra, step, plan_json, overwrite, timeout)
    except KeyboardInterrupt:  # (Ctrl-C, SIGINT): the half-written save goes, as a failed one
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _save(
    final: Path,
    partial: Path,
    model: torch.nn.Module,
    optimizer: Optimizers | None,
    extra: Mapping[str, Any] | None,
    step: int | None,
    plan_json: str | None,
    overwrite: bool,
    timeout: datetime.timedelta,
) -> Path:
    with _ranks(timeout) as group:
        tensors: dict[str, TensorLike] = {}
        skeleton, problems = _encode(model, optimizer, extra, tensors)
        if group.rank == 0 and not problems:
            problems += _prepare_partial(final, partial, overwrite)
        group.agree(problems, f"cannot save checkpoint {final}")
        metadata, mine, problems = _write_own(final, partial, tensors, group)
        gathered = group.all_gather((mine, problems, all_finite(tensors.values())))
        problems = [p for _, rank_problems, _ in gathered for p in rank_problems]
        if group.rank == 0 and not problems:
            entries = [rank_entries for rank_entries, _, _ in gathered]
            finite = all(rank_finite for _, _, rank_finite in gathered)
            try:
                _finish(final, partial, entries, skeleton, metadata, group, step, plan_json, finite)
            except (OSError, CheckpointError) as e:
                problems.append(write_failure(e, group.rank, final, partial, tensors))
        if problems and group.rank == 0:
            # Never leave a failed save's files behind: on a full disk they keep it full.
            shutil.rmtree(partial, ignore_errors=True)
        group.agree(problems, f"cannot complete checkpoint {final}")
    return final


def _encode(
    model: torch.nn.Module,
    optimizer: Optimizers | None,
    extra: Mapping[str, Any] | None,
    tensors: dict[str, TensorLike],
) -> tuple[Any, list[str]]:
    """Puts every tensor to save into ``tensors``; returns the skeleton, or a problem."""
    try:
        flush_kernel_caches(model)  # UVM-cached rows are saved as last updated
        tree: dict[str, Any] = {"model": model.state_dict()}
        if optimizer is not None:
            tree["optim"] = _optimizer_tree(optimizer, model)
        if extra:
            tree["extra"] = _extra_tree(extra)
        return encode_tree(tree, "", tensors), []
    except CheckpointError as e:
        return None, [str(e)]


def _write_own(
    final: Path, partial: Path, tensors: dict[str, TensorLike], group: _Group
) -> tuple[Any, dict[str, FileEntry], list[str]]:
    """DCP writes this rank's tensors into ``partial``; returns DCP's metadata, this rank's
    files (sizes and checksums), and the problem if the write failed."""
    writer = dcp.FileSystemWriter(partial)
    writer.fs = summing = SummingFileSystem()
    try:
        with _dcp_quietly(), archive_crc_off():
            metadata = dcp.save(
                tensors,
                storage_writer=writer,
                process_group=group.pg,
                no_dist=group.pg is None,
            )
        # Every rank sums its own files; a local failure is reported through the gather,
        # so the other ranks raise it too instead of waiting for a timeout.
        return metadata, _sum_own_files(partial, group.rank, summing.sums), []
    except (Exception, CheckpointException) as e:
        return None, {}, [write_failure(e, group.rank, final, partial, tensors)]


def _sum_own_files(partial: Path, rank: int, sums: dict[str, FileEntry]) -> dict[str, FileEntry]:
    """Write this rank's RNG file; size and CRC of it and of this rank's DCP data files
    (summed while DCP wrote them; read back only if DCP wrote one some other way)."""
    rank_file = partial / rank_file_name(rank)
    write_durably(rank_file, _json_bytes({"rank": rank, "rng": capture_rng()}))
    mine = {rank_file.name: file_entry(rank_file)}
    for f in sorted(partial.glob(f"__{rank}_*.distcp")):
        mine[f.name] = sums[f.name] if f.name in sums else file_entry(f)
    return mine


def _prepare_partial(final: Path, partial: Path, overwrite: bool) -> list[str]:
    if final.exists() and not overwrite:
        return [f"{final} exists; pass overwrite=True or save under another name"]
    try:
        # A '.partial' left by a crashed save is garbage by construction: never a good copy.
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    except OSError as e:
        return [f"cannot create {partial}: {e}"]
    return []


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value).encode()


def _finish(
    final: Path,
    partial: Path,
    entries: list[dict[str, FileEntry]],
    skeleton: Any,
    metadata: Any,
    group: _Group,
    step: int | None,
    plan_json: str | None,
    finite: bool,
) -> None:
    """Rank 0, after every rank wrote and summed its files: manifest, then rename into place."""
    write_durably(partial / SKELETON_NAME, _json_bytes(skeleton))
    files: dict[str, FileEntry] = {}
    for rank_entries in entries:
        files.update(rank_entries)
    for f in sorted(partial.iterdir()):
        if f.is_file() and f.name not in files:
            files[f.name] = file_entry(f)  # .metadata, objects.json, any unexpected DCP file
    tensors = {
        key: TensorEntry(shape=list(md.size), dtype=dtype_name(md.properties.dtype))
        for key, md in sorted(metadata.state_dict_metadata.items())
        if hasattr(md, "size")
    }
    Manifest(
        world_size=group.world_size,
        step=step,
        plan=plan_json,
        files=files,
        tensors=tensors,
        finite=finite,
    ).write(partial)
    fsync_dir(partial)
    old = final.parent / f".{final.name}.old"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    partial.rename(final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def load(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: Optimizers | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    restore_rng_state: bool = True,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (and ``optimizer``) under any plan and world size.

    Every file's size and checksum and every key's shape are checked on all ranks first; on
    any problem all ranks raise and nothing has been copied. A tensor saved in another float
    dtype (fp32, fp16, bf16: a table's ``weight_dtype`` or ``state_dtype`` changed) is
    converted to the model's dtype, rounded to nearest, with a ``UserWarning`` listing them.

    Args:
        path: a directory written by `save`.
        model: receives the weights (ShardedTensors are filled with their own shards).
        optimizer: as given to `save` (an optimizer, or the same name -> optimizer mapping);
            ``None`` loads weights only.
        extra: objects with ``load_state_dict`` among the saved extras are restored in place.
        restore_rng_state: set python/numpy/torch generators to those this rank saved (only
            ranks that existed when saving; others keep theirs).
        timeout: limit for every collective of the load.

    Returns:
        The saved extras by name (stateful ones as their state dicts).

    Raises:
        CheckpointError: the checkpoint is incomplete, damaged or for another model.
    """
    directory = Path(path)
    extra = extra or {}
    # A pipeline's id-map steps taken ahead are undone first: the maps' state_dict entries
    # are then their live buffers (else copies, which the backup below would restore).
    rewind_ahead_steps(model)
    with _ranks(timeout) as group:
        manifest, skeleton, rank_state = _verify(directory, group)
        live_tensors, targets = _match_live(
            directory, group, manifest, skeleton, model, optimizer, extra
        )
        # Everything is decoded and checked before a byte reaches live state; the live tensors
        # are copied aside so that a failure inside DCP or a load_state_dict can be undone.
        undo: list[Callable[[], None]] = []
        backup: Backup | None = None
        try:
            decoded = decode_trees(skeleton, targets, model, optimizer)
            backup = Backup(live_tensors)
            with _dcp_quietly():
                dcp.load(
                    dict(targets),
                    storage_reader=SafeFileSystemReader(directory),
                    process_group=group.pg,
                    no_dist=group.pg is None,
                )
            saved = sum(name.startswith("rank_") for name in manifest.files)
            note = (
                f"rank {group.rank} of {group.world_size} now; the checkpoint (world size "
                f"{manifest.world_size}) holds the RNG states of the {saved} ranks that saved it "
                "(an offline reshard keeps the original ranks')"
            )
            return apply_trees(
                decoded, model, optimizer, extra, rank_state, restore_rng_state, undo, note
            )
        except (Exception, CheckpointException) as e:
            # Tensors first: the saved optimizer state dicts below refer to them.
            if backup is not None:
                backup.restore()
            for step in reversed(undo):
                step()
            raise CheckpointError(
                f"cannot load checkpoint {directory}: {type(e).__name__}: {e}; nothing was "
                "changed (the model, optimizer, extras and RNG states are as before the load)"
            ) from e


def _match_live(
    directory: Path,
    group: _Group,
    manifest: Manifest,
    skeleton: Any,
    model: torch.nn.Module,
    optimizer: Optimizers | None,
    extra: Mapping[str, Any],
) -> tuple[dict[str, TensorLike], dict[str, TensorLike]]:
    """Checks on all ranks that the checkpoint fits the live model, optimizer and extras.

    Returns:
        The live tensors by checkpoint key, and the tensors DCP reads into: the live ones,
        and fresh ones of the saved shape for saved tensors with no live counterpart
        (optimizer state torch creates lazily, extras).
    """
    if optimizer is not None and subtree(skeleton, "optim") is not None:
        init_optimizer_state(optimizer)
    # Cached rows written back and dropped: the loaded rows are what the next step reads.
    flush_kernel_caches(model)
    live: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        live["optim"] = _optimizer_tree(optimizer, model)
    problems, live_tensors = compare_tensors(manifest, skeleton, live, directory)
    problems += compare_names(skeleton, optimizer, extra)
    group.agree(problems, f"checkpoint {directory} does not fit this model")
    wanted = set(live) | {"extra"}
    targets: dict[str, TensorLike] = {
        key: live_tensors[key] if key in live_tensors else empty_tensor(entry)
        for key, entry in manifest.tensors.items()
        if key.split("/", 1)[0] in wanted
    }
    return live_tensors, targets


def _verify(directory: Path, group: _Group) -> tuple[Manifest, Any, dict[str, Any] | None]:
    """Check every file (split over ranks) and read the skeleton and this rank's state."""
    problems: list[str] = []
    manifest = None
    try:
        manifest = read_manifest(directory)
    except CheckpointError as e:
        problems.append(str(e))
    group.agree(problems, f"cannot load checkpoint {directory}")
    assert manifest is not None
    names = sorted(manifest.files)
    own = rank_file_name(group.rank)
    needed = {SKELETON_NAME, DCP_METADATA_NAME} | ({own} if own in manifest.files else set())
    missing = sorted({SKELETON_NAME, DCP_METADATA_NAME} - set(manifest.files))
    problems += [f"manifest lists no {name}" for name in missing]
    mine = set(names[group.rank :: group.world_size]) | (needed & set(names))
    problems += verify_files(directory, manifest, sorted(mine))
    group.agree(problems, f"checkpoint {directory} failed verification")
    skeleton = rank_state = None
    try:
        skeleton = _read_json(directory / SKELETON_NAME)
        check_skeleton(skeleton, str(directory / SKELETON_NAME))
        if own in manifest.files:
            rank_state = _read_json(directory / own)
            check_rank_state(rank_state, str(directory / own))
    except CheckpointError as e:
        problems.append(str(e))
    group.agree(problems, f"cannot load checkpoint {directory}")
    return manifest, skeleton, rank_state


def _read_json(file: Path) -> Any:
    """A JSON side file of a checkpoint (already verified against the manifest)."""
    try:
        return json.loads(file.read_bytes())
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError
        raise CheckpointError(f"{file} is not JSON ({e}); the checkpoint is damaged") from e
