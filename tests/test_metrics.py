"""recopt.metrics against hand computations, alone and summed over two gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch

from recopt.metrics import NormalizedEntropy, click_metrics
from recopt.testing import run_on_ranks

PREDS = torch.tensor([0.9, 0.2, 0.65, 0.4, 0.05, 0.7, 0.3, 0.8])
LABELS = torch.tensor([1, 0, 0, 1, 0, 1, 0, 1])


def hand_ne(preds: list[float], labels: list[int]) -> float:
    """NE = mean log loss / entropy of the click rate, written out term by term."""
    n = len(preds)
    log_loss = (
        -sum(
            y * math.log(p) + (1 - y) * math.log(1 - p) for p, y in zip(preds, labels, strict=True)
        )
        / n
    )
    ctr = sum(labels) / n
    entropy = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))
    return log_loss / entropy


def hand_auc(preds: list[float], labels: list[int]) -> float:
    """Share of (positive, negative) pairs ranked correctly, ties counting one half."""
    pos = [p for p, y in zip(preds, labels, strict=True) if y == 1]
    neg = [p for p, y in zip(preds, labels, strict=True) if y == 0]
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in pos for b in neg)
    return wins / (len(pos) * len(neg))


def test_normalized_entropy_matches_the_formula_across_batches() -> None:
    metric = NormalizedEntropy()
    metric.update(PREDS[:3], LABELS[:3])
    metric.update(PREDS[3:], LABELS[3:])
    expected = hand_ne(PREDS.tolist(), LABELS.tolist())
    assert metric.compute().item() == pytest.approx(expected, rel=1e-9)


def test_predicting_the_click_rate_has_ne_one_and_a_better_model_less() -> None:
    labels = torch.tensor([1, 0, 0, 0] * 5)
    constant = NormalizedEntropy()
    constant.update(torch.full((20,), 0.25), labels)
    assert constant.compute().item() == pytest.approx(1.0, rel=1e-9)
    informed = NormalizedEntropy()
    informed.update(torch.where(labels == 1, 0.7, 0.1), labels)
    assert informed.compute().item() < 0.6


@pytest.mark.filterwarnings("ignore:The ``compute`` method:UserWarning")
def test_ne_is_nan_without_samples_or_with_one_class_and_rejects_shape_mismatch() -> None:
    assert math.isnan(NormalizedEntropy().compute().item())
    one_class = NormalizedEntropy()
    one_class.update(torch.tensor([0.3, 0.6]), torch.tensor([1, 1]))
    assert math.isnan(one_class.compute().item())
    with pytest.raises(ValueError, match="shape"):
        NormalizedEntropy().update(torch.tensor([0.5, 0.5]), torch.tensor([1]))


def test_ne_survives_confident_mistakes() -> None:
    metric = NormalizedEntropy()
    metric.update(torch.tensor([0.0, 1.0, 0.5]), torch.tensor([1, 0, 1]))
    assert math.isfinite(metric.compute().item()) and metric.compute().item() > 1.0


def test_click_metrics_match_hand_computations() -> None:
    metrics = click_metrics()
    metrics.update(PREDS[:5], LABELS[:5])
    metrics.update(PREDS[5:], LABELS[5:])
    result = {k: v.item() for k, v in metrics.compute().items()}
    preds, labels = PREDS.tolist(), LABELS.tolist()
    accuracy = sum((p > 0.5) == bool(y) for p, y in zip(preds, labels, strict=True)) / len(preds)
    assert result["auc"] == pytest.approx(hand_auc(preds, labels), abs=1e-6)
    assert result["accuracy"] == pytest.approx(accuracy)
    assert result["ne"] == pytest.approx(hand_ne(preds, labels), rel=1e-6)


def test_auroc_counts_ties_as_half() -> None:
    preds, labels = [0.5, 0.5, 0.9, 0.1], [1, 0, 1, 0]
    metrics = click_metrics()
    metrics.update(torch.tensor(preds), torch.tensor(labels))
    assert metrics.compute()["auc"].item() == pytest.approx(hand_auc(preds, labels))


def _two_rank_metrics(rank: int, world_size: int) -> dict[str, float]:
    metrics = click_metrics()
    half = slice(0, 3) if rank == 0 else slice(3, None)  # unequal shares on purpose
    metrics.update(PREDS[half], LABELS[half])
    return {k: v.item() for k, v in metrics.compute().items()}


@pytest.mark.multiprocess
def test_metrics_are_synchronised_across_ranks() -> None:
    results = run_on_ranks(_two_rank_metrics, 2, timeout_s=90)
    preds, labels = PREDS.tolist(), LABELS.tolist()
    for result in results:  # every rank sees the metrics of the union
        assert result["auc"] == pytest.approx(hand_auc(preds, labels), abs=1e-6)
        assert result["ne"] == pytest.approx(hand_ne(preds, labels), rel=1e-6)
