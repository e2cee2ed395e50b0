"""Inputs of the sharding contract test: each rank's batch (different sizes per rank, an
empty feature at one step), optionally as a variable batch per feature, and the reference's
batch (every rank's, a variable batch expanded to one bag per sample)."""

from __future__ import annotations

import torch

from recopt.sparse import KeyedJaggedTensor

BATCHES = [3, 2, 4]  # per rank: different batch sizes


def batch_bags(rank: int, step: int) -> dict[str, list[list[int]]]:
    """Bags per feature of ``rank``'s batch at ``step``; f2 is empty on rank 0 at step 1."""
    g = torch.Generator().manual_seed(1000 * step + 17 * rank + 3)
    rows = {"f0": 11, "f1": 13, "f2": 13, "f3": 7}
    batch = BATCHES[rank]
    bags: dict[str, list[list[int]]] = {}
    for f, n in rows.items():
        empty = f == "f2" and rank == 0 and step == 1
        lengths = [
            0 if empty else int(torch.randint(0, 4, (1,), generator=g)) for _ in range(batch)
        ]
        bags[f] = [torch.randint(0, n, (k,), generator=g).tolist() for k in lengths]
    return bags


def vbe_batch(rank: int, step: int) -> tuple[dict[str, list[list[int]]], dict[str, list[int]]]:
    """A variable batch: each feature's distinct bags (1 to 3, fewer than the batch on some
    features) and, for every sample of ``rank``'s batch, the index of its bag."""
    full = batch_bags(rank, step)
    g = torch.Generator().manual_seed(500 * step + 7 * rank + 1)
    unique: dict[str, list[list[int]]] = {}
    inverse: dict[str, list[int]] = {}
    for f, bags in full.items():
        count = min(int(torch.randint(1, 4, (1,), generator=g)), len(bags))
        unique[f] = bags[:count]
        # Every distinct bag is some sample's (as deduplication gives): a bag no sample
        # refers to would still be looked up, its rows updated with a zero gradient.
        picks = torch.cat(
            [torch.arange(count), torch.randint(0, count, (len(bags) - count,), generator=g)]
        )
        inverse[f] = picks[torch.randperm(len(bags), generator=g)].tolist()
    return unique, inverse


def vbe_kjt(
    unique: dict[str, list[list[int]]], inverse: dict[str, list[int]], weighted: bool
) -> KeyedJaggedTensor:
    keys, v, lengths, w = flat([unique], weighted)
    return KeyedJaggedTensor(
        keys=keys,
        values=v,
        lengths=lengths,
        weights=w,
        stride_per_key_per_rank=[[len(unique[f])] for f in keys],
        inverse_indices=(keys, torch.tensor([inverse[f] for f in keys])),
    )


def inputs(
    vbe: bool, weighted: bool, rank: int, step: int, world: int
) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    """This rank's input, and the reference's: every rank's batch, expanded to one bag each."""
    if not vbe:
        bags = [batch_bags(r, step) for r in range(world)]
        return kjt([bags[rank]], weighted), kjt(bags, weighted)
    parts = [vbe_batch(r, step) for r in range(world)]
    expanded = [{f: [u[f][i] for i in inv[f]] for f in u} for u, inv in parts]
    return vbe_kjt(*parts[rank], weighted), kjt(expanded, weighted)


def flat(
    bags_per_rank: list[dict[str, list[list[int]]]], weighted: bool
) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Keys, ids, lengths and weights (a function of id and bag length) of every bag."""
    keys = ["f0", "f1", "f2", "f3"]
    lengths, values = [], []
    for f in keys:
        for bags in bags_per_rank:
            for bag in bags[f]:
                lengths.append(len(bag))
                values.extend(bag)
    v = torch.tensor(values, dtype=torch.int64)
    w = None
    if weighted:
        w = ((v * 7 + torch.tensor(lengths).repeat_interleave(torch.tensor(lengths))) % 5 + 1) / 4
    return keys, v, torch.tensor(lengths), w


def kjt(bags_per_rank: list[dict[str, list[list[int]]]], weighted: bool) -> KeyedJaggedTensor:
    keys, v, lengths, w = flat(bags_per_rank, weighted)
    return KeyedJaggedTensor(keys=keys, values=v, lengths=lengths, weights=w)
