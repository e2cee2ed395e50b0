"""The recopt kernel's hooks: grad_hook rewrites row gradients, row_stat_hook widens row stats."""

from __future__ import annotations

import pytest
import torch

from recopt.kernels.config import FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding

CPU = torch.device("cpu")
IDS = torch.tensor([3, 1, 3, 0, 7, 3])
OFFSETS = torch.tensor([0, 3, 4, 6])  # one feature, batch 3


def kernel(name: str, dim: int) -> RecoptTableBatchedEmbedding:
    return RecoptTableBatchedEmbedding(
        [TableSpec(name="t", num_embeddings=8, embedding_dim=dim)],
        [0],
        FusedOptimizerConfig(name=name, lr=0.1),
        PoolingType.SUM,
        CPU,
    )


def test_grad_hook_sees_unique_rows_and_its_result_is_applied() -> None:
    plain, hooked = kernel("sgd", 4), kernel("sgd", 4)
    hooked.split_embedding_weights()[0].copy_(plain.split_embedding_weights()[0])
    seen: list[torch.Tensor] = []

    def double(table: int, rows: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        seen.append(rows.clone())
        return grad * 2

    hooked.grad_hook = double
    upstream = torch.randn(3, 4)
    before = plain.split_embedding_weights()[0].clone()
    (plain(IDS, OFFSETS) * upstream).sum().backward()
    (hooked(IDS, OFFSETS) * upstream).sum().backward()
    assert torch.equal(seen[0], torch.tensor([0, 1, 3, 7]))
    plain_delta = plain.split_embedding_weights()[0] - before
    hooked_delta = hooked.split_embedding_weights()[0] - before
    torch.testing.assert_close(hooked_delta, 2 * plain_delta)


def dense_row_grads(upstream: torch.Tensor) -> torch.Tensor:
    """Per unique row of IDS (0, 1, 3, 7), its gradient summed over occurrences."""
    bags = torch.tensor([0, 0, 0, 1, 2, 2])
    grad = torch.zeros(8, upstream.shape[1]).index_add_(0, IDS, upstream[bags])
    return grad[torch.tensor([0, 1, 3, 7])]


@pytest.mark.parametrize("name", ["row_wise_adagrad", "row_wise_adam"])
def test_row_stat_hook_makes_column_shards_equal_the_whole_table(name: str) -> None:
    """Two column halves whose hook adds the other half's partial sums behave as one table."""
    whole = kernel(name, 8)
    halves = [kernel(name, 4), kernel(name, 4)]
    for h, cols in zip(halves, (slice(0, 4), slice(4, 8)), strict=True):
        h.split_embedding_weights()[0].copy_(whole.split_embedding_weights()[0][:, cols])
    torch.manual_seed(0)
    for _ in range(3):
        upstream = torch.randn(3, 8)
        for i, h in enumerate(halves):
            other_sum_sq = dense_row_grads(upstream[:, 4 * (1 - i) : 4 * (2 - i)]).square().sum(1)

            def hook(
                table: int, rows: torch.Tensor, sum_sq: torch.Tensor, other=other_sum_sq
            ) -> torch.Tensor:
                assert table == 0 and torch.equal(rows, torch.tensor([0, 1, 3, 7]))
                return (sum_sq + other) / 8

            h.row_stat_hook = hook
            (h(IDS, OFFSETS) * upstream[:, 4 * i : 4 * i + 4]).sum().backward()
        (whole(IDS, OFFSETS) * upstream).sum().backward()
    joined = torch.cat([h.split_embedding_weights()[0] for h in halves], dim=1)
    torch.testing.assert_close(joined, whole.split_embedding_weights()[0])
    state = "momentum1" if name == "row_wise_adagrad" else "exp_avg_sq"
    for h in halves:
        torch.testing.assert_close(
            h.split_optimizer_states()[0][state], whole.split_optimizer_states()[0][state]
        )


def test_grad_hook_runs_for_every_table_even_without_ids() -> None:
    two_tables = RecoptTableBatchedEmbedding(
        [
            TableSpec(name="a", num_embeddings=8, embedding_dim=4),
            TableSpec(name="b", num_embeddings=8, embedding_dim=4),
        ],
        [0, 1],
        FusedOptimizerConfig(name="sgd", lr=0.1),
        PoolingType.SUM,
        CPU,
    )
    calls: list[tuple[int, int]] = []

    def record(table: int, rows: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        calls.append((table, rows.numel()))
        return grad

    two_tables.grad_hook = record
    # Feature 1 (table b) has no ids in this batch of 3.
    out = two_tables(IDS, torch.cat([OFFSETS, torch.tensor([6, 6, 6])]))
    out.sum().backward()
    assert calls == [(0, 4), (1, 0)]
