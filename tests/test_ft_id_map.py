"""Id-mapped tables under fault tolerance: a dropped step leaves map, rows and state as before.

Each case trains a guarded collection and a twin (same seed, no guard) through committed steps,
then drops a step on the guarded one only (an injected error, or a NaN gradient that the
non-finite gate skips) in which the maps evict, expire and admit ids and re-initialise their
rows. Afterwards every map buffer, weight and optimizer state must equal the twin's bit for
bit (torch.equal), and the next committed batch must give both the same output and state.
Cases: lru, lfu, ttl_steps, admit_after; the fused collections on both backends; the sharded
ones at 2 ranks table-wise, row-wise, table-row-wise and mixed (one spawned group; id-mapped
tables are never column-wise or data-parallel).
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from recopt.ft.embedding import FusedEmbeddingGuard
from recopt.ft.nonfinite import NonFiniteGradientError
from recopt.ft.steps import StepTransaction
from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.modules import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
    IdMapConfig,
)
from recopt.modules.id_map import IdMap
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

POLICIES = {
    "lru": IdMapConfig(policy="lru"),
    "lfu": IdMapConfig(policy="lfu", decay=0.8),
    "ttl_steps": IdMapConfig(policy="lru", ttl_steps=2),
    "admit_after": IdMapConfig(policy="lfu", admit_after=2, candidate_slots=4),
}
COMMITTED = 4  # steps before the dropped one


class OneReplica(StepTransaction):
    """A transaction with this process as its only participant; the vote is the outcome."""

    def __init__(self) -> None:
        super().__init__("test", 1, datetime.timedelta(seconds=10))

    def start_quorum(self) -> None:
        self._errored = None
        self._num_participants = 1
        self._begin()

    def _vote(self, ok: bool) -> bool:
        return ok


def _tables(id_map: IdMapConfig, shared: bool) -> list[EmbeddingBagConfig]:
    """Two small id-mapped tables (t1 looked up by two features when ``shared``) and a plain one."""
    return [
        EmbeddingBagConfig(
            name="t0", num_embeddings=5, embedding_dim=4, feature_names=("f0",), id_map=id_map
        ),
        EmbeddingBagConfig(
            name="t1",
            num_embeddings=6,
            embedding_dim=8,
            feature_names=("f1", "f2") if shared else ("f1",),
            id_map=id_map,
        ),
        EmbeddingBagConfig(name="t2", num_embeddings=5, embedding_dim=4, feature_names=("g",)),
    ]


def bags(step: int, features: tuple[str, ...], rank: int = 0) -> dict[str, list[list[int]]]:
    """Bags of raw ids from a space that drifts with ``step``; a negative step is a batch of
    ids never seen, each twice (admitted at once under admit_after=2), that fills the maps."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    out = {}
    for f in features:
        if f == "g":
            out[f] = [torch.randint(0, 5, (2,), generator=gen).tolist() for _ in range(3)]
        elif step < 0:
            fresh = [(-step * 100 + k + 10 * rank) * 2**33 + 3 for k in range(4)]
            out[f] = [fresh[:2] * 2, fresh[2:] * 2, [fresh[0]]]
        else:
            out[f] = [
                ((torch.randint(0, 7, (int(n),), generator=gen) + 2 * step) * 2**33 + 3).tolist()
                for n in torch.randint(0, 4, (3,), generator=gen)
            ]
    return out


def _kjt(step: int, features: tuple[str, ...], rank: int = 0) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_id_lists(bags(step, features, rank))


def _loss(out: torch.Tensor, step: int) -> torch.Tensor:
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(abs(step)))
    return (out * weight).sum()


def state_of(module: nn.Module) -> dict[str, Any]:
    """Every tensor of the module (weights, id map buffers) and of its fused optimizer."""
    fused: Any = module  # a fused collection: its fused_optimizer
    optimizer = fused.fused_optimizer.state_dict()
    return copy.deepcopy({"model": module.state_dict(), "optim": optimizer["state"]})


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Bit-exact equality of nested dicts/lists of tensors."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def churn(module: nn.Module) -> dict[str, float]:
    """The last map step's evictions, expiries and admissions, summed over the tables."""
    fused: Any = module
    stats = fused.stats()
    keys = ("evictions", "expired", "admissions", "new_ids")
    return {k: sum(s[k] for s in stats.values()) for k in keys}


def _bag_module(
    name: str, backend: Backend, shared: bool
) -> Callable[[IdMapConfig], FusedEmbeddingBagCollection]:
    config = FusedOptimizerConfig(name=name, lr=0.05, eps=1e-3, backend=backend)

    def build(id_map: IdMapConfig) -> FusedEmbeddingBagCollection:
        torch.manual_seed(0)
        return FusedEmbeddingBagCollection(_tables(id_map, shared), optimizer=config)

    return build


def _run_dropped_step(
    module: nn.Module,
    twin: nn.Module,
    train: Callable[[nn.Module, int], torch.Tensor],
    nonfinite: bool = False,
    state: Callable[[nn.Module], dict[str, Any]] = state_of,
) -> dict[str, float]:
    """COMMITTED steps on both, a dropped step on ``module``, then one more step on both.

    Returns the dropped step's churn (evictions, expiries, admissions) for the caller to check.
    ``state``: what to compare (a sharded collection: the rank's own shards).
    """
    tx = OneReplica()
    guard = FusedEmbeddingGuard(module, tx)
    for step in range(COMMITTED):
        tx.start_quorum()
        out = train(module, step)
        assert tx.should_commit()
        assert torch.equal(out, train(twin, step))
    assert_same(state(twin), state(module), "before")
    tx.start_quorum()
    train(module, -1)  # new ids fill the maps: evictions, fresh rows
    seen = churn(module)
    if nonfinite:
        with pytest.warns(RuntimeWarning, match="NaN or inf"):
            train(module, -2 - 1000)  # the collection's gate skips the update
    else:
        train(module, -2)  # a second forward in the same step (two map steps to undo)
        tx.report_error(RuntimeError("injected"))
    with pytest.raises(AssertionError):
        assert_same(state(twin), state(module))  # the step did change things
    assert not tx.should_commit()
    if nonfinite:
        assert isinstance(tx.errored(), NonFiniteGradientError)
    assert_same(state(twin), state(module), "after the dropped step")
    assert guard.snapshot_bytes() == 0
    tx.start_quorum()
    out = train(module, COMMITTED)
    assert tx.should_commit()
    assert torch.equal(out, train(twin, COMMITTED))
    assert_same(state(twin), state(module), "after the next step")
    guard.remove()
    return seen


FEATURES = ("f0", "f1", "f2", "g")


def _train_bags(features: tuple[str, ...]) -> Callable[[nn.Module, int], torch.Tensor]:
    def train(module: nn.Module, step: int) -> torch.Tensor:
        nan = step < -1000
        step = step + 1000 if nan else step
        out = module(_kjt(step, features)).values()
        loss = _loss(out, step) * (float("nan") if nan else 1.0)
        loss.backward()
        return out.detach()

    return train


BACKENDS = [
    ("adam", Backend.RECOPT, True),
    ("row_wise_adagrad", Backend.RECOPT, True),
    ("row_wise_adagrad", Backend.FBGEMM, False),  # fbgemm's CPU kernel: one feature per table
]


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name, backend, shared", BACKENDS)
def test_dropped_step_restores_map_rows_and_state(
    policy: str, name: str, backend: Backend, shared: bool
) -> None:
    build = _bag_module(name, backend, shared)
    features = FEATURES if shared else ("f0", "f1", "g")
    seen = _run_dropped_step(
        build(POLICIES[policy]), build(POLICIES[policy]), _train_bags(features)
    )
    assert seen["evictions"] + seen["expired"] > 0, seen  # live ids lost their rows
    if policy == "admit_after":
        assert seen["admissions"] > 0, seen


@pytest.mark.parametrize("policy", list(POLICIES))
def test_dropped_step_on_the_torch_remap_path(policy: str, monkeypatch: Any) -> None:
    """The same with the remap in torch ops (the CUDA path; CPU uses native code if it can)."""
    monkeypatch.setattr(IdMap, "native", False)
    build = _bag_module("adam", Backend.RECOPT, True)
    seen = _run_dropped_step(
        build(POLICIES[policy]), build(POLICIES[policy]), _train_bags(FEATURES)
    )
    assert seen["evictions"] + seen["expired"] > 0, seen


@pytest.mark.parametrize("name", ["adafactor", "sgd"])
def test_dropped_step_restores_other_optimizers(name: str) -> None:
    """Adafactor's state is not by rows (whole copies); sgd has no state at all."""
    build = _bag_module(name, Backend.RECOPT, True)
    seen = _run_dropped_step(build(POLICIES["lru"]), build(POLICIES["lru"]), _train_bags(FEATURES))
    assert seen["evictions"] > 0


def test_nonfinite_step_is_dropped_and_restored() -> None:
    """The gate skips the fused update of a NaN step, but the forward already stepped the maps
    and re-initialised rows: the guard drops the step and puts all of it back."""
    build = _bag_module("adam", Backend.RECOPT, True)
    policy = POLICIES["admit_after"]
    seen = _run_dropped_step(build(policy), build(policy), _train_bags(FEATURES), nonfinite=True)
    assert seen["evictions"] > 0


def _ec_tables(id_map: IdMapConfig) -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(
            name=t.name,
            num_embeddings=t.num_embeddings,
            embedding_dim=4,
            feature_names=t.feature_names,
            id_map=t.id_map,
        )
        for t in _tables(id_map, shared=False)
    ]


def train_ec(module: nn.Module, step: int) -> torch.Tensor:
    rows = module(_kjt(step, ("f0", "f1", "g")))
    out = torch.cat([jt.values() for jt in rows.values()])
    _loss(out, step).backward()
    return out.detach()


@pytest.mark.parametrize(
    "name, backend", [("adam", Backend.RECOPT), ("row_wise_adagrad", Backend.FBGEMM)]
)
def test_embedding_collection_dropped_step(name: str, backend: Backend) -> None:
    config = FusedOptimizerConfig(name=name, lr=0.05, eps=1e-3, backend=backend)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return FusedEmbeddingCollection(_ec_tables(POLICIES["lfu"]), optimizer=config)

    seen = _run_dropped_step(build(), build(), train_ec)
    assert seen["evictions"] > 0


def test_guard_stops_observing_when_removed() -> None:
    module = _bag_module("sgd", Backend.RECOPT, True)(POLICIES["lru"])
    guard = FusedEmbeddingGuard(module)
    maps = module.id_maps
    assert maps is not None and maps.observers == [guard]
    guard.remove()
    assert maps.observers == []
    _train_bags(FEATURES)(module, 0)
    assert guard.snapshot_bytes() == 0


def test_a_copy_of_a_guarded_module_is_not_observed() -> None:
    """deepcopy / pickle drop the observers: a copy's map steps are not the guard's to undo."""
    module = _bag_module("sgd", Backend.RECOPT, True)(POLICIES["lru"])
    guard = FusedEmbeddingGuard(module)
    clone = copy.deepcopy(module)
    assert clone.id_maps.observers == []  # type: ignore[union-attr]
    assert module.id_maps.observers == [guard]  # type: ignore[union-attr]
    _train_bags(FEATURES)(clone, 0)
    assert guard.snapshot_bytes() == 0
    _train_bags(FEATURES)(module, 0)
    assert guard.snapshot_bytes() > 0


# -- sharded: 2 ranks, one spawned group -------------------------------------------------------


def _requests(kind: str, world: int) -> dict[str, Any]:
    from recopt.sharding import column_wise, row_wise, table_row_wise, table_wise

    last = world - 1
    if kind == "table_wise":
        return {"t0": table_wise(last), "t1": table_wise(0), "t2": table_wise(0)}
    if kind == "row_wise":
        return {"t0": row_wise(), "t1": row_wise(), "t2": table_wise(last)}
    if kind == "table_row_wise":
        return {"t0": table_row_wise(0), "t1": table_row_wise(0), "t2": table_wise(0)}
    # mixed: id-mapped tables row- and table-wise, the unmapped one column-wise
    return {"t0": row_wise(), "t1": table_wise(last), "t2": column_wise([last])}


SHARDED_CASES = [
    ("table_wise", "adam", "lru"),
    ("row_wise", "row_wise_adagrad", "lfu"),
    ("row_wise", "adagrad", "ttl_steps"),
    ("table_row_wise", "adam", "admit_after"),
    ("mixed", "sgd", "admit_after"),
]


def _local_state(module: nn.Module) -> dict[str, Any]:
    """The rank's own tensors: local shards of ShardedTensors, plain tensors as they are."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    def local(value: Any) -> Any:
        if isinstance(value, ShardedTensor):
            return [s.tensor for s in value.local_shards()]
        if isinstance(value, dict):
            return {k: local(v) for k, v in value.items()}
        return value

    return local(state_of(module))


def _sharded_train(world: int, rank: int, features: tuple[str, ...]) -> Any:
    def train(module: nn.Module, step: int) -> torch.Tensor:
        nan = step < -1000
        step = step + 1000 if nan else step
        out = module(_kjt(step, features, rank)).values()
        loss = _loss(out, 10 * step + rank) * (float("nan") if nan else 1.0)
        loss.backward()
        return out.detach()

    return train


def _sharded_case(kind: str, name: str, policy: str, rank: int, world: int, nan: bool) -> None:
    from recopt.sharding import construct_module_sharding_plan
    from recopt.sharding.sharded_embedding import ShardedEmbeddingBagCollection

    tables = _tables(POLICIES[policy], shared=True)
    plan = construct_module_sharding_plan(tables, _requests(kind, world), world)
    config = FusedOptimizerConfig(name=name, lr=0.05, eps=1e-3)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return ShardedEmbeddingBagCollection(tables, plan, optimizer=config)

    train = _sharded_train(world, rank, FEATURES)
    seen = _run_dropped_step(build(), build(), train, nan, _local_state)
    assert seen["evictions"] + seen["expired"] > 0, (kind, seen)


def _sharded_ec_case(kind: str, rank: int, world: int) -> None:
    from recopt.sharding import construct_module_sharding_plan
    from recopt.sharding.sharded_embedding_collection import ShardedEmbeddingCollection

    tables = _ec_tables(POLICIES["lru"])
    plan = construct_module_sharding_plan(tables, _requests(kind, world), world)
    config = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.05)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return ShardedEmbeddingCollection(tables, plan, optimizer=config)

    def train(module: nn.Module, step: int) -> torch.Tensor:
        rows = module(_kjt(step, ("f0", "f1", "g"), rank))
        out = torch.cat([jt.values() for jt in rows.values()])
        _loss(out, 10 * step + rank).backward()
        return out.detach()

    seen = _run_dropped_step(build(), build(), train, state=_local_state)
    assert seen["evictions"] > 0, (kind, seen)


def _all_sharded_cases(rank: int, world: int) -> list[str]:
    done = []
    for kind, name, policy in SHARDED_CASES:
        _sharded_case(kind, name, policy, rank, world, nan=False)
        done.append(f"{kind}/{name}/{policy}")
    _sharded_case("row_wise", "adam", "admit_after", rank, world, nan=True)
    done.append("row_wise non-finite")
    IdMap.native = False  # the torch remap (this process only)
    try:
        _sharded_case("table_wise", "adam", "lfu", rank, world, nan=False)
    finally:
        IdMap.native = True
    done.append("table_wise, torch remap")
    for kind in ("table_wise", "row_wise"):
        _sharded_ec_case(kind, rank, world)
        done.append(f"ec/{kind}")
    return done


@pytest.mark.multiprocess
def test_sharded_dropped_step_restores_every_rank() -> None:
    results = run_on_ranks(_all_sharded_cases, 2, timeout_s=270.0)
    assert results[0] == results[1] and len(results[0]) == len(SHARDED_CASES) + 4


# -- end to end on torchft's manager ------------------------------------------------------------


@pytest.mark.multiprocess
def test_torchft_dropped_step_of_an_id_mapped_dlrm() -> None:
    """Two DLRMs with id-mapped tables, each a replica group alone on its own torchft
    lighthouse: the one that drops position 1 once (rolled back, retrained) commits, step for
    step, the same state digest (maps included) as the one that never dropped it."""
    pytest.importorskip("torchft", reason="the ft extra: pip install 'recopt[ft]'")
    import concurrent.futures

    from ft_torchft_groups import Scenario, replica_group
    from torchft.coordination import LighthouseServer

    servers = [
        LighthouseServer(
            bind="[::]:0", min_replicas=1, join_timeout_ms=200, heartbeat_timeout_ms=1000
        )
        for _ in range(2)
    ]
    try:
        addresses = [f"http://127.0.0.1:{s.address().rsplit(':', 1)[1]}" for s in servers]
        specs = [
            Scenario(replica_id="A", lighthouse=addresses[0], steps=4, seed=1, id_map=True),
            Scenario(
                replica_id="B", lighthouse=addresses[1], steps=4, seed=1, drop_at=1, id_map=True
            ),
        ]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            runs = pool.map(lambda s: run_on_ranks(replica_group, 1, s, timeout_s=150), specs)
            reference, dropping = (result[0] for result in runs)
    finally:
        for server in servers:
            server.shutdown()
    dropped = [e for e in dropping if not e["committed"]]
    assert [(e["position"], e["error"]) for e in dropped] == [(1, "RuntimeError")], dropping
    assert dropped[0]["after"] == dropped[0]["before"]
    assert all(e["committed"] for e in reference)
    committed = [(e["position"], e["after"]) for e in dropping if e["committed"]]
    assert committed == [(e["position"], e["after"]) for e in reference]
