"""A small click model on synthetic data: a FusedEmbeddingBagCollection plus a linear head.

Clicks are drawn from a hidden model over the same features, so the loss visibly falls.
Run: ``python examples/click_model/train.py [--steps N] [--batch-size B] [--seed S]``.
"""

from __future__ import annotations

import argparse
import time

import torch

from recopt.kernels.config import FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
from recopt.sparse import KeyedJaggedTensor

FEATURES = {"user": 20_000, "item": 50_000, "category": 500}
DIM = 16
IDS_PER_BAG = 4


def sample_batch(
    batch_size: int, hidden: dict[str, torch.Tensor], generator: torch.Generator
) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """Power-law ids per feature; label ~ Bernoulli(sigmoid(sum of hidden per-id scores))."""
    values, logits = [], torch.zeros(batch_size)
    for name, rows in FEATURES.items():
        # Zipf-like ids: a few ids are frequent, most are rare, as in real click logs.
        u = torch.rand(batch_size * IDS_PER_BAG, generator=generator)
        ids = ((rows**u) - 1).long().clamp_(0, rows - 1)
        values.append(ids)
        logits += hidden[name][ids].view(batch_size, IDS_PER_BAG).sum(dim=1)
    lengths = torch.full((len(FEATURES) * batch_size,), IDS_PER_BAG, dtype=torch.long)
    kjt = KeyedJaggedTensor.from_lengths_sync(list(FEATURES), torch.cat(values), lengths)
    labels = torch.bernoulli(torch.sigmoid(logits), generator=generator)
    return kjt, labels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed + 1)
    hidden = {name: torch.randn(rows, generator=generator) for name, rows in FEATURES.items()}
    tables = [
        EmbeddingBagConfig(
            name=f"t_{name}", num_embeddings=rows, embedding_dim=DIM, feature_names=[name]
        )
        for name, rows in FEATURES.items()
    ]
    ebc = FusedEmbeddingBagCollection(
        tables, optimizer=FusedOptimizerConfig(name="row_wise_adagrad", lr=0.1)
    )
    head = torch.nn.Linear(DIM * len(FEATURES), 1)
    dense_opt = torch.optim.Adagrad(head.parameters(), lr=0.05)
    start, window = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        kjt, labels = sample_batch(args.batch_size, hidden, generator)
        logits = head(ebc(kjt).values()).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        dense_opt.zero_grad()
        loss.backward()  # also updates the embedding rows of this batch (fused optimizer)
        dense_opt.step()
        window.append(loss.item())
        if step % 50 == 0 or step == args.steps:
            rate = step * args.batch_size / (time.perf_counter() - start)
            print(f"step {step:5d}  loss {sum(window) / len(window):.4f}  {rate:,.0f} samples/s")
            window.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
