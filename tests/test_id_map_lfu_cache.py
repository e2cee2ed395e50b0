"""lfu's cached low set (`recopt.modules.id_map_native.LowSet`) against the full order.

Native lfu maps pick their victims from a cached set of low-key rows on most evicting steps;
the result must be exactly the torch path's (`IdMap.eviction_order` over every row) on every
step, and the cache must actually serve (its full scans are counted).
"""

from __future__ import annotations

import pytest
import torch

from recopt.kernels import cpu_id_map
from recopt.modules import IdMapConfig
from recopt.modules.id_map import IdMap, Remapped

pytestmark = pytest.mark.skipif(not cpu_id_map.available(), reason="no C compiler")


def _pair(config: IdMapConfig, rows: int) -> tuple[IdMap, IdMap]:
    native, reference = IdMap(config, rows), IdMap(config, rows)
    reference.native = False
    return native, reference


def _assert_same(a: Remapped, b: Remapped, a_map: IdMap, b_map: IdMap, where: str) -> None:
    assert torch.equal(a.rows_M, b.rows_M), where
    assert torch.equal(a.fresh_rows, b.fresh_rows), where  # the victims, in order
    assert a.stats == b.stats, where
    b_state = b_map.state_dict()
    for key, value in a_map.state_dict().items():
        assert torch.equal(value, b_state[key]), (where, key)


def _drifting(gen: torch.Generator, step: int, rows: int, unique: bool) -> torch.Tensor:
    """Power-law ids (or each new id twice: equal counts, many ties) drifting every step."""
    size = int(torch.randint(rows // 20, rows // 10, (1,), generator=gen))
    if unique:
        rank = (torch.arange(size) + step * size) // 2
    else:
        rank = (torch.rand(size, generator=gen) ** 3 * 3 * rows).long() + step * (rows // 50)
    return rank * 0x9E3779B97F4A7C15 - 5


def _stream(config: IdMapConfig, rows: int, steps: int, unique: bool = False) -> tuple[int, int]:
    """Native and torch maps on one stream, equal after every step; (evicting steps, scans)."""
    native, reference = _pair(config, rows)
    gen = torch.Generator().manual_seed(7)
    evicting = 0
    for step in range(steps):
        ids = _drifting(gen, step, rows, unique)
        a, b = native.remap(ids, True), reference.remap(ids, True)
        _assert_same(a, b, native, reference, f"step {step}")
        evicting += a.stats.evictions > 0
    assert native._native_map is not None
    low_set = native._native_map.low_set
    assert low_set.full_scans + low_set.served == evicting
    return evicting, low_set.full_scans


@pytest.mark.parametrize(
    "config",
    [
        IdMapConfig(policy="lfu"),
        IdMapConfig(policy="lfu", decay=0.999),
        IdMapConfig(policy="lfu", decay=1.0),
        IdMapConfig(policy="lfu", decay=0.9, ttl_steps=40),
        IdMapConfig(policy="lfu", decay=0.95, admit_after=2, candidate_slots=600),
    ],
    ids=["default", "0.999", "no_decay", "ttl", "admission"],
)
@pytest.mark.parametrize("unique", [False, True], ids=["power_law", "ties"])
def test_cached_victims_equal_full_order_and_cache_serves(
    config: IdMapConfig, unique: bool
) -> None:
    evicting, scans = _stream(config, 2000, 260, unique)
    assert evicting > 150
    assert scans * 4 < evicting  # most evicting steps are served by the cache


@pytest.mark.parametrize("decay", [0.5, 1e-3])
def test_counts_that_underflow_rescan_and_stay_exact(decay: float) -> None:
    # Old rows' decayed counts reach float64's underflow (0.5**1075 == 0.0): exact values tie
    # while their keys differ, so those steps must scan every row.
    evicting, scans = _stream(IdMapConfig(policy="lfu", decay=decay), 500, 400)
    assert evicting > 300
    assert scans > 10


def test_state_load_and_undo_mid_stream_drop_the_cache() -> None:
    config = IdMapConfig(policy="lfu", decay=0.97)
    native, reference = _pair(config, 1000)
    gen = torch.Generator().manual_seed(3)
    snapshot: dict[str, torch.Tensor] = {}
    for step in range(240):
        ids = _drifting(gen, step, 1000, False)
        if step % 60 == 59:  # go back to an earlier state on both maps
            native.load_state_dict(snapshot)
            reference.load_state_dict(snapshot)
        undo = step % 25 == 7
        a, b = native.remap(ids, True, undo), reference.remap(ids, True, undo)
        _assert_same(a, b, native, reference, f"step {step}")
        if undo:
            assert a.undo is not None and b.undo is not None
            native.apply_undo(a.undo)
            reference.apply_undo(b.undo)
            a, b = native.remap(ids, True), reference.remap(ids, True)
            _assert_same(a, b, native, reference, f"step {step} redone")
        if step % 60 == 30:
            snapshot = {k: v.clone() for k, v in native.state_dict().items()}
    assert native._native_map is not None
    low_set = native._native_map.low_set
    assert low_set.served > 100 and low_set.full_scans >= 4 + 9  # loads and undos rescan


def _differing_age(decay: float) -> int:
    """An age whose power ``decay**age`` is lower from the scalar kernel than the vector one."""
    ages = torch.arange(1, 5000, dtype=torch.float64)
    vector = (decay ** torch.cat([ages, ages.new_zeros(64)]))[: ages.numel()]
    scalar = decay ** ages.unsqueeze(1).expand(-1, 2).contiguous()[:, 0]
    lower = ages[scalar < vector]
    return int(lower[0]) if lower.numel() else 32


def test_rows_whose_powers_differ_by_kernel_are_not_served_from_the_cache() -> None:
    # Every row has count 1 at one age: the full order computes the last few rows' powers
    # with the scalar kernel (a loop's tail), lower by an ulp here, so they go first.
    rows, need, step = 1003, 10, 10_000
    idmap = IdMap(IdMapConfig(policy="lfu", decay=0.99), rows)
    native = idmap._native()
    assert native is not None
    with torch.no_grad():
        idmap.occupied.fill_(True)
        idmap.row_ids.copy_(torch.arange(rows))
        idmap.frequency.fill_(1.0)
        idmap.step.fill_(step)
        idmap.last_seen.fill_(step - _differing_age(0.99))
    every = torch.arange(rows)
    expected = every[idmap.eviction_order(every)[:need]]
    native.low_set.rebuild(idmap, every, need)
    assert native.low_set.low_N is not None and bool(native.low_set.low_N.all())
    victims = native.low_set.victims(idmap, every[:0], need)
    if victims is not None:
        assert torch.equal(victims, expected)
    if not torch.equal(expected, every[:need]):  # the kernels differ here: only a scan is exact
        assert victims is None


def test_underflowed_counts_tie_by_recency_not_by_key() -> None:
    # Both groups' decayed counts are 0.0 (1e-3**200, 1e301 * 1e-3**300): the full order
    # ties them and takes the least recent first, the group whose key is the higher.
    rows, need, step = 103, 10, 1000
    idmap = IdMap(IdMapConfig(policy="lfu", decay=1e-3), rows)
    native = idmap._native()
    assert native is not None
    with torch.no_grad():
        idmap.occupied.fill_(True)
        idmap.row_ids.copy_(torch.arange(rows))
        idmap.step.fill_(step)
        idmap.frequency.fill_(1.0)
        idmap.last_seen.fill_(step - 200)
        idmap.frequency[100:] = 1e301
        idmap.last_seen[100:] = step - 300
    every = torch.arange(rows)
    expected = every[idmap.eviction_order(every)[:need]]
    assert torch.equal(expected[:3], torch.tensor([100, 101, 102]))
    native.low_set.rebuild(idmap, every, need)
    assert native.low_set.low_N is not None and not bool(native.low_set.low_N[100:].any())
    victims = native.low_set.victims(idmap, every[:0], need)
    assert victims is None or torch.equal(victims, expected)


def test_rows_touched_without_evicting_are_not_kept_without_bound() -> None:
    config = IdMapConfig(policy="lfu", decay=0.99)
    native, reference = _pair(config, 400)
    gen = torch.Generator().manual_seed(5)
    for step in range(60):  # fills the map and evicts: the low set is built
        ids = _drifting(gen, step, 400, False)
        _assert_same(native.remap(ids, True), reference.remap(ids, True), native, reference, "")
    assert native._native_map is not None
    low_set = native._native_map.low_set
    assert low_set.low_N is not None
    known = native.row_ids[native.occupied][:30]
    for step in range(200):  # known ids only: nothing evicts
        a, b = native.remap(known, True), reference.remap(known, True)
        _assert_same(a, b, native, reference, f"known step {step}")
        assert a.stats.evictions == 0
        assert low_set.pending_rows <= 400 and len(low_set.pending) <= 2 * 400 // 30
    for step in range(60, 120):  # evicting again: still exact
        ids = _drifting(gen, step, 400, False)
        _assert_same(native.remap(ids, True), reference.remap(ids, True), native, reference, "")
