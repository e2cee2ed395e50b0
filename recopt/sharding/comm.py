"""Collectives of sharded embeddings: the count exchange, the id all-to-all, and the autograd
all-to-all of pooled outputs whose backward sends the output gradients back the same way.

Every call is a single collective on the caller's process group (whose timeout bounds it), so a
step costs four collectives: counts, ids, pooled outputs (forward) and their gradients (backward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from recopt.kernels.autotune import BackendDecision, default_resolver
from recopt.kernels.config import FusedOptimizerConfig, TableSpec
from recopt.kernels.factory import auto_candidates

Tensor = torch.Tensor
ProcessGroup = dist.ProcessGroup


def all_to_all_counts(send_W_C: Tensor, group: ProcessGroup | None) -> Tensor:
    """Exchange one small int64 row with every rank: row ``d`` of the input goes to rank ``d``.

    Args:
        send_W_C: ``[world_size, C]`` int64; row ``d`` is what this rank tells rank ``d``.
        group: the process group.

    Returns:
        ``[world_size, C]``: row ``s`` is what rank ``s`` told this rank.
    """
    send = send_W_C.contiguous()
    recv = torch.empty_like(send)
    if dist.get_world_size(group) == 1:
        recv.copy_(send)
        return recv
    dist.all_to_all_single(recv, send, group=group)
    return recv


def all_to_all_flat(
    send: Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup | None
) -> Tensor:
    """All-to-all of a flat tensor with variable splits (no autograd).

    Args:
        send: 1-D tensor; its first ``send_splits[0]`` entries go to rank 0, and so on.
        send_splits: entries for each destination rank.
        recv_splits: entries arriving from each source rank.
        group: the process group.

    Returns:
        The 1-D tensor of ``sum(recv_splits)`` entries, source-rank order.
    """
    assert send.dim() == 1 and send.numel() == sum(send_splits), (send.shape, send_splits)
    recv = send.new_empty(sum(recv_splits))
    if dist.get_world_size(group) == 1:
        recv.copy_(send)
        return recv
    dist.all_to_all_single(
        recv,
        send.contiguous(),
        output_split_sizes=recv_splits,
        input_split_sizes=send_splits,
        group=group,
    )
    return recv


class OutputExchange(torch.autograd.Function):
    """Pooled outputs to their source ranks, and the data-parallel rows of this rank.

    Forward: an all-to-all of the model-parallel pooled outputs (flat, destination-major) and a
    local slice of the data-parallel output (computed on the global batch). Backward: ONE
    all-to-all carries both the model-parallel output gradients back to the shard holders and
    this rank's data-parallel output gradient to every rank, which then holds the global
    data-parallel gradient (the equivalent of all-reducing the replicas' table gradients).
    ``dummy`` (a 0-element tensor requiring grad) makes backward run on every rank, also on a
    rank with no shards, so the collective is never left waiting.
    """

    @staticmethod
    def forward(
        ctx: Any,
        mp_send: Tensor,
        dp_global_G_D: Tensor,
        dummy: Tensor,
        meta: ExchangeMeta,
    ) -> tuple[Tensor, Tensor]:
        ctx.meta = meta
        mp_recv = all_to_all_flat(mp_send, meta.mp_send_splits, meta.mp_recv_splits, meta.group)
        lo = meta.rank * meta.dp_stride
        dp_own_B_D = dp_global_G_D[lo : lo + meta.batch_sizes[meta.rank]].clone()
        return mp_recv, dp_own_B_D

    @staticmethod
    def backward(
        ctx: Any, grad_mp_recv: Tensor | None, grad_dp_own_B_D: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        meta: ExchangeMeta = ctx.meta
        for hook in meta.backward_hooks:
            hook()
        dp_dim = meta.dp_dim
        own_b = meta.batch_sizes[meta.rank]
        if grad_mp_recv is None:
            grad_mp_recv = torch.zeros(sum(meta.mp_recv_splits), device=meta.device)
        if grad_dp_own_B_D is None:
            grad_dp_own_B_D = torch.zeros(own_b, dp_dim, device=meta.device)
        if dp_dim == 0:  # nothing to interleave: the gradients go back as they came
            recv = all_to_all_flat(
                grad_mp_recv.contiguous(), meta.mp_recv_splits, meta.mp_send_splits, meta.group
            )
            return recv, grad_mp_recv.new_zeros(meta.dp_rows, 0), None, None
        dp_flat = grad_dp_own_B_D.reshape(-1).to(grad_mp_recv.dtype)
        pieces: list[Tensor] = []
        for chunk in grad_mp_recv.split(meta.mp_recv_splits):
            pieces.append(chunk)
            pieces.append(dp_flat)
        send = torch.cat(pieces) if pieces else grad_mp_recv
        send_splits = [n + dp_flat.numel() for n in meta.mp_recv_splits]
        recv_splits = [
            n + b * dp_dim for n, b in zip(meta.mp_send_splits, meta.batch_sizes, strict=True)
        ]
        recv = all_to_all_flat(send, send_splits, recv_splits, meta.group)
        grad_mp: list[Tensor] = []
        grad_dp = torch.zeros(meta.dp_rows, dp_dim, dtype=recv.dtype, device=recv.device)
        start = 0
        for src, (n, b) in enumerate(zip(meta.mp_send_splits, meta.batch_sizes, strict=True)):
            grad_mp.append(recv[start : start + n])
            start += n
            lo = src * meta.dp_stride
            grad_dp[lo : lo + b] = recv[start : start + b * dp_dim].view(b, dp_dim)
            start += b * dp_dim
        grad_mp_send = torch.cat(grad_mp) if grad_mp else recv[:0]
        return grad_mp_send, grad_dp, None, None


class ExchangeMeta:
    """Sizes of one step's output exchange (Python ints, known after the count exchange).

    Args:
        group: the process group.
        rank: this rank.
        device: where gradients live.
        mp_send_splits: model-parallel output entries sent to each rank.
        mp_recv_splits: model-parallel output entries received from each rank.
        batch_sizes: every rank's batch size.
        dp_stride: rows per rank in the data-parallel global output (the padded batch).
        dp_dim: width of the data-parallel output.
        backward_hooks: callables run at the start of backward (before any collective).
    """

    def __init__(
        self,
        *,
        group: ProcessGroup | None,
        rank: int,
        device: torch.device,
        mp_send_splits: list[int],
        mp_recv_splits: list[int],
        batch_sizes: list[int],
        dp_stride: int,
        dp_dim: int,
        backward_hooks: list[Callable[[], None]],
    ) -> None:
        self.group = group
        self.rank = rank
        self.device = device
        self.mp_send_splits = mp_send_splits
        self.mp_recv_splits = mp_recv_splits
        self.batch_sizes = batch_sizes
        self.dp_stride = dp_stride
        self.dp_dim = dp_dim
        self.dp_rows = dp_stride * len(batch_sizes)
        self.backward_hooks = backward_hooks


def all_reduce_sum(tensor: Tensor, group: ProcessGroup | None) -> Tensor:
    """Sum ``tensor`` over the ranks of ``group`` in place (no-op on one rank) and return it."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


# One kernel as create_kernel sees it: its tables, feature-to-table map and optimizer.
KernelRequest = tuple[list[TableSpec], list[int], FusedOptimizerConfig]


def share_backend_decisions(
    kernels: Sequence[KernelRequest], device: torch.device, group: ProcessGroup | None
) -> dict[str, BackendDecision]:
    """Resolve every rank's ``Backend.AUTO`` kernels on rank 0 and give all ranks its answers.

    Ranks holding replicas of a table (data-parallel) must run the same backend to stay
    bit-identical, and each rank's own measurement can differ under load. Every rank sends its
    kernels' shape classes to rank 0 (one all-gather), rank 0 resolves them all (pin, cache, or
    a measurement of the probe, which needs only the shape class), and broadcasts the
    decisions, which every rank adopts. Two collectives, bounded by the group's timeout.

    Args:
        kernels: this rank's kernels, before they are built.
        device: where they will run.
        group: the process group (a no-op on one rank).

    Returns:
        The decisions adopted, by shape-class key.
    """
    if dist.get_world_size(group) == 1:
        return {}
    requests = []
    for tables, feature_table_map, optimizer in kernels:
        request = auto_candidates(tables, optimizer, device, feature_table_map)
        if request is not None:
            requests.append((request[0], optimizer, request[1]))
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, requests, group=group)
    resolver = default_resolver()
    shared: list[Any] = [None]
    if dist.get_rank(group) == 0:
        decisions: dict[str, BackendDecision] = {}
        for shape, optimizer, candidates in (r for rank in gathered for r in rank):
            decision = resolver.resolve(shape, optimizer, candidates)
            decisions.setdefault(shape.key(), decision)
        shared[0] = {k: d.to_json() for k, d in decisions.items()}
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(shared, src=src, group=group)
    adopted = {
        k: BackendDecision.from_json({**v, "reason": f"shared by rank 0 ({v['reason']})"})
        for k, v in shared[0].items()
    }
    resolver.adopt(adopted)
    return adopted
