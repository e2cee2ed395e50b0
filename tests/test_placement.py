"""Table placement (device / UVM / UVM caching): validation, kernel choice, plan JSON, and on a
CUDA host, a UVM-cached fused module trained equal to one in HBM and flushed for checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recopt.checkpoint import load, save
from recopt.kernels.config import Backend, FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.factory import create_kernel, resolve_backend
from recopt.kernels.placement import (
    DEFAULT_CACHE_LOAD_FACTOR,
    Location,
    Placement,
    combined_cache_load_factor,
)
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
from recopt.sharding import (
    ParameterSharding,
    PlanError,
    ShardingPlan,
    ShardingType,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from recopt.sparse import KeyedJaggedTensor

CACHED = Placement(location="uvm_caching", cache_load_factor=0.2)
UVM = Placement(location=Location.UVM)


def test_placement_defaults_and_describe() -> None:
    assert Placement().location is Location.DEVICE and Placement().cache_load_factor is None
    assert Placement(location="uvm_caching").cache_load_factor == DEFAULT_CACHE_LOAD_FACTOR
    assert CACHED.describe() == "uvm_caching(0.2)" and UVM.describe() == "uvm"
    assert [Placement().cache_share, UVM.cache_share, CACHED.cache_share] == [1.0, 0.0, 0.2]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"location": "hbm"}, r"location 'hbm' is unknown; valid: \['device', 'uvm'"),
        ({"location": "uvm", "cache_load_factor": 0.2}, "only for location 'uvm_caching'"),
        ({"location": "device", "cache_load_factor": 0.5}, "only for location 'uvm_caching'"),
        ({"location": "uvm_caching", "cache_load_factor": 0.0}, r"must be in \(0, 1\]"),
        ({"location": "uvm_caching", "cache_load_factor": 1.5}, r"got 1.5; e.g. 0.2"),
        ({"location": "uvm_caching", "cache_load_factor": "big"}, "must be a number"),
    ],
)
def test_placement_rejects_bad_fields(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Placement(**kwargs)  # type: ignore[arg-type]


def test_combined_cache_load_factor_weights_by_rows() -> None:
    placements = [Placement(location="uvm_caching", cache_load_factor=0.1), CACHED, Placement()]
    # 100 rows at 0.1 and 300 at 0.2: 70 cache rows for 400 cached rows; the device table
    # does not count.
    assert combined_cache_load_factor([100, 300, 1000], placements) == pytest.approx(70 / 400)
    assert combined_cache_load_factor([10], [Placement()]) == DEFAULT_CACHE_LOAD_FACTOR


def _spec(placement: Placement, name: str = "t") -> TableSpec:
    return TableSpec(name=name, num_embeddings=16, embedding_dim=8, placement=placement)


@pytest.mark.parametrize("backend", list(Backend))
def test_uvm_on_cpu_is_refused_by_every_backend(backend: Backend) -> None:
    opt = FusedOptimizerConfig(name="sgd", backend=backend)
    with pytest.raises(ValueError, match="'t': placement 'uvm_caching.0.2.' needs a CUDA"):
        create_kernel([_spec(CACHED)], [0], opt, PoolingType.SUM, torch.device("cpu"))


def test_recopt_kernel_refuses_uvm_directly() -> None:
    from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding

    opt = FusedOptimizerConfig(name="sgd")
    with pytest.raises(ValueError, match=r"tables \['t'\]: recopt's kernel .* cannot read UVM"):
        RecoptTableBatchedEmbedding([_spec(UVM)], [0], opt, PoolingType.SUM, torch.device("cpu"))


def test_device_placement_keeps_the_cpu_kernels_working() -> None:
    opt = FusedOptimizerConfig(name="sgd", backend=Backend.RECOPT)
    kernel = create_kernel([_spec(Placement())], [0], opt, PoolingType.SUM, torch.device("cpu"))
    kernel.flush()  # a no-op in device memory
    assert kernel.tables[0].placement == Placement()


def test_fused_module_refuses_uvm_on_cpu_and_unknown_tables() -> None:
    tables = [EmbeddingBagConfig(name="t", num_embeddings=16, embedding_dim=8, feature_names=["f"])]
    with pytest.raises(ValueError, match="needs a CUDA device"):
        FusedEmbeddingBagCollection(tables, table_placements={"t": UVM})
    with pytest.raises(ValueError, match=r"names tables \['u'\], which the collection"):
        FusedEmbeddingBagCollection(tables, table_placements={"u": UVM})
    with pytest.raises(ValueError, match="must be a Placement"):
        FusedEmbeddingBagCollection(tables, table_placements={"t": "uvm"})  # type: ignore[dict-item]


# ------------------------------------------------------------------------------------ plans


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="a", num_embeddings=40, embedding_dim=8, feature_names=["fa"]),
        EmbeddingBagConfig(name="b", num_embeddings=30, embedding_dim=8, feature_names=["fb"]),
    ]


def test_plan_json_round_trips_placement() -> None:
    shardings = construct_module_sharding_plan(
        _tables(), {"a": row_wise(placement=CACHED), "b": table_wise(1, placement=UVM)}, 2
    )
    plan = ShardingPlan({"sparse": shardings})
    again = ShardingPlan.from_json(plan.to_json())
    assert again == plan
    assert again["sparse"]["a"].placement == CACHED
    assert again["sparse"]["b"].placement == UVM
    doc = json.loads(plan.to_json())
    assert doc["plan"]["sparse"]["a"]["placement"] == {
        "location": "uvm_caching",
        "cache_load_factor": 0.2,
    }


def test_old_plan_file_without_placement_loads_as_device() -> None:
    # A plan written before placements existed: no "placement" key, shards as 5-item lists.
    old = {
        "version": 1,
        "plan": {
            "sparse": {
                "a": {
                    "sharding_type": "table_wise",
                    "ranks": [0],
                    "shards": [[0, 0, 40, 0, 8]],
                    "backend": "auto",
                    "optimizer": None,
                }
            }
        },
    }
    plan = ShardingPlan.from_json(json.dumps(old))
    assert plan["sparse"]["a"].placement == Placement()


@pytest.mark.parametrize(
    ("placement", "match"),
    [
        ({"location": "disk"}, r"table 'a' \(module 'sparse'\): placement location 'disk'"),
        ({"location": "uvm", "cache_load_factor": 0.3}, "only for location 'uvm_caching'"),
        ({"cache_load_factor": 0.3}, r"missing keys \['location'\]"),
        ({"location": "uvm", "size": 1}, r"unknown keys \['size'\]"),
        ("uvm", "expected a JSON object"),
    ],
)
def test_plan_json_rejects_bad_placement(placement: object, match: str) -> None:
    entry = {
        "sharding_type": "table_wise",
        "ranks": [0],
        "shards": [[0, 0, 40, 0, 8]],
        "backend": "auto",
        "optimizer": None,
        "placement": placement,
    }
    text = json.dumps({"version": 1, "plan": {"sparse": {"a": entry}}})
    with pytest.raises(PlanError, match=match):
        ShardingPlan.from_json(text)


def test_parameter_sharding_takes_a_location_string_and_rejects_others() -> None:
    def sharding(placement: object) -> ParameterSharding:
        return ParameterSharding(
            sharding_type=ShardingType.TABLE_WISE,
            ranks=(0,),
            placement=placement,  # type: ignore[arg-type]
        )

    assert sharding("uvm").placement == UVM
    with pytest.raises(PlanError, match="placement: placement location 'disk' is unknown"):
        sharding("disk")
    with pytest.raises(PlanError, match="must be a Placement or a location string, got 3"):
        sharding(3)


def test_uvm_table_on_recopt_kernel_or_row_stat_layout_is_a_plan_error() -> None:
    from recopt.sharding.layout import resolve_optimizer

    table = _tables()[0]
    opt = FusedOptimizerConfig(name="row_wise_adagrad")
    on_recopt = ParameterSharding(
        sharding_type=ShardingType.TABLE_WISE,
        ranks=(0,),
        backend=Backend.RECOPT,
        placement=UVM,
    )
    with pytest.raises(PlanError, match="backend is 'recopt'; use 'auto' or 'fbgemm'"):
        resolve_optimizer(table, on_recopt, opt, "sparse")
    column = ParameterSharding(sharding_type=ShardingType.COLUMN_WISE, ranks=(0,), placement=UVM)
    with pytest.raises(PlanError, match="full-row statistic hook"):
        resolve_optimizer(table, column, opt, "sparse")
    fine = ParameterSharding(sharding_type=ShardingType.TABLE_WISE, ranks=(0,), placement=UVM)
    # Explicitly fbgemm, so UVM shards never share an AUTO kernel with device shards.
    assert resolve_optimizer(table, fine, opt, "sparse").backend is Backend.FBGEMM


# ----------------------------------------------------------------------------- CUDA only


def _batch(device: torch.device, seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (2 * 8,), generator=g)
    ids = torch.cat(
        [
            torch.randint(0, 40, (int(lengths[:8].sum()),), generator=g),
            torch.randint(0, 30, (int(lengths[8:].sum()),), generator=g),
        ]
    )
    return KeyedJaggedTensor(keys=["fa", "fb"], values=ids.to(device), lengths=lengths.to(device))


def _train(placements: dict[str, Placement], steps: int) -> FusedEmbeddingBagCollection:
    device = torch.device("cuda")
    torch.manual_seed(0)
    # fbgemm in HBM too: the tests compare placements, not backends.
    optimizer = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.1, backend=Backend.FBGEMM)
    module = FusedEmbeddingBagCollection(
        _tables(),
        optimizer=optimizer,
        device=device,
        table_placements=placements,
    )
    for step in range(steps):
        module(_batch(device, step)).values().square().sum().backward()
    return module


@pytest.mark.cuda
def test_cuda_uvm_caching_and_uvm_train_equal_to_device() -> None:
    reference = _train({}, steps=4)
    placed = _train({"a": CACHED, "b": UVM}, steps=4)
    assert all(k.backend is Backend.FBGEMM for k in placed.kernels())
    for kernel in placed.kernels():
        kernel.flush()
    ref_state, state = reference.state_dict(), placed.state_dict()
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key].cpu(), value.cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_cuda_checkpoint_flushes_the_cache_and_loads_across_placements(tmp_path: Path) -> None:
    placed = _train({"a": CACHED}, steps=3)
    # Not flushed by hand: save must write back the cached rows itself.
    save(tmp_path / "ckpt", placed, placed.fused_optimizer)
    reference = _train({}, steps=3)
    on_device = _train({}, steps=0)
    load(tmp_path / "ckpt", on_device, on_device.fused_optimizer)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(on_device.state_dict()[key].cpu(), value.cpu())
    ref_opt = reference.fused_optimizer.state_dict()["state"]
    for key, value in on_device.fused_optimizer.state_dict()["state"].items():
        torch.testing.assert_close(value, ref_opt[key])
    # And back into a cached module that has cached rows of its own: the load wins.
    cached_again = _train({"a": CACHED}, steps=1)
    load(tmp_path / "ckpt", cached_again, cached_again.fused_optimizer)
    cached_again(_batch(torch.device("cuda"), 3)).values().square().sum().backward()
    reference(_batch(torch.device("cuda"), 3)).values().square().sum().backward()
    for kernel in cached_again.kernels():
        kernel.flush()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(cached_again.state_dict()[key].cpu(), value.cpu())


@pytest.mark.cuda
def test_cuda_auto_backend_is_fbgemm_for_a_cached_table() -> None:
    opt = FusedOptimizerConfig(name="row_wise_adagrad")
    decision = resolve_backend([_spec(CACHED)], opt, torch.device("cuda"), [0])
    assert decision.backend is Backend.FBGEMM
