"""Test helpers for checkpoint tests: hand-made sharded tables in every layout, plain models.

`ShardedTables` stands in for a sharded embedding collection (until the real one is used): its
state_dict holds ShardedTensors of true global shape, laid out table-wise, row-wise,
column-wise or data-parallel, and a KeyedOptimizer-style fused optimizer with row-wise and
element-wise state plus a per-table scalar.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

from recopt.checkpoint import load
from recopt.optim.keyed import KeyedOptimizer
from recopt.sharding.plan import ParameterSharding, ShardingPlan, ShardingType, ShardSpec
from recopt.sparse import KeyedJaggedTensor

TABLES = {"t0": (10, 4), "t1": (7, 6), "t2": (12, 2)}


def full_value(name: str, kind: str, seed: int) -> torch.Tensor:
    """A deterministic full ``weight``, ``m1`` [rows] or ``m2`` [rows, dim] of a table."""
    rows, dim = TABLES[name]
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}.{kind}.{seed}".encode()))
    shape = {"weight": (rows, dim), "m1": (rows,), "m2": (rows, dim)}[kind]
    return torch.randn(shape, generator=g)


def rectangles(
    layout: str, rows: int, dim: int, rank: int, world: int, table_index: int
) -> list[tuple[int, int, int, int]]:
    """(row_offset, num_rows, col_offset, num_cols) held by ``rank`` under ``layout``."""
    if layout == "tw":
        return [(0, rows, 0, dim)] if table_index % world == rank else []
    if layout == "rw":
        per = -(-rows // world)
        start, stop = min(rank * per, rows), min((rank + 1) * per, rows)
        return [(start, stop - start, 0, dim)] if stop > start else []
    if layout == "cw":
        # One-column blocks dealt round-robin: several rectangles on one rank.
        return [(0, rows, c, 1) for c in range(dim) if c % world == rank]
    raise ValueError(layout)


def make_sharded(
    full: torch.Tensor, layout: str, rank: int, world: int, table_index: int
) -> torch.Tensor | ShardedTensor:
    """``full`` laid out as ``layout`` (``dp``: a plain replicated tensor)."""
    if layout == "dp":
        return full.clone()
    dim = full.shape[1] if full.dim() == 2 else 1
    shards = []
    for r0, nr, c0, nc in rectangles(layout, full.shape[0], dim, rank, world, table_index):
        if full.dim() == 1:
            if c0 != 0:
                continue  # row-wise state lives with the first column block only
            local = full[r0 : r0 + nr].clone()
            offsets, sizes = [r0], [nr]
        else:
            local = full[r0 : r0 + nr, c0 : c0 + nc].clone()
            offsets, sizes = [r0, c0], [nr, nc]
        shards.append(Shard(local, ShardMetadata(offsets, sizes, f"rank:{rank}/cpu")))
    return ShardedTensor._init_from_local_shards(shards, list(full.shape))


def to_full(t: torch.Tensor | ShardedTensor) -> dict[tuple[int, ...], torch.Tensor]:
    """This rank's pieces of ``t``, keyed by offsets (a plain tensor is one piece)."""
    if not isinstance(t, ShardedTensor):  # ShardedTensor is a torch.Tensor subclass
        return {(0,) * t.dim(): t.clone()}
    return {tuple(s.metadata.shard_offsets): s.tensor.clone() for s in t.local_shards()}


def copy_into(dst: torch.Tensor | ShardedTensor, src: torch.Tensor | ShardedTensor) -> None:
    """In-place copy between identically laid-out tensors (what load_state_dict must do)."""
    if not isinstance(dst, ShardedTensor):
        assert not isinstance(src, ShardedTensor)
        dst.copy_(src)
        return
    assert isinstance(src, ShardedTensor)
    for d, s in zip(dst.local_shards(), src.local_shards(), strict=True):
        d.tensor.copy_(s.tensor)


class ShardedTables(torch.nn.Module):
    """Tables ``t0..t2`` laid out by ``layouts`` (table -> tw/rw/cw/dp), with fused state.

    Args:
        layouts: per table layout.
        rank, world: this rank and the world size.
        seed: picks the values (different seeds give different models' values).
    """

    def __init__(self, layouts: dict[str, str], rank: int, world: int, seed: int = 0) -> None:
        super().__init__()
        self.weights: dict[str, Any] = {}
        state: dict[Any, Any] = {}
        params: dict[str, Any] = {}
        for i, (name, layout) in enumerate(layouts.items()):
            w = make_sharded(full_value(name, "weight", seed), layout, rank, world, i)
            self.weights[name] = w
            key = f"ebc.embedding_bags.{name}.weight"
            params[key] = w
            state[w] = {
                f"{name}.m1": make_sharded(full_value(name, "m1", seed), layout, rank, world, i),
                f"{name}.m2": make_sharded(full_value(name, "m2", seed), layout, rank, world, i),
                f"{name}.step": torch.tensor(float(seed + i)),
            }
        self.fused_optimizer = _FusedState(params, state)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return {f"ebc.embedding_bags.{n}.weight": w for n, w in self.weights.items()}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        assert set(state_dict) == set(self.state_dict())
        for key, value in state_dict.items():
            copy_into(self.state_dict()[key], value)


class _FusedState(KeyedOptimizer):
    def __init__(self, params: dict[str, Any], state: dict[Any, Any]) -> None:
        super().__init__(params, state, [{"params": list(params.values()), "lr": 0.1}])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mine = self.state_dict()["state"]
        assert set(state_dict["state"]) == set(mine)
        for param, states in state_dict["state"].items():
            for name, value in states.items():
                target = mine[param][name]
                copy_into(target, value)

    def step(self, closure: Any = None) -> None:
        pass


def full_snapshot(model: ShardedTables) -> dict[str, dict[tuple[int, ...], torch.Tensor]]:
    """Every piece of every weight and state this rank holds, for exact comparisons."""
    out = {}
    for key, t in model.state_dict().items():
        out[key] = to_full(t)
    for param, states in model.fused_optimizer.state_dict()["state"].items():
        for name, t in states.items():
            out[f"{param}/{name}"] = to_full(t)
    return out


def expected_snapshot(
    layouts: dict[str, str], rank: int, world: int, seed: int
) -> dict[str, dict[tuple[int, ...], torch.Tensor]]:
    """What `full_snapshot` must give after loading a checkpoint of a ``seed`` model."""
    return full_snapshot(ShardedTables(layouts, rank, world, seed))


def plan_for_c(world: int) -> ShardingPlan:
    """Layout C (t0 column-wise, t1 data-parallel, t2 table-wise) as a plan for module ``ebc``."""
    rows0, dim0 = TABLES["t0"]
    rows2, dim2 = TABLES["t2"]
    cw = tuple(
        ShardSpec(rank=c % world, row_offset=0, num_rows=rows0, col_offset=c, num_cols=1)
        for c in range(dim0)
    )
    tw = ShardSpec(rank=2 % world, row_offset=0, num_rows=rows2, col_offset=0, num_cols=dim2)
    return ShardingPlan(
        {
            "ebc": {
                "t0": ParameterSharding(
                    sharding_type=ShardingType.COLUMN_WISE,
                    ranks=tuple(sorted({s.rank for s in cw})),
                    shards=cw,
                ),
                "t1": ParameterSharding(
                    sharding_type=ShardingType.DATA_PARALLEL, ranks=tuple(range(world))
                ),
                "t2": ParameterSharding(
                    sharding_type=ShardingType.TABLE_WISE, ranks=(tw.rank,), shards=(tw,)
                ),
            }
        }
    )


# Layouts of t0, t1, t2 used by the tests.
A = {"t0": "tw", "t1": "rw", "t2": "cw"}
B = {"t0": "rw", "t1": "cw", "t2": "dp"}
C = {"t0": "cw", "t1": "dp", "t2": "tw"}
ALL_DP = {"t0": "dp", "t1": "dp", "t2": "dp"}


def same_pieces(a: dict, b: dict) -> list[str]:
    """The pieces (key and offsets) where two `full_snapshot` results differ."""
    bad = []
    assert a.keys() == b.keys()
    for key in a:
        if a[key].keys() != b[key].keys():
            bad.append(f"{key}: pieces {sorted(a[key])} vs {sorted(b[key])}")
        bad += [f"{key}{o}" for o in a[key] if not torch.equal(a[key][o], b[key][o])]
    return bad


def load_and_check(path: Path, layouts: dict, rank: int, world: int, seed: int) -> list[str]:
    """Load ``path`` into a fresh model of ``layouts``; list what differs from a ``seed`` model."""
    model = ShardedTables(layouts, rank, world, seed=99)
    load(path, model, model.fused_optimizer)
    return same_pieces(full_snapshot(model), expected_snapshot(layouts, rank, world, seed))


def full_state(model: torch.nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """Every model tensor and optimizer state value, gathered to full tensors (any plan)."""
    from recopt.sharding.state import full_tensor

    out = {k: full_tensor(v) for k, v in model.state_dict().items()}
    for param, states in opt.state_dict()["state"].items():
        for name, value in states.items():
            out[f"{param}/{name}"] = full_tensor(value)
    return out


def random_batch(rows: dict[str, int], rank: int, step: int, batch: int = 4) -> KeyedJaggedTensor:
    """``rank``'s batch at ``step``: 0-2 ids per bag, each below its feature's row count."""
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 3, (len(rows) * batch,), generator=g)
    values = torch.cat(
        [
            torch.randint(0, rows[f], (int(n),), generator=g)
            for f, chunk in zip(rows, lengths.split(batch), strict=True)
            for n in chunk
        ]
    )
    return KeyedJaggedTensor(keys=list(rows), values=values, lengths=lengths)
