"""The non-finite gate with sharded id-mapped tables: a NaN step trains no row on any rank.

Row-wise and table-row-wise at 2 ranks, under capacity, against the unsharded fused
collection fed the ranks' batches concatenated: a step whose output gradient holds NaN is
skipped by both gates (no weight or optimizer state moves), while the map step of its forward
stays (new ids keep the rows they got, re-initialised), as in the unsharded collection; the
steps after it train on. Compared by id after every step.
"""

from __future__ import annotations

import warnings

import torch
from test_id_map_sharded import BIG, _bags, _compare_by_id, _everyone, _kjt, _modules

from recopt.testing import run_on_ranks

NAN_STEP = 2


def _case(kind: str, rank: int, world: int) -> int:
    ref, sharded, _ = _modules(kind, "adam", world, BIG)
    first = sum(2 + r for r in range(rank))
    mine = slice(first, first + 2 + rank)
    for step in range(5):
        out = sharded(_kjt(_bags(rank, step))).values()
        ref_out = ref(_kjt(_everyone(world, step))).values()
        torch.testing.assert_close(out, ref_out[mine])
        weight = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(step))
        if step == NAN_STEP:
            weight[0, 0] = float("nan")  # rank 0's first bag: every rank's gate must skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the gates say they skipped
            (out * weight[mine]).sum().backward()
            (ref_out * weight).sum().backward()
        assert sharded.stats() == ref.stats()
        _compare_by_id(ref, sharded, "adam", f"{kind} step {step}")
    assert ref.skipped_nonfinite_steps == 1
    return sharded.skipped_nonfinite_steps


def _all(rank: int, world: int) -> list[int]:
    return [_case(kind, rank, world) for kind in ("row_wise", "table_row_wise")]


def test_nan_step_of_sharded_id_mapped_tables_trains_nothing_and_keeps_the_maps() -> None:
    results = run_on_ranks(_all, 2, timeout_s=240.0)
    assert results == [[1, 1], [1, 1]]  # every rank counted the one skipped step
