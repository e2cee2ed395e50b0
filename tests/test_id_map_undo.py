"""IdMap undo records (`record_undo`): a remap put back leaves the map bit-exactly as before."""

from __future__ import annotations

import pytest
import torch

from recopt.kernels import cpu_id_map
from recopt.modules import IdMapConfig
from recopt.modules.id_map import IdMap, Remapped

CONFIGS = {
    "lru": IdMapConfig(policy="lru"),
    "lfu_decay": IdMapConfig(policy="lfu", decay=0.8),
    "ttl": IdMapConfig(policy="lru", ttl_steps=3),
    "admission_overflow": IdMapConfig(
        policy="lfu", decay=0.9, ttl_steps=4, admit_after=3, candidate_slots=5
    ),
}


@pytest.fixture(autouse=True, params=["native", "torch"])
def remap_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test on both remap paths: native code (when it builds; lfu's rows in buckets by
    key, as large maps keep them) and torch ops."""
    if request.param == "native" and not cpu_id_map.available():
        pytest.skip("no C compiler: the native remap is not built")
    monkeypatch.setattr(IdMap, "native", request.param == "native")
    if request.param == "native":
        was = cpu_id_map.lfu_buckets_min_rows(0)
        request.addfinalizer(lambda: cpu_id_map.lfu_buckets_min_rows(was))


def _state(idmap: IdMap) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in idmap.state_dict().items()}


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


def _assert_same_result(a: Remapped, b: Remapped) -> None:
    assert torch.equal(a.rows_M, b.rows_M)
    assert torch.equal(a.fresh_rows, b.fresh_rows)
    assert torch.equal(a.fresh_ids, b.fresh_ids)
    assert a.stats == b.stats


def _batch(gen: torch.Generator, step: int) -> torch.Tensor:
    """Power-law ids over a space that drifts with the step (so rows expire and are evicted)."""
    size = int(torch.randint(0, 24, (1,), generator=gen))
    rank = (torch.rand(size, generator=gen) ** 2 * 30).long()
    return (rank + step) * 7919 - 50


@pytest.mark.parametrize("name", list(CONFIGS))
def test_undo_restores_every_buffer_and_the_next_step_is_unchanged(name: str) -> None:
    config = CONFIGS[name]
    undone, reference = IdMap(config, num_rows=12), IdMap(config, num_rows=12)
    gen = torch.Generator().manual_seed(3)
    evictions = 0
    for step in range(60):
        before, stats_before = _state(undone), undone.last_stats
        trial = undone.remap(_batch(gen, step), True, record_undo=True)
        assert trial.undo is not None
        evictions += trial.stats.evictions
        undone.apply_undo(trial.undo)
        _assert_same_state(before, _state(undone))
        assert undone.last_stats == stats_before
        batch = _batch(gen, step)
        _assert_same_result(undone.remap(batch, True), reference.remap(batch, True))
        _assert_same_state(_state(reference), _state(undone))
        assert undone.last_stats == reference.last_stats
    assert evictions > 0  # the undone steps evicted rows too


def test_undo_of_several_steps_in_reverse_order() -> None:
    config = CONFIGS["admission_overflow"]
    idmap = IdMap(config, num_rows=6)
    gen = torch.Generator().manual_seed(5)
    for step in range(10):
        idmap.remap(_batch(gen, step), True)
    before = _state(idmap)
    undos = [idmap.remap(_batch(gen, 10 + s), True, record_undo=True).undo for s in range(5)]
    for undo in reversed(undos):
        assert undo is not None
        idmap.apply_undo(undo)
    _assert_same_state(before, _state(idmap))


def test_no_undo_outside_training_or_unasked() -> None:
    idmap = IdMap(CONFIGS["lru"], num_rows=4)
    ids = torch.tensor([1, 2, 3])
    assert idmap.remap(ids, True).undo is None
    assert idmap.remap(ids, False, record_undo=True).undo is None
    empty = idmap.remap(ids[:0], True, record_undo=True)
    assert empty.undo is not None and empty.undo.rows.numel() == 0
