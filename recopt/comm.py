"""The one module that calls torch.distributed collectives and creates process groups.

Generic collectives only: the count and flat all-to-alls the sharded embeddings exchange ids and
pooled outputs with (their autograd exchange is `recopt.sharding.output_exchange`), and small
wrappers for everything else (plan broadcast, norms, state gathering, checkpoint agreement,
backend decisions), which put a tensor on a device its group serves: a CUDA run's default
group is ``"cpu:gloo,cuda:nccl"``, so CPU-side collectives need no copy there, and a group with
one device type (NCCL alone, or ``"cuda:gloo"`` in tests) gets the tensor moved once, here.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

Tensor = torch.Tensor
ProcessGroup = dist.ProcessGroup


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
    """Exchange one small int64 row with every rank, started without waiting: row ``d`` of the
    input goes to rank ``d``.

    Args:
        send_W_C: ``[world_size, C]`` int64; row ``d`` is what this rank tells rank ``d``.
        group: the process group.

    Returns:
        ``(recv, work)``: ``recv`` ``[world_size, C]``, row ``s`` what rank ``s`` told this
        rank, once `wait` on ``work`` has returned (as `start_all_to_all_flat`).
    """
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
    """Every rank's ``data``, rank order (`all_gather_sized`: the lengths, then the padded
    bytes; each all-gather bounded by ``timeout``)."""
    values = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0)
    _, parts = all_gather_sized(torch.tensor([len(data)]), values.to(torch.uint8), group, timeout)
    return [p.cpu().numpy().tobytes() for p in parts]


def broadcast_object(obj: Any, group: ProcessGroup | None) -> Any:
    """Rank 0's ``obj`` (of ``group``) on every rank (the group should serve CPU tensors)."""
    shared: list[Any] = [obj]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(shared, src=src, group=group)
    return shared[0]


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
