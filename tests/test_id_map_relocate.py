"""relocate: id-mapped rows move to the row shard that owns their id, with all they carry.

At 2 and 3 ranks (one spawned gloo group each, every case in a loop) shards are filled with
ids placed on the wrong shards on purpose, each with values derived from its id (weight row,
per-row and per-element optimizer state, last_seen, frequency). The parent rebuilds every
shard as it was and checks by id: every live id sits on its owner, with the values it had;
no id is lost when rows suffice, and on overflow exactly the policy's best stay (the keep set
computed here independently); candidates move likewise; per-column and scalar states, ranks
without a shard, empty maps and an already-placed table stay bit-exact.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from recopt.kernels.registry import StateShape, optimizer_spec
from recopt.modules.id_map import IdMap, IdMapConfig
from recopt.modules.id_map_rows import route_shard
from recopt.sharding.id_map_relocate import ShardRows, relocate
from recopt.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess

STEP = 1000
DIM = 4
MAP_BUFFERS = ("row_ids", "occupied", "last_seen", "frequency", "step")
CANDIDATE_BUFFERS = ("candidate_ids", "candidate_used", "candidate_count", "candidate_last_seen")


@dataclass(frozen=True)
class Table:
    """One id-mapped table: a shard per entry of ``ranks``, ``rows[k]`` rows each."""

    name: str
    ranks: tuple[int, ...]
    rows: tuple[int, ...]
    live: tuple[int, ...]  # live ids placed on each shard
    optimizer: str = "adam"
    policy: str = "lru"
    decay: float | None = None
    candidates: tuple[int, ...] = ()  # admission candidates placed on each shard
    candidate_slots: int | None = None
    weight_dtype: torch.dtype = torch.float32
    misplaced: bool = True  # False: every id starts on its owner
    crowd: bool = False  # half the ids of every shard are shard 0's: it overflows
    ttl: int | None = None  # rows unseen for longer hold no live id
    seed: int = 0

    def config(self) -> IdMapConfig:
        admit = 5 if self.candidates else None
        slots = self.candidate_slots if self.candidates else None
        return IdMapConfig(
            policy=self.policy,
            decay=self.decay,
            admit_after=admit,
            candidate_slots=slots,
            ttl_steps=self.ttl,
        )

    def live_rows(self, snap: dict[str, torch.Tensor]) -> torch.Tensor:
        """The rows of a shard's snapshot that hold a live id."""
        live = snap["occupied"].clone()
        if self.ttl is not None:
            live &= STEP - snap["last_seen"] <= self.ttl
        return live


@dataclass(frozen=True)
class Case:
    name: str
    tables: tuple[Table, ...]
    overflow: bool = False  # some shard gets more ids than rows
    bad_index: bool = False  # every rank passes a wrong shard index: ValueError everywhere


def _cases(world: int) -> list[Case]:
    every, last = tuple(range(world)), world - 1

    def on_every_rank(name: str, rows: int, live: int, seed: int, **kw: Any) -> Table:
        return Table(name, every, (rows,) * world, (live,) * world, seed=seed, **kw)

    small_first = (4,) + (5,) * (world - 1)
    lfu = dict(optimizer="row_wise_adagrad", policy="lfu", decay=0.995, crowd=True)
    fp16 = dict(optimizer="row_wise_adagrad", weight_dtype=torch.float16)
    return [
        Case("adam", (on_every_rank("t", 12, 7, 1),)),
        Case(
            "row_wise_adagrad_fp16_reversed_ranks",
            (Table("t", every[::-1], tuple(10 + k for k in every), (6,) * world, seed=2, **fp16),),
        ),
        Case(
            "several_tables_one_call",
            (
                on_every_rank("a", 9, 5, 3, optimizer="adagrad"),
                on_every_rank("empty", 4, 0, 4),
                on_every_rank("row_var", 8, 4, 5, optimizer="adafactor"),
                on_every_rank("sgd", 6, 3, 6, optimizer="sgd"),
            ),
        ),
        Case(
            "rank_without_shard",
            (
                Table("part", (last, 0), (10, 10), (6, 6), seed=7),
                Table("one", (last,), (10,), (8,), optimizer="row_wise_adagrad", seed=8),
            ),
        ),
        Case("overflow_lru", (on_every_rank("t", 5, 5, 9, crowd=True),), overflow=True),
        Case(
            "overflow_lfu",
            (Table("t", every, small_first, small_first, seed=10, **lfu),),
            overflow=True,
        ),
        Case("expired_rows_stay_and_take_arrivals", (on_every_rank("t", 6, 6, 16, ttl=400),)),
        Case("candidates", (on_every_rank("t", 8, 3, 11, candidates=(4,) * world),)),
        Case(
            "candidates_overflow",
            (on_every_rank("t", 8, 2, 12, candidates=(3,) * world, candidate_slots=3, crowd=True),),
            overflow=True,
        ),
        Case(
            "already_placed",
            (
                on_every_rank("t", 9, 5, 13, misplaced=False),
                on_every_rank("c", 6, 2, 14, candidates=(3,) * world),
            ),
        ),
        Case("bad_index", (on_every_rank("t", 4, 1, 15),), bad_index=True),
    ]


# ------------------------------------------------------------------ building the shards


def _ids(table: Table, count: int) -> torch.Tensor:
    """``count`` distinct raw ids (negative and large ones among them)."""
    gen = torch.Generator().manual_seed(1000 + table.seed)
    return torch.randperm(10**6, generator=gen)[:count].to(torch.int64) * 7919 - 3 * 10**9


def _placement(table: Table) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The live ids and the candidate ids of each shard.

    Ids are drawn by owner: on shard k, every other id is owned by another shard (misplaced);
    with ``crowd`` every other id is owned by shard 0 instead, so shard 0 gets more ids than
    it has rows; with ``misplaced`` False every id sits on its owner.
    """
    shards = len(table.ranks)
    pool = _ids(table, 8 * (sum(table.live) + sum(table.candidates)) + 64)
    owner = route_shard(pool, shards)
    queues = [pool[owner == o].tolist() for o in range(shards)]

    def draw(k: int, count: int) -> torch.Tensor:
        picked = []
        for j in range(count):
            wrong = (k + 1 + j // 2 % max(1, shards - 1)) % shards
            o = k if not table.misplaced or j % 2 == 1 else wrong
            if table.crowd and j % 2 == 0:
                o = 0
            picked.append(queues[o].pop())
        return torch.tensor(picked, dtype=torch.int64)

    live = [draw(k, n) for k, n in enumerate(table.live)]
    return live, [draw(k, n) for k, n in enumerate(table.candidates)]


def _per_id(ids: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """Values derived from each id (the same wherever the id lives)."""
    gen = torch.Generator().manual_seed(seed)
    last_seen = torch.randperm(STEP, generator=gen)[: ids.numel()].to(torch.int64)
    frequency = torch.rand(ids.numel(), generator=gen, dtype=torch.float64) * 50
    return {"last_seen": last_seen, "frequency": frequency}


def _weight_rows(ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    base = (ids % 9973).to(torch.float64).unsqueeze(1) * 0.01
    return (base + torch.arange(DIM) * 0.25).to(dtype)


def _state_rows(ids: torch.Tensor, key: str, shape: StateShape) -> torch.Tensor:
    salt = sum(map(ord, key))
    per_row = ((ids + salt) % 7919).to(torch.float32) * -0.5
    if shape is StateShape.PER_ROW:
        return per_row
    return per_row.unsqueeze(1) + torch.arange(DIM, dtype=torch.float32)


def _shard(table: Table, k: int) -> ShardRows:
    """Row shard ``k`` of ``table`` as loaded (ids at random rows, junk in free rows)."""
    live, cands = _placement(table)
    rows = table.rows[k]
    idmap = IdMap(table.config(), rows)
    gen = torch.Generator().manual_seed(table.seed * 100 + k)
    at = torch.randperm(rows, generator=gen)[: live[k].numel()]
    ids = live[k]
    values = _per_id(ids, table.seed * 100 + k + 50)
    idmap.step.fill_(STEP)
    idmap.row_ids[at], idmap.occupied[at] = ids, True
    idmap.last_seen[at], idmap.frequency[at] = values["last_seen"], values["frequency"]
    weight = torch.full((rows, DIM), 77.0, dtype=table.weight_dtype)
    weight[at] = _weight_rows(ids, table.weight_dtype)
    states: dict[str, torch.Tensor] = {}
    for key, shape in optimizer_spec(table.optimizer).states:
        states[key] = torch.full(shape.size(rows, DIM), 55.0)
        if shape is not StateShape.PER_COLUMN:
            states[key][at] = _state_rows(ids, key, shape)
        else:
            states[key].copy_(torch.arange(DIM) + 0.5 * k)
    if optimizer_spec(table.optimizer).stepped:
        states["step"] = torch.tensor(STEP + k)
    if table.candidates:
        slots = idmap.candidate_ids.numel()
        at = torch.randperm(slots, generator=gen)[: cands[k].numel()]
        cvalues = _per_id(cands[k], table.seed * 100 + k + 70)
        idmap.candidate_ids[at], idmap.candidate_used[at] = cands[k], True
        idmap.candidate_last_seen[at] = cvalues["last_seen"]
        idmap.candidate_count[at] = cands[k] % 4 + 1
    return ShardRows(index=k, idmap=idmap, weight=weight, states=states, optimizer=table.optimizer)


def _snapshot(shard: ShardRows) -> dict[str, torch.Tensor]:
    out = {name: t.clone() for name, t in shard.idmap.state_dict().items()}
    out["weight"] = shard.weight.clone()
    out.update({f"state.{key}": t.clone() for key, t in shard.states.items()})
    return out


# ------------------------------------------------------------------ the ranks


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _run_cases(rank: int, world: int) -> list[dict[str, Any]]:
    import datetime

    handler = _Records()
    logging.getLogger("recopt.sharding.id_map_relocate").addHandler(handler)
    results = []
    for case in _cases(world):
        entries = []
        for table in case.tables:
            k = table.ranks.index(rank) if rank in table.ranks else None
            shard = None if k is None else _shard(table, k)
            if shard is not None and case.bad_index:
                shard.index = (k + 1) % len(table.ranks)
            entries.append((table.name, list(table.ranks), shard))
        handler.messages.clear()
        try:
            report = relocate(entries, None, datetime.timedelta(seconds=60))
        except ValueError as e:
            results.append({"error": str(e)})
            continue
        after = {n: None if s is None else _snapshot(s) for n, _, s in entries}
        results.append({"report": report, "after": after, "warnings": list(handler.messages)})
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def outcome(request: pytest.FixtureRequest) -> tuple[int, list[list[dict[str, Any]]]]:
    world = request.param
    return world, run_on_ranks(_run_cases, world, timeout_s=240.0)


# ------------------------------------------------------------------ checks in the parent


def _by_id(snap: dict[str, torch.Tensor], table: Table) -> dict[int, dict[str, torch.Tensor]]:
    """Each live id of one shard's snapshot -> its row's values."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    spec = optimizer_spec(table.optimizer)
    moved = [k for k, s in spec.states if s is not StateShape.PER_COLUMN]
    for row in table.live_rows(snap).nonzero().squeeze(1).tolist():
        values = {n: snap[n][row] for n in ("last_seen", "frequency", "weight")}
        values.update({k: snap[f"state.{k}"][row] for k in moved})
        out[int(snap["row_ids"][row])] = values
    return out


def _candidates_by_id(snap: dict[str, torch.Tensor]) -> dict[int, tuple[int, int]]:
    slots = snap["candidate_used"].nonzero().squeeze(1).tolist()
    return {
        int(snap["candidate_ids"][s]): (
            int(snap["candidate_count"][s]),
            int(snap["candidate_last_seen"][s]),
        )
        for s in slots
    }


def _unmoved_keys(optimizer: str, snap: dict[str, torch.Tensor]) -> list[str]:
    shapes = dict(optimizer_spec(optimizer).states)
    keys = ["step", *(f"state.{k}" for k, s in shapes.items() if s is StateShape.PER_COLUMN)]
    if "state.step" in snap:
        keys.append("state.step")
    assert all(key in snap for key in keys)
    return keys


def _expected_rows(table: Table, before: dict[int, dict[str, torch.Tensor]]) -> set[int]:
    """The ids that stay: per owner shard, the best ``rows`` of all ids routed to it by the
    policy (lru: latest last_seen; lfu: highest decayed count), computed here in Python."""
    kept: set[int] = set()
    for k, rows in enumerate(table.rows):
        owned = [i for i in before if int(route_shard(torch.tensor([i]), len(table.ranks))) == k]

        def score(i: int) -> float:
            last = int(before[i]["last_seen"])
            if table.policy == "lru":
                return last
            decay = 0.99 if table.decay is None else table.decay
            return float(before[i]["frequency"]) * decay ** (STEP - last)

        kept.update(sorted(owned, key=score, reverse=True)[:rows])
    return kept


def _expected_candidates(table: Table, before: dict[int, tuple[int, int]]) -> set[int]:
    kept: set[int] = set()
    shards = len(table.ranks)
    for k, rows in enumerate(table.rows):
        slots = table.candidate_slots or rows
        owned = [i for i in before if int(route_shard(torch.tensor([i]), shards)) == k]
        kept.update(sorted(owned, key=lambda i: before[i][1], reverse=True)[:slots])
    return kept


def _check_table(table: Table, results: list[dict[str, Any]], overflow: bool) -> None:
    shards = len(table.ranks)
    before_snaps = [_snapshot(_shard(table, k)) for k in range(shards)]
    after_snaps = [results[r]["after"][table.name] for r in table.ranks]
    for r, result in enumerate(results):
        if r not in table.ranks:
            assert result["after"][table.name] is None
            assert result["report"].tables[table.name].rows_sent == 0
    before: dict[int, dict[str, torch.Tensor]] = {}
    for snap in before_snaps:
        before.update(_by_id(snap, table))
    assert len(before) == sum(table.live) or table.ttl is not None
    after: dict[int, dict[str, torch.Tensor]] = {}
    for k, snap in enumerate(after_snaps):
        ids = snap["row_ids"][snap["occupied"]]
        assert ids.unique().numel() == ids.numel()  # no two rows with one id
        assert bool((snap["row_ids"][~snap["occupied"]] == -1).all())
        found = _by_id(snap, table)
        assert bool((route_shard(torch.tensor(list(found), dtype=torch.int64), shards) == k).all())
        assert not set(found) & set(after), "an id is live on two shards"
        after.update(found)
        for key in _unmoved_keys(table.optimizer, snap):  # per-column, scalar, the map's step
            assert torch.equal(snap[key], before_snaps[k][key]), key
    expected = _expected_rows(table, before) if overflow else set(before)
    assert set(after) == expected
    for i, values in after.items():
        for name, value in values.items():
            assert torch.equal(value, before[i][name]), (table.name, i, name)
    reports = [results[r]["report"].tables[table.name] for r in table.ranks]
    misplaced = sum(
        int((route_shard(snap["row_ids"][table.live_rows(snap)], shards) != k).sum())
        for k, snap in enumerate(before_snaps)
    )
    assert sum(t.rows_sent for t in reports) == misplaced
    assert sum(t.rows_received for t in reports) == misplaced
    assert sum(t.rows_dropped for t in reports) == len(before) - len(after)
    if table.candidates:
        _check_candidates(table, before_snaps, after_snaps, reports, overflow)
    if table.ttl is not None:  # expired rows were there, and arrivals took some of them
        expired = [b["occupied"] & ~table.live_rows(b) for b in before_snaps]
        assert sum(int(e.sum()) for e in expired) > 0
        taken = [e & table.live_rows(a) for e, a in zip(expired, after_snaps, strict=True)]
        assert sum(int(t.sum()) for t in taken) > 0


def _check_candidates(
    table: Table,
    before_snaps: list[dict[str, torch.Tensor]],
    after_snaps: list[dict[str, torch.Tensor]],
    reports: list[Any],
    overflow: bool,
) -> None:
    shards = len(table.ranks)
    before: dict[int, tuple[int, int]] = {}
    for snap in before_snaps:
        before.update(_candidates_by_id(snap))
    after: dict[int, tuple[int, int]] = {}
    for k, snap in enumerate(after_snaps):
        found = _candidates_by_id(snap)
        assert len(found) == int(snap["candidate_used"].sum())
        assert bool((route_shard(torch.tensor(list(found), dtype=torch.int64), shards) == k).all())
        after.update(found)
    expected = _expected_candidates(table, before) if overflow else set(before)
    assert set(after) == expected
    assert all(after[i] == before[i] for i in after)
    assert sum(t.candidates_dropped for t in reports) == len(before) - len(after)
    assert sum(t.candidates_sent for t in reports) > 0


def _case_results(
    outcome: tuple[int, list[list[dict[str, Any]]]], name: str
) -> tuple[Case, list[dict[str, Any]]]:
    world, per_rank = outcome
    index = [c.name for c in _cases(world)].index(name)
    return _cases(world)[index], [per_rank[r][index] for r in range(world)]


@pytest.mark.parametrize(
    "name",
    [
        "adam",
        "row_wise_adagrad_fp16_reversed_ranks",
        "several_tables_one_call",
        "rank_without_shard",
        "overflow_lru",
        "overflow_lfu",
        "expired_rows_stay_and_take_arrivals",
        "candidates",
        "candidates_overflow",
    ],
)
def test_every_live_id_moves_to_its_owner_with_its_row_and_state(
    outcome: tuple[int, list[list[dict[str, Any]]]], name: str
) -> None:
    case, results = _case_results(outcome, name)
    for table in case.tables:
        _check_table(table, results, case.overflow)
    dropped = sum(r["report"].rows_dropped + r["report"].candidates_dropped for r in results)
    warnings = [w for r in results for w in r["warnings"]]
    if case.overflow:
        assert dropped > 0 and len(warnings) > 0
        assert all("table 't'" in w and "dropped" in w for w in warnings)
        rows = sum(int(w.split("dropped ")[1].split(" ")[0]) for w in warnings)
        candidates = sum(int(w.split(" and ")[1].split(" ")[0]) for w in warnings)
        assert rows == sum(r["report"].rows_dropped for r in results)
        assert candidates == sum(r["report"].candidates_dropped for r in results)
    else:
        assert dropped == 0 and warnings == []


@pytest.mark.parametrize("world", [2, 3])
def test_the_cases_misplace_ids_on_purpose(world: int) -> None:
    """Every misplaced table starts with live ids (and candidates) on wrong shards."""
    for case in _cases(world):
        for table in case.tables:
            if not table.misplaced or len(table.ranks) == 1:
                continue
            for placed in _placement(table):
                if sum(p.numel() for p in placed) == 0:
                    continue
                wrong = sum(
                    int((route_shard(ids, len(table.ranks)) != k).sum())
                    for k, ids in enumerate(placed)
                )
                assert wrong >= 1, (case.name, table.name)


def test_nothing_to_move_changes_nothing_bit_exact(
    outcome: tuple[int, list[list[dict[str, Any]]]],
) -> None:
    case, results = _case_results(outcome, "already_placed")
    for table in case.tables:
        if table.name == "c":  # live rows placed, candidates not: only its rows stay still
            continue
        for k, rank in enumerate(table.ranks):
            before = _snapshot(_shard(table, k))
            after = results[rank]["after"][table.name]
            assert before.keys() == after.keys()
            for key in before:
                assert torch.equal(before[key].view(-1), after[key].view(-1)), key
            assert results[rank]["report"].tables[table.name].rows_sent == 0


def test_empty_and_single_shard_tables_stay_as_they_were(
    outcome: tuple[int, list[list[dict[str, Any]]]],
) -> None:
    for name, table_name in (("several_tables_one_call", "empty"), ("rank_without_shard", "one")):
        case, results = _case_results(outcome, name)
        table = next(t for t in case.tables if t.name == table_name)
        for k, rank in enumerate(table.ranks):
            before, after = _snapshot(_shard(table, k)), results[rank]["after"][table_name]
            assert all(torch.equal(before[key], after[key]) for key in before), table_name


def test_a_wrong_shard_index_is_refused_on_every_rank_before_any_exchange(
    outcome: tuple[int, list[list[dict[str, Any]]]],
) -> None:
    _, results = _case_results(outcome, "bad_index")
    for r in results:
        assert "table 't'" in r["error"] and "pass the shard index of this rank" in r["error"]


def test_row_records_round_trip_bit_exact() -> None:
    """The byte records carry any value as it is: -0.0, NaN payloads, bf16, int64 extremes."""
    from recopt.sharding.id_map_relocate import _decode, _encode

    fields = [
        torch.tensor([-(2**63), 2**63 - 1, -1], dtype=torch.int64),
        torch.tensor([-0.0, float("nan"), 1e-310], dtype=torch.float64),
        torch.randn(3, 5).to(torch.bfloat16),
        torch.tensor([[1.5, -0.0], [float("inf"), 3.0], [7.0, 8.0]], dtype=torch.float16),
    ]
    index = torch.tensor([2, 0])
    records = _encode(fields, index)
    assert records.dtype == torch.uint8 and records.shape == (2, 8 + 8 + 10 + 4)
    for got, field in zip(_decode(records, fields), fields, strict=True):
        want = field[index]
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    empty = _encode(fields, index[:0])
    assert empty.shape == (0, 30)
    assert [t.shape[0] for t in _decode(empty, fields)] == [0, 0, 0, 0]
