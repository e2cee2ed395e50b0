"""A TorchRec training script run on recopt: TorchRec code in which ``torchrec`` became
``recopt.torchrec`` (``sed 's/\\btorchrec\\b/recopt.torchrec/g'``) and nothing else.

A click model over pooled user features (EmbeddingBagCollection) and an unpooled item history
(EmbeddingCollection), built on the meta device; the user tables get row-wise Adagrad through
``apply_optimizer_in_backward``, the item table Adagrad through its sharder's
``fused_params``; the planner plans under per-table constraints; DistributedModelParallel
shards; a CombinedOptimizer of the fused optimizer and a dense Adam trains; a DCP checkpoint
is saved and loaded back. Run on one process (``python examples/torchrec_style/train.py``) or
``torchrun --nproc-per-node 2 examples/torchrec_style/train.py`` (gloo).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn

from recopt.torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    JaggedTensor,
    KeyedJaggedTensor,
)
from recopt.torchrec.distributed import DistributedModelParallel
from recopt.torchrec.distributed.embedding import EmbeddingCollectionSharder
from recopt.torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from recopt.torchrec.distributed.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    Topology,
)
from recopt.torchrec.distributed.types import ShardingType
from recopt.torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from recopt.torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from recopt.torchrec.optim.optimizers import in_backward_optimizer_filter
from recopt.torchrec.optim.rowwise_adagrad import RowWiseAdagrad

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


def build(seed: int) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    """The sharded model and its optimizer, as a TorchRec tutorial builds them."""
    torch.manual_seed(seed)  # the same initial model on every rank
    model = HistoryClickModel(device=torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, model.user_features.parameters(), {"lr": 0.1})
    sharders = [
        EmbeddingBagCollectionSharder(),
        EmbeddingCollectionSharder(
            fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.1}
        ),
    ]
    constraints = {
        "user": ParameterConstraints(
            sharding_types=[ShardingType.ROW_WISE.value, ShardingType.TABLE_WISE.value]
        ),
        "category": ParameterConstraints(sharding_types=[ShardingType.DATA_PARALLEL.value]),
        "item": ParameterConstraints(
            sharding_types=[ShardingType.TABLE_WISE.value], pooling_factors=[4.0, 1.0]
        ),
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    model = DistributedModelParallel(
        model, device=torch.device("cpu"), plan=plan, sharders=sharders
    )
    dense_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adam(params, lr=0.01),
    )
    return model, CombinedOptimizer([model.fused_optimizer, dense_optimizer])


def train(
    steps: int, batch_size: int, seed: int, log_every: int, checkpoint_dir: str | None = None
) -> list[float]:
    """Train for ``steps`` on this rank's batches, then save a DCP checkpoint to
    ``checkpoint_dir`` (if given), take one more step and load it back; returns the losses
    (the last two: a fixed batch's loss at the save and after the load, equal)."""
    rank = dist.get_rank()
    taste = torch.randn(NUM_ITEMS, generator=torch.Generator().manual_seed(seed))
    model, optimizer = build(seed)
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
    if checkpoint_dir is not None:
        losses += save_and_restore(model, optimizer, checkpoint_dir, taste, generator)
    return losses


def save_and_restore(
    model: DistributedModelParallel,
    optimizer: CombinedOptimizer,
    checkpoint_dir: str,
    taste: torch.Tensor,
    generator: torch.Generator,
) -> list[float]:
    """Save model and optimizer with DCP, train one step, load: the model is back."""
    features, labels = sample_batch(64, taste, generator)
    loss_fn = nn.BCEWithLogitsLoss()
    with torch.no_grad():
        saved_loss = float(loss_fn(model(features), labels))
    dcp.save(
        {"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=checkpoint_dir
    )
    loss = loss_fn(model(features), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    with torch.no_grad():
        restored_loss = float(loss_fn(model(features), labels))
    if dist.get_rank() == 0:
        print(f"checkpoint loss {saved_loss:.6f} restored {restored_loss:.6f}", flush=True)
    return [saved_loss, restored_loss]


def main(argv: list[str] | None = None) -> int:
    """Parse flags, join (or start) the process group, train; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--checkpoint-dir", help="DCP checkpoint folder, the same on every rank")
    args = parser.parse_args(argv)
    started = not dist.is_initialized()
    if started and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("gloo")
    elif started:  # one process, no launcher
        store = os.path.join(tempfile.mkdtemp(prefix="recopt-example-"), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        train(args.steps, args.batch_size, args.seed, args.log_every, args.checkpoint_dir)
    finally:
        if started:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
