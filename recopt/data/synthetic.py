"""A synthetic click log with a planted signal: ids follow a power law, labels a hidden model.

Every batch is a pure function of (seed, model_seed, split, global batch index), generated
with vectorised torch ops, so ranks split the stream without talking (each step, rank r of N
takes global batch G + r, where G counts the global batches all ranks consumed before it) and a
resumed run, with the same or another number of ranks, continues at global batch G: nothing
repeated or skipped.

``id_space = "drifting"`` draws ids from an unbounded space instead: a power law over 2**40
raw ids whose popular set moves with the global batch index (the drift clock), for id-mapped
tables (docs/id_map.md); tables without an id map get those raw ids modulo their rows.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from recopt.data.batch import Batch
from recopt.sparse import KeyedJaggedTensor

# Per-split salts keep the train and validation streams disjoint for one seed.
_SPLIT_SALT = {"train": 0x5EED, "val": 0xE7A1}
_GOLDEN = 2654435761  # Knuth's multiplicative hash constant (< 2**32, so int64 never overflows)
ID_SPACES = ("fixed", "drifting")
RAW_ID_BITS = 40  # the drifting id space: raw ids in [0, 2**40)
_MASK40 = (1 << RAW_ID_BITS) - 1
# Odd multipliers below 2**23: x * m stays below 2**63 for x < 2**40, and is a bijection mod 2**40.
_SCRAMBLE = (0x5BD1E9, 0x6F4F2B)


@dataclass(frozen=True, kw_only=True, slots=True)
class SyntheticConfig:
    """How the synthetic click log looks.

    Args:
        num_dense: dense columns per sample.
        min_ids_per_bag: fewest ids in one bag (0 allows empty bags).
        max_ids_per_bag: most ids in one bag; each bag's count is uniform in [min, max].
        zipf_exponent: exponent a of the id distribution P(id = k) ~ (k + 1) ** -a.
        signal: scale of the hidden model's logit (0 makes labels pure noise).
        signal_features: how many sparse features the hidden model reads (the first ones).
        ctr_bias: bias of the hidden logit; negative values make clicks rarer.
        seed: seeds the stream (which samples are drawn); streams with different seeds
            are different samples of the same hidden model.
        model_seed: seeds the hidden model (the planted weights and id effects the labels
            follow); keep it equal across runs (or fault-tolerant replica groups) that
            should learn the same thing.
        id_space: ``"fixed"``: feature f's ids are ranks of the power law in ``[0, rows_f)``,
            rank 0 the most popular, forever. ``"drifting"``: the power law runs over 2**40
            ranks, and rank k at drift clock t is item ``floor(drift_rate * t) - k``, whose
            raw id is a fixed scramble of (item, feature) in ``[0, 2**40)``: every
            ``1 / drift_rate`` global batches a new item becomes the most popular and the
            others move one rank down, towards the tail. Labels follow each raw id's own
            planted effect; features without raw ids get ``raw % rows_f`` (collisions).
        drift_rate: ``"drifting"`` only: new items per global batch (> 0).
    """

    num_dense: int = 13
    min_ids_per_bag: int = 1
    max_ids_per_bag: int = 1
    zipf_exponent: float = 1.1
    signal: float = 1.0
    signal_features: int = 8
    ctr_bias: float = -1.0
    seed: int = 0
    model_seed: int = 0
    id_space: str = "fixed"
    drift_rate: float = 1.0

    def __post_init__(self) -> None:
        if self.id_space not in ID_SPACES:
            raise ValueError(
                f"data.synthetic.id_space {self.id_space!r} is unknown; use one of "
                f"{list(ID_SPACES)}"
            )
        if not (self.drift_rate > 0 and math.isfinite(self.drift_rate)):
            raise ValueError(
                f"data.synthetic.drift_rate must be finite and > 0 (new popular ids per "
                f"global batch), got {self.drift_rate}; e.g. 1.0"
            )
        if self.num_dense < 1:
            raise ValueError(f"data.num_dense must be >= 1, got {self.num_dense}")
        if not 0 <= self.min_ids_per_bag <= self.max_ids_per_bag or self.max_ids_per_bag < 1:
            raise ValueError(
                f"data.min_ids_per_bag ({self.min_ids_per_bag}) and data.max_ids_per_bag "
                f"({self.max_ids_per_bag}) need 0 <= min <= max and max >= 1"
            )
        for name, value, ok, rule in (
            ("zipf_exponent", self.zipf_exponent, self.zipf_exponent > 0, " and > 0 (e.g. 1.1)"),
            ("signal", self.signal, self.signal >= 0, " and >= 0 (0: labels are pure noise)"),
            ("ctr_bias", self.ctr_bias, True, " (e.g. -1.0)"),
        ):
            if not (ok and math.isfinite(value)):
                raise ValueError(f"data.synthetic.{name} must be finite{rule}, got {value}")


def _hash_unit(ids: torch.Tensor, salt: int) -> torch.Tensor:
    """A fixed pseudo-random value in [-1, 1] per (id, salt): the hidden model's id effects."""
    mixed = ((ids + salt) & 0xFFFFFFF) * _GOLDEN
    mixed = (mixed ^ (mixed >> 15)) & 0xFFFF
    return mixed.to(torch.float32) * (2.0 / 0xFFFF) - 1.0


def _power_law(uniform: torch.Tensor, num_ids: torch.Tensor, exponent: float) -> torch.Tensor:
    """Inverse-CDF sample of a continuous power law on [1, N+1), floored to ids in [0, N)."""
    if abs(exponent - 1.0) < 1e-9:
        x = torch.pow(num_ids + 1.0, uniform)
    else:
        power = 1.0 - exponent
        x = torch.pow((torch.pow(num_ids + 1.0, power) - 1.0) * uniform + 1.0, 1.0 / power)
    ids = x.floor().to(torch.int64) - 1
    return torch.minimum(ids.clamp_(min=0), num_ids.to(torch.int64) - 1)


def drifting_raw_ids(
    ranks: torch.Tensor, features: torch.Tensor, clock: int, drift_rate: float, model_seed: int
) -> torch.Tensor:
    """Raw ids in ``[0, 2**40)`` of power-law ``ranks`` at drift clock ``clock``.

    Rank k is item ``floor(drift_rate * clock) - k``; the raw id is a bijective scramble of
    the item (mod 2**40) salted by feature and ``model_seed``, so an item keeps its raw id
    while it moves down the ranks, and distinct items of a feature never share one.
    """
    newest = math.floor(drift_rate * clock)
    salt = (features * 0x9E3779B1 + model_seed * 0x85EBCA77 + 0x2545F491) & _MASK40
    x = (newest - ranks + salt) & _MASK40
    for multiplier, shift in zip(_SCRAMBLE, (20, 17), strict=True):
        x = (x * multiplier) & _MASK40
        x = x ^ (x >> shift)
    return x


class SyntheticClickLog:
    """Iterator of synthetic batches for one rank.

    Example: ``SyntheticClickLog([("c0", 1000), ("c1", 50)], SyntheticConfig(), 256)``
    yields ``Batch(dense [256, 13], sparse KJT keys ["c0", "c1"], labels [256], position)``
    forever; ``num_batches=10`` stops after ten.

    Args:
        features: (feature name, number of ids) per sparse feature, in KJT key order.
        config: the distribution and the hidden model.
        batch_size: samples per batch on this rank.
        rank: this rank.
        world_size: number of ranks sharing the stream.
        split: ``train`` or ``val`` (disjoint streams).
        num_batches: batches this rank yields, or None for an endless stream.
        raw_features: under ``id_space = "drifting"``, the features that get raw ids
            (those of id-mapped tables); the others get ``raw % rows``.
        drift_clock: under ``"drifting"``, the drift clock of every batch (validation at a
            training position: the global batches trained so far); None: each batch's own
            global index.

    Raises:
        ValueError: on an empty feature list, a non-positive size, or a bad rank or split.
    """

    def __init__(
        self,
        features: Sequence[tuple[str, int]],
        config: SyntheticConfig,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        split: str = "train",
        num_batches: int | None = None,
        raw_features: Collection[str] = (),
        drift_clock: int | None = None,
    ) -> None:
        if not features:
            raise ValueError("SyntheticClickLog needs at least one sparse feature")
        for name, num_ids in features:
            if num_ids < 1:
                raise ValueError(f"feature {name!r}: number of ids must be >= 1, got {num_ids}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if split not in _SPLIT_SALT:
            raise ValueError(f"split {split!r} is unknown; use one of {sorted(_SPLIT_SALT)}")
        self.keys = [name for name, _ in features]
        self.config = config
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.num_batches = num_batches
        self._split_salt = _SPLIT_SALT[split]
        self._num_ids = torch.tensor([n for _, n in features], dtype=torch.float64)
        unknown = sorted(set(raw_features) - set(self.keys))
        if unknown:
            raise ValueError(f"raw_features {unknown} are not features of this log: {self.keys}")
        self._raw = torch.tensor([name in raw_features for name in self.keys])
        self.drift_clock = drift_clock
        self._position = 0
        self._global_batches = 0  # consumed by all ranks together: independent of world_size
        self._init_hidden_model()

    def _init_hidden_model(self) -> None:
        """Draws the hidden model's weights from ``model_seed`` alone (the same on every rank
        and for every stream ``seed``)."""
        gen = torch.Generator().manual_seed(self.config.model_seed)
        num_signal = min(self.config.signal_features, len(self.keys))
        self._dense_weights = torch.zeros(self.config.num_dense)
        num_dense_signal = min(4, self.config.num_dense)
        self._dense_weights[:num_dense_signal] = torch.randn(num_dense_signal, generator=gen) * 0.6
        self._feature_weights = torch.zeros(len(self.keys))
        self._feature_weights[:num_signal] = 0.8 + 0.4 * torch.rand(num_signal, generator=gen)

    def __iter__(self) -> SyntheticClickLog:
        return self

    def __next__(self) -> Batch:
        if self.num_batches is not None and self._position >= self.num_batches:
            raise StopIteration
        global_index = self._global_batches + self.rank
        self._position += 1
        self._global_batches += self.world_size
        dense, sparse, labels = self.generate(global_index)
        return Batch(dense, sparse, labels, self._position)

    def state_dict(self) -> dict[str, Any]:
        """Returns the position: batches this rank yielded, global batches all ranks consumed."""
        return {
            "position": self._position,
            "global_batches": self._global_batches,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues after the global batches ``state`` counts, with any number of ranks.

        Raises:
            ValueError: if the state's per-rank batch size differs (a global batch is
                ``batch_size`` samples, so the stream would not continue where it stopped).
        """
        saved_batch = int(state.get("batch_size", self.batch_size))
        if saved_batch != self.batch_size:
            raise ValueError(
                f"data state was saved with data.batch_size {saved_batch}, this run has "
                f"{self.batch_size}; keep data.batch_size to resume the synthetic stream"
            )
        self._position = int(state["position"])
        # States from before global_batches existed: every rank had taken `position` steps.
        default = self._position * int(state.get("world_size", self.world_size))
        self._global_batches = int(state.get("global_batches", default))

    def generate(self, global_index: int) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
        """Batch number ``global_index`` of the whole stream (all ranks' batches interleaved).

        Returns:
            (dense [B, num_dense], sparse KJT, labels [B]).
        """
        cfg = self.config
        num_features, batch = len(self.keys), self.batch_size
        gen = torch.Generator().manual_seed(
            (cfg.seed * 1_000_003 + self._split_salt) * 1_000_000_007 + global_index
        )
        latent = torch.randn(batch, cfg.num_dense, generator=gen)
        # Criteo-like: non-negative, skewed columns (what log(1 + count) looks like).
        dense = torch.nn.functional.softplus(1.5 * latent)
        lengths, length_per_key = self._lengths(gen, num_features * batch)
        num_ids = torch.repeat_interleave(self._num_ids, torch.tensor(length_per_key))
        uniform = torch.rand(num_ids.shape[0], generator=gen, dtype=torch.float64)
        if cfg.id_space == "drifting":
            raw = self._drifting(uniform, length_per_key, global_index)
            is_raw = torch.repeat_interleave(
                self._raw, torch.tensor(length_per_key), output_size=uniform.numel()
            )
            values = torch.where(is_raw, raw, raw % num_ids.to(torch.int64))
        else:
            raw = values = _power_law(uniform, num_ids, cfg.zipf_exponent)
        # The hidden model reads the raw ids: folding them modulo a table loses information.
        bag_effect_F_B = self._bag_effects(raw, lengths, length_per_key).view(num_features, batch)
        logit = cfg.ctr_bias + cfg.signal * self._hidden_logit(latent, bag_effect_F_B)
        labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
        sparse = KeyedJaggedTensor.from_lengths_sync(self.keys, values, lengths)
        return dense, sparse, labels

    def _drifting(
        self, uniform: torch.Tensor, length_per_key: list[int], global_index: int
    ) -> torch.Tensor:
        """Raw ids of the drifting space for uniforms in key order (`drifting_raw_ids`)."""
        space = torch.full_like(uniform, float(2**RAW_ID_BITS))
        ranks = _power_law(uniform, space, self.config.zipf_exponent)
        features = torch.repeat_interleave(
            torch.arange(len(self.keys)), torch.tensor(length_per_key), output_size=uniform.numel()
        )
        clock = global_index if self.drift_clock is None else self.drift_clock
        cfg = self.config
        return drifting_raw_ids(ranks, features, clock, cfg.drift_rate, cfg.model_seed)

    def _lengths(self, gen: torch.Generator, num_bags: int) -> tuple[torch.Tensor, list[int]]:
        cfg = self.config
        batch = self.batch_size
        if cfg.min_ids_per_bag == cfg.max_ids_per_bag:
            lengths = torch.full((num_bags,), cfg.max_ids_per_bag, dtype=torch.int64)
            return lengths, [cfg.max_ids_per_bag * batch] * len(self.keys)
        lengths = torch.randint(
            cfg.min_ids_per_bag, cfg.max_ids_per_bag + 1, (num_bags,), generator=gen
        )
        return lengths, lengths.view(len(self.keys), batch).sum(1).tolist()

    def _bag_effects(
        self, values: torch.Tensor, lengths: torch.Tensor, length_per_key: list[int]
    ) -> torch.Tensor:
        """Mean hidden id effect of each bag, [F*B] (0 for an empty bag)."""
        salts = torch.repeat_interleave(
            torch.arange(len(self.keys)) * 7919 + self.config.model_seed,
            torch.tensor(length_per_key),
        )
        effects = _hash_unit(values * 131 + salts, 17)
        if self.config.min_ids_per_bag == self.config.max_ids_per_bag:
            return effects.view(-1, self.config.max_ids_per_bag).mean(1)
        bag = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
        sums = torch.zeros(lengths.shape[0]).index_add_(0, bag, effects)
        return sums / lengths.clamp(min=1)

    def _hidden_logit(self, latent: torch.Tensor, bag_effect_F_B: torch.Tensor) -> torch.Tensor:
        """The planted model: linear in dense and id effects, plus two interactions."""
        logit = latent @ self._dense_weights
        logit = logit + self._feature_weights @ bag_effect_F_B
        if bag_effect_F_B.shape[0] >= 2:
            # A pairwise term (what the dot interaction is for) and a dense x sparse one.
            logit = logit + 1.2 * bag_effect_F_B[0] * bag_effect_F_B[1]
        logit = logit + 0.6 * torch.tanh(latent[:, 0]) * bag_effect_F_B[-1]
        return logit / math.sqrt(1.0 + 0.1 * len(self.keys))
