"""What the fbgemm backend refuses, and what AUTO then picks, on CPU and (described) CUDA.

fbgemm-gpu has no bf16 weights on either build (issue 23, defect 1), ignores ``weight_decay``
for sgd and adagrad everywhere and for row-wise adagrad on CPU (defect 2), and its LAMB writes
NaN into a row whose direction is zero (likely item): each is a refusal or an AUTO objection
decided locally, before any collective. CUDA is described by ``torch.device("cuda")``: the
checks read only its type. The real kernels on a GPU: tests/test_cuda.py.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from recopt.kernels.autotune import ENV_BACKEND, default_resolver
from recopt.kernels.config import Backend, FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.factory import auto_candidates, create_kernel, resolve_backend
from recopt.kernels.fbgemm_backend import (
    FBGEMM_OPTIMIZERS,
    build_fbgemm_tbe,
    fbgemm_auto_objections,
    fbgemm_problems,
)
from recopt.kernels.placement import Location, Placement
from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding
from recopt.kernels.registry import fbgemm_spec_names
from recopt.modules import EmbeddingBagConfig
from recopt.sharding.layout import resolve_optimizer
from recopt.sharding.plan import PlanError
from recopt.sharding.plan_helpers import construct_module_sharding_plan, table_wise
from recopt.sharding.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    PlannerError,
    Topology,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
UVM = Placement(location=Location.UVM)
GIB = 2**30


def _tables(weight_dtype: str = "fp32", placement: Placement | None = None) -> list[TableSpec]:
    extra = {} if placement is None else {"placement": placement}
    return [
        TableSpec(
            name="t0", num_embeddings=30, embedding_dim=8, weight_dtype=weight_dtype, **extra
        ),
        TableSpec(
            name="t1", num_embeddings=20, embedding_dim=4, weight_dtype=weight_dtype, **extra
        ),
    ]


# bf16 weights (defect 1) ---------------------------------------------------------------------


# Every optimizer of each fbgemm build, with its device type.
FBGEMM_RUNS = [(n, d) for d in ("cpu", "cuda") for n in sorted(fbgemm_spec_names(d))]


@pytest.mark.parametrize(("name", "device_type"), FBGEMM_RUNS)
def test_fbgemm_refuses_bf16_weights_on_every_device(name: str, device_type: str) -> None:
    device = torch.device(device_type)
    optimizer = FusedOptimizerConfig(name=name, stochastic_rounding=False)
    problems = fbgemm_problems(_tables("bf16"), optimizer, device)
    (bf16,) = [p for p in problems if "bf16" in p]
    assert "'t0', 't1'" in bf16 and "weight_dtype='fp16' or 'fp32'" in bf16
    assert fbgemm_problems(_tables("fp16"), optimizer, device) == []
    request = auto_candidates(_tables("bf16"), optimizer, device)
    assert request is not None and request[1] == [Backend.RECOPT]
    forced = dataclasses.replace(optimizer, backend=Backend.FBGEMM)
    with pytest.raises(ValueError, match="do not run bf16 weights"):
        resolve_backend(_tables("bf16"), forced, device)


@pytest.mark.real_backend
def test_auto_runs_bf16_on_recopt_on_cuda_without_a_pin() -> None:
    optimizer = FusedOptimizerConfig(name="row_wise_adagrad")
    decision = resolve_backend(_tables("bf16"), optimizer, CUDA)
    assert (decision.backend, decision.reason) == (Backend.RECOPT, "only candidate")


@pytest.mark.parametrize("backend", [Backend.AUTO, Backend.FBGEMM])
def test_bf16_in_uvm_is_refused_at_build_naming_the_fixes(backend: Backend) -> None:
    optimizer = FusedOptimizerConfig(name="row_wise_adagrad", backend=backend)
    fixes = r"weight_dtype='fp16' or 'fp32', or keep bf16 in device memory \(placement 'device'\)"
    with pytest.raises(ValueError, match=f"placed in UVM.*{fixes}"):
        resolve_backend(_tables("bf16", UVM), optimizer, CUDA)
    if backend is Backend.AUTO:  # refused where AUTO's candidates are listed, on every rank
        with pytest.raises(ValueError, match=fixes):
            auto_candidates(_tables("bf16", UVM), optimizer, CUDA)
    assert resolve_backend(_tables("fp16", UVM), optimizer, CUDA).backend is Backend.FBGEMM


def _uvm_table(weight_dtype: str) -> tuple[EmbeddingBagConfig, object]:
    table = EmbeddingBagConfig(
        name="t", num_embeddings=64, embedding_dim=8, feature_names=["f"], weight_dtype=weight_dtype
    )
    plan = construct_module_sharding_plan([table], {"t": table_wise(0, placement=UVM)}, 2)
    return table, plan["t"]


def test_a_plan_with_bf16_in_uvm_is_refused_on_every_rank_before_any_kernel() -> None:
    optimizer = FusedOptimizerConfig(name="row_wise_adagrad")
    table, ps = _uvm_table("bf16")
    with pytest.raises(PlanError, match="table 't'.*'uvm'.*do not run bf16 weights"):
        resolve_optimizer(table, ps, optimizer, "m")  # type: ignore[arg-type]
    table, ps = _uvm_table("fp16")
    resolved = resolve_optimizer(table, ps, optimizer, "m")  # type: ignore[arg-type]
    assert resolved.backend is Backend.FBGEMM


def test_the_planner_keeps_bf16_tables_out_of_uvm() -> None:
    # 1M x 64 bf16 rows (128 MB) on a GPU with 100 MB of HBM: fits only in UVM, which fbgemm
    # (the only UVM kernel) cannot run in bf16, so the planner has no placement for it.
    topo = Topology(world_size=1, device="cuda", hbm_bytes=100 * 2**20, ddr_bytes=64 * GIB)

    def plan(weight_dtype: str) -> Placement:
        table = EmbeddingBagConfig(
            name="t",
            num_embeddings=1_000_000,
            embedding_dim=64,
            feature_names=["f"],
            weight_dtype=weight_dtype,
        )
        planner = EmbeddingShardingPlanner(topo, batch_size=512)
        return planner.plan({"m": [table]})["m"]["t"].placement

    assert not plan("fp16").on_device  # the same table in fp16 goes to UVM
    with pytest.raises(PlannerError, match="does not fit|short by"):
        plan("bf16")


# weight decay (defect 2) ---------------------------------------------------------------------

# (optimizer, device type): does fbgemm apply weight_decay as recopt does there?
DECAY_APPLIED = {
    ("sgd", "cpu"): False,
    ("sgd", "cuda"): False,
    ("adagrad", "cpu"): False,
    ("adagrad", "cuda"): False,
    ("row_wise_adagrad", "cpu"): False,
    ("row_wise_adagrad", "cuda"): True,
    ("lamb", "cuda"): True,
    ("row_wise_lamb", "cuda"): True,
}


@pytest.mark.parametrize(("name", "device_type"), sorted(DECAY_APPLIED))
def test_fbgemm_refuses_weight_decay_where_it_ignores_it(name: str, device_type: str) -> None:
    device = torch.device(device_type)
    decayed = FusedOptimizerConfig(name=name, weight_decay=0.5)
    problems = fbgemm_problems(_tables(), decayed, device)
    if DECAY_APPLIED[(name, device_type)]:
        assert problems == []
        return
    (problem,) = problems
    assert f"fbgemm's {device_type} {name!r} ignores weight_decay (weight_decay=0.5" in problem
    assert "backend='recopt' or 'auto', or weight_decay=0" in problem
    request = auto_candidates(_tables(), decayed, device)
    assert request is not None and request[1] == [Backend.RECOPT]
    with pytest.raises(ValueError, match="ignores weight_decay"):
        resolve_backend(_tables(), dataclasses.replace(decayed, backend=Backend.FBGEMM), device)
    assert fbgemm_problems(_tables(), FusedOptimizerConfig(name=name), device) == []


def _train(kernel: torch.nn.Module, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 20, (24,), generator=gen)  # 4 bags a feature, 3 ids each
        offsets = torch.arange(0, 25, 3)
        kernel(ids, offsets).backward(torch.randn(4, 12, generator=gen))


@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
@pytest.mark.parametrize("name", sorted(FBGEMM_OPTIMIZERS))
def test_fbgemm_equals_recopt_with_weight_decay_where_both_run_on_cpu(
    name: str, weight_decay: float
) -> None:
    """Where fbgemm is allowed, its update is recopt's; where it is refused, running its kernel
    anyway (built directly) shows why: it leaves the decay out."""
    optimizer = FusedOptimizerConfig(name=name, lr=0.1, weight_decay=weight_decay)
    tables = _tables()
    recopt = RecoptTableBatchedEmbedding(tables, [0, 1], optimizer, PoolingType.SUM, CPU)
    fbgemm = build_fbgemm_tbe(tables, [0, 1], optimizer, PoolingType.SUM, CPU)
    pairs = list(
        zip(recopt.split_embedding_weights(), fbgemm.split_embedding_weights(), strict=True)
    )
    with torch.no_grad():
        for mine, theirs in pairs:
            theirs.copy_(mine)
    _train(recopt, 3)
    _train(fbgemm, 3)
    diffs = [float((mine - theirs).abs().max()) for mine, theirs in pairs]
    if fbgemm_problems(tables, optimizer, CPU):
        assert weight_decay > 0 and max(diffs) > 1e-3  # fbgemm's result is not recopt's
    else:
        assert max(diffs) < 1e-5


@pytest.mark.real_backend
def test_auto_picks_recopt_for_weight_decay_fbgemm_would_ignore() -> None:
    for name in ("sgd", "adagrad", "row_wise_adagrad"):
        decayed = FusedOptimizerConfig(name=name, weight_decay=0.1)
        kernel = create_kernel(_tables(), [0, 1], decayed, PoolingType.SUM, CPU)
        assert kernel.backend is Backend.RECOPT
        assert kernel.backend_decision is not None
        assert kernel.backend_decision.reason == "only candidate"


# LAMB's zero-direction rows (likely item) ----------------------------------------------------


@pytest.mark.parametrize("name", ["lamb", "row_wise_lamb"])
def test_auto_never_picks_fbgemms_lamb_but_an_explicit_request_runs_it(name: str) -> None:
    optimizer = FusedOptimizerConfig(name=name)
    (objection,) = fbgemm_auto_objections(optimizer, CUDA)
    assert "writes NaN" in objection and "backend='fbgemm'" in objection
    assert fbgemm_problems(_tables(), optimizer, CUDA) == []  # it can run them
    request = auto_candidates(_tables(), optimizer, CUDA)
    assert request is not None and request[1] == [Backend.RECOPT]
    forced = dataclasses.replace(optimizer, backend=Backend.FBGEMM)
    assert resolve_backend(_tables(), forced, CUDA).backend is Backend.FBGEMM
    # In UVM only fbgemm runs: AUTO refuses to choose it silently, an explicit request runs.
    with pytest.raises(ValueError, match=r"placed in UVM.*writes NaN.*backend='fbgemm'"):
        resolve_backend(_tables(placement=UVM), optimizer, CUDA)
    assert resolve_backend(_tables(placement=UVM), forced, CUDA).backend is Backend.FBGEMM


def test_lamb_in_uvm_needs_fbgemm_asked_for_in_the_plan_and_the_planner() -> None:
    table, ps = _uvm_table("fp32")
    with pytest.raises(PlanError, match="table 't'.*'uvm'.*writes NaN"):
        resolve_optimizer(table, ps, FusedOptimizerConfig(name="lamb"), "m")  # type: ignore[arg-type]
    forced = FusedOptimizerConfig(name="lamb", backend=Backend.FBGEMM)
    assert resolve_optimizer(table, ps, forced, "m").backend is Backend.FBGEMM  # type: ignore[arg-type]
    # 1M x 64 with LAMB's two fp32 moments (768 MB) fits a 100 MB GPU only in UVM: the planner
    # puts it there only when the table's constraints ask for fbgemm.
    topo = Topology(world_size=1, device="cuda", hbm_bytes=100 * 2**20, ddr_bytes=64 * GIB)
    big = EmbeddingBagConfig(
        name="t", num_embeddings=1_000_000, embedding_dim=64, feature_names=["f"]
    )
    lamb = {"m": {"t": FusedOptimizerConfig(name="lamb")}}
    with pytest.raises(PlannerError, match="does not fit|short by"):
        EmbeddingShardingPlanner(topo, batch_size=512).plan({"m": [big]}, lamb)
    only_fbgemm = {"t": ParameterConstraints(backends=(Backend.FBGEMM,))}
    plan = EmbeddingShardingPlanner(topo, batch_size=512, constraints=only_fbgemm).plan(
        {"m": [big]}, lamb
    )
    assert not plan["m"]["t"].placement.on_device


def test_other_optimizers_have_no_objection() -> None:
    for name in sorted(fbgemm_spec_names("cuda") - {"lamb", "row_wise_lamb"}):
        assert fbgemm_auto_objections(FusedOptimizerConfig(name=name), CUDA) == []
    assert fbgemm_auto_objections(FusedOptimizerConfig(name="lamb"), CPU) == []


# the test suite's pin (item 5) ---------------------------------------------------------------


def test_unmarked_tests_run_pinned_to_recopt() -> None:
    if os.environ.get(ENV_BACKEND) != "recopt":
        pytest.skip(f"pytest was run with {ENV_BACKEND}={os.environ[ENV_BACKEND]}")
    assert default_resolver().config.pin is Backend.RECOPT


@pytest.mark.real_backend
def test_marked_tests_see_autos_real_choice() -> None:
    if os.environ.get(ENV_BACKEND) not in (None, "auto"):
        pytest.skip(f"pytest was run with {ENV_BACKEND}={os.environ[ENV_BACKEND]}")
    assert default_resolver().config.pin is Backend.AUTO


@pytest.mark.real_backend
def test_without_fbgemm_installed_auto_runs_recopt_and_fbgemm_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Python without fbgemm_gpu (a GPU host whose fbgemm build is not on the path) trains
    on recopt's kernels under AUTO, and an explicit fbgemm request names what to install."""
    import recopt.kernels.fbgemm_backend as fbgemm_backend

    monkeypatch.setattr(fbgemm_backend, "fbgemm_installed", lambda: False)
    optimizer = FusedOptimizerConfig(name="row_wise_adagrad")
    for device in (CPU, CUDA):
        request = auto_candidates(_tables(), optimizer, device)
        assert request is not None and request[1] == [Backend.RECOPT]
        decision = resolve_backend(_tables(), optimizer, device)
        assert (decision.backend, decision.reason) == (Backend.RECOPT, "only candidate")
        forced = dataclasses.replace(optimizer, backend=Backend.FBGEMM)
        build = "fbgemm-gpu==" if device.type == "cuda" else "fbgemm-gpu-cpu=="
        with pytest.raises(ValueError, match=f"fbgemm is not installed.*{build}"):
            resolve_backend(_tables(), forced, device)
    kernel = create_kernel(_tables(), [0, 1], optimizer, PoolingType.SUM, CPU)
    assert kernel.backend is Backend.RECOPT
