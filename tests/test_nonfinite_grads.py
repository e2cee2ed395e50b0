"""A NaN/inf gradient of the pooled output updates no fused table: skipped, counted, warned once."""

from __future__ import annotations

import warnings

import pytest
import torch
from fused_snapshots import assert_bit_identical, snapshot

from recopt.kernels import FusedOptimizerConfig
from recopt.kernels.config import Backend
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
from recopt.sparse import KeyedJaggedTensor

TABLES = [
    EmbeddingBagConfig(name="t0", num_embeddings=10, embedding_dim=8, feature_names=("f0",)),
    EmbeddingBagConfig(name="t1", num_embeddings=6, embedding_dim=4, feature_names=("f1",)),
]
CASES = [
    (Backend.FBGEMM, "sgd"),
    (Backend.FBGEMM, "row_wise_adagrad"),
    (Backend.RECOPT, "adam"),  # a step counter that must not advance
    (Backend.RECOPT, "row_wise_adagrad"),
]


def _features(weighted: bool = False, seed: int = 0) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.cat(
        [torch.randint(0, 10, (4,), generator=gen), torch.randint(0, 6, (3,), generator=gen)]
    )
    weights = torch.rand(7, generator=gen) + 0.5 if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(
        ["f0", "f1"], ids, torch.tensor([2, 2, 1, 2]), weights=weights
    )


def _build(
    backend: Backend, name: str, weighted: bool = False, **kwargs: object
) -> FusedEmbeddingBagCollection:
    torch.manual_seed(0)
    try:
        return FusedEmbeddingBagCollection(
            TABLES,
            optimizer=FusedOptimizerConfig(name=name, lr=0.1, backend=backend),
            is_weighted=weighted,
            **kwargs,  # type: ignore[arg-type]
        )
    except ValueError as err:  # fbgemm not usable here
        pytest.skip(str(err))


def _step(ebc: FusedEmbeddingBagCollection, seed: int, scale: float = 1.0) -> None:
    out = ebc(_features(seed=seed)).values()
    (out * torch.arange(out.numel()).view_as(out) * scale).sum().backward()


@pytest.mark.parametrize(("backend", "name"), CASES)
def test_non_finite_gradient_skips_the_fused_update(backend: Backend, name: str) -> None:
    ebc = _build(backend, name)
    reference = _build(backend, name)
    _step(ebc, seed=1)
    _step(reference, seed=1)
    before = snapshot(ebc)
    with pytest.warns(RuntimeWarning, match="NaN or inf.*skipped"):
        _step(ebc, seed=2, scale=float("nan"))
    assert_bit_identical(snapshot(ebc), before)
    assert ebc.skipped_nonfinite_steps == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        _step(ebc, seed=3, scale=float("inf"))
    assert_bit_identical(snapshot(ebc), before)
    assert ebc.skipped_nonfinite_steps == 2
    # The next finite step updates as a module that never saw the bad steps would.
    _step(ebc, seed=4)
    _step(reference, seed=4)
    assert_bit_identical(snapshot(ebc), snapshot(reference))
    assert reference.skipped_nonfinite_steps == 0
    assert not torch.equal(
        snapshot(ebc)["embedding_bags.t0.weight"], before["embedding_bags.t0.weight"]
    )


@pytest.mark.parametrize(("backend", "name"), CASES)
def test_without_skip_nonfinite_the_nan_reaches_the_tables(backend: Backend, name: str) -> None:
    # The defect the guard fixes (issue 18), still reachable by choice.
    ebc = _build(backend, name, skip_nonfinite=False)
    _step(ebc, seed=2, scale=float("nan"))
    assert not torch.isfinite(ebc.state_dict()["embedding_bags.t0.weight"]).all()


def test_nan_in_one_kernels_columns_skips_every_kernel() -> None:
    torch.manual_seed(0)
    ebc = FusedEmbeddingBagCollection(
        TABLES,
        optimizer=FusedOptimizerConfig(name="adam", lr=0.1),
        table_optimizers={"t1": FusedOptimizerConfig(name="sgd", lr=0.1)},
    )
    assert len(ebc.kernels()) == 2
    before = snapshot(ebc)
    out = ebc(_features()).values()
    nan_in_t1 = torch.zeros_like(out)
    nan_in_t1[0, -1] = float("nan")
    with pytest.warns(RuntimeWarning):
        (out * nan_in_t1 + out).sum().backward()
    assert_bit_identical(snapshot(ebc), before)
    assert ebc.skipped_nonfinite_steps == 1


@pytest.mark.parametrize("backend", [Backend.RECOPT, Backend.FBGEMM])
def test_per_id_weight_gradient_and_update_equal_the_unguarded_module(backend: Backend) -> None:
    results = []
    for skip in (True, False):
        ebc = _build(backend, "sgd", weighted=True, skip_nonfinite=skip)
        features = _features(weighted=True, seed=5)
        weights = features.weights().clone().requires_grad_(True)
        features = KeyedJaggedTensor.from_lengths_sync(
            features.keys(), features.values(), features.lengths(), weights=weights
        )
        out = ebc(features).values()
        (out * torch.arange(out.numel()).view_as(out)).sum().backward()
        assert weights.grad is not None
        results.append((out.detach(), weights.grad.clone(), snapshot(ebc)))
    guarded, plain = results
    assert torch.equal(guarded[0], plain[0])
    assert torch.equal(guarded[1], plain[1])
    assert_bit_identical(guarded[2], plain[2])


def test_no_grad_forward_needs_no_guard() -> None:
    ebc = _build(Backend.RECOPT, "adam")
    with torch.no_grad():
        out = ebc(_features()).values()
    assert out.grad_fn is None
    before = snapshot(ebc)
    _step(ebc, seed=1)  # grad mode again: trains
    assert not torch.equal(
        snapshot(ebc)["embedding_bags.t0.weight"], before["embedding_bags.t0.weight"]
    )


def test_kernels_with_a_grad_hook_are_not_gated() -> None:
    # A grad_hook may run collectives with other replicas (fault tolerance): skipping here
    # alone would leave them waiting, so the kernel still runs (docs/design.md).
    ebc = _build(Backend.RECOPT, "sgd")
    calls: list[int] = []

    def hook(t: int, rows: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        calls.append(t)
        return grad

    ebc.kernels()[0].grad_hook = hook
    _step(ebc, seed=2, scale=float("nan"))
    assert sorted(set(calls)) == [0, 1]
    assert ebc.skipped_nonfinite_steps == 0


STRIDED_GRADS = {
    "contiguous": lambda g: g,
    "broadcast scalar (loss = out.sum())": lambda g: g[:1, :1].expand(6, 8).reshape(-1),
    "repeated block (row-wise)": lambda g: g.unsqueeze(0).expand(3, 6, 8),
    "transposed": lambda g: g.t(),
    "strided slice": lambda g: g[:, ::2],
}


@pytest.mark.parametrize("layout", sorted(STRIDED_GRADS))
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_finite_flag_reads_strided_gradients_in_place(
    layout: str, bad: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same answer as isfinite().all() on every layout; broadcast and permuted gradients are
    reduced without the contiguous copy (a fresh, page-faulting buffer each step)."""
    from recopt.modules.nonfinite import finite_flag

    g = torch.randn(6, 8)
    if bad is not None:
        g[0, 0] = bad
    grad = STRIDED_GRADS[layout](g)
    seen: list[bool] = []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t: seen.append(t.is_contiguous()) or aminmax(t))
    assert bool(finite_flag([grad, None], grad.device)) == bool(torch.isfinite(grad).all())
    assert seen == [layout != "strided slice"]  # only a layout with gaps is still copied
