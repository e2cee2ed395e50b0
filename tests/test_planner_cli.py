"""recopt-plan (CLI and calibration) and planning inside a job (plan_collectively)."""

from __future__ import annotations

import datetime
import random
import re
from pathlib import Path

import pytest
import torch

from recopt.modules import EmbeddingBagConfig
from recopt.sharding import ShardingPlan, ShardingType, validate_plan
from recopt.sharding.planner import (
    EmbeddingShardingPlanner,
    PlannerError,
    Topology,
    plan_collectively,
)
from recopt.sharding.planner.cli import main, read_config
from recopt.sharding.planner.topology import load_topology_values
from recopt.testing import run_on_ranks

EXAMPLE = Path(__file__).resolve().parents[1] / "configs" / "planner_example.toml"


def random_tables(n: int, seed: int, max_rows: int) -> list[EmbeddingBagConfig]:
    rng = random.Random(seed)
    return [
        EmbeddingBagConfig(
            name=f"t{i}",
            num_embeddings=rng.randint(100, max_rows),
            embedding_dim=rng.choice([8, 16, 32]),
            feature_names=(f"f{i}",),
        )
        for i in range(n)
    ]


# --------------------------------------------------------------------------------------------
# CLI


def test_cli_on_the_example_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main([str(EXAMPLE), "--world-size", "8", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "estimated step" in printed and "query_terms" in printed
    plan = ShardingPlan.load(out)
    config = read_config(str(EXAMPLE))
    validate_plan(plan, {"sparse.ebc": config.tables}, 8, 8)
    qt = plan["sparse.ebc"]["query_terms"]
    assert qt.sharding_type in (
        ShardingType.ROW_WISE,
        ShardingType.COLUMN_WISE,
        ShardingType.TABLE_WISE,
    )
    assert qt.optimizer is not None and qt.optimizer.name == "adam"


def test_cli_module_path_overrides_the_configs(tmp_path: Path) -> None:
    """``--module-path`` puts the tables under another module than ``[planner] module_path``
    (a DLRM config's tables live under ``embedding_bags`` in the script's model)."""
    out = tmp_path / "plan.json"
    argv = [str(EXAMPLE), "--world-size", "2", "--output", str(out)]
    assert main([*argv, "--module-path", "embedding_bags"]) == 0
    plan = ShardingPlan.load(out)
    assert list(plan.plan) == ["embedding_bags"]
    assert set(plan["embedding_bags"]) == {t.name for t in read_config(str(EXAMPLE)).tables}


def test_plan_json_shards_have_named_fields_and_the_old_form_still_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    out = tmp_path / "plan.json"
    assert main([str(EXAMPLE), "--world-size", "4", "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    shards = [s for tables in doc["plan"].values() for t in tables.values() for s in t["shards"]]
    assert shards and all(
        set(s) == {"rank", "row_offset", "num_rows", "col_offset", "num_cols"} for s in shards
    )
    plan = ShardingPlan.load(out)
    for tables in doc["plan"].values():  # the unlabeled 5-tuples earlier versions wrote
        for t in tables.values():
            t["shards"] = [
                [s["rank"], s["row_offset"], s["num_rows"], s["col_offset"], s["num_cols"]]
                for s in t["shards"]
            ]
    assert ShardingPlan.from_json(json.dumps(doc)) == plan
    # The stats table shows the assumed usable memory per rank next to each rank's usage.
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.split()[:2] == ["rank", "memory"])
    assert "of usable" in header
    usable = re.search(r"usable memory per rank (\S+ \S+) of", printed)
    assert usable is not None
    rows = [line for line in printed.splitlines() if re.match(r"\s+[0-3] ", line)][:4]
    assert len(rows) == 4 and all(usable.group(1) in row for row in rows)


def test_cli_topology_file_overrides_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topo = tmp_path / "topo.toml"
    topo.write_text("ddr_bytes = 1000\n")  # far too small: the plan must fail on memory
    assert main([str(EXAMPLE), "--world-size", "2", "--topology", str(topo)]) == 1
    assert "the tables need at least 1.94 GiB in total" in capsys.readouterr().err


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "model.toml"
    path.write_text(text)
    return str(path)


TABLE = (
    '[[embedding.tables]]\nname = "t"\nnum_embeddings = 10\nembedding_dim = 4\n'
    'feature_names = ["f"]\n'
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[model]\n", r"no \[\[embedding.tables\]\]"),
        (TABLE + "colour = 1\n", r"entry 0 \('t'\): unknown keys \['colour'\]"),
        (TABLE.replace("10", "0"), r"entry 0 \('t'\): .*num_embeddings must be an int >= 1, got 0"),
        (
            TABLE + "[embedding.optimizer]\nname = 'sgd'\nmomentum = 0.9\n",
            r"\[embedding.optimizer\]: unknown keys \['momentum'\]",
        ),
        (TABLE + "[planner]\nbatch = 3\n", r"\[planner\] has unknown keys \['batch'\]"),
        (TABLE + "[planner]\nbatch_size = '3'\n", r"\[planner\] batch_size must be int, got '3'"),
        (
            TABLE + "[planner.constraints.t]\nsharding = 1\n",
            r"constraints for table 't': unknown keys \['sharding'\]",
        ),
        (
            TABLE + "[planner.constraints.t]\noptimizer = {name = 'lion'}\n",
            "constraints for table 't'.*'lion' is unknown",
        ),
        ("embedding = 3\n[[x]]\n", r"no \[\[embedding.tables\]\]"),
        ("not toml [", "cannot read the config"),
    ],
)
def test_cli_config_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    assert main([_write(tmp_path, text), "--world-size", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("recopt-plan: error: ")
    assert re.search(message, err), err


def test_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(EXAMPLE)]) == 2
    assert "give a config and --world-size" in capsys.readouterr().err
    # (a batch size of 0 used to plan silently with the config's; -1 tables listed 7 of 8)
    for flag in ("--batch-size", "--max-tables"):
        for value in ("0", "-1"):
            assert main([str(EXAMPLE), "--world-size", "2", flag, value]) == 2
            assert f"{flag} must be >= 1, got {value}" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# planning inside a job


def _collective_rank(
    rank: int, world_size: int, tables: list[EmbeddingBagConfig]
) -> tuple[str, str]:
    timeout = datetime.timedelta(seconds=60)
    planner = EmbeddingShardingPlanner(Topology(world_size=world_size), batch_size=64)
    plan = plan_collectively(planner, {"m": tables}, timeout=timeout)
    tiny = EmbeddingShardingPlanner(Topology(world_size=world_size, ddr_bytes=1024))
    try:
        plan_collectively(tiny, {"m": tables}, timeout=timeout)
        failure = "no error"
    except PlannerError as e:
        failure = str(e)
    wrong = EmbeddingShardingPlanner(Topology(world_size=world_size + 1))
    with pytest.raises(PlannerError, match=f"world_size {world_size + 1} but the process group"):
        plan_collectively(wrong, {"m": tables}, timeout=timeout)
    return plan.to_json(), failure


@pytest.mark.multiprocess
def test_plan_collectively_broadcasts_plan_and_failure() -> None:
    tables = random_tables(10, seed=9, max_rows=5000)
    results = run_on_ranks(_collective_rank, 2, tables, timeout_s=120)
    (plan0, fail0), (plan1, fail1) = results
    assert plan0 == plan1
    assert ShardingPlan.from_json(plan0) == EmbeddingShardingPlanner(
        Topology(world_size=2), batch_size=64
    ).plan({"m": tables})
    assert (
        "need at least" in fail0
        and "planning on rank 0 failed: PlannerError: the tables need" in fail1
    )


@pytest.mark.multiprocess
def test_calibrate_writes_a_topology_the_cli_reads_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from recopt.sharding.planner import calibrate as calibration

    full = calibration.calibrate
    monkeypatch.setattr(calibration, "calibrate", lambda rph: full(rph, quick=True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU topology, also on GPUs
    topo_file = tmp_path / "topo.toml"
    assert main(["--calibrate", "--ranks-per-host", "2", "--output", str(topo_file)]) == 0
    text = topo_file.read_text()
    assert "inter_host_bandwidth is NOT measured" in text and "world_size" not in text
    values = load_topology_values(topo_file)
    assert values["memory_bandwidth"] > 1e6 and values["intra_host_bandwidth"] > 1e5
    assert values["ranks_per_host"] == 2 and values["device"] == "cpu"
    assert values["kernel_backends"]["row_wise_adagrad"] in ("fbgemm", "recopt")
    assert values["kernel_seconds_per_id"]["adam/recopt"] > 0.0
    assert main([str(EXAMPLE), "--world-size", "4", "--topology", str(topo_file)]) == 0
    assert "estimated step" in capsys.readouterr().out


BIG_TABLE = TABLE.replace("num_embeddings = 10", "num_embeddings = 40000000").replace(
    "embedding_dim = 4", "embedding_dim = 64"
)  # 9.5 GiB with its optimizer state: more than two ranks of the default 4 GiB


@pytest.mark.parametrize(
    ("planner", "topology", "source"),
    [
        ("", None, "the default ddr_bytes: no [planner] ddr_bytes in"),
        ("[planner]\nddr_bytes = 4294967296\n", None, "[planner] ddr_bytes of"),
        ("", "ddr_bytes = 4294967296\n", "ddr_bytes of --topology"),
        ("", 'device = "cuda"\nhbm_bytes = 4294967296\n', "hbm_bytes of --topology"),
    ],
)
def test_cli_out_of_memory_names_the_setting_and_where_it_came_from(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    planner: str,
    topology: str | None,
    source: str,
) -> None:
    argv = [_write(tmp_path, BIG_TABLE + planner), "--world-size", "2"]
    if topology is not None:
        (tmp_path / "topo.toml").write_text(topology)
        argv += ["--topology", str(tmp_path / "topo.toml")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    key = "hbm_bytes" if "cuda" in (topology or "") else "ddr_bytes"
    assert f"ranks of 4.00 GiB each ({source}" in err
    assert f"set it in the config's [planner] section ({key} = <bytes per rank>" in err
    # The root module is called as the stats table calls it, never ''.
    assert "'t' (module (root))" in err and "(module '')" not in err


def test_cli_root_module_is_root_in_table_and_messages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([_write(tmp_path, TABLE), "--world-size", "1"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("t "))
    assert row.split()[1] == "(root)"
    constrained = TABLE + "[planner.constraints.t]\nsharding_types = ['row_wise']\n"
    constrained += "optimizer = {name = 'adafactor'}\n"  # table-wise or data-parallel only
    assert main([_write(tmp_path, constrained), "--world-size", "2"]) == 1
    assert "table 't' (module (root))" in capsys.readouterr().err
