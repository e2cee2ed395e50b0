"""DevicePrefetcher on CPU: batches pass through unchanged and checkpoints see the source's
position (the CUDA path, one batch ahead on a side stream, is tested in test_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from recopt.data import SyntheticClickLog, SyntheticConfig
from recopt.data.batch import Batch
from recopt.data.prefetch import DevicePrefetcher, pin_batch
from recopt.sparse import KeyedJaggedTensor


def _source() -> SyntheticClickLog:
    config = SyntheticConfig(min_ids_per_bag=0, max_ids_per_bag=3)
    return SyntheticClickLog([("a", 1000), ("b", 50)], config, batch_size=16, num_batches=4)


def test_cpu_prefetcher_is_the_source() -> None:
    fetched, plain = DevicePrefetcher(_source(), torch.device("cpu")), _source()
    got, want = list(fetched), list(plain)
    assert [b.position for b in got] == [b.position for b in want] == [1, 2, 3, 4]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.sparse.values(), b.sparse.values())
    assert fetched.state_dict() == plain.state_dict()
    again = DevicePrefetcher(_source(), torch.device("cpu"))
    again.load_state_dict({**plain.state_dict(), "position": 2})
    assert [b.position for b in again] == [3, 4]


def test_pin_batch_keeps_a_variable_batch_kjt(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pinning needs a CUDA build; a clone stands in for it so the rebuild itself is what runs.
    pinned_ids: list[int] = []

    def fake_pin(tensor: torch.Tensor) -> torch.Tensor:
        copy = tensor.clone()
        pinned_ids.append(id(copy))
        return copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    inverse = torch.tensor([[0, 1, 1], [0, 0, 1]])
    sparse = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1, 2, 3, 4, 5]),
        weights=torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5]),
        lengths=torch.tensor([1, 2, 0, 2]),  # a: 3 bags (2 + 1 ranks), b: 1 bag
        stride_per_key_per_rank=[[2, 1], [1, 0]],
        inverse_indices=(["a", "b"], inverse),
    )
    batch = Batch(torch.ones(3, 2), sparse, torch.zeros(3), position=7)
    pinned = pin_batch(batch)
    got = pinned.sparse
    assert got.stride_per_key_per_rank() == [[2, 1], [1, 0]]
    assert got.stride_per_key() == [3, 1] and got.stride() == sparse.stride()
    keys, indices = got.inverse_indices()
    assert keys == ["a", "b"] and torch.equal(indices, inverse)
    assert torch.equal(got.values(), sparse.values())
    assert torch.equal(got.weights(), sparse.weights())
    assert torch.equal(got.lengths(), sparse.lengths())
    assert pinned.position == 7 and torch.equal(pinned.dense, batch.dense)
    # Every tensor went through pinning, the inverse indices included.
    held = [pinned.dense, pinned.labels, *got.tensors()]
    assert {id(t) for t in held} <= set(pinned_ids)
    assert any(t is indices for t in got.tensors())
    moved = pinned.to("cpu")  # what the prefetcher does next, on its side stream
    assert moved.sparse.stride_per_key_per_rank() == [[2, 1], [1, 0]]
    assert torch.equal(moved.sparse["a"].lengths(), torch.tensor([1, 2, 0]))
