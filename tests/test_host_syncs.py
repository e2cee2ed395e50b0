"""The fused module's forward and backward each read back one flag a step, nothing more.

On a GPU every ``.item()``, ``.tolist()``, ``bool(tensor)``, ``int(tensor)`` or
``float(tensor)`` waits for the device. These are counted here on CPU, structurally, by wrapping
those methods during one forward + backward of a 26-feature collection (a Criteo-shaped input).
Only reads made by recopt's own code count: fbgemm's reads of its CPU-resident step counter
(``iter_cpu``) are host-side on a GPU too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from recopt.kernels import cpu_fused, registry
from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, InvalidIdError
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

NUM_FEATURES = 26
READ_BACKS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def count_read_backs() -> Iterator[list[str]]:
    """Record the name of every tensor-to-host read made inside the block."""
    calls: list[str] = []
    package = os.path.dirname(os.path.abspath(sys.modules["recopt"].__file__ or "")) + os.sep
    originals = {name: getattr(torch.Tensor, name) for name in READ_BACKS}

    def wrap(name: str, original: Any) -> Any:
        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if os.path.abspath(caller).startswith(package):
                calls.append(f"{name} at {caller}:{sys._getframe(1).f_lineno}")
            return original(self, *args, **kwargs)

        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def criteo_like(num_rows: int = 50) -> tuple[list[EmbeddingBagConfig], KeyedJaggedTensor]:
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=num_rows, embedding_dim=8, feature_names=[f"f{i}"]
        )
        for i in range(NUM_FEATURES)
    ]
    gen = torch.Generator().manual_seed(0)
    batch = 16
    lengths = torch.randint(0, 3, (NUM_FEATURES * batch,), generator=gen)
    values = torch.randint(0, num_rows, (int(lengths.sum()),), generator=gen)
    keys = [t.feature_names[0] for t in tables]
    kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
    return tables, kjt


@pytest.mark.parametrize("name", ["sgd", "row_wise_adagrad"])
def test_fused_forward_backward_reads_back_at_most_one_value(name: str) -> None:
    # fbgemm: the backend these optimizers run on with a GPU.
    tables, kjt = criteo_like()
    ebc = FusedEmbeddingBagCollection(
        tables, optimizer=FusedOptimizerConfig(name=name, lr=0.1, backend=Backend.FBGEMM)
    )
    ebc(kjt).values().sum().backward()  # first step: kernels built, native code compiled
    with count_read_backs() as forward_calls:
        pooled = ebc(kjt)
    # Forward: the one id/weight check. Backward: the one finiteness check of the gradient
    # before the fused update (issue 18); without it (skip_nonfinite=False), none.
    assert len(forward_calls) <= 1, forward_calls
    with count_read_backs() as backward_calls:
        pooled.values().sum().backward()
    assert len(backward_calls) <= 1, backward_calls
    unguarded = FusedEmbeddingBagCollection(
        tables,
        optimizer=FusedOptimizerConfig(name=name, lr=0.1, backend=Backend.FBGEMM),
        skip_nonfinite=False,
    )
    unguarded(kjt).values().sum().backward()
    pooled = unguarded(kjt)
    with count_read_backs() as backward_calls:
        pooled.values().sum().backward()
    assert backward_calls == [], backward_calls


RECOPT_OPTIMIZERS = list(registry.OPTIMIZERS)  # every fused optimizer


@pytest.mark.parametrize("name", RECOPT_OPTIMIZERS)
def test_recopt_backend_reads_back_nothing_beyond_the_checks(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # recopt's backend on a GPU runs its torch path: the same path here without the native
    # CPU library. Over several steps (step counters, Adafactor's running norm), forward reads
    # only the id check and backward only the gradient check; with skip_nonfinite=False, none.
    monkeypatch.setattr(cpu_fused, "available", lambda: False)
    tables, kjt = criteo_like()
    for guarded in (True, False):
        ebc = FusedEmbeddingBagCollection(
            tables,
            optimizer=FusedOptimizerConfig(name=name, lr=0.01, backend=Backend.RECOPT),
            skip_nonfinite=guarded,
        )
        ebc(kjt).values().sum().backward()  # first step: kernels built
        for _ in range(2):
            with count_read_backs() as forward_calls:
                pooled = ebc(kjt)
            assert len(forward_calls) <= 1, forward_calls
            with count_read_backs() as backward_calls:
                pooled.values().sum().backward()
            assert len(backward_calls) <= (1 if guarded else 0), backward_calls


def test_one_bad_id_among_many_features_still_names_it_and_updates_nothing() -> None:
    tables, kjt = criteo_like()
    ebc = FusedEmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig(name="sgd", lr=0.1))
    values = kjt.values().clone()
    opk = kjt.offset_per_key()
    feature = next(f for f in range(7, NUM_FEATURES) if opk[f + 1] > opk[f])
    values[opk[feature]] = 50  # the table has rows 0..49
    bad = KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths())
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    with pytest.raises(InvalidIdError, match=rf"table 't{feature}', feature 'f{feature}': id 50"):
        ebc(bad)
    for key, value in ebc.state_dict().items():
        assert torch.equal(value, before[key])


def _input_distribution_reads(rank: int, world_size: int) -> list[str]:
    from recopt.sharding import ShardedEmbeddingBagCollection
    from recopt.sharding.plan_helpers import balanced_table_wise_plan

    tables, kjt = criteo_like()
    plan = balanced_table_wise_plan({"": tables}, world_size)
    ebc = ShardedEmbeddingBagCollection(tables, plan[""], FusedOptimizerConfig(name="sgd"))
    ebc(kjt).values().sum().backward()  # first step: kernels built
    with count_read_backs() as calls:
        ebc(kjt)
    return [call for call in calls if "input_dist.py" in call]


@pytest.mark.multiprocess
def test_sharded_input_distribution_reads_back_only_the_count_exchange() -> None:
    # The counts this rank sends and those the other ranks sent are read back together, once
    # (tests/test_host_syncs_sharded.py counts the whole sharded step).
    (reads,) = run_on_ranks(_input_distribution_reads, 1, timeout_s=120)
    assert len(reads) == 1 and reads[0].startswith("tolist"), reads
