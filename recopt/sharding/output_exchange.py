"""The autograd all-to-all of the sharded embeddings' pooled outputs, and its buffers.

Forward sends each rank the pooled outputs of its bags; backward sends the output gradients
back the same way (and agrees, before any collective, on whether they are finite). The
collectives are `recopt.comm`'s; this module owns the sharding-side layout of what they carry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from recopt.comm import ProcessGroup, all_to_all_flat

Tensor = torch.Tensor


class OutputExchange(torch.autograd.Function):
    """Pooled outputs to their source ranks, and the data-parallel rows of this rank.

    Forward: an all-to-all of the model-parallel pooled outputs (flat, destination-major) and a
    local slice of the data-parallel output (computed on the global batch). Backward: ONE
    all-to-all carries both the model-parallel output gradients back to the shard holders and
    this rank's data-parallel output gradient to every rank, which then holds the global
    data-parallel gradient (the equivalent of all-reducing the replicas' table gradients).
    ``dummy`` (a 0-element tensor requiring grad) makes backward run on every rank, also on a
    rank with no shards, so the collective is never left waiting.

    No large per-step temporary: one is fresh pages (page faults) every step where the
    allocator hands large blocks back to the system (glibc; benchmarks/README.md, "Non-finite
    gradient gate"). Without data-parallel rows the returning gradients land in ``mp_send``'s
    memory (dead once sent: the kernels' backward reads only ids; the collective does not bump
    its version, which a view made inside a custom Function forbids). ``meta.sum_over_ranks``
    (row-wise layouts) returns the sum of the received blocks; the blocks, and the repeated
    gradient sent back, live in ``meta.scratch``, which never leaves this class. The
    gradients land there through an alias with its own version counter: gloo receives a CUDA
    tensor by ``copy_`` from a host buffer, a write that would otherwise bump mp_send's.
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
        # See the class doc; one rank copies in place (it would bump mp_send's version).
        reuse = mp_send.is_contiguous() and mp_send.numel() > 0 and len(meta.batch_sizes) > 1
        ctx.send_buffer = _unversioned_alias(mp_send) if reuse else None
        recv_numel = sum(meta.mp_recv_splits)
        scratch = meta.scratch.get(recv_numel, mp_send) if meta.sum_over_ranks else None
        mp_recv = all_to_all_flat(
            mp_send, meta.mp_send_splits, meta.mp_recv_splits, meta.group, out=scratch
        )
        if meta.sum_over_ranks:  # [B * width], a new tensor: the scratch is free again
            mp_recv = mp_recv.view(len(meta.mp_recv_splits), -1).sum(0)
        lo = meta.rank * meta.dp_stride
        dp_own_B_D = dp_global_G_D[lo : lo + meta.batch_sizes[meta.rank]].clone()
        return mp_recv, dp_own_B_D

    @staticmethod
    def backward(
        ctx: Any, grad_mp_recv: Tensor | None, grad_dp_own_B_D: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        meta: ExchangeMeta = ctx.meta
        # Before any other collective: every rank takes the same branch (None: the kernels'
        # gate skips their backward, so no update and no row-statistics exchange either).
        if meta.admit is not None and not meta.admit(grad_mp_recv, grad_dp_own_B_D):
            return None, None, None, None
        for hook in meta.backward_hooks:
            hook()
        dp_dim = meta.dp_dim
        own_b = meta.batch_sizes[meta.rank]
        if grad_mp_recv is None:
            blocks = len(meta.mp_recv_splits) if meta.sum_over_ranks else 1
            grad_mp_recv = torch.zeros(sum(meta.mp_recv_splits) // blocks, device=meta.device)
        if grad_dp_own_B_D is None:
            grad_dp_own_B_D = torch.zeros(own_b, dp_dim, device=meta.device)
        if dp_dim == 0:  # nothing to interleave: the gradients go back as they came
            out, ctx.send_buffer = ctx.send_buffer, None  # a second backward allocates
            if out is not None and out.dtype != grad_mp_recv.dtype:
                out = None
            recv = all_to_all_flat(
                _send_layout(grad_mp_recv, meta),
                meta.mp_recv_splits,
                meta.mp_send_splits,
                meta.group,
                out=out,
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


def _unversioned_alias(tensor: Tensor) -> Tensor:
    """A tensor on ``tensor``'s memory (same offset, sizes and strides) with a version counter
    of its own, unlike ``detach()``: in-place writes into it (a collective's ``copy_``) leave
    ``tensor``'s counter, which autograd checks, alone. Only for memory no one reads again."""
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    with torch.no_grad():
        alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
    return alias


def _send_layout(grad_mp_recv: Tensor, meta: ExchangeMeta) -> Tensor:
    """The model-parallel gradients as sent back: contiguous, one block per source rank.

    Summed outputs got the sum of every rank's block, so each block's gradient is the same:
    it is repeated into the scratch buffer (as is any other non-contiguous gradient, e.g. the
    stride-0 one of ``loss = out.sum()``), which the collective reads before this returns.
    """
    if meta.sum_over_ranks:
        grad = grad_mp_recv.reshape(1, -1).expand(len(meta.mp_recv_splits), -1)
    elif grad_mp_recv.is_contiguous():
        return grad_mp_recv
    else:
        grad = grad_mp_recv
    send = meta.scratch.get(grad.numel(), grad_mp_recv)
    send.view(grad.shape).copy_(grad)
    return send


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
        admit: called first in backward with this rank's output gradients; False (the same on
            every rank: it must agree with the others, see `all_ranks_finite`) returns no
            gradient at all, skipping the exchange and the hooks.
        scratch: the collection's reusable buffer for the temporaries of the exchange.
        sum_over_ranks: every rank sends the same columns (equal splits, no data-parallel
            rows): return their sum, ``[B * width]``, instead of the blocks.
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
        admit: Callable[[Tensor | None, Tensor | None], bool] | None = None,
        scratch: ScratchBuffer | None = None,
        sum_over_ranks: bool = False,
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
        self.admit = admit
        self.scratch = ScratchBuffer() if scratch is None else scratch
        self.sum_over_ranks = sum_over_ranks


class ScratchBuffer:
    """One reused buffer (grown to the largest request) for temporaries of a single call."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0)

    def get(self, numel: int, like: Tensor) -> Tensor:
        """``numel`` elements of ``like``'s dtype and device, contents undefined."""
        buf = self._buffer
        if buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]
