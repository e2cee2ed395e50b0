"""Id-mapped tables sharded: every sharding type equals the unsharded collection, step for step.

At 2 and 3 ranks (one spawned gloo group each, every case in a loop): forward outputs,
then after training steps every weight, optimizer state and map buffer equals an unsharded
FusedEmbeddingBagCollection fed the ranks' batches concatenated (the maps evict, expire and
admit on the way); a bad id of an unmapped table raises on every rank and moves no map; a
DistributedModelParallel checkpoint saved under one plan resumes under another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from recopt.kernels.config import FusedOptimizerConfig, PoolingType
from recopt.modules import (
    EmbeddingBagConfig,
    FusedEmbeddingBagCollection,
    IdMapConfig,
    InvalidIdError,
)
from recopt.sharding import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

STEPS = 6
FEATURES = ("f0", "f1", "f2", "g")
TABLES = [
    EmbeddingBagConfig(
        name="t0",
        num_embeddings=7,
        embedding_dim=6,
        feature_names=("f0",),
        pooling=PoolingType.MEAN,
        id_map=IdMapConfig(policy="lfu", decay=0.8, ttl_steps=3, admit_after=2),
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
KINDS = ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel", "mixed"]
OPTIMIZERS = ["adagrad", "row_wise_adagrad", "adam", "sgd"]


def _requests(kind: str, world: int) -> dict[str, Any]:
    last = world - 1
    if kind == "table_wise":
        return {"t0": table_wise(last), "t1": table_wise(0), "t2": table_wise(min(1, last))}
    if kind == "row_wise":
        return {t.name: row_wise() for t in TABLES}
    if kind == "column_wise":
        return {"t0": column_wise([last, 0]), "t1": column_wise([0, last]), "t2": table_wise(0)}
    if kind == "table_row_wise":
        return {t.name: table_row_wise(0) for t in TABLES}
    if kind == "data_parallel":
        return {t.name: data_parallel() for t in TABLES}
    return {"t0": row_wise(), "t1": data_parallel(), "t2": column_wise([last])}


def _bags(rank: int, step: int) -> dict[str, list[list[int]]]:
    """This rank's bags: raw ids of a space drifting with the step; 2 + rank bags."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    out = {}
    for f in FEATURES:
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


def _run_case(kind: str, optimizer: str, rank: int, world: int) -> None:
    from recopt.sharding.sharded_embedding import ShardedEmbeddingBagCollection
    from recopt.sharding.state import full_tensor

    config = FusedOptimizerConfig(name=optimizer, lr=0.05, eps=1e-3)
    torch.manual_seed(0)
    ref = FusedEmbeddingBagCollection(TABLES, optimizer=config)
    plan = construct_module_sharding_plan(TABLES, _requests(kind, world), world)
    sharded = ShardedEmbeddingBagCollection(TABLES, plan, optimizer=config)
    sharded.load_state_dict(ref.state_dict())
    first = sum(2 + r for r in range(rank))
    mine = slice(first, first + 2 + rank)
    churn = {"evictions": 0.0, "zero_row_ids": 0.0}
    for step in range(STEPS):
        out = sharded(_kjt(_bags(rank, step))).values()
        ref_out = ref(_kjt(_everyone(world, step))).values()
        name = f"{kind}/{optimizer} step {step}"
        torch.testing.assert_close(out, ref_out[mine], msg=lambda m, n=name: f"{n}: {m}")
        weight = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(step))
        (out * weight[mine]).sum().backward()
        (ref_out * weight).sum().backward()
        assert sharded.stats() == ref.stats(), name
        for key in churn:
            churn[key] += sum(s[key] for s in ref.stats().values())
    assert churn["evictions"] > 0 and churn["zero_row_ids"] > 0, churn  # the maps were full
    state, ref_state = sharded.state_dict(), ref.state_dict()
    assert sorted(state) == sorted(ref_state), kind
    for key, value in ref_state.items():
        torch.testing.assert_close(
            full_tensor(state[key]), value, atol=1e-5, rtol=1e-5, msg=f"{kind}/{optimizer} {key}"
        )
    again = ShardedEmbeddingBagCollection(TABLES, plan, optimizer=config)
    again.load_state_dict(ref_state)  # an unsharded state, maps included, into the shards
    for key, value in ref_state.items():
        assert torch.equal(full_tensor(again.state_dict()[key]).to(value.dtype), value), key
    got_opt = sharded.fused_optimizer.state_dict()["state"]
    for param, states in ref.fused_optimizer.state_dict()["state"].items():
        for name, value in states.items():
            torch.testing.assert_close(
                full_tensor(got_opt[param][name]).to(value.dtype),
                value,
                atol=1e-5,
                rtol=1e-5,
                msg=f"{kind}/{optimizer} {name}",
            )


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
    assert int(maps["id_maps.t1.step"]) == 0 and not bool(maps["id_maps.t1.occupied"].any())
    sharded(_kjt(_bags(rank, 0)))  # the next good batch runs on every rank
    assert int(sharded.state_dict()["id_maps.t1.step"]) == 1


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


def _checkpoint_case(rank: int, world: int, root: str) -> None:
    """DMP: save under one plan, load under another; the run goes on as without the stop."""
    from recopt.checkpoint import load, save
    from recopt.sharding.state import full_tensor

    dmp, dense = _dmp("row_wise", world)
    _train(dmp, dense, rank, range(3))
    save(Path(root) / "ck", dmp, {"fused": dmp.fused_optimizer, "dense": dense}, step=3)
    straight = _train(dmp, dense, rank, range(3, STEPS))
    other, other_dense = _dmp("table_wise", world)
    load(Path(root) / "ck", other, {"fused": other.fused_optimizer, "dense": other_dense})
    resumed = _train(other, other_dense, rank, range(3, STEPS))
    torch.testing.assert_close(resumed, straight, rtol=1e-5, atol=1e-6)
    mine = {k: full_tensor(v) for k, v in dmp.state_dict().items()}
    theirs = {k: full_tensor(v) for k, v in other.state_dict().items()}
    assert sorted(mine) == sorted(theirs) and "sparse.id_maps.t1.row_ids" in mine
    for key, value in mine.items():
        torch.testing.assert_close(theirs[key], value, rtol=1e-5, atol=1e-6, msg=key)


def _unpooled_case(kind: str, rank: int, world: int) -> None:
    """ShardedEmbeddingCollection: each rank's rows equal the unsharded module's rows of its
    ids (the global batch is the ranks' ids concatenated, feature by feature)."""
    from recopt.modules import EmbeddingConfig, FusedEmbeddingCollection
    from recopt.sharding.sharded_embedding_collection import ShardedEmbeddingCollection

    tables = [
        EmbeddingConfig(
            name=t.name,
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            feature_names=t.feature_names,
            id_map=t.id_map,
        )
        for t in TABLES
    ]
    config = FusedOptimizerConfig(name="adagrad", lr=0.05)
    torch.manual_seed(0)
    ref = FusedEmbeddingCollection(tables, config)
    plan = construct_module_sharding_plan(tables, _requests(kind, world), world)
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
            torch.testing.assert_close(out[f].values(), mine, msg=f"ec/{kind} {f} step {step}")
            loss = loss + out[f].values().square().sum()
            ref_loss = ref_loss + ref_out[f].values().square().sum()
        loss.backward()
        ref_loss.backward()
        assert sharded.stats() == ref.stats()
    for key, value in ref.state_dict().items():
        got = full_tensor_of(sharded.state_dict()[key])
        torch.testing.assert_close(got, value, atol=1e-5, rtol=1e-5, msg=f"ec/{kind} {key}")


def full_tensor_of(value: Any) -> torch.Tensor:
    from recopt.sharding.state import full_tensor

    return full_tensor(value)


def _all_cases(rank: int, world: int, root: str) -> list[str]:
    done = []
    for i, kind in enumerate(KINDS):
        for optimizer in (OPTIMIZERS[i % len(OPTIMIZERS)], OPTIMIZERS[(i + 1) % len(OPTIMIZERS)]):
            _run_case(kind, optimizer, rank, world)
            done.append(f"{kind}/{optimizer}")
    _bad_input_case(rank, world)
    done.append("bad input")
    _checkpoint_case(rank, world, root)
    done.append("checkpoint")
    for kind in ("row_wise", "table_wise"):
        _unpooled_case(kind, rank, world)
        done.append(f"ec/{kind}")
    return done


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_id_maps_equal_unsharded(world: int, tmp_path: Path) -> None:
    results = run_on_ranks(_all_cases, world, str(tmp_path), timeout_s=270.0)
    assert all(r == results[0] for r in results) and len(results[0]) == 2 * len(KINDS) + 4


def _full_states(dmp: Any) -> dict[str, torch.Tensor]:
    """Every model tensor and fused optimizer state as a full tensor."""
    out = {k: full_tensor_of(v) for k, v in dmp.state_dict().items()}
    for param, states in dmp.fused_optimizer.state_dict()["state"].items():
        for name, value in states.items():
            out[f"{param}/{name}"] = full_tensor_of(value)
    return out


def _save_at(rank: int, world: int, root: str, kind: str) -> dict[str, torch.Tensor]:
    from recopt.checkpoint import save

    dmp, dense = _dmp(kind, world)
    _train(dmp, dense, rank, range(STEPS))
    save(Path(root) / "ck", dmp, {"fused": dmp.fused_optimizer}, step=STEPS)
    return _full_states(dmp)


def _load_at(rank: int, world: int, root: str, kind: str) -> dict[str, torch.Tensor]:
    from recopt.checkpoint import load

    dmp, _ = _dmp(kind, world)
    load(Path(root) / "resharded", dmp, {"fused": dmp.fused_optimizer})
    return _full_states(dmp)


def test_reshard_two_to_three_ranks_keeps_every_ids_row_and_state(tmp_path: Path) -> None:
    from recopt.checkpoint.reshard import reshard

    saved = run_on_ranks(_save_at, 2, str(tmp_path), "row_wise", timeout_s=270.0)[0]
    reshard(tmp_path / "ck", tmp_path / "resharded", world_size=3)
    loaded = run_on_ranks(_load_at, 3, str(tmp_path), "table_row_wise", timeout_s=270.0)
    assert int(saved["sparse.id_maps.t1.occupied"].sum()) > 0
    for state in loaded:
        assert sorted(state) == sorted(saved)
        for key, value in saved.items():
            assert torch.equal(state[key].to(value.dtype), value), key
