"""Backend choice for table-batched embedding kernels: fbgemm's or recopt's own.

`create_kernel` is what modules call; `choose_backend` resolves `Backend.AUTO` (fbgemm where
it cannot run the tables is ruled out here; `recopt.kernels.autotune` measures the rest).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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

    Returns:
        ``None`` when ``optimizer.backend`` is explicit (nothing to decide).
    """
    if optimizer.backend != Backend.AUTO:
        return None
    device = torch.device(device)
    if placed_off_device(tables):
        # Only fbgemm reads UVM; resolve_backend has already refused tables it cannot run.
        return ShapeClass.of(tables, optimizer, device), [Backend.FBGEMM]
    problems = fbgemm_problems(tables, optimizer, device, feature_table_map)
    candidates = [Backend.RECOPT] if problems else [Backend.FBGEMM, Backend.RECOPT]
    return ShapeClass.of(tables, optimizer, device), candidates


def _check_placements(
    tables: list[TableSpec],
    optimizer: FusedOptimizerConfig,
    device: torch.device,
    feature_table_map: list[int] | None,
) -> None:
    """Refuse tables placed in UVM off CUDA, or where fbgemm (the only UVM kernel) cannot run."""
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
    in UVM (kernels/placement.py), recopt when fbgemm cannot run the tables; otherwise
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
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        yield
