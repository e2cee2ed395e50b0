"""Input distribution: send every id to the shards that hold its row, in two all-to-alls.

`bucketizer.Bucketizer` routes this rank's ids to every destination's virtual features; this
module exchanges them: a count exchange (one row of the count table per destination, read on
the host once), then one all-to-all of lengths, ids and weights, split per source on arrival.
Legend: F features, B this rank's batch, Bm the largest batch of any rank, N ids, G virtual
features of every destination together, W world size.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from recopt.comm import start_all_to_all_counts, start_all_to_all_flat, wait
from recopt.modules.inputs import PendingCheck
from recopt.sharding.bucketizer import BATCH_COLUMN, FLAG_COLUMN, IDS_COLUMN, Bucketizer
from recopt.sparse import KeyedJaggedTensor

Tensor = torch.Tensor

DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)


class RemoteInputError(ValueError):
    """Another rank's input was rejected, so this step was abandoned on every rank."""


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
        counts[:, FLAG_COLUMN] = 1
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
    bad = [s for s, row in enumerate(received) if row[FLAG_COLUMN]]
    if error is not None:
        raise error
    if sent and sent[0][FLAG_COLUMN]:
        assert check is not None
        check.raise_error()
    if bad:
        raise RemoteInputError(
            f"the input of rank(s) {bad} was rejected (see the error raised on that rank); "
            "this step was abandoned on every rank and nothing was updated"
        )
    assert features is not None and routed is not None
    ids_N, w_N, lengths_G_B = routed
    batch_sizes = [row[BATCH_COLUMN] for row in received]
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
    return row[IDS_COLUMN : IDS_COLUMN + bucketizer.dest_counts[dest]]


def _fill_counts(
    counts: Tensor,
    bucketizer: Bucketizer,
    features: KeyedJaggedTensor,
    lengths_G_B: Tensor,
    check: PendingCheck | None,
) -> None:
    """Write this rank's row of the count table for every destination, on the device."""
    counts[:, BATCH_COLUMN] = features.stride()
    if check is not None and check.bad is not None:
        counts[:, FLAG_COLUMN] = check.bad
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
