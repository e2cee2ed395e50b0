"""Tests of Backend.AUTO by measurement (`recopt.kernels.autotune`): the choice, the disk cache,
the pins, the explicit backend, the rank-0 decision shared by every rank, and param_groups.

Timings are injected (fake samplers); nothing real is timed in an assertion.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
import torch

from recopt.kernels import autotune
from recopt.kernels.autotune import (
    AutoConfig,
    AutoResolver,
    BackendDecision,
    Sampler,
    ShapeClass,
    auto_config_from_environment,
    configure_auto,
)
from recopt.kernels.config import Backend, FusedOptimizerConfig, TableSpec
from recopt.kernels.factory import choose_backend, resolve_backend
from recopt.testing import run_on_ranks

CPU = torch.device("cpu")
RWA = FusedOptimizerConfig(name="row_wise_adagrad")
TABLES = [TableSpec(name="t0", num_embeddings=1000, embedding_dim=16)]
BOTH = [Backend.FBGEMM, Backend.RECOPT]
SHAPE = ShapeClass.of(TABLES, RWA, CPU)


class FakeTimings:
    """A sampler factory whose candidates 'take' fixed seconds; counts the measurements."""

    def __init__(self, seconds: Mapping[Backend, float]) -> None:
        self.seconds = dict(seconds)
        self.calls = 0

    def __call__(
        self,
        shape: ShapeClass,
        optimizer: FusedOptimizerConfig,
        candidates: Sequence[Backend],
        config: AutoConfig,
    ) -> dict[Backend, Sampler]:
        self.calls += 1
        return {b: (lambda s=self.seconds[b]: s) for b in candidates}


@pytest.fixture(autouse=True)
def _restore_default_resolver() -> Iterator[None]:
    previous = configure_auto(None)
    yield
    configure_auto(previous)


def test_measurement_picks_the_faster_candidate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for fast, slow in ((Backend.FBGEMM, Backend.RECOPT), (Backend.RECOPT, Backend.FBGEMM)):
        fake = FakeTimings({fast: 0.001, slow: 0.004})
        resolver = AutoResolver(AutoConfig(cache_dir=tmp_path / fast.value), fake, machine="m")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="recopt.kernels.autotune"):
            decision = resolver.resolve(SHAPE, RWA, BOTH)
            assert resolver.resolve(SHAPE, RWA, BOTH) is decision  # remembered: logged once
        (message,) = [r.getMessage() for r in caplog.records]
        assert f"{SHAPE.key()}: {fast.value}" in message and "fbgemm " in message
        assert decision.backend == fast
        assert decision.reason == "measured"
        assert decision.seconds == {fast.value: 0.001, slow.value: 0.004}
        assert fake.calls == 1


def test_measure_takes_the_median_of_interleaved_samples() -> None:
    order: list[str] = []
    samples = {Backend.FBGEMM: iter([5.0, 1.0, 2.0]), Backend.RECOPT: iter([3.0, 3.0, 9.0])}

    def sampler(backend: Backend) -> Sampler:
        def sample() -> float:
            order.append(backend.value)
            return next(samples[backend])

        return sample

    medians = autotune.measure({b: sampler(b) for b in samples}, repeats=3)
    assert medians == {Backend.FBGEMM: 2.0, Backend.RECOPT: 3.0}
    assert order == ["fbgemm", "recopt"] * 3
    # A clear gap (SEPARATION) after MIN_REPEATS rounds ends the measurement early.
    order.clear()
    samples = {Backend.FBGEMM: iter([9.0, 8.0, 9.5] * 3), Backend.RECOPT: iter([1.0, 2.0, 1.5] * 3)}
    medians = autotune.measure({b: sampler(b) for b in samples}, repeats=9)
    assert medians == {Backend.FBGEMM: 9.0, Backend.RECOPT: 1.5}
    assert order == ["fbgemm", "recopt"] * autotune.MIN_REPEATS


def test_cache_hit_does_not_measure_again(tmp_path: Path) -> None:
    first = FakeTimings({Backend.FBGEMM: 0.004, Backend.RECOPT: 0.001})
    AutoResolver(AutoConfig(cache_dir=tmp_path), first, machine="m").resolve(SHAPE, RWA, BOTH)
    # A new process (new resolver) with timings that would now pick fbgemm: the cache answers.
    second = FakeTimings({Backend.FBGEMM: 0.001, Backend.RECOPT: 0.004})
    resolver = AutoResolver(AutoConfig(cache_dir=tmp_path), second, machine="m")
    decision = resolver.resolve(SHAPE, RWA, BOTH)
    assert (decision.backend, decision.reason, second.calls) == (Backend.RECOPT, "cached", 0)
    assert decision.seconds == {"fbgemm": 0.004, "recopt": 0.001}
    # Another machine key, or another shape class, is measured.
    other = AutoResolver(AutoConfig(cache_dir=tmp_path), second, machine="other")
    assert other.resolve(SHAPE, RWA, BOTH).backend == Backend.FBGEMM
    wide = ShapeClass.of([TableSpec(name="w", num_embeddings=10, embedding_dim=64)], RWA, CPU)
    assert resolver.resolve(wide, RWA, BOTH).reason == "measured"
    assert second.calls == 2
    entries = json.loads((tmp_path / "backend_choices.json").read_text())["machines"]
    assert sorted(entries) == ["m", "other"] and sorted(entries["m"]) == sorted(
        [SHAPE.key(), wide.key()]
    )


@pytest.mark.parametrize(
    "content", ["{not json", json.dumps({"version": 1, "machines": {"m": {"x": 3}}}), "[]"]
)
def test_corrupt_cache_is_ignored_with_a_warning(tmp_path: Path, content: str) -> None:
    path = tmp_path / "backend_choices.json"
    if "x" in content:  # a well-formed file whose entry for this shape is garbage
        content = json.dumps({"version": 1, "machines": {"m": {SHAPE.key(): {"backend": "?"}}}})
    path.write_text(content)
    fake = FakeTimings({Backend.FBGEMM: 0.001, Backend.RECOPT: 0.002})
    resolver = AutoResolver(AutoConfig(cache_dir=tmp_path), fake, machine="m")
    with pytest.warns(RuntimeWarning, match="ignoring"):
        decision = resolver.resolve(SHAPE, RWA, BOTH)
    assert (decision.backend, decision.reason, fake.calls) == (Backend.FBGEMM, "measured", 1)
    # The file was rewritten with the new measurement.
    stored = json.loads(path.read_text())["machines"]["m"][SHAPE.key()]
    assert stored["backend"] == "fbgemm"


def test_environment_and_config_pin_win_over_measurement() -> None:
    config = auto_config_from_environment({"RECOPT_BACKEND": "fbgemm", "XDG_CACHE_HOME": "/x"})
    assert config.pin == Backend.FBGEMM and config.cache_dir == Path("/x/recopt")
    assert auto_config_from_environment({"RECOPT_CACHE_DIR": "/c"}).cache_dir == Path("/c")
    assert auto_config_from_environment({}).pin == Backend.AUTO
    with pytest.raises(ValueError, match="RECOPT_BACKEND='fast'.*use one of"):
        auto_config_from_environment({"RECOPT_BACKEND": "fast"})
    fake = FakeTimings({Backend.FBGEMM: 0.004, Backend.RECOPT: 0.001})
    pinned = AutoResolver(config, fake, machine="m")
    assert pinned.resolve(SHAPE, RWA, BOTH).backend == Backend.FBGEMM
    # A pin fbgemm cannot honour (it cannot run the tables) leaves recopt.
    assert pinned.resolve(SHAPE, RWA, [Backend.RECOPT]).backend == Backend.RECOPT
    recopt_pin = AutoResolver(AutoConfig(pin=Backend.RECOPT), FakeTimings({}), machine="m")
    assert recopt_pin.resolve(SHAPE, RWA, BOTH).reason == "pinned to recopt"
    assert fake.calls == 0
    with pytest.raises(ValueError, match="AutoConfig.repeats must be >= 1"):
        AutoConfig(repeats=0)


def test_explicit_backend_wins_and_auto_goes_through_the_resolver() -> None:
    fake = FakeTimings({Backend.FBGEMM: 0.001, Backend.RECOPT: 0.004})
    configure_auto(AutoResolver(AutoConfig(pin=Backend.AUTO), fake, machine="m"))
    explicit = FusedOptimizerConfig(name="row_wise_adagrad", backend=Backend.RECOPT)
    assert resolve_backend(TABLES, explicit, CPU) == BackendDecision(
        backend=Backend.RECOPT, reason="explicit"
    )
    assert choose_backend(TABLES, RWA, CPU) == Backend.FBGEMM
    configure_auto(AutoConfig(pin=Backend.RECOPT))
    forced = FusedOptimizerConfig(name="row_wise_adagrad", backend=Backend.FBGEMM)
    assert choose_backend(TABLES, forced, CPU) == Backend.FBGEMM
    assert choose_backend(TABLES, RWA, CPU) == Backend.RECOPT
    assert fake.calls == 1


def test_param_groups_show_the_decision() -> None:
    from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection

    fake = FakeTimings({Backend.FBGEMM: 0.003, Backend.RECOPT: 0.001})
    configure_auto(AutoResolver(AutoConfig(), fake, machine="m"))
    tables = [
        EmbeddingBagConfig(name="t", num_embeddings=50, embedding_dim=8, feature_names=("f",))
    ]
    adam = FusedOptimizerConfig(name="adam")
    module = FusedEmbeddingBagCollection(tables, RWA, table_optimizers={})
    (group,) = module.fused_optimizer.param_groups
    assert (group["backend"], group["backend_reason"]) == ("recopt", "measured")
    assert group["backend_seconds"] == {"fbgemm": 0.003, "recopt": 0.001}
    (group,) = FusedEmbeddingBagCollection(tables, adam).fused_optimizer.param_groups
    assert (group["backend"], group["backend_reason"]) == ("recopt", "only candidate")
    forced = FusedOptimizerConfig(name="sgd", backend=Backend.FBGEMM)
    (group,) = FusedEmbeddingBagCollection(tables, forced).fused_optimizer.param_groups
    assert (group["backend"], group["backend_reason"]) == ("fbgemm", "explicit")


def _ranks_agree(rank: int, world_size: int) -> list[str]:
    from recopt.modules import EmbeddingBagConfig
    from recopt.sharding import (
        ShardedEmbeddingBagCollection,
        construct_module_sharding_plan,
        data_parallel,
        table_wise,
    )
    from recopt.sharding.backend_decisions import share_backend_decisions

    # Each rank's own measurement disagrees: rank 0 finds fbgemm faster, rank 1 recopt.
    fast = Backend.FBGEMM if rank == 0 else Backend.RECOPT
    slow = Backend.RECOPT if rank == 0 else Backend.FBGEMM
    configure_auto(AutoResolver(AutoConfig(), FakeTimings({fast: 0.001, slow: 0.002}), "m"))
    adopted = share_backend_decisions([(TABLES, [0], RWA)], CPU, None)
    assert adopted[SHAPE.key()].reason == "shared by rank 0 (measured)"
    tables = [
        EmbeddingBagConfig(name="a", num_embeddings=64, embedding_dim=8, feature_names=("fa",)),
        EmbeddingBagConfig(name="b", num_embeddings=32, embedding_dim=8, feature_names=("fb",)),
    ]
    requests = {"a": data_parallel(), "b": table_wise(rank=1)}
    plan = construct_module_sharding_plan(tables, requests, world_size)  # type: ignore[arg-type]
    module = ShardedEmbeddingBagCollection(tables, plan, RWA)
    names = [type(k).__name__ for k in module.kernels()]
    return [choose_backend(TABLES, RWA, CPU).value, *names]


@pytest.mark.multiprocess
def test_ranks_agree_on_rank_zeros_decision() -> None:
    results = run_on_ranks(_ranks_agree, 2, timeout_s=120)
    assert results[0] == ["fbgemm", "FbgemmTableBatchedEmbedding"]
    assert results[1] == ["fbgemm", "FbgemmTableBatchedEmbedding", "FbgemmTableBatchedEmbedding"]
