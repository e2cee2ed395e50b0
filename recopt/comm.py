"""The one module that calls torch.distributed collectives and creates process groups.

Sharded embeddings: the count exchange, the id all-to-all, and the autograd all-to-all of pooled
outputs whose backward sends the output gradients back the same way (four collectives a step).
Everything else (plan broadcast, norms, state gathering, checkpoint agreement) goes through the
small wrappers at the end, which put a tensor on a device its group serves: a CUDA run's default
group is ``"cpu:gloo,cuda:nccl"``, so CPU-side collectives need no copy there, and a group with
one device type (NCCL alone, or ``"cuda:gloo"`` in tests) gets the tensor moved once, here.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from recopt.kernels.autotune import BackendDecision, default_resolver
from recopt.kernels.factory import KernelRequest, auto_requests, resolve_requests

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
    send: Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: ProcessGroup | None,
    out: Tensor | None = None,
) -> Tensor:
    """All-to-all of a flat tensor with variable splits (no autograd).

    Args:
        send: 1-D tensor; its first ``send_splits[0]`` entries go to rank 0, and so on.
        send_splits: entries for each destination rank.
        recv_splits: entries arriving from each source rank.
        group: the process group.
        out: where to receive (``sum(recv_splits)`` entries; None: a new tensor).

    Returns:
        The 1-D tensor of ``sum(recv_splits)`` entries, source-rank order.
    """
    assert send.dim() == 1 and send.numel() == sum(send_splits), (send.shape, send_splits)
    recv = send.new_empty(sum(recv_splits)) if out is None else out
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


def start_all_to_all_counts(send_W_C: Tensor, group: ProcessGroup | None) -> tuple[Tensor, Any]:
    """`all_to_all_counts`, started without waiting: ``(recv, work)``, as
    `start_all_to_all_flat`."""
    send = send_W_C.contiguous()
    recv = torch.empty_like(send)
    if dist.get_world_size(group) == 1:
        recv.copy_(send)
        return recv, None
    return recv, dist.all_to_all_single(recv, send, group=group, async_op=True)


def start_all_to_all_flat(
    send: Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup | None
) -> tuple[Tensor, Any]:
    """`all_to_all_flat`, started without waiting (a pipeline overlaps it with a step).

    Returns:
        ``(recv, work)``: ``recv`` holds the result once `wait` on ``work`` has returned
        (``work`` is None when there is nothing to wait for: one rank).
    """
    assert send.dim() == 1 and send.numel() == sum(send_splits), (send.shape, send_splits)
    recv = send.new_empty(sum(recv_splits))
    if dist.get_world_size(group) == 1:
        recv.copy_(send)
        return recv, None
    work = dist.all_to_all_single(
        recv,
        send.contiguous(),
        output_split_sizes=recv_splits,
        input_split_sizes=send_splits,
        group=group,
        async_op=True,
    )
    return recv, work


def wait(work: Any, timeout: datetime.timedelta) -> None:
    """Wait for a started collective (``None``: nothing to wait for), at most ``timeout``."""
    if work is not None:
        _wait(work, timeout)


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
    gradient sent back, live in ``meta.scratch``, which never leaves this class.
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
        ctx.send_buffer = mp_send.detach() if reuse else None
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


def all_reduce_sum(tensor: Tensor, group: ProcessGroup | None) -> Tensor:
    """Sum ``tensor`` over the ranks of ``group`` in place (no-op on one rank) and return it."""
    return all_reduce(tensor, group)


# ------------------------------------------------------------------ groups and their devices


def default_backend(device: torch.device) -> str:
    """The backend string for a process group of ranks computing on ``device``.

    CUDA runs get NCCL for CUDA tensors and gloo beside it for the library's few CPU-side
    collectives (plan broadcast, checkpoint agreement); CPU runs get gloo.
    """
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_process_group(
    device: torch.device,
    *,
    timeout: datetime.timedelta,
    backend: str | None = None,
    init_method: str | None = None,
    rank: int = -1,
    world_size: int = -1,
    store_prefix: str = "",
) -> None:
    """Initialise the default process group for ranks computing on ``device``.

    Args:
        device: this rank's device; a CUDA device is also made the current one.
        timeout: limit for every collective of the group.
        backend: overrides `default_backend` (e.g. ``"cuda:gloo"``: ranks sharing one GPU).
        init_method: rendezvous URL (None: torchrun's environment variables).
        rank: this rank (-1: from the environment).
        world_size: number of ranks (-1: from the environment).
        store_prefix: a namespace for the group's keys in the rendezvous store, different
            for each attempt of a job that restarts on the same store (torchrun
            ``--max-restarts`` keeps its store: ``attempt<TORCHELASTIC_RESTART_COUNT>/``).
            Without it a restarted rank can read a dead peer's address, left in the store
            by the previous attempt, and its gloo connect times out.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not store_prefix:
        dist.init_process_group(
            backend or default_backend(device),
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        return
    store, rank, world_size = next(
        dist.rendezvous(init_method or "env://", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    dist.init_process_group(
        backend or default_backend(device),
        store=dist.PrefixStore(store_prefix, store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def new_group(
    ranks: Sequence[int] | None, timeout: datetime.timedelta, backend: str | None = None
) -> ProcessGroup:
    """A new process group over ``ranks`` (None: all); every rank of the world must call it."""
    group = dist.new_group(
        ranks=None if ranks is None else list(ranks), timeout=timeout, backend=backend
    )
    assert group is not None  # every rank calls it, so every rank gets a group
    return group


def device_for_local_rank(local_rank: int, use_cuda: bool) -> torch.device:
    """The device of the process with node-local index ``local_rank``: GPU ``local_rank``.

    Args:
        local_rank: this process's index on its host (torchrun's ``LOCAL_RANK``).
        use_cuda: False pins the CPU.

    Raises:
        ValueError: more local ranks than visible GPUs (naming both and the fix).
    """
    if not use_cuda:
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(
            f"local rank {local_rank} needs GPU {local_rank}, but this host has {count} visible "
            f"GPU(s); start at most {count} process(es) per host (torchrun --nproc-per-node "
            f"{count}), or run on CPU (CUDA_VISIBLE_DEVICES=)"
        )
    return torch.device("cuda", local_rank)


def served_device_types(backend_config: str) -> list[str]:
    """Device types a backend configuration serves, e.g. ``"cpu:gloo,cuda:nccl"`` -> both."""
    types: list[str] = []
    for part in backend_config.split(","):
        kind, _, name = part.strip().partition(":")
        if not name:  # a bare backend name
            types += {"nccl": ["cuda"], "gloo": ["cpu", "cuda"]}.get(kind, ["cpu"])
        else:
            types.append(kind)
    return list(dict.fromkeys(types))


def collective_device(group: ProcessGroup | None, device: torch.device) -> torch.device:
    """Where a tensor that lives on ``device`` goes through a collective of ``group``.

    Its own device when the group serves that type; else the current GPU (a CUDA-only group),
    else the CPU.
    """
    served = served_device_types(str(dist.get_backend_config(group)))
    if device.type in served:
        return device
    if "cuda" in served:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ------------------------------------------------------------------ small collectives


def _on_served_device(tensor: Tensor, group: ProcessGroup | None) -> Tensor:
    device = collective_device(group, tensor.device)
    return tensor if device == tensor.device else tensor.to(device)


def _wait(work: Any, timeout: datetime.timedelta | None) -> None:
    assert work is not None  # async_op=True always returns a work handle
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout=timeout)


def broadcast(
    tensor: Tensor,
    src: int,
    group: ProcessGroup | None,
    timeout: datetime.timedelta | None = None,
) -> Tensor:
    """Broadcast ``tensor`` in place from global rank ``src`` on any device; returns it."""
    moved = _on_served_device(tensor, group)
    _wait(dist.broadcast(moved, src=src, group=group, async_op=True), timeout)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def all_reduce(
    tensor: Tensor,
    group: ProcessGroup | None,
    op: Any = dist.ReduceOp.SUM,
    timeout: datetime.timedelta | None = None,
) -> Tensor:
    """Reduce ``tensor`` in place over ``group`` with ``op`` on any device; returns it."""
    if dist.get_world_size(group) == 1:
        return tensor
    moved = _on_served_device(tensor, group)
    _wait(dist.all_reduce(moved, op=op, group=group, async_op=True), timeout)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def all_gather_sized(
    header: Tensor,
    values: Tensor,
    group: ProcessGroup | None,
    timeout: datetime.timedelta,
) -> tuple[list[Tensor], list[Tensor]]:
    """Every rank's ``header`` (int64, the same length everywhere, ``header[0]`` the number
    of ``values`` it sends) and its ``values`` (1-D, any count); two all-gathers.

    Returns:
        (headers, values): one entry per rank, in rank order, on ``values``' device.

    Raises:
        RuntimeError: a collective did not finish within ``timeout``.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return [header], [values]
    moved = _on_served_device(header, group)
    headers = [torch.empty_like(moved) for _ in range(world)]
    _wait(dist.all_gather(headers, moved, group=group, async_op=True), timeout)
    counts = [int(h[0]) for h in headers]
    padded = torch.zeros(max(1, *counts), dtype=values.dtype, device=moved.device)
    padded[: values.numel()] = values
    gathered = [torch.empty_like(padded) for _ in range(world)]
    _wait(dist.all_gather(gathered, padded, group=group, async_op=True), timeout)
    return (
        [h.to(header.device) for h in headers],
        [g[:n].to(values.device) for g, n in zip(gathered, counts, strict=True)],
    )


def all_ranks_finite(
    local_finite: Tensor, group: ProcessGroup | None, timeout: datetime.timedelta
) -> bool:
    """Whether every rank's flag is set: one MIN all-reduce of one number, one host read.

    Args:
        local_finite: 0-dim bool tensor, this rank's answer (e.g. its gradients are finite).
        group: the ranks that must agree (one rank: its own flag).
        timeout: limit for the collective.

    Returns:
        The same answer on every rank: True only if every rank's flag is True.
    """
    flag = local_finite.reshape(1).to(torch.float32)  # gloo and NCCL reduce floats everywhere
    all_reduce(flag, group, op=dist.ReduceOp.MIN, timeout=timeout)
    return bool(flag.item() == 1.0)


def all_gather_object(obj: Any, group: ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj``, rank order (the group should serve CPU tensors: gloo)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_gather_bytes(
    data: bytes, group: ProcessGroup | None, timeout: datetime.timedelta
) -> list[bytes]:
    """Every rank's ``data``, rank order: the lengths, then the padded bytes (two all-gathers
    of CPU tensors, each bounded by ``timeout``; the group must serve CPU tensors: gloo)."""
    world = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    work = dist.all_gather(lengths, torch.tensor([len(data)]), group=group, async_op=True)
    _wait(work, timeout)
    size = max(int(n.item()) for n in lengths)
    mine = torch.zeros(size, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.zeros(size, dtype=torch.uint8) for _ in range(world)]
    _wait(dist.all_gather(parts, mine, group=group, async_op=True), timeout)
    return [p[: int(n.item())].numpy().tobytes() for p, n in zip(parts, lengths, strict=True)]


def barrier(group: ProcessGroup | None, timeout: datetime.timedelta) -> None:
    """Wait for every rank of ``group``, at most ``timeout``.

    A gloo group uses gloo's monitored barrier, which names a missing rank. torch implements
    that barrier for a group whose backend is exactly ``gloo``, so any other group (a CUDA
    run's ``"cpu:gloo,cuda:nccl"``, NCCL, ``"cuda:gloo"``) waits on a one-element all-reduce
    on a device it serves instead.
    """
    if dist.get_world_size(group) == 1:
        return
    if str(dist.get_backend(group)) == str(dist.Backend.GLOO):
        dist.monitored_barrier(group=group, timeout=timeout)
        return
    all_reduce(torch.zeros(1), group, timeout=timeout)


class BackendDecisionError(ValueError):
    """Another rank could not take part in the backend decision (its kernels are refused, or
    rank 0's resolution failed), so every rank stops instead of waiting for it."""


def share_backend_decisions(
    kernels: Sequence[KernelRequest], device: torch.device, group: ProcessGroup | None
) -> dict[str, BackendDecision]:
    """Resolve every rank's ``Backend.AUTO`` kernels on rank 0 and give all ranks its answers.

    Ranks holding replicas of a table (data-parallel) must run the same backend to stay
    bit-identical, and each rank's own measurement can differ under load. Every rank sends its
    kernels' shape classes to rank 0 (one all-gather), rank 0 resolves them all (pin, cache, or
    a measurement of the probe, which needs only the shape class), and broadcasts the
    decisions, which every rank adopts. Two collectives, bounded by the group's timeout. A
    failure travels with them: a rank whose kernels are refused sends its refusal in the
    all-gather, rank 0 broadcasts an error of its resolution, and every rank then raises.

    Args:
        kernels: this rank's kernels, before they are built.
        device: where they will run.
        group: the process group (a no-op on one rank).

    Returns:
        The decisions adopted, by shape-class key.

    Raises:
        ValueError: this rank's kernels are refused (the refusal itself).
        BackendDecisionError: another rank's kernels are refused, or rank 0's resolution
            failed (rank 0 raises its own error); the message names the rank and the error.
        Exception: on rank 0, whatever stopped its resolution.
    """
    if dist.get_world_size(group) == 1:
        return {}
    requests, refusal = auto_requests(kernels, device)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    sent = (requests, None if refusal is None else str(refusal))
    dist.all_gather_object(gathered, sent, group=group)
    if refusal is not None:
        raise refusal
    refused = [f"rank {r}: {message}" for r, (_, message) in enumerate(gathered) if message]
    if refused:
        raise BackendDecisionError(
            f"other ranks' kernels were refused, so no rank builds its kernels: {refused}"
        )
    shared: list[Any] = [None]
    failure: Exception | None = None
    if dist.get_rank(group) == 0:
        shared[0], failure = resolve_requests([rank[0] for rank in gathered])
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(shared, src=src, group=group)
    if failure is not None:
        raise failure
    if "error" in shared[0]:
        raise BackendDecisionError(
            f"rank 0 failed to decide the kernels' backends, so no rank builds its kernels: "
            f"{shared[0]['error']}"
        )
    adopted = {
        k: BackendDecision.from_json({**v, "reason": f"shared by rank 0 ({v['reason']})"})
        for k, v in shared[0]["decisions"].items()
    }
    default_resolver().adopt(adopted)
    return adopted
