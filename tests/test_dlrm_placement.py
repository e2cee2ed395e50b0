"""The DLRM script's ``[embedding.placements]``: parsing, validation, and where it goes."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from recopt.kernels import Placement

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "dlrm"))

import dlrm_config  # noqa: E402
import train as dlrm_train  # noqa: E402


def test_placements_default_to_none_named() -> None:
    assert dlrm_config.load_config(None).embedding.placements == {}


def test_placements_from_a_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        '[embedding.placements]\nt0 = "uvm_caching"\nt1 = "device"\n'
        't2 = { location = "uvm_caching", cache_load_factor = 0.1 }\nt3 = "uvm"\n'
    )
    placements = dlrm_config.load_config(str(path)).embedding.placements
    assert placements == {
        "t0": Placement(location="uvm_caching", cache_load_factor=0.2),
        "t1": Placement(),
        "t2": Placement(location="uvm_caching", cache_load_factor=0.1),
        "t3": Placement(location="uvm"),
    }


def test_placements_from_an_override() -> None:
    config = dlrm_config.load_config(None, ["embedding.placements.t4=uvm"])
    assert config.embedding.placements == {"t4": Placement(location="uvm")}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("embedding.placements.t0=hbm", r"embedding\.placements\.t0 = 'hbm': placement location"),
        ("embedding.placements.nope=uvm", r"names tables \['nope'\] that are not in"),
        (
            'embedding.placements.t0={location = "uvm", cache_load_factor = 0.3}',
            r"embedding\.placements\.t0 = .*only for location 'uvm_caching'",
        ),
        (
            'embedding.placements.t0={location = "uvm_caching", cache_load_factor = 3.0}',
            r"cache_load_factor must be in \(0, 1\]",
        ),
        ("embedding.placements.t0=3", "must be a location string or a table"),
    ],
)
def test_bad_placements_name_the_table_and_the_fix(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dlrm_config.load_config(None, [override])


def test_uvm_on_a_cpu_run_is_refused_with_the_fix() -> None:
    import torch

    config = dlrm_config.load_config(None, ["embedding.placements.t0=uvm_caching"])
    with pytest.raises(ValueError, match="'t0': placement 'uvm_caching.0.2.' needs a CUDA"):
        dlrm_train.build_model(config, torch.device("cpu"))


# ------------------------------------------------------------------ the planner's topology


def test_planner_topology_follows_a_cuda_run_and_measures_its_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No ``device`` in [planner]: a CUDA run plans against the GPU's free memory (so the
    planner can choose UVM), and fields given in [planner] still win."""
    import datetime

    import dlrm_build
    from test_model_parallel_topology import MIB, fake_gpus

    from recopt.sharding.planner.topology import host_memory_bytes

    fake_gpus(monkeypatch.setattr, [3000], total_mib=4000)
    timeout = datetime.timedelta(seconds=30)
    config = dlrm_config.load_config(None)
    cuda = dlrm_build.RunEnv(world_size=1, device=torch.device("cuda", 0))
    measured = dlrm_build.planning_topology(config.planner, cuda, timeout)
    assert measured.device == "cuda"
    assert measured.hbm_bytes == 3000 * MIB
    assert measured.ddr_bytes == host_memory_bytes(1)  # measured too: the config sets none
    given = dlrm_build.planning_topology({"hbm_bytes": 1024, "ddr_bytes": 2048}, cuda, timeout)
    assert (given.device, given.hbm_bytes, given.ddr_bytes) == ("cuda", 1024, 2048)
    for path in ("configs/dlrm_small.toml", "configs/dlrm_criteo_shape.toml"):  # measure too
        shipped = dlrm_config.load_config(str(ROOT / path)).planner
        assert dlrm_build.planning_topology(shipped, cuda, timeout) == measured
    # An explicit device describes a machine: nothing is measured.
    cpu = dlrm_build.planning_topology({"device": "cpu"}, cuda, timeout)
    assert (cpu.device, cpu.hbm_bytes) == ("cpu", 0)
    on_cpu = dlrm_build.RunEnv(world_size=1)
    assert dlrm_build.planning_topology(config.planner, on_cpu, timeout).device == "cpu"
