"""DevicePrefetcher on CPU: batches pass through unchanged and checkpoints see the source's
position (the CUDA path, one batch ahead on a side stream, is tested in test_cuda.py)."""

from __future__ import annotations

import torch

from recopt.data import SyntheticClickLog, SyntheticConfig
from recopt.data.prefetch import DevicePrefetcher


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
