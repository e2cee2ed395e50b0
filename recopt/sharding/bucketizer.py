"""Routing of every id to the shards that hold its row: the first step of input distribution.

A shard of feature f's table is a rectangle (rows [r0, r1), columns [c0, c1)) on a rank. Each
rank sees the same list of *virtual features* (f, shard) per destination; an id of f goes to
every virtual feature whose row range holds it, as the local id ``id - r0``, keeping its bag.
Bucketization is vectorised (one searchsorted when a table is row-split, one stable sort) and
reads nothing back; on CPU a native pass (`recopt/kernels/cpu_bucketize.c`) gives the same
output. `input_dist` exchanges what it produces. An id-mapped table's raw ids go
to the row shard `route_shard` names (a hash of the id, not its value), unchanged: the owner
maps them to rows of its shard after the exchange (`id_map_sharded`).
Legend: F features, B this rank's batch, N ids, G virtual features of every destination
together, W world size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from recopt.kernels import cpu_bucketize
from recopt.modules.id_map_rows import route_shard
from recopt.sparse import KeyedJaggedTensor

Tensor = torch.Tensor

# Columns of the count exchange: this rank's batch size, whether its input was rejected, then
# the ids it sends to each of the destination's virtual features (padded to the most any rank
# has), then the ids of each data-parallel feature. Every size of the step after it (splits,
# each kernel's ids, each kernel's feature bounds) follows from this table on the host.
BATCH_COLUMN, FLAG_COLUMN, IDS_COLUMN = range(3)


@dataclass(frozen=True, slots=True)
class VirtualFeature:
    """One feature looked up on one shard: what a destination rank's kernel sees as a feature."""

    feature: int  # index in the collection's feature layout
    table: int
    shard: int  # index in the table's ParameterSharding.shards
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int


class Bucketizer:
    """Static routing of every feature's ids to the virtual features of every rank.

    Args:
        num_rows: the row count of each feature's table (layout order).
        dest_features: per destination rank, its virtual features in its kernels' order.
        dp_features: the layout indices of the data-parallel features, in kernel order.
        device: where the routing tensors live.
        hashed: per feature, whether its table is id-mapped (its raw ids routed by
            `route_shard`, sent as they are); None: none is.
    """

    native = True  # row-split layouts on CPU: the native routing (cpu_bucketize) when built

    def __init__(
        self,
        num_rows: Sequence[int],
        dest_features: Sequence[Sequence[VirtualFeature]],
        dp_features: Sequence[int],
        device: torch.device,
        hashed: Sequence[bool] | None = None,
    ) -> None:
        self.world_size = len(dest_features)
        self.device = device
        self.num_features = len(num_rows)
        self.dest_counts = [len(v) for v in dest_features]
        self.dp_features = list(dp_features)
        flat = [vf for vfs in dest_features for vf in vfs]
        # Row blocks of each feature: the distinct row ranges of its table's shards.
        blocks: list[list[int]] = [[0] for _ in num_rows]
        for vf in flat:
            if vf.row_offset not in blocks[vf.feature]:
                blocks[vf.feature].append(vf.row_offset)
        for b in blocks:
            b.sort()
        block_base = [0]
        for b in blocks:
            block_base.append(block_base[-1] + len(b))
        routes: list[list[int]] = [[] for _ in range(block_base[-1])]
        for gv, vf in enumerate(flat):
            routes[block_base[vf.feature] + blocks[vf.feature].index(vf.row_offset)].append(gv)
        feat_base = [0]
        for n in num_rows:
            feat_base.append(feat_base[-1] + n)
        hashed = list(hashed) if hashed is not None else [False] * len(num_rows)
        self.hashed = any(hashed)
        self._hash_routes(flat, hashed, blocks, block_base)
        self.single_block = all(len(b) == 1 for b in blocks)
        self.replicated = any(len(r) > 1 for r in routes)
        self.has_unrouted = any(not r for r in routes)
        self.num_virtual = len(flat)
        # No table is row-split: every virtual feature takes a whole feature's segment (column
        # shards repeat it), so routing copies segments and needs no per-id work.
        self.whole_features = self.single_block
        self.gv_feature_list = [vf.feature for vf in flat]
        self.row_split = self._pure_row_split(blocks, routes, block_base)
        self.split_bounds = [
            torch.tensor([*b, num_rows[f]], dtype=torch.int64, device=device)
            for f, b in enumerate(blocks)
        ]
        self.split_sizes = torch.tensor(
            [-(-n // self.world_size) for n in num_rows], dtype=torch.int64, device=device
        )

        def t(x: list[int]) -> Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        self.feat_base = t(feat_base[:-1])
        self.feature_blocks = t(block_base)  # feature f's blocks: [f] .. [f + 1] - 1
        self.block_bounds = t([feat_base[f] + r for f, b in enumerate(blocks) for r in b])
        # (a raw id keeps its value: its owner maps it to a row)
        self.block_row_offset = t([0 if hashed[f] else r for f, b in enumerate(blocks) for r in b])
        self.route_count = t([len(r) for r in routes])
        self.route_start = t([sum(len(r) for r in routes[:i]) for i in range(len(routes))])
        self.route_gv = t([gv for r in routes for gv in r])
        self.gv_feature = t(self.gv_feature_list)
        # The count exchange's table: where each virtual feature's id count goes in it.
        self.dp_column = IDS_COLUMN + max(self.dest_counts, default=0)
        self.num_columns = self.dp_column + len(self.dp_features)
        slots = [
            d * self.num_columns + IDS_COLUMN + j
            for d, n in enumerate(self.dest_counts)
            for j in range(n)
        ]
        self.count_slot = t(slots)
        self.max_routes = max((len(r) for r in routes), default=0)
        self._native_tables = self._routing_tables()

    def _routing_tables(self) -> dict[str, Tensor]:
        """What the native routing reads (`_bucketize_native`, `cpu_bucketize.bucketize`)."""
        tables = {
            "feature_blocks": self.feature_blocks,
            "block_bounds": self.block_bounds,
            "feat_base": self.feat_base,
            "block_row_offset": self.block_row_offset,
            "route_count": self.route_count,
            "route_start": self.route_start,
            "route_gv": self.route_gv,
        }
        if self.hashed:
            tables.update(
                feature_hashed=self.feature_hashed.to(torch.uint8),
                hash_shards=self.hash_shards,
                hash_base=self.hash_base,
                hash_block=self.hash_block,
            )
        return tables

    def _hash_routes(
        self,
        flat: Sequence[VirtualFeature],
        hashed: Sequence[bool],
        blocks: Sequence[Sequence[int]],
        block_base: Sequence[int],
    ) -> None:
        """Where an id-mapped feature's raw id goes: shard k (`route_shard`) of its table is
        the block ``hash_block[hash_base[f] + k]`` (of ``hash_shards[f]``)."""
        shard_block: dict[tuple[int, int], int] = {}
        shard_start: dict[tuple[int, int], int] = {}
        for vf in flat:
            if hashed[vf.feature]:
                at = block_base[vf.feature] + blocks[vf.feature].index(vf.row_offset)
                shard_block[(vf.feature, vf.shard)] = at
                shard_start[(vf.feature, vf.shard)] = vf.row_offset
        features = range(len(hashed))
        shards = [1 + max((k for g, k in shard_block if g == f), default=0) for f in features]
        blocks_at = [shard_block.get((f, k), 0) for f in features for k in range(shards[f])]

        def t(x: list[int]) -> Tensor:
            return torch.tensor(x, dtype=torch.int64, device=self.device)

        self.feature_hashed = torch.tensor(list(hashed), dtype=torch.bool, device=self.device)
        self.hash_shards = t(shards)
        self.hash_base = t([sum(shards[:f]) for f in features])
        self.hash_block = t(blocks_at)
        # (a row in the shard's block: what fbgemm's bucketization routes in the id's place)
        self.hash_key = t([shard_start.get((f, k), 0) for f in features for k in range(shards[f])])
        self.all_hashed = all(hashed)

    def _pure_row_split(
        self, blocks: list[list[int]], routes: list[list[int]], block_base: list[int]
    ) -> bool:
        """Whether every feature is split into one row range per rank, rank order, and every
        rank's virtual features are all the features in order: fbgemm's block bucketization
        then produces exactly our layout in one native pass."""
        world, num_features = self.world_size, self.num_features
        if self.replicated or self.has_unrouted or self.dest_counts != [num_features] * world:
            return False
        for f, b in enumerate(blocks):
            if len(b) != world:
                return False
            for d in range(world):
                if routes[block_base[f] + d] != [d * num_features + f]:
                    return False
        return _block_bucketize_op() is not None

    def bucketize(self, features: KeyedJaggedTensor) -> tuple[Tensor, Tensor | None, Tensor]:
        """Sort this rank's model-parallel ids into destination / virtual-feature order.

        Reads nothing back: how many ids go where stays on the device (``lengths_G_B``'s row
        sums) until the count exchange reads it together with what the other ranks send.

        Args:
            features: the prepared input (layout order, ids in range).

        Returns:
            ``(ids_N, weights_N, lengths_G_B)``: the routed local ids (and weights) grouped by
            virtual feature, bags in order, and every virtual feature's bag lengths over this
            rank's batch.
        """
        if self.whole_features:
            return self._bucketize_whole(features)
        routed = self._bucketize_native(features)
        if routed is not None:
            return routed
        if self.row_split and features.stride() > 0:
            return self._bucketize_rows(features)
        values, lengths = features.values(), features.lengths()
        weights = features.weights_or_none()
        batch = features.stride()
        n = values.numel()
        if n == 0 or self.num_virtual == 0:
            no_w = None if weights is None else weights[:0]
            lengths_G_B = values.new_zeros(self.num_virtual, batch)
            return values[:0], no_w, lengths_G_B
        bag_N = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=values.device), lengths, output_size=n
        )
        feature_N = bag_N // batch
        bag_N = bag_N - feature_N * batch
        if self.single_block:
            block_N = feature_N
        else:
            key_N = values + self.feat_base[feature_N]  # (a raw id's is replaced below)
            block_N = torch.searchsorted(self.block_bounds, key_N, right=True) - 1
        if self.hashed:
            hashed_block_N = self.hash_block[self._shard_at(values, feature_N)]
            block_N = torch.where(self.feature_hashed[feature_N], hashed_block_N, block_N)
        source_N: Tensor | None = None
        if self.replicated:
            count_N = self.route_count[block_N]
            source_N = torch.repeat_interleave(torch.arange(n, device=values.device), count_N)
            first_N = torch.cumsum(count_N, 0) - count_N
            pos = torch.arange(source_N.numel(), device=values.device) - first_N[source_N]
            block_N = block_N[source_N]
            gv_N = self.route_gv[self.route_start[block_N] + pos]
        else:
            if self.has_unrouted:
                source_N = torch.nonzero(self.route_count[block_N] > 0).squeeze(1)
                block_N = block_N[source_N]
            gv_N = self.route_gv[self.route_start[block_N]]
        ids_N = values if source_N is None else values[source_N]
        ids_N = ids_N - self.block_row_offset[block_N]
        if source_N is not None:
            bag_N = bag_N[source_N]
            weights = None if weights is None else weights[source_N]
        size = self.num_virtual * batch
        # index_add_, not bincount: CUDA's bincount reads the largest key back to size its output.
        lengths_G_B = gv_N.new_zeros(size).index_add_(
            0, gv_N * batch + bag_N, torch.ones_like(gv_N)
        )
        lengths_G_B = lengths_G_B.view(self.num_virtual, batch)  # batch may be 0
        gv_N, order = torch.sort(gv_N, stable=True)
        return ids_N[order], None if weights is None else weights[order], lengths_G_B

    def _bucketize_native(
        self, features: KeyedJaggedTensor
    ) -> tuple[Tensor, Tensor | None, Tensor] | None:
        """The native routing (`cpu_bucketize`, the torch ops' output bit for bit, in two passes
        over the ids): on CPU, int64 ids, float32 weights or none, every feature's bags as many
        (``stride``), their lengths summing to the ids (checked by the native call), and the
        library built; else None."""
        values, weights = features.values(), features.weights_or_none()
        lengths, batch = features.lengths(), features.stride()
        if (
            not Bucketizer.native
            or self.device.type != "cpu"
            or values.device.type != "cpu"
            or values.dtype != torch.int64
            or (weights is not None and weights.dtype != torch.float32)
            or lengths.numel() != self.num_features * batch
            or not cpu_bucketize.available()
        ):
            return None
        return cpu_bucketize.bucketize(  # (None where the lengths do not sum to the ids)
            lengths.to(torch.int64).contiguous(),
            values.contiguous(),
            None if weights is None else weights.contiguous(),
            batch,
            self._native_tables,
            self.num_virtual,
            self.max_routes,
        )

    def _bucketize_rows(self, features: KeyedJaggedTensor) -> tuple[Tensor, Tensor | None, Tensor]:
        """Row-wise layouts: fbgemm's block bucketization, one native pass over the ids. An
        id-mapped feature's raw id goes in as a row of its shard's block, and is written back
        over it where the pass put it (its ``unbucketize_permute``)."""
        op = _block_bucketize_op()
        assert op is not None
        values = features.values()
        keys, hashed_N = self._hash_keys(features) if self.hashed else (values, None)
        lengths, ids, weights, _, permute = op(
            features.lengths(),
            keys,
            False,
            self.hashed,
            self.split_sizes,
            self.world_size,
            features.weights_or_none(),
            None,
            -1,
            self.split_bounds,
        )
        if self.hashed:
            assert permute is not None
            source = values  # every feature id-mapped: every id as it came
            if hashed_N is not None:  # the others' as the pass made them (no mask: no sync)
                source = torch.where(hashed_N, values, ids.index_select(0, permute))
            ids = torch.empty_like(ids).index_copy_(0, permute, source)
        lengths_G_B = lengths.view(self.num_virtual, features.stride())
        return ids, weights, lengths_G_B

    def _hash_keys(self, features: KeyedJaggedTensor) -> tuple[Tensor, Tensor | None]:
        """Each id's routing value: an id-mapped feature's, a row of the block of the shard
        `route_shard` names; the others', the id. And which ids are id-mapped (None: all)."""
        values = features.values()
        per_key = torch.tensor(features.length_per_key(), dtype=torch.int64)
        feature_N = torch.repeat_interleave(
            torch.arange(self.num_features, device=values.device),
            per_key.to(values.device, non_blocking=True),
            output_size=values.numel(),
        )
        key_N = self.hash_key[self._shard_at(values, feature_N)]
        if self.all_hashed:
            return key_N, None
        hashed_N = self.feature_hashed[feature_N]
        return torch.where(hashed_N, key_N, values), hashed_N

    def _shard_at(self, values: Tensor, feature_N: Tensor) -> Tensor:
        """Each id's place in the ``hash_*`` tables: its feature's first, plus the shard
        `route_shard` names for it (meaningful for id-mapped features only)."""
        return self.hash_base[feature_N] + route_shard(values, self.hash_shards[feature_N])

    def _bucketize_whole(self, features: KeyedJaggedTensor) -> tuple[Tensor, Tensor | None, Tensor]:
        """No row split (table-wise, column-wise, data-parallel): each virtual feature gets its
        feature's whole segment, so routing copies segments and does no per-id work."""
        values, weights = features.values(), features.weights_or_none()
        opk = features.offset_per_key()
        order = self.gv_feature_list
        ids = torch.cat([values[opk[f] : opk[f + 1]] for f in order]) if order else values[:0]
        w = None
        if weights is not None:
            w = torch.cat([weights[opk[f] : opk[f + 1]] for f in order]) if order else weights[:0]
        batch = features.stride()
        lengths_G_B = features.lengths().view(len(features.keys()), batch)[self.gv_feature]
        return ids, w, lengths_G_B


def _block_bucketize_op() -> Any:
    """fbgemm's ``block_bucketize_sparse_features`` if fbgemm is installed, else ``None``."""
    try:
        import fbgemm_gpu  # noqa: F401  (registers the torch.ops.fbgemm operators)

        return torch.ops.fbgemm.block_bucketize_sparse_features
    except (ImportError, AttributeError, RuntimeError):
        return None
