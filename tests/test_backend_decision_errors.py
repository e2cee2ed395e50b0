"""The ranks' shared backend decision stops every rank together when one of them fails.

Rank 0 resolves every rank's AUTO kernels and broadcasts the answer
(recopt/sharding/backend_decisions.py, `share_backend_decisions`). Before issue 23, a rank 0
that raised while resolving (a probe kernel fbgemm could not build, such as bf16 on CUDA) left
the other ranks waiting in the broadcast until the group's timeout; now the error travels in
the broadcast, and a rank whose own kernels are refused says so in the all-gather, so every
rank raises at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
import torch

from recopt.kernels.autotune import AutoConfig, AutoResolver, Sampler, ShapeClass, configure_auto
from recopt.kernels.config import Backend, FusedOptimizerConfig, TableSpec
from recopt.kernels.placement import Location, Placement
from recopt.testing import run_on_ranks

RWA = FusedOptimizerConfig(name="row_wise_adagrad")


def _tables(weight_dtype: str = "fp32", location: Location = Location.DEVICE) -> list[TableSpec]:
    placement = Placement(location=location)
    return [TableSpec(name="t", num_embeddings=64, embedding_dim=8, weight_dtype=weight_dtype,
                      placement=placement)]  # fmt: skip


def _failing_probe(
    shape: ShapeClass,
    optimizer: FusedOptimizerConfig,
    candidates: Sequence[Backend],
    config: AutoConfig,
) -> Mapping[Backend, Sampler]:
    raise RuntimeError(f"probe kernel for {shape.key()} could not be built")


def _decide(rank: int, world_size: int, case: str) -> tuple[str, str]:
    """This rank's outcome of the shared decision: the error's type and message."""
    from recopt.sharding.backend_decisions import share_backend_decisions

    configure_auto(AutoResolver(AutoConfig(), _failing_probe, machine="m"))
    device = torch.device("cpu")
    tables = _tables()
    kernel = (tables, [0], RWA)
    if case == "refused on rank 1" and rank == 1:
        device, tables = torch.device("cuda"), _tables("bf16", Location.UVM)
        kernel = (tables, [0], RWA)
    elif case == "refused on rank 1":
        device = torch.device("cuda")  # described only: nothing runs on it
    elif case == "explicit fbgemm refused on rank 1":
        # an explicit backend is not AUTO's to decide, but its refusal must travel too (a
        # table read by two features: fbgemm's CPU adagrad does not sum their gradients)
        explicit = FusedOptimizerConfig(name="adagrad", backend=Backend.FBGEMM)
        kernel = (tables, [0, 0] if rank == 1 else [0], explicit)
    try:
        share_backend_decisions([kernel], device, None)
    except Exception as err:
        return type(err).__name__, str(err)
    return "no error", ""


def _decide_each(rank: int, world_size: int, cases: list[str]) -> list[tuple[str, str]]:
    return [_decide(rank, world_size, case) for case in cases]


@pytest.mark.multiprocess
def test_a_failure_on_rank_zero_reaches_every_rank() -> None:
    results = run_on_ranks(_decide, 2, "rank 0 fails", timeout_s=60)
    assert results[0] == (
        "RuntimeError",
        "probe kernel for cpu/row_wise_adagrad/dim8/rows64 could not be built",
    )
    kind, message = results[1]
    assert kind == "BackendDecisionError"
    assert "rank 0 failed to decide" in message and "RuntimeError: probe kernel" in message


@pytest.mark.multiprocess
def test_a_rank_whose_kernels_are_refused_stops_the_others() -> None:
    cases = ["refused on rank 1", "explicit fbgemm refused on rank 1"]
    (uvm_0, explicit_0), (uvm_1, explicit_1) = run_on_ranks(_decide_each, 2, cases, timeout_s=60)
    kind, message = uvm_1
    assert kind == "ValueError" and "do not run bf16 weights" in message
    kind, message = uvm_0
    assert kind == "BackendDecisionError"
    assert "rank 1: tables ['t'] are placed in UVM" in message
    # rank 0 used to go on into the next collective and wait for the group's timeout
    kind, message = explicit_1
    assert kind == "ValueError" and "looked up by 2 features" in message
    kind, message = explicit_0
    assert kind == "BackendDecisionError" and "rank 1: table 't' is looked up by 2" in message
