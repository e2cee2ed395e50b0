"""Id-mapped tables sharded with owner-local maps, against the unsharded collection.

At 2 and 3 ranks (one spawned gloo group each, every case in a loop): table-wise (one shard:
the unsharded map) equals an unsharded FusedEmbeddingBagCollection fed the ranks' batches
concatenated bit for bit while the maps evict, expire and admit; row-wise, table-row-wise and a
mixed plan equal it under capacity (outputs, stats, and by id every weight, optimizer state
and map row); with evictions, each shard's map equals a standalone `IdMap` of the shard's
capacity fed the ids routed to it, fresh rows hold the hashed init and zero state, and every
live id sits once, on its owner shard. A bad id of an unmapped table raises on every rank and
moves no map; an unsharded state loaded row-wise is relocated to the owners (by id equal to
it); a checkpoint resumed under the same plan equals an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from pipeline_helpers import embedding_configs

from recopt.kernels.config import FusedOptimizerConfig, PoolingType
from recopt.modules import (
    EmbeddingBagConfig,
    FusedEmbeddingBagCollection,
    IdMapConfig,
    InvalidIdError,
)
from recopt.modules.id_map import IdMap, map_device
from recopt.modules.id_map_rows import hash_uniform, route_shard
from recopt.sharding import (
    ParameterSharding,
    ShardedEmbeddingBagCollection,
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_row_wise,
    table_wise,
)
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

STEPS = 6
FEATURES = ("f0", "f1", "f2", "g")
TABLES = [  # small: the maps evict, expire and admit
    EmbeddingBagConfig(
        name="t0",
        num_embeddings=7,
        embedding_dim=6,
        feature_names=("f0",),
        pooling=PoolingType.MEAN,
        id_map=IdMapConfig(policy="lfu", decay=0.8, ttl_steps=2, admit_after=2),
    ),
    EmbeddingBagConfig(
        name="t1",
        num_embeddings=9,
        embedding_dim=6,
        feature_names=("f1", "f2"),
        id_map=IdMapConfig(policy="lru"),
    ),
    EmbeddingBagConfig(name="t2", num_embeddings=5, embedding_dim=6, feature_names=("g",)),
]
# Under capacity: every shard has room for every id it is sent (at most 18 per table).
BIG = [dataclasses.replace(t, num_embeddings=60) if t.id_map else t for t in TABLES]
MAPPED = ("t0", "t1")
STATE_NAMES = {"adagrad": ["momentum1"], "row_wise_adagrad": ["momentum1"], "sgd": []}
STATE_NAMES["adam"] = ["exp_avg", "exp_avg_sq"]


def _requests(kind: str, world: int) -> dict[str, Any]:
    last = world - 1
    if kind == "table_wise":
        return {"t0": table_wise(last), "t1": table_wise(0), "t2": table_wise(min(1, last))}
    if kind == "row_wise":
        return {t.name: row_wise() for t in TABLES}
    if kind == "table_row_wise":
        return {t.name: table_row_wise(0) for t in TABLES}
    return {"t0": table_wise(last), "t1": row_wise(), "t2": column_wise([last, 0])}  # mixed


def _bags(rank: int, step: int) -> dict[str, list[list[int]]]:
    return drifting_bags(FEATURES, rank, step)


def drifting_bags(features: Sequence[str], rank: int, step: int) -> dict[str, list[list[int]]]:
    """This rank's bags: raw ids of a space drifting with the step; 2 + rank bags (feature
    "g": small ids, for an unmapped table)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    out = {}
    for f in features:
        bags = []
        for _ in range(2 + rank):
            size = int(torch.randint(0, 4, (1,), generator=gen))
            raw = torch.randint(0, 8, (size,), generator=gen) + 2 * step
            bags.append((raw % 5 if f == "g" else raw * 2**33 - 7).tolist())
        out[f] = bags
    return out


def _kjt(bags: dict[str, list[list[int]]]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_id_lists(bags)


def _everyone(world: int, step: int) -> dict[str, list[list[int]]]:
    per_rank = [_bags(r, step) for r in range(world)]
    return {f: [b for bags in per_rank for b in bags[f]] for f in FEATURES}


def _table_ids(rank: int, step: int, table: EmbeddingBagConfig) -> torch.Tensor:
    """A rank's raw ids of ``table``, feature after feature (the order the exchange sends)."""
    bags = _bags(rank, step)
    return torch.tensor(
        [i for f in table.feature_names for bag in bags[f] for i in bag], dtype=torch.int64
    )


def _full(value: Any) -> torch.Tensor:
    """The whole tensor on every rank (bool ShardedTensors summed as int64)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from recopt.comm import all_reduce

    if not isinstance(value, ShardedTensor):
        return value.detach().clone()
    full = torch.zeros(
        value.size(), dtype=torch.float64 if value.dtype.is_floating_point else torch.int64
    )
    for shard in value.local_shards():
        offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
        full[index] = shard.tensor.to(full.dtype)
    full = all_reduce(full, None)
    return full.to(value.dtype)


def _modules(
    kind: str, optimizer: str, world: int, tables: list[EmbeddingBagConfig], weighted: bool = False
) -> Any:
    from recopt.sharding.sharded_embedding import ShardedEmbeddingBagCollection

    config = FusedOptimizerConfig(name=optimizer, lr=0.05, eps=1e-3)
    torch.manual_seed(0)
    ref = FusedEmbeddingBagCollection(tables, optimizer=config, is_weighted=weighted)
    plan = construct_module_sharding_plan(tables, _requests(kind, world), world)
    sharded = ShardedEmbeddingBagCollection(tables, plan, optimizer=config, is_weighted=weighted)
    sharded.load_state_dict(ref.state_dict())
    return ref, sharded, plan


def _weighted_kjt(ranks: Sequence[int], step: int) -> KeyedJaggedTensor:
    """The bags of ``ranks`` (in order) with a weight per id, the same for a rank's ids
    wherever its bags go."""
    values: list[int] = []
    weights: list[float] = []
    lengths: list[int] = []
    for f in FEATURES:
        for rank in ranks:
            gen = torch.Generator().manual_seed(1000 + 10 * step + rank + 97 * FEATURES.index(f))
            for bag in _bags(rank, step)[f]:
                values += bag
                weights += (0.5 + torch.rand(len(bag), generator=gen)).tolist()
                lengths.append(len(bag))
    return KeyedJaggedTensor(
        list(FEATURES),
        torch.tensor(values, dtype=torch.int64),
        weights=torch.tensor(weights),
        lengths=torch.tensor(lengths),
    )


def _train_both(ref: Any, sharded: Any, rank: int, world: int, step: int, name: str) -> None:
    first = sum(2 + r for r in range(rank))
    mine = slice(first, first + 2 + rank)
    if sharded.is_weighted:
        out = sharded(_weighted_kjt([rank], step)).values()
        ref_out = ref(_weighted_kjt(range(world), step)).values()
    else:
        out = sharded(_kjt(_bags(rank, step))).values()
        ref_out = ref(_kjt(_everyone(world, step))).values()
    torch.testing.assert_close(out, ref_out[mine], msg=lambda m: f"{name} step {step}: {m}")
    if not sharded.training:
        return
    weight = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(step))
    (out * weight[mine]).sum().backward()
    (ref_out * weight).sum().backward()
    assert sharded.stats() == ref.stats(), name


def _table_wise_case(optimizer: str, rank: int, world: int) -> None:
    """One shard per table: the unsharded map; bit for bit, with evictions and expiry."""
    ref, sharded, _ = _modules("table_wise", optimizer, world, TABLES)
    churn = {"evictions": 0.0, "zero_row_ids": 0.0, "expired": 0.0, "admissions": 0.0}
    for step in range(STEPS):
        _train_both(ref, sharded, rank, world, step, f"table_wise/{optimizer}")
        for key in churn:
            churn[key] += sum(s[key] for s in ref.stats().values())
    assert all(v > 0 for v in churn.values()), churn  # the maps were full
    state, ref_state = sharded.state_dict(), ref.state_dict()
    assert sorted(state) == sorted(ref_state)
    for key, value in ref_state.items():
        got = _full(state[key])
        if key.startswith("id_maps."):  # the one shard's map is the unsharded map
            assert torch.equal(got, value), key
        torch.testing.assert_close(got, value, atol=1e-5, rtol=1e-5, msg=key)
    got_opt = sharded.fused_optimizer.state_dict()["state"]
    for param, states in ref.fused_optimizer.state_dict()["state"].items():
        for name, value in states.items():
            got = _full(got_opt[param][name]).to(value.dtype)
            torch.testing.assert_close(got, value, atol=1e-5, rtol=1e-5, msg=name)


def _by_id(state: dict[str, Any], table: str) -> dict[int, int]:
    """Live id -> row of a (full) state dict's map."""
    ids, used = state[f"id_maps.{table}.row_ids"], state[f"id_maps.{table}.occupied"]
    rows = used.nonzero().squeeze(1)
    return dict(zip(ids[rows].tolist(), rows.tolist(), strict=True))


def _compare_by_id(ref: Any, sharded: Any, optimizer: str, name: str) -> None:
    """Each live id's weight, optimizer state and map counters equal the unsharded row's."""
    ref_state = ref.state_dict()
    state = {k: _full(v) for k, v in sharded.state_dict().items()}
    ref_opt = ref.fused_optimizer.state_dict()["state"]
    opt = sharded.fused_optimizer.state_dict()["state"]
    for t in MAPPED:
        want, got = _by_id(ref_state, t), _by_id(state, t)
        assert sorted(want) == sorted(got) and want, (name, t)
        r, s = list(want.values()), [got[i] for i in want]
        pairs = [(ref_state[f"embedding_bags.{t}.weight"], state[f"embedding_bags.{t}.weight"])]
        pairs += [
            (ref_state[f"id_maps.{t}.{b}"], state[f"id_maps.{t}.{b}"])
            for b in ("last_seen", "frequency")
        ]
        param = f"embedding_bags.{t}.weight"
        for key in STATE_NAMES[optimizer]:
            pairs.append((ref_opt[param][f"{t}.{key}"], _full(opt[param][f"{t}.{key}"])))
        for want_value, got_value in pairs:
            torch.testing.assert_close(
                got_value[s].to(want_value.dtype),
                want_value[r],
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m, t=t: f"{name} {t}: {m}",
            )
        assert int(state[f"id_maps.{t}.step"]) == int(ref_state[f"id_maps.{t}.step"])
    _check_owners(sharded, name)


def _check_owners(sharded: Any, name: str) -> None:
    """Every live id once in its table, and in the row shard `route_shard` names."""
    state = sharded.state_dict()
    for t in MAPPED:
        ids = state[f"id_maps.{t}.row_ids"]
        used = state[f"id_maps.{t}.occupied"]
        full_ids, full_used = _full(ids), _full(used)
        live = full_ids[full_used]
        assert live.unique().numel() == live.numel(), (name, t)  # no id in two rows
        shards = ids.metadata().shards_metadata
        for local in ids.local_shards():
            k = [m.shard_offsets for m in shards].index(local.metadata.shard_offsets)
            start, size = local.metadata.shard_offsets[0], local.metadata.shard_sizes[0]
            mine = local.tensor[full_used[start : start + size]]
            assert bool((route_shard(mine, len(shards)) == k).all()), (name, t, k)


def _under_capacity_case(
    kind: str, optimizer: str, rank: int, world: int, weighted: bool = False
) -> None:
    ref, sharded, _ = _modules(kind, optimizer, world, BIG, weighted)
    name = f"{kind}/{optimizer} under capacity{' weighted' if weighted else ''}"
    for step in range(STEPS):
        _train_both(ref, sharded, rank, world, step, name)
        assert all(s["evictions"] == 0 for s in ref.stats().values()), name
    _compare_by_id(ref, sharded, optimizer, name)
    ref.eval()
    sharded.eval()  # evaluation reads the owners' maps: the same rows, nothing moves
    _train_both(ref, sharded, rank, world, STEPS, f"{name} eval")
    assert int(sharded.state_dict()["id_maps.t1.step"]) == STEPS


def _evicting_case(kind: str, optimizer: str, rank: int, world: int) -> None:
    """Each own shard's map equals a standalone map of its capacity fed the ids routed to it;
    fresh rows hold the hashed init and zero optimizer state."""
    ref, sharded, plan = _modules(kind, optimizer, world, TABLES)
    name = f"{kind}/{optimizer} evicting"
    own = {}
    for t in TABLES[:2]:
        shards = plan[t.name].shards
        for k, s in enumerate(shards):
            if s.rank == rank:
                standalone = IdMap(t.id_map, s.num_rows)  # type: ignore[arg-type]
                own[t.name] = (k, len(shards), standalone, t)
    evictions = 0.0
    for step in range(STEPS):
        fed = {}
        for t_name, (k, count, standalone, table) in own.items():
            parts = [_table_ids(r, step, table) for r in range(world)]
            routed = torch.cat([p[route_shard(p, count) == k] for p in parts])
            fed[t_name] = standalone.remap(routed, True)
        out = sharded(_kjt(_bags(rank, step))).values()
        maps = sharded.id_maps
        for t_name, (_, _, standalone, table) in own.items():
            for key, value in standalone.state_dict().items():
                got = maps.table_map(t_name).state_dict()[key]
                assert torch.equal(got, value), (name, step, t_name, key)
            _check_fresh(sharded, table, fed[t_name], optimizer, name)
        out.square().sum().backward()
        evictions += sum(s["evictions"] for s in sharded.stats().values())
    assert evictions > 0, name
    _check_owners(sharded, name)


def _check_fresh(sharded: Any, table: Any, fresh: Any, optimizer: str, name: str) -> None:
    """The fresh rows of this rank's shard hold the hashed init and zero optimizer state."""
    rows, ids = fresh.fresh_rows, fresh.fresh_ids
    param = f"embedding_bags.{table.name}.weight"
    (weight,) = sharded.state_dict()[param].local_shards()
    lo, hi = table.init_bounds()
    want = (lo + (hi - lo) * hash_uniform(ids, fresh.stats.step, table.embedding_dim)).to(
        torch.float32
    )
    assert torch.equal(weight.tensor[rows], want), (name, table.name)
    states = sharded.fused_optimizer.state_dict()["state"][param]
    for key in STATE_NAMES[optimizer]:
        (local,) = states[f"{table.name}.{key}"].local_shards()
        assert not bool(local.tensor[rows].any()), (name, table.name, key)


def _bad_input_case(rank: int, world: int) -> None:
    from recopt.sharding.sharded_embedding import ShardedEmbeddingBagCollection

    plan = construct_module_sharding_plan(TABLES, _requests("row_wise", world), world)
    sharded = ShardedEmbeddingBagCollection(TABLES, plan)
    bags = _bags(rank, 0)
    if rank == 0:
        bags["g"][0] = [99]  # t2 has 5 rows
    with pytest.raises(InvalidIdError if rank == 0 else ValueError):
        sharded(_kjt(bags))
    maps = sharded.state_dict()
    assert int(maps["id_maps.t1.step"]) == 0
    assert not bool(_full(maps["id_maps.t1.occupied"]).any())
    sharded(_kjt(_bags(rank, 0)))  # the next good batch runs on every rank
    assert int(sharded.state_dict()["id_maps.t1.step"]) == 1
    assert bool(_full(sharded.state_dict()["id_maps.t1.occupied"]).any())
    sharded.eval()  # evaluation exchanges ids too: the same protocol
    with pytest.raises(InvalidIdError if rank == 0 else ValueError):
        sharded(_kjt(bags))
    before = _full(sharded.state_dict()["id_maps.t1.row_ids"])
    sharded(_kjt(_bags(rank, 1)))
    assert int(sharded.state_dict()["id_maps.t1.step"]) == 1
    assert torch.equal(_full(sharded.state_dict()["id_maps.t1.row_ids"]), before)


def _relocation_case(rank: int, world: int) -> None:
    """A trained unsharded state loaded into row shards leaves ids on shards that do not own
    them: the pending relocation moves each to its owner with its row (equal by id to the
    unsharded module); a load of the module's own (same-plan) state moves nothing."""
    ref, sharded, plan = _modules("row_wise", "sgd", world, BIG)
    for step in range(2):
        _train_both(ref, sharded, rank, world, step, "relocation")
    maps = sharded._id_maps
    twin = _modules("row_wise", "sgd", world, BIG)[1]
    own_state = {k: _full(v) for k, v in sharded.state_dict().items()}
    twin.load_state_dict(sharded.state_dict())
    twin._id_maps._relocate_if_pending()  # same plan: every id is on its owner
    assert not twin._id_maps.relocate_pending
    for key, value in twin.state_dict().items():
        assert torch.equal(_full(value), own_state[key]), key
    sharded.load_state_dict(ref.state_dict())
    assert maps.relocate_pending
    misplaced = False
    for t in MAPPED:
        ids, used = (
            ref.state_dict()[f"id_maps.{t}.row_ids"],
            ref.state_dict()[f"id_maps.{t}.occupied"],
        )
        shards = plan[t].shards
        (k,) = [k for k, s in enumerate(shards) if s.rank == rank]
        start, size = shards[k].row_offset, shards[k].num_rows
        mine = ids[start : start + size][used[start : start + size]]
        misplaced |= bool((route_shard(mine, len(shards)) != k).any())
    maps._relocate_if_pending()
    assert not maps.relocate_pending
    _compare_by_id(ref, sharded, "sgd", "relocation")  # every id on its owner, its row kept
    from recopt.comm import all_reduce

    anywhere = all_reduce(torch.tensor([float(misplaced)]), None)
    assert float(anywhere) > 0  # the case does test a misplaced id somewhere


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.05)
        self.sparse = FusedEmbeddingBagCollection(TABLES, optimizer=config)
        self.dense = torch.nn.Linear(24, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(self.sparse(kjt).values()).square().sum()


def _dmp(kind: str, world: int) -> tuple[Any, torch.optim.Optimizer]:
    from recopt.sharding import ShardingPlan
    from recopt.sharding.model_parallel import DistributedModelParallel

    plan = ShardingPlan(
        {"sparse": construct_module_sharding_plan(TABLES, _requests(kind, world), world)}
    )
    dmp = DistributedModelParallel(_Model(), plan)
    return dmp, torch.optim.SGD([p for _, p in dmp.named_parameters()], lr=0.01)


def _train(dmp: Any, dense: torch.optim.Optimizer, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = dmp(_kjt(_bags(rank, step)))
        dense.zero_grad()
        loss.backward()
        dense.step()
        losses.append(float(loss))
    return losses


def _checkpoint_case(kind: str, rank: int, world: int, root: str) -> None:
    """DMP: save, load into a fresh model under the same plan; the run goes on as without
    the stop (the maps evict and expire on the way)."""
    from recopt.checkpoint import load, save

    dmp, dense = _dmp(kind, world)
    _train(dmp, dense, rank, range(3))
    path = Path(root) / f"ck-{kind}"
    save(path, dmp, {"fused": dmp.fused_optimizer, "dense": dense}, step=3)
    straight = _train(dmp, dense, rank, range(3, STEPS))
    other, other_dense = _dmp(kind, world)
    load(path, other, {"fused": other.fused_optimizer, "dense": other_dense})
    resumed = _train(other, other_dense, rank, range(3, STEPS))
    assert resumed == straight, kind
    mine = {k: _full(v) for k, v in dmp.state_dict().items()}
    theirs = {k: _full(v) for k, v in other.state_dict().items()}
    assert sorted(mine) == sorted(theirs) and "sparse.id_maps.t1.row_ids" in mine
    for key, value in mine.items():
        assert torch.equal(theirs[key], value), key


def _unpooled_case(rank: int, world: int) -> None:
    """ShardedEmbeddingCollection, table-wise: each rank's rows equal the unsharded module's
    rows of its ids (the global batch is the ranks' ids concatenated, feature by feature)."""
    from recopt.modules import FusedEmbeddingCollection
    from recopt.sharding.sharded_embedding_collection import ShardedEmbeddingCollection

    tables = embedding_configs(TABLES)
    config = FusedOptimizerConfig(name="adagrad", lr=0.05)
    torch.manual_seed(0)
    ref = FusedEmbeddingCollection(tables, config)
    plan = construct_module_sharding_plan(tables, _requests("table_wise", world), world)
    sharded = ShardedEmbeddingCollection(tables, plan, optimizer=config)
    sharded.load_state_dict(ref.state_dict())
    for step in range(STEPS):
        out, ref_out = sharded(_kjt(_bags(rank, step))), ref(_kjt(_everyone(world, step)))
        loss = torch.zeros(())
        ref_loss = torch.zeros(())
        for f in FEATURES:
            counts = [sum(len(b) for b in _bags(r, step)[f]) for r in range(world)]
            start = sum(counts[:rank])
            mine = ref_out[f].values()[start : start + counts[rank]]
            torch.testing.assert_close(out[f].values(), mine, msg=f"ec {f} step {step}")
            loss = loss + out[f].values().square().sum()
            ref_loss = ref_loss + ref_out[f].values().square().sum()
        loss.backward()
        ref_loss.backward()
        assert sharded.stats() == ref.stats()
    for key, value in ref.state_dict().items():
        got = _full(sharded.state_dict()[key])
        torch.testing.assert_close(got, value, atol=1e-5, rtol=1e-5, msg=f"ec {key}")


def _all_cases(rank: int, world: int, root: str) -> list[str]:
    done = []
    for optimizer in ("adam", "row_wise_adagrad"):
        _table_wise_case(optimizer, rank, world)
        done.append(f"table_wise/{optimizer}")
    for kind, optimizer in (
        ("row_wise", "adam"),
        ("table_row_wise", "adagrad"),
        ("mixed", "row_wise_adagrad"),
    ):
        _under_capacity_case(kind, optimizer, rank, world)
        done.append(f"{kind}/{optimizer} under capacity")
    _under_capacity_case("row_wise", "row_wise_adagrad", rank, world, weighted=True)
    done.append("row_wise weighted (the zero row's ids and their weights dropped at the owner)")
    for kind, optimizer in (("row_wise", "adagrad"), ("table_row_wise", "sgd")):
        _evicting_case(kind, optimizer, rank, world)
        done.append(f"{kind}/{optimizer} evicting")
    _bad_input_case(rank, world)
    done.append("bad input")
    _relocation_case(rank, world)
    done.append("relocation")
    _checkpoint_case("row_wise", rank, world, root)
    done.append("checkpoint")
    _unpooled_case(rank, world)
    done.append("ec/table_wise")
    return done


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_id_maps_equal_unsharded(world: int, tmp_path: Path) -> None:
    results = run_on_ranks(_all_cases, world, str(tmp_path), timeout_s=270.0)
    assert all(r == results[0] for r in results) and len(results[0]) == 12


def _on_a_gpu_case(rank: int, world: int, device_type: str = "cuda") -> list[str]:
    """Sharded id-mapped tables on a GPU against the unsharded collection on CPU fed every
    rank's batch: outputs (up to the kernels' rounding) and stats (exactly) after every step;
    table-wise while the maps evict, expire and admit, row- and table-row-wise under
    capacity."""
    from recopt.sharding.sharded_embedding import ShardedEmbeddingBagCollection

    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    config = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.05, eps=1e-3)
    first = sum(2 + r for r in range(rank))
    mine = slice(first, first + 2 + rank)
    done = []
    for kind, tables in (("table_wise", TABLES), ("row_wise", BIG), ("table_row_wise", BIG)):
        torch.manual_seed(0)
        ref = FusedEmbeddingBagCollection(tables, optimizer=config)
        plan = construct_module_sharding_plan(tables, _requests(kind, world), world)
        sharded = ShardedEmbeddingBagCollection(tables, plan, optimizer=config, device=device)
        sharded.load_state_dict(ref.state_dict())
        new_ids = 0.0
        for step in range(STEPS):
            out = sharded(_kjt(_bags(rank, step)).to(device)).values()
            ref_out = ref(_kjt(_everyone(world, step))).values()
            torch.testing.assert_close(out.cpu(), ref_out[mine], atol=1e-5, rtol=1e-5)
            weight = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(step))
            (out * weight[mine].to(device)).sum().backward()
            (ref_out * weight).sum().backward()
            assert sharded.stats() == ref.stats(), (kind, step)
            new_ids += sum(s["new_ids"] for s in ref.stats().values())
        assert new_ids > 0, kind
        maps = sharded.id_maps
        assert maps is not None and maps.home == map_device(device)  # the host, for a GPU
        assert all(maps.table_map(n).buffer("occupied").device == maps.home for n in maps)
        _saved_maps_reload(sharded, tables, plan, config, device, _kjt(_bags(rank, STEPS)))
        done.append(kind)
    return done


def _saved_maps_reload(
    sharded: ShardedEmbeddingBagCollection,
    tables: Sequence[EmbeddingBagConfig],
    plan: dict[str, ParameterSharding],
    config: FusedOptimizerConfig,
    device: torch.device,
    batch: KeyedJaggedTensor,
) -> None:
    """The state (maps as ShardedTensors where they live) loads into a fresh collection
    that then reads the same rows: an evaluation forward equals the saved one's."""
    state = sharded.state_dict()
    row_ids = next(v for k, v in state.items() if k.endswith("row_ids"))
    assert all(s.tensor.device == map_device(device) for s in row_ids.local_shards())
    again = ShardedEmbeddingBagCollection(tables, plan, optimizer=config, device=device)
    again.load_state_dict(state)
    sharded.eval()
    again.eval()
    with torch.no_grad():
        expected = sharded(batch.to(device)).values()
        torch.testing.assert_close(again(batch.to(device)).values(), expected)


@pytest.mark.cuda
def test_sharded_id_maps_on_a_gpu_equal_unsharded_on_cpu() -> None:
    results = run_on_ranks(_on_a_gpu_case, 2, "cuda", timeout_s=240.0, backend="cuda:gloo")
    assert results == [["table_wise", "row_wise", "table_row_wise"]] * 2


def test_the_gpu_case_itself_on_cpu() -> None:
    """The GPU case's logic, run on CPU (its GPU run needs a GPU host)."""
    results = run_on_ranks(_on_a_gpu_case, 2, "cpu", timeout_s=240.0)
    assert results == [["table_wise", "row_wise", "table_row_wise"]] * 2
