"""Backend choice for table-batched embedding kernels: fbgemm's or recopt's own.

`create_kernel` is what modules call; `choose_backend` resolves `Backend.AUTO` (fbgemm where
it cannot run the tables is ruled out here; `recopt.kernels.autotune` measures the rest).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from recopt.kernels.autotune import ShapeClass, default_resolver
from recopt.kernels.backends import kernel_class
from recopt.kernels.config import (
    Backend,
    FusedOptimizerConfig,
    PoolingType,
    TableSpec,
    validate_kernel_layout,
)
from recopt.kernels.contract import BackendDecision, Kernel
from recopt.kernels.fbgemm_backend import (  # fbgemm itself is imported only when used
    fbgemm_auto_objections,
    fbgemm_problems,
)
from recopt.kernels.placement import placed_off_device, placement_problems


def auto_candidates(
    tables: list[TableSpec],
    optimizer: FusedOptimizerConfig,
    device: torch.device,
    feature_table_map: list[int] | None = None,
) -> tuple[ShapeClass, list[Backend]] | None:
    """What AUTO chooses among for these tables: their shape class and the able backends.

    fbgemm is a candidate where it can run the tables (`fbgemm_problems`) and AUTO has no
    objection to it (`fbgemm_auto_objections`). Pure and local, so every rank reaches the same
    answer (or the same refusal) before any collective.

    Returns:
        ``None`` when ``optimizer.backend`` is explicit (nothing to decide).

    Raises:
        ValueError: a table is placed in UVM where nothing can run it (see `resolve_backend`).
    """
    if optimizer.backend != Backend.AUTO:
        return None
    device = torch.device(device)
    _check_placements(tables, optimizer, device, feature_table_map)
    if placed_off_device(tables):
        return ShapeClass.of(tables, optimizer, device), [Backend.FBGEMM]  # the only UVM kernel
    problems = fbgemm_problems(tables, optimizer, device, feature_table_map)
    problems += fbgemm_auto_objections(optimizer, device)
    candidates = [Backend.RECOPT] if problems else [Backend.FBGEMM, Backend.RECOPT]
    return ShapeClass.of(tables, optimizer, device), candidates


# One kernel as create_kernel sees it: its tables, feature-to-table map and optimizer.
KernelRequest = tuple[list[TableSpec], list[int], FusedOptimizerConfig]
# What AUTO asks of the resolver for one kernel: shape class, optimizer, candidates.
AutoRequest = tuple[ShapeClass, FusedOptimizerConfig, list[Backend]]


def auto_requests(
    kernels: Sequence[KernelRequest], device: torch.device
) -> tuple[list[AutoRequest], ValueError | None]:
    """The AUTO requests of these kernels, or the refusal that stops them.

    The refusal is returned, not raised, so that a rank can tell the others before it raises
    (`recopt.sharding.backend_decisions.share_backend_decisions`).
    """
    requests = []
    try:
        for tables, feature_table_map, optimizer in kernels:
            if optimizer.backend != Backend.AUTO:  # its refusals, here too: before any wait
                resolve_backend(tables, optimizer, device, feature_table_map)
                continue
            request = auto_candidates(tables, optimizer, device, feature_table_map)
            if request is not None:
                requests.append((request[0], optimizer, request[1]))
    except ValueError as err:
        return [], err
    return requests, None


def resolve_requests(
    requests_by_rank: Sequence[Sequence[AutoRequest]],
) -> tuple[dict[str, Any], Exception | None]:
    """Every rank's AUTO requests resolved by this process, as a JSON-able answer.

    Returns:
        ``({"decisions": {shape key: decision json}}, None)``, or ``({"error": message},
        the error)`` when a resolution failed (e.g. a probe kernel that did not build), so
        that rank 0 can tell the others before it raises.
    """
    resolver = default_resolver()
    decisions: dict[str, BackendDecision] = {}
    try:
        for shape, optimizer, candidates in (r for rank in requests_by_rank for r in rank):
            decisions.setdefault(shape.key(), resolver.resolve(shape, optimizer, candidates))
    except Exception as err:  # whatever stops rank 0 must not leave the others waiting
        return {"error": f"{type(err).__name__}: {err}"}, err
    return {"decisions": {k: d.to_json() for k, d in decisions.items()}}, None


def _check_placements(
    tables: list[TableSpec],
    optimizer: FusedOptimizerConfig,
    device: torch.device,
    feature_table_map: list[int] | None,
) -> None:
    """Refuse tables placed in UVM off CUDA, or where fbgemm (the only UVM kernel) cannot run,
    or, under AUTO, where fbgemm runs only when asked for explicitly."""
    problems = placement_problems(tables, device.type)
    if problems:
        raise ValueError("; ".join(problems))
    off_device = placed_off_device(tables)
    if not off_device:
        return
    if optimizer.backend == Backend.RECOPT:
        raise ValueError(
            f"tables {off_device} are placed in UVM, which only the fbgemm backend reads; "
            "use backend 'fbgemm' or 'auto', or placement 'device'"
        )
    fbgemm = fbgemm_problems(tables, optimizer, device, feature_table_map)
    if optimizer.backend == Backend.AUTO:
        fbgemm += fbgemm_auto_objections(optimizer, device)
    if fbgemm:
        raise ValueError(
            f"tables {off_device} are placed in UVM, which only the fbgemm backend reads, and "
            f"fbgemm cannot run this kernel: {'; '.join(fbgemm)}; or use placement 'device'"
        )


def resolve_backend(
    tables: list[TableSpec],
    optimizer: FusedOptimizerConfig,
    device: torch.device,
    feature_table_map: list[int] | None = None,
) -> BackendDecision:
    """`choose_backend` with the reason and the measured times (see `choose_backend`).

    Raises:
        ValueError: ``backend='fbgemm'`` was asked for tables or an optimizer fbgemm cannot run;
            a table placed in UVM off CUDA, or with a backend other than fbgemm.
    """
    device = torch.device(device)
    _check_placements(tables, optimizer, device, feature_table_map)
    if optimizer.backend == Backend.FBGEMM:
        problems = fbgemm_problems(tables, optimizer, device, feature_table_map)
        if problems:
            raise ValueError("; ".join(problems))
        return BackendDecision(backend=Backend.FBGEMM, reason="explicit")
    if optimizer.backend == Backend.RECOPT:
        return BackendDecision(backend=Backend.RECOPT, reason="explicit")
    if device.type == "meta":
        # A placeholder (build on meta, then shard): nothing can be measured on meta, and the
        # sharded module resolves its own kernels on the real device.
        return BackendDecision(backend=Backend.RECOPT, reason="meta device: nothing measured")
    request = auto_candidates(tables, optimizer, device, feature_table_map)
    assert request is not None  # AUTO
    return default_resolver().resolve(request[0], optimizer, request[1])


def choose_backend(
    tables: list[TableSpec],
    optimizer: FusedOptimizerConfig,
    device: torch.device,
    feature_table_map: list[int] | None = None,
) -> Backend:
    """Resolve the backend that runs these tables with this optimizer on this device.

    An explicit ``optimizer.backend`` wins. ``Backend.AUTO`` is fbgemm when a table is placed
    in UVM (kernels/placement.py), recopt when fbgemm cannot run the tables or has a
    defect recopt's kernel lacks (`fbgemm_auto_objections`: LAMB's NaN rows); otherwise
    `recopt.kernels.autotune` decides: a pin (``RECOPT_BACKEND`` or ``AutoConfig.pin``), else
    the faster backend on a probe of these shapes, measured once per machine and shape class
    and cached on disk.

    Args:
        tables: the tables the kernel batches.
        optimizer: the fused optimizer; its ``backend`` field may force a backend.
        device: where the kernel runs.
        feature_table_map: the features' tables, when known (a table shared by several
            features rules out fbgemm's CPU adagrad and row-wise adagrad).

    Returns:
        ``Backend.FBGEMM`` or ``Backend.RECOPT`` (never ``AUTO``).

    Raises:
        ValueError: ``backend='fbgemm'`` was asked for tables or an optimizer fbgemm cannot
            run, or a table is placed in UVM where that cannot run; the message names the
            table and the fix.
    """
    return resolve_backend(tables, optimizer, device, feature_table_map).backend


def create_kernel(
    tables: list[TableSpec],
    feature_table_map: list[int],
    optimizer: FusedOptimizerConfig,
    pooling: PoolingType,
    device: torch.device,
) -> Kernel:
    """Build the kernel that runs these tables, on the backend `choose_backend` picks.

    Args:
        tables: the tables, in kernel order.
        feature_table_map: for each feature (KJT key order), the index of its table.
        optimizer: the fused optimizer (and the requested backend).
        pooling: sum or mean pooling, for every feature of the kernel.
        device: where the weights live and the kernel runs.

    Returns:
        An ``nn.Module`` implementing the `Kernel` contract (kernels/contract.py).

    Raises:
        ValueError: no tables, a feature maps to no table, or a backend that cannot run them.
    """
    validate_kernel_layout(tables, feature_table_map)
    decision = resolve_backend(tables, optimizer, torch.device(device), feature_table_map)
    kernel = kernel_class(decision.backend)(
        tables, feature_table_map, optimizer, pooling, torch.device(device)
    )
    kernel.backend_decision = decision  # read by the modules' param_groups
    return kernel


@contextlib.contextmanager
def rng_unchanged(device: torch.device) -> Iterator[None]:
    """Leave torch's random streams (CPU, and ``device``'s when it is a GPU) as they were.

    Kernel construction may draw random numbers (fbgemm initialises its own weights, AUTO's
    probes make random tables), and how many depends on the backend and on whether AUTO's
    choice was cached. Modules build their kernels inside this, then initialise the weights
    themselves, so one seed gives the same weights whatever backend runs.
    """
    devices = [cuda_index(device)] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        yield


def cuda_index(device: torch.device) -> int:
    """The GPU ``device`` means: its index, or for a bare ``cuda`` the current device (a rank
    that called ``torch.cuda.set_device(r)`` builds on GPU r, not on GPU 0)."""
    return device.index if device.index is not None else torch.cuda.current_device()
