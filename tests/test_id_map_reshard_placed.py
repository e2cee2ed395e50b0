"""`recopt-reshard` with a target plan writes every id of an id-mapped table on its owner shard.

A DistributedModelParallel checkpoint saved at 2 ranks row-wise is resharded for 3 ranks
row-wise, table-row-wise and an uneven row-wise plan whose small shards overflow (shard order
unlike rank order). Read back, the written checkpoint holds every live id and candidate on the
shard `route_shard` names, with its saved values. Loaded at 3 ranks, the runtime relocation
moves nothing, and training continues bit for bit as on the existing path (reshard without a
plan, the ids moved by the runtime relocation at the first forward). Damaged or mismatched
inputs raise errors naming the table and the fix.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_id_map_sharded_reshard import (
    MAPPED,
    STEPS,
    TABLES,
    _assert_same_by_id,
    _bags,
    _by_id,
    _full_states,
    _kjt,
    _misplaced,
    _Model,
    _requests,
    _save_at,
)

from recopt.checkpoint import CheckpointError, read_manifest
from recopt.checkpoint.cli import main as reshard_main
from recopt.checkpoint.reader import SafeFileSystemReader
from recopt.checkpoint.reshard import reshard
from recopt.modules import EmbeddingBagConfig, IdMapConfig
from recopt.modules.id_map_rows import route_shard
from recopt.sharding import ShardingPlan, construct_module_sharding_plan
from recopt.sharding.plan import PlanError
from recopt.sharding.sharding_types import ShardSpec
from recopt.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess

WORLD = 3
TRAIN_STEPS = 3
PLANS = ("row_wise", "table_row_wise", "uneven")
# (rank, row_offset, num_rows) of each row shard of t0 and t1 in the uneven plan, in shard
# order: shards 0 and 2 have 2 rows, fewer than the ids routed to them.
UNEVEN = ((2, 0, 2), (0, 2, 56), (1, 58, 2))


def _plan(name: str, world: int) -> ShardingPlan:
    kind = "table_row_wise" if name == "table_row_wise" else "row_wise"
    plan = construct_module_sharding_plan(TABLES, _requests(kind), world)
    if name == "uneven":
        shards = tuple(
            ShardSpec(rank=r, row_offset=offset, num_rows=rows, col_offset=0, num_cols=8)
            for r, offset, rows in UNEVEN
        )
        for table in MAPPED:
            plan[table] = dataclasses.replace(plan[table], shards=shards)
    return ShardingPlan({"sparse": plan})


def _read_back(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole, keyed as `_full_states` keys them."""
    manifest = read_manifest(directory)
    out = {
        k: torch.empty(e.shape, dtype=getattr(torch, e.dtype)) for k, e in manifest.tensors.items()
    }
    with warnings.catch_warnings():  # "torch.distributed is disabled": one process, as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, storage_reader=SafeFileSystemReader(directory), no_dist=True)
    short = {
        k: "/".join(k.split("/", 1)[1:] if k.startswith("model/") else k.rsplit("/", 2)[1:])
        for k in out
    }
    return {short[k]: v for k, v in out.items()}


def _owners_wrong(full: dict[str, torch.Tensor], plan: ShardingPlan) -> dict[str, int]:
    """Per mapped table: live ids and candidates written outside their owner shard's range."""
    wrong = {}
    for table in TABLES:
        if table.name not in MAPPED:
            continue
        assert table.id_map is not None
        maps = f"sparse.id_maps.{table.name}."
        shards = plan["sparse"][table.name].shards
        live = full[maps + "occupied"].clone()
        if table.id_map.ttl_steps is not None:
            live &= full[maps + "step"] - full[maps + "last_seen"] <= table.id_map.ttl_steps
        shard_of_row = torch.zeros(table.num_embeddings, dtype=torch.int64)
        for k, s in enumerate(shards):
            shard_of_row[s.row_offset : s.row_offset + s.num_rows] = k
        rows = live.nonzero().squeeze(1)
        owner = route_shard(full[maps + "row_ids"][rows], len(shards))
        count = int((owner != shard_of_row[rows]).sum())
        if maps + "candidate_ids" in full:
            total, ends, rows_so_far = table.num_embeddings, [0], 0
            for s in shards:  # candidate slots split in proportion to rows, in shard order
                rows_so_far += s.num_rows
                ends.append(total * rows_so_far // table.num_embeddings)
            slot_shard = torch.zeros(total, dtype=torch.int64)
            for k in range(len(shards)):
                slot_shard[ends[k] : ends[k + 1]] = k
            used = full[maps + "candidate_used"].nonzero().squeeze(1)
            owner = route_shard(full[maps + "candidate_ids"][used], len(shards))
            count += int((owner != slot_shard[used]).sum())
        wrong[table.name] = count
    return wrong


@contextmanager
def _relocation_reports(reports: list[Any]) -> Iterator[None]:
    """Records what every runtime relocation of a sharded collection did on this rank."""
    from recopt.sharding import id_map_sharded

    real = id_map_sharded.relocate

    def recording(*args: Any, **kwargs: Any) -> Any:
        reports.append(real(*args, **kwargs))
        return reports[-1]

    id_map_sharded.relocate = recording
    try:
        yield
    finally:
        id_map_sharded.relocate = real


def _continue_at(rank: int, world: int, root: str, cases: list[tuple[str, str]]) -> list[Any]:
    """Per (plan, checkpoint): misplaced ids after the load, what the runtime relocation
    moved, each step's loss and pooled outputs, and the state after training on."""
    from recopt.checkpoint import load
    from recopt.sharding.model_parallel import DistributedModelParallel

    out = []
    for plan_name, directory in cases:
        dmp = DistributedModelParallel(_Model(), _plan(plan_name, world))
        load(Path(root) / directory, dmp, {"fused": dmp.fused_optimizer})
        misplaced = _misplaced(dmp, "sparse.")
        loaded = _full_states(dmp, "sparse.")
        reports: list[Any] = []
        with _relocation_reports(reports), torch.no_grad():
            dmp.eval()
            dmp(_kjt(_bags(rank, STEPS)))  # relocates (the maps are only read)
            dmp.train()
        relocated = _full_states(dmp, "sparse.")
        sparse = next(m for n, m in dmp.named_modules() if n.endswith("sparse"))
        pooled: list[torch.Tensor] = []
        hook = sparse.register_forward_hook(
            lambda m, i, o, into=pooled: into.append(o.values().detach())
        )
        dense = torch.optim.SGD([p for _, p in dmp.named_parameters()], lr=0.01)
        losses = []
        with _relocation_reports(reports):
            for step in range(STEPS, STEPS + TRAIN_STEPS):
                loss = dmp(_kjt(_bags(rank, step)))
                dense.zero_grad()
                loss.backward()
                dense.step()
                losses.append(loss.detach())
        hook.remove()
        moved = [vars(t) for r in reports for t in r.tables.values()]
        states = (loaded, relocated, _full_states(dmp, "sparse."))
        out.append((misplaced, moved, losses, pooled, states))
    return out


@pytest.fixture(scope="module")
def resharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The checkpoint saved at 2 ranks, resharded for 3 ranks without a plan ("runtime") and
    with each plan ("placed_<plan>"); what was saved, by id; each placed reshard's report."""
    root = tmp_path_factory.mktemp("placed")
    saved = run_on_ranks(_save_at, 2, str(root), timeout_s=270.0)[0]
    reshard(root / "ck", root / "runtime", world_size=WORLD)
    reports = {
        name: reshard(
            root / "ck",
            root / f"placed_{name}",
            world_size=WORLD,
            plan=_plan(name, WORLD),
            tables=TABLES,
        )
        for name in PLANS
    }
    return {"root": root, "saved": saved, "reports": reports}


def test_written_checkpoint_has_every_live_id_on_its_owner_shard(resharded: dict[str, Any]) -> None:
    root, saved = resharded["root"], resharded["saved"]
    for name in PLANS:
        plan = _plan(name, WORLD)
        report = resharded["reports"][name]
        assert report.id_map_tables == 2 and report.id_rows_moved > 0, name
        assert sum(_owners_wrong(_read_back(root / "runtime"), plan).values()) > 0, name
        written = _read_back(root / f"placed_{name}")
        assert _owners_wrong(written, plan) == {"t0": 0, "t1": 0}, name
        by_id = _by_id(written, "sparse.")
        if name != "uneven":
            assert report.id_rows_dropped == report.id_candidates_dropped == 0
            _assert_same_by_id(by_id, saved, name)
            continue
        assert report.id_rows_dropped > 0  # the small shards overflow
        kept = sum(len(ids) for key, ids in by_id.items() if "/" not in key)
        assert (
            kept
            == sum(len(ids) for key, ids in saved.items() if "/" not in key)
            - report.id_rows_dropped
        )
        for key, ids in by_id.items():  # every id kept has its saved values
            for i, values in ids.items():
                assert all(torch.equal(a, b) for a, b in zip(values, saved[key][i], strict=True))


def test_placed_checkpoint_trains_on_as_the_runtime_relocation(resharded: dict[str, Any]) -> None:
    cases = [(name, d) for name in PLANS for d in ("runtime", f"placed_{name}")]
    results = run_on_ranks(_continue_at, WORLD, str(resharded["root"]), cases, timeout_s=240.0)
    for c, (name, _) in enumerate(cases[::2]):
        runtime = [per_rank[2 * c] for per_rank in results]
        placed = [per_rank[2 * c + 1] for per_rank in results]
        # The existing path: ids misplaced after the load, moved by the first forward.
        assert sum(sum(misplaced) for misplaced, *_ in runtime) > 0, name
        assert sum(m["rows_sent"] for _, moved, *_ in runtime for m in moved) > 0, name
        # The placed checkpoint: nothing misplaced, the runtime relocation moves nothing.
        assert all(misplaced == [0, 0] for misplaced, *_ in placed), name
        for _, moved, *_ in placed:
            assert moved and all(not any(m.values()) for m in moved), (name, moved)
        dropped = sum(m["rows_dropped"] for _, moved, *_ in runtime for m in moved)
        report = resharded["reports"][name]
        assert dropped == report.id_rows_dropped, name
        candidates = sum(m["candidates_dropped"] for _, moved, *_ in runtime for m in moved)
        assert candidates == report.id_candidates_dropped, name
        # Relocated, the runtime path holds what was written (every tensor, row for row), and
        # training on gives the same losses, pooled outputs and state.
        for (_, _, losses_a, pooled_a, states_a), (_, _, losses_b, pooled_b, states_b) in zip(
            runtime, placed, strict=True
        ):
            _assert_equal_states(states_b[0], states_b[1], name)  # nothing moved
            _assert_equal_states(states_a[1], states_b[1], name)
            assert len(losses_a) == TRAIN_STEPS and len(pooled_a) == TRAIN_STEPS
            assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b, strict=True))
            assert all(torch.equal(a, b) for a, b in zip(pooled_a, pooled_b, strict=True))
            _assert_equal_states(states_a[2], states_b[2], name)


def _assert_equal_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], name: str) -> None:
    assert sorted(a) == sorted(b), name
    for key, value in a.items():
        assert torch.equal(value, b[key]), (name, key)


def _no_output(dst: Path) -> bool:
    return not dst.exists() and not (dst.parent / f".{dst.name}.partial").exists()


def test_damaged_or_mismatched_input_is_refused(
    resharded: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ck, plan, dst = resharded["root"] / "ck", _plan("row_wise", WORLD), tmp_path / "out"
    mapped = {t.name: t for t in TABLES}
    replace = dataclasses.replace
    wrong_tables: list[tuple[list[EmbeddingBagConfig] | None, str]] = [
        ([t for t in TABLES if t.name != "t1"], r"table 't1' .* no table of that name"),
        ([*TABLES[:1], replace(mapped["t1"], id_map=None), TABLES[2]], "t1.*without id_map"),
        (
            [*TABLES[:1], replace(mapped["t1"], num_embeddings=61), TABLES[2]],
            r"'t1'.*row_ids \[60\]",
        ),
        (
            [replace(mapped["t0"], id_map=IdMapConfig(policy="lfu")), *TABLES[1:]],
            r"'t0'.*does not match its config: map buffers",
        ),
    ]
    for tables, message in wrong_tables:
        with pytest.raises(ValueError, match=message):
            reshard(ck, dst, world_size=WORLD, plan=plan, tables=tables)
        assert _no_output(dst)
    with caplog.at_level(logging.WARNING):  # no configs at all: rows stay, a warning says so
        report = reshard(ck, dst, world_size=WORLD, plan=plan, tables=None)
    assert "sparse.t0" in caplog.text and "--config" in caplog.text
    assert report.id_map_tables == 0 and report.id_rows_moved == 0
    shutil.rmtree(dst)
    column = construct_module_sharding_plan(TABLES, _requests("row_wise"), WORLD)
    halves = [
        ShardSpec(rank=r, row_offset=0, num_rows=60, col_offset=4 * r, num_cols=4) for r in (0, 1)
    ]
    column["t0"] = replace(
        column["t0"], sharding_type="column_wise", ranks=(0, 1), shards=tuple(halves)
    )
    with pytest.raises(PlanError, match="t0.*column_wise"):
        reshard(ck, dst, world_size=WORLD, plan=ShardingPlan({"sparse": column}), tables=TABLES)
    assert _no_output(dst)
    damaged = tmp_path / "damaged"
    shutil.copytree(ck, damaged)
    data = sorted(damaged.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="failed verification"):
        reshard(damaged, dst, world_size=WORLD, plan=plan, tables=TABLES)
    assert _no_output(dst)


CONFIG = """
[[embedding.tables]]
name = "t0"
num_embeddings = 60
embedding_dim = 8
feature_names = ["f0"]
id_map = { policy = "lfu", decay = 0.8, ttl_steps = 2, admit_after = 2 }

[[embedding.tables]]
name = "t1"
num_embeddings = 60
embedding_dim = 8
feature_names = ["f1"]
id_map = { policy = "lru" }

[[embedding.tables]]
name = "t2"
num_embeddings = 5
embedding_dim = 8
feature_names = ["g"]
"""


def test_cli_places_ids_with_the_model_config(
    resharded: dict[str, Any], tmp_path: Path, capsys: Any, caplog: Any
) -> None:
    root = resharded["root"]
    (tmp_path / "model.toml").write_text(CONFIG)
    (tmp_path / "plan.json").write_text(_plan("uneven", WORLD).to_json())
    args = [str(root / "ck"), str(tmp_path / "out"), "--world-size", str(WORLD), "--quiet"]
    with caplog.at_level(logging.WARNING, logger="recopt.sharding.id_map_relocate"):
        status = reshard_main(
            [*args, "--plan", str(tmp_path / "plan.json"), "--config", str(tmp_path / "model.toml")]
        )
    assert status == 0
    report = resharded["reports"]["uneven"]
    assert (
        f"id maps: 2 tables placed for the plan, {report.id_rows_moved} ids moved to their owner "
        f"shard ({report.id_rows_dropped} dropped: no room)"
    ) in capsys.readouterr().out
    warned = {r.args[0] for r in caplog.records if "dropped" in r.getMessage()}
    assert warned == {"t0", "t1"}
    written, api = _read_back(tmp_path / "out"), _read_back(root / "placed_uneven")
    assert sorted(written) == sorted(api)
    assert all(torch.equal(written[k], api[k]) for k in api)
    status = reshard_main(
        [*args[:1], str(tmp_path / "out2"), *args[2:], "--config", str(tmp_path / "model.toml")]
    )
    assert status == 2 and "--config is read with --plan only" in capsys.readouterr().err


def test_unsharded_source_is_placed_the_same_way(tmp_path: Path) -> None:
    """The source's layout does not matter (tensors are read whole): an unsharded fused
    collection's checkpoint gets every id on its owner shard, with its saved values."""
    from recopt.checkpoint import save
    from recopt.kernels.config import FusedOptimizerConfig
    from recopt.modules import FusedEmbeddingBagCollection

    torch.manual_seed(0)
    config = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.05)
    ebc = FusedEmbeddingBagCollection(TABLES, optimizer=config)
    for step in range(STEPS):
        everyone = [_bags(r, step) for r in range(2)]
        bags = {f: [b for per in everyone for b in per[f]] for f in ("f0", "f1", "g")}
        ebc(_kjt(bags)).values().square().sum().backward()
    save(tmp_path / "ck", ebc, {"fused": ebc.fused_optimizer})
    saved = _by_id(_full_states(ebc, ""), "")
    for name in ("row_wise", "uneven"):
        plan = ShardingPlan({"": _plan(name, WORLD)["sparse"]})
        dst = tmp_path / name
        report = reshard(tmp_path / "ck", dst, world_size=WORLD, plan=plan, tables=TABLES)
        assert report.id_rows_moved > 0 and report.id_candidates_moved > 0, name
        written = {f"sparse.{k}": v for k, v in _read_back(dst).items()}
        assert _owners_wrong(written, ShardingPlan({"sparse": plan[""]})) == {"t0": 0, "t1": 0}
        by_id = _by_id(written, "sparse.")
        if name == "row_wise":
            _assert_same_by_id(by_id, saved, name)
        assert report.id_rows_dropped == (
            sum(len(saved[t]) for t in MAPPED) - sum(len(by_id[t]) for t in MAPPED)
        )
        for key, ids in by_id.items():
            for i, values in ids.items():
                assert all(torch.equal(a, b) for a, b in zip(values, saved[key][i], strict=True))


def test_unpooled_collection_is_placed_too(tmp_path: Path) -> None:
    """An id-mapped table of an unpooled collection (``embeddings.<table>.weight``, beside an
    unmapped one): every live id written on its owner shard, with its weight row, row-wise
    Adagrad state and counters as saved."""
    from recopt.checkpoint import save
    from recopt.kernels.config import FusedOptimizerConfig
    from recopt.modules import EmbeddingConfig, FusedEmbeddingCollection
    from recopt.sharding import row_wise
    from recopt.sparse import KeyedJaggedTensor

    mapped = EmbeddingConfig(
        name="u0", num_embeddings=40, embedding_dim=4, feature_names=("f0",),
        id_map=IdMapConfig(policy="lru"),
    )  # fmt: skip
    plain = EmbeddingConfig(name="u1", num_embeddings=30, embedding_dim=4, feature_names=("f1",))
    torch.manual_seed(0)
    optimizer = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.05)
    ec = FusedEmbeddingCollection([mapped, plain], optimizer=optimizer)
    for step in range(6):  # 30 ids a step drifting by 13: the 40 rows fill and evict
        ids = torch.cat([torch.arange(30) * 7919 + step * 13, torch.randint(0, 30, (30,))])
        kjt = KeyedJaggedTensor.from_lengths_sync(
            ["f0", "f1"], ids, torch.ones(60, dtype=torch.int64)
        )
        sum(jt.values().square().sum() for jt in ec(kjt).values()).backward()
    assert ec.stats()["u0"]["evictions"] > 0
    save(tmp_path / "ck", ec, {"fused": ec.fused_optimizer})
    plan = ShardingPlan(
        {
            "": construct_module_sharding_plan(
                [mapped, plain], {"u0": row_wise(), "u1": row_wise()}, WORLD
            )
        }
    )
    report = reshard(
        tmp_path / "ck", tmp_path / "out", world_size=WORLD, plan=plan, tables=[mapped]
    )
    assert report.id_map_tables == 1 and report.id_rows_moved > 0

    def by_id(full: dict[str, torch.Tensor]) -> dict[int, list[torch.Tensor]]:
        maps = "id_maps.u0."
        rows = full[maps + "occupied"].nonzero().squeeze(1).tolist()
        fields = [
            full["embeddings.u0.weight"], full["embeddings.u0.weight/u0.momentum1"],
            full[maps + "last_seen"], full[maps + "frequency"],
        ]  # fmt: skip
        return {int(full[maps + "row_ids"][r]): [f[r] for f in fields] for r in rows}

    saved, written = _read_back(tmp_path / "ck"), _read_back(tmp_path / "out")
    assert torch.equal(written["embeddings.u1.weight"], saved["embeddings.u1.weight"])
    before, after = by_id(saved), by_id(written)
    # 40 ids over 3 shards of 13-14 rows: a shard routed more ids than it has rows keeps the
    # most recently seen (the runtime rule) and the report counts the rest
    assert len(before) == 40 and set(after) <= set(before)
    assert report.id_rows_dropped == len(before) - len(after) < 10
    for i, values in after.items():
        assert all(torch.equal(a, b) for a, b in zip(values, before[i], strict=True)), i
    shards = plan[""]["u0"].shards
    for i in after:  # each id's row lies in the range of the shard route_shard names
        row = int((written["id_maps.u0.row_ids"] == i).nonzero()[0, 0])
        owner = shards[int(route_shard(torch.tensor([i]), len(shards))[0])]
        assert owner.row_offset <= row < owner.row_offset + owner.num_rows, i
