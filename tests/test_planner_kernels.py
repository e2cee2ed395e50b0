"""The planner and measured kernels: `--calibrate` records each optimizer's backend choice and
kernel speed in the topology, and the cost model uses the speed of the backend that will run."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from recopt.kernels.autotune import AutoConfig, AutoResolver, Sampler, ShapeClass, configure_auto
from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.sharding import ShardingType
from recopt.sharding.planner import calibrate as calibration
from recopt.sharding.planner.constraints import TableWorkload
from recopt.sharding.planner.perf import shard_cost
from recopt.sharding.planner.topology import (
    Topology,
    TopologyError,
    load_topology_values,
    topology_from_dict,
)

MEASURED = {"row_wise_adagrad/fbgemm": 4e-7, "row_wise_adagrad/recopt": 1e-7}


@pytest.fixture(autouse=True)
def _restore_default_resolver() -> Iterator[None]:
    previous = configure_auto(None)
    yield
    configure_auto(previous)


def _fake_samplers(
    shape: ShapeClass, optimizer: FusedOptimizerConfig, candidates: Sequence[Backend], _: object
) -> dict[Backend, Sampler]:
    # fbgemm 'takes' 1 ms, recopt 2 ms (4 ms for optimizers fbgemm cannot run).
    seconds = {Backend.FBGEMM: 0.001, Backend.RECOPT: 0.002 if len(candidates) == 2 else 0.004}
    return {b: (lambda s=seconds[b]: s) for b in candidates}


def test_topology_file_round_trip_with_kernels(tmp_path: Path) -> None:
    topo = Topology(
        world_size=2, kernel_backends={"row_wise_adagrad": "recopt"}, kernel_seconds_per_id=MEASURED
    )
    path = tmp_path / "topo.toml"
    path.write_text(topo.to_toml())
    assert topology_from_dict(load_topology_values(path), str(path)) == topo
    assert "kernel" not in Topology(world_size=1).to_toml()
    with pytest.raises(TopologyError, match=r"kernel_backends\['sgd'\] = 'fast'"):
        Topology(world_size=1, kernel_backends={"sgd": "fast"})
    with pytest.raises(TopologyError, match="'sgd' is not '<optimizer>/<backend>'"):
        Topology(world_size=1, kernel_seconds_per_id={"sgd": 1e-7})
    with pytest.raises(TopologyError, match=r"kernel_seconds_per_id\['sgd/recopt'\] must be > 0"):
        Topology(world_size=1, kernel_seconds_per_id={"sgd/recopt": 0.0})


def test_cost_model_uses_the_measured_speed_of_the_backend_that_will_run() -> None:
    plain = Topology(world_size=1)
    topo = plain.replace(
        kernel_backends={"row_wise_adagrad": "recopt"}, kernel_seconds_per_id=MEASURED
    )

    def compute(backend: Backend, topology: Topology, name: str = "row_wise_adagrad") -> float:
        optimizer = FusedOptimizerConfig(name=name, backend=backend)
        workload = TableWorkload(
            batch_size=100, num_features=1, pooling_factor=10.0, optimizer=optimizer
        )
        cost = shard_cost(ShardingType.TABLE_WISE, 1000, 64, 1000, workload, topology)
        return cost.fwd_compute + cost.bwd_compute

    ids = 100 * 10
    assert compute(Backend.AUTO, topo) == pytest.approx(ids * 1e-7)  # AUTO's choice: recopt
    assert compute(Backend.RECOPT, topo) == pytest.approx(ids * 1e-7)
    assert compute(Backend.FBGEMM, topo) == pytest.approx(ids * 4e-7)
    # Not measured (another optimizer, or no calibration): the bytes-moved model, unchanged.
    assert compute(Backend.AUTO, topo, "sgd") == compute(Backend.AUTO, plain, "sgd")
    assert compute(Backend.AUTO, plain) != pytest.approx(ids * 1e-7)


def test_measure_kernels_records_autos_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    configure_auto(AutoResolver(AutoConfig(), _fake_samplers, machine="m"))
    monkeypatch.setattr(calibration, "probe_samplers", _fake_samplers)
    backends, seconds = calibration.measure_kernels("cpu", dim=8, rows=64)
    ids = AutoConfig().probe_bags * AutoConfig().ids_per_bag
    assert backends["row_wise_adagrad"] == "fbgemm" and backends["adam"] == "recopt"
    assert seconds["row_wise_adagrad/fbgemm"] == pytest.approx(0.001 / ids)
    assert seconds["row_wise_adagrad/recopt"] == pytest.approx(0.002 / ids)
    assert seconds["adam/recopt"] == pytest.approx(0.004 / ids) and "adam/fbgemm" not in seconds
    # A pin decides the choice; both backends are still timed for the cost model.
    configure_auto(AutoResolver(AutoConfig(pin=Backend.RECOPT), _fake_samplers, machine="m"))
    backends, seconds = calibration.measure_kernels("cpu", dim=8, rows=64)
    assert backends["row_wise_adagrad"] == "recopt" and "row_wise_adagrad/fbgemm" in seconds
