"""A sharded step reads the host twice: its count exchange, and the gradient gate's flag.

Counted as in test_host_syncs.py (recopt's own ``.item()``/``.tolist()``/... on tensors), on
2 gloo ranks, for every sharding type and both kernel backends, with two optimizers so each
rank runs two kernels (two kernel groups split the received ids). A step is:

- forward: one read, the count exchange's (`CountExchange.start_ids`: what this rank sends and
  what it received, read together). The id bounds check's flag rides in it, and every later size
  (the splits, the ids each kernel gets, each kernel's and the row statistics' feature bounds) is
  derived from it on the host;
- backward: the non-finite gradient gate's all-reduced flag; none with ``skip_nonfinite=False``.

The input batch's ``length_per_key`` is known here (as from recopt's data pipeline); a batch
built from lengths alone costs one more read to validate them, as in the unsharded module.
"""

from __future__ import annotations

import pytest
from sharding_requests import requests_for
from test_host_syncs import count_read_backs

from recopt.kernels import cpu_fused
from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig
from recopt.sharding.plan import ShardingType
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

KINDS = [*(kind.value for kind in ShardingType), "mixed"]  # every sharding type, and a mix
# fbgemm on CPU runs sgd / adagrad / row-wise adagrad (column splits of a row-wise optimizer
# need recopt's row-statistic hook); recopt's backend runs its torch path (the one it runs on
# a GPU) with the native CPU library switched off, row statistics included.
BACKENDS = {"fbgemm": ("sgd", "adagrad"), "recopt": ("row_wise_adam", "adagrad")}
# Two kernels per rank (two optimizers), plus row-wise with one kernel: the plan fbgemm's
# native block bucketization routes (two kernel groups reorder the virtual features).
CASES = [(kind, backend, 2) for kind in KINDS for backend in BACKENDS]
CASES += [("row_wise", backend, 1) for backend in BACKENDS]
NUM_TABLES = 6
NUM_ROWS = 50


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=NUM_ROWS, embedding_dim=8, feature_names=[f"f{i}"]
        )
        for i in range(NUM_TABLES)
    ]


def _input(rank: int) -> KeyedJaggedTensor:
    import torch

    gen = torch.Generator().manual_seed(rank)
    batch = 8 + rank  # uneven batches: the padded path
    lengths = torch.randint(0, 3, (NUM_TABLES * batch,), generator=gen)
    values = torch.randint(0, NUM_ROWS, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(
        keys=[f"f{i}" for i in range(NUM_TABLES)], values=values, lengths=lengths
    )


def _step_reads(
    rank: int, world: int, kind: str, backend: str, num_kernels: int, guarded: bool
) -> tuple[list[str], list[str]]:
    from recopt.sharding import ShardedEmbeddingBagCollection, construct_module_sharding_plan

    tables = _tables()
    first, second = (
        FusedOptimizerConfig(name=name, lr=0.01, backend=Backend(backend))
        for name in BACKENDS[backend]
    )
    shardings = construct_module_sharding_plan(tables, requests_for(kind, world, NUM_TABLES), world)
    ebc = ShardedEmbeddingBagCollection(
        tables,
        shardings,
        first,
        table_optimizers={t.name: second for t in tables[1::2]} if num_kernels == 2 else None,
        skip_nonfinite=guarded,
    )
    if kind == "row_wise":  # every rank holds a row shard of every table
        assert len(ebc.kernels()) == num_kernels
    assert ebc._bucketizer.row_split == (kind == "row_wise" and num_kernels == 1)
    features = _input(rank)
    ebc(features).values().sum().backward()  # first step: kernels built
    with count_read_backs() as forward_reads:
        pooled = ebc(features)
    with count_read_backs() as backward_reads:
        pooled.values().sum().backward()
    return forward_reads, backward_reads


def _all_reads(
    rank: int, world: int
) -> dict[tuple[str, str, int, bool], tuple[list[str], list[str]]]:
    native = cpu_fused.available
    cpu_fused.available = lambda: False  # type: ignore[assignment]
    try:
        return {
            (kind, backend, n, guarded): _step_reads(rank, world, kind, backend, n, guarded)
            for kind, backend, n in CASES
            for guarded in (True, False)
        }
    finally:
        cpu_fused.available = native  # type: ignore[assignment]


@pytest.mark.multiprocess
def test_sharded_step_reads_the_host_once_beyond_the_checks() -> None:
    reports = run_on_ranks(_all_reads, 2, timeout_s=270)
    for rank, report in enumerate(reports):
        assert len(report) == len(CASES) * 2
        for (kind, backend, n, guarded), (forward, backward) in report.items():
            where = f"rank {rank}, {kind}, {backend}, {n} kernels, skip_nonfinite={guarded}"
            assert len(forward) == 1 and "input_dist.py" in forward[0], (where, forward)
            assert forward[0].startswith("tolist"), (where, forward)
            assert len(backward) == (1 if guarded else 0), (where, backward)


def _negative_id_on_a_row_split(rank: int, world: int) -> None:
    import torch

    from recopt.modules import InvalidIdError
    from recopt.sharding import ShardedEmbeddingBagCollection, construct_module_sharding_plan
    from recopt.sharding.input_dist import RemoteInputError

    tables = _tables()
    shardings = construct_module_sharding_plan(
        tables, requests_for("row_wise", world, NUM_TABLES), world
    )
    sgd = FusedOptimizerConfig(name="sgd", lr=0.1, backend=Backend.FBGEMM)
    ebc = ShardedEmbeddingBagCollection(tables, shardings, sgd)
    # fbgemm's block bucketization routes the ids before the check's answer is read: they must
    # be clamped into their tables first (fbgemm could place a negative id before bucket 0).
    assert ebc._bucketizer.row_split
    features = _input(rank)
    values = features.values().clone()
    opk = features.offset_per_key()
    feature = next(f for f in range(2, NUM_TABLES) if opk[f + 1] > opk[f])
    values[opk[feature]] = -1
    bad = KeyedJaggedTensor(keys=features.keys(), values=values, lengths=features.lengths())
    weights = [w for k in ebc.kernels() for w in k.split_embedding_weights()]
    before = [w.clone() for w in weights]
    if rank == 1:
        match = rf"table 't{feature}', feature 'f{feature}': id -1"
        with pytest.raises(InvalidIdError, match=match):
            ebc(bad)
    else:
        with pytest.raises(RemoteInputError, match=r"rank\(s\) \[1\]"):
            ebc(features)
    assert all(torch.equal(w, b) for w, b in zip(weights, before, strict=True))
    ebc(features).values().sum().backward()  # the next good step works on every rank
    assert any(not torch.equal(w, b) for w, b in zip(weights, before, strict=True))


@pytest.mark.multiprocess
def test_deferred_id_check_rejects_a_negative_id_before_routing_it() -> None:
    run_on_ranks(_negative_id_on_a_row_split, 2, timeout_s=120)


if __name__ == "__main__":
    for rank, report in enumerate(run_on_ranks(_all_reads, 2, timeout_s=270)):
        for case, (forward, backward) in report.items():
            print(rank, case, len(forward), len(backward))
            for r in forward + backward:
                print("    ", r.split("recopt/")[-1])
