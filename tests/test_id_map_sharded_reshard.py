"""Id-mapped tables loaded under another plan or world size: every id moves to its owner shard.

A DistributedModelParallel checkpoint saved at 2 ranks row-wise, `recopt-reshard`ed to 3, is
loaded at 3 ranks table-row-wise and row-wise; an unsharded collection's state is loaded into
a row-wise one. The first forward after the load relocates the ids (`id_map_relocate`), and
compared by id with what was saved: the same live ids, each with its weight row, optimizer
state, last_seen and frequency bit for bit (candidates too), each on the shard that owns it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_id_map_sharded import drifting_bags

from recopt.kernels.config import FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, IdMapConfig
from recopt.modules.id_map_rows import route_shard
from recopt.sharding import construct_module_sharding_plan, row_wise, table_row_wise
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess

STEPS = 6
FEATURES = ("f0", "f1", "g")
# Rows to spare: every id live at the save finds a row at its owner under the new plan.
# Width 8 and one feature a table: fbgemm's CPU kernels can run them too.
TABLES = [
    EmbeddingBagConfig(
        name="t0",
        num_embeddings=60,
        embedding_dim=8,
        feature_names=("f0",),
        id_map=IdMapConfig(policy="lfu", decay=0.8, ttl_steps=2, admit_after=2),
    ),
    EmbeddingBagConfig(
        name="t1",
        num_embeddings=60,
        embedding_dim=8,
        feature_names=("f1",),
        id_map=IdMapConfig(policy="lru"),
    ),
    EmbeddingBagConfig(name="t2", num_embeddings=5, embedding_dim=8, feature_names=("g",)),
]
MAPPED = ("t0", "t1")


def _bags(rank: int, step: int) -> dict[str, list[list[int]]]:
    return drifting_bags(FEATURES, rank, step)


def _kjt(bags: dict[str, list[list[int]]]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_id_lists(bags)


def _requests(kind: str) -> dict[str, Any]:
    make = row_wise if kind == "row_wise" else (lambda: table_row_wise(0))
    return {t.name: make() for t in TABLES}


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = FusedOptimizerConfig(name="adam", lr=0.05, eps=1e-3)
        self.sparse = FusedEmbeddingBagCollection(TABLES, optimizer=config)
        self.dense = torch.nn.Linear(24, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(self.sparse(kjt).values()).square().sum()


def _dmp(kind: str, world: int) -> Any:
    from recopt.sharding import ShardingPlan
    from recopt.sharding.model_parallel import DistributedModelParallel

    plan = construct_module_sharding_plan(TABLES, _requests(kind), world)
    return DistributedModelParallel(_Model(), ShardingPlan({"sparse": plan}))


def _full(value: Any) -> torch.Tensor:
    """The whole tensor on every rank (a ShardedTensor's shards summed over the ranks)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from recopt.comm import all_reduce

    if not isinstance(value, ShardedTensor):
        return value.detach().clone()
    wide = torch.float64 if value.dtype.is_floating_point else torch.int64
    full = torch.zeros(value.size(), dtype=wide)
    for shard in value.local_shards():
        offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
        full[index] = shard.tensor.to(wide)
    return all_reduce(full, None).to(value.dtype)


def _full_states(module: Any, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``module`` and its fused optimizer state (``param/key``), whole."""
    out = {k: _full(v) for k, v in module.state_dict().items() if k.startswith(prefix)}
    for param, states in module.fused_optimizer.state_dict()["state"].items():
        for key, value in states.items():
            out[f"{param}/{key}"] = _full(value)
    return out


def _live(full: dict[str, torch.Tensor], prefix: str, table: EmbeddingBagConfig) -> torch.Tensor:
    maps = f"{prefix}id_maps.{table.name}."
    live = full[maps + "occupied"].clone()
    assert table.id_map is not None
    if table.id_map.ttl_steps is not None:
        live &= full[maps + "step"] - full[maps + "last_seen"] <= table.id_map.ttl_steps
    return live


def _by_id(full: dict[str, torch.Tensor], prefix: str) -> dict[str, dict[int, list[torch.Tensor]]]:
    """Per mapped table: live id -> [weight row, last_seen, frequency, each optimizer state
    row]; and ``<table>/candidates``: candidate id -> [count, last_seen]."""
    out: dict[str, dict[int, list[torch.Tensor]]] = {}
    for table in TABLES:
        if table.name not in MAPPED:
            continue
        maps, param = f"{prefix}id_maps.{table.name}.", f"{prefix}embedding_bags.{table.name}"
        per_row = [full[f"{param}.weight"], full[maps + "last_seen"], full[maps + "frequency"]]
        prefix_state = f"{param}.weight/{table.name}."
        per_row += [v for k, v in sorted(full.items()) if k.startswith(prefix_state) and v.dim()]
        rows = _live(full, prefix, table).nonzero().squeeze(1).tolist()
        ids = full[maps + "row_ids"]
        out[table.name] = {int(ids[r]): [t[r] for t in per_row] for r in rows}
        if maps + "candidate_ids" in full:
            used = full[maps + "candidate_used"].nonzero().squeeze(1).tolist()
            fields = [full[maps + k] for k in ("candidate_count", "candidate_last_seen")]
            cands = full[maps + "candidate_ids"]
            out[f"{table.name}/candidates"] = {int(cands[s]): [f[s] for f in fields] for s in used}
    return out


def _misplaced(module: Any, prefix: str) -> list[int]:
    """Per mapped table: the live ids of this rank's shards that another shard owns."""
    state = module.state_dict()
    counts = []
    for table in TABLES:
        if table.name not in MAPPED:
            continue
        maps = f"{prefix}id_maps.{table.name}."
        ids, occupied = state[maps + "row_ids"], state[maps + "occupied"]
        last_seen, step = state[maps + "last_seen"], state[maps + "step"]
        shards = ids.metadata().shards_metadata
        wrong = 0
        for local, used, seen in zip(
            ids.local_shards(), occupied.local_shards(), last_seen.local_shards(), strict=True
        ):
            k = [m.shard_offsets for m in shards].index(local.metadata.shard_offsets)
            live = used.tensor.clone()
            assert table.id_map is not None
            if table.id_map.ttl_steps is not None:
                live &= step - seen.tensor <= table.id_map.ttl_steps
            wrong += int((route_shard(local.tensor[live], len(shards)) != k).sum())
        counts.append(wrong)
    return counts


def _save_at(rank: int, world: int, root: str) -> dict[str, Any]:
    from recopt.checkpoint import save

    dmp = _dmp("row_wise", world)
    dense = torch.optim.SGD([p for _, p in dmp.named_parameters()], lr=0.01)
    for step in range(STEPS):
        loss = dmp(_kjt(_bags(rank, step)))
        dense.zero_grad()
        loss.backward()
        dense.step()
    save(Path(root) / "ck", dmp, {"fused": dmp.fused_optimizer}, step=STEPS)
    return _by_id(_full_states(dmp, "sparse."), "sparse.")


def _load_at(rank: int, world: int, root: str) -> list[tuple[list[int], list[int], Any]]:
    """For each plan: misplaced ids after the load, after the first forward, and by id."""
    from recopt.checkpoint import load

    out = []
    for kind in ("table_row_wise", "row_wise"):
        dmp = _dmp(kind, world)
        load(Path(root) / "resharded", dmp, {"fused": dmp.fused_optimizer})
        before = _misplaced(dmp, "sparse.")
        dmp.eval()
        with torch.no_grad():
            dmp(_kjt(_bags(rank, STEPS)))  # the first forward relocates, then reads the maps
        out.append(
            (before, _misplaced(dmp, "sparse."), _by_id(_full_states(dmp, "sparse."), "sparse."))
        )
    return out


def _assert_same_by_id(got: dict[str, Any], want: dict[str, Any], name: str) -> None:
    assert sorted(got) == sorted(want), name
    for key, ids in want.items():
        assert sorted(got[key]) == sorted(ids) and ids, (name, key)
        for i, values in ids.items():
            for n, (a, b) in enumerate(zip(got[key][i], values, strict=True)):
                assert torch.equal(a, b), (name, key, i, n)


def test_reshard_two_to_three_ranks_keeps_every_ids_row_and_state(tmp_path: Path) -> None:
    from recopt.checkpoint.reshard import reshard

    saved = run_on_ranks(_save_at, 2, str(tmp_path), timeout_s=270.0)[0]
    reshard(tmp_path / "ck", tmp_path / "resharded", world_size=3)
    loaded = run_on_ranks(_load_at, 3, str(tmp_path), timeout_s=270.0)
    for kind, per_rank in zip(
        ("table_row_wise", "row_wise"), zip(*loaded, strict=True), strict=True
    ):
        assert sum(sum(before) for before, _, _ in per_rank) > 0, kind  # ids had to move
        assert all(after == [0, 0] for _, after, _ in per_rank), kind
        for _, _, by_id in per_rank:
            _assert_same_by_id(by_id, saved, kind)


def _unsharded_case(
    rank: int, world: int, optimizer: str, backend: str
) -> tuple[list[int], list[int], bool]:
    """An unsharded collection's state (module and optimizer) loaded into a row-wise one."""
    from recopt.sharding.sharded_embedding import ShardedEmbeddingBagCollection

    config = FusedOptimizerConfig(name=optimizer, lr=0.05, eps=1e-3, backend=backend)
    torch.manual_seed(0)
    ref = FusedEmbeddingBagCollection(TABLES, optimizer=config)
    for step in range(STEPS):  # the same on every rank: all ranks' batches, one module
        everyone = [_bags(r, step) for r in range(world)]
        bags = {f: [b for per in everyone for b in per[f]] for f in FEATURES}
        ref(_kjt(bags)).values().square().sum().backward()
    plan = construct_module_sharding_plan(TABLES, _requests("row_wise"), world)
    sharded = ShardedEmbeddingBagCollection(TABLES, plan, optimizer=config)
    sharded.load_state_dict(ref.state_dict())
    _load_optimizer_rows(sharded, ref)
    before = _misplaced(sharded, "")
    sharded.eval()
    with torch.no_grad():
        sharded(_kjt(_bags(rank, STEPS)))
    want = _by_id(_full_states(ref, ""), "")
    _assert_same_by_id(_by_id(_full_states(sharded, ""), ""), want, "unsharded -> row_wise")
    return before, _misplaced(sharded, ""), True


def _load_optimizer_rows(sharded: Any, ref: Any) -> None:
    """Copy the unsharded optimizer's per-row and per-element state into the shards' rows
    (a fused optimizer loads only a state of its own layout)."""
    ref_state = ref.fused_optimizer.state_dict()["state"]
    for param, states in sharded.fused_optimizer.state_dict()["state"].items():
        for key, value in states.items():
            if not hasattr(value, "local_shards") or value.dim() == 0:
                continue
            for shard in value.local_shards():
                start, size = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
                with torch.no_grad():
                    shard.tensor.copy_(ref_state[param][key][start : start + size])


@pytest.mark.parametrize(
    ("optimizer", "backend"), [("adam", "recopt"), ("row_wise_adagrad", "fbgemm")]
)
def test_unsharded_state_loaded_row_wise_moves_every_id_to_its_owner(
    optimizer: str, backend: str
) -> None:
    results = run_on_ranks(_unsharded_case, 3, optimizer, backend, timeout_s=270.0)
    assert sum(sum(before) for before, _, _ in results) > 0  # ids had to move
    assert all(after == [0, 0] and ok for _, after, ok in results)
