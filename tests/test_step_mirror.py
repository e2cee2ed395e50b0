"""The host copy of the step counters: no read per step, one read after an outside write."""

from __future__ import annotations

import pytest
import torch
from test_host_syncs import count_read_backs

from recopt.kernels.config import FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding
from recopt.kernels.steps import StepMirror


def test_mirror_advances_without_reading_and_rereads_after_a_load() -> None:
    steps = [torch.zeros((), dtype=torch.int64) for _ in range(3)]
    mirror = StepMirror(steps, [0, 0, 0])
    with count_read_backs() as calls:
        assert mirror.advance(steps) == [1, 1, 1]
        assert mirror.advance(steps) == [2, 2, 2]
    assert calls == []
    assert [int(s) for s in steps] == [2, 2, 2]
    steps[1].fill_(7)  # a checkpoint load writes in place
    with count_read_backs() as calls:
        assert mirror.advance(steps) == [3, 8, 3]
    assert len(calls) == 1, calls
    replaced = [steps[0], torch.full((), 40, dtype=torch.int64), steps[2]]
    assert StepMirror(replaced).values(replaced) == [3, 40, 3]
    assert mirror.values(replaced) == [3, 40, 3]  # another tensor object: read again


def _kernel(name: str, seed: int) -> RecoptTableBatchedEmbedding:
    torch.manual_seed(seed)
    tables = [TableSpec(name=f"t{i}", num_embeddings=20, embedding_dim=8) for i in range(2)]
    return RecoptTableBatchedEmbedding(
        tables, [0, 1], FusedOptimizerConfig(name=name, lr=0.05), PoolingType.SUM, "cpu"
    )


@pytest.mark.parametrize("use_native", [True, False])
@pytest.mark.parametrize("name", ["adam", "row_wise_adam", "lamb", "adafactor"])
def test_state_loaded_in_place_continues_like_the_original(name: str, use_native: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        lengths = torch.randint(0, 4, (2 * 5,), generator=gen)
        ids = torch.randint(0, 20, (int(lengths.sum()),), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        batches.append((ids, offsets, torch.randn(5, 16, generator=gen)))
    original = _kernel(name, seed=0)
    original._use_native = use_native
    for ids, offsets, grad in batches[:3]:
        original(ids, offsets).backward(grad)
    loaded = _kernel(name, seed=5)
    loaded._use_native = use_native
    weights = (original.split_embedding_weights(), loaded.split_embedding_weights())
    states = (original.split_optimizer_states(), loaded.split_optimizer_states())
    with torch.no_grad():
        for src, dst in zip(*weights, strict=True):
            dst.copy_(src)
        for src_state, dst_state in zip(*states, strict=True):
            for key, value in src_state.items():
                dst_state[key].copy_(value)
    ids, offsets, grad = batches[3]
    for kernel in (original, loaded):
        kernel(ids, offsets).backward(grad)
    for a, b in zip(*weights, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for sa, sb in zip(*states, strict=True):
        assert int(sa["step"]) == int(sb["step"]) == 4
        for key in sa:
            torch.testing.assert_close(sa[key], sb[key], rtol=1e-6, atol=1e-7)
