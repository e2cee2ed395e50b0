"""lfu in native code against the torch path: the decay powers, the victims, whole streams.

Both paths compute ``decay ** age`` as the same product of repeated squares
(`recopt.modules.id_map.decay_powers`), so they must agree bit for bit: the powers themselves,
the victims of an evicting step among heavy ties (the native side selects them from its rows
in buckets by key, or in one pass over every row's key in maps too small for the buckets;
the torch path sorts every row), and the maps after every step of long streams. Every test
runs both native ways (`cpu_id_map.lfu_buckets_min_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from recopt.kernels import cpu_id_map
from recopt.modules import IdMapConfig
from recopt.modules.id_map import IdMap, Remapped, decay_powers

pytestmark = pytest.mark.skipif(not cpu_id_map.available(), reason="no C compiler")

DECAYS = [0.99, 0.5, 0.999999, 0.3, 1e-3, 1.0]


@pytest.fixture(autouse=True, params=["buckets", "every_row"])
def victims_way(request: pytest.FixtureRequest) -> Iterator[None]:
    """The native maps built here keep lfu's buckets whatever their size, or never."""
    was = cpu_id_map.lfu_buckets_min_rows(0 if request.param == "buckets" else 2**62)
    yield
    cpu_id_map.lfu_buckets_min_rows(was)


def _product(decay: float, age: int) -> float:
    """The definition, in Python floats: decay^(2^b) over the set bits b, lowest first."""
    out, square = 1.0, decay
    while age > 0:
        if age & 1:
            out *= square
        square *= square
        age >>= 1
    return out


@pytest.mark.parametrize("decay", DECAYS)
def test_decay_powers_are_the_same_bits_in_torch_native_and_python(decay: float) -> None:
    gen = torch.Generator().manual_seed(3)
    ages = torch.cat(
        [
            torch.arange(-3, 5000),  # negatives count as 0; past the native memo of 4096 ages
            torch.randint(0, 2**62, (2000,), generator=gen),
            torch.tensor([2**62, 2**63 - 1, 65535, 65536, 4095, 4096]),
        ]
    )
    torch_powers = decay_powers(decay, ages)
    assert torch.equal(torch_powers, cpu_id_map.decay_powers(decay, ages))
    for i in range(0, ages.numel(), 97):
        age = max(int(ages[i]), 0)
        assert torch_powers[i].item() == _product(decay, age)
    # and it is decay ** age: repeated squaring carries the rounding of decay into every
    # square, so the relative error grows with the age, within (age + 1) rounding units
    small = torch.arange(0, 3000)
    exact = torch.tensor([math.pow(decay, int(a)) for a in small], dtype=torch.float64)
    normal = exact > 1e-300
    rel = (decay_powers(decay, small) - exact).abs() / exact
    assert bool((rel[normal] <= (small[normal] + 1) * 2.0**-52).all())


def _pair(config: IdMapConfig, rows: int) -> tuple[IdMap, IdMap]:
    native, reference = IdMap(config, rows), IdMap(config, rows)
    reference.native = False
    return native, reference


def _assert_same(a: Remapped, b: Remapped, a_map: IdMap, b_map: IdMap, where: str) -> None:
    assert torch.equal(a.rows_M, b.rows_M), where
    assert torch.equal(a.fresh_rows, b.fresh_rows), where  # the victims (lfu: in row order)
    assert a.stats == b.stats, where
    b_state = b_map.state_dict()
    for key, value in a_map.state_dict().items():
        assert torch.equal(value, b_state[key]), (where, key)


def _full_maps(
    maps: tuple[IdMap, ...], frequency: torch.Tensor, last_seen: torch.Tensor, step: int
) -> None:
    """Every row of ``maps`` live (row r holds id 11 r + 1) with these counters, at ``step``."""
    with torch.no_grad():
        for idmap in maps:
            idmap.row_ids.copy_(torch.arange(frequency.numel()) * 11 + 1)
            idmap.occupied.fill_(True)
            idmap.frequency.copy_(frequency)
            idmap.last_seen.copy_(last_seen)
            idmap.step.fill_(step)


@pytest.mark.parametrize("decay", [1.0, 0.5, 0.99])
@pytest.mark.parametrize(
    ("rows", "values"),
    [(500, 4), (20000, 4), (20000, 1), (20000, 1000)],
    ids=["small", "few_values", "all_tied", "many_values"],
)
def test_native_victims_are_the_head_of_the_full_order_among_ties(
    decay: float, rows: int, values: int
) -> None:
    """A full map whose counts and last-seen steps take ``values`` values (ties at every level
    of the order): the victims of one step are the first rows of `IdMap.eviction_order`,
    handed out in row order. 20000 rows: the native side filters by a sampled pivot, then by a
    tighter one from the listed rows' keys (all tied: more rows at the pivot than it keeps, so
    it falls back to every row)."""
    gen = torch.Generator().manual_seed(2)
    for need in (1, 7, 150, 399, 500):
        native, reference = _pair(IdMapConfig(policy="lfu", decay=decay), rows)
        frequency = torch.randint(1, values + 1, (rows,), generator=gen).double()
        last_seen = torch.randint(0, min(values, 4), (rows,), generator=gen)
        if values == 1:  # one count: the older second half goes first (under decay 1.0, the
            last_seen = torch.where(torch.arange(rows) < rows // 2, 3, 0)  # counts all tie)
        _full_maps((native, reference), frequency, last_seen, 5)
        expected = reference.eviction_order(torch.arange(rows))[:need]
        new_ids = torch.arange(need) * 11 + 2  # none is live: each takes a victim
        a, b = native.remap(new_ids, True), reference.remap(new_ids, True)
        _assert_same(a, b, native, reference, f"need {need}")
        assert torch.equal(a.fresh_rows, expected.sort().values), need


def _drifting(gen: torch.Generator, step: int, rows: int, unique: bool) -> torch.Tensor:
    """Power-law ids (or each new id twice: equal counts, many ties) drifting every step."""
    size = int(torch.randint(rows // 20, rows // 10, (1,), generator=gen))
    if unique:
        rank = (torch.arange(size) + step * size) // 2
    else:
        rank = (torch.rand(size, generator=gen) ** 3 * 3 * rows).long() + step * (rows // 50)
    return rank * 0x9E3779B97F4A7C15 - 5


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
def test_native_lfu_equals_torch_after_every_step(config: IdMapConfig, unique: bool) -> None:
    native, reference = _pair(config, 2000)
    gen = torch.Generator().manual_seed(7)
    evicting = 0
    for step in range(200):
        ids = _drifting(gen, step, 2000, unique)
        a, b = native.remap(ids, True), reference.remap(ids, True)
        _assert_same(a, b, native, reference, f"step {step}")
        evicting += a.stats.evictions > 0
    assert native._native_map is not None and evicting > 100


@pytest.mark.parametrize(
    ("decay", "oldest"),
    [(0.9, 5000), (0.5, 3000), (0.999, 1_000_000)],
    ids=["tiny_counts", "underflow", "old_steps"],
)
def test_native_victims_over_extreme_ages(decay: float, oldest: int) -> None:
    """Rows last seen up to ``oldest`` steps ago: decayed counts down to 1e-229 (the key
    filter's range), or underflowing to 0 (0.5^3000: the filter steps aside, every row is
    compared exactly), or steps in the millions (large keys): the victims are still the head
    of `IdMap.eviction_order`, and the native map equals the torch one."""
    rows = 20000
    gen = torch.Generator().manual_seed(3)
    now = oldest + 5
    frequency = (torch.rand(rows, generator=gen) * 50 + 1).double()
    last_seen = torch.randint(0, oldest, (rows,), generator=gen)
    for need in (1, 64, 700):
        native, reference = _pair(IdMapConfig(policy="lfu", decay=decay), rows)
        _full_maps((native, reference), frequency, last_seen, now - 1)
        expected = reference.eviction_order(torch.arange(rows))[:need]
        new_ids = torch.arange(need) * 11 + 2
        a, b = native.remap(new_ids, True), reference.remap(new_ids, True)
        _assert_same(a, b, native, reference, f"need {need}")
        assert torch.equal(a.fresh_rows, expected.sort().values), need
        # a second step: the keys kept up by the first (fresh rows, counted rows) filter it
        more = torch.arange(need) * 11 + 3
        _assert_same(native.remap(more, True), reference.remap(more, True), native, reference, "2")


@pytest.mark.parametrize("case", ["zero_counts", "wide_key_range"])
def test_native_victims_where_the_key_buckets_step_aside(case: str) -> None:
    """The native map keeps lfu's rows in buckets by static key; rows whose key is not finite
    (a count of 0, as a loaded state may hold) or keys spread over too many buckets (decay 0.5,
    rows last seen up to two million steps apart) turn them off and every row is read: the
    victims are still the head of `IdMap.eviction_order`, step after step, as the torch map's."""
    rows = 5000
    gen = torch.Generator().manual_seed(5)
    decay, oldest = (0.9, 200) if case == "zero_counts" else (0.5, 2_000_000)
    frequency = (torch.rand(rows, generator=gen) * 20 + 1).double()
    if case == "zero_counts":
        frequency[torch.randint(0, rows, (300,), generator=gen)] = 0.0
    last_seen = torch.randint(0, oldest, (rows,), generator=gen)
    last_seen[:50] = oldest - 1  # recent rows beside the oldest: the widest key range
    native, reference = _pair(IdMapConfig(policy="lfu", decay=decay), rows)
    _full_maps((native, reference), frequency, last_seen, oldest + 4)
    for step in range(4):
        need = 300 + 100 * step
        expected = reference.eviction_order(torch.arange(rows))[:need]
        new_ids = torch.arange(need) + 10**9 + 100_000 * step  # none of them live
        a, b = native.remap(new_ids, True), reference.remap(new_ids, True)
        _assert_same(a, b, native, reference, f"step {step}")
        assert torch.equal(a.fresh_rows, expected.sort().values), step


def test_native_victims_after_ttl_frees_the_lowest_rows() -> None:
    """ttl frees the rows unseen longest, whose static keys (set at an earlier step) are the
    lowest: the rows under the key filter's pivots are then free, not evictable, so the tighter
    pivot keeps too few and the sampled one's rows are read. The free rows go first, the
    victims after them, in row order, as the torch map's."""
    rows, ttl, now = 20000, 50, 100
    gen = torch.Generator().manual_seed(11)
    frequency = (torch.rand(rows, generator=gen) * 30 + 1).double()
    last_seen = torch.randint(now - ttl, now - 1, (rows,), generator=gen)
    stale = torch.randperm(rows, generator=gen)[:3000]
    last_seen[stale] = now - ttl - 1  # live at step now - 1, expired at step now
    native, reference = _pair(IdMapConfig(policy="lfu", decay=0.9, ttl_steps=ttl), rows)
    _full_maps((native, reference), frequency, last_seen, now - 2)
    first = torch.arange(10) * 11 + 2  # step now - 1: 10 victims (keys built), all stale
    _assert_same(native.remap(first, True), reference.remap(first, True), native, reference, "1")
    left = reference.occupied & (reference.last_seen >= now - ttl)
    order = reference.eviction_order(torch.arange(rows)[left])
    expected = torch.arange(rows)[left][order][:500].sort().values
    new_ids = torch.arange(3490) * 11 + 3  # step now: 2,990 rows expire, then 500 victims
    a, b = native.remap(new_ids, True), reference.remap(new_ids, True)
    _assert_same(a, b, native, reference, "expiring step")
    assert a.stats.expired == 2990 and a.stats.evictions == 500
    assert torch.equal(a.fresh_rows[2990:], expected)
    more = torch.arange(700) * 11 + 4  # the next step, its keys kept up by this one
    _assert_same(native.remap(more, True), reference.remap(more, True), native, reference, "next")
