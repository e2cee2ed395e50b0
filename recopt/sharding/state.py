"""Sharded weights and optimizer state as ShardedTensors whose local shards view kernel storage.

Keys and global shapes never depend on the plan: ``embedding_bags.<t>.weight`` ``[rows, dim]``
(``embeddings.<t>.weight`` for an embedding collection),
state ``<t>.<name>`` with the unsharded shapes (row-wise ``[rows]``, element-wise
``[rows, dim]``, Adafactor's ``col_var`` ``[dim]``, per-table scalars as plain 0-dim tensors
equal on every rank). Built without a collective: every rank knows the whole plan.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from recopt import comm
from recopt.kernels.contract import Kernel
from recopt.kernels.updates import ROUNDING_STEP, has_rounding_step, init_state
from recopt.modules.fused_groups import make_param_group
from recopt.optim.fused import FusedOptimizer
from recopt.sharding.layout import ShardedLayout

Tensor = torch.Tensor
# (offsets, sizes, rank, local tensor or None): one rectangle of a ShardedTensor.
Piece = tuple[list[int], list[int], int, Tensor | None]


@contextlib.contextmanager
def quiet_sharded_tensor() -> Iterator[None]:
    """Silence torch's ShardedTensor deprecation warning around recopt's own uses of it.

    recopt exposes sharded state as ShardedTensor on purpose (DCP reshards it); the warning is
    recopt's to handle, and must not reach users whatever their warning filters are.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*deprecating ShardedTensor.*", category=FutureWarning
        )
        yield


@quiet_sharded_tensor()
def make_sharded_tensor(
    pieces: Sequence[Piece],
    size: Sequence[int],
    rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> ShardedTensor:
    """A ShardedTensor from every rank's rectangles; this rank's are views (no copy, no collective).

    Args:
        pieces: all rectangles of the tensor, with this rank's local tensors.
        size: the global shape.
        rank: this rank (in ``group``).
        group: the process group.
        device: this rank's device (default: its pieces', else CPU). Other ranks' pieces are
            placed on the same device type (``cuda:<rank % device count>`` on GPUs).
        dtype: the tensor's dtype (default: its local pieces', else float32). Pass it when
            this rank may hold no piece: every rank must declare the same dtype.

    Returns:
        The ShardedTensor.
    """
    if device is None:
        device = next((p[3].device for p in pieces if p[3] is not None), torch.device("cpu"))
    if dtype is None:
        dtype = next((p[3].dtype for p in pieces if p[3] is not None), torch.float32)
    # Placements name global ranks (ShardedTensor's rule); ``pieces`` and ``rank`` are the
    # group's: they differ on a group that is not the whole world.
    world_rank = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    metas = [
        ShardMetadata(
            shard_offsets=list(o),
            shard_sizes=list(s),
            placement=_placement(world_rank(r), world_rank(rank), device),
        )
        for o, s, r, _ in pieces
    ]
    local = [
        Shard(tensor=t, metadata=m)
        for (_, _, r, t), m in zip(pieces, metas, strict=True)
        if r == rank and t is not None
    ]
    metadata = ShardedTensorMetadata(
        shards_metadata=metas,
        size=torch.Size(size),
        tensor_properties=TensorProperties(dtype=dtype),
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, metadata, process_group=group
    )


def _placement(owner: int, rank: int, device: torch.device) -> str:
    if owner == rank or device.type == "cpu":
        return f"rank:{owner}/{device}"
    return f"rank:{owner}/{device.type}:{owner % max(1, torch.cuda.device_count())}"


@quiet_sharded_tensor()
def full_tensor(value: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """The whole tensor on every rank: a ShardedTensor is summed from its shards (a collective).

    Args:
        value: a ShardedTensor or a plain tensor (returned as a copy).
        group: the ShardedTensor's process group.

    Returns:
        A dense tensor of the global shape.
    """
    if not isinstance(value, ShardedTensor):
        return value.detach().clone()
    local = value.local_shards()
    if local:
        device = local[0].tensor.device
    else:  # no shard here: the placement's device type (NCCL reduces device tensors)
        placement = value.metadata().shards_metadata[0].placement
        device = _own_device(placement.device() if placement is not None else None)
    full = torch.zeros(value.size(), dtype=value.dtype, device=device)
    for shard in local:
        index = tuple(
            slice(o, o + s)
            for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True)
        )
        full[index] = shard.tensor
    return comm.all_reduce(full, group)


def _own_device(placed: torch.device | None) -> torch.device:
    """This rank's device of the type a shard's placement names: the placement holds the
    owner's GPU (``cuda:<owner>``), and a collective must run on this rank's own."""
    if placed is None or placed.type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class ShardedFusedOptimizer(FusedOptimizer):
    """The fused optimizer of a sharded collection; the update runs in backward.

    After a load it restores the invariants ShardedTensors cannot express: replicas of row-wise
    state on every column shard, and per-table counters (``step``, ``rounding_step``) on every
    local shard. ``rounding_step`` is optional in a loaded state dict (absent: 0; present for a
    table that keeps none: dropped).
    """

    optional_state = (ROUNDING_STEP,)

    def __init__(
        self,
        params: Mapping[str, Any],
        state: Mapping[Any, Any],
        param_groups: Sequence[Mapping[str, Any]],
        after_load: Callable[[], None],
    ) -> None:
        super().__init__(params, state, param_groups)
        self._after_load = after_load

    def post_load_state_dict(self) -> None:
        """Write the loaded values into every replica."""
        self._after_load()

    # KeyedOptimizer's checks read ShardedTensor metadata, which warns; a CombinedOptimizer
    # holding this one calls both methods directly.
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """`KeyedOptimizer.load_state_dict`, without ShardedTensor's deprecation warning."""
        with quiet_sharded_tensor():
            super().load_state_dict(state_dict)

    def _check_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        with quiet_sharded_tensor():
            super()._check_state_dict(state_dict)


class ShardedState:
    """The weights and optimizer state of one rank of a sharded collection.

    Args:
        layout: the collection's layout.
        mp_kernels: this rank's model-parallel kernels (``layout.mp_groups`` order).
        dp_kernels: its data-parallel kernels (``layout.dp_groups`` order).
        group: the process group.
        device: where this rank's shards live.
    """

    def __init__(
        self,
        layout: ShardedLayout,
        mp_kernels: Sequence[Kernel],
        dp_kernels: Sequence[Kernel],
        group: dist.ProcessGroup | None,
        device: torch.device,
        param_prefix: str = "embedding_bags",
    ) -> None:
        self._layout = layout
        self._prefix = param_prefix
        self._group = group
        self._layout_device = device
        self._rank = layout.rank
        # (table, shard) -> (weight view, state views) of this rank's rectangles.
        self._local: dict[tuple[int, int], tuple[Tensor, dict[str, Tensor]]] = {}
        groups = [*layout.mp_groups, *layout.dp_groups]
        # For each user-facing param group, this rank's kernels that run its tables.
        self.group_kernels: list[list[Kernel]] = [[] for _ in layout.group_optimizers]
        for g, kernel in zip(groups, [*mp_kernels, *dp_kernels], strict=True):
            self.group_kernels[g.param_group].append(kernel)
            weights = kernel.split_embedding_weights()
            states = kernel.split_optimizer_states()
            for tk, w, s in zip(g.tables, weights, states, strict=True):
                self._local[tk] = (w, s)
        self._mirrors: dict[tuple[int, str], Tensor] = {}
        self.weights: dict[str, Tensor] = {}
        self._table_state: list[dict[str, Tensor]] = []
        for t, table in enumerate(layout.tables):
            self.weights[f"{param_prefix}.{table.name}.weight"] = self._weight(t)
            self._table_state.append(self._states(t))
        self.optimizer = self._build_optimizer()

    # ------------------------------------------------------------------ building
    def _shards(self, t: int) -> list[tuple[int, Any]]:
        if self._layout.is_data_parallel(t):
            return [(-1, None)]
        return list(enumerate(self._layout.shardings[t].shards))

    def _weight(self, t: int) -> Tensor:
        if self._layout.is_data_parallel(t):
            return self._local[(t, -1)][0]
        pieces: list[Piece] = []
        for k, s in self._shards(t):
            local = self._local.get((t, k))
            pieces.append(
                (
                    [s.row_offset, s.col_offset],
                    [s.num_rows, s.num_cols],
                    s.rank,
                    None if local is None else local[0],
                )
            )
        table = self._layout.tables[t]
        return make_sharded_tensor(
            pieces,
            [table.num_embeddings, table.embedding_dim],
            self._rank,
            self._group,
            self._device(),
            table.weight_dtype.dtype,
        )

    def _states(self, t: int) -> dict[str, Tensor]:
        table = self._layout.tables[t]
        rows, dim = table.num_embeddings, table.embedding_dim
        optimizer = self._layout.resolved[t]
        names = init_state(
            optimizer.name,
            1,
            1,
            torch.device("meta"),
            optimizer.state_dtype.dtype,
            rounding_step=has_rounding_step(optimizer, table.weight_dtype),
        )
        if self._layout.is_data_parallel(t):
            return dict(self._local[(t, -1)][1])
        out: dict[str, Tensor] = {}
        for name, proto in names.items():
            if proto.dim() == 0:
                out[name] = self._scalar(t, name, proto)
                continue
            pieces: list[Piece] = []
            for k, s in self._shards(t):
                local = self._local.get((t, k))
                view = None if local is None else local[1][name]
                if proto.dim() == 2:
                    pieces.append(
                        ([s.row_offset, s.col_offset], [s.num_rows, s.num_cols], s.rank, view)
                    )
                elif name == "col_var":
                    pieces.append(([s.col_offset], [s.num_cols], s.rank, view))
                elif s.col_offset == 0:  # row-wise state: the first column shard's copy
                    pieces.append(([s.row_offset], [s.num_rows], s.rank, view))
            size = [rows, dim] if proto.dim() == 2 else [dim if name == "col_var" else rows]
            out[name] = make_sharded_tensor(
                pieces, size, self._rank, self._group, self._device(), proto.dtype
            )
        return out

    def _scalar(self, t: int, name: str, proto: Tensor) -> Tensor:
        for k, _ in self._shards(t):
            if (t, k) in self._local:
                return self._local[(t, k)][1][name]
        # Not held here: a mirror advanced at every backward, as the holders' counters are.
        mirror = torch.zeros((), dtype=proto.dtype, device=self._device())
        self._mirrors[(t, name)] = mirror
        return mirror

    def _device(self) -> torch.device:
        return self._layout_device

    def _build_optimizer(self) -> ShardedFusedOptimizer:
        layout = self._layout
        params: dict[str, Tensor] = {}
        state: dict[Tensor, dict[str, Tensor]] = {}
        groups: list[dict[str, Any]] = []
        for i, opt in enumerate(layout.group_optimizers):
            groups.append(make_param_group(opt, [], self.group_kernels[i]))
        for t, table in enumerate(layout.tables):
            name = f"{self._prefix}.{table.name}.weight"
            param = self.weights[name]
            params[name] = param
            state[param] = {f"{table.name}.{k}": v for k, v in self._table_state[t].items()}
            groups[layout.table_group[t]]["params"].append(param)
        return ShardedFusedOptimizer(params, state, groups, self.after_load)

    # ------------------------------------------------------------------ runtime
    def on_backward(self) -> None:
        """Advance the mirrored counters (``step``, ``rounding_step``) of tables held elsewhere
        (their kernels advance theirs at every backward)."""
        for mirror in self._mirrors.values():
            mirror.add_(1)

    @quiet_sharded_tensor()
    def after_load(self) -> None:
        """Copy loaded values into every replica: other local shards' counters and the row-wise
        state of column shards (broadcast from the first column shard's rank)."""
        for t, states in enumerate(self._table_state):
            for name, value in states.items():
                if isinstance(value, ShardedTensor):
                    continue
                for k, _ in self._shards(t):
                    local = self._local.get((t, k))
                    if local is not None and local[1][name] is not value:
                        local[1][name].copy_(value)
        if any(ps.sharding_type.splits_columns for ps in self._layout.shardings):
            self._sync_row_replicas()

    def _sync_row_replicas(self) -> None:
        for t, ps in enumerate(self._layout.shardings):
            if not ps.sharding_type.splits_columns:
                continue
            first = next(s for s in ps.shards if s.col_offset == 0)
            rows = self._layout.tables[t].num_embeddings
            for name, value in self._table_state[t].items():
                if not isinstance(value, ShardedTensor) or value.dim() != 1:
                    continue
                if value.size(0) != rows or name == "col_var":
                    continue
                src_k = ps.shards.index(first)
                local = self._local.get((t, src_k))
                buf = (
                    local[1][name].clone()
                    if local is not None
                    else torch.empty(rows, dtype=value.dtype, device=self._device())
                )
                if dist.get_world_size(self._group) > 1:
                    src = first.rank
                    if self._group is not None:
                        src = dist.get_global_rank(self._group, first.rank)
                    comm.broadcast(buf, src, self._group)
                for k, _ in self._shards(t):
                    mine = self._local.get((t, k))
                    if mine is not None:
                        mine[1][name].copy_(buf)

    @quiet_sharded_tensor()
    def load_weight(self, name: str, value: Any) -> None:
        """Copy a full tensor's rectangles, or a ShardedTensor's overlapping local shards.

        Raises:
            ValueError: the global shape differs, naming the key.
        """
        current = self.weights[name]
        if tuple(value.shape if not isinstance(value, ShardedTensor) else value.size()) != tuple(
            current.size()
        ):
            raise ValueError(
                f"{name}: shape {tuple(value.size())} in the state_dict does not match the "
                f"table's {tuple(current.size())}"
            )
        with torch.no_grad():
            if not isinstance(current, ShardedTensor):
                current.copy_(full_local(value))
                return
            for shard in current.local_shards():
                _copy_overlaps(shard, value)


@quiet_sharded_tensor()
def full_local(value: Any) -> Tensor:
    """A plain tensor's data (a ShardedTensor with one local shard covering it all)."""
    if isinstance(value, ShardedTensor):
        shards = value.local_shards()
        if len(shards) == 1 and list(shards[0].tensor.shape) == list(value.size()):
            return shards[0].tensor
        raise ValueError(
            "a replicated (data-parallel) table needs the whole tensor on every rank; got a "
            "ShardedTensor without a full local shard"
        )
    return value


def _copy_overlaps(shard: Shard, value: Any) -> None:
    """Copy into ``shard`` every part of ``value`` (full tensor or local shards) overlapping it."""
    off = shard.metadata.shard_offsets
    size = shard.metadata.shard_sizes
    if not isinstance(value, ShardedTensor):
        index = tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))
        shard.tensor.copy_(value[index])
        return
    for src in value.local_shards():
        s_off, s_size = src.metadata.shard_offsets, src.metadata.shard_sizes
        lo = [max(a, b) for a, b in zip(off, s_off, strict=True)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(off, size, s_off, s_size, strict=True)]
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            continue
        dst = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, off, strict=True))
        sel = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, s_off, strict=True))
        shard.tensor[dst].copy_(src.tensor[sel])
