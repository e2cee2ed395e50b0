"""A TorchRec-style training loop on recopt: TorchRec code with only its imports changed.

A click model over pooled user features (EmbeddingBagCollection) and an unpooled item history
(EmbeddingCollection), sharded by DistributedModelParallel under the planner's plan, trained
with a CombinedOptimizer of the fused embedding optimizer and a dense Adam. Run on one process
(``python examples/torchrec_style/train.py``) or ``torchrun --nproc-per-node 2 ...`` (gloo).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

# With TorchRec these would be: torchrec (configs, collections, KeyedJaggedTensor),
# torchrec.distributed (DistributedModelParallel), torchrec.optim.keyed (the optimizers).
from recopt.kernels.config import FusedOptimizerConfig
from recopt.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from recopt.optim import CombinedOptimizer, KeyedOptimizerWrapper
from recopt.sharding import DistributedModelParallel
from recopt.sparse import JaggedTensor, KeyedJaggedTensor

NUM_USERS, NUM_CATEGORIES, NUM_ITEMS = 500, 20, 200
DIM = 16
MAX_HISTORY = 8


class HistoryClickModel(nn.Module):
    """Logit of a click on a candidate item, given the user and the items they clicked before."""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.user_features = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="user", num_embeddings=NUM_USERS, embedding_dim=DIM, feature_names=["user"]
                ),
                EmbeddingBagConfig(
                    name="category",
                    num_embeddings=NUM_CATEGORIES,
                    embedding_dim=DIM,
                    feature_names=["liked_categories"],
                ),
            ],
            device=device,
        )
        # One item table for the history and the candidate: unpooled, one row per id.
        self.item_features = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name="item",
                    num_embeddings=NUM_ITEMS,
                    embedding_dim=DIM,
                    feature_names=["history", "candidate"],
                )
            ],
            device=device,
        )
        self.over = nn.Sequential(nn.Linear(5 * DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.user_features(features)
        items = self.item_features(features)
        history = mean_of_sequence(items["history"])
        candidate = items["candidate"].values()  # one candidate per sample: [B, DIM]
        x = torch.cat(
            [pooled["user"], pooled["liked_categories"], history, candidate, history * candidate],
            dim=1,
        )
        return self.over(x).squeeze(1)


def mean_of_sequence(jt: JaggedTensor) -> torch.Tensor:
    """The mean row of each sample's sequence (zeros for an empty one): ``[B, DIM]``."""
    padded = jt.to_padded_dense(desired_length=MAX_HISTORY)  # [B, MAX_HISTORY, DIM]
    counts = jt.lengths().clamp(min=1, max=MAX_HISTORY).unsqueeze(1).to(padded.dtype)
    return padded.sum(dim=1) / counts


def sample_batch(
    batch_size: int, taste: torch.Tensor, generator: torch.Generator
) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """Users click popular candidates, and candidates whose hidden taste matches their history's."""
    users = torch.randint(0, NUM_USERS, (batch_size,), generator=generator)
    num_categories = torch.randint(1, 4, (batch_size,), generator=generator)
    categories = torch.randint(0, NUM_CATEGORIES, (int(num_categories.sum()),), generator=generator)
    history_lengths = torch.randint(0, MAX_HISTORY + 1, (batch_size,), generator=generator)
    history = torch.randint(0, NUM_ITEMS, (int(history_lengths.sum()),), generator=generator)
    candidates = torch.randint(0, NUM_ITEMS, (batch_size,), generator=generator)
    sample = torch.repeat_interleave(torch.arange(batch_size), history_lengths)
    history_taste = torch.zeros(batch_size).index_add_(0, sample, taste[history])
    affinity = (1.0 + history_taste / history_lengths.clamp(min=1)) * taste[candidates]
    labels = torch.bernoulli(torch.sigmoid(3.0 * affinity), generator=generator)
    ones = torch.ones(batch_size, dtype=torch.int64)
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=["user", "liked_categories", "history", "candidate"],
        values=torch.cat([users, categories, history, candidates]),
        lengths=torch.cat([ones, num_categories, history_lengths, ones]),
    )
    return features, labels


def train(steps: int, batch_size: int, seed: int, log_every: int) -> list[float]:
    """Train for ``steps`` on this rank's batches; returns this rank's losses."""
    rank = dist.get_rank()
    torch.manual_seed(seed)  # the same initial model on every rank
    taste = torch.randn(NUM_ITEMS, generator=torch.Generator().manual_seed(seed))
    model = DistributedModelParallel(
        HistoryClickModel(),
        default_optimizer=FusedOptimizerConfig(name="row_wise_adagrad", lr=0.1),
    )
    dense_optimizer = KeyedOptimizerWrapper(
        dict(model.named_parameters()), lambda params: torch.optim.Adam(params, lr=0.01)
    )
    optimizer = CombinedOptimizer([model.fused_optimizer, dense_optimizer])
    loss_fn = nn.BCEWithLogitsLoss()
    generator = torch.Generator().manual_seed(seed + 1 + rank)
    losses = []
    for step in range(steps):
        features, labels = sample_batch(batch_size, taste, generator)
        loss = loss_fn(model(features), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if rank == 0 and (step % log_every == 0 or step == steps - 1):
            print(f"step {step} loss {losses[-1]:.4f}", flush=True)
    return losses


def main(argv: list[str] | None = None) -> int:
    """Parse flags, join (or start) the process group, train; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=20)
    args = parser.parse_args(argv)
    started = not dist.is_initialized()
    if started and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("gloo")
    elif started:  # one process, no launcher
        store = os.path.join(tempfile.mkdtemp(prefix="recopt-example-"), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        train(args.steps, args.batch_size, args.seed, args.log_every)
    finally:
        if started:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
