"""Input distribution: route every id to the shards that hold its row, in two all-to-alls.

A shard of feature f's table is a rectangle (rows [r0, r1), columns [c0, c1)) on a rank. Each
rank sees the same list of *virtual features* (f, shard) per destination; an id of f goes to
every virtual feature whose row range holds it, as the local id ``id - r0``, keeping its bag.
Bucketization is vectorised (one searchsorted when a table is row-split, one stable sort).
Legend: F features, B this rank's batch, Bm the largest batch of any rank, N ids, G virtual
features of every destination together, W world size.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from recopt.comm import start_all_to_all_counts, start_all_to_all_flat, wait
from recopt.modules.inputs import PendingCheck
from recopt.sparse import KeyedJaggedTensor

Tensor = torch.Tensor

# Columns of the count exchange: this rank's batch size, whether its input was rejected, then
# the ids it sends to each of the destination's virtual features (padded to the most any rank
# has), then the ids of each data-parallel feature. Every size of the step after it (splits,
# each kernel's ids, each kernel's feature bounds) follows from this table on the host.
_BATCH, _FLAG, _IDS = range(3)
DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)


class RemoteInputError(ValueError):
    """Another rank's input was rejected, so this step was abandoned on every rank."""


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


@dataclass(slots=True)
class ReceivedInput:
    """What one rank received for one step, per source rank (all tensors 1-D).

    ``mp_id_counts[s][v]`` (host ints) is how many ids source ``s`` sent for this rank's
    virtual feature ``v``; ``dp_id_counts[s][f]`` the same for data-parallel feature ``f``.
    """

    batch_sizes: list[int]
    max_batch: int
    mp_lengths: list[Tensor]  # per source: [n_vf * Bm]
    mp_ids: list[Tensor]
    mp_weights: list[Tensor | None]
    dp_lengths: list[Tensor]  # per source: [F_dp * Bm]
    dp_ids: list[Tensor]
    dp_weights: list[Tensor | None]
    mp_id_counts: list[list[int]]
    dp_id_counts: list[list[int]]


class KernelInput(NamedTuple):
    """One kernel's input: ids, bag offsets, per-id weights, and each feature's first id
    (``offsets[f * B]`` for f in 0..F, host ints: the kernel's ``offset_per_key``)."""

    ids: Tensor
    offsets: Tensor
    weights: Tensor | None
    bounds: list[int]


class Bucketizer:
    """Static routing of every feature's ids to the virtual features of every rank.

    Args:
        num_rows: the row count of each feature's table (layout order).
        dest_features: per destination rank, its virtual features in its kernels' order.
        dp_features: the layout indices of the data-parallel features, in kernel order.
        device: where the routing tensors live.
    """

    def __init__(
        self,
        num_rows: Sequence[int],
        dest_features: Sequence[Sequence[VirtualFeature]],
        dp_features: Sequence[int],
        device: torch.device,
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
        self.block_bounds = t([feat_base[f] + r for f, b in enumerate(blocks) for r in b])
        self.block_row_offset = t([r for b in blocks for r in b])
        self.route_count = t([len(r) for r in routes])
        self.route_start = t([sum(len(r) for r in routes[:i]) for i in range(len(routes))])
        self.route_gv = t([gv for r in routes for gv in r])
        self.gv_feature = t(self.gv_feature_list)
        # The count exchange's table: where each virtual feature's id count goes in it.
        self.dp_column = _IDS + max(self.dest_counts, default=0)
        self.num_columns = self.dp_column + len(self.dp_features)
        slots = [
            d * self.num_columns + _IDS + j
            for d, n in enumerate(self.dest_counts)
            for j in range(n)
        ]
        self.count_slot = t(slots)

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
            key_N = values + self.feat_base[feature_N]
            block_N = torch.searchsorted(self.block_bounds, key_N, right=True) - 1
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

    def _bucketize_rows(self, features: KeyedJaggedTensor) -> tuple[Tensor, Tensor | None, Tensor]:
        """Row-wise layouts: fbgemm's block bucketization, one native pass over the ids."""
        op = _block_bucketize_op()
        assert op is not None
        lengths, ids, weights, _, _ = op(
            features.lengths(),
            features.values(),
            False,
            False,
            self.split_sizes,
            self.world_size,
            features.weights_or_none(),
            None,
            -1,
            self.split_bounds,
        )
        lengths_G_B = lengths.view(self.num_virtual, features.stride())
        return ids, weights, lengths_G_B

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


def segment_transpose(values: Tensor, seg_W_V: Tensor) -> Tensor:
    """Reorder segments laid out (w, v)-major into (v, w)-major order, vectorised, no sync.

    Args:
        values: the concatenated segments, ``seg_W_V[0, 0]`` entries first, then ``[0, 1]``...
        seg_W_V: ``[W, V]`` segment sizes (int64).

    Returns:
        The same entries with segment ``(w, v)`` moved to position ``(v, w)``.
    """
    n = values.numel()
    if n == 0 or seg_W_V.shape[0] == 1 or seg_W_V.shape[1] == 1:
        return values
    flat = seg_W_V.reshape(-1)
    starts_W_V = (torch.cumsum(flat, 0) - flat).view(seg_W_V.shape)
    seg_V_W = seg_W_V.t().reshape(-1)
    new_starts = torch.cumsum(seg_V_W, 0) - seg_V_W
    shift = torch.repeat_interleave(starts_W_V.t().reshape(-1) - new_starts, seg_V_W, output_size=n)
    return values[shift + torch.arange(n, device=values.device)]


def pack_weights(weights: Tensor) -> Tensor:
    """float32 weights as int64 (bit-exact), so they travel in the ids' all-to-all."""
    return weights.to(torch.float32).view(torch.int32).to(torch.int64)


def unpack_weights(packed: Tensor) -> Tensor:
    """Inverse of `pack_weights`."""
    return packed.to(torch.int32).view(torch.float32)


def _dp_part(
    features: KeyedJaggedTensor, dp_features: list[int], max_batch: int
) -> tuple[Tensor, Tensor, Tensor | None]:
    """This rank's data-parallel lengths ``[F_dp * Bm]`` (padded), ids and weights."""
    batch = features.stride()
    lengths = features.lengths().view(len(features.keys()), batch)  # batch may be 0
    padded = lengths.new_zeros(len(dp_features), max_batch)
    if dp_features and batch:
        padded[:, :batch] = lengths[dp_features]
    opk = features.offset_per_key()
    values = features.values()
    weights = features.weights_or_none()
    ids = [values[opk[f] : opk[f + 1]] for f in dp_features]
    dp_ids = torch.cat(ids) if ids else values[:0]
    dp_w = None
    if weights is not None:
        ws = [weights[opk[f] : opk[f + 1]] for f in dp_features]
        dp_w = torch.cat(ws) if ws else weights[:0]
    return padded.reshape(-1), dp_ids, dp_w


@dataclass(slots=True)
class InputInFlight:
    """A distribution whose id all-to-all was started and not yet waited for."""

    out: ReceivedInput  # batch sizes and counts filled; the tensors once `wait` returns
    recv: Tensor
    work: Any
    recv_splits: list[int]
    n_mp_lengths: int
    n_dp_lengths: int
    weighted: bool

    def wait(self, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> ReceivedInput:
        """Finish the id all-to-all (at most ``timeout``) and split what arrived."""
        if not self.out.mp_lengths and not self.out.dp_lengths:
            wait(self.work, timeout)
            _unpack(
                self.out,
                self.recv,
                self.recv_splits,
                self.n_mp_lengths,
                self.n_dp_lengths,
                self.weighted,
            )
        return self.out


def start_count_exchange(
    features: KeyedJaggedTensor | None,
    error: BaseException | None,
    bucketizer: Bucketizer,
    weighted: bool,
    group: dist.ProcessGroup | None,
    rank: int,
    check: PendingCheck | None = None,
) -> CountExchange:
    """Route this rank's ids and start the count exchange; `CountExchange.start_ids` then
    starts the lengths + ids (+ weights) exchange: two collectives.

    The one host read of the step's input: the counts this rank sends and the counts it
    received, read together after the count exchange (the id check's flag rides in it too).

    Args:
        features: this rank's prepared input, or ``None`` when it was rejected.
        error: why this rank's input was rejected (re-raised here after the count exchange).
        bucketizer: the static routing.
        weighted: whether ids carry weights.
        group: the process group.
        rank: this rank.
        check: the id/weight check of ``features`` with its answer still on the device (its
            ids must already be safe to route, `FeatureLayout.prepare_deferred`); ``None``
            when the ids were checked already.

    Returns:
        The count exchange in flight.

    `CountExchange.start_ids` raises:
        The local ``error`` (or the check's ``InvalidIdError`` / ``NonFiniteWeightError``) on
        the rank whose input was rejected; `RemoteInputError` naming the rejected ranks on
        every other rank. Nothing is sent past the count exchange then.
    """
    world = bucketizer.world_size
    # On the ids' device: NCCL exchanges device tensors only.
    counts = torch.zeros(world, bucketizer.num_columns, dtype=torch.int64, device=bucketizer.device)
    routed: tuple[Tensor, Tensor | None, Tensor] | None = None
    if features is None or error is not None:
        counts[:, _FLAG] = 1
    else:
        routed = bucketizer.bucketize(features)
        _fill_counts(counts, bucketizer, features, routed[2], check)
    recv, work = start_all_to_all_counts(counts, group)
    return CountExchange(
        counts, recv, work, features, error, check, routed, bucketizer, weighted, group, rank
    )


@dataclass(slots=True)
class CountExchange:
    """A distribution whose count exchange was started (`start_count_exchange`)."""

    counts: Tensor
    recv: Tensor
    work: Any
    features: KeyedJaggedTensor | None
    error: BaseException | None
    check: PendingCheck | None
    routed: tuple[Tensor, Tensor | None, Tensor] | None
    bucketizer: Bucketizer
    weighted: bool
    group: dist.ProcessGroup | None
    rank: int

    def start_ids(self, timeout: datetime.timedelta) -> InputInFlight:
        """Read the counts (waiting at most ``timeout``) and start the id exchange.

        Raises:
            See `start_count_exchange`.
        """
        wait(self.work, timeout)
        sent, received = torch.stack([self.counts, self.recv]).tolist()  # the one read
        return _start_ids(self, sent, received)


def _start_ids(
    exchange: CountExchange, sent: list[list[int]], received: list[list[int]]
) -> InputInFlight:
    features, error, check = exchange.features, exchange.error, exchange.check
    bucketizer, routed, weighted = exchange.bucketizer, exchange.routed, exchange.weighted
    group, rank = exchange.group, exchange.rank
    bad = [s for s, row in enumerate(received) if row[_FLAG]]
    if error is not None:
        raise error
    if sent and sent[0][_FLAG]:
        assert check is not None
        check.raise_error()
    if bad:
        raise RemoteInputError(
            f"the input of rank(s) {bad} was rejected (see the error raised on that rank); "
            "this step was abandoned on every rank and nothing was updated"
        )
    assert features is not None and routed is not None
    ids_N, w_N, lengths_G_B = routed
    batch_sizes = [row[_BATCH] for row in received]
    max_batch = max(batch_sizes)
    if lengths_G_B.shape[1] == max_batch:
        lengths = lengths_G_B.reshape(-1)
    else:  # pad this rank's batch to the largest with empty bags
        lengths = lengths_G_B.new_zeros(lengths_G_B.shape[0], max_batch)
        lengths[:, : lengths_G_B.shape[1]] = lengths_G_B
        lengths = lengths.reshape(-1)
    dp_len, dp_ids, dp_w = _dp_part(features, bucketizer.dp_features, max_batch)
    sent_ids = [sum(_mp_counts(bucketizer, row, d)) for d, row in enumerate(sent)]
    send, send_splits = _pack(
        bucketizer, sent_ids, lengths, ids_N, w_N, dp_len, dp_ids, dp_w, max_batch, weighted
    )
    mp_counts = [_mp_counts(bucketizer, row, rank) for row in received]
    dp_counts = [row[bucketizer.dp_column :] for row in received]
    n_vf = bucketizer.dest_counts[rank]
    n_dp = len(bucketizer.dp_features) * max_batch
    factor = 2 if weighted else 1
    recv_splits = [
        n_vf * max_batch + n_dp + factor * (sum(mp) + sum(dp))
        for mp, dp in zip(mp_counts, dp_counts, strict=True)
    ]
    recv_flat, work = start_all_to_all_flat(send, send_splits, recv_splits, group)
    out = ReceivedInput(batch_sizes, max_batch, [], [], [], [], [], [], mp_counts, dp_counts)
    return InputInFlight(out, recv_flat, work, recv_splits, n_vf * max_batch, n_dp, weighted)


def _mp_counts(bucketizer: Bucketizer, row: list[int], dest: int) -> list[int]:
    """The ids of each of ``dest``'s virtual features in one row of the count table."""
    return row[_IDS : _IDS + bucketizer.dest_counts[dest]]


def _fill_counts(
    counts: Tensor,
    bucketizer: Bucketizer,
    features: KeyedJaggedTensor,
    lengths_G_B: Tensor,
    check: PendingCheck | None,
) -> None:
    """Write this rank's row of the count table for every destination, on the device."""
    counts[:, _BATCH] = features.stride()
    if check is not None and check.bad is not None:
        counts[:, _FLAG] = check.bad
    if bucketizer.num_virtual:
        counts.view(-1)[bucketizer.count_slot] = lengths_G_B.sum(1).to(torch.int64)
    if bucketizer.dp_features:
        lpk = features.length_per_key()
        dp = [lpk[f] for f in bucketizer.dp_features]
        counts[:, bucketizer.dp_column :] = torch.tensor(
            dp, dtype=torch.int64, device=counts.device
        )


def _pack(
    bucketizer: Bucketizer,
    id_counts: list[int],
    lengths: Tensor,
    ids_N: Tensor,
    w_N: Tensor | None,
    dp_len: Tensor,
    dp_ids: Tensor,
    dp_w: Tensor | None,
    max_batch: int,
    weighted: bool,
) -> tuple[Tensor, list[int]]:
    # ``id_counts``: the ids sent to each destination, from the count exchange's one read.
    len_parts = lengths.split([c * max_batch for c in bucketizer.dest_counts])
    id_parts = ids_N.split(id_counts)
    w_parts = pack_weights(w_N).split(id_counts) if weighted and w_N is not None else None
    dp_w_packed = pack_weights(dp_w) if weighted and dp_w is not None else None
    pieces: list[Tensor] = []
    splits: list[int] = []
    for d in range(bucketizer.world_size):
        part = [len_parts[d], dp_len, id_parts[d], dp_ids]
        if w_parts is not None and dp_w_packed is not None:
            part += [w_parts[d], dp_w_packed]
        pieces += part
        splits.append(sum(p.numel() for p in part))
    return torch.cat(pieces), splits


def _unpack(
    out: ReceivedInput,
    recv: Tensor,
    recv_splits: list[int],
    n_mp_lengths: int,
    n_dp_lengths: int,
    weighted: bool,
) -> None:
    """Split the received buffer per source into ``out``'s lengths, ids and weights."""
    for chunk, mp, dp in zip(
        recv.split(recv_splits), out.mp_id_counts, out.dp_id_counts, strict=True
    ):
        sizes = [n_mp_lengths, n_dp_lengths, sum(mp), sum(dp)]
        if weighted:
            sizes += [sum(mp), sum(dp)]
        parts = chunk.split(sizes)
        out.mp_lengths.append(parts[0])
        out.dp_lengths.append(parts[1])
        out.mp_ids.append(parts[2])
        out.dp_ids.append(parts[3])
        out.mp_weights.append(unpack_weights(parts[4]) if weighted else None)
        out.dp_weights.append(unpack_weights(parts[5]) if weighted else None)
