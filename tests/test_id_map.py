"""IdMap (recopt/modules/id_map.py): raw ids to rows, policies hand-checked on small cases."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from recopt.config import from_dict
from recopt.kernels import cpu_id_map
from recopt.modules import EmbeddingBagConfig, IdMapConfig
from recopt.modules.id_map import IdMap
from recopt.modules.id_map_rows import hash_uniform


@pytest.fixture(autouse=True, params=["native", "torch"])
def remap_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test on both remap paths: native code (when it builds) and torch ops."""
    if request.param == "native" and not cpu_id_map.available():
        pytest.skip("no C compiler: the native remap is not built")
    monkeypatch.setattr(IdMap, "native", request.param == "native")


def _step(idmap: IdMap, ids: list[int], training: bool = True) -> list[int]:
    return idmap.remap(torch.tensor(ids, dtype=torch.int64), training).rows_M.tolist()


def _table(idmap: IdMap) -> dict[int, int]:
    """Raw id -> row of the live rows."""
    rows = idmap.occupied.nonzero().squeeze(1).tolist()
    return {int(idmap.row_ids[r]): r for r in rows}


def test_distinct_ids_under_capacity_never_share_a_row() -> None:
    gen = torch.Generator().manual_seed(0)
    space = torch.randint(-(2**62), 2**62, (300,), generator=gen)  # any int64, negatives too
    idmap = IdMap(IdMapConfig(policy="lru"), num_rows=300)
    assigned: dict[int, int] = {}
    for _ in range(20):
        ids = space[torch.randint(0, 300, (64,), generator=gen)]
        rows = _step(idmap, ids.tolist())
        for raw, row in zip(ids.tolist(), rows, strict=True):
            assert assigned.setdefault(raw, row) == row  # an id keeps its row
    assert len(set(assigned.values())) == len(assigned)  # no two ids share a row
    assert _table(idmap) == assigned
    assert idmap.last_stats.evictions == 0


def test_lru_evicts_least_recently_seen_row_not_in_batch() -> None:
    idmap = IdMap(IdMapConfig(policy="lru"), num_rows=3)
    assert _step(idmap, [10, 20]) == [0, 1]
    assert _step(idmap, [30, 10]) == [2, 0]
    # full: 20 (seen at step 1) is the least recently seen
    result = idmap.remap(torch.tensor([40]), True)
    assert result.rows_M.tolist() == [1] and result.fresh_rows.tolist() == [1]
    assert result.fresh_ids.tolist() == [40] and result.stats.evictions == 1
    # 10 is in the batch (protected), 30 (step 2) is older than 40 (step 3)
    assert _step(idmap, [50, 50, 10]) == [2, 2, 0]
    assert _table(idmap) == {10: 0, 40: 1, 50: 2}


def test_lfu_decay_changes_the_victim() -> None:
    def run(decay: float) -> dict[int, int]:
        idmap = IdMap(IdMapConfig(policy="lfu", decay=decay), num_rows=2)
        _step(idmap, [1, 1, 1, 2])  # 1: count 3, 2: count 1 (step 1)
        _step(idmap, [2])  # 2: 1 * decay + 1 (step 2)
        _step(idmap, [3])  # evict the lowest decayed count
        return _table(idmap)

    # no decay: 1 has 3, 2 has 2 -> 2 goes
    assert run(1.0) == {1: 0, 3: 1}
    # decay 0.5 at step 3: 1 has 3 * 0.25 = 0.75, 2 has 1.5 * 0.5 = 0.75: a tie, and the
    # least recently seen (1, step 1) goes
    assert run(0.5) == {3: 0, 2: 1}


def test_lfu_default_decay_and_count_order() -> None:
    idmap = IdMap(IdMapConfig(policy="lfu"), num_rows=2)
    assert idmap.config.lfu_decay == 0.99
    assert _step(idmap, [5, 6, 6]) == [1, 0, 0]  # new ids placed most frequent first
    _step(idmap, [7])  # 5 has 0.99, 6 has 1.98
    assert _table(idmap) == {6: 0, 7: 1}


def test_ttl_frees_stale_rows_and_a_returning_id_starts_over() -> None:
    idmap = IdMap(IdMapConfig(policy="lru", ttl_steps=2), num_rows=4)
    _step(idmap, [1, 2])
    _step(idmap, [1])
    _step(idmap, [1])
    assert idmap.occupancy() == 0.5
    assert _step(idmap, [3]) == [1]  # step 4: 2 (seen at 1) is past the ttl: its row is free
    assert idmap.last_stats.expired == 1 and idmap.last_stats.evictions == 0
    assert _table(idmap) == {1: 0, 3: 1}
    idmap.eval()
    assert _step(idmap, [2, 1], training=False) == [-1, 0]  # reading changes nothing
    result = idmap.remap(torch.tensor([2]), True)  # 2 returns: a fresh row
    assert result.fresh_ids.tolist() == [2] and result.fresh_rows.tolist() == [2]


def test_ttl_expiry_is_seen_by_reads_before_the_next_step() -> None:
    idmap = IdMap(IdMapConfig(policy="lru", ttl_steps=1), num_rows=2)
    _step(idmap, [1])
    _step(idmap, [2])
    _step(idmap, [2])
    assert _step(idmap, [1, 2], training=False) == [-1, 1]
    assert idmap.occupancy() == 0.5


def test_admission_after_k_occurrences() -> None:
    idmap = IdMap(IdMapConfig(policy="lru", admit_after=2), num_rows=4)
    assert _step(idmap, [7]) == [-1]
    assert idmap.last_stats.zero_row_ids == 1 and idmap.last_stats.new_ids == 0
    # 7: second sighting; 8: twice in one batch (placed first: more occurrences here)
    assert _step(idmap, [7, 8, 8]) == [1, 0, 0]
    assert idmap.last_stats.admissions == 2 and idmap.last_stats.new_ids == 2
    assert not idmap.candidate_used.any()  # admitted ids leave the candidates


def test_full_candidate_table_forgets_least_recently_seen() -> None:
    idmap = IdMap(IdMapConfig(policy="lru", admit_after=2, candidate_slots=1), num_rows=4)
    assert _step(idmap, [5]) == [-1]
    assert _step(idmap, [6]) == [-1]  # 5 is forgotten
    assert _step(idmap, [5]) == [-1]  # counted from 1 again; 6 forgotten
    assert _step(idmap, [5]) == [0]


def test_more_new_ids_than_rows_places_the_most_frequent() -> None:
    idmap = IdMap(IdMapConfig(policy="lru"), num_rows=2)
    assert _step(idmap, [1, 2, 2, 2, 3, 3]) == [-1, 0, 0, 0, 1, 1]
    assert idmap.last_stats.zero_row_ids == 1 and idmap.last_stats.occupancy == 1.0


def test_state_dict_round_trip_continues_identically() -> None:
    config = IdMapConfig(policy="lfu", decay=0.9, ttl_steps=3, admit_after=2)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 40, (16,), generator=gen) for _ in range(12)]
    straight = IdMap(config, num_rows=8)
    for ids in batches[:6]:
        straight.remap(ids, True)
    resumed = IdMap(config, num_rows=8)
    resumed.load_state_dict(straight.state_dict())
    for ids in batches[6:]:
        a, b = straight.remap(ids, True), resumed.remap(ids, True)
        assert torch.equal(a.rows_M, b.rows_M) and torch.equal(a.fresh_ids, b.fresh_ids)
    for key, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


def test_hash_uniform_is_a_fixed_function_in_unit_range() -> None:
    ids = torch.tensor([0, 1, -5, 2**62])
    a = hash_uniform(ids, step=3, dim=8)
    assert a.shape == (4, 8) and bool((a >= 0).all()) and bool((a < 1).all())
    assert torch.equal(a[1:2], hash_uniform(ids[1:2], step=3, dim=8))  # per id, not per batch
    assert not torch.equal(a, hash_uniform(ids, step=4, dim=8))
    many = hash_uniform(torch.arange(4000), step=0, dim=16)
    assert abs(float(many.mean()) - 0.5) < 0.01  # 64k draws: std of the mean ~0.001


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "fifo"}, "id_map.policy 'fifo'"),
        ({"policy": "lru", "decay": 0.9}, "applies to policy 'lfu' only"),
        ({"policy": "lfu", "decay": 0.0}, "id_map.decay must be in"),
        ({"policy": "lfu", "decay": 1.5}, "id_map.decay must be in"),
        ({"ttl_steps": 0}, "id_map.ttl_steps must be an int >= 1"),
        ({"admit_after": True}, "id_map.admit_after must be an int >= 1"),
        ({"candidate_slots": 10}, "needs admit_after >= 2"),
    ],
)
def test_config_errors_name_field_and_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        IdMapConfig(**kwargs)  # type: ignore[arg-type]


def test_table_config_takes_id_map_from_toml_tables() -> None:
    table = from_dict(
        EmbeddingBagConfig,
        {
            "name": "user",
            "num_embeddings": 8,
            "embedding_dim": 4,
            "feature_names": ["user_id"],
            "id_map": {"policy": "lfu", "decay": 0.95, "admit_after": 2},
        },
        "embedding.tables[0]",
    )
    assert table.id_map == IdMapConfig(policy="lfu", decay=0.95, admit_after=2)
    with pytest.raises(ValueError, match=r"embedding.tables\[0\].id_map.polcy"):
        from_dict(
            EmbeddingBagConfig,
            {
                "name": "u",
                "num_embeddings": 8,
                "embedding_dim": 4,
                "feature_names": ["f"],
                "id_map": {"polcy": "lru"},
            },
            "embedding.tables[0]",
        )
    with pytest.raises(ValueError, match="id_map must be an IdMapConfig"):
        EmbeddingBagConfig(
            name="u",
            num_embeddings=8,
            embedding_dim=4,
            feature_names=("f",),
            id_map="lru",  # type: ignore[arg-type]
        )


def test_route_shard_is_a_fixed_spread_function_of_the_id() -> None:
    from recopt.modules.id_map_rows import route_shard

    ids = torch.tensor([0, 1, -1, 2**40 + 3, -(2**63), 2**63 - 1, 12345])
    assert route_shard(ids, 1).tolist() == [0] * ids.numel()
    for shards in (2, 3, 7):
        routed = route_shard(ids, shards)
        assert routed.dtype == torch.int64
        assert bool(((routed >= 0) & (routed < shards)).all())
        assert torch.equal(routed, route_shard(ids.clone(), shards))  # deterministic
    # pinned: a checkpoint's ids must route the same in every version
    assert route_shard(ids, 3).tolist() == [2, 2, 1, 0, 0, 0, 2]
    spread = torch.bincount(route_shard(torch.arange(30_000) * 2**33, 3), minlength=3)
    assert int(spread.min()) > 9_500, spread  # an even spread of structured ids
    per_id = torch.tensor([1, 2, 3, 7, 2, 3, 1])  # several tables' ids at once
    expected = [int(route_shard(ids[i : i + 1], int(n))) for i, n in enumerate(per_id)]
    assert route_shard(ids, per_id).tolist() == expected


@pytest.mark.parametrize("path", ["native", "torch"])
def test_rows_of_the_zero_row_leave_their_bags_and_unmapped_ids_stay(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`apply_rows`: mapped ids whose row is -1 (the zero row) are dropped from their bags
    (lengths, weights and per-key counts follow); an unmapped feature's ids are kept as they
    are, even a negative one (its own check names it). In native code and in torch ops."""
    from types import SimpleNamespace

    from recopt.kernels import cpu_id_map
    from recopt.modules.id_map import Remapped
    from recopt.modules.id_map_batch import apply_rows
    from recopt.sparse import KeyedJaggedTensor

    if path == "native" and not cpu_id_map.available():
        pytest.skip("no C compiler: no native remap")
    if path == "torch":
        monkeypatch.setattr(cpu_id_map, "drop_zero_rows", lambda *args: None)

    features = KeyedJaggedTensor(
        ["m1", "u", "m2"],
        torch.tensor([10, 11, 12, -1, 5, 20, 21]),
        weights=torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]),
        lengths=torch.tensor([2, 1, 1, 1, 0, 2]),
    )
    layout: Any = SimpleNamespace(table_names=["a", "plain", "b"])
    results = {  # table a holds m1's ids, table b m2's
        "a": Remapped(
            torch.tensor([3, -1, 4]),
            torch.zeros(0, dtype=torch.int64),
            torch.zeros(0, dtype=torch.int64),
        ),
        "b": Remapped(
            torch.tensor([-1, 7]),
            torch.zeros(0, dtype=torch.int64),
            torch.zeros(0, dtype=torch.int64),
        ),
    }
    mapped = apply_rows(features, layout, results).features
    assert mapped.values().tolist() == [3, 4, -1, 5, 7]
    assert mapped.weights().tolist() == [1.0, 3.0, 4.0, 5.0, 7.0]
    assert mapped.lengths().tolist() == [1, 1, 1, 1, 0, 1]
    assert mapped.length_per_key() == [2, 2, 1]
    # without an unmapped feature every piece is rows: the same through the one-pass mask
    only = KeyedJaggedTensor(["m1"], torch.tensor([10, 11, 12]), lengths=torch.tensor([2, 1]))
    one: Any = SimpleNamespace(table_names=["a"])
    assert apply_rows(only, one, {"a": results["a"]}).features.lengths().tolist() == [1, 1]


def test_id_maps_list_their_maps_again_after_a_map_is_added() -> None:
    """`IdMaps.maps` (kept between calls) follows a map put in later, and a copy's maps are
    its own."""
    import copy

    from recopt.modules.id_map_lookup import IdMaps

    tables = [
        EmbeddingBagConfig(name=name, num_embeddings=4, embedding_dim=2, feature_names=(name,),
                           id_map=IdMapConfig(policy="lru"))
        for name in ("a", "b")
    ]  # fmt: skip
    maps = IdMaps(tables, "cpu")
    first = maps.maps()
    assert list(first) == ["a", "b"] and first["a"] is maps.table_map("a")
    first.pop("a")  # a caller's dict: the kept one stays whole
    assert list(maps.maps()) == ["a", "b"]
    added = IdMap(IdMapConfig(policy="lfu"), 4)
    maps.put("c", added)
    assert list(maps.maps()) == ["a", "b", "c"] and maps.maps()["c"] is added
    copied = copy.deepcopy(maps)
    assert all(
        copied.maps()[name] is copied.table_map(name) is not maps.table_map(name)
        for name in ("a", "b", "c")
    )
