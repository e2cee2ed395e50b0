"""Id-mapped fused tables kept identical across replica groups (`EmbeddingReplicaSync`).

Each spawned rank is one replica group: a `StepTransaction` over the gloo world (the vote is
an all-reduce of the oks), a guard and the replica sync, each group training on its own
batches. After every step, the maps, weights and optimizer states must be bit-identical across
groups (torch.equal). The maps must equal, bit for bit, those of one plain collection fed the
groups' batches concatenated (a map step depends only on the ids); its weights and states
agree up to float rounding (it sums row gradients in another order). A dropped step (an
injected error, or a NaN loss in one group) rolls every group back; a group that heals from a
peer's state_dict (maps included) stays identical; an evaluation forward gathers nothing.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_ft_id_map import (
    POLICIES,
    OneReplica,
    _ec_tables,
    _loss,
    _tables,
    assert_same,
    bags,
    state_of,
)
from torch import nn

from recopt.ft.embedding import FusedEmbeddingGuard
from recopt.ft.embedding_tables import id_maps_of
from recopt.ft.replica_sync import EmbeddingReplicaSync
from recopt.ft.steps import StepTransaction
from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.modules import FusedEmbeddingBagCollection, FusedEmbeddingCollection
from recopt.modules.id_map import IdMap
from recopt.sparse import KeyedJaggedTensor, KeyedTensor
from recopt.testing import run_on_ranks

FEATURES = ("f0", "f1", "f2", "g")
CONFIG = FusedOptimizerConfig(name="adam", lr=0.05, eps=1e-3, backend=Backend.RECOPT)
# (step, forwards, what): "drop" reports an error, "nan" gives group 1 a NaN loss, "bad" an
# out-of-range id of the unmapped table (its forward raises; the others' steps drop).
PLAN: list[tuple[int, int, str]] = [
    (0, 1, ""),
    (1, 1, ""),
    (-1, 1, ""),  # new ids from every group: the maps fill and evict
    (2, 2, ""),  # two forwards: the second reads rows the first's backward updated
    (3, 2, "drop"),  # two forwards (two map steps to undo)
    (4, 1, "nan"),
    (5, 1, "heal"),  # the last group reloads its state from group 0's first
    (6, 1, "eval"),  # group 0 also runs an evaluation forward
    (7, 1, ""),
    (8, 1, "bad"),
    (9, 1, ""),
]
DROPPED = ("drop", "nan", "bad")


class WorldReplicas(StepTransaction):
    """Every rank of the gloo world is a replica group; the vote: all oks, all-reduced."""

    def __init__(self) -> None:
        super().__init__("test", 1, datetime.timedelta(seconds=60))
        self._pg = dist.distributed_c10d._get_default_group()

    def start_quorum(self) -> None:
        self._errored = None
        self._rank, self._num_participants = dist.get_rank(), dist.get_world_size()
        self._begin()

    def _vote(self, ok: bool) -> bool:
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())


@dataclasses.dataclass(frozen=True)
class Case:
    """``policy`` of POLICIES; ``ec``: a FusedEmbeddingCollection (else bags); ``native``:
    the native CPU remap (else the torch one)."""

    policy: str
    ec: bool = False
    native: bool = True


def _build(case: Case) -> nn.Module:
    torch.manual_seed(0)
    if case.ec:
        return FusedEmbeddingCollection(_ec_tables(POLICIES[case.policy]), optimizer=CONFIG)
    tables = _tables(POLICIES[case.policy], shared=True)
    return FusedEmbeddingBagCollection(tables, optimizer=CONFIG)


def _batch(case: Case, step: int, forward: int, ranks: list[int]) -> KeyedJaggedTensor:
    """The bags of ``ranks`` (one group, or all of them concatenated), forward ``forward``."""
    seed = step + 50 * forward if step >= 0 else step - forward
    features = ("f0", "f1", "g") if case.ec else FEATURES
    per_rank = [bags(seed, features, r) for r in ranks]
    return KeyedJaggedTensor.from_id_lists({f: sum((b[f] for b in per_rank), []) for f in features})


def _forward(module: nn.Module, batch: KeyedJaggedTensor) -> torch.Tensor:
    out = module(batch)
    if isinstance(out, KeyedTensor):
        return out.values()
    return torch.cat([jt.values() for jt in out.values()])  # FusedEmbeddingCollection


def _attach(module: nn.Module, tx: StepTransaction) -> None:
    EmbeddingReplicaSync(module, tx, FusedEmbeddingGuard(module, tx))


def _heal(module: Any, case: Case) -> Any:
    """The last group rebuilds its module and loads group 0's state (as healing does)."""
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    sent = [state_of(module) if rank == 0 else None]
    dist.broadcast_object_list(sent, src=0)
    if rank != last:
        return module
    fresh: Any = _build(case)
    state = sent[0]
    assert state is not None
    fresh.load_state_dict(state["model"])
    optim = fresh.fused_optimizer.state_dict()
    optim["state"] = state["optim"]
    fresh.fused_optimizer.load_state_dict(optim)
    return fresh


def _step(case: Case, module: nn.Module, tx: StepTransaction, plan: tuple[int, int, str]) -> bool:
    """One step of PLAN in this group; whether it committed."""
    step, forwards, what = plan
    rank = dist.get_rank()
    tx.start_quorum()
    for forward in range(forwards):
        batch = _batch(case, step, forward, [rank])
        if what == "bad" and rank == 1:  # an id out of table g's range: raises after the gather
            values = batch.values().clone()
            values[-1] = 99
            batch = KeyedJaggedTensor(batch.keys(), values, lengths=batch.lengths())
            with pytest.raises(ValueError, match="'g'"):
                module(batch)
            tx.report_error(RuntimeError("bad batch"))  # as a training loop would
            continue
        out = _forward(module, batch)
        nan = what == "nan" and rank == 1
        (_loss(out, 10 * step + forward) * (float("nan") if nan else 1.0)).backward()
    if what == "drop":
        tx.report_error(RuntimeError("injected"))
    return tx.should_commit()


def _groups(rank: int, world: int, case: Case) -> list[dict[str, Any]]:
    """Run PLAN in this group; every step's state (after its vote) and outcome."""
    IdMap.native = case.native  # this process only
    tx = WorldReplicas()
    module: Any = _build(case)
    _attach(module, tx)
    states = []
    for step, forwards, what in PLAN:
        if what == "heal":
            healed = _heal(module, case)
            if healed is not module:
                module, tx = healed, WorldReplicas()
                _attach(module, tx)
        if what == "eval":
            module.eval()
            before = state_of(module)
            if rank == 0:
                with torch.no_grad():
                    module(_batch(case, step, 9, [rank]))
            assert_same(before, state_of(module), "evaluation")
            module.train()
        before = state_of(module)
        committed = _step(case, module, tx, (step, forwards, what))
        assert committed == (what not in DROPPED), (step, what, tx.errored())
        if not committed:
            assert_same(before, state_of(module), f"rolled back at step {step}")
        states.append({"committed": committed, "state": state_of(module), "stats": module.stats()})
    return states


def _reference(world: int, case: Case) -> list[dict[str, Any]]:
    """One plain collection fed, per committed step, every group's batch concatenated (a
    FusedEmbeddingCollection only steps its maps: its rows are not split by group here)."""
    module = _build(case)
    states = []
    for step, forwards, what in PLAN:
        if what not in DROPPED:
            for forward in range(forwards):
                out = _forward(module, _batch(case, step, forward, list(range(world))))
                if case.ec:
                    continue
                parts = out.chunk(world)
                loss = sum(_loss(p, 10 * step + forward) for p in parts) / world
                assert isinstance(loss, torch.Tensor)
                loss.backward()
        states.append(state_of(module))
    return states


def _assert_close(a: Any, b: Any, where: str) -> None:
    if isinstance(a, dict):
        for key in a:
            _assert_close(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, torch.Tensor):
        assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6), where


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "world, case",
    [
        (2, Case("lru")),
        (3, Case("admit_after")),
        (2, Case("ttl_steps", native=False)),
        (2, Case("lfu", ec=True)),
    ],
    ids=["2-lru", "3-admit_after", "2-ttl-torch-remap", "2-lfu-embedding-collection"],
)
def test_replica_groups_keep_id_maps_and_rows_identical(world: int, case: Case) -> None:
    runs = run_on_ranks(_groups, world, case, timeout_s=240.0)
    reference = _reference(world, case)
    evicted = 0
    for s, (step, _, what) in enumerate(PLAN):
        for r in range(1, world):
            assert_same(runs[0][s]["state"], runs[r][s]["state"], f"group {r}, step {step}")
        model, expected = runs[0][s]["state"]["model"], reference[s]["model"]
        maps = [k for k in expected if k.startswith("id_maps.")]
        assert maps and all(torch.equal(model[k], expected[k]) for k in maps), (step, what)
        if not case.ec:
            _assert_close(runs[0][s]["state"], reference[s], f"step {step}")
        evicted += sum(t["evictions"] + t["expired"] for t in runs[0][s]["stats"].values())
    assert evicted > 0  # the maps did evict live ids along the way


def test_one_group_with_sync_trains_as_without() -> None:
    """Alone in its quorum, a synced group's gather returns its own ids: the same map steps
    and rows as a twin whose maps step locally (the twin also has the row-gradient hooks,
    whose rounding differs from the plain kernel's)."""
    tx, twin_tx = OneReplica(), OneReplica()
    module, twin = _build(Case("lfu")), _build(Case("lfu"))
    _attach(module, tx)
    _attach(twin, twin_tx)
    maps, twin_maps = id_maps_of(module), id_maps_of(twin)
    assert maps is not None and maps.peers is not None and twin_maps is not None
    twin_maps.peers = None
    for step, forwards, _ in PLAN:
        tx.start_quorum()
        twin_tx.start_quorum()
        for forward in range(forwards):
            for m in (module, twin):
                _loss(_forward(m, _batch(Case("lfu"), step, forward, [0])), step).backward()
        assert tx.should_commit() and twin_tx.should_commit()
        assert_same(state_of(twin), state_of(module), f"step {step}")


def test_replica_sync_refuses_init_fn_on_id_mapped_tables() -> None:
    tables = _tables(POLICIES["lru"], shared=True)
    tables[1] = dataclasses.replace(tables[1], init_fn=torch.nn.init.zeros_)
    torch.manual_seed(0)
    module: Any = FusedEmbeddingBagCollection(tables, optimizer=CONFIG)
    tx = OneReplica()
    with pytest.raises(ValueError, match=r"tables \['t1'\] have id_map and init_fn"):
        _attach(module, tx)
    assert module.id_maps is not None and module.id_maps.peers is None
    assert all(k.grad_hook is None for k in module.kernels())  # refused before any hook


def test_guard_lets_a_bad_id_raise_its_own_error() -> None:
    """The guard's snapshot skips ids out of a table's range: the forward's check names them."""
    module = _build(Case("lru"))
    FusedEmbeddingGuard(module, OneReplica())
    batch = _batch(Case("lru"), 0, 0, [0])
    values = batch.values().clone()
    values[-1] = 99  # feature g, table t2 (5 rows, not id-mapped)
    with pytest.raises(ValueError, match="'g'"):
        module(KeyedJaggedTensor(batch.keys(), values, lengths=batch.lengths()))


def _sharded_groups(rank: int, world: int, case: Case) -> list[dict[str, torch.Tensor]]:
    """Each rank a replica group holding a one-rank sharded collection (table-wise; of bags,
    or an embedding collection with ``case.ec``) with the replica sync: its shard maps step
    with every group's ids (`ShardedIdMaps`). Per step, the maps' buffers and the weights."""
    from recopt.sharding import construct_module_sharding_plan, table_wise
    from recopt.sharding.sharded_embedding import ShardedEmbeddingBagCollection
    from recopt.sharding.sharded_embedding_collection import ShardedEmbeddingCollection

    own = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group
    tables: Any = _ec_tables(POLICIES["lru"]) if case.ec else _tables(POLICIES["lru"], True)
    plan = construct_module_sharding_plan(tables, {t.name: table_wise(0) for t in tables}, 1)
    torch.manual_seed(0)
    kind: Any = ShardedEmbeddingCollection if case.ec else ShardedEmbeddingBagCollection
    module = kind(tables, plan, optimizer=CONFIG, process_group=own)
    tx = WorldReplicas()
    _attach(module, tx)
    maps = module.id_maps
    assert maps is not None and maps.peers is not None

    def snapshot() -> dict[str, torch.Tensor]:
        state = {f"{n}.{k}": v.clone() for n in maps for k, v in maps[n].named_buffers()}
        for k, kernel in enumerate(module.kernels()):
            for t, weight in enumerate(kernel.split_embedding_weights()):
                state[f"weight.{k}.{t}"] = weight.clone()
        return state

    seen = []
    for step in (0, -1, 1, 2, 3):  # -1: new ids from every group (the maps evict)
        tx.start_quorum()
        batch = _batch(case, step, 0, [rank])
        before = snapshot()
        if step == 3 and rank == 1:  # an id out of the unmapped table g's range
            values = batch.values().clone()
            values[-1] = 99
            with pytest.raises(ValueError, match="'g'"):  # after joining the gather
                module(KeyedJaggedTensor(batch.keys(), values, lengths=batch.lengths()))
            tx.report_error(RuntimeError("bad batch"))
        else:
            _loss(_forward(module, batch), step).backward()
        committed = tx.should_commit()
        assert committed == (step != 3), (step, tx.errored())
        if not committed:  # every group's maps and rows as before the step
            assert all(torch.equal(v, before[k]) for k, v in snapshot().items()), step
        seen.append(snapshot())
    # a collection on a group that is not the world: its shards name their global rank
    sharded = [v for v in module.state_dict().values() if hasattr(v, "local_shards")]
    assert sharded and all(
        shard.metadata.placement is not None and shard.metadata.placement.rank() == rank
        for value in sharded
        for shard in value.local_shards()
    )
    return seen


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [Case("lru"), Case("lru", ec=True)], ids=["bags", "ec"])
def test_a_sharded_collections_shard_maps_step_with_every_groups_ids(case: Case) -> None:
    """Replica groups of sharded collections: the shard maps and rows stay bit-identical
    across groups, and the maps equal a plain collection's fed every group's batch; a bad
    batch in one group drops the step in both, rolled back."""
    runs = run_on_ranks(_sharded_groups, 2, case)
    reference = _build(case)
    for s, step in enumerate((0, -1, 1, 2, 3)):
        for key, value in runs[0][s].items():
            assert torch.equal(value, runs[1][s][key]), (step, key)
        if step == 3:  # dropped everywhere
            continue
        out = _forward(reference, _batch(case, step, 0, [0, 1]))
        if not case.ec:  # (an embedding collection's rows are not split by group here)
            sum(_loss(p, step) for p in out.chunk(2)).backward()  # type: ignore[union-attr]
        expected = reference.state_dict()
        keys = [k for k in expected if k.startswith("id_maps.")]
        assert keys
        for key in keys:
            assert torch.equal(runs[0][s][key[len("id_maps.") :]], expected[key]), (step, key)
